"""Compare the ZeRO-1/2 module's 16-bit weights with the fp32 masters cast the way the engine casts them.

Streams both in bounded chunks (numpy casts, round to nearest even), so memory stays flat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import dtypes
from .torchfile import RecordReader

if TYPE_CHECKING:
    from .reader import TensorSource, ZeroCheckpoint

CHUNK_ELEMS = 4 << 20


def read_range(source: TensorSource, start: int, count: int, reader: RecordReader, out: memoryview) -> None:
    """Elements [start, start + count) of a source (in its stored dtype) into `out`."""
    pos, filled = 0, 0
    item = source.dtype.itemsize
    for seg in source.segments:
        lo, hi = max(start, pos), min(start + count, pos + seg.count)
        if lo < hi:
            base, _ = seg.tensor.byte_span()
            n = hi - lo
            reader.readinto(
                seg.tensor.record, base + (seg.start + lo - pos) * item, out[filled * item : (filled + n) * item]
            )
            filled += n
        pos += seg.count
        if pos >= start + count:
            break


def module_matches_masters(ckpt: ZeroCheckpoint, reader: RecordReader) -> str | None:
    """The first trainable parameter whose stored module copy differs from its cast master, or None."""
    scratch = bytearray(CHUNK_ELEMS * 4)
    cast = bytearray(CHUNK_ELEMS * 4)
    copy = bytearray(CHUNK_ELEMS * 4)
    for param in ckpt.params:
        module = ckpt.bit16.get(param.name)
        if module is None or module.kind != "trainable" or not module.dtype.is_floating_point:
            continue
        if module.numel() != param.numel:
            return param.name
        for start in range(0, param.numel, CHUNK_ELEMS):
            n = min(CHUNK_ELEMS, param.numel - start)
            read_range(param.fp32, start, n, reader, memoryview(scratch))
            nbytes = n * module.dtype.itemsize
            read_range(module, start, n, reader, memoryview(copy))
            if module.dtype == dtypes.FLOAT32:
                same = memoryview(scratch)[: n * 4] == memoryview(copy)[:nbytes]
            else:
                dtypes.cast(scratch, dtypes.FLOAT32, cast, module.dtype, n)
                same = memoryview(cast)[:nbytes] == memoryview(copy)[:nbytes]
            if not same:
                return param.name
    return None

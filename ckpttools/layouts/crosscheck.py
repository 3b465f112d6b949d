"""Compare the ZeRO-1/2 module's 16-bit weights with the fp32 masters cast the way the engine casts them.

Streams both in bounded chunks on a few threads (numpy releases the GIL while it casts and compares), so
memory stays flat and the check keeps up with the disk. Bytes are read with plain `pread` (each file's
`ByteSource`): the CRC-32 of these records is checked by whichever pass writes them, and a damaged record fails
this check anyway.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.source import ByteSource, open_source, read_full
from ckpttools.io.threads import default_workers
from ckpttools.io.torchfile import check_present
from ckpttools.model.checkpoint import Replica, TensorSource, slice_segments

if TYPE_CHECKING:
    from ckpttools.model.checkpoint import Checkpoint

CHUNK_ELEMS = 4 << 20
SAMPLE_ELEMS = 4096


@dataclass(frozen=True)
class _Chunk:
    name: str
    master: TensorSource
    copy: TensorSource
    start: int
    count: int


class OpenFiles:
    """Open byte sources, shared by the worker threads."""

    def __init__(self) -> None:
        self.sources: dict[Path, ByteSource] = {}
        self.lock = threading.Lock()

    def source(self, path: Path) -> ByteSource:
        with self.lock:
            if path not in self.sources:
                self.sources[path] = open_source(path)
            return self.sources[path]

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def read_elements(source: TensorSource, start: int, count: int, files: OpenFiles) -> np.ndarray:
    """Elements [start, start + count) of a source, in its stored dtype, as raw little-endian numbers."""
    item = source.dtype.itemsize
    out = bytearray(count * item)
    view = memoryview(out)
    pos, filled = 0, 0
    for seg in source.segments:
        lo, hi = max(start, pos), min(start + count, pos + seg.count)
        if lo < hi:
            record = seg.tensor.record
            check_present(record)
            base, _ = seg.tensor.byte_span()
            offset = record.offset + base + (seg.start + lo - pos) * item
            want = (hi - lo) * item
            got = read_full(files.source(record.path), offset, view[filled * item : filled * item + want])
            if got != want:
                raise CorruptCheckpointError(f"{record.path} is truncated inside record {record.name}; re-copy it")
            filled += hi - lo
        pos += seg.count
        if pos >= start + count:
            break
    return np.frombuffer(out, dtype=source.dtype.numpy)


def casts_equal(master: np.ndarray, copy: np.ndarray, dtype: DType) -> bool:
    """cast(master) == copy bit for bit, round to nearest even as torch's copy_ does; a NaN master matches any NaN
    copy (the NaN a cast writes differs between torch's CPU and CUDA kernels: 0xffff, 0x7fff, 0x7fc0 in bf16)."""
    if dtype == dtypes.FLOAT32:
        return bool(np.array_equal(master.view(np.uint32), copy.view(np.uint32)))
    cast = bytearray(len(copy) * dtype.itemsize)
    dtypes.cast(master.tobytes(), dtypes.FLOAT32, cast, dtype, len(copy))
    ours = np.frombuffer(cast, dtype=copy.dtype)
    if np.array_equal(ours, copy):
        return True
    differ = ours != copy
    return bool(np.isnan(master[differ]).all() and _is_nan(copy[differ], dtype).all())


def _is_nan(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Which 16-bit values are NaN: exponent all ones, mantissa not zero (bf16: 8+7 bits, fp16: 5+10)."""
    raw = bits.view(np.uint16).astype(np.uint32)
    mantissa_bits = 7 if dtype == dtypes.BFLOAT16 else 10
    exponent = (raw >> mantissa_bits) & ((1 << (15 - mantissa_bits)) - 1)
    nan: np.ndarray = (exponent == (1 << (15 - mantissa_bits)) - 1) & ((raw & ((1 << mantissa_bits) - 1)) != 0)
    return nan


def first_difference(a: TensorSource, b: TensorSource, files: OpenFiles) -> int | None:
    """The first element where two sources' stored bytes differ (None: bit-identical), read chunk by chunk.

    Bytes, not values: NaN payloads and the sign of zero count, as for any copy that must be bit-identical."""
    if (a.dtype, a.numel()) != (b.dtype, b.numel()):
        return 0
    for start in range(0, a.numel(), CHUNK_ELEMS):
        n = min(CHUNK_ELEMS, a.numel() - start)
        x, y = (read_elements(t, start, n, files).view(np.uint8) for t in (a, b))
        if not np.array_equal(x, y):
            return start + int(np.flatnonzero(x != y)[0]) // a.dtype.itemsize
    return None


def _windows(master: TensorSource, full: bool) -> list[tuple[int, int]]:
    """Element ranges to compare: all of it, or both ends of every rank's piece of it.

    A rank file that is swapped, stale or from another run makes its piece of every parameter differ
    throughout, so both ends of each piece sampled catch it; damage inside a piece is the CRC's job.
    """
    numel = sum(seg.count for seg in master.segments)
    if full:
        return [(start, min(CHUNK_ELEMS, numel - start)) for start in range(0, numel, CHUNK_ELEMS)]
    ranges: set[tuple[int, int]] = set()
    pos = 0
    for seg in master.segments:
        n = min(SAMPLE_ELEMS, seg.count)
        if n:
            ranges.add((pos, n))
            ranges.add((pos + seg.count - n, n))
        pos += seg.count
    return sorted(ranges)


def _chunks(ckpt: Checkpoint, full: bool) -> list[_Chunk]:
    chunks = []
    for param in ckpt.params:
        copy = ckpt.bit16.get(param.name)
        if copy is None or copy.kind != "trainable" or not copy.dtype.is_floating_point or copy.dtype.numpy is None:
            continue
        if copy.numel() != param.numel:
            chunks.append(_Chunk(param.name, param.fp32, copy, 0, -1))
            continue
        chunks += [_Chunk(param.name, param.fp32, copy, a, n) for a, n in _windows(param.fp32, full)]
    return chunks


def module_matches_masters(ckpt: Checkpoint, *, full: bool = False, workers: int | None = None) -> str | None:
    """The first trainable parameter whose stored module copy differs from its cast master, or None.

    By default both ends of every rank's piece of every parameter are compared (`SAMPLE_ELEMS` each);
    `full` compares every element.
    """
    chunks = _chunks(ckpt, full)
    if not chunks:
        return None
    files = OpenFiles()

    def check(chunk: _Chunk) -> bool:
        if chunk.count < 0:
            return False
        master = read_elements(chunk.master, chunk.start, chunk.count, files)
        copy = read_elements(chunk.copy, chunk.start, chunk.count, files)
        return casts_equal(master, copy, chunk.copy.dtype)

    workers = workers or default_workers()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-crosscheck")
    try:
        for chunk, same in zip(chunks, pool.map(check, chunks), strict=True):
            if not same:
                return chunk.name
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        files.close()
    return None


def check_module_copies(ckpt: Checkpoint, *, full: bool = False) -> None:
    """ZeRO-1/2 save the module's 16-bit weights beside the fp32 masters; the engine copies the cast masters
    into them after every step, so they must be equal. A swapped, stale or mixed-up optimizer file breaks
    this even when every file is intact. By default both ends of every rank's piece of every parameter are
    compared; `full` compares every element.
    """
    if ckpt.replicas:  # replicated params must agree on every TP rank (ds_to_universal asserts it)
        check_replicas(ckpt, full=full)
    mismatch = module_matches_masters(ckpt, full=full)
    if mismatch is not None:
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: the fp32 master of {mismatch} does not match the module's "
            f"{ckpt.train_dtype.name} copy of it: the optimizer files do not belong with "
            f"{ckpt.location.files.model_files[0]} (files swapped, stale, from another run, or damaged); "
            "re-copy the tag folder"
        )


# --- Replicated tensors (AutoTP): every TP rank's copy must equal the one written ---------------------------


REPLICA_SAMPLE = 4096  # elements compared at each end of every replica by default


def replica_mismatch(ckpt: Checkpoint, *, full: bool = False) -> str | None:
    """The first replicated tensor whose copy on another TP rank differs from the one written (the lowest TP
    rank's), or None. AutoTP keeps replicated parameters (norms, embeddings) identical on every TP rank, as
    ds_to_universal asserts; a copy that differs means a file from another save or run. Reads both ends of every
    replica (a foreign file differs throughout), or every element with `full`; compares bytes, chunk by chunk."""
    files = OpenFiles()
    try:
        for replica in ckpt.replicas:
            for merged, copy in _samples(replica, None if full else REPLICA_SAMPLE):
                if first_difference(merged, copy, files) is not None:
                    return replica.what
    finally:
        files.close()
    return None


def _samples(replica: Replica, n: int | None) -> list[tuple[TensorSource, TensorSource]]:
    total = replica.merged.numel()
    if n is None or total <= 2 * n:
        return [(replica.merged, replica.copy)]
    return [(_part(replica.merged, start, n), _part(replica.copy, start, n)) for start in (0, total - n)]


def _part(src: TensorSource, start: int, count: int) -> TensorSource:
    return TensorSource(src.name, (count,), src.dtype, tuple(slice_segments(src, start, count)), src.kind)


def check_replicas(ckpt: Checkpoint, *, full: bool = False) -> None:
    """Raise CorruptCheckpointError when TP ranks hold different values for a replicated parameter."""
    what = replica_mismatch(ckpt, full=full)
    if what is not None:
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: the replicated tensor {what} differs from TP rank 0's copy: the TP ranks' "
            "files are from different saves or runs (or damaged); re-copy the tag folder"
        )

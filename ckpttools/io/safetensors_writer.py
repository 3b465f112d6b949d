"""Stream tensors from checkpoint shards into safetensors files with bounded memory.

The header is written first (every shape and dtype is known up front), then each tensor's bytes in
order. A background thread reads (and casts) fixed-size chunks while the main thread writes, so at
most a few chunk buffers exist at once, whatever the model size.
"""

from __future__ import annotations

import contextlib
import json
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.segments import ElementSource, Segment
from ckpttools.io.staging import WriteBehind
from ckpttools.io.threads import Workers, resolve_workers
from ckpttools.io.torchfile import ReadAhead, Record, RecordReader
from ckpttools.io.values import NonFiniteCounter

CHUNK_BYTES = 16 << 20
BUFFERS_IN_FLIGHT = 3

ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to write: its name in the file, output dtype and where its values come from."""

    name: str
    source: ElementSource
    dtype: DType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.dtype.itemsize


class HeaderTensor(Protocol):
    """What a safetensors header needs of a tensor: OutputTensor here, the live engine's tensors in engine_save."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


def output_dtype(source: ElementSource, dtype: DType) -> DType:
    """The dtype a tensor is written in (see `written_dtype`)."""
    return written_dtype(source.dtype, source.kind, dtype)


def written_dtype(stored: DType, kind: str, dtype: DType) -> DType:
    """The dtype a tensor stored as `stored` is written in when `dtype` is asked for.

    Integer and bool tensors keep theirs. Floating params take `dtype`. Floating buffers (`kind` "buffer")
    are upcast for fp32 output (as zero_to_fp32 does) but otherwise keep the dtype the engine held them in
    (an fp32 buffer in a bf16 model stays fp32 in the engine's 16-bit state dict), unless that is another
    16-bit type.
    """
    if not stored.is_floating_point:
        return stored
    if kind == "buffer" and dtype is not dtypes.FLOAT32 and stored not in (dtypes.BFLOAT16, dtypes.FLOAT16):
        return stored
    return dtype


def safetensors_header(tensors: Sequence[HeaderTensor], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header, padded to 8 bytes as the safetensors reader expects."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype.safetensors,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _segment_chunks(seg: Segment, chunk_elems: int) -> Iterator[tuple[Segment, int, int]]:
    """(segment, element offset, element count) pieces of at most `chunk_elems`."""
    done = 0
    while done < seg.count:
        n = min(chunk_elems, seg.count - done)
        yield seg, seg.start + done, n
        done += n


def _chunk_plan(tensors: Sequence[OutputTensor], chunk_bytes: int) -> Iterator[tuple[OutputTensor, Segment, int, int]]:
    for t in tensors:
        item = max(t.source.dtype.itemsize, t.dtype.itemsize)
        for seg in t.source.segments:
            for s, start, n in _segment_chunks(seg, max(1, chunk_bytes // item)):
                yield t, s, start, n


def _chunk_owners(tensors: Sequence[OutputTensor], chunk_bytes: int) -> list[int]:
    """The index in `tensors` of each chunk `_chunk_plan` yields, in the same order."""
    owners = []
    for i, t in enumerate(tensors):
        per = max(1, chunk_bytes // max(t.source.dtype.itemsize, t.dtype.itemsize))
        owners += [i] * sum(-(-seg.count // per) for seg in t.source.segments)
    return owners


def _chunk_size(tensors: Sequence[OutputTensor], chunk_bytes: int) -> int:
    """At least one whole element of the widest dtype read or written (8 bytes: int64, float64)."""
    return max(chunk_bytes, *(max(t.source.dtype.itemsize, t.dtype.itemsize) for t in tensors), 8)


def stream_chunks(
    tensors: Sequence[OutputTensor],
    reader: RecordReader,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: Workers | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """Every tensor's bytes in its output dtype, chunk by chunk and in order, as (index in `tensors`, bytes): the
    loop `write_safetensors` writes from, for callers that reduce the values instead (`ckpttools.ops.reduce`).

    A background thread reads (and casts) ahead, so two streams consumed side by side read their sources in
    parallel. A chunk's bytes are valid until the next chunk is asked for; a tensor's chunks split it at no
    particular element (segment boundaries, `chunk_bytes`); a tensor with no elements yields no chunk.
    """
    if not tensors:
        return
    chunk_bytes = _chunk_size(tensors, chunk_bytes)
    yield from zip(_chunk_owners(tensors, chunk_bytes), _ChunkPump(tensors, reader, chunk_bytes, workers),
                   strict=True)  # fmt: skip


def _source_span(seg: Segment, start: int, n: int) -> tuple[Record, int, int]:
    """The bytes of the record that elements [start, start + n) of a segment occupy."""
    item = seg.tensor.dtype.itemsize
    base, _ = seg.tensor.byte_span()
    return seg.tensor.record, base + start * item, n * item


_spare = threading.local()  # within `reused_buffers`: this thread's chunk buffers, kept from file to file


@contextlib.contextmanager
def reused_buffers() -> Iterator[None]:
    """Within the block, each file written on this thread reuses the last file's chunk buffers: allocating and
    zeroing 64 MiB cost about 30 ms a file, once per shard of a sharded output. Freed when the block ends."""
    outer = getattr(_spare, "on", False)
    _spare.on = True
    try:
        yield
    finally:
        _spare.on = outer
        if not outer:
            _spare.buffers = []


def _spare_buffers(count: int, size: int) -> list[bytearray]:
    """`count` buffers of `size` bytes: the last file's (inside `reused_buffers`), or new ones."""
    kept: list[bytearray] = getattr(_spare, "buffers", [])
    _spare.buffers = []  # taken: a second pump at the same time gets its own
    if len(kept) == count and all(len(b) == size for b in kept):
        return kept
    return [bytearray(size) for _ in range(count)]


def _keep_buffers(buffers: list[bytearray]) -> None:
    if getattr(_spare, "on", False):
        _spare.buffers = buffers


class _ChunkPump:
    """Reads and casts chunks on a background thread into a small pool of reusable buffers; each cast is
    split over `workers`' threads."""

    def __init__(self, tensors: Sequence[OutputTensor], reader: RecordReader, chunk_bytes: int,
                 workers: Workers | None = None) -> None:  # fmt: skip
        self.reader, self.workers = reader, workers
        self.buffers = _spare_buffers(BUFFERS_IN_FLIGHT + 1, chunk_bytes)
        self.free: queue.Queue[bytearray] = queue.Queue()
        for buf in self.buffers[:BUFFERS_IN_FLIGHT]:
            self.free.put(buf)
        self.scratch = self.buffers[BUFFERS_IN_FLIGHT]  # source bytes before a cast
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=BUFFERS_IN_FLIGHT)
        self.plan = list(_chunk_plan(tensors, chunk_bytes))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ckpt-reader", daemon=True)

    def _run(self) -> None:
        try:
            read_ahead = ReadAhead(self.reader, [_source_span(seg, start, n) for _, seg, start, n in self.plan])
            for i, (t, seg, start, n) in enumerate(self.plan):
                if self.stop.is_set():
                    return
                read_ahead.before(i)
                buf = self.free.get()
                self.ready.put((buf, self._fill(buf, t, seg, start, n)))
            self.ready.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the writer thread, which re-raises it
            self.ready.put(e)

    def _fill(self, buf: bytearray, t: OutputTensor, seg: Segment, start: int, n: int) -> int:
        record, offset, src_bytes = _source_span(seg, start, n)
        if seg.tensor.dtype == t.dtype:
            self.reader.readinto(record, offset, memoryview(buf)[:src_bytes], self.workers)
            return src_bytes
        self.reader.readinto(record, offset, memoryview(self.scratch)[:src_bytes], self.workers)
        # round-to-nearest-even, as the engine's copy_
        dtypes.cast(self.scratch, seg.tensor.dtype, buf, t.dtype, n, self.workers)
        return n * t.dtype.itemsize

    def __iter__(self) -> Iterator[memoryview]:
        self.thread.start()
        try:
            while True:
                item = self.ready.get()
                if item is None:
                    # the pump is done and the writer holds no chunk: the next file may use these buffers
                    self.thread.join()
                    _keep_buffers(self.buffers)
                    return
                if isinstance(item, BaseException):
                    raise item
                buf, nbytes = item
                yield memoryview(buf)[:nbytes]
                self.free.put(buf)
        finally:
            self.stop.set()
            while self.thread.is_alive():  # unblock the pump if the writer stopped early
                with contextlib.suppress(queue.Empty):
                    self.ready.get_nowait()
                self.free.put(bytearray(0))
                self.thread.join(timeout=0.05)


def write_safetensors(
    path: Path,
    tensors: Sequence[OutputTensor],
    reader: RecordReader,
    *,
    metadata: dict[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: ProgressFn | None = None,
    workers: int | None = None,
    nonfinite: NonFiniteCounter | None = None,
) -> int:
    """Write `tensors` into one safetensors file, streaming from the checkpoint. Returns bytes written.

    Casts run on `workers` threads (default: this process's share of the cores). With `nonfinite`, the NaN and Inf
    of every tensor are counted into it from the very bytes written (no second read).
    """
    chunk_bytes = _chunk_size(tensors, chunk_bytes)
    header = safetensors_header(tensors, metadata or {"format": "pt"})
    owners = _chunk_owners(tensors, chunk_bytes) if nonfinite is not None else []
    written = 0
    with open(path, "wb") as fh, Workers(resolve_workers(workers)) as pool:
        behind = WriteBehind(fh)
        fh.write(header)
        written += len(header)
        for i, chunk in enumerate(_ChunkPump(tensors, reader, chunk_bytes, pool)):
            fh.write(chunk)
            if nonfinite is not None:
                t = tensors[owners[i]]
                nonfinite.add(t.name, t.dtype, chunk)
            behind.wrote()
            written += len(chunk)
            if on_progress:
                on_progress(len(chunk))
        behind.finish()
    return written


def read_tensor(source: ElementSource, reader: RecordReader, dtype: DType | None = None) -> Any:
    """Materialise one source tensor as a torch tensor (for checks, `--to pt` and small tensors)."""
    import torch

    out = torch.empty(source.numel(), dtype=source.dtype.to_torch())
    pos = 0
    for seg in source.segments:
        base, _ = seg.tensor.byte_span()
        isz = seg.tensor.dtype.itemsize
        chunk = bytearray(seg.count * isz)
        reader.readinto(seg.tensor.record, base + seg.start * isz, memoryview(chunk))
        if seg.count:
            out[pos : pos + seg.count] = torch.frombuffer(chunk, dtype=seg.tensor.dtype.to_torch())
        pos += seg.count
    out = out.view(source.shape)
    return out.to(dtype.to_torch()) if dtype is not None and dtype is not source.dtype else out


def write_pt(
    path: Path,
    tensors: Sequence[OutputTensor],
    reader: RecordReader,
    on_progress: ProgressFn | None = None,
    nonfinite: NonFiniteCounter | None = None,
) -> int:
    """Write a `torch.save` state dict (`--to pt`); holds one shard in memory, as torch.save must. With `nonfinite`,
    NaN and Inf are counted per tensor from the values written."""
    import torch

    state = {}
    for t in tensors:
        state[t.name] = read_tensor(t.source, reader, t.dtype)
        if nonfinite is not None and t.dtype.is_floating_point:
            nonfinite.add(t.name, t.dtype, state[t.name].contiguous().reshape(-1).view(torch.uint8).numpy())
        if on_progress:
            on_progress(t.nbytes)
    torch.save(state, path)
    return path.stat().st_size

"""The tensor chunks of a torch DCP folder as stored records, and a whole tensor as segments of its chunks.

torch's FileSystemWriter stores each chunk as a complete `torch.save` zip at (offset, length) of a `.distcp`
file (torch/distributed/checkpoint/filesystem.py `_write_item`). Each one is opened here as a torch file of its
own through a byte range of the `.distcp` source: the same zip reader, allowlisting unpickler and CRC-checked
records as DeepSpeed files, with record offsets counted from the start of the `.distcp` file. A tensor's chunks
are blocks of it (FSDP2 shards dim 0; with tensor parallelism, 2-D blocks); `tensor_segments` cuts them into the
runs that are contiguous in the whole tensor, in row-major order, and checks that they tile it exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

from ckpttools.errors import CkptError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import torchfile
from ckpttools.io.segments import Segment
from ckpttools.io.source import ByteSource, open_source, open_stream, read_full
from ckpttools.io.torchfile import LazyTensor
from ckpttools.layouts.dcp.metadata import Chunk, StoredChunk, TensorEntry
from ckpttools.model.checkpoint import shape_numel

ZIP_MAGIC = b"PK\x03\x04"


class RangeSource:
    """Bytes [offset, offset + length) of another source, as a source of their own (a chunk inside a .distcp)."""

    def __init__(self, source: ByteSource, offset: int, length: int) -> None:
        self.source, self.offset, self.length = source, offset, length
        self.name = f"{source.name}@{offset}+{length}"

    def size(self) -> int:
        return self.length

    def read_into(self, offset: int, buffer: memoryview) -> int:
        n = max(0, min(len(buffer), self.length - offset))
        return self.source.read_into(self.offset + offset, buffer[:n]) if n else 0

    def advise(self, offset: int, nbytes: int) -> None:
        self.source.advise(self.offset + offset, nbytes)

    def close(self) -> None:
        pass  # the outer source is its opener's to close


class ChunkFiles:
    """The `.distcp` files of one folder, opened once each, with their sizes."""

    def __init__(self, folder: Path, names: set[str]) -> None:
        self.folder, self.names = folder, names
        self._open: dict[str, ByteSource] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()  # chunks are opened from several threads

    def source(self, stored: StoredChunk, fqn: str) -> ByteSource:
        name = stored.relative_path
        with self._lock:
            if name not in self._open:
                if name not in self.names:
                    raise CorruptCheckpointError(
                        f"{self.folder / name} is missing ({fqn!r} is stored there): a rank's file was not saved or "
                        "not copied; copy the whole checkpoint folder"
                    )
                self._open[name] = open_source(self.folder / name)
                self._sizes[name] = self._open[name].size()
        if stored.offset + stored.length > self._sizes[name]:
            raise CorruptCheckpointError(
                f"{self.folder / name} is truncated: {fqn!r} needs bytes {stored.offset}-"
                f"{stored.offset + stored.length} but the file holds {self._sizes[name]}; re-copy it from the source"
            )
        return self._open[name]

    def check_sizes(self, ends: dict[str, int]) -> None:
        """Every file at least as long as `.metadata` says (the optimizer's chunks too, though never read here):
        a file cut short is a save or copy that did not finish, whichever bytes it lost."""
        for name, end in sorted(ends.items()):
            if name not in self.names:
                raise CorruptCheckpointError(
                    f"{self.folder / name} is missing (.metadata places saved data there): a rank's file was not "
                    "saved or not copied; copy the whole checkpoint folder"
                )
            size = self._size(name)
            if size < end:
                raise CorruptCheckpointError(
                    f"{self.folder / name} is truncated: .metadata places saved data up to byte {end} but the file "
                    f"holds {size}; re-copy it from the source"
                )

    def _size(self, name: str) -> int:
        if name not in self._sizes:
            with contextlib.closing(open_source(self.folder / name)) as source:
                self._sizes[name] = source.size()
        return self._sizes[name]

    def close(self) -> None:
        for source in self._open.values():
            source.close()
        self._open.clear()


def chunk_tensor(files: ChunkFiles, entry: TensorEntry, chunk: Chunk) -> LazyTensor:
    """The stored tensor of one chunk, checked against what `.metadata` says of it."""
    stored = chunk.stored
    if stored.transforms:
        raise UnsupportedCheckpointError(
            f"{files.folder / stored.relative_path}: {entry.fqn!r} was saved through stream transforms "
            f"({', '.join(stored.transforms)}); only plain torch.save chunks are read: re-save without extensions"
        )
    source = files.source(stored, entry.fqn)
    where = Path(f"{files.folder / stored.relative_path}")
    tensor = _load_embedded(source, stored, where, entry.fqn)
    if tensor.dtype is not entry.dtype or tensor.shape != chunk.sizes:
        raise CorruptCheckpointError(
            f"{where}: the chunk of {entry.fqn!r} at {list(chunk.offsets)} holds {tensor.dtype.name} "
            f"{list(tensor.shape)}, but .metadata says {entry.dtype.name} {list(chunk.sizes)}; files from "
            "different saves were mixed"
        )
    if not tensor.is_contiguous():
        raise UnsupportedCheckpointError(f"{where}: the chunk of {entry.fqn!r} is stored non-contiguous")
    tensor.check_bounds()
    return tensor


class WindowedSource(RangeSource):
    """A chunk's byte range whose first and last few KiB are read once, up front: a torch.save zip of one
    tensor keeps everything but the tensor's bytes there (local headers and data.pkl first, the central directory
    last), so its zip structure parses from two reads instead of a dozen small ones (each a GET on remote
    storage). Reads outside the windows go to the source as before."""

    HEAD = 16 << 10  # local headers and data.pkl, plus the 8 KiB block a buffered stream reads from the last one
    TAIL = 8 << 10  # central directory and end records (a few hundred bytes for one tensor)

    def __init__(self, source: ByteSource, offset: int, length: int) -> None:
        super().__init__(source, offset, length)
        head_len = min(length, self.HEAD)
        self.head = self._fetch(0, head_len)
        tail_start = max(head_len, length - self.TAIL)
        self.tail_start, self.tail = tail_start, self._fetch(tail_start, length - tail_start)

    def _fetch(self, start: int, n: int) -> bytes:
        buf = bytearray(n)
        got = read_full(self.source, self.offset + start, memoryview(buf)) if n else 0
        return bytes(buf[:got])

    def read_into(self, offset: int, buffer: memoryview) -> int:
        n = max(0, min(len(buffer), self.length - offset))  # readers ask past the end (a buffered stream's block)
        end = offset + n
        if end <= len(self.head):
            buffer[:n] = self.head[offset:end]
            return n
        if offset >= self.tail_start and end <= self.tail_start + len(self.tail):
            buffer[:n] = self.tail[offset - self.tail_start : end - self.tail_start]
            return n
        return super().read_into(offset, buffer)


def _load_embedded(source: ByteSource, stored: StoredChunk, where: Path, fqn: str) -> LazyTensor:
    """Unpickle the torch.save zip at the chunk's byte range (allowlist, CRC-checked records)."""
    part = WindowedSource(source, stored.offset, stored.length)
    if part.head[:4] != ZIP_MAGIC:
        raise UnsupportedCheckpointError(
            f"{where}: the chunk of {fqn!r} is not a torch.save record (safetensors-serialized or transformed DCP "
            "files are not read yet)"
        )
    try:
        with contextlib.closing(part), open_stream(part) as fh:
            data, records, _ = torchfile._read_zip(where, fh)
    except CkptError:
        raise
    except Exception as e:  # zipfile raises many kinds on damaged input
        raise CorruptCheckpointError(f"{where}: the chunk of {fqn!r} is damaged ({type(e).__name__}: "
                                     f"{short(e, 80)}); re-copy the file") from e  # fmt: skip
    # offsets counted from the .distcp file's start; names made unique in it (every chunk's zip has archive/data/0),
    # since readers key a record's CRC check by (file, name)
    shifted = {
        k: dataclasses.replace(r, offset=r.offset + stored.offset, name=f"{r.name}@{stored.offset}")
        for k, r in records.items()
    }
    for rec in shifted.values():
        if rec.offset + rec.nbytes > stored.offset + stored.length:
            raise CorruptCheckpointError(f"{where}: the chunk of {fqn!r} runs past its byte range; re-copy the file")
    unpickler = torchfile._AllowlistUnpickler(data, shifted, where)
    try:
        obj = unpickler.load()
    except CkptError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: cannot read the chunk of {fqn!r} ({type(e).__name__})") from e
    if not isinstance(obj, LazyTensor):
        raise CorruptCheckpointError(f"{where}: the chunk of {fqn!r} holds a {type(obj).__name__}, not a tensor")
    return obj


def tensor_segments(entry: TensorEntry, tensors: list[LazyTensor]) -> tuple[Segment, ...]:
    """The whole tensor, row-major, as segments of its chunks' stored tensors (one per chunk for dim-0 shards).

    Raises CorruptCheckpointError unless the chunks cover every element exactly once.
    """
    pieces = sorted(
        ((start, seg) for chunk, tensor in zip(entry.chunks, tensors, strict=True)
         for start, seg in _runs(entry.size, chunk, tensor)),
        key=lambda piece: piece[0],
    )  # fmt: skip
    out, pos = [], 0
    for start, seg in pieces:
        if start != pos:
            what = "overlap" if start < pos else f"leave elements {pos}-{start - 1} uncovered"
            raise CorruptCheckpointError(
                f"the chunks of {entry.fqn!r} {what} (tensor {list(entry.size)}); the metadata is damaged or files "
                "from different saves were mixed"
            )
        out.append(seg)
        pos += seg.count
    if pos != shape_numel(entry.size):
        raise CorruptCheckpointError(
            f"the chunks of {entry.fqn!r} hold {pos} of its {shape_numel(entry.size)} elements; the save was incomplete"
        )
    return _merged(out)


def _runs(size: tuple[int, ...], chunk: Chunk, tensor: LazyTensor) -> Iterator[tuple[int, Segment]]:
    """(flat start in the whole tensor, segment) for each run of the chunk contiguous in both."""
    if not size:
        yield 0, Segment(tensor, 0, 1)
        return
    if 0 in chunk.sizes:
        return
    strides = contiguous_strides(size)
    # the last dimension the chunk does not span whole: runs are chunk.sizes[k] rows of the dims after it
    k = max((d for d in range(len(size)) if chunk.sizes[d] != size[d]), default=0)
    run = chunk.sizes[k] * strides[k]
    outer = chunk.sizes[:k]
    chunk_strides = contiguous_strides(chunk.sizes)
    for index in _indices(outer):
        start = sum((chunk.offsets[d] + i) * strides[d] for d, i in enumerate(index)) + chunk.offsets[k] * strides[k]
        local = sum(i * chunk_strides[d] for d, i in enumerate(index))
        yield start, Segment(tensor, local, run)


def _merged(segments: list[Segment]) -> tuple[Segment, ...]:
    """Adjacent runs of the same stored tensor, joined (a chunk spanning whole rows is one segment)."""
    out: list[Segment] = []
    for seg in segments:
        prev = out[-1] if out else None
        if prev is not None and prev.tensor is seg.tensor and prev.start + prev.count == seg.start:
            out[-1] = Segment(seg.tensor, prev.start, prev.count + seg.count)
        else:
            out.append(seg)
    return tuple(out)


def contiguous_strides(size: tuple[int, ...]) -> list[int]:
    strides, acc = [0] * len(size), 1
    for d in range(len(size) - 1, -1, -1):
        strides[d], acc = acc, acc * size[d]
    return strides


def _indices(dims: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i, *rest)

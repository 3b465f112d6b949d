"""Write `torch.save` files by streaming tensor bytes from other checkpoint files.

`torch.save` needs every tensor in memory at once; a resharded rank file can be many GB. Here the
pickle is written first (tensors reduced to storage references, as torch does), then each storage
record is streamed in fixed-size chunks from its sources, 64-byte aligned like torch's own writer,
with the reads running on a second thread ahead of the writes. The pickle is written opcode for
opcode as `torch.save` writes it, naming torch's and DeepSpeed's real classes without importing
either: a DeepSpeed file read and written back unchanged has the same `data.pkl` bytes. The one
deliberate difference: storages are always located on "cpu", so no `map_location` is needed.
The result loads with `torch.load` (mmap included) and with DeepSpeed.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.segments import ElementSource
from ckpttools.io.staging import WriteBehind
from ckpttools.io.threads import Workers, resolve_workers
from ckpttools.io.torchfile import (
    DEEPSPEED_STUBS,
    LazyTensor,
    PickledObject,
    ReadAhead,
    Record,
    RecordReader,
    TorchDevice,
    TorchSize,
    ZeroStageEnum,
)

ProgressFn = Callable[[int], None]
ALIGNMENT = 64
CHUNK_BYTES = 16 << 20
BUFFERS_IN_FLIGHT = 4

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(frozen=True)
class Fill:
    """`count` zero elements (ZeRO padding)."""

    count: int


@dataclass(frozen=True)
class Slice:
    """`count` elements from element `start` of a stored tensor, read flat."""

    tensor: LazyTensor
    start: int
    count: int


@dataclass(frozen=True, eq=False)
class NewTensor:
    """A 1-D tensor assembled from slices of stored tensors and zero fills, written as its own storage."""

    dtype: DType
    pieces: tuple[Slice | Fill, ...]
    shape: tuple[int, ...] | None = None  # default: 1-D
    requires_grad: bool = False  # pickled as torch does; DeepSpeed saves its fp32 master partitions with it set

    def numel(self) -> int:
        return sum(p.count for p in self.pieces)

    def view_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (self.numel(),)


class _StorageTable:
    """Assigns storage keys in pickling order; a stored record keeps one key however many views use it."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Record | NewTensor, DType, int]] = []
        self._by_record: dict[tuple[Path, str], str] = {}

    def key_for_record(self, record: Record, dtype: DType) -> str:
        ident = (record.path, record.name)
        if ident not in self._by_record:
            self._by_record[ident] = str(len(self.entries))
            self.entries.append((self._by_record[ident], record, dtype, record.nbytes // dtype.itemsize))
        return self._by_record[ident]

    def key_for_new(self, tensor: NewTensor) -> str:
        key = str(len(self.entries))
        self.entries.append((key, tensor, tensor.dtype, tensor.numel()))
        return key


class _StorageRef:
    def __init__(self, key: str, dtype: DType, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Global:
    """A class or function the pickle names by module and name (a GLOBAL opcode), never imported here."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce insists that reduce functions are callable
        raise TypeError(f"{self.module}.{self.name} is only named, not loaded")


_GLOBALS: dict[tuple[str, str], _Global] = {}


def _global(module: str, name: str) -> _Global:
    """One marker per name, so the pickle memoizes it as torch.save's pickles do."""
    return _GLOBALS.setdefault((module, name), _Global(module, name))


_STORAGE_CLASS = {dtype: name for name, dtype in dtypes.BY_STORAGE.items()}
_REBUILD_TENSOR = _global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_FROM_TYPE = _global("torch._tensor", "_rebuild_from_type_v2")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


class _Pickler(pickle._Pickler):
    """Pickles as `torch.save` does (protocol 2, storages as persistent ids) without importing torch.

    torch and DeepSpeed objects (tensors, dtypes, torch.Size, the loss scaler, ZeroStageEnum) are written
    as the opcodes their own reductions produce, naming the real classes, so `torch.load` and DeepSpeed
    get their own objects back and no stand-in class reaches a file. The pure-Python pickler is used
    because only it lets a GLOBAL be written for a class that is not imported.
    """

    # typeshed types the table's functions as taking an Unpickler; they take the pickler itself
    dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]] = dict(pickle._Pickler.dispatch)
    # the pure-Python pickler's internals used below, which typeshed leaves out
    write: Callable[[bytes], object]
    if TYPE_CHECKING:

        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...
        def memoize(self, obj: Any) -> None: ...

    def __init__(self, file: Any, table: _StorageTable) -> None:
        super().__init__(file, protocol=2)
        self.table = table

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", _global("torch", _STORAGE_CLASS[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, LazyTensor):
            key = self.table.key_for_record(obj.record, obj.dtype)
            ref = _StorageRef(key, obj.dtype, obj.record.nbytes // obj.dtype.itemsize)
            hooks: OrderedDict[str, Any] = OrderedDict()  # backward hooks: none, as torch.save writes them
            args = (ref, obj.storage_offset, tuple(obj.shape), tuple(obj.stride), obj.requires_grad, hooks)
            if obj.attrs:  # a tensor with Python attributes (ZeRO-3's `ds_id`): Tensor.__reduce_ex__'s other form
                return _REBUILD_FROM_TYPE, (_REBUILD_TENSOR, _global("torch", "Tensor"), args, dict(obj.attrs))
            return _REBUILD_TENSOR, args
        if isinstance(obj, NewTensor):
            ref = _StorageRef(self.table.key_for_new(obj), obj.dtype, obj.numel())
            shape = obj.view_shape()
            return _REBUILD_TENSOR, (ref, 0, shape, _contiguous_strides(shape), obj.requires_grad, OrderedDict())
        if isinstance(obj, ZeroStageEnum):  # Enum.__reduce_ex__: the class called with the value
            return _global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (int(obj),)
        if isinstance(obj, TorchSize):
            return _global("torch", "Size"), (tuple(obj),)
        if isinstance(obj, TorchDevice):
            return _global("torch", "device"), tuple(obj)
        return NotImplemented

    def save_named_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def save_dtype(self, obj: DType) -> None:  # torch.dtype reduces to its name in module torch
        self.save(_global("torch", obj.name))

    def save_object(self, obj: PickledObject) -> None:
        """A plain object as protocol 2 writes it: cls.__new__(cls), then its __dict__ (NEWOBJ, BUILD)."""
        module, name = obj.qualname.rsplit(".", 1)
        self.save(_global(module, name))
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save({k: v for k, v in obj.__dict__.items() if k != "args"})
        self.write(pickle.BUILD)

    dispatch[_Global] = save_named_global
    dispatch[DType] = save_dtype
    for _stub in DEEPSPEED_STUBS.values():
        if isinstance(_stub, type) and issubclass(_stub, PickledObject):
            dispatch[_stub] = save_object
    del _stub


def _pickle(obj: Any, table: _StorageTable) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, table).dump(obj)
    return buf.getvalue()


def _aligned_info(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose data starts on a 64-byte boundary (padding in an extra field, as torch does)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule for adding the zip64 field
    header = 30 + len(name.encode()) + (20 if zip64 else 0)
    assert zf.fp is not None, "the archive is open for writing"
    start = zf.fp.tell() + header + 4  # 4: the padding field's own id and length
    pad = -start % ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return info


def _write_record(zf: zipfile.ZipFile, name: str, size: int, chunks: Iterator[memoryview] | bytes,
                  after_chunk: ProgressFn | None = None) -> None:  # fmt: skip
    info = _aligned_info(zf, name, size)
    with zf.open(info, "w") as out:
        if isinstance(chunks, bytes):
            out.write(chunks)
            return
        left = size
        while left:
            view = next(chunks)
            out.write(view)
            left -= len(view)
            if after_chunk:
                after_chunk(len(view))


# A read of `nbytes` bytes of `record` from byte `start`, or (record None) `nbytes` zero bytes; with a cast
# (source dtype, storage dtype), the bytes read are converted, so the op yields nbytes / src.itemsize elements.
_Op = tuple[Record | None, int, int, tuple[DType, DType] | None]


def _op_out_bytes(op: _Op) -> int:
    _, _, nbytes, cast = op
    return nbytes if cast is None else nbytes // cast[0].itemsize * cast[1].itemsize


def _storage_ops(source: Record | NewTensor, chunk_bytes: int) -> Iterator[_Op]:
    """The reads and zero fills, at most `chunk_bytes` in and out each, that produce one storage record's bytes.

    A slice of another dtype than its tensor is cast (round to nearest even, as torch's `.to()`): a 16-bit
    module weight written from its fp32 master.
    """
    if isinstance(source, NewTensor):
        item = source.dtype.itemsize
        spans: list[_Op] = []
        for piece in source.pieces:
            if isinstance(piece, Fill):
                spans.append((None, 0, piece.count * item, None))
                continue
            src = piece.tensor.dtype
            cast = None if src == source.dtype else (src, source.dtype)
            if cast is not None and (src.numpy is None or source.dtype.numpy is None):
                raise ValueError(f"cannot cast {src} to {source.dtype}")
            base, _ = piece.tensor.byte_span()
            spans.append((piece.tensor.record, base + piece.start * src.itemsize, piece.count * src.itemsize, cast))
    else:
        spans = [(source, 0, source.nbytes, None)]
    for record, start, nbytes, cast in spans:
        step = (
            chunk_bytes if cast is None else chunk_bytes // max(cast[0].itemsize, cast[1].itemsize) * cast[0].itemsize
        )
        for pos in range(0, nbytes, step):
            yield record, start + pos, min(step, nbytes - pos), cast


@dataclass
class _PlannedFile:
    path: Path
    data_pkl: bytes
    storages: list[tuple[str, int, list[_Op]]]  # (key, nbytes, ops)

    @property
    def stem(self) -> str:
        """The archive's top folder, named after the file as torch.save names it."""
        return self.path.stem or "archive"


def _plan_file(path: Path, obj: Any, chunk_bytes: int) -> _PlannedFile:
    table = _StorageTable()
    data_pkl = _pickle(obj, table)
    storages = [(key, numel * dtype.itemsize, list(_storage_ops(source, chunk_bytes)))
                for key, source, dtype, numel in table.entries]  # fmt: skip
    return _PlannedFile(Path(path), data_pkl, storages)


class _ReadPump:
    """Performs the reads of all planned files on a background thread, a few buffers ahead of the writer.

    Reads (with their CRC-32 checks) and writes (with zipfile's CRC-32) then run at the same time, and
    the kernel reads ahead of both, so slices spread over many rank files arrive in parallel. Zero fills
    share one read-only buffer.
    """

    def __init__(self, ops: list[_Op], reader: RecordReader, chunk_bytes: int, workers: Workers | None = None) -> None:
        self.ops, self.reader, self.workers = ops, reader, workers
        self.zeros = memoryview(bytes(chunk_bytes))
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(BUFFERS_IN_FLIGHT):
            self.free.put(bytearray(chunk_bytes))
        self.ready: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ckpt-reader", daemon=True)
        self._held: bytearray | None = None

    def _run(self) -> None:
        try:
            read_ahead = ReadAhead(self.reader, [(r, s, n) for r, s, n, _ in self.ops])
            scratch: bytearray | None = None
            for i, (record, start, nbytes, cast) in enumerate(self.ops):
                read_ahead.before(i)
                if record is None:
                    self.ready.put((None, self.zeros[:nbytes]))
                    continue
                buf = self.free.get()
                if self.stop.is_set():
                    return
                if cast is None:
                    view = memoryview(buf)[:nbytes]
                    self.reader.readinto(record, start, view, self.workers)
                else:
                    scratch = scratch if scratch is not None else bytearray(len(buf))
                    self.reader.readinto(record, start, memoryview(scratch)[:nbytes], self.workers)
                    count = nbytes // cast[0].itemsize
                    view = memoryview(buf)[: count * cast[1].itemsize]
                    dtypes.cast(scratch, cast[0], view, cast[1], count, self.workers)
                self.ready.put((buf, view))
        except BaseException as e:  # noqa: BLE001 - handed to the writer, which re-raises it
            self.ready.put((None, e))

    def chunks(self) -> Iterator[memoryview]:
        """The bytes of every op, in order; each view is valid until the next one is taken."""
        while True:
            if self._held is not None:
                self.free.put(self._held)
                self._held = None
            buf, item = self.ready.get()
            if isinstance(item, BaseException):
                raise item
            self._held = buf
            yield item

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for _ in range(BUFFERS_IN_FLIGHT + 1):  # wake the pump if it waits for a buffer
            self.free.put(bytearray(0))
        self.thread.join()


def write_torch_files(files: Sequence[tuple[Path, Any]], reader: RecordReader, *, chunk_bytes: int = CHUNK_BYTES,
                      on_start: ProgressFn | None = None, on_progress: ProgressFn | None = None,
                      workers: int | None = None) -> int:  # fmt: skip
    """Write each `(path, obj)` (plain containers, LazyTensors, NewTensors, DeepSpeed stand-ins) as a
    `torch.save` file, in one pass whose reads run ahead of its writes. Returns the bytes written.

    Casts (16-bit weights from fp32 masters) run on `workers` threads (default: this process's share of the cores).

    `on_start` gets the number of tensor bytes to write, `on_progress` the bytes of each chunk written.
    """
    plans = [_plan_file(path, obj, chunk_bytes) for path, obj in files]
    ops = [op for plan in plans for _, _, storage_ops in plan.storages for op in storage_ops]
    if on_start:
        on_start(sum(_op_out_bytes(op) for op in ops))
    written = 0
    with Workers(resolve_workers(workers)) as pool, _ReadPump(ops, reader, chunk_bytes, pool) as pump:
        chunks = pump.chunks()
        for plan in plans:
            _write_planned(plan, chunks, on_progress)
            written += plan.path.stat().st_size
    return written


def _write_planned(plan: _PlannedFile, chunks: Iterator[memoryview], on_progress: ProgressFn | None) -> None:
    stem = plan.stem
    with zipfile.ZipFile(plan.path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        assert zf.fp is not None, "the archive is open for writing"
        behind = WriteBehind(zf.fp)

        def after_chunk(n: int) -> None:
            behind.wrote()
            if on_progress:
                on_progress(n)

        for name, payload in ((f"{stem}/data.pkl", plan.data_pkl), (f"{stem}/.format_version", b"1"),
                              (f"{stem}/.storage_alignment", b"64"), (f"{stem}/byteorder", b"little")):  # fmt: skip
            _write_record(zf, name, len(payload), payload)
        for key, nbytes, _ in plan.storages:
            _write_record(zf, f"{stem}/data/{key}", nbytes, chunks, after_chunk)
        _write_record(zf, f"{stem}/version", 2, b"3\n")
        _write_record(zf, f"{stem}/.data/serialization_id", 16, os.urandom(8).hex().encode())
        behind.finish()  # the central directory that close() adds is small


def write_torch_file(path: Path, obj: Any, reader: RecordReader) -> int:
    """Write one object as a `torch.save` file (see `write_torch_files`)."""
    return write_torch_files([(path, obj)], reader)


def whole_tensor(src: ElementSource, shape: tuple[int, ...] | None = None, dtype: DType | None = None) -> NewTensor:
    """A tensor written whole from its source (1-D unless `shape`), cast to `dtype` when given."""
    pieces = tuple(Slice(s.tensor, s.start, s.count) for s in src.segments)
    return NewTensor(dtype or src.dtype, pieces, shape)

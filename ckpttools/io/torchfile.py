"""Read `torch.save` zip files safely and lazily.

The pickle goes through an explicit allowlist (the same classes `torch.load(weights_only=True)`
accepts, plus stand-ins for the three DeepSpeed classes found in ZeRO checkpoints), so no pickled
code ever runs and DeepSpeed need not be installed. Tensors come back as `LazyTensor`s: a record
of the zip archive plus a view into it. Bytes are read only on request, with `pread` into caller
buffers (nothing stays mapped, so resident memory stays bounded), and every record that is read
is checked against the CRC-32 the zip format stores for it.

Files in torch's legacy (non-zip) format (see `legacyfile`) are read the same way: their records are the raw
storages after the pickles, located by walking the 8-byte element counts. That format stores no checksum, so their
records carry none (`Record.crc32` is None) and are checked for structure only when the file is opened.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
import struct
import threading
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from ckpttools.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import dtypes, legacyfile, pickles
from ckpttools.io.crc import crc32, crc32_combine
from ckpttools.io.dtypes import DType
from ckpttools.io.source import ByteSource, open_source, open_stream, read_full

if TYPE_CHECKING:
    from ckpttools.io.threads import Workers

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header, 30 bytes


# --- Stand-ins for the DeepSpeed classes inside ZeRO checkpoints -----------------------------------


class ZeroStageEnum(int, enum.Enum):
    """Stands in for `deepspeed.runtime.zero.config.ZeroStageEnum` (compared numerically everywhere)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class PickledObject:
    """Stands in for a plain DeepSpeed object (loss scaler, fragment address): its attributes only."""

    qualname = "object"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        attrs = {k: v for k, v in self.__dict__.items() if k != "args"}
        return f"{self.qualname}({attrs})"


def _stub(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[1], (PickledObject,), {"qualname": qualname})


DEEPSPEED_STUBS: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
}
for _qual in (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",  # Megatron-DeepSpeed stores its args
):
    _mod, _name = _qual.rsplit(".", 1)
    DEEPSPEED_STUBS[(_mod, _name)] = _stub(_qual)


class TorchSize(tuple[int, ...]):
    """A `torch.Size` read from a pickle (a tuple; kept distinct so it is written back as torch.Size)."""


class TorchDevice(tuple[Any, ...]):
    """A `torch.device(...)` read from a pickle: its constructor arguments."""


# --- Records and lazy tensors -----------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One stored storage: where its bytes lie in the file and their CRC-32 (None in a legacy file, which stores
    none: its records are checked for structure when the file is opened, see `legacyfile.storage_spans`)."""

    path: Path
    name: str
    offset: int
    nbytes: int
    crc32: int | None


# Records whose bytes are not on this machine: holes in a node-local checkpoint's gathered copy (see nodelocal).
# Reading one is a bug, and fails instead of returning zeros.
_ABSENT: dict[str, set[str]] = {}


def mark_absent(path: Path, names: Iterable[str]) -> None:
    _ABSENT.setdefault(os.path.abspath(path), set()).update(names)


def mark_present(path: Path, names: Iterable[str]) -> None:
    _ABSENT.get(os.path.abspath(path), set()).difference_update(names)


def forget_absent(folder: Path) -> None:
    """Drop the marks of every file under `folder` (the gathered copy is gone)."""
    prefix = os.path.abspath(folder) + os.sep
    for key in [k for k in _ABSENT if k.startswith(prefix)]:
        del _ABSENT[key]


def absent_records() -> set[tuple[str, str]]:
    return {(path, name) for path, names in _ABSENT.items() for name in names}


def check_present(record: Record) -> None:
    if _ABSENT and record.name in _ABSENT.get(os.path.abspath(record.path), ()):
        raise RuntimeError(
            f"{record.path}: record {record.name} was read but never fetched from the rank that holds it"
        )


def storage_records(path: Path) -> list[Record]:
    """The storage records of a torch.save zip (no unpickling), or of a legacy file (its pickle read through the
    allowlist for the storages' element sizes)."""
    with contextlib.closing(open_source(path)) as source, open_stream(source) as fh:
        if _is_legacy(fh):
            return list(_read_legacy(Path(path), source, fh)[1].values())
        return list(_read_zip(Path(path), fh)[1].values())


@dataclass(frozen=True)
class StorageRef:
    record: Record
    dtype: DType


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor described by its storage record and view, not yet read."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    requires_grad: bool = False  # as pickled (DeepSpeed's fp32 master partitions have it set)

    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    @property
    def record(self) -> Record:
        return self.storage.record

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_span(self) -> tuple[int, int]:
        """(start, length) within the record of the bytes this view touches."""
        if self.numel() == 0:
            return self.storage_offset * self.itemsize, 0
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        return self.storage_offset * self.itemsize, extent * self.itemsize

    def check_bounds(self) -> None:
        start, length = self.byte_span()
        if start + length > self.record.nbytes:
            raise CorruptCheckpointError(
                f"{self.record.path}: tensor in record {self.record.name} needs {start + length} bytes "
                f"but the record holds {self.record.nbytes}; the file is damaged, re-copy it from the source"
            )

    def load(self, reader: RecordReader) -> Any:
        """Read the tensor into a fresh torch tensor (small tensors: buffers, fragments, scalars)."""
        import torch

        start, length = self.byte_span()
        raw = bytearray(length)
        reader.readinto(self.record, start, memoryview(raw))
        dtype = self.dtype.to_torch()
        if length == 0:
            return torch.empty(self.shape, dtype=dtype)
        flat = torch.frombuffer(raw, dtype=dtype)
        return flat.view(self.shape) if self.is_contiguous() else flat.as_strided(self.shape, self.stride).clone()


# --- The allowlisting unpickler -----------------------------------------------------------------------


def _rebuild_tensor(
    storage: StorageRef, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False, *_: Any
) -> LazyTensor:
    if not isinstance(storage, StorageRef):
        raise UnsafeCheckpointError("tensor rebuilt from something that is not a stored storage")
    if not _is_count(storage_offset) or not _is_dims(size) or not _is_dims(stride) or len(size) != len(stride):
        raise CorruptCheckpointError(
            f"{storage.record.path}: a tensor of record {storage.record.name} has an impossible view "
            f"(offset {short(storage_offset, 20)}, size {short(size, 40)}, stride {short(stride, 40)}); "
            "the file is damaged"
        )
    dims = tuple(int(s) for s in size)
    return LazyTensor(
        storage, int(storage_offset), dims, tuple(int(s) for s in stride), requires_grad=requires_grad is True
    )


def _torch_size(dims: Any) -> TorchSize:
    """torch.Size accepts only non-negative ints; so do we (a damaged pickle must not carry anything else on)."""
    if not _is_dims(dims):
        raise CorruptCheckpointError(f"a torch.Size holds {short(dims)}, not sizes: the file is damaged")
    return TorchSize(dims)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _is_dims(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) <= 64 and all(_is_count(v) for v in value)


def _rebuild_from_type(func: Any, _type: Any, args: tuple[Any, ...], state: Any) -> Any:
    tensor = func(*args)
    if isinstance(tensor, LazyTensor) and isinstance(state, dict):
        tensor.attrs.update(state)  # e.g. DeepSpeed's `ds_id` on ZeRO-3 flat groups
    return tensor


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _dtype_of_storage(name: str) -> Any:
    return ("storage_type", dtypes.BY_STORAGE[name])


_TORCH_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): "tensor_type",
    ("torch.nn.parameter", "Parameter"): "tensor_type",
    ("torch", "Size"): lambda dims=(): _torch_size(dims),
    ("torch", "device"): lambda *args: TorchDevice(args),
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): lambda s, enc="utf-8": s.encode(enc),  # protocol 2 stores bytes this way
}


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(
        self, data: bytes, records: dict[str, Record], path: Path, *, label: str = "data/",
        extra_globals: Mapping[tuple[str, str], Any] | None = None, walked: bool = False,
    ) -> None:  # fmt: skip
        """`label`: what messages put before a storage key (a zip's records are `data/<key>`). `extra_globals`:
        more allowed names, asked first (a reader's stand-ins for the classes of its format, e.g. DTensor).
        `walked`: `data` has been through `pickles.walk` already (legacy files are walked to find the pickle's end).

        Raises CorruptCheckpointError when a memo index would make the unpickler allocate by its value (`pickles`)."""
        import io

        if not walked:
            pickles.check(data, path)
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.records = records
        self.path = path
        self.label = label
        self.extra_globals = extra_globals or {}
        self.used: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self.extra_globals:
            return self.extra_globals[key]
        if key in _TORCH_GLOBALS:
            return _TORCH_GLOBALS[key]
        if key in DEEPSPEED_STUBS:
            return DEEPSPEED_STUBS[key]
        if module == "torch" and name in dtypes.BY_STORAGE:
            return _dtype_of_storage(name)
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]  # a dtype value, e.g. DynamicLossScaler.dtype
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to unpickle '{module}.{name}', which is not a tensor or DeepSpeed "
            "checkpoint class; ckpttools never runs code from checkpoint files"
        )

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{self.path}: unexpected persistent id {short(pid, 80)}")
        storage_type, key = pid[1], str(pid[2])
        if not (isinstance(storage_type, tuple) and storage_type[0] == "storage_type"):
            raise UnsafeCheckpointError(f"{self.path}: unexpected storage type {short(storage_type, 80)}")
        record = self.records.get(key)
        if record is None:
            raise CorruptCheckpointError(
                f"{self.path}: storage record {self.label}{key} is missing; the file is damaged"
            )
        dtype, numel = storage_type[1], pid[4]
        if not _is_count(numel) or numel * dtype.itemsize != record.nbytes:
            raise CorruptCheckpointError(
                f"{self.path}: storage {self.label}{key} is declared as {short(numel)} {dtype.name} elements but its "
                f"record holds {record.nbytes} bytes; the file is damaged"
            )
        self.used.add(key)
        return StorageRef(record, dtype)


# --- Opening files -----------------------------------------------------------------------------------


def _data_offset(fh: Any, info: zipfile.ZipInfo) -> int:
    fh.seek(info.header_offset)
    header = fh.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename}")
    fields = _LOCAL_HEADER.unpack(header)
    name_len, extra_len = int(fields[-2]), int(fields[-1])
    return int(info.header_offset) + _LOCAL_HEADER.size + name_len + extra_len


GENERIC_ARCHIVE = "archive"  # torch.save to a file object (not a path) names its archive folder so


def load_pickle(
    path: Path, *, check_identity: bool = True, extra_globals: Mapping[tuple[str, str], Any] | None = None
) -> Any:
    """Unpickle a `torch.save` file (zip, or legacy non-zip) through the allowlist; tensors come back as
    `LazyTensor`s.

    `torch.save(obj, ".../name.pt")` stores everything under a folder `name/` inside the zip, so a file that
    was renamed, swapped with another or copied over one betrays itself: with `check_identity` such a file
    is refused. (A legacy file records no name: nothing to check.)

    Raises:
        CorruptCheckpointError: the file is truncated, not a zip, renamed, or its pickle is damaged.
        UnsupportedCheckpointError: big-endian files, legacy files of torch < 0.4.
        UnsafeCheckpointError: the pickle references anything outside the allowlist.
    """
    path = Path(path)
    # an unreadable file is the environment's problem, reported as such (the OSError of opening it)
    with contextlib.closing(open_source(path)) as source, open_stream(source) as fh:
        size = source.size()
        try:
            legacy = _is_legacy(fh)
            data, records, archive = _read_legacy(path, source, fh) if legacy else _read_zip(path, fh)
        except CkptError:
            raise
        except Exception as e:  # zipfile raises many kinds (BadZipFile, RuntimeError, OSError on bad offsets, ...)
            reason = f"{type(e).__name__}: {short(e, 100)}"
            raise CorruptCheckpointError(f"{path} is damaged ({reason}); re-copy it from the source") from e
    if check_identity and archive is not None and archive not in (path.stem, GENERIC_ARCHIVE):
        raise CorruptCheckpointError(
            f"{path} holds the data of {archive}{path.suffix} (torch.save records the file's own name inside it): "
            "files were renamed, swapped or copied over each other; restore the original files"
        )
    for rec in records.values():
        if rec.offset + rec.nbytes > size:
            raise CorruptCheckpointError(f"{path} is truncated: record {rec.name} runs past the end of the file")
    unpickler = _AllowlistUnpickler(
        data, records, path, label="" if legacy else "data/", extra_globals=extra_globals, walked=legacy
    )
    try:
        obj = unpickler.load()
    except CkptError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: cannot read its pickle ({type(e).__name__}: {short(e, 100)})") from e
    unused = sorted(set(records) - unpickler.used)
    if unused:
        raise CorruptCheckpointError(
            f"{path}: storage record {unpickler.label}{unused[0]} belongs to no tensor (torch.save writes none such); "
            "the file was altered"
        )
    _check_structure(obj, path)
    return obj


MAX_DEPTH = 64  # DeepSpeed's files nest a handful of levels
MAX_INT_BITS = 256


def _check_structure(obj: Any, path: Path) -> None:
    """Refuse what no DeepSpeed file holds and what would make later walks explode: deep nesting, shared
    references expanding exponentially (each container is visited once), numbers too large to print."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > MAX_INT_BITS:
            raise CorruptCheckpointError(f"{path} holds a {item.bit_length()}-bit integer: not a DeepSpeed checkpoint")
        if isinstance(item, (dict, list, tuple, set, frozenset, PickledObject)):
            if depth > MAX_DEPTH:
                raise CorruptCheckpointError(
                    f"{path} nests more than {MAX_DEPTH} levels deep: not a DeepSpeed checkpoint"
                )
            if id(item) in seen:
                continue
            seen.add(id(item))
            children = item.__dict__.values() if isinstance(item, PickledObject) else item
            if isinstance(item, dict):
                children = [*item.keys(), *item.values()]
            stack.extend((child, depth + 1) for child in children)


def _read_zip(path: Path, fh: Any) -> tuple[bytes, dict[str, Record], str]:
    """The pickle bytes, the storage records and the archive folder name of a torch.save zip."""
    if not zipfile.is_zipfile(fh):
        fh.seek(0)
        magic = fh.read(2)
        if magic[:1] == b"\x80":  # a legacy torch.save file starts with its magic number (_is_legacy)
            raise UnsupportedCheckpointError(
                f"{path} is a pickle that does not start with torch.save's magic number: not a torch checkpoint "
                "(or a damaged legacy one)"
            )
        raise CorruptCheckpointError(f"{path} is not a torch checkpoint (not a zip archive): truncated or damaged")
    with zipfile.ZipFile(fh) as zf:
        infos = zf.infolist()
        pkls = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkls) != 1:
            raise CorruptCheckpointError(f"{path} has {len(pkls)} data.pkl entries: not a torch.save file")
        pkl = pkls[0]
        prefix = pkl.filename[: -len("data.pkl")]
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(
                    f"{path}: entry {info.filename} is compressed, which torch.save never does; the file is not "
                    "a checkpoint DeepSpeed wrote"
                )
        byteorder = next((i for i in infos if i.filename == prefix + "byteorder"), None)
        if byteorder is not None and zf.read(byteorder).strip() != b"little":
            raise UnsupportedCheckpointError(f"{path} was written on a big-endian machine")
        records = {}
        for info in infos:
            if info.filename.startswith(prefix + "data/"):
                key = info.filename[len(prefix) + 5 :]
                records[key] = Record(path, info.filename, _data_offset(fh, info), info.file_size, info.CRC)
        data = zf.read(pkl)  # zipfile checks this record's CRC
    return data, records, prefix[:-1]


def _is_legacy(fh: Any) -> bool:
    fh.seek(0)
    head = fh.read(32)
    fh.seek(0)
    return legacyfile.is_legacy(head)


class _LegacyScan(_AllowlistUnpickler):
    """The first pass over a legacy file's data pickle: each storage's dtype, whose element size the storage's
    8-byte count multiplies (needed before any record can be located). The same allowlist applies; tensors are built
    against placeholder records and dropped."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(data, {}, path, label="", walked=True)
        self.dtypes: dict[str, DType] = {}

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{self.path}: unexpected persistent id {short(pid, 80)}")
        storage_type, key, numel, view = pid[1], str(pid[2]), pid[4], pid[5]
        if not (isinstance(storage_type, tuple) and storage_type[0] == "storage_type"):
            raise UnsafeCheckpointError(f"{self.path}: unexpected storage type {short(storage_type, 80)}")
        if view is not None:  # torch has written None since storage views went (torch 0.4)
            raise UnsupportedCheckpointError(
                f"{self.path} holds a storage view, which only torch before 0.4 wrote: load and re-save it once with "
                "torch"
            )
        dtype = storage_type[1]
        if not _is_count(numel) or self.dtypes.setdefault(key, dtype) != dtype:
            raise CorruptCheckpointError(
                f"{self.path}: storage {key} is declared as {short(numel)} {dtype.name} elements, impossible or "
                "contradicting another declaration of it; the file is damaged"
            )
        return StorageRef(Record(self.path, key, 0, numel * dtype.itemsize, None), dtype)


def _read_legacy(path: Path, source: ByteSource, fh: Any) -> tuple[bytes, dict[str, Record], None]:
    """The data pickle's bytes and the storage records of a legacy torch.save file (see `legacyfile`): the pickle is
    read twice (once for the dtypes that locate the records, once against them), the storages never."""
    size = source.size()
    legacyfile.read_preamble(path, fh, size)
    data = legacyfile.read_pickle(path, fh, size, "data pickle")
    scan = _LegacyScan(data, path)
    try:
        scan.load()
    except CkptError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: cannot read its pickle ({type(e).__name__}: {short(e, 100)})") from e
    keys = legacyfile.read_keys(path, fh, size)
    itemsizes = {key: dtype.itemsize for key, dtype in scan.dtypes.items()}
    spans = legacyfile.storage_spans(path, source, fh.tell(), keys, itemsizes)
    records = {key: Record(path, f"storage {key}", offset, nbytes, None) for key, (offset, nbytes) in spans.items()}
    return data, records, None


# --- Reading bytes with CRC checks --------------------------------------------------------------------


class _CrcCursor:
    """Checks a record's CRC-32 as its bytes stream past, reading any skipped gap once."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.pos = 0
        self.crc = 0
        self.lock = threading.Lock()


class RecordReader:
    """Reads byte ranges of records with `pread` (through each file's `ByteSource`), verifying each touched
    record's CRC-32 (records of legacy files have none: they are only read, see `Record`).

    A record read front to back (the usual case: flat fp32 partitions in parameter order) is checked
    in the same pass that reads it; gaps are read once for the checksum. Call `finish()` to check the
    tails of all touched records; it raises `CorruptCheckpointError` on any mismatch.
    """

    GAP_CHUNK = 8 << 20

    def __init__(self, *, pieces: bool = False) -> None:
        """With `pieces` (ranks sharing one conversion), reads are not checked as they go: each is only logged
        with its CRC-32 in `self.pieces`, for `verify_pieces` on the rank that checks that record, which then
        reads only the bytes no rank read. Every byte is then read once in all, not once more for the check."""
        self._sources: dict[Path, ByteSource] = {}
        self._cursors: dict[tuple[Path, str], _CrcCursor] = {}
        self._lock = threading.Lock()
        self.pieces: list[tuple[tuple[Path, str], int, int, int]] | None = [] if pieces else None
        self.bytes_read = 0

    def _source(self, path: Path) -> ByteSource:
        with self._lock:
            source = self._sources.get(path)
            if source is None:
                source = self._sources[path] = open_source(path)
            return source

    def _cursor(self, record: Record) -> _CrcCursor:
        with self._lock:
            key = (record.path, record.name)
            cur = self._cursors.get(key)
            if cur is None:
                cur = self._cursors[key] = _CrcCursor(record)
            return cur

    def _pread(self, record: Record, start: int, buf: memoryview) -> None:
        check_present(record)
        if read_full(self._source(record.path), record.offset + start, buf) < len(buf):
            raise CorruptCheckpointError(f"{record.path} is truncated inside record {record.name}")
        self.bytes_read += len(buf)

    def advise(self, record: Record, start: int, nbytes: int) -> None:
        """Ask the source to start reading these bytes now (a hint; never fails)."""
        self._source(record.path).advise(record.offset + start, nbytes)

    def readinto(self, record: Record, start: int, buf: memoryview, workers: Workers | None = None) -> None:
        """Fill `buf` with the record's bytes from `start`; its CRC-32 is split over `workers`' threads."""
        end = start + len(buf)
        if end > record.nbytes:
            raise CorruptCheckpointError(f"{record.path}: read past the end of record {record.name}")
        if record.crc32 is None:  # nothing to check it against: read what is asked, no more
            self._pread(record, start, buf)
            return
        if self.pieces is not None:
            self._pread(record, start, buf)
            piece = ((record.path, record.name), start, len(buf), crc32(buf, 0, workers))
            with self._lock:
                self.pieces.append(piece)
            return
        cur = self._cursor(record)
        with cur.lock:
            self._advance_gap(cur, start)
            self._pread(record, start, buf)
            if start <= cur.pos < end:
                cur.crc = crc32(buf[cur.pos - start :], cur.crc, workers)
                cur.pos = end

    def _advance_gap(self, cur: _CrcCursor, upto: int) -> None:
        while cur.pos < upto:
            chunk = bytearray(min(self.GAP_CHUNK, upto - cur.pos))
            self._pread(cur.record, cur.pos, memoryview(chunk))
            cur.crc = zlib.crc32(chunk, cur.crc)
            cur.pos += len(chunk)

    def verify(self, record: Record) -> None:
        """Read whatever of the record has not been checked yet and compare its CRC-32."""
        if record.crc32 is None:
            return
        cur = self._cursor(record)
        with cur.lock:
            self._advance_gap(cur, record.nbytes)
            if cur.crc != record.crc32:
                raise CorruptCheckpointError(
                    f"{record.path}: record {record.name} fails its CRC-32 check (stored {record.crc32:08x}, "
                    f"read {cur.crc:08x}); the file is damaged, re-copy it from the source"
                )

    def verify_pieces(self, record: Record, pieces: Iterable[tuple[int, int, int]]) -> None:
        """Check a record's CRC-32 from the (start, length, CRC-32) of the pieces any rank read of it, combined in
        order (`crc.crc32_combine`); the bytes no piece covers are read here."""
        if record.crc32 is None:
            return
        crc, pos = 0, 0
        for start, length, piece_crc in sorted(pieces):
            end = start + length
            if end <= pos:
                continue  # bytes another piece already covered
            if start < pos:  # overlaps the covered bytes: read the rest here
                crc = self._crc_of(record, pos, end, crc)
            else:
                crc = crc32_combine(self._crc_of(record, pos, start, crc), piece_crc, length)
            pos = end
        crc = self._crc_of(record, pos, record.nbytes, crc)
        if crc != record.crc32:
            raise CorruptCheckpointError(
                f"{record.path}: record {record.name} fails its CRC-32 check (stored {record.crc32:08x}, "
                f"read {crc:08x}); the file is damaged, re-copy it from the source"
            )

    def _crc_of(self, record: Record, start: int, end: int, crc: int) -> int:
        while start < end:
            chunk = bytearray(min(self.GAP_CHUNK, end - start))
            self._pread(record, start, memoryview(chunk))
            crc = zlib.crc32(chunk, crc)
            start += len(chunk)
        return crc

    def finish(self) -> None:
        """Verify every record touched so far."""
        for cur in list(self._cursors.values()):
            self.verify(cur.record)

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
        self._sources.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


READAHEAD_BYTES = 256 << 20  # asked of the kernel ahead of the reads: fills the page cache, not our memory


class ReadAhead:
    """Keeps the kernel reading up to `window` bytes ahead of a known sequence of reads.

    `spans` lists the reads to come as (record, byte start, byte count); a record of None is a span
    that needs no reading (a zero fill). Call `before(i)` just before performing read i. With every
    rank file hinted at once, the kernel reads them in parallel while the caller works.
    """

    def __init__(self, reader: RecordReader, spans: list[tuple[Record | None, int, int]],
                 window: int = READAHEAD_BYTES) -> None:  # fmt: skip
        self.reader, self.spans, self.window = reader, spans, window
        self.ahead = 0  # spans before this one have been hinted
        self.pending = 0  # hinted bytes not yet read

    def before(self, i: int) -> None:
        while self.ahead < len(self.spans) and (self.ahead <= i or self.pending < self.window):
            record, start, nbytes = self.spans[self.ahead]
            if record is not None:
                self.reader.advise(record, start, nbytes)
                self.pending += nbytes
            self.ahead += 1
        record, _, nbytes = self.spans[i]
        if record is not None:
            self.pending -= nbytes


def lazy_tensors(obj: Any) -> list[LazyTensor]:
    """Every LazyTensor inside a nested structure of dicts, lists and tuples."""
    found: list[LazyTensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, LazyTensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found

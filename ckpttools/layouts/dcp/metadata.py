"""The `.metadata` file of a torch Distributed Checkpoint folder, read without running anything it names.

torch's own reader opens `.metadata` with plain `pickle.load`, so a planted file runs code as soon as it is read.
Here the pickle goes through an allowlist: the DCP metadata classes become inert records (`_Pickled`), `torch.Size`
a tuple, dtypes ckpttools' own `DType`s, paths strings; any other global is refused before it is looked up. The
records are then checked field by field into the plain dataclasses below, so nothing downstream touches a pickled
object.

What torch 2.4-2.13 writes (torch/distributed/checkpoint/metadata.py, filesystem.py): `Metadata` with
`state_dict_metadata` (FQN -> `TensorStorageMetadata(properties, size, chunks)` or `BytesStorageMetadata()`),
`storage_data` (`MetadataIndex(fqn, offset, index)` -> `_StorageInfo(relative_path, offset, length,
transform_descriptors)`), `planner_data` (FQN -> the key path in the nested state dict), `storage_meta`, `version`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from typing_extensions import Self

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError, short
from ckpttools.io import dtypes, pickles
from ckpttools.io.dtypes import DType

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a 405B model's metadata is tens of MB; more is not a DCP folder
DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._hf_utils",
    "torch.distributed.checkpoint.planner",
)
DCP_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_StorageInfo",
    "_StoragePrefix",
    "_HFStorageInfo",
    # Megatron-Core keeps the ranks' save plans in `.metadata` (Metadata.all_local_plans): inert records, never used
    "SavePlan",
    "WriteItem",
    "WriteItemType",
    "TensorWriteData",
}


@dataclass(frozen=True)
class StoredChunk:
    """Where one chunk of a tensor lies: `length` bytes at `offset` of file `relative_path` in the folder."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]  # stream transforms applied on save (e.g. zstd); () for plain torch.save


@dataclass(frozen=True)
class Chunk:
    """A block of a tensor: `sizes` elements per dimension from `offsets`, and where its bytes are stored."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: StoredChunk


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    dtype: DType
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpMetadata:
    """What a DCP folder's `.metadata` says, checked: tensors, non-tensor entries, and each FQN's key path."""

    tensors: dict[str, TensorEntry]
    byte_entries: list[str]  # pickled non-tensor leaves (param_groups, step counters, ...), never read here
    key_paths: dict[str, tuple[str | int, ...]]  # FQN -> path in the nested state dict (planner_data)
    version: str | None
    file_ends: dict[str, int]  # file -> the end of its last stored item (model, optimizer and bytes alike)
    byte_storage: dict[str, StoredChunk] = field(default_factory=dict)  # where each non-tensor entry's bytes are


class _Pickled:
    """An allowlisted DCP class as pickled: its constructor arguments and state, nothing run."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, position: int) -> Any:
        """A dataclass field, from the state dict (most classes) or the constructor arguments."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if isinstance(self.state, tuple) and len(self.state) == 2 and isinstance(self.state[1], dict):
            slots = self.state[1]  # (None, slots) for classes with __slots__
            if name in slots:
                return slots[name]
        if position < len(self.args):
            return self.args[position]
        return None


def _stub(name: str) -> type[_Pickled]:
    return type(name, (_Pickled,), {"qualname": name})


_STUBS = {name: _stub(name) for name in DCP_CLASSES}


def _mem_format(value: Any) -> Any:
    return ("memory_format", value)  # _MEM_FORMAT_ENCODING(n): an enum member, kept as its value


def _layout(name: Any) -> Any:
    return ("layout", name)  # torch.serialization._get_layout("torch.strided")


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): lambda dims=(): tuple(dims),
    ("torch.serialization", "_get_layout"): _layout,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    ("collections", "OrderedDict"): dict,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("pathlib", "Path"): _path,
    # megatron-core 0.13-0.15 pickle their SavePlan subclass in all_local_plans (an inert record, with `mcore_data`)
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): _STUBS["SavePlan"],
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module in DCP_MODULES and name in _STUBS:
            return _STUBS[name]
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle '{module}.{name}', which is not a torch Distributed Checkpoint "
            "metadata class; ckpttools never runs code from checkpoint files"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.where}: unexpected persistent id {short(pid, 80)} in DCP metadata")


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """The checked content of a `.metadata` file's bytes (`where` names it in messages).

    Raises:
        UnsafeCheckpointError: the pickle names anything outside the DCP metadata classes.
        CorruptCheckpointError: it is not DCP metadata, or its entries contradict each other, or its pickle would
            make the unpickler allocate by a memo index (`pickles`).
    """
    pickles.check(data, where)
    try:
        raw = _MetadataUnpickler(data, where).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as e:  # a damaged pickle raises anything (UnpicklingError, EOFError, TypeError, ...)
        raise CorruptCheckpointError(f"{where} is damaged ({type(e).__name__}: {short(e, 100)}); re-copy it") from e
    if not isinstance(raw, _STUBS["Metadata"]):
        raise CorruptCheckpointError(f"{where} does not hold torch Distributed Checkpoint metadata")
    return _Checker(where).metadata(raw)


class _Checker:
    """Turns the pickled records into the dataclasses, refusing any field of the wrong type or range."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {what}; the metadata is damaged or not torch's")

    def metadata(self, raw: _Pickled) -> DcpMetadata:
        entries = raw.field("state_dict_metadata", 0)
        storage = raw.field("storage_data", 2)
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise self.fail("state_dict_metadata or storage_data is missing")
        stored = self.storage(storage)
        tensors, byte_entries = {}, []
        for fqn, entry in entries.items():
            if not isinstance(fqn, str):
                raise self.fail(f"key {short(fqn, 60)} is not a string")
            if isinstance(entry, _STUBS["BytesStorageMetadata"]):
                byte_entries.append(fqn)
            elif isinstance(entry, _STUBS["TensorStorageMetadata"]):
                tensors[fqn] = self.tensor(fqn, entry, stored)
            else:
                raise self.fail(f"entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes metadata")
        version = raw.field("version", 4)
        ends: dict[str, int] = {}
        for item in stored.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        byte_storage = {fqn: stored[(fqn, ())] for fqn in byte_entries if (fqn, ()) in stored}
        return DcpMetadata(tensors, byte_entries, self.key_paths(raw.field("planner_data", 1)),
                           version if isinstance(version, str) else None, ends, byte_storage)  # fmt: skip

    def storage(self, storage: dict[Any, Any]) -> dict[tuple[str, tuple[int, ...]], StoredChunk]:
        out = {}
        for index, info in storage.items():
            if not isinstance(index, _STUBS["MetadataIndex"]) or not isinstance(info, _STUBS["_StorageInfo"]):
                raise self.fail("a storage_data entry is not MetadataIndex -> _StorageInfo")
            fqn, offset = index.field("fqn", 0), index.field("offset", 1)
            if not isinstance(fqn, str):
                raise self.fail("a storage index has no FQN")
            key = (fqn, self.dims(offset or (), f"the storage offset of {fqn!r}"))
            out[key] = self.stored(fqn, info)
        return out

    def stored(self, fqn: str, info: _Pickled) -> StoredChunk:
        path, offset, length = info.field("relative_path", 0), info.field("offset", 1), info.field("length", 2)
        transforms = info.field("transform_descriptors", 3) or ()
        if not isinstance(path, str) or not _is_plain_name(path):
            raise UnsafeCheckpointError(
                f"{self.where}: {fqn!r} is stored in {short(path, 80)}, which is not a file of the checkpoint "
                "folder; refusing to read outside it"
            )
        if not (is_count(offset) and is_count(length)):
            raise self.fail(f"the byte range of {fqn!r} is {short(offset)}+{short(length)}")
        if not (isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)):
            raise self.fail(f"the transforms of {fqn!r} are {short(transforms, 60)}")
        return StoredChunk(path, offset, length, tuple(transforms))

    def tensor(self, fqn: str, entry: _Pickled, stored: dict[tuple[str, tuple[int, ...]], StoredChunk]) -> TensorEntry:
        props, size, chunks = entry.field("properties", 0), entry.field("size", 1), entry.field("chunks", 2)
        dtype = props.field("dtype", 0) if isinstance(props, _STUBS["TensorProperties"]) else None
        if isinstance(props, _STUBS["TensorProperties"]) and isinstance(props.state, tuple) and len(props.state) == 5:
            dtype = props.state[0]  # torch >= 2.1 pickles (dtype, layout, requires_grad, memory_format, pin_memory)
        if not isinstance(dtype, DType):
            raise self.fail(f"{fqn!r} has no dtype torch can store")
        dims = self.dims(size, f"the size of {fqn!r}")
        if not isinstance(chunks, list) or not chunks:
            raise self.fail(f"{fqn!r} has no chunks")
        out = []
        for chunk in chunks:
            if not isinstance(chunk, _STUBS["ChunkStorageMetadata"]):
                raise self.fail(f"a chunk of {fqn!r} is a {type(chunk).__name__}")
            offsets = self.dims(chunk.field("offsets", 0), f"a chunk offset of {fqn!r}")
            sizes = self.dims(chunk.field("sizes", 1), f"a chunk size of {fqn!r}")
            if len(offsets) != len(dims) or len(sizes) != len(dims):
                raise self.fail(f"a chunk of {fqn!r} has {len(sizes)} dimensions, the tensor {len(dims)}")
            if any(o + s > d for o, s, d in zip(offsets, sizes, dims, strict=True)):
                block = f"a chunk of {fqn!r} at {list(offsets)} of size {list(sizes)}"
                raise self.fail(f"{block} lies outside {list(dims)}")
            where = stored.get((fqn, offsets))
            if where is None:
                raise self.fail(f"the chunk of {fqn!r} at {list(offsets)} is stored nowhere (no storage_data entry)")
            out.append(Chunk(offsets, sizes, where))
        return TensorEntry(fqn, dtype, dims, tuple(out))

    def dims(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, (tuple, list)) or not all(is_count(v) for v in value) or len(value) > 64:
            raise self.fail(f"{what} is {short(value, 60)}")
        return tuple(value)

    def key_paths(self, planner_data: Any) -> dict[str, tuple[str | int, ...]]:
        if not isinstance(planner_data, dict):
            return {}
        out: dict[str, tuple[str | int, ...]] = {}
        for fqn, path in planner_data.items():
            if isinstance(fqn, str) and isinstance(path, (tuple, list)) and all(_is_key(p) for p in path):
                out[fqn] = tuple(path)
        return out


def _is_key(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _is_plain_name(path: str) -> bool:
    """A file inside the folder: relative, no `..`, no drive or backslash tricks."""
    if not path or "\\" in path or "\x00" in path:
        return False
    pure = PurePosixPath(path)
    return not pure.is_absolute() and ".." not in pure.parts and ":" not in pure.parts[0]

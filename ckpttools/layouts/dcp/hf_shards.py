"""DCP saves written as Hugging Face safetensors shards (torch's `HuggingFaceStorageWriter`, save_distributed).

Each rank writes `shard-RRRRR-model-IIIII-of-NNNNN.safetensors` holding its piece of each tensor; the file's
`__metadata__["DCP_SHARDING_INFO"]` gives each piece's `saved_offsets` in the whole tensor (torch
`_hf_utils.CUSTOM_METADATA_KEY`), and the whole tensor's size is the furthest piece's end, as torch's
`HuggingFaceStorageReader.read_metadata` computes it. No `.metadata`, no pickle: only JSON headers are parsed,
then tensors are segments of the shards' byte ranges (safetensors has no checksum: `Record.crc32` is None).
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

from ckpttools.errors import CorruptCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.source import open_source, read_full
from ckpttools.io.torchfile import LazyTensor, Record, StorageRef
from ckpttools.layouts.dcp.chunks import contiguous_strides, tensor_segments
from ckpttools.layouts.dcp.metadata import Chunk, StoredChunk, TensorEntry, is_count
from ckpttools.model.checkpoint import TensorSource, shape_numel, strip_prefixes

SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
BY_CODE = {d.safetensors: d for d in dtypes.BY_NAME.values()}


def shard_names(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.endswith(".safetensors"))


def is_dcp_shard(path: Path) -> bool:
    """A safetensors file carrying DCP sharding metadata (a plain HF weights file has none)."""
    try:
        meta, _, _, _ = read_header(path)
    except (OSError, CorruptCheckpointError):
        return False
    return SHARDING_KEY in meta


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """(__metadata__, tensor entries, byte offset of the data, file size) of a safetensors file."""
    with contextlib.closing(open_source(path)) as source:
        size = source.size()
        head = bytearray(8)
        if size < 8 or read_full(source, 0, memoryview(head)) != 8:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptCheckpointError(
                f"{path}: its header claims {n} bytes; the file is truncated or not safetensors"
            )
        raw = bytearray(n)
        read_full(source, 8, memoryview(raw))
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: its safetensors header is not JSON ({short(e, 60)})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: its safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{path}: its __metadata__ is not a JSON object")
    return meta, header, 8 + n, size


def read_hf_shards(folder: Path, names: list[str]) -> dict[str, TensorSource]:
    """Every tensor of the shards in `folder`, whole, as segments of the shards' pieces."""
    pieces: dict[str, list[tuple[Chunk, LazyTensor]]] = {}
    dtype_of: dict[str, dtypes.DType] = {}
    for name in shard_names(names):
        path = folder / name
        meta, entries, data_start, size = read_header(path)
        sharding = _sharding(path, meta)
        for key, entry in entries.items():
            dtype, shape, begin, end = _entry(path, key, entry)
            if data_start + end > size:
                raise CorruptCheckpointError(f"{path} is truncated: {key!r} runs past its end; re-copy it")
            offsets = _offsets(path, key, sharding.get(key), len(shape))
            if dtype_of.setdefault(key, dtype) is not dtype:
                raise CorruptCheckpointError(f"{path}: {key!r} is {dtype.name} here and {dtype_of[key].name} elsewhere")
            record = Record(path, f"{key}@{begin}", data_start + begin, end - begin, None)
            tensor = LazyTensor(StorageRef(record, dtype), 0, shape, tuple(contiguous_strides(shape)))
            stored = StoredChunk(name, data_start + begin, end - begin, ())
            pieces.setdefault(key, []).append((Chunk(offsets, shape, stored), tensor))
    return {strip_prefixes(key): _whole(key, dtype_of[key], parts) for key, parts in pieces.items()}


def _whole(key: str, dtype: dtypes.DType, parts: list[tuple[Chunk, LazyTensor]]) -> TensorSource:
    dims = len(parts[0][0].sizes)
    size = tuple(max(c.offsets[d] + c.sizes[d] for c, _ in parts) for d in range(dims))
    entry = TensorEntry(key, dtype, size, tuple(c for c, _ in parts))
    segments = tensor_segments(entry, [t for _, t in parts])
    return TensorSource(strip_prefixes(key), size, dtype, segments, "trainable")


def _sharding(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    try:
        info = json.loads(meta[SHARDING_KEY]) if SHARDING_KEY in meta else {}
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: its {SHARDING_KEY} is not JSON") from e
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{path}: its {SHARDING_KEY} is not a JSON object")
    return info


def _entry(path: Path, key: str, entry: Any) -> tuple[dtypes.DType, tuple[int, ...], int, int]:
    damaged = CorruptCheckpointError(f"{path}: the header entry of {key!r} is damaged ({short(entry, 80)})")
    try:
        dtype = BY_CODE[entry["dtype"]]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise damaged from e
    if not all(is_count(v) for v in (*shape, begin, end)) or end - begin != shape_numel(shape) * dtype.itemsize:
        raise damaged
    return dtype, shape, begin, end


def _offsets(path: Path, key: str, info: Any, dims: int) -> tuple[int, ...]:
    if info is None:
        return (0,) * dims
    offsets = info.get(OFFSETS_KEY) if isinstance(info, dict) else None
    if not isinstance(offsets, list) or len(offsets) != dims or not all(is_count(o) for o in offsets):
        raise CorruptCheckpointError(f"{path}: the saved_offsets of {key!r} are {short(offsets, 60)}")
    return tuple(offsets)

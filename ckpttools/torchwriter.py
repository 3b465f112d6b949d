"""Write `torch.save`-compatible zip files by streaming tensor bytes from other checkpoint files.

`torch.save` needs every tensor in memory at once; a resharded rank file can be many GB. Here the
pickle is written first (tensors reduced to storage references, as torch does), then each storage
record is streamed in fixed-size chunks from its sources, 64-byte aligned like torch's own writer.
The result loads with `torch.load` (mmap included) and with DeepSpeed. Objects read through
`torchfile`'s stand-ins are turned back into the real classes, so DeepSpeed gets its own loss
scaler back and no stand-in class ever reaches a file.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import DType
from .errors import UsageError
from .torchfile import LazyTensor, PickledObject, Record, RecordReader, TorchDevice, TorchSize, ZeroStageEnum

ALIGNMENT = 64
CHUNK_BYTES = 16 << 20


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

    def numel(self) -> int:
        return sum(p.count for p in self.pieces)

    def view_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (self.numel(),)


def _deepspeed_classes() -> dict[str, Any]:
    import importlib

    try:
        loss_scaler = importlib.import_module("deepspeed.runtime.fp16.loss_scaler")
        zero_config = importlib.import_module("deepspeed.runtime.zero.config")
        tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    except ImportError as e:
        raise UsageError(
            "writing DeepSpeed checkpoints needs deepspeed installed (pip install 'ckpttools[deepspeed]'), "
            f"so that its own classes are written into the files ({e})"
        ) from e
    return {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler": loss_scaler.LossScaler,
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": loss_scaler.DynamicLossScaler,
        "deepspeed.utils.tensor_fragment.fragment_address": tensor_fragment.fragment_address,
        "ZeroStageEnum": zero_config.ZeroStageEnum,
    }


def _real_object(stub: PickledObject, classes: dict[str, Any]) -> Any:
    cls = classes.get(stub.qualname)
    if cls is None:
        import argparse

        if stub.qualname == "argparse.Namespace":
            cls = argparse.Namespace
        else:
            raise UsageError(f"cannot write back an object of class {stub.qualname}")
    obj = cls.__new__(cls)
    obj.__dict__.update({k: v for k, v in stub.__dict__.items() if k != "args"})
    return obj


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


def _pickle(obj: Any, table: _StorageTable) -> bytes:
    import torch
    from torch._utils import _rebuild_tensor_v2

    classes = _deepspeed_classes()
    storage_types = {
        "float64": torch.DoubleStorage, "float32": torch.FloatStorage, "float16": torch.HalfStorage,
        "bfloat16": torch.BFloat16Storage, "int64": torch.LongStorage, "int32": torch.IntStorage,
        "int16": torch.ShortStorage, "int8": torch.CharStorage, "uint8": torch.ByteStorage, "bool": torch.BoolStorage,
    }  # fmt: skip

    def tensor_reduce(ref: _StorageRef, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
        return _rebuild_tensor_v2, (ref, offset, tuple(shape), tuple(stride), False, OrderedDict())

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _StorageRef):
                return ("storage", storage_types[o.dtype.name], o.key, "cpu", o.numel)
            return None

        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, LazyTensor):
                key = table.key_for_record(o.record, o.dtype)
                ref = _StorageRef(key, o.dtype, o.record.nbytes // o.dtype.itemsize)
                return tensor_reduce(ref, o.storage_offset, o.shape, o.stride)
            if isinstance(o, NewTensor):
                ref = _StorageRef(table.key_for_new(o), o.dtype, o.numel())
                shape = o.view_shape()
                strides = [1] * len(shape)
                for i in range(len(shape) - 2, -1, -1):
                    strides[i] = strides[i + 1] * shape[i + 1]
                return tensor_reduce(ref, 0, shape, tuple(strides))
            if isinstance(o, ZeroStageEnum):
                return classes["ZeroStageEnum"], (int(o),)
            if isinstance(o, TorchSize):
                return torch.Size, (tuple(o),)
            if isinstance(o, TorchDevice):
                return torch.device, tuple(o)
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(_with_real_objects(obj, classes))
    return buf.getvalue()


def _with_real_objects(obj: Any, classes: dict[str, Any]) -> Any:
    """A copy of the container tree with stand-ins replaced by DeepSpeed's real classes and torch dtypes."""
    if isinstance(obj, DType):
        return obj.to_torch()  # pickles as GLOBAL torch.<name>, as torch.save writes it
    if isinstance(obj, PickledObject):
        real = _real_object(obj, classes)
        real.__dict__.update({k: _with_real_objects(v, classes) for k, v in real.__dict__.items()})
        return real
    if isinstance(obj, dict):
        return type(obj)((k, _with_real_objects(v, classes)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_with_real_objects(v, classes) for v in obj]
    if type(obj) is tuple:
        return tuple(_with_real_objects(v, classes) for v in obj)
    return obj


def _aligned_info(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose data starts on a 64-byte boundary (padding in an extra field, as torch does)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule for adding the zip64 field
    header = 30 + len(name.encode()) + (20 if zip64 else 0)
    start = zf.fp.tell() + header + 4  # 4: the padding field's own id and length
    pad = -start % ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return info


def _write_record(zf: zipfile.ZipFile, name: str, size: int, fill: Callable[[Any], None]) -> None:
    info = _aligned_info(zf, name, size)
    with zf.open(info, "w") as out:
        fill(out)


def _copy_record(record: Record, reader: RecordReader, out: Any) -> None:
    buf = bytearray(min(CHUNK_BYTES, max(record.nbytes, 1)))
    pos = 0
    while pos < record.nbytes:
        n = min(len(buf), record.nbytes - pos)
        view = memoryview(buf)[:n]
        reader.readinto(record, pos, view)
        out.write(view)
        pos += n


def _write_new(tensor: NewTensor, reader: RecordReader, out: Any) -> None:
    item = tensor.dtype.itemsize
    for piece in tensor.pieces:  # let the kernel read every slice (often one per old rank file) in parallel
        if isinstance(piece, Slice):
            base, _ = piece.tensor.byte_span()
            reader.advise(piece.tensor.record, base + piece.start * item, piece.count * item)
    buf = bytearray(CHUNK_BYTES)
    zeros = bytes(min(CHUNK_BYTES, max(1, max((p.count for p in tensor.pieces if isinstance(p, Fill)), default=1) * item)))
    for piece in tensor.pieces:
        if isinstance(piece, Fill):
            left = piece.count * item
            while left:
                n = min(left, len(zeros))
                out.write(zeros[:n])
                left -= n
            continue
        if piece.tensor.dtype != tensor.dtype:
            raise ValueError(f"slice dtype {piece.tensor.dtype} does not match {tensor.dtype}")
        base, _ = piece.tensor.byte_span()
        pos, end = base + piece.start * item, base + (piece.start + piece.count) * item
        while pos < end:
            n = min(len(buf), end - pos)
            view = memoryview(buf)[:n]
            reader.readinto(piece.tensor.record, pos, view)
            out.write(view)
            pos += n


def write_torch_file(path: Path, obj: Any, reader: RecordReader) -> int:
    """Write `obj` (plain containers, LazyTensors, NewTensors, DeepSpeed stand-ins) as a torch.save file."""
    path = Path(path)
    table = _StorageTable()
    data_pkl = _pickle(obj, table)
    stem = path.stem or "archive"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, payload in ((f"{stem}/data.pkl", data_pkl), (f"{stem}/.format_version", b"1"),
                              (f"{stem}/.storage_alignment", b"64"), (f"{stem}/byteorder", b"little")):  # fmt: skip
            _write_record(zf, name, len(payload), lambda out, p=payload: out.write(p))
        for key, source, dtype, numel in table.entries:
            if isinstance(source, NewTensor):
                _write_record(zf, f"{stem}/data/{key}", numel * dtype.itemsize, lambda out, t=source: _write_new(t, reader, out))
            else:
                _write_record(zf, f"{stem}/data/{key}", source.nbytes, lambda out, r=source: _copy_record(r, reader, out))
        _write_record(zf, f"{stem}/version", 2, lambda out: out.write(b"3\n"))
        serial = os.urandom(8).hex().encode()
        _write_record(zf, f"{stem}/.data/serialization_id", len(serial), lambda out: out.write(serial))
    return path.stat().st_size

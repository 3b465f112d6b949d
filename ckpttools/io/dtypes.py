"""Tensor dtypes without importing torch, and exact casts between them with numpy.

Consolidation only moves bytes and casts floats, so the hot path needs neither torch nor its 1-2 s
import. Casts round to nearest even, bit for bit what torch (and so DeepSpeed's fp32 -> 16-bit
copy) does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ckpttools.io.threads import Workers

# Elements cast per pass: the source, the temporaries and the result of one block stay in the core's cache,
# which makes the bf16 rounding 2-3x faster than one pass over a 16 MiB chunk.
CAST_BLOCK = 1 << 17


@dataclass(frozen=True)
class DType:
    name: str  # torch's attribute name: "float32", "bfloat16", ...
    itemsize: int
    is_floating_point: bool
    safetensors: str  # the safetensors header code
    numpy: str | None  # numpy dtype with the same bytes (bf16: its raw uint16)

    def __repr__(self) -> str:
        return self.name

    def to_torch(self) -> Any:
        import torch

        return getattr(torch, self.name)


FLOAT64 = DType("float64", 8, True, "F64", "<f8")
FLOAT32 = DType("float32", 4, True, "F32", "<f4")
FLOAT16 = DType("float16", 2, True, "F16", "<f2")
BFLOAT16 = DType("bfloat16", 2, True, "BF16", "<u2")
INT64 = DType("int64", 8, False, "I64", "<i8")
INT32 = DType("int32", 4, False, "I32", "<i4")
INT16 = DType("int16", 2, False, "I16", "<i2")
INT8 = DType("int8", 1, False, "I8", "i1")
UINT8 = DType("uint8", 1, False, "U8", "u1")
BOOL = DType("bool", 1, False, "BOOL", "?")
COMPLEX64 = DType("complex64", 8, False, "C64", "<c8")
COMPLEX128 = DType("complex128", 16, False, "C128", "<c16")

BY_NAME = {
    d.name: d
    for d in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16, INT64, INT32, INT16, INT8, UINT8, BOOL, COMPLEX64, COMPLEX128)
}
BY_NAME.update({"half": FLOAT16, "float": FLOAT32, "double": FLOAT64, "long": INT64, "int": INT32, "short": INT16})

# Storage classes as torch.save pickles them.
BY_STORAGE = {
    "DoubleStorage": FLOAT64,
    "FloatStorage": FLOAT32,
    "HalfStorage": FLOAT16,
    "BFloat16Storage": BFLOAT16,
    "LongStorage": INT64,
    "IntStorage": INT32,
    "ShortStorage": INT16,
    "CharStorage": INT8,
    "ByteStorage": UINT8,
    "BoolStorage": BOOL,
    "ComplexFloatStorage": COMPLEX64,
    "ComplexDoubleStorage": COMPLEX128,
    "UntypedStorage": UINT8,
}

# The names users pass on the command line.
SHORT = {"fp32": FLOAT32, "bf16": BFLOAT16, "fp16": FLOAT16}


def from_torch(dtype: Any) -> DType:
    return BY_NAME[str(dtype).removeprefix("torch.")]


def _f32_to_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    """Round-to-nearest-even on the bits, as c10::BFloat16 does; NaN becomes the quiet NaN 0x7FC0."""
    bits = src.view(np.uint32)
    tmp = np.right_shift(bits, 16)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, bits, out=tmp)
    np.right_shift(tmp, 16, out=tmp)
    dst[:] = tmp  # uint32 -> uint16, values fit
    nan = np.isnan(src)
    if nan.any():
        dst[nan] = 0x7FC0


def _to_f32(src: np.ndarray, src_dtype: DType) -> np.ndarray:
    if src_dtype is BFLOAT16:
        return np.left_shift(src.astype(np.uint32), 16).view(np.float32)
    return src.astype(np.float32)


def cast(src_buf: Any, src_dtype: DType, dst_buf: Any, dst_dtype: DType, count: int,
         workers: Workers | None = None) -> None:  # fmt: skip
    """Cast `count` elements from one buffer into another, split over `workers`' threads when given."""
    if src_dtype.numpy is None or dst_dtype.numpy is None:
        raise TypeError(f"cannot cast {src_dtype} to {dst_dtype}")
    src = np.frombuffer(src_buf, dtype=src_dtype.numpy, count=count)
    dst = np.frombuffer(dst_buf, dtype=dst_dtype.numpy, count=count)
    n = 1 if workers is None else max(1, min(workers.n, -(-count // CAST_BLOCK)))
    bounds = [count * i // n for i in range(n + 1)]
    parts = [_blocks_caster(src[a:b], src_dtype, dst[a:b], dst_dtype) for a, b in itertools.pairwise(bounds)]
    if workers is None:
        parts[0]()
    else:
        workers.run(parts)


def _blocks_caster(src: np.ndarray, src_dtype: DType, dst: np.ndarray, dst_dtype: DType) -> Any:
    def run() -> None:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, as in torch
            for a in range(0, len(src), CAST_BLOCK):
                _cast(src[a : a + CAST_BLOCK], src_dtype, dst[a : a + CAST_BLOCK], dst_dtype)

    return run


def _cast(src: np.ndarray, src_dtype: DType, dst: np.ndarray, dst_dtype: DType) -> None:
    if dst_dtype is BFLOAT16:
        _f32_to_bf16(src if src_dtype is FLOAT32 else _to_f32(src, src_dtype), dst)
    elif src_dtype is BFLOAT16:
        dst[:] = _to_f32(src, src_dtype)
    else:
        dst[:] = src  # numpy's float casts round to nearest even

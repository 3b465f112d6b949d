"""Chunk bytes as numbers, without torch: the decoding every reduction shares, and the non-finite count.

Reductions (`ckpttools.ops.reduce`: statistics, `ckpt diff`) and the writers (a NaN noted while the bytes stream
into a shard) look at the same chunks `safetensors_writer.stream_chunks` yields. numpy has no bfloat16: its bits
are kept as uint16 (`raw`) and widened to float32 exactly (`numbers`), as torch's `.float()` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType

# bfloat16 bits: exponent all ones is Inf (mantissa 0) or NaN; the sign bit tells +Inf from -Inf
_BF16_EXP, _BF16_MANT, _BF16_SIGN = 0x7F80, 0x007F, 0x8000


def raw(chunk: memoryview | bytes | bytearray | np.ndarray, dtype: DType) -> np.ndarray:
    """The chunk's elements as stored (bfloat16 as its uint16 bits); a view, no copy."""
    if dtype.numpy is None:
        raise TypeError(f"{dtype} has no numpy equivalent")
    return np.frombuffer(chunk, dtype=dtype.numpy)


def numbers(values: np.ndarray, dtype: DType) -> np.ndarray:
    """`raw` values as numbers numpy computes with: bfloat16 widened to float32 (exact), the rest as they are."""
    if dtype is dtypes.BFLOAT16:
        return np.left_shift(values.astype(np.uint32), 16).view(np.float32)
    return values


def is_float(dtype: DType) -> bool:
    """Floating dtypes, whose elements can be NaN or Inf."""
    return dtype.is_floating_point


@dataclass
class NonFinite:
    """NaN, +Inf and -Inf counts of one tensor (or of several, added up)."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    @property
    def total(self) -> int:
        return self.nan + self.posinf + self.neginf

    def __bool__(self) -> bool:
        return self.total > 0

    def add(self, other: NonFinite) -> None:
        self.nan += other.nan
        self.posinf += other.posinf
        self.neginf += other.neginf

    def to_dict(self) -> dict[str, int]:
        return {"nan": self.nan, "posinf": self.posinf, "neginf": self.neginf}

    def describe(self) -> str:
        """`2 NaN, 1 +Inf`: the counts that are not zero."""
        parts = [(self.nan, "NaN"), (self.posinf, "+Inf"), (self.neginf, "-Inf")]
        return ", ".join(f"{n:,} {label}" for n, label in parts if n)


def count_nonfinite(values: np.ndarray, dtype: DType) -> NonFinite:
    """NaN, +Inf and -Inf among `raw` values (all zero for integer and bool dtypes).

    One pass that finds nothing for the usual chunk (every element finite); the counts only when something is.
    bfloat16 is tested on its bits, without widening.
    """
    if not is_float(dtype) or values.size == 0:
        return NonFinite()
    if dtype is dtypes.BFLOAT16:
        special = (values & _BF16_EXP) == _BF16_EXP
        if not special.any():
            return NonFinite()
        picked = values[special]
        nan = int(np.count_nonzero(picked & _BF16_MANT))
        inf = picked[(picked & _BF16_MANT) == 0]
        neg = int(np.count_nonzero(inf & _BF16_SIGN))
        return NonFinite(nan, len(inf) - neg, neg)
    finite = np.isfinite(values)
    if finite.all():
        return NonFinite()
    picked = values[~finite]
    nan = int(np.count_nonzero(np.isnan(picked)))
    neg = int(np.count_nonzero(picked < 0))
    return NonFinite(nan, len(picked) - nan - neg, neg)


class NonFiniteCounter:
    """Counts NaN and Inf per tensor over a stream of (tensor name, dtype, chunk bytes): what consolidate notes,
    verify fails on and push refuses. `found` keeps only the tensors that hold any, in the order first seen."""

    def __init__(self) -> None:
        self.found: dict[str, NonFinite] = {}

    def add(self, name: str, dtype: DType, chunk: memoryview | bytes | bytearray | np.ndarray) -> None:
        """Take in a chunk of the tensor `name`: its bytes (as bytes or a uint8 array), or its `raw` values."""
        if not is_float(dtype):
            return
        values = raw(chunk.reshape(-1).view(np.uint8), dtype) if isinstance(chunk, np.ndarray) else raw(chunk, dtype)
        counts = count_nonfinite(values, dtype)
        if counts:
            self.found.setdefault(name, NonFinite()).add(counts)

    def total(self) -> NonFinite:
        out = NonFinite()
        for counts in self.found.values():
            out.add(counts)
        return out

    def describe(self, limit: int = 5) -> str:
        """`lm_head.weight (3 NaN), ... and 2 more`: the tensors holding non-finite values, for a note or error."""
        items = [f"{name} ({counts.describe()})" for name, counts in self.found.items()]
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more

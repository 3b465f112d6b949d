"""Output tensors as pieces of stored ones: the arithmetic every rank-file writer shares (pure).

A state of a param group, flattened in the optimizer's order with DeepSpeed's alignment padding, is a `Flat` of
`Slice`s of stored tensors; a rank's partition is `Flat.take` of it, padded with zero `Fill`s where DeepSpeed pads.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from typing import Any

from . import dtypes
from .errors import CorruptCheckpointError
from .reader import Param, TensorSource, ZeroCheckpoint
from .torchfile import DEEPSPEED_STUBS
from .torchwriter import Fill, NewTensor, Slice
from .universal import MASTER

_FRAGMENT = DEEPSPEED_STUBS[("deepspeed.utils.tensor_fragment", "fragment_address")]
Pieces = list[Slice | Fill]


# --- Piece arithmetic -------------------------------------------------------------------------------------


class Flat:
    """The concatenation of pieces, cut anywhere in O(log n): resharding N ranks to M cuts every state M times."""

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.ends = list(itertools.accumulate(p.count for p in pieces))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def take(self, start: int, count: int) -> Pieces:
        """Elements [start, start+count)."""
        out: Pieces = []
        end = start + count
        i = bisect.bisect_right(self.ends, start)
        while i < len(self.pieces) and count and self.ends[i] - self.pieces[i].count < end:
            p, pos = self.pieces[i], self.ends[i] - self.pieces[i].count
            lo, hi = max(start, pos), min(end, self.ends[i])
            if lo < hi:
                out.append(Fill(hi - lo) if isinstance(p, Fill) else Slice(p.tensor, p.start + lo - pos, hi - lo))
            i += 1
        if sum(p.count for p in out) != count:
            raise CorruptCheckpointError(f"a flat state is shorter ({len(self)}) than its layout needs ({end})")
        return out


def padded(pieces: Pieces, pad: int) -> Pieces:
    return [*pieces, Fill(pad)] if pad > 0 else pieces


def master_partition(pieces: Pieces) -> NewTensor:
    """A rank's fp32 master partition: DeepSpeed saves these with requires_grad set."""
    return NewTensor(dtypes.FLOAT32, tuple(pieces), requires_grad=True)


def fragment_address(numel: int, start: int) -> Any:
    frag = _FRAGMENT()
    frag.__dict__.update(numel=numel, start=start)
    return frag


# --- The checkpoint model, as pieces of stored tensors -----------------------------------------------------


def pieces_of(src: TensorSource) -> Pieces:
    return [Slice(s.tensor, s.start, s.count) for s in src.segments]


def state_of(p: Param, key: str) -> TensorSource:
    return p.fp32 if key == MASTER else p.states[key]


def group_params(ckpt: ZeroCheckpoint, g: int) -> list[Param]:
    return [p for p in ckpt.params if p.group == g]


def group_count(ckpt: ZeroCheckpoint) -> int:
    return max(len(ckpt.optimizer.group_scalars), 1 + max((p.group for p in ckpt.params), default=-1))


def group_keys(group: list[Param]) -> list[str]:
    """The optimizer's own state keys of a param group (none before the first optimizer step)."""
    keys = list(group[0].states) if group else []
    for p in group:
        if sorted(p.states) != sorted(keys):
            raise CorruptCheckpointError(f"{p.name} has optimizer states {sorted(p.states)}, its group {sorted(keys)}")
    return keys


def new_tensor(dtype: dtypes.DType, pieces: Pieces, shape: tuple[int, ...] | None = None) -> NewTensor:
    return NewTensor(dtype, tuple(pieces), shape)


def slice_mappings(group: list[Param], lo: int, hi: int) -> OrderedDict[str, Any]:
    """DeepSpeed's param_slice_mappings: each param touching [lo, hi) with its (numel, start) in the partition."""
    mapping: OrderedDict[str, Any] = OrderedDict()
    off = 0
    for p in group:
        start, end = max(off, lo), min(off + p.numel, hi)
        if start < end:
            mapping[p.file_name] = fragment_address(end - start, start - lo)
        off += p.numel + p.align_pad
    return mapping

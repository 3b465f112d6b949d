"""Output tensors as pieces of stored ones: the arithmetic every rank-file writer shares (pure).

A state of a param group, flattened in the optimizer's order with DeepSpeed's alignment padding, is a `Flat` of
`Slice`s of stored tensors; a rank's partition is `Flat.take` of it, padded with zero `Fill`s where DeepSpeed pads.

One state is laid out differently: the Muon momentum of a ZeRO-1/2 Muon param group (`use_muon` in its
hyper-parameters). DeepSpeed's `_muon_momentum_buffer` (stage_1_and_2.py) sizes it by the *whole* params of the
rank's partition (`params_in_partition`, each in full, in order), because Newton-Schulz needs whole matrices; a param
cut by a partition boundary is held whole by every rank it touches (`whole_params_in_partition`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.torchfile import DEEPSPEED_STUBS
from ckpttools.io.torchwriter import Fill, NewTensor, Slice
from ckpttools.layouts.zero import partition
from ckpttools.model.checkpoint import MASTER, Checkpoint, Param, TensorSource

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


def group_params(ckpt: Checkpoint, g: int) -> list[Param]:
    return [p for p in ckpt.params if p.group == g]


def group_count(ckpt: Checkpoint) -> int:
    return max(len(ckpt.optimizer.group_scalars), 1 + max((p.group for p in ckpt.params), default=-1))


def group_keys(group: list[Param]) -> list[str]:
    """The optimizer's own state keys of a param group (none before the first optimizer step)."""
    keys = list(group[0].states) if group else []
    for p in group:
        if sorted(p.states) != sorted(keys):
            raise CorruptCheckpointError(f"{p.name} has optimizer states {sorted(p.states)}, its group {sorted(keys)}")
    return keys


MUON_MOMENTUM = "momentum_buffer"


def is_muon_group(param_group: Any) -> bool:
    """A param group that DeepSpeed's MuonWithAuxAdam steps with Muon (the rest go to its auxiliary Adam)."""
    return isinstance(param_group, dict) and param_group.get("use_muon") is True


def whole_params_in_partition(numels: list[int], offsets: list[int], size: int, rank: int) -> list[int]:
    """The params DeepSpeed's `get_partition_info` puts in ZeRO-1/2 partition `rank` of `size` elements: those
    starting inside it and the one running into it from before (indices into the group's params)."""
    lo, hi = size * rank, size * (rank + 1)
    return [i for i, (n, off) in enumerate(zip(numels, offsets, strict=True)) if lo <= off < hi or off < lo < off + n]


def group_offsets(group: list[Param]) -> list[int]:
    return partition.zero12_param_offsets([p.numel for p in group], [p.align_pad for p in group])


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


@dataclass(frozen=True)
class GroupPartition:
    """One rank's share of a ZeRO-1/2 param group, as its optimizer file records it."""

    master: NewTensor  # single_partition_of_fp32_groups entry
    state: dict[str, Any]  # the group's scalars (step) and its slice of every optimizer state; {} before a step
    padding: int  # group_paddings entry
    mapping: OrderedDict[str, Any]  # param_slice_mappings entry


def cut_group(
    group: list[Param],
    scalars: dict[str, Any],
    ranks: int,
    *,
    bf16_optimizer: bool = False,
    elastic: bool = False,
    muon: bool = False,
) -> list[GroupPartition]:
    """A param group cut over `ranks` ranks with ZeRO-1/2's arithmetic, rank by rank.

    Elastic checkpoints keep the optimizer states without their padding; BF16_Optimizer pads its fp32 partitions
    and records the whole group's padding on the last rank only. A Muon group (`muon`) holds its momentum as the
    whole params of each partition, as DeepSpeed does.
    """
    keys = group_keys(group)
    total = sum(p.numel + p.align_pad for p in group)
    size = partition.zero12_partition_size(total, ranks)
    flats = {
        k: Flat([x for p in group for x in padded(pieces_of(state_of(p, k)), p.align_pad)]) for k in [MASTER, *keys]
    }
    parts = []
    for r in range(ranks):
        lo = r * size
        n = max(0, min(size, total - lo))
        fp32 = flats[MASTER].take(lo, n)
        state = dict(scalars)
        for key in keys:
            if muon and key == MUON_MOMENTUM:
                state[key] = _whole_params_state(group, key, size, r)
                continue
            part = flats[key].take(lo, n)
            state[key] = new_tensor(group[0].states[key].dtype, part if elastic else padded(part, size - n))
        pad = (size * ranks - total if r == ranks - 1 else 0) if bf16_optimizer else size - n
        master = master_partition(padded(fp32, size - n) if bf16_optimizer else fp32)
        parts.append(GroupPartition(master, state, pad, slice_mappings(group, lo, lo + n)))
    return parts


def _whole_params_state(group: list[Param], key: str, size: int, rank: int) -> NewTensor:
    """A ZeRO-1/2 Muon momentum of partition `rank`: the whole momentum of every param in it, in order."""
    numels = [p.numel for p in group]
    members = whole_params_in_partition(numels, group_offsets(group), size, rank)
    pieces = [x for i in members for x in pieces_of(state_of(group[i], key))]
    return new_tensor(group[0].states[key].dtype, pieces)

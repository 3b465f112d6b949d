"""ZeRO partition arithmetic. Pure: integers in, integers out.

ZeRO-1/2 flatten each param group into one buffer, pad it to a multiple of 2*dp, and give each rank
one contiguous slice. ZeRO-3 splits every parameter on its own: each rank holds ceil(numel/dp)
elements of it, the last ranks padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


@dataclass(frozen=True)
class Piece:
    """`count` elements starting at element `start` of rank `rank`'s flat partition."""

    rank: int
    start: int
    count: int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def zero12_partition_size(total_numel: int, dp: int) -> int:
    """Elements per rank for a ZeRO-1/2 group of `total_numel` (padding included) at `dp` ranks."""
    align = NCCL_START_ALIGNMENT_FACTOR * dp
    return ceil_div(total_numel, align) * align // dp


def zero12_param_offsets(numels: Sequence[int], alignment_paddings: Sequence[int] | None = None) -> list[int]:
    """Offset of each param in its group's flat buffer: sum of the earlier numels and their alignment pads."""
    pads = list(alignment_paddings) if alignment_paddings else [0] * len(numels)
    offsets, pos = [], 0
    for numel, pad in zip(numels, pads, strict=True):
        offsets.append(pos)
        pos += numel + pad
    return offsets


def split_range(start: int, count: int, part_lengths: Sequence[int]) -> list[Piece]:
    """Cut the flat range [start, start+count) into per-rank pieces, given consecutive rank lengths."""
    pieces = []
    base = 0
    end = start + count
    for rank, length in enumerate(part_lengths):
        lo, hi = max(start, base), min(end, base + length)
        if lo < hi:
            pieces.append(Piece(rank, lo - base, hi - lo))
        base += length
        if base >= end:
            break
    if sum(p.count for p in pieces) != count:
        raise ValueError(f"range [{start}, {end}) runs past the partitions (total {sum(part_lengths)})")
    return pieces


def zero3_partition_numel(numel: int, dp: int) -> int:
    """Elements of one parameter each ZeRO-3 rank holds: ceil(numel / dp)."""
    return ceil_div(numel, dp)


def zero3_pieces(numel: int, dp: int, offset: int) -> list[Piece]:
    """Where a ZeRO-3 param lives: rank r holds elements [r*p, (r+1)*p) at `offset` of its flat group."""
    p = zero3_partition_numel(numel, dp)
    pieces = []
    for rank in range(dp):
        count = max(0, min(p, numel - rank * p))
        if count:
            pieces.append(Piece(rank, offset, count))
    return pieces


def zero3_subgroup_offsets(numels: Sequence[int], dp: int) -> list[int]:
    """Offset of each param inside its ZeRO-3 sub-group's per-rank flat buffer."""
    offsets, pos = [], 0
    for numel in numels:
        offsets.append(pos)
        pos += zero3_partition_numel(numel, dp)
    return offsets


def split_subgroups(partition_numels: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's `_create_fp16_sub_groups`: the params of one param group (their ZeRO-3 partition numels), split
    into sub-groups, each closed once it reaches sub_group_size elements (indices into the group)."""
    if not partition_numels:
        return []
    if sub_group_size >= sum(partition_numels):
        return [list(range(len(partition_numels)))]
    groups, current, size = [], [], 0
    for i, n in enumerate(partition_numels):
        current.append(i)
        size += n
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups.append(current)
            current, size = [], 0
    return groups

"""Zero-copy operations on tensor sources: each returns new sources made of the same stored segments.

A tensor source is its elements in row-major order, as runs of stored elements (`model.checkpoint.TensorSource`).
A block of leading-axis rows is one element range of it, so renaming, taking one layer of a stacked `[L, ...]`
tensor, splitting rows (QKV per query group, fc1's gate and up halves), dropping padded vocabulary rows,
concatenating and permuting rows are all lists of element ranges: no byte is read here, and the writers stream
the result chunk by chunk as they stream any other source. Every operation checks that its pieces tile the tensor
exactly; a shape that does not is refused with one line naming the tensor (`MappingError`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpttools.errors import CorruptCheckpointError
from ckpttools.model.checkpoint import TensorSource, shape_numel, slice_segments


class MappingError(CorruptCheckpointError):
    """A tensor whose shape does not follow from the model config, or pieces that do not tile it."""


def renamed(src: TensorSource, name: str) -> TensorSource:
    return TensorSource(name, src.shape, src.dtype, src.segments, src.kind)


def rows(src: TensorSource, start: int, count: int, name: str) -> TensorSource:
    """Rows [start, start + count) of the leading axis, as a tensor of its own."""
    if not src.shape or start < 0 or count < 0 or start + count > src.shape[0]:
        raise MappingError(f"{src.name}: rows {start}-{start + count} do not lie in its shape {list(src.shape)}")
    inner = shape_numel(src.shape[1:])
    segments = tuple(slice_segments(src, start * inner, count * inner))
    return TensorSource(name, (count, *src.shape[1:]), src.dtype, segments, src.kind)


def layer(src: TensorSource, index: int, name: str) -> TensorSource:
    """Layer `index` of a stacked `[L, ...]` tensor (the leading axis dropped)."""
    one = rows(src, index, 1, name)
    return TensorSource(name, src.shape[1:], one.dtype, one.segments, one.kind)


def concat(parts: Sequence[TensorSource], name: str) -> TensorSource:
    """Row blocks stacked along the leading axis; every part has the same trailing shape and dtype."""
    first = parts[0]
    for part in parts[1:]:
        if part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
            what = f"{part.name} {list(part.shape)} to {first.name} {list(first.shape)}"
            raise MappingError(f"{name}: cannot join {what}")
    segments = tuple(seg for part in parts for seg in part.segments)
    return TensorSource(name, (sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype, segments, first.kind)


def split_rows(src: TensorSource, sizes: Sequence[int], names: Sequence[str]) -> list[TensorSource]:
    """Consecutive row blocks of the given sizes, which must add up to the tensor's rows exactly."""
    if not src.shape or sum(sizes) != src.shape[0]:
        raise MappingError(
            f"{src.name}: its {src.shape[0] if src.shape else 0} rows do not split into {list(sizes)} "
            f"(shape {list(src.shape)}); is the config the run's?"
        )
    out, start = [], 0
    for size, name in zip(sizes, names, strict=True):
        out.append(rows(src, start, size, name))
        start += size
    return out


def grouped_rows(src: TensorSource, groups: int, sizes: Sequence[int], names: Sequence[str]) -> list[TensorSource]:
    """Rows laid out as `groups` repeats of blocks of `sizes` (Megatron's QKV: per query group [q.., k, v]),
    gathered per block: block b of every group, in group order, becomes `names[b]`."""
    per_group = sum(sizes)
    if not src.shape or groups * per_group != src.shape[0]:
        raise MappingError(
            f"{src.name}: {src.shape[0] if src.shape else 0} rows are not {groups} groups of {list(sizes)} "
            f"(shape {list(src.shape)}); is the config the run's?"
        )
    out = []
    for b, name in enumerate(names):
        offset = sum(sizes[:b])
        blocks = [rows(src, g * per_group + offset, sizes[b], name) for g in range(groups)]
        out.append(concat(blocks, name))
    return out


def permuted_rows(src: TensorSource, order: Sequence[int], name: str) -> TensorSource:
    """Rows taken in `order` (a permutation of all rows): one segment run per row."""
    if not src.shape or sorted(order) != list(range(src.shape[0])):
        raise MappingError(f"{src.name}: {list(order)[:8]}... is not a permutation of its {src.shape[0]} rows")
    return concat([rows(src, r, 1, name) for r in order], name)


def expect_shape(src: TensorSource, shape: tuple[int, ...], why: str) -> TensorSource:
    """`src` unchanged when its shape is `shape`, else a refusal naming the tensor and what the config says."""
    if src.shape != shape:
        raise MappingError(f"{src.name} is {list(src.shape)}, but {why} gives {list(shape)}; is the config the run's?")
    return src

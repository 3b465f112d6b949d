"""The AutoTP map: how each TP rank's shard of a parameter makes up the full tensor.

DeepSpeed's AutoTP saves `universal_checkpoint_info` in every model-states file; its `affine_map` (version 1)
and the older pattern lists (replicated, row-parallel, vocabulary, concatenated sub-params) say, per parameter
regex, where each piece of every TP rank's shard lies in the full ("logical") tensor. `TensorPlan` is that answer
for one parameter as runs of elements; AutoTP reading and universal folders both use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.layouts.rankfile import (
    RankFile,
    param_shapes_of,
)
from ckpttools.model.checkpoint import Checkpoint

AFFINE_MAP_VERSION = 1


@dataclass(frozen=True)
class Run:
    """`count` elements that lie contiguously both in the full tensor (from `full`) and in TP rank `rank`'s
    shard (from `shard`)."""

    full: int
    rank: int
    shard: int
    count: int


@dataclass(frozen=True)
class TensorPlan:
    """How one full tensor is made of the TP shards: its logical shape, the shape written (vocabulary
    padding cut), the runs covering exactly the written elements, in order, and the runs of the other
    copies of replicated pieces (for `check_replicas`)."""

    name: str
    logical_shape: tuple[int, ...]
    shape: tuple[int, ...]
    shard_shapes: tuple[tuple[int, ...], ...]
    runs: tuple[Run, ...]
    replicas: tuple[Run, ...] = ()


# --- The map: how TP shards make full tensors ---------------------------------------------------------------


def tensor_plans(models: Sequence[RankFile], ranks: Sequence[Checkpoint]) -> dict[str, TensorPlan]:
    """A plan for every parameter (trained or frozen) of the module, from TP rank 0's map."""
    return _plans_of(models[0], {name: [_local_shape(c, name) for c in ranks] for name in _param_names(ranks[0])})


def full_shapes(models: Sequence[RankFile], names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The full shape of each parameter of a TP checkpoint whose model-states files (one per TP rank) are
    `models`, from each rank's param_shapes and TP rank 0's map (a universal folder holds full tensors)."""
    local: dict[str, list[tuple[int, ...]]] = {name: [] for name in names}
    for f in models:
        shapes = dict(entry for group in param_shapes_of(f, f.get(f.obj, "param_shapes", list), "param_shapes")
                      for entry in group)  # fmt: skip
        if set(shapes) != set(names):
            raise CorruptCheckpointError(
                f"{f.path} lists other parameters than {models[0].path.name}: the TP ranks' model-states files are "
                "from different runs; re-copy the tag folder"
            )
        for name in names:
            local[name].append(shapes[name])
    return {name: plan.shape for name, plan in _plans_of(models[0], local).items()}


def _plans_of(f0: RankFile, local_shapes: Mapping[str, list[tuple[int, ...]]]) -> dict[str, TensorPlan]:
    info = f0.get(f0.obj, "universal_checkpoint_info", dict)
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    maps = _affine_maps(f0, info)
    vocab = [str(p) for p in info.get("vocabulary_parameter_patterns") or []]
    original_vocab = info.get("original_vocab_size")
    plans = {}
    for name, local in local_shapes.items():
        hit = matching(f0, name, unsupported)
        if hit is not None:
            raise UnsupportedCheckpointError(
                f"{f0.path}: AutoTP marks {name} as not convertible ({short(unsupported[hit], 80)}); its TP shards "
                "cannot be merged"
            )
        pattern = matching(f0, name, maps)
        if pattern is None and maps and not _categorized(f0, info, name):
            raise CorruptCheckpointError(
                f"{f0.path}: {name} is covered neither by universal_checkpoint_info's affine map nor by any of its "
                "pattern lists, so how its TP shards merge is unknown; the file is damaged or not from this run"
            )
        entry = _category_map(f0, info, name, local) if pattern is None else maps[pattern]
        keep = original_vocab if matching(f0, name, dict.fromkeys(vocab)) is not None else None
        plans[name] = plan_of(f0, name, entry, local, keep)
    return plans


def _affine_maps(f0: RankFile, info: dict[str, Any]) -> dict[str, Any]:
    affine = info.get("affine_map")
    if affine is None:
        return {}
    if not isinstance(affine, dict) or not isinstance(affine.get("params"), dict):
        raise f0.fail("universal_checkpoint_info.affine_map is not a dict with 'params'")
    version = affine.get("version")
    if version != AFFINE_MAP_VERSION:
        raise UnsupportedCheckpointError(
            f"{f0.path}: universal_checkpoint_info.affine_map has version {short(version, 10)}; ckpttools reads "
            f"version {AFFINE_MAP_VERSION}. Convert it with the DeepSpeed that wrote it (ds_to_universal)"
        )
    return dict(affine["params"])


def matching(f0: RankFile, name: str, patterns: Mapping[str, Any]) -> str | None:
    """The one pattern matching `name` (DeepSpeed's converter matches with re.match), or None."""
    hits = [str(pattern) for pattern in patterns if _compiled(f0, pattern).match(name)]
    if len(hits) > 1:
        raise f0.fail(f"{name} matches {len(hits)} patterns of one kind ({', '.join(hits[:3])})")
    return hits[0] if hits else None


# Categories ds_to_universal merges other than by concatenation (averaged, chunk-interleaved): refused.
UNMERGED_KEYS = ("parameter_to_average_patterns", "parameter_with_2_sub_params_cat_dim_0")
CATEGORY_KEYS = ("tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                 "vocabulary_parameter_patterns")  # fmt: skip


def _categorized(f0: RankFile, info: dict[str, Any], name: str) -> bool:
    """Whether a pattern list of universal_checkpoint_info names the parameter (column-parallel ones need none)."""
    return any(matching(f0, name, dict.fromkeys(info.get(key) or [])) is not None for key in CATEGORY_KEYS)


def _compiled(f0: RankFile, pattern: Any) -> re.Pattern[str]:
    try:
        return re.compile(str(pattern))
    except re.error as e:
        raise f0.fail(f"universal_checkpoint_info holds an invalid pattern {short(pattern, 60)} ({e})") from e


def _category_map(f0: RankFile, info: dict[str, Any], name: str, local: list[tuple[int, ...]]) -> dict[str, Any]:
    """A map for a parameter without an affine entry, from the pattern categories as ds_to_universal merges
    them: replicated ones from TP rank 0, row-parallel ones concatenated on dim 1, all others on dim 0."""
    fused = [p for entry in info.get("parameter_with_sub_params") or [] if isinstance(entry, dict)
              for p in entry.get("patterns") or []]  # fmt: skip
    if matching(f0, name, dict.fromkeys(fused)) is not None:
        raise UnsupportedCheckpointError(
            f"{f0.path}: {name} is a fused parameter (parameter_with_sub_params) without an affine map; ckpttools "
            "merges fused parameters only through the affine map newer DeepSpeed versions save"
        )
    if matching(f0, name, dict.fromkeys(info.get("tp_replicated_parameter_patterns") or [])) is not None:
        return _replicated(local)
    for key in UNMERGED_KEYS:  # averaged or chunk-interleaved: not a concatenation, which is all that is left
        if matching(f0, name, dict.fromkeys(info.get(key) or [])) is not None:
            raise UnsupportedCheckpointError(
                f"{f0.path}: {name} matches {key} of universal_checkpoint_info without an affine map; ckpttools "
                "does not merge such parameters (DeepSpeed's ds_to_universal does)"
            )
    row_parallel = info.get("parameter_with_row_parallelism_patterns") or []
    return _concatenated(f0, name, local, 1 if matching(f0, name, dict.fromkeys(row_parallel)) else 0)


def _row_major(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def _replicated(local: list[tuple[int, ...]]) -> dict[str, Any]:
    shape = list(local[0])
    piece = {"shape": shape, "source": [0, _row_major(shape)], "dest": [0, _row_major(shape)],
             "locations": list(range(len(local)))}  # fmt: skip
    return {
        "logical_shape": shape,
        "ranks": {r: {"shard_shape": list(s), "pieces": [piece]} for r, s in enumerate(local)},
    }


def _concatenated(f0: RankFile, name: str, local: list[tuple[int, ...]], dim: int) -> dict[str, Any]:
    if any(len(s) <= dim or s[:dim] + s[dim + 1 :] != local[0][:dim] + local[0][dim + 1 :] for s in local):
        raise f0.fail(f"the TP shards of {name} ({[list(s) for s in local]}) do not concatenate along dim {dim}")
    full = list(local[0])
    full[dim] = sum(s[dim] for s in local)
    strides = _row_major(full)
    ranks, start = {}, 0
    for r, s in enumerate(local):
        piece = {"shape": list(s), "source": [start * strides[dim], strides], "dest": [0, _row_major(s)],
                 "locations": [r]}  # fmt: skip
        ranks[r] = {"shard_shape": list(s), "pieces": [piece]}
        start += s[dim]
    return {"logical_shape": full, "ranks": ranks}


def halves_map(local: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    """The map of a tensor whose every TP shard is [its slice of part 1; its slice of part 2] (Megatron-DeepSpeed's
    SwiGLU `dense_h_to_4h`, `parameter_with_2_sub_params_cat_dim_0`), merged as ds_to_universal merges it: every
    rank's first half, then every rank's second half."""
    half = local[0][0] // 2
    full = [sum(s[0] for s in local), *local[0][1:]]
    strides = _row_major(full)
    row = strides[0]  # elements in one row of dim 0
    ranks = {}
    for r, shard in enumerate(local):
        if shard != local[0] or shard[0] % 2:
            raise CorruptCheckpointError(f"TP shards {[list(s) for s in local]} do not split into two equal halves")
        pieces = [{"shape": [half, *shard[1:]], "source": [(part * full[0] // 2 + r * half) * row, strides],
                   "dest": [part * half * row, strides], "locations": [r]} for part in (0, 1)]  # fmt: skip
        ranks[r] = {"shard_shape": list(shard), "pieces": pieces}
    return {"logical_shape": full, "ranks": ranks}


def plan_of(f0: RankFile, name: str, entry: Any, local: list[tuple[int, ...]], keep_rows: Any) -> TensorPlan:
    """Check a map entry against the stored shards and turn it into the runs of the full tensor."""
    where = f"the affine map of {name}"
    if not isinstance(entry, dict):
        raise f0.fail(f"{where} is a {type(entry).__name__}, not a dict")
    logical = _int_list(f0, entry.get("logical_shape"), f"{where}: logical_shape")
    ranks = entry.get("ranks")
    tp = len(local)
    if not isinstance(ranks, dict) or set(ranks) != set(range(tp)):  # int keys, as DeepSpeed pickles them
        raise f0.fail(f"{where} does not describe TP ranks 0-{tp - 1}")
    runs: list[Run] = []
    replicas: list[Run] = []
    for key, rank_entry in ranks.items():
        r = int(key)  # an int already (checked above)
        if not isinstance(rank_entry, dict):
            raise f0.fail(f"{where}: TP rank {r}'s entry is not a dict")
        shard_shape = _int_list(f0, rank_entry.get("shard_shape"), f"{where}: TP rank {r}'s shard_shape")
        if shard_shape != local[r]:
            raise CorruptCheckpointError(
                f"{f0.path}: {where} gives TP rank {r} a shard of shape {list(shard_shape)}, but that rank stores "
                f"{list(local[r])}: the model-states files are from different runs; re-copy the tag folder"
            )
        pieces = rank_entry.get("pieces")
        if not isinstance(pieces, list):
            raise f0.fail(f"{where}: TP rank {r} has no list of pieces")
        stored: list[Run] = []
        for piece in pieces:
            taken, piece_runs = _piece_runs(f0, where, r, piece)
            stored += piece_runs
            if taken:
                runs += piece_runs
            else:
                replicas += piece_runs
        _check_shard_tiled(f0, name, r, stored, _count(shard_shape))
    shape, runs = _cut_vocabulary(f0, name, logical, runs, keep_rows)
    _, replicas = _cut_vocabulary(f0, name, logical, replicas, keep_rows)
    tiled = tuple(_tiled(f0, name, logical, shape, runs))
    return TensorPlan(name, logical, shape, tuple(local), tiled, tuple(replicas))


def _int_list(f0: RankFile, value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise f0.fail(f"{where} is not a list of ints ({short(value, 40)})")
    return tuple(int(v) for v in value)


def _count(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _piece_runs(f0: RankFile, where: str, rank: int, piece: Any) -> tuple[bool, list[Run]]:
    """A piece's elements as runs contiguous in both tensors, and whether this rank is the one to take them
    from: a replicated piece is listed by every rank holding it and taken from the lowest."""
    if not isinstance(piece, dict) or not all(isinstance(piece.get(k), list) for k in ("source", "dest")):
        raise f0.fail(f"{where}: TP rank {rank} has a piece that is not a dict with source and dest")
    if piece.get("scale", 1.0) != 1.0:
        raise UnsupportedCheckpointError(
            f"{f0.path}: {where} holds a piece scaled by {short(piece['scale'], 12)} (pre-divided by the TP size); "
            "ckpttools merges only unscaled pieces"
        )
    shape = _int_list(f0, piece.get("shape"), f"{where}: piece shape")
    src_off, src_strides = _offset_strides(f0, piece["source"], f"{where}: piece source")
    dst_off, dst_strides = _offset_strides(f0, piece["dest"], f"{where}: piece dest")
    holders = _int_list(f0, piece.get("locations"), f"{where}: piece locations")
    if rank not in holders or len(src_strides) != len(shape) or len(dst_strides) != len(shape):
        raise f0.fail(f"{where}: TP rank {rank} lists a piece whose locations {list(holders)} or strides do not fit it")
    if _count(shape) == 0:
        return False, []
    inner = _contiguous_dims(shape, src_strides, dst_strides)
    length = _count(shape[inner:])
    runs = []
    for index in _indices(shape[:inner]):
        s = src_off + sum(i * st for i, st in zip(index, src_strides, strict=False))
        d = dst_off + sum(i * st for i, st in zip(index, dst_strides, strict=False))
        runs.append(Run(s, rank, d, length))
    return rank == min(holders), runs


def _offset_strides(f0: RankFile, value: Any, where: str) -> tuple[int, tuple[int, ...]]:
    if len(value) != 2 or not isinstance(value[0], int) or isinstance(value[0], bool) or value[0] < 0:
        raise f0.fail(f"{where} is not [offset, strides] ({short(value, 40)})")
    return int(value[0]), _int_list(f0, value[1], where)


def _contiguous_dims(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> int:
    """The first dim from which the piece is one contiguous block in both tensors (len(shape): none)."""
    k = len(shape)
    expected = 1
    while k > 0 and (shape[k - 1] == 1 or (a[k - 1] == expected and b[k - 1] == expected)):
        expected *= shape[k - 1]
        k -= 1
    return k


def _indices(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def _check_shard_tiled(f0: RankFile, name: str, rank: int, runs: list[Run], numel: int) -> None:
    """A rank's pieces fill its shard exactly: every stored element used once, none outside."""
    spans = sorted((r.shard, r.count) for r in runs)
    cursor = 0
    for start, count in spans:
        if start != cursor:
            what = "overlap" if start < cursor else "leave a gap"
            raise CorruptCheckpointError(
                f"{f0.path}: the affine map's pieces of {name} on TP rank {rank} {what} at shard element "
                f"{min(start, cursor)}; the map does not describe the stored shard, so it cannot be merged"
            )
        cursor += count
    if cursor != numel:
        raise CorruptCheckpointError(
            f"{f0.path}: the affine map's pieces of {name} on TP rank {rank} account for {cursor} of the shard's "
            f"{numel} elements; the map does not describe the stored shard, so it cannot be merged"
        )


def _cut_vocabulary(
    f0: RankFile, name: str, logical: tuple[int, ...], runs: list[Run], keep_rows: Any
) -> tuple[tuple[int, ...], list[Run]]:
    """Vocabulary parameters lose the rows past original_vocab_size (AutoTP's padding), as ds_to_universal does."""
    if keep_rows is None or not logical:
        return logical, runs
    if not isinstance(keep_rows, int) or isinstance(keep_rows, bool) or keep_rows <= 0:
        raise f0.fail(f"original_vocab_size {short(keep_rows, 20)} is not a positive row count")
    if keep_rows >= logical[0]:
        return logical, runs
    end = keep_rows * _count(logical[1:])
    cut = [Run(r.full, r.rank, r.shard, min(r.count, end - r.full)) for r in runs if r.full < end]
    return (keep_rows, *logical[1:]), cut


def _tiled(f0: RankFile, name: str, logical: tuple[int, ...], shape: tuple[int, ...], runs: list[Run]) -> list[Run]:
    """The runs sorted by their place in the full tensor, checked to cover it exactly once."""
    runs = sorted(runs, key=lambda r: r.full)
    cursor = 0
    for run in runs:
        if run.full != cursor:
            problem = "is covered twice" if run.full < cursor else "is held by no TP rank"
            raise CorruptCheckpointError(
                f"{f0.path}: element {min(run.full, cursor)} of {name} (logical shape {list(logical)}) {problem} "
                "according to the affine map; the map is damaged, so the shards cannot be merged"
            )
        cursor += run.count
    if cursor != _count(shape):
        raise CorruptCheckpointError(
            f"{f0.path}: the affine map covers {cursor} of the {_count(shape)} elements of {name}; the map is "
            "damaged, so the shards cannot be merged"
        )
    return runs


def _param_names(ckpt: Checkpoint) -> list[str]:
    """Every parameter of the module (trained and frozen), in state-dict order."""
    masters = ckpt.masters
    return [k for k in ckpt.keys if k in masters or (k in ckpt.bit16 and k not in ckpt.shared_params)]


def _local_shape(ckpt: Checkpoint, name: str) -> tuple[int, ...]:
    src = ckpt.masters.get(name) or ckpt.bit16.get(name)
    if src is None:
        raise CorruptCheckpointError(f"{ckpt.location.tag_dir}: a TP rank's files lack parameter {name}")
    return src.shape

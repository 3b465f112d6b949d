"""DeepSpeed AutoTP (tensor-parallel) checkpoints read as one full-size checkpoint.

An AutoTP run of DP x TP processes saves one `mp_rank_{tp:02d}_model_states.pt` per TP rank (its module
holds that rank's TP shards) and one `{bf16_}zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt` per
(DP, TP) rank: every TP rank is an ordinary ZeRO-1/2 data-parallel group over its local shards. Each
model-states file also carries `universal_checkpoint_info`, whose `affine_map` (version 1) says, per
parameter regex, where every piece of every TP rank's shard lies in the full ("logical") tensor.

`read_tensor_parallel` reads each TP rank's files with the data-parallel reader, then rebuilds every full
tensor (fp32 master, each optimizer state, the 16-bit module copy) as `Segment`s over the TP ranks' flat
sources, in the logical tensor's row-major order: a split along dim 1 becomes row-interleaved segments,
replicated pieces come from the lowest TP rank holding them, vocabulary padding past `original_vocab_size`
is cut. No tensor bytes are read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.layouts.locate import MODEL_RE, OPTIM_RE, ZERO3_MODEL_RE
from ckpttools.layouts.rankfile import (
    MODEL_KEYS,
    OPTIM_KEYS,
    RankFile,
    check_agree,
    dict_at,
    dp_size_of,
    param_shapes_of,
    require_keys,
    zero_stage_of,
)
from ckpttools.layouts.universal import NAME_KEY, param_files, whole_tensor
from ckpttools.layouts.zero.read import Zero12Reader
from ckpttools.model.checkpoint import Param, Replica, Segment, TensorSource, ZeroCheckpoint
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

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


def read_tensor_parallel(loc: CheckpointLocation) -> ZeroCheckpoint:
    """Read an AutoTP tag folder (DP x TP ranks, ZeRO-1/2) into one checkpoint of full-size tensors.

    Raises:
        CheckpointNotFoundError: a TP rank's model-states file or a (DP, TP) optimizer file is missing.
        CorruptCheckpointError: TP ranks disagree (config, version, step, DP size, map, optimizer), a
            parameter is not covered by the map, or the map's pieces do not tile a tensor exactly.
        UnsupportedCheckpointError: ZeRO-3, pipeline stages, scaled or unmergeable parameters.
    """
    names = list(loc.files.names) or sorted(p.name for p in loc.tag_dir.iterdir())
    first, model_names, optim_names = _rank_file_names(loc.tag_dir, names)
    models = [first] + [
        RankFile(loc.tag_dir / n, load_pickle(loc.tag_dir / n), "model-states") for n in model_names[1:]
    ]
    tp = len(models)
    dp = dp_size_of(models[0])
    optims = _load_optim_files(loc.tag_dir, optim_names, dp, tp)
    with RecordReader() as reader:
        _check_tp_ranks_agree(models, reader)
        stage = _stage(loc.tag_dir, optims)
        ranks = [Zero12Reader(loc, models[r], optims[r], dp, stage, reader).read() for r in range(tp)]
        _check_optimizers_agree(models, optims, ranks, reader)
        reader.finish()
    plans = _plans(models, ranks)
    return _merged(loc, ranks, plans, models, tp)


# --- Files --------------------------------------------------------------------------------------------------


def _rank_file_names(tag_dir: Path, names: Sequence[str]) -> tuple[RankFile, list[str], dict[tuple[int, int], str]]:
    """TP rank 0's model-states file (loaded: it gives the TP size), the model-states file name per TP rank and
    the optimizer file name per (DP, TP) rank."""
    if any(ZERO3_MODEL_RE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"{tag_dir} is a ZeRO-3 tensor-parallel checkpoint (zero_pp_rank_*_mp_rank_*_model_states.pt); "
            "only AutoTP with ZeRO-1/2 is supported"
        )
    models = {int(m["mp"]): n for n in names if (m := MODEL_RE.match(n))}
    optims = {(int(m["dp"]), int(m["mp"])): n for n in names if (m := OPTIM_RE.match(n))}
    if 0 not in models:
        raise CheckpointNotFoundError(
            f"{tag_dir}: TP rank 0's model-states file mp_rank_00_model_states.pt is missing; re-copy the tag folder"
        )
    first = RankFile(tag_dir / models[0], load_pickle(tag_dir / models[0]), "model-states")
    tp = _tp_size(first)
    for r in range(tp):
        if r not in models:
            raise CheckpointNotFoundError(
                f"{tag_dir}: TP rank {r}'s model-states file mp_rank_{r:02d}_model_states.pt is missing "
                f"(mp_world_size={tp} in {models[0]}); the save was interrupted or the copy is incomplete: re-copy "
                "the tag folder"
            )
    stray = sorted(r for r in models if r >= tp)
    if stray:
        raise CorruptCheckpointError(
            f"{tag_dir}: model-states files for TP rank {', '.join(map(str, stray))} do not belong to a run with "
            f"mp_world_size={tp}; remove the stray files (left over from another run?)"
        )
    return first, [models[r] for r in range(tp)], optims


def _tp_size(f: RankFile) -> int:
    """The TP degree, from mp_world_size and checkpoint_parallel_dimensions (which must agree)."""
    mp = f.get(f.obj, "mp_world_size", int)
    if isinstance(mp, bool) or not 1 <= mp <= 1 << 16:
        raise f.fail(f"mp_world_size {short(mp, 20)} is not a positive rank count")
    dims = f.opt(f.obj, "checkpoint_parallel_dimensions", dict) or {}
    if dims.get("pp_degree", 1) != 1:
        raise UnsupportedCheckpointError(
            f"{f.path}: pipeline parallel degree {short(dims.get('pp_degree'), 10)} with tensor parallelism is "
            "not supported"
        )
    if dims.get("tp_degree", mp) != mp:
        raise f.fail(f"checkpoint_parallel_dimensions says tp_degree {short(dims.get('tp_degree'), 10)}, "
                     f"mp_world_size {mp}")  # fmt: skip
    return int(mp)


def _load_optim_files(tag_dir: Path, names: Mapping[tuple[int, int], str], dp: int, tp: int) -> list[list[RankFile]]:
    """Per TP rank, its DP ranks' optimizer files (every one present, none from a bigger run)."""
    for t in range(tp):
        for d in range(dp):
            if (d, t) not in names:
                raise CheckpointNotFoundError(
                    f"{tag_dir}: TP rank {t}, DP rank {d}: its optimizer file (*zero_pp_rank_{d}_mp_rank_{t:02d}_"
                    f"optim_states.pt) is missing (dp_world_size={dp}, mp_world_size={tp}); the save was "
                    "interrupted or the copy is incomplete: re-copy the tag folder"
                )
    stray = sorted(k for k in names if k[0] >= dp or k[1] >= tp)
    if stray:
        raise CorruptCheckpointError(
            f"{tag_dir}: optimizer file {names[stray[0]]} does not belong to a run with dp_world_size={dp} and "
            f"mp_world_size={tp}; remove the stray files (left over from another run?)"
        )
    return [
        [RankFile(tag_dir / names[(d, t)], load_pickle(tag_dir / names[(d, t)]), "optimizer") for d in range(dp)]
        for t in range(tp)
    ]


def _stage(tag_dir: Path, optims: Sequence[Sequence[RankFile]]) -> int:
    stages = set()
    for f in (f for rank in optims for f in rank):
        osd = f.get(f.obj, "optimizer_state_dict", dict)
        stage = zero_stage_of(f, osd)
        if stage == 3:
            raise UnsupportedCheckpointError(f"{f.path}: ZeRO-3 with tensor parallelism is not supported")
        require_keys(f, osd, OPTIM_KEYS["zero" if "zero_stage" in osd else "bf16_optimizer"], "ZeRO optimizer file")
        stages.add(stage)
    if len(stages) != 1:
        raise CorruptCheckpointError(
            f"{tag_dir}: rank files disagree on the ZeRO stage ({sorted(stages)}); mixed runs?"
        )
    return stages.pop()


# --- Agreement between TP ranks -----------------------------------------------------------------------------

# What every TP rank's model-states file must hold identically (its module and param_shapes are its own).
TP_SHARED_KEYS = ("ds_config", "ds_version", "global_steps", "global_samples", "skipped_steps", "dp_world_size",
                  "mp_world_size", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "buffer_names",
                  "shared_params")  # fmt: skip


def _check_tp_ranks_agree(models: Sequence[RankFile], reader: RecordReader) -> None:
    for f in models:
        require_keys(f, f.obj, MODEL_KEYS, "DeepSpeed model-states file")
        offload = dict_at(f.obj, "ds_config", "zero_optimization", "offload_optimizer")
        if offload.get("device") == "nvme":
            raise UnsupportedCheckpointError(f"{f.path}: the optimizer state was offloaded to NVMe; its fp32 weights "
                                             "are not in the checkpoint files")  # fmt: skip
    for key in TP_SHARED_KEYS:
        check_agree(models, [f.obj.get(key) for f in models], key, reader)
    check_agree(models, [list(f.get(f.obj, "module", dict)) for f in models], "the module's keys", reader)


def _check_optimizers_agree(
    models: Sequence[RankFile],
    optims: Sequence[Sequence[RankFile]],
    ranks: Sequence[ZeroCheckpoint],
    reader: RecordReader,
) -> None:
    """The TP ranks ran one optimizer: same groups, hyper-parameters, steps and state keys."""
    firsts = [rank[0] for rank in optims]
    for f in firsts:  # each optimizer file was saved with its rank's model-states file
        check_agree([models[0], f], [models[0].obj.get("ds_config"), f.obj.get("ds_config")], "ds_config", reader)
    check_agree(firsts, [[(p.name, p.group) for p in c.params] for c in ranks], "the parameters per group", reader)
    check_agree(firsts, [c.optimizer.param_groups for c in ranks], "the optimizer hyper-parameters", reader)
    check_agree(firsts, [c.optimizer.group_scalars for c in ranks], "the optimizer step", reader)
    check_agree(firsts, [c.state_keys for c in ranks], "the optimizer state keys", reader)
    check_agree(firsts, [c.optimizer_kind for c in ranks], "the optimizer wrapper", reader)


# --- The map: how TP shards make full tensors ---------------------------------------------------------------


def _plans(models: Sequence[RankFile], ranks: Sequence[ZeroCheckpoint]) -> dict[str, TensorPlan]:
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
        hit = _matching(f0, name, unsupported)
        if hit is not None:
            raise UnsupportedCheckpointError(
                f"{f0.path}: AutoTP marks {name} as not convertible ({short(unsupported[hit], 80)}); its TP shards "
                "cannot be merged"
            )
        pattern = _matching(f0, name, maps)
        if pattern is None and maps and not _categorized(f0, info, name):
            raise CorruptCheckpointError(
                f"{f0.path}: {name} is covered neither by universal_checkpoint_info's affine map nor by any of its "
                "pattern lists, so how its TP shards merge is unknown; the file is damaged or not from this run"
            )
        entry = _category_map(f0, info, name, local) if pattern is None else maps[pattern]
        keep = original_vocab if _matching(f0, name, dict.fromkeys(vocab)) is not None else None
        plans[name] = _plan(f0, name, entry, local, keep)
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


def _matching(f0: RankFile, name: str, patterns: Mapping[str, Any]) -> str | None:
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
    return any(_matching(f0, name, dict.fromkeys(info.get(key) or [])) is not None for key in CATEGORY_KEYS)


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
    if _matching(f0, name, dict.fromkeys(fused)) is not None:
        raise UnsupportedCheckpointError(
            f"{f0.path}: {name} is a fused parameter (parameter_with_sub_params) without an affine map; ckpttools "
            "merges fused parameters only through the affine map newer DeepSpeed versions save"
        )
    if _matching(f0, name, dict.fromkeys(info.get("tp_replicated_parameter_patterns") or [])) is not None:
        return _replicated(local)
    for key in UNMERGED_KEYS:  # averaged or chunk-interleaved: not a concatenation, which is all that is left
        if _matching(f0, name, dict.fromkeys(info.get(key) or [])) is not None:
            raise UnsupportedCheckpointError(
                f"{f0.path}: {name} matches {key} of universal_checkpoint_info without an affine map; ckpttools "
                "does not merge such parameters (DeepSpeed's ds_to_universal does)"
            )
    row_parallel = info.get("parameter_with_row_parallelism_patterns") or []
    return _concatenated(f0, name, local, 1 if _matching(f0, name, dict.fromkeys(row_parallel)) else 0)


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


def _plan(f0: RankFile, name: str, entry: Any, local: list[tuple[int, ...]], keep_rows: Any) -> TensorPlan:
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
    if keep_rows is None or not logical or keep_rows >= logical[0]:
        return logical, runs
    if not isinstance(keep_rows, int) or isinstance(keep_rows, bool) or keep_rows <= 0:
        raise f0.fail(f"original_vocab_size {short(keep_rows, 20)} is not a positive row count")
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


def _param_names(ckpt: ZeroCheckpoint) -> list[str]:
    """Every parameter of the module (trained and frozen), in state-dict order."""
    masters = ckpt.masters
    return [k for k in ckpt.keys if k in masters or (k in ckpt.bit16 and k not in ckpt.shared_params)]


def _local_shape(ckpt: ZeroCheckpoint, name: str) -> tuple[int, ...]:
    src = ckpt.masters.get(name) or ckpt.bit16.get(name)
    if src is None:
        raise CorruptCheckpointError(f"{ckpt.location.tag_dir}: a TP rank's files lack parameter {name}")
    return src.shape


# --- The merged checkpoint ----------------------------------------------------------------------------------


def _merged(
    loc: CheckpointLocation, ranks: list[ZeroCheckpoint], plans: dict[str, TensorPlan], models: list[RankFile], tp: int
) -> ZeroCheckpoint:
    first = ranks[0]
    params = []
    replicas: list[Replica] = []
    for p in first.params:
        plan = plans[p.name]
        per_rank = [c.params[i] for c in ranks for i in [_index(c, p.name)]]
        fp32 = _full(plan, [q.fp32 for q in per_rank])
        states = {k: _full(plan, [q.states[k] for q in per_rank]) for k in p.states}
        params.append(Param(p.name, p.file_name, plan.shape, p.group, 0, fp32, states))
        replicas += _replicas(plan, "fp32", fp32, [q.fp32 for q in per_rank])
        for k, src in states.items():
            replicas += _replicas(plan, k, src, [q.states[k] for q in per_rank])
    bit16 = {name: _full(plans[name], [c.bit16[name] for c in ranks]) for name in first.bit16}
    for name, src in bit16.items():
        replicas += _replicas(plans[name], "module", src, [c.bit16[name] for c in ranks])
    for c in ranks[1:]:
        for name, buf in c.buffers.items():
            if buf.shape != first.buffers[name].shape:
                raise CorruptCheckpointError(f"{loc.tag_dir}: buffer {name} has shape {list(buf.shape)} on one TP "
                                             f"rank, {list(first.buffers[name].shape)} on TP rank 0")  # fmt: skip
    info = models[0].obj["universal_checkpoint_info"]
    details = {
        "affine_map": "affine_map" in info,
        "original_vocab_size": info.get("original_vocab_size"),
        "model_files": [f.path.name for f in models],
    }
    ckpt = ZeroCheckpoint(
        location=loc,
        zero_stage=first.zero_stage,
        dp_world_size=first.dp_world_size,
        train_dtype=first.train_dtype,
        optimizer_kind=first.optimizer_kind,
        ds_version=first.ds_version,
        global_steps=first.global_steps,
        keys=first.keys,
        params=params,
        optimizer=first.optimizer,
        bit16=bit16,
        buffers=first.buffers,
        shared_params=first.shared_params,
        frozen_excluded=first.frozen_excluded,
        ds_config=first.ds_config,
        model_files=[f.obj for f in models],
        layout=ParallelLayout("tensor", dp=first.dp_world_size, tp=tp, details=details),
        slices=list(ranks),  # each TP rank is a ZeRO-1/2 DP group over its shards: resharded on its own
        replicas=replicas,
    )
    return ckpt


def _replicas(plan: TensorPlan, kind: str, merged: TensorSource, shards: Sequence[TensorSource]) -> list[Replica]:
    by_rank: dict[int, list[Run]] = {}
    for run in plan.replicas:
        by_rank.setdefault(run.rank, []).append(run)
    out = []
    for rank, runs in sorted(by_rank.items()):
        ours = tuple(seg for run in runs for seg in _slice(merged, run.full, run.count))
        theirs = tuple(seg for run in runs for seg in _slice(shards[rank], run.shard, run.count))
        count = sum(run.count for run in runs)
        out.append(Replica(f"{plan.name} ({kind}) on TP rank {rank}",
                           TensorSource(merged.name, (count,), merged.dtype, ours, merged.kind),
                           TensorSource(merged.name, (count,), shards[rank].dtype, theirs, merged.kind)))  # fmt: skip
    return out


REPLICA_SAMPLE = 4096  # elements compared at each end of every replica by default


def replica_mismatch(ckpt: ZeroCheckpoint, *, full: bool = False) -> str | None:
    """The first replicated tensor whose copy on another TP rank differs from the one written (the lowest TP
    rank's), or None. AutoTP keeps replicated parameters (norms, embeddings) identical on every TP rank, as
    ds_to_universal asserts; a copy that differs means a file from another save or run. Reads both ends of every
    replica (a foreign file differs throughout), or every element with `full`; compares bytes, chunk by chunk."""
    from ckpttools.layouts.crosscheck import OpenFiles, first_difference

    files = OpenFiles()
    try:
        for replica in ckpt.replicas:
            for merged, copy in _samples(replica, None if full else REPLICA_SAMPLE):
                if first_difference(merged, copy, files) is not None:
                    return replica.what
    finally:
        files.close()
    return None


def _samples(replica: Replica, n: int | None) -> list[tuple[TensorSource, TensorSource]]:
    total = replica.merged.numel()
    if n is None or total <= 2 * n:
        return [(replica.merged, replica.copy)]
    return [(_part(replica.merged, start, n), _part(replica.copy, start, n)) for start in (0, total - n)]


def _part(src: TensorSource, start: int, count: int) -> TensorSource:
    return TensorSource(src.name, (count,), src.dtype, tuple(_slice(src, start, count)), src.kind)


def check_replicas(ckpt: ZeroCheckpoint, *, full: bool = False) -> None:
    """Raise CorruptCheckpointError when TP ranks hold different values for a replicated parameter."""
    what = replica_mismatch(ckpt, full=full)
    if what is not None:
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: the replicated tensor {what} differs from TP rank 0's copy: the TP ranks' "
            "files are from different saves or runs (or damaged); re-copy the tag folder"
        )


def _index(ckpt: ZeroCheckpoint, name: str) -> int:
    return next(i for i, p in enumerate(ckpt.params) if p.name == name)


def _full(plan: TensorPlan, shards: Sequence[TensorSource]) -> TensorSource:
    """The full tensor as segments of the TP ranks' sources (each a flat run over its DP partitions)."""
    segments: list[Segment] = []
    for run in plan.runs:
        for seg in _slice(shards[run.rank], run.shard, run.count):
            last = segments[-1] if segments else None
            if last is not None and last.tensor is seg.tensor and last.start + last.count == seg.start:
                segments[-1] = Segment(seg.tensor, last.start, last.count + seg.count)
            else:
                segments.append(seg)
    first = shards[0]
    return TensorSource(first.name, plan.shape, first.dtype, tuple(segments), first.kind)


def _slice(src: TensorSource, start: int, count: int) -> Iterator[Segment]:
    """Elements [start, start + count) of a source, as segments of its stored tensors."""
    pos = 0
    for seg in src.segments:
        lo, hi = max(start, pos), min(start + count, pos + seg.count)
        if lo < hi:
            yield Segment(seg.tensor, seg.start + lo - pos, hi - lo)
        pos += seg.count
        if pos >= start + count:
            return


# --- The universal format ---------------------------------------------------------------------------------------


# What ds_to_universal records beside each full tensor (its keys in deepspeed.checkpoint.constants).
CAT_DIM, VOCAB_TENSOR = "cat_dim", "vocab_tensor"


def tensor_universal_files(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    """Relative path -> object: DeepSpeed's universal layout of an AutoTP checkpoint, as ds_to_universal writes it.

    Per trained parameter `zero/<name>/{fp32,<state>}.pt` = `{"param": <full tensor>, ...}` with ds_to_universal's
    markers (none for a parameter its affine map covers: the loading engine's own map re-splits it at any TP
    size; `cat_dim` 0/1 for concatenated ones without a map; `vocab_tensor` for vocabulary parameters) and the
    parameter's name, `step.pt`, `zero/optimizer_state.pt` (TP rank 0, DP rank 0's shared state) and every TP
    rank's model-states file unchanged.
    """
    opt = ckpt.optimizer
    if opt.param_groups is None:
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: elastic ZeRO-1/2 checkpoints carry no param_groups for the universal format; "
            "reshard natively instead"
        )
    info = ckpt.model_files[0].get("universal_checkpoint_info") or {}
    markers = {p.file_name: _universal_markers(info, p.file_name) for p in ckpt.params}

    def state_file(p: Param, src: TensorSource) -> dict[str, Any]:
        return {**markers[p.file_name], "param": whole_tensor(src, p.shape), NAME_KEY: p.file_name}

    files = param_files(ckpt.params, opt.group_scalars, state_file)
    files["zero/optimizer_state.pt"] = dict(opt.common)
    # ds_to_universal copies every TP rank's model-states file: their maps describe the saved TP shards
    files.update(zip(ckpt.layout.details["model_files"], ckpt.model_files, strict=True))
    return files


def _universal_markers(info: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The keys ds_to_universal's merge_tp_slices writes beside a parameter's full tensor (re.match, like it)."""

    def hit(key: str) -> bool:
        return any(re.match(str(pattern), name) for pattern in info.get(key) or [])

    affine = (info.get("affine_map") or {}).get("params") or {}
    markers: dict[str, Any] = {}
    if not any(re.match(str(pattern), name) for pattern in affine) and not hit("tp_replicated_parameter_patterns"):
        markers[CAT_DIM] = 1 if hit("parameter_with_row_parallelism_patterns") else 0  # the reader refused the rest
    if hit("vocabulary_parameter_patterns"):
        markers[VOCAB_TENSOR] = True
    return markers

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.io.torchwriter import whole_tensor
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.locate import MODEL_RE, OPTIM_RE, ZERO3_MODEL_RE, model_parallel_ranks
from ckpttools.layouts.rankfile import (
    MODEL_KEYS,
    OPTIM_KEYS,
    RankFile,
    check_agree,
    dict_at,
    dp_size_of,
    require_keys,
    zero_stage_of,
)
from ckpttools.layouts.tp_map import Run, TensorPlan, tensor_plans
from ckpttools.layouts.universal import NAME_KEY, param_files
from ckpttools.layouts.zero.read import Zero12Reader
from ckpttools.layouts.zero.write import check_sliced_reshard, sliced_tag_files
from ckpttools.model.checkpoint import Checkpoint, Param, Replica, Segment, TensorSource, slice_segments
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout


def read_tensor_parallel(loc: CheckpointLocation) -> Checkpoint:
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
    plans = tensor_plans(models, ranks)
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
    ranks: Sequence[Checkpoint],
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


# --- The merged checkpoint ----------------------------------------------------------------------------------


def _merged(
    loc: CheckpointLocation, ranks: list[Checkpoint], plans: dict[str, TensorPlan], models: list[RankFile], tp: int
) -> Checkpoint:
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
    ckpt = Checkpoint(
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
        ours = tuple(seg for run in runs for seg in slice_segments(merged, run.full, run.count))
        theirs = tuple(seg for run in runs for seg in slice_segments(shards[rank], run.shard, run.count))
        count = sum(run.count for run in runs)
        out.append(Replica(f"{plan.name} ({kind}) on TP rank {rank}",
                           TensorSource(merged.name, (count,), merged.dtype, ours, merged.kind),
                           TensorSource(merged.name, (count,), shards[rank].dtype, theirs, merged.kind)))  # fmt: skip
    return out


def _index(ckpt: Checkpoint, name: str) -> int:
    return next(i for i, p in enumerate(ckpt.params) if p.name == name)


def _full(plan: TensorPlan, shards: Sequence[TensorSource]) -> TensorSource:
    """The full tensor as segments of the TP ranks' sources (each a flat run over its DP partitions)."""
    segments: list[Segment] = []
    for run in plan.runs:
        for seg in slice_segments(shards[run.rank], run.shard, run.count):
            last = segments[-1] if segments else None
            if last is not None and last.tensor is seg.tensor and last.start + last.count == seg.start:
                segments[-1] = Segment(seg.tensor, last.start, last.count + seg.count)
            else:
                segments.append(seg)
    first = shards[0]
    return TensorSource(first.name, plan.shape, first.dtype, tuple(segments), first.kind)


# --- The universal format ---------------------------------------------------------------------------------------


# What ds_to_universal records beside each full tensor (its keys in deepspeed.checkpoint.constants).
CAT_DIM, VOCAB_TENSOR = "cat_dim", "vocab_tensor"


def tensor_universal_files(ckpt: Checkpoint) -> dict[str, Any]:
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


class AutoTpLayout:
    """AutoTP: a ZeRO-1/2 data-parallel group per TP rank, merged into full tensors through the TP map."""

    kind = "tensor"
    title = "tensor-parallel (AutoTP)"

    def claims(self, names: Sequence[str]) -> bool:
        return bool(model_parallel_ranks(names) - {0})

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_tensor_parallel(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        return []

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_sliced_reshard(ckpt, target, self.title)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        return tensor_universal_files(ckpt)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return tensor_universal_files(ckpt)
        return sliced_tag_files(ckpt, target)


LAYOUT = AutoTpLayout()

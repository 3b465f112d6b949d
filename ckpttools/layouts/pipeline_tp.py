"""Pipeline combined with tensor parallelism (Megatron-DeepSpeed / BLOOM 3D, PipelineModule with a TP mpu).

A save of S stages x T TP ranks x D DP ranks holds, in the tag folder:
  - `mp_rank_{m:02d}_model_states.pt` per model-parallel rank m = s * T + t (the grid's rank over the pipe x model
    ranks of one data slice, pipe-major): as a pipeline stage file (`module` None, whole-model `param_shapes` of
    TP rank t's shards), with `checkpoint_parallel_dimensions` {pp_degree: S, tp_degree: T}, `mp_world_size` S x T;
  - `layer_{i:02d}-model_{t:02d}-model_states.pt` per layer i and TP rank t: that rank's shard of the layer;
  - `{bf16_}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt`: ZeRO-1 over (stage s, TP rank t)'s params.
So each TP rank is a whole pipeline checkpoint (pipeline.read_pipeline reads it). How the TP shards of a param make
the full tensor is decided by the layer's code (column- or row-parallel, replicated, vocabulary-parallel) and
DeepSpeed records nothing of it; Megatron-DeepSpeed saves the rules in every mp_rank file as
`universal_checkpoint_info` (vocabulary_parameter_patterns with original/padded vocab size,
tp_replicated_parameter_patterns, parameter_with_row_parallelism_patterns, the rest concatenated on dim 0), which
DeepSpeed's ds_to_universal applies. This layout merges by those rules (tp_map, shared with AutoTP) and refuses
a folder without them: guessing a split would write wrong weights without a sign.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.layouts.autotp import _full, _index, _replicas, tensor_universal_files
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.locate import MODEL_RE, OPTIM_RE
from ckpttools.layouts.pipeline import PipelineFiles, StageGlobals, read_pipeline, refuse_inert_records, run_args
from ckpttools.layouts.rankfile import RankFile, check_agree
from ckpttools.layouts.tp_map import TensorPlan, halves_map, matching, plan_of, tensor_plans
from ckpttools.layouts.zero.write import check_sliced_reshard, sliced_tag_files
from ckpttools.model.checkpoint import Checkpoint, Param, Replica
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

LAYER_TP_RE = re.compile(r"^layer_(?P<layer>\d+)-model_(?P<tp>\d+)-model_states\.pt$")
INFO = "universal_checkpoint_info"
# Saved alike by every model-parallel rank of one save.
RANKS_AGREE = ("ds_config", "ds_version", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
               "global_steps", "global_samples", "skipped_steps", INFO)  # fmt: skip


def tp_rank_files(names: Sequence[str], where: str) -> list[PipelineFiles]:
    """The files of each TP rank, as a pipeline checkpoint of its own (stage s = mp_rank s * T + t)."""
    layers: dict[int, dict[int, str]] = {}
    models: dict[int, str] = {}
    optims: dict[int, dict[int, str]] = {}
    for name in names:
        if m := LAYER_TP_RE.match(name):
            layers.setdefault(int(m["tp"]), {})[int(m["layer"])] = name
        elif m := MODEL_RE.match(name):
            models[int(m["mp"])] = name
        elif m := OPTIM_RE.match(name):
            optims.setdefault(int(m["mp"]), {})[int(m["dp"])] = name
    tp = max(layers) + 1
    missing = [t for t in range(tp) if t not in layers]
    if missing:
        raise CheckpointNotFoundError(
            f"{where}: no layer file of TP rank {missing[0]} (layer_XX-model_{missing[0]:02d}-model_states.pt) "
            f"although TP rank {tp - 1}'s are here; re-copy the folder"
        )
    if not models or len(models) % tp:
        raise CheckpointNotFoundError(
            f"{where}: {len(models)} mp_rank_XX_model_states.pt files for {tp} TP ranks (one per stage and TP rank); "
            "the save may have been interrupted: re-copy the folder or pick another tag with --tag"
        )
    pp = (max(models) + 1 + tp - 1) // tp
    return [
        PipelineFiles(
            stages={s: models[s * tp + t] for s in range(pp) if s * tp + t in models},
            optims={s: optims[s * tp + t] for s in range(pp) if s * tp + t in optims},
            layers=layers[t],
        )
        for t in range(tp)
    ]


def read_pipeline_tp(loc: CheckpointLocation, rules: Mapping[str, Any] | None = None) -> Checkpoint:
    """Every TP rank read as a pipeline checkpoint, then merged into full tensors by the save's TP rules.

    `rules`: the merge rules of a save that carries none (DeepSpeed's PipelineModule with a TP mpu), in the form of
    Megatron-DeepSpeed's `universal_checkpoint_info` (the pattern lists, `original_vocab_size`; a param no list
    names is concatenated on dim 0, as ds_to_universal does). They are put into the model files' dicts as if saved
    there, so a reshard writes them into its mp_rank files and the result carries them. A save with its own rules
    refuses different ones.

    Raises:
        CheckpointNotFoundError: a TP rank's layer, stage or optimizer file is missing (named).
        CorruptCheckpointError: files that disagree across TP ranks, shards the rules do not tile.
        UnsupportedCheckpointError: no universal_checkpoint_info and no `rules`: nothing says how params are
            split; `rules` that contradict the saved ones.
    """
    names = list(getattr(loc.files, "names", None) or sorted(p.name for p in loc.tag_dir.iterdir()))
    per_tp = tp_rank_files(names, str(loc.tag_dir))
    tp = len(per_tp)
    models = [RankFile(loc.tag_dir / f.stages[s], load_pickle(loc.tag_dir / f.stages[s], extra_globals=StageGlobals()),
                       "model-states") for s in sorted(per_tp[0].stages) for f in per_tp if s in f.stages]  # fmt: skip
    with RecordReader() as reader:
        for key in RANKS_AGREE:
            check_agree(models, [f.obj.get(key) for f in models], key, reader)
        reader.finish()
    models = _with_rules(loc, models, rules)
    _require_rules(loc, models[0], tp)
    ranks = [read_pipeline(loc, files, tp) for files in per_tp]
    for t, c in enumerate(ranks[1:], 1):
        if c.keys != ranks[0].keys:
            raise CorruptCheckpointError(
                f"{loc.tag_dir}: TP rank {t}'s files hold other parameters than TP rank 0's; files of different "
                "runs are mixed: re-copy the tag folder"
            )
    return _merged(loc, ranks, _plans(models[0], ranks), models, tp)


HALVES = "parameter_with_2_sub_params_cat_dim_0"


def _plans(f0: RankFile, ranks: list[Checkpoint]) -> dict[str, TensorPlan]:
    """tp_map's plans, and for Megatron-DeepSpeed's SwiGLU `dense_h_to_4h` (listed in `HALVES`: each TP rank holds
    [its gate rows; its up rows]) the merge ds_to_universal makes: every rank's first half, then every second half
    ([gate; up] of the whole layer), as an affine map of two pieces per rank."""
    info = f0.obj[INFO]
    halves = [str(p) for p in info.get(HALVES) or []]
    if not halves or info.get("affine_map"):
        return tensor_plans([f0], ranks)
    f0 = RankFile(f0.path, {**f0.obj, INFO: {k: v for k, v in info.items() if k != HALVES}}, f0.what)
    plans = tensor_plans([f0], ranks)
    for name, plan in plans.items():
        if matching(f0, name, dict.fromkeys(halves)) is not None:
            plans[name] = plan_of(f0, name, halves_map(plan.shard_shapes), list(plan.shard_shapes), None)
    return plans


def _with_rules(loc: CheckpointLocation, models: list[RankFile], rules: Mapping[str, Any] | None) -> list[RankFile]:
    if rules is None:
        return models
    saved = models[0].obj.get(INFO)
    if saved is not None and saved != dict(rules):
        raise UnsupportedCheckpointError(
            f"{loc.tag_dir}: the TP merge rules given differ from the {INFO} saved in {models[0].path.name}; the "
            "saved ones are what the training code wrote: drop the rules given"
        )
    return [RankFile(f.path, {**f.obj, INFO: dict(rules)}, f.what) for f in models]


def _require_rules(loc: CheckpointLocation, f0: RankFile, tp: int) -> None:
    info = f0.obj.get(INFO)
    if info is None:
        raise UnsupportedCheckpointError(
            f"{loc.tag_dir} is a pipeline x tensor-parallel checkpoint (TP {tp}) whose files do not say how each "
            f"parameter is split over TP ({f0.path.name} has no {INFO}, which Megatron-DeepSpeed saves): the layer "
            "code decides it, so ckpttools will not guess; save with Megatron-DeepSpeed's client state or convert "
            "with the training code"
        )
    if not isinstance(info, dict):
        raise f0.fail(f"{INFO} is a {type(info).__name__}, not a dict")


def _merged(
    loc: CheckpointLocation, ranks: list[Checkpoint], plans: dict[str, TensorPlan], models: list[RankFile], tp: int
) -> Checkpoint:
    """One checkpoint of full tensors (segments over the TP ranks' sources); slices: every (stage, TP rank)'s
    ZeRO-1 group in mp_rank order, which a DP reshard re-cuts one by one."""
    first = ranks[0]
    params = []
    replicas: list[Replica] = []
    for p in first.params:
        plan = plans[p.name]
        per_rank = [c.params[_index(c, p.name)] for c in ranks]
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
    pp = len(first.slices)
    slices = [ranks[t].slices[s] for s in range(pp) for t in range(tp)]  # mp_rank = s * tp + t
    return Checkpoint(
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
        shared_params={},
        frozen_excluded=False,
        ds_config=first.ds_config,
        model_files=[f.obj for f in models],
        layout=_layout(first, pp, tp, plans, models),
        slices=slices,
        replicas=replicas,
        layout_files=sorted(n for c in ranks for n in c.layout_files),
    )


def _layout(
    first: Checkpoint, pp: int, tp: int, plans: dict[str, TensorPlan], models: list[RankFile]
) -> ParallelLayout:
    info = models[0].obj[INFO]
    halves = {} if info.get("affine_map") else dict.fromkeys(str(p) for p in info.get(HALVES) or [])
    split: dict[str, list[str]] = {}
    for name, plan in plans.items():
        how = "halves of each rank, joined ([gate; up])" if matching(models[0], name, halves) else _split_of(plan)
        split.setdefault(how, []).append(name)
    details = {
        "layer_stage": first.layout.details.get("layer_stage", {}),
        "tied": first.layout.details.get("tied", {}),
        "tp_split": split,
        "original_vocab_size": info.get("original_vocab_size"),
        "padded_vocab_size": info.get("padded_vocab_size"),
        "model_files": [f.path.name for f in models],
    }
    args = run_args(models[0].obj)
    if args:
        details["args"] = args  # Megatron-DeepSpeed's: what adapters.megatron_deepspeed maps the names with
    return ParallelLayout(kind="pipeline_tp", dp=first.dp_world_size, tp=tp, pp=pp, details=details)


def _split_of(plan: TensorPlan) -> str:
    """How the TP shards make the full tensor: `replicated`, `dim N` (concatenated), and a vocabulary cut."""
    shard, full = plan.shard_shapes[0], plan.logical_shape
    if all(s == tuple(full) for s in plan.shard_shapes):
        how = "replicated"
    else:
        dims = [d for d in range(len(full)) if shard[d] != full[d]]
        how = f"dim {dims[0]}" if len(dims) == 1 else "affine map"
    return how + (f", vocabulary cut to {plan.shape[0]} rows" if plan.shape != tuple(full) else "")


class PipelineTpLayout:
    """PipelineModule x tensor parallel: every TP rank a pipeline checkpoint, merged by universal_checkpoint_info."""

    kind = "pipeline_tp"
    title = "pipeline x tensor-parallel (Megatron-DeepSpeed 3D)"

    def claims(self, names: Sequence[str]) -> bool:
        return any(LAYER_TP_RE.match(n) for n in names)

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_pipeline_tp(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        by_stage: dict[int, list[str]] = {}
        for layer, stage in (parallel.get("layer_stage") or {}).items():
            by_stage.setdefault(int(stage), []).append(str(layer))
        stages = "; ".join(f"stage {s}: layers {', '.join(ls)}" for s, ls in sorted(by_stage.items()))
        lines = [f"stages         {stages or parallel.get('pp')}"]
        for how, names in sorted((parallel.get("tp_split") or {}).items()):
            lines.append(f"TP split       {how}: {', '.join(names)}")
        return lines

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_sliced_reshard(ckpt, target, self.title)
        refuse_inert_records(ckpt)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        """As ds_to_universal writes a Megatron-DeepSpeed 3D save: every param's full tensors with its merge
        markers (cat_dim, vocab_tensor), the shared optimizer state, every mp_rank file unchanged."""
        return tensor_universal_files(ckpt)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return tensor_universal_files(ckpt)
        return sliced_tag_files(ckpt, target)


LAYOUT = PipelineTpLayout()

"""DeepSpeed's universal checkpoint format, read into the same model as native checkpoints, and written from it.

Layout (`ds_to_universal`'s, and what `"checkpoint": {"load_universal": true}` reads):
    <root>/latest_universal                       the tag
    <root>/<tag>/*_model_states.pt                the native model-state files, unchanged
    <root>/<tag>/zero/optimizer_state.pt          optimizer state that is not per parameter
    <root>/<tag>/zero/<param>/fp32.pt             full fp32 master ({"param": tensor, "cat_dim": 0} or a bare tensor)
    <root>/<tag>/zero/<param>/<state>.pt          each optimizer state under its own key (exp_avg, momentum_buffer, ...)
    <root>/<tag>/zero/<param>/step.pt             the optimizer step (ZeRO-1/2; ZeRO-3 keeps it in optimizer_state.pt)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, load_pickle
from ckpttools.io.torchwriter import whole_tensor
from ckpttools.layouts.locate import HF_SIDE_FILES, MODEL_RE, ZERO3_MODEL_RE, check_tag_name
from ckpttools.layouts.rankfile import (
    RankFile,
    check_ties_and_keys,
    check_unique_names,
    dict_at,
    param_shapes_of,
    read_module,
    shape_of,
    train_dtype_of,
    zero_stage_of,
)
from ckpttools.layouts.tp_map import full_shapes
from ckpttools.layouts.zero.pieces import is_muon_group
from ckpttools.layouts.zero.read import zero3_frozen, zero3_optimizer_parts, zero12_bit16
from ckpttools.model.checkpoint import (
    MASTER,
    Checkpoint,
    OptimizerState,
    Param,
    Segment,
    TensorSource,
    strip_prefixes,
)
from ckpttools.model.origin import CheckpointLocation, TagFiles
from ckpttools.model.parallel import ParallelLayout

LATEST = "latest_universal"
STEP = "step"
NAME_KEY = "param_name"  # written by ckpttools: the parameter a state file belongs to


def is_universal(path: Path) -> bool:
    """A universal root (holding latest_universal) or one of its tag folders (holding zero/optimizer_state.pt)."""
    return (path / LATEST).is_file() or (path / "zero" / "optimizer_state.pt").is_file()


def resolve_root(path: Path, tag: str | None) -> tuple[Path, str]:
    """The universal checkpoint's root and tag for a root (`latest_universal`, or `tag`) or a tag folder."""
    if (path / "zero").is_dir():
        return path.parent, path.name
    if tag is None:
        latest = path / LATEST
        if not latest.is_file():
            raise CheckpointNotFoundError(f"{path} has no {LATEST} file; pass --tag")
        try:
            tag = latest.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointNotFoundError(f"{latest} is not a text file naming a tag; pass --tag") from e
    return path, check_tag_name(tag)


def read_universal(path: Path | str, *, tag: str | None = None) -> Checkpoint:
    """Open a universal checkpoint (root or tag folder) into the validated checkpoint model.

    Raises:
        CkptError subclasses naming the file: missing per-parameter files, sizes that do not match the
        parameter, optimizer state keys or steps that differ between parameters of one group.
    """
    root, tag = resolve_root(Path(path), tag)
    tag_dir = root / tag
    zero = tag_dir / "zero"
    if not (zero / "optimizer_state.pt").is_file():
        raise CheckpointNotFoundError(f"{zero / 'optimizer_state.pt'} is missing: not a universal checkpoint tag")
    common_file = RankFile(
        zero / "optimizer_state.pt", load_pickle(zero / "optimizer_state.pt"), "universal optimizer-state"
    )
    stage = zero_stage_of(common_file, common_file.obj)
    models = _model_files(tag_dir, stage)
    f0 = models[0]
    mod = read_module(f0)
    shapes = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
    check_unique_names(f0, shapes)
    tp = len(models) if stage != 3 else 1
    if tp > 1:  # AutoTP: each rank's model file lists its shard shapes; zero/ holds the merged tensors
        full = full_shapes(models, [name for group in shapes for name, _ in group])
        shapes = [[(name, full[name]) for name, _ in group] for group in shapes]
    groups, scalars_of, common = _groups(common_file, stage, len(shapes))
    params = [
        _param(zero, name, shape, groups[g], tp > 1) for g, entries in enumerate(shapes) for name, shape in entries
    ]
    params.sort(key=lambda p: p.group)
    by_name = {p.name: p for p in params}
    scalars = scalars_of if stage == 3 else _steps(zero, params)
    _same_state_keys(zero, params)
    dp = int(f0.get(f0.obj, "dp_world_size", int))
    bit16 = zero3_frozen(models, dp) if stage == 3 else zero12_bit16(f0, mod, by_name)
    if tp > 1:  # a TP rank's module holds its shards, which the merged fp32 masters replace
        _refuse_frozen_tp_shards(tag_dir, bit16, by_name)
        bit16 = {}
    check_ties_and_keys(f0, mod, by_name, {n: s for n, s in bit16.items() if n not in by_name})
    ds_config = dict_at(f0.obj, "ds_config")
    prefix = "bf16_" if dict_at(ds_config, "bf16").get("enabled") else ""
    files = TagFiles({i: m.path.name for i, m in enumerate(models)}, {}, prefix, stage == 3)
    side = [name for name in ("config.json", *HF_SIDE_FILES) if (root / name).is_file()]
    return Checkpoint(
        location=CheckpointLocation(root, tag, tag_dir, files, None, side),
        zero_stage=stage,
        dp_world_size=dp,
        train_dtype=train_dtype_of(mod.tensors, by_name),
        optimizer_kind="zero" if "zero_stage" in common_file.obj else "bf16_optimizer",
        ds_version=str(f0.obj.get("ds_version", "")),
        global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
        keys=mod.keys,
        params=params,
        optimizer=OptimizerState(scalars, common, {"ds_config": ds_config, "ds_version": f0.obj.get("ds_version")}),
        bit16=bit16,
        buffers=mod.buffers,
        shared_params=mod.shared,
        frozen_excluded=False,
        ds_config=ds_config,
        model_files=[m.obj for m in models],
        source_format="universal",
        layout=ParallelLayout("tensor", dp=dp, tp=tp) if tp > 1 else ParallelLayout("dp", dp=dp),
    )


def _refuse_frozen_tp_shards(tag_dir: Path, bit16: dict[str, TensorSource], params: dict[str, Param]) -> None:
    """Frozen params of a TP run exist only as the TP ranks' shards, which a universal folder does not merge."""
    frozen = sorted(n for n in bit16 if n not in params)
    if frozen:
        raise UnsupportedCheckpointError(
            f"{tag_dir} is a tensor-parallel universal checkpoint with frozen parameters ({short(frozen[0], 60)}, "
            "...): they exist only as TP shards, which ckpttools does not merge from a universal folder; use the "
            "native checkpoint it was converted from"
        )


def _model_files(tag_dir: Path, stage: int) -> list[RankFile]:
    pattern = ZERO3_MODEL_RE if stage == 3 else MODEL_RE
    found = {}
    for p in tag_dir.iterdir():
        if m := pattern.match(p.name):
            found[int(m["dp"] if stage == 3 else m["mp"])] = p
    if not found:
        raise CheckpointNotFoundError(
            f"{tag_dir} has no {'zero_pp_rank_*_' if stage == 3 else ''}mp_rank_00_model_states.pt"
        )
    if set(found) != set(range(len(found))):
        raise CorruptCheckpointError(
            f"{tag_dir}: model-state files for ranks {sorted(found)}; expected 0-{len(found) - 1}"
        )
    models = [RankFile(found[i], load_pickle(found[i]), "model-states") for i in range(len(found))]
    if stage != 3 and len(found) > 1:
        first = models[0].obj
        pp = dict_at(first, "checkpoint_parallel_dimensions").get("pp_degree")
        kind = "pipeline" if isinstance(pp, int) and pp > 1 else None
        if kind is None and not isinstance(first.get("universal_checkpoint_info"), dict):
            kind = "model-parallel"  # neither a pipeline nor AutoTP's map: nothing says how the shards merge
        if kind is not None:
            raise UnsupportedCheckpointError(
                f"{tag_dir} holds {len(found)} mp_rank_*_model_states.pt files: a {kind} universal "
                "checkpoint, which ckpttools does not read back; use the native checkpoint it was converted from, "
                'or load it in DeepSpeed with "checkpoint": {"load_universal": true}'
            )
    dp = models[0].obj.get("dp_world_size")
    if stage == 3 and dp != len(models):
        raise CheckpointNotFoundError(
            f"{tag_dir} holds {len(models)} ZeRO-3 model-state files, the checkpoint was written at DP "
            f"{short(dp, 20)}; one is missing (copy them all: they carry the frozen parameters)"
        )
    return models


def _groups(f: RankFile, stage: int, num_shape_groups: int) -> tuple[list[int], list[dict[str, Any]], dict[str, Any]]:
    """Param group of each param_shapes group, per-group scalar state (ZeRO-3), and the shared optimizer state."""
    common = dict(f.obj)
    if stage != 3:
        groups = f.get(common, "param_groups", list)
        if len(groups) != num_shape_groups:
            raise f.fail(f"has {len(groups)} param groups, the model states {num_shape_groups}")
        return list(range(num_shape_groups)), [], common
    group_of, scalars, shared = zero3_optimizer_parts(f, common, num_shape_groups)
    return [group_of[sg] for sg in range(num_shape_groups)], scalars, shared


def _param_dir(zero: Path, name: str) -> Path:
    try:
        return zero / check_tag_name(name)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{zero}: parameter name {short(name, 60)} is not a folder name") from e


def _param(zero: Path, name: str, shape: tuple[int, ...], group: int, tensor_parallel: bool = False) -> Param:
    folder = _param_dir(zero, name)
    if not (folder / f"{MASTER}.pt").is_file():
        raise CheckpointNotFoundError(f"universal checkpoint lacks {folder / (MASTER + '.pt')}")
    stripped = strip_prefixes(name)
    fp32 = _state_source(folder / f"{MASTER}.pt", name, shape, "trainable", tensor_parallel)
    if fp32.dtype != dtypes.FLOAT32:
        raise CorruptCheckpointError(f"{folder / (MASTER + '.pt')} is stored as {fp32.dtype.name}, not float32")
    states = {}
    for p in sorted(folder.glob("*.pt")):
        if p.stem not in (MASTER, STEP):
            states[p.stem] = _state_source(p, name, shape, "state", tensor_parallel)
    return Param(stripped, name, shape, group, 0, fp32, states)


def _state_source(
    path: Path, name: str, shape: tuple[int, ...], kind: str, tensor_parallel: bool = False
) -> TensorSource:
    f = RankFile(path, {"value": load_pickle(path)}, "universal state")
    value = f.obj["value"]
    tensor = value.get("param") if isinstance(value, dict) else value
    t = f.tensor(tensor, "its tensor")
    owner = value.get(NAME_KEY, name) if isinstance(value, dict) else name
    if owner != name:
        raise CorruptCheckpointError(
            f"{path} holds a state of {short(owner)}, not of {name}: files were moved between parameter folders; "
            "re-copy the universal checkpoint"
        )
    name = strip_prefixes(name)
    if isinstance(value, dict) and "vocab_tensor" in value and not tensor_parallel:
        raise f.fail("holds tensor-parallel merge information, but the folder has one model-states file; re-copy it")
    numel = 1
    for s in shape_of(f, shape, "the parameter's shape"):
        numel *= s
    if t.numel() != numel:
        raise CorruptCheckpointError(f"{path} holds {t.numel()} elements, parameter {name} has {numel}; re-copy it")
    return TensorSource(name, shape, t.dtype, (Segment(t, 0, numel),), kind)


def _steps(zero: Path, params: list[Param]) -> list[dict[str, Any]]:
    """ZeRO-1/2: each group's step, from its params' step.pt files, which must agree (DeepSpeed asserts so)."""
    scalars: list[dict[str, Any]] = []
    for p in params:
        path = _param_dir(zero, p.file_name) / f"{STEP}.pt"
        step = load_pickle(path) if path.is_file() else None
        if step is not None and not isinstance(step, (int, float, LazyTensor)):
            raise CorruptCheckpointError(f"{path} holds a {type(step).__name__}, not a step count")
        while len(scalars) <= p.group:
            scalars.append({"first": p, "step": step})
        first = scalars[p.group]
        if _step_value(step) != _step_value(first["step"]):
            raise CorruptCheckpointError(
                f"{path} records step {_step_value(step)}, {first['first'].file_name} of the same group "
                f"{_step_value(first['step'])}: files from different saves are mixed"
            )
    return [{STEP: s["step"]} if s["step"] is not None else {} for s in scalars]


def _step_value(step: Any) -> Any:
    if isinstance(step, LazyTensor):
        return ("tensor", step.dtype.name, step.record.crc32)
    return step


def _same_state_keys(zero: Path, params: list[Param]) -> None:
    by_group: dict[int, Param] = {}
    for p in params:
        first = by_group.setdefault(p.group, p)
        for key in set(first.states) ^ set(p.states):
            owner = p if key not in p.states else first
            raise CheckpointNotFoundError(
                f"universal checkpoint lacks {_param_dir(zero, owner.file_name) / (key + '.pt')} (other parameters "
                "of its group have it); re-copy the folder"
            )


# --- Writing -----------------------------------------------------------------------------------------------


def _state_file(p: Param, src: TensorSource) -> dict[str, Any]:
    # NAME_KEY lets a reader see a file moved to another parameter's folder (DeepSpeed ignores extra keys)
    return {"param": whole_tensor(src, p.shape), "cat_dim": 0, NAME_KEY: p.file_name}


StateFile = Callable[[Param, TensorSource], dict[str, Any]]  # one state's file object, from its param and source


def param_files(params: Sequence[Param], group_scalars: Sequence[dict[str, Any]],
                state_file: StateFile = _state_file) -> dict[str, Any]:  # fmt: skip
    """`zero/<name>/{fp32,<state>}.pt` (each `state_file(param, source)`) and `step.pt`, for every param."""
    files: dict[str, Any] = {}
    for p in params:
        folder = f"zero/{p.file_name}"
        for key, src in {MASTER: p.fp32, **p.states}.items():
            files[f"{folder}/{key}.pt"] = state_file(p, src)
        if STEP in group_scalars[p.group]:
            files[f"{folder}/{STEP}.pt"] = group_scalars[p.group][STEP]
    return files


def universal_files(ckpt: Checkpoint) -> dict[str, Any]:
    """Relative path -> object: the universal layout of a checkpoint, one folder per parameter.

    Every state file is `{"param": full-shape tensor, "cat_dim": 0}`, for all stages, under the optimizer's
    own state key, with a `step.pt` beside it when the optimizer keeps a step (ds_to_universal writes bare
    flat tensors and no step.pt for ZeRO-3; DeepSpeed reads both). A checkpoint saved before the first
    optimizer step has only fp32.pt files. The shared optimizer state is lean: no rank's shard in it.
    """
    # DeepSpeed's universal loader would misplace what it cannot tell apart; AutoTP has its own writer
    # (tensor.tensor_universal_files)
    if ckpt.layout.kind != "dp":
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} is not a plain data-parallel checkpoint ({ckpt.layout.describe()}); "
            "writing it in the universal format is not supported yet"
        )
    opt = ckpt.optimizer
    groups = opt.param_groups
    if groups is None:
        raise CorruptCheckpointError(
            "elastic ZeRO-1/2 checkpoints carry no param_groups for the universal format; reshard natively instead"
        )
    refuse_muon(ckpt, groups)
    files = param_files(ckpt.params, opt.group_scalars)
    common = dict(opt.common)
    if ckpt.zero_stage == 3:  # DeepSpeed reads the step from state[first sub-group]; keyed like its sub-groups
        state = {
            int(pg["params"][0]): dict(opt.group_scalars[g]) for g, pg in enumerate(groups) if opt.group_scalars[g]
        }
        common["optimizer_state_dict"] = {"state": state, "param_groups": groups}
    files["zero/optimizer_state.pt"] = common
    return files


# What DeepSpeed 0.19.8 answers when it resumes a Muon run from the universal form (tests/test_muon.py runs both).
MUON_ZERO12_ERROR = "RuntimeError: start (0) + length (192) exceeds dimension size (124)."
MUON_ZERO3_ERROR = "KeyError: 0"


def refuse_muon(ckpt: Checkpoint, groups: Sequence[Any]) -> None:
    """DeepSpeed cannot resume its Muon optimizer from a universal checkpoint, so none is written.

    ZeRO-1/2's loader reads every `<key>.pt` of a param folder but puts each state back as the rank's slice of the
    partition, while its Muon step keeps the momentum as the whole params of the partition: the load passes and the
    first step fails (MUON_ZERO12_ERROR, in get_flat_partition's narrow). ZeRO-3's loader
    (load_hp_checkpoint_state_from_checkpoint_dir_stage3) reads `fp32`, `exp_avg` and `exp_avg_sq` of every param
    and `optimizer_state.pt`'s state[0]['step'], none of which a Muon group has (MUON_ZERO3_ERROR); DeepSpeed's own
    ds_to_universal stops before, with `KeyError: 'exp_avg'` (#8608). Native resharding keeps Muon's state.
    """
    if any(is_muon_group(g) for g in groups):
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} was trained with DeepSpeed's Muon optimizer (param groups with use_muon), which "
            f"DeepSpeed 0.19.8 cannot resume from the universal format (ZeRO-1/2: the load passes, then its first step "
            f'fails with "{MUON_ZERO12_ERROR}"; ZeRO-3: "{MUON_ZERO3_ERROR}", its loader reads Adam\'s exp_avg and '
            "exp_avg_sq only); reshard natively instead (--dp, --stage), which keeps the Muon momentum"
        )

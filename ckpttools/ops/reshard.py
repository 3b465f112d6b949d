"""Reshard a ZeRO checkpoint to a new data-parallel size, or to and from DeepSpeed's universal format.

DeepSpeed refuses to load a checkpoint saved at another DP size. The fp32 master weights and every
optimizer state are laid out by pure arithmetic (see `partition`), so they can be re-cut offline.
The validated checkpoint model (`sources.open_checkpoint`: native of any layout, or universal) already describes
every state of every parameter as the flat stored slices it is made of; the new files are planned as
slices of those plus zero padding, exactly as DeepSpeed lays them out for the new size, and streamed
into place. Native results load with a plain `engine.load_checkpoint` at the new size
and the user's unchanged config; universal ones with `"checkpoint": {"load_universal": true}`.
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError, short
from ckpttools.io.staging import check_output_dir, shared_staged_folder, staged_folder
from ckpttools.io.torchfile import LazyTensor, Record, RecordReader, TorchSize, load_pickle
from ckpttools.io.torchwriter import NewTensor, ProgressFn, Slice, write_torch_files
from ckpttools.layouts import moe, zero0
from ckpttools.layouts.autotp import tensor_universal_files
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.pipeline import pipeline_universal_files
from ckpttools.layouts.registry import checkpoint_root, open_checkpoint
from ckpttools.layouts.universal import MASTER, universal_files
from ckpttools.layouts.zero import partition, stages
from ckpttools.layouts.zero.pieces import (
    Flat,
    Pieces,
    cut_group,
    group_count,
    group_keys,
    group_params,
    master_partition,
    new_tensor,
    padded,
    pieces_of,
    state_of,
)
from ckpttools.model.checkpoint import Param, TensorSource, ZeroCheckpoint, strip_prefixes
from ckpttools.model.parallel import KIND_NAMES
from ckpttools.ops import hf
from ckpttools.ranks import nodelocal
from ckpttools.ranks.distributed import check_records, plan_by_bytes

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import ProcessGroup

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default
_ProgressFns = tuple[ProgressFn | None, ProgressFn | None]  # (on_start, on_progress)


@dataclass
class ReshardResult:
    output_dir: str | None
    tag: str
    zero_stage: int
    dp_from: int | None  # None when the source is a universal checkpoint
    dp_to: int | None  # None when the output is a universal checkpoint
    files: list[str]
    notes: list[str] = field(default_factory=list)
    zero_stage_from: int | None = None  # the source's stage when --stage changed it
    world_size: int | None = None  # set by a run on many ranks, with the rank that wrote each file
    ranks: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d if self.world_size is not None else {k: v for k, v in d.items() if k not in ("world_size", "ranks")}


# --- Native ZeRO-1/2 rank files -----------------------------------------------------------------------------


def _zero12_files(ckpt: ZeroCheckpoint, dp: int, stage: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    opt = ckpt.optimizer
    bf16_optimizer = ckpt.optimizer_kind == "bf16_optimizer"
    num_groups = group_count(ckpt)
    param_groups = opt.param_groups
    if ckpt.zero_stage == 3 and param_groups is not None:  # ZeRO-1/2: one flat fp32 partition per group
        param_groups = [{**pg, "params": [g]} for g, pg in enumerate(param_groups)]
    if stage == ckpt.zero_stage:
        common = {k: v for k, v in opt.common.items() if k != "param_groups"}
    else:
        common = stages.optimizer_common(ckpt, stage)
        common["param_alignment_paddings"] = [[0] * len(group_params(ckpt, g)) for g in range(num_groups)]
    osds = [{**common, "single_partition_of_fp32_groups": [], "group_paddings": [], "param_slice_mappings": [],
             "partition_count": [dp] * num_groups,
             "base_optimizer_state": [] if opt.elastic else {"state": {}, "param_groups": param_groups}}
            for _ in range(dp)]  # fmt: skip
    for g in range(num_groups):
        scalars = opt.group_scalars[g] if g < len(opt.group_scalars) else {}
        parts = cut_group(group_params(ckpt, g), scalars, dp, bf16_optimizer=bf16_optimizer, elastic=opt.elastic)
        for osd, part in zip(osds, parts, strict=True):
            osd["single_partition_of_fp32_groups"].append(part.master)
            if opt.elastic:
                osd["base_optimizer_state"].append(part.state)
            elif part.state:  # before the first optimizer step the torch optimizer has no state at all
                osd["base_optimizer_state"]["state"][g] = part.state
            osd["group_paddings"].append(part.padding)
            osd["param_slice_mappings"].append(part.mapping)
    if bf16_optimizer:
        for osd in osds:
            osd.pop("param_alignment_paddings", None)
    if stage == ckpt.zero_stage:
        model, meta = {**ckpt.model_files[0], "dp_world_size": dp}, opt.file_meta
    else:
        model, meta = stages.zero12_model_state(ckpt, stage, dp), stages.file_meta_at(ckpt, stage)
    return [model], [{**meta, "optimizer_state_dict": o} for o in osds]


# --- Native ZeRO-3 rank files -------------------------------------------------------------------------------


def split_subgroups(partition_numels: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's `_create_fp16_sub_groups`: close a sub-group once it reaches sub_group_size elements."""
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


def _zero3_slice(flat: Flat, numel: int, dp: int, rank: int) -> Pieces:
    """Rank `rank`'s ceil(numel/dp) elements of a parameter; padding is zero, never uninitialised memory."""
    p = partition.zero3_partition_numel(numel, dp)
    n = max(0, min(p, numel - rank * p))
    return padded(flat.take(rank * p, n) if n else [], p - n)


def _sub_group_size(ckpt: ZeroCheckpoint) -> int:
    zero_cfg = (ckpt.optimizer.file_meta.get("ds_config") or {}).get("zero_optimization") or {}
    try:
        size = int(float(zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))
    except (TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"the run's zero_optimization.sub_group_size {short(zero_cfg.get('sub_group_size'), 30)} is not a number"
        ) from e
    return max(size, 1)


def _zero3_files(ckpt: ZeroCheckpoint, dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    changed = ckpt.zero_stage != 3
    opt = ckpt.optimizer
    groups = opt.param_groups or []
    sub_group_size = _sub_group_size(ckpt)
    subgroups: list[list[Param]] = []
    param_groups = []
    for g, pg in enumerate(groups):
        group = group_params(ckpt, g)
        ids = []
        for indices in split_subgroups([partition.zero3_partition_numel(p.numel, dp) for p in group], sub_group_size):
            ids.append(len(subgroups))
            subgroups.append([group[i] for i in indices])
        param_groups.append({**pg, "params": ids})
    common = (
        stages.optimizer_common(ckpt, 3) if changed else {k: v for k, v in opt.common.items() if k != "param_groups"}
    )
    meta = stages.file_meta_at(ckpt, 3) if changed else opt.file_meta
    keys_of = {g: group_keys(group_params(ckpt, g)) for g in range(len(groups))}
    flats = _Flats()
    optim_files = []
    for r in range(dp):
        flat, state = [], {}
        for sg, members in enumerate(subgroups):
            g = members[0].group
            flat.append(master_partition(_rank_pieces(members, MASTER, dp, r, flats)))
            entry = {k: _own_copy(v) for k, v in opt.group_scalars[g].items()}
            entry.update(
                {k: new_tensor(members[0].states[k].dtype, _rank_pieces(members, k, dp, r, flats)) for k in keys_of[g]}
            )
            if entry:  # before the first optimizer step the torch optimizer has no state at all
                state[sg] = entry
        osd = {**common, "partition_count": dp, "fp32_flat_groups": flat,
               "optimizer_state_dict": {"state": state, "param_groups": param_groups}}  # fmt: skip
        optim_files.append({**meta, "optimizer_state_dict": osd})
    return _zero3_model_files(ckpt, subgroups, dp), optim_files


def _rank_pieces(members: list[Param], key: str, dp: int, rank: int, flats: _Flats) -> Pieces:
    """One rank's flat partition of a state over a sub-group: each member's slice, in order."""
    return [x for p in members for x in _zero3_slice(flats.of(state_of(p, key)), p.numel, dp, rank)]


class _Flats:
    """One `Flat` per stored state, built once however many ranks cut it."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[TensorSource, Flat]] = {}

    def of(self, src: TensorSource) -> Flat:
        if id(src) not in self.cache:
            self.cache[id(src)] = (src, Flat(pieces_of(src)))
        return self.cache[id(src)][1]


def _own_copy(value: Any) -> Any:
    """A stored tensor written as its own storage: torch AdamW's 0-dim `step` must not be shared between
    sub-groups, or each optimizer step would advance it once per sub-group."""
    if isinstance(value, LazyTensor):
        return NewTensor(value.dtype, (Slice(value, 0, value.numel()),), value.shape)
    return value


def _zero3_model_files(ckpt: ZeroCheckpoint, subgroups: list[list[Param]], dp: int) -> list[dict[str, Any]]:
    flats = _Flats()
    model0 = ckpt.model_files[0]
    param_shapes = [OrderedDict((p.file_name, TorchSize(p.shape)) for p in members) for members in subgroups]
    module, frozen_shapes = stages.zero3_module(ckpt)
    changed = ckpt.zero_stage != 3
    frozen_raw = frozen_shapes if changed else (model0.get("frozen_param_shapes") or {})
    extra = {"module": module, "frozen_param_shapes": frozen_shapes,
             "ds_config": stages.ds_config_at(model0.get("ds_config"), 3)} if changed else {}  # fmt: skip
    files = []
    for r in range(dp):
        fragments = OrderedDict()
        for raw in frozen_raw:
            src = ckpt.bit16[strip_prefixes(raw)]
            fragments[raw] = NewTensor(src.dtype, tuple(_zero3_slice(flats.of(src), src.numel(), dp, r)))
        files.append({**model0, **extra, "dp_world_size": dp, "param_shapes": param_shapes,
                      "frozen_param_fragments": fragments if frozen_raw or changed
                      else model0.get("frozen_param_fragments"),
                      "shared_params": model0.get("shared_params") if r == 0 else {}})  # fmt: skip
    return files


# --- Files around the tag: latest, Trainer files, RNG states ------------------------------------------------


@dataclass(frozen=True)
class _RngScheme:
    """How a framework names its per-process RNG files beside the checkpoint."""

    glob: str
    per_rank: str  # with {} for the rank
    single: str | None  # the name at one process, when it differs
    who: str


RNG_SCHEMES = (
    _RngScheme("rng_state*.pth", "rng_state_{}.pth", "rng_state.pth", "the Trainer"),
    _RngScheme("random_states_*.pkl", "random_states_{}.pkl", None, "accelerate's load_state"),  # never unpickled
)


def _copy_root_files(root: Path, out: Path, old_dp: int | None, new_dp: int | None, skip: set[str]) -> list[str]:
    """Everything beside the tag folders comes along; RNG files follow the new ranks."""
    rng = {scheme: sorted(p.name for p in root.glob(scheme.glob)) for scheme in RNG_SCHEMES}
    rng_files = {name for names in rng.values() for name in names}
    for item in root.iterdir():
        if item.name in skip or item.name in rng_files:
            continue
        if item.is_dir():
            if not any(item.glob("*_model_states.pt")):  # tag folders: only the converted one is written
                shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    notes = []
    for scheme, names in rng.items():
        if not names:
            continue
        if old_dp is None or new_dp is None:
            for name in names:
                shutil.copy2(root / name, out / name)
            notes.append("RNG states copied as they are")
        else:
            notes.append(_place_rng_states(root, out, old_dp, new_dp, scheme))
    return notes


def _place_rng_states(root: Path, out: Path, old_dp: int, new_dp: int, scheme: _RngScheme) -> str:
    """Each process restores its own RNG file; keep what maps over, by rank."""

    def name(rank: int, dp: int) -> str:
        return scheme.single if (dp == 1 and scheme.single) else scheme.per_rank.format(rank)

    def old_file(rank: int) -> Path | None:
        path = root / name(rank, old_dp)
        return path if path.is_file() else None

    for rank in range(min(old_dp, new_dp)):
        if src := old_file(rank):
            shutil.copy2(src, out / name(rank, new_dp))
    if new_dp == 1:
        return f"RNG states: rank 0's kept as {name(0, 1)}; the other ranks' random streams do not carry over"
    if new_dp > old_dp:
        return (
            f"RNG states: carried over for {_ranks(0, old_dp)}; {_ranks(old_dp, new_dp)} start without one, so "
            f"{scheme.who} logs that it found no RNG file and continues with fresh random streams there"
        )
    if new_dp == old_dp:
        return f"RNG states: carried over for {_ranks(0, new_dp)}"
    return f"RNG states: carried over for {_ranks(0, new_dp)}; those of {_ranks(new_dp, old_dp)} are dropped"


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


# --- Entry point --------------------------------------------------------------------------------------------


def reshard(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    dp: int | None = None,
    universal: bool = False,
    stage: int | None = None,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
    config: Path | str | None = None,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
    group: ProcessGroup | None = None,
) -> ReshardResult:
    """Write a native ZeRO checkpoint for `dp` ranks, or (`universal=True`) a universal checkpoint.

    Args:
        path: a native checkpoint (see `read_checkpoint`) or a universal one (holding `latest_universal`).
        out_dir: output folder; defaults to `dp<M>-<name>` or `universal-<name>` beside the input.
        dp: the new data-parallel size (native output).
        universal: write DeepSpeed's universal format instead, loadable at any DP size.
        stage: write the files DeepSpeed saves at this ZeRO stage (1, 2 or 3) instead of the checkpoint's own,
            so the run resumes at that stage; the DP size stays unless `dp` is given.
        config: the model's config.json (or its folder, tokenizer files included), copied into the output
            for checkpoints saved without one (accelerate's save_state).
        on_start: called once with the number of tensor bytes to write.
        on_progress: called with the number of bytes written after each chunk.
        group: the ranks of a launcher (`ckpttools.ranks.distributed.join_group`) sharing the work: each writes the
            rank files (or universal parameter folders) planned for it, balanced by bytes, into one staged
            folder that is committed only when every rank succeeded; rank 0 also writes `latest` and the files
            beside the tag. Every rank returns the same result, with `world_size` and each file's rank.

    Example:
        >>> reshard("out/checkpoint-500", "out/dp8-checkpoint-500", dp=8).files[0]
        'global_step500/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'
    """
    _check_arguments(dp, universal, stage)  # every rank alike, before anything is read
    if group is not None and group.world_size > 1:
        holdings = nodelocal.exchange_holdings(group, Path(path))
        if not nodelocal.is_shared(holdings):
            args = (out_dir, dp, universal, stage, tag, step, best, overwrite, config, (on_start, on_progress))
            return _gathered(group, Path(path), holdings, *args)
        job = group.run_agreed(lambda: _prepare(path, out_dir, dp, universal, stage, tag, step, best, config))
        if isinstance(job, ReshardResult):
            job.world_size, job.ranks = group.world_size, {}
            return job
        return _write_on_ranks(group, job, out_dir, overwrite, (on_start, on_progress))
    job = _prepare(path, out_dir, dp, universal, stage, tag, step, best, config)
    if isinstance(job, ReshardResult):
        return job
    return _write(job.ckpt, job.dp, job.stage, out_dir, overwrite, job.model_config, (on_start, on_progress))


def _gathered(group: ProcessGroup, path: Path, holdings: list[nodelocal.Holdings], out_dir: Path | str | None,
              dp: int | None, universal: bool, stage: int | None, tag: str | None, step: int | None, best: bool,
              overwrite: bool, config: Path | str | None, progress: _ProgressFns) -> ReshardResult:  # fmt: skip
    """A node-local checkpoint (each node holds its own ranks' files): rank 0 gathers it and writes the output."""

    def on_copy(view: Path, user_path: Callable[[Path], Path]) -> dict[str, Any]:
        job = _prepare(view, out_dir, dp, universal, stage, tag, step, best, config)
        if isinstance(job, ReshardResult):
            result = job
        else:
            user_root = user_path(job.ckpt.location.root)
            new_stage = job.stage if job.stage != job.ckpt.zero_stage else None
            out = Path(out_dir) if out_dir else _default_out(user_root, job.dp, new_stage)
            check_output_dir(out, user_root, overwrite)
            result = _write(job.ckpt, job.dp, job.stage, out, overwrite, job.model_config, progress)
        result.world_size, result.ranks = group.world_size, dict.fromkeys(result.files, 0)
        return result.to_dict()

    def check_output(root: Path) -> None:  # before any byte moves; the default folder's name needs the checkpoint
        if out_dir is not None:
            check_output_dir(Path(out_dir), root, overwrite)

    steps = nodelocal.GatherSteps(lambda v: checkpoint_root(v, tag=tag, step=step, best=best), check_output,
                                  lambda v: open_checkpoint(v, tag=tag, step=step, best=best), on_copy)  # fmt: skip
    done = nodelocal.convert_on_rank0(group, path, holdings, nodelocal.gather_parent(path, out_dir), steps,
                                      optimizer_states=True)  # fmt: skip
    return ReshardResult(**done)


@dataclass(frozen=True)
class _Job:
    """What `reshard` writes, once its arguments and the checkpoint are checked."""

    ckpt: ZeroCheckpoint
    dp: int | None  # None: universal output
    stage: int
    model_config: hf.ModelConfig | None


def _check_arguments(dp: int | None, universal: bool, stage: int | None) -> None:
    if universal and (dp is not None or stage is not None):
        raise UsageError("--universal writes a checkpoint for any DP size and stage; pass it without --dp/--stage")
    if not universal and dp is None and stage is None:
        raise UsageError("pass --dp M, --stage S or --universal")
    if dp is not None and not 1 <= dp <= 1 << 20:
        raise UsageError(f"--dp must be at least 1 (and at most {1 << 20}), not {dp}")
    if stage is not None and stage not in (1, 2, 3):
        raise UsageError(f"--stage must be 1, 2 or 3, not {stage}")


def _prepare(
    path: Path | str,
    out_dir: Path | str | None,
    dp: int | None,
    universal: bool,
    stage: int | None,
    tag: str | None,
    step: int | None,
    best: bool,
    config: Path | str | None,
) -> _Job | ReshardResult:
    """Check the arguments and open the checkpoint: the job, or the result when there is nothing to do."""
    _check_arguments(dp, universal, stage)
    ckpt = open_checkpoint(path, tag=tag, step=step, best=best)
    if universal and ckpt.source_format == "universal":
        raise UsageError(f"{path} is already a universal checkpoint; pass --dp M to turn it into native shards")
    if not universal and dp is None:
        if ckpt.source_format == "universal":
            raise UsageError(f"{path} is a universal checkpoint; pass --dp M with --stage to write native shards")
        dp = ckpt.dp_world_size
    target = stage if stage is not None else ckpt.zero_stage
    _check_layout(ckpt, universal, target, dp)
    if target != ckpt.zero_stage:
        stages.check_stage_change(ckpt, target)
    unchanged = dp == ckpt.dp_world_size and target == ckpt.zero_stage and ckpt.source_format == "native"
    if unchanged and out_dir is None:
        result = ReshardResult(None, ckpt.location.tag, ckpt.zero_stage, dp, dp, [])
        result.notes.append(f"the checkpoint is already at DP {dp}, ZeRO-{target}; nothing to do")
        return result
    if universal and ckpt.optimizer.param_groups is None:
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} is an elastic ZeRO-1/2 checkpoint: it carries no param_groups, which the "
            "universal format needs; reshard it natively with --dp M instead"
        )
    model_config = hf.find_config(ckpt.location.root, config) if config is not None else None
    return _Job(ckpt, dp, target, model_config)


def _check_layout(ckpt: ZeroCheckpoint, universal: bool, stage: int, dp: int | None) -> None:
    """Only what is proven to load in DeepSpeed is written: plain DP; other layouts' DP size slice by slice."""
    kind = ckpt.layout.kind
    if kind == "dp":
        return
    if kind == "zero0":
        zero0.check_zero0_reshard(ckpt, universal=universal, stage=stage)
        return
    if kind == "moe":
        moe.check_moe_reshard(ckpt, universal=universal, stage=stage, dp=dp)
        return
    what = f"{ckpt.location.tag_dir} is a {KIND_NAMES[kind]} checkpoint ({ckpt.layout.describe()})"
    if ckpt.source_format == "universal":
        raise UnsupportedCheckpointError(
            f"{what} in the universal format; writing native TP shards from it is not supported: load it in "
            'DeepSpeed with "checkpoint": {"load_universal": true}, or reshard the native checkpoint it came from'
        )
    if not ckpt.slices:
        raise UnsupportedCheckpointError(f"{what}; resharding it is not supported yet (consolidate works)")
    zero = ckpt.ds_config.get("zero_optimization")
    if kind == "pipeline" and (zero.get("stage", 0) if isinstance(zero, dict) else 0) == 0:
        raise UnsupportedCheckpointError(
            f"{what}, saved without ZeRO (BF16_Optimizer keeps DP rank 0's state in every stage file); DeepSpeed "
            "0.19.8 cannot resume such a checkpoint even at its own size (KeyError: 0 in _load_legacy_checkpoint), "
            "so resharding it is not supported (consolidate works)"
        )
    if universal and kind not in ("tensor", "pipeline"):  # their own writers: tensor.py, pipeline.py
        raise UnsupportedCheckpointError(f"{what}; --universal is not supported for it yet, reshard with --dp M")
    if stage != ckpt.zero_stage:
        raise UnsupportedCheckpointError(f"{what}; --stage is supported for data-parallel checkpoints only")


def _default_out(root: Path, dp: int | None, stage: int | None = None) -> Path:
    """`dp<M>-<name>`, `zero<S>-dp<M>-<name>` or `universal-<name>` beside the input (never matched by the
    Trainer's checkpoint rotation)."""
    if not dp:
        return root.parent / f"universal-{root.name}"
    return root.parent / (f"zero{stage}-dp{dp}-{root.name}" if stage else f"dp{dp}-{root.name}")


def _write(
    ckpt: ZeroCheckpoint,
    dp: int | None,
    stage: int,
    out_dir: Any,
    overwrite: bool,
    model_config: hf.ModelConfig | None,
    progress: _ProgressFns,
) -> ReshardResult:
    loc = ckpt.location
    out, files, needed, result = _plan_output(ckpt, dp, stage, out_dir, overwrite)
    with RecordReader() as reader:
        check_module_copies(ckpt)  # before anything is written
        with staged_folder(out, overwrite=overwrite, needed_bytes=needed, notes=result.notes) as tmp:
            (tmp / loc.tag).mkdir()
            result.files = _write_tag(files, tmp / loc.tag, reader, progress)
            _finish_folder(ckpt, dp, stage, tmp, model_config, result)
    result.output_dir = str(out)
    return result


def _plan_output(
    ckpt: ZeroCheckpoint, dp: int | None, stage: int, out_dir: Any, overwrite: bool
) -> tuple[Path, dict[str, Any], int, ReshardResult]:
    """The checked output folder, the tag's files, the disk space the whole output needs and the result to fill in."""
    loc = ckpt.location
    old_dp = ckpt.dp_world_size if ckpt.source_format == "native" else None
    new_stage = stage if stage != ckpt.zero_stage else None
    out = check_output_dir(Path(out_dir) if out_dir else _default_out(loc.root, dp, new_stage), loc.root, overwrite)
    files = _tag_files(ckpt, dp, stage)
    result = ReshardResult(None, loc.tag, stage, old_dp, dp, [], zero_stage_from=new_stage and ckpt.zero_stage)
    return out, files, _output_bytes(files, loc.root), result


_FILE_OVERHEAD = 8192  # a torch file's zip records and pickle, and the last block it fills only in part


def _output_bytes(files: dict[str, Any], root: Path) -> int:
    """What the output takes on the disk: every tensor of the tag's files with each file's overhead, and the files
    copied from beside the tag (for a universal output, thousands of small files: the tag folder's size is no
    guide)."""
    tag = files_bytes(files)
    beside = 0
    for item in root.iterdir():
        if item.is_file():
            beside += item.stat().st_size + _FILE_OVERHEAD
        elif item.is_dir() and not any(item.glob("*_model_states.pt")):  # other tags are not copied
            beside += sum(p.stat().st_size + _FILE_OVERHEAD for p in item.rglob("*") if p.is_file())
    return tag + beside


def files_bytes(files: dict[str, Any]) -> int:
    """What torch files (relative path -> object) take on the disk: their tensors and each file's overhead."""
    return sum(_tensor_bytes(obj) + _FILE_OVERHEAD for obj in files.values())


def _finish_folder(
    ckpt: ZeroCheckpoint,
    dp: int | None,
    stage: int,
    tmp: Path,
    model_config: hf.ModelConfig | None,
    result: ReshardResult,
) -> None:
    """Everything but the tag's rank files: notes, the files beside the tag, config.json and `latest`."""
    loc = ckpt.location
    if result.zero_stage_from is not None:
        result.notes.append(
            f"ZeRO-{ckpt.zero_stage} -> ZeRO-{stage}: resume with zero_optimization.stage {stage} in the "
            "DeepSpeed config"
        )
    elif dp is not None and dp == result.dp_from:
        result.notes.append(f"the checkpoint is already at DP {dp}; rewritten as it is, every record checked")
    skip = {loc.tag, "latest", "latest_universal"}
    result.notes += _copy_root_files(loc.root, tmp, result.dp_from, dp, skip)
    if model_config is not None:
        (tmp / "config.json").write_text(json.dumps(model_config.config, indent=2) + "\n")
        hf.copy_side_files(model_config.folder, model_config.side_files, tmp)
    (tmp / ("latest" if dp else "latest_universal")).write_text(loc.tag)
    if dp is None:
        result.notes.append('load it with "checkpoint": {"load_universal": true} in the DeepSpeed config')


# --- On many ranks ------------------------------------------------------------------------------------------


def _write_on_ranks(
    group: ProcessGroup, job: _Job, out_dir: Any, overwrite: bool, progress: _ProgressFns
) -> ReshardResult:
    """`_write` shared by a launcher's ranks: each writes its own files of the tag, rank 0 the rest, one commit."""
    ckpt, loc = job.ckpt, job.ckpt.location
    out, files, needed, result = group.run_agreed(lambda: _plan_output(ckpt, job.dp, job.stage, out_dir, overwrite))
    owners = _plan_file_ranks(files, ckpt, group.world_size)
    group.run_agreed(lambda: check_module_copies(ckpt) if group.rank == 0 else None)  # one whole-model pass
    mine = {name: obj for name, obj in files.items() if owners[name] == group.rank}
    staging = shared_staged_folder(out, overwrite=overwrite, needed_bytes=needed, group=group, notes=result.notes)
    with RecordReader(pieces=True) as reader, staging as tmp:
        (tmp / loc.tag).mkdir(exist_ok=True)
        group.run_agreed(lambda: _write_files(tmp / loc.tag, mine, reader, progress))
        check_records(group, reader, _records_read(files))  # each checked by one rank, from every rank's pieces
        if group.rank == 0:
            _finish_folder(ckpt, job.dp, job.stage, tmp, job.model_config, result)
    result.files = [f"{loc.tag}/{n}" for n in files]
    result.output_dir, result.world_size = str(out), group.world_size
    result.ranks = {f"{loc.tag}/{n}": owners[n] for n in files}
    return result


def _plan_file_ranks(files: dict[str, Any], ckpt: ZeroCheckpoint, world_size: int) -> dict[str, int]:
    """The rank writing each file of the tag: a universal parameter folder goes whole to one rank, balanced by
    tensor bytes; shared files (`zero/optimizer_state.pt`, a layout's own files) go to rank 0."""
    shared = {"zero/optimizer_state.pt", *ckpt.layout_files}
    units: dict[str, list[str]] = {}
    for name in files:
        if name not in shared:
            parts = name.split("/")
            units.setdefault("/".join(parts[:2]) if parts[0] == "zero" and len(parts) > 2 else name, []).append(name)
    sizes = [sum(_tensor_bytes(files[n]) for n in names) for names in units.values()]
    owners = dict.fromkeys(files, 0)
    for names, rank in zip(units.values(), plan_by_bytes(sizes, world_size), strict=True):
        owners.update(dict.fromkeys(names, rank))
    return owners


def _records_read(files: dict[str, Any]) -> list[Record]:
    """Every record any rank's files read."""
    records: list[Record] = []
    for obj in files.values():
        for t in _tensors_in(obj):
            if isinstance(t, LazyTensor):
                records.append(t.record)
            else:
                records += [p.tensor.record for p in t.pieces if isinstance(p, Slice)]
    return records


def _tensors_in(obj: Any) -> Iterator[LazyTensor | NewTensor]:
    """Every stored or new tensor a file object holds (in containers and DeepSpeed stand-ins)."""
    if isinstance(obj, LazyTensor | NewTensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors_in(value)
    elif not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
        yield from _tensors_in(vars(obj))


def _tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in _tensors_in(obj))


def universal_tag_files(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    """Relative path -> object: the universal tag folder of a checkpoint of any layout that has one."""
    if ckpt.layout.kind == "tensor":
        return tensor_universal_files(ckpt)
    if ckpt.layout.kind == "pipeline":
        return pipeline_universal_files(ckpt)
    return universal_files(ckpt)


def _rank_files(ckpt: ZeroCheckpoint, dp: int, stage: int, mp: int = 0) -> dict[str, Any]:
    """The optimizer and model-states files of one model-parallel slice (`mp`: stage or TP rank) at `dp` ranks."""
    if ckpt.zero_stage == 0:
        return zero0.zero0_rank_files(ckpt, dp)
    if stage == 3:
        model_files, optim_files = _zero3_files(ckpt, dp)
    else:
        model_files, optim_files = _zero12_files(ckpt, dp, stage)
    prefix = ckpt.location.files.optim_prefix
    files = {f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt": o for r, o in enumerate(optim_files)}
    for r, m in enumerate(model_files):
        files[_model_file_name(stage, r, mp)] = m
    return files


def _model_file_name(stage: int, rank: int, mp: int = 0) -> str:
    return (
        f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt" if stage == 3 else f"mp_rank_{mp:02d}_model_states.pt"
    )


def _sliced_rank_files(ckpt: ZeroCheckpoint, dp: int, stage: int) -> dict[str, Any]:
    """Pipeline / tensor-parallel: every slice re-cut on its own, the layout's other files kept."""
    files: dict[str, Any] = {}
    for mp, part in enumerate(ckpt.slices):
        files.update(_rank_files(part, dp, stage, mp))
    return files


def _tag_files(ckpt: ZeroCheckpoint, dp: int | None, stage: int) -> dict[str, Any]:
    """Relative path in the tag folder -> object: every file the output's tag holds."""
    if dp is None:
        files = universal_tag_files(ckpt)
        if ckpt.layout.kind == "dp":  # other layouts' universal writers name their own model-states files
            for r, m in enumerate(ckpt.model_files):
                files[_model_file_name(ckpt.zero_stage, r)] = m
    elif ckpt.layout.kind == "moe":
        files = moe.moe_rank_files(ckpt, dp, stage)
    elif ckpt.slices:
        files = _sliced_rank_files(ckpt, dp, stage)
        for name in ckpt.layout_files:  # rewritten, not copied: every record's CRC is checked on the way
            files[name] = load_pickle(ckpt.location.tag_dir / name)
    else:
        files = _rank_files(ckpt, dp, stage)
    return files


def _write_files(tag_dir: Path, files: dict[str, Any], reader: RecordReader, progress: _ProgressFns) -> None:
    for name in files:
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
    on_start, on_progress = progress
    write_torch_files([(tag_dir / name, obj) for name, obj in files.items()], reader, on_start=on_start,
                      on_progress=on_progress)  # fmt: skip


def _write_tag(files: dict[str, Any], tag_dir: Path, reader: RecordReader, progress: _ProgressFns) -> list[str]:
    _write_files(tag_dir, files, reader, progress)
    reader.finish()  # CRC-32 of every source record read
    return [f"{tag_dir.name}/{n}" for n in files]

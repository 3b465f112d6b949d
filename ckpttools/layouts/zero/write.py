"""Native data-parallel rank files at another DP degree or ZeRO stage, planned as slices of the model's stored
partitions plus zero padding, exactly as DeepSpeed lays them out (see `partition`, `pieces`, `stages`).

Pipeline and AutoTP checkpoints are data-parallel groups slice by slice: their layouts re-cut each slice here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import LazyTensor, TorchSize, load_pickle
from ckpttools.io.torchwriter import NewTensor, Slice
from ckpttools.layouts import zero0
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.zero import nvme, partition, stages
from ckpttools.layouts.zero.partition import split_subgroups  # tests and older callers import it from here
from ckpttools.layouts.zero.pieces import (
    Flat,
    Pieces,
    cut_group,
    group_count,
    group_keys,
    group_params,
    is_muon_group,
    master_partition,
    new_tensor,
    padded,
    pieces_of,
    state_of,
)
from ckpttools.model.checkpoint import MASTER, Checkpoint, Param, TensorSource, strip_prefixes

# --- Native ZeRO-1/2 rank files -----------------------------------------------------------------------------


def _zero12_files(ckpt: Checkpoint, dp: int, stage: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
        muon = param_groups is not None and g < len(param_groups) and is_muon_group(param_groups[g])
        parts = cut_group(group_params(ckpt, g), scalars, dp, bf16_optimizer=bf16_optimizer, elastic=opt.elastic,
                          muon=muon)  # fmt: skip
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


def _zero3_slice(flat: Flat, numel: int, dp: int, rank: int) -> Pieces:
    """Rank `rank`'s ceil(numel/dp) elements of a parameter; padding is zero, never uninitialised memory."""
    p = partition.zero3_partition_numel(numel, dp)
    n = max(0, min(p, numel - rank * p))
    return padded(flat.take(rank * p, n) if n else [], p - n)


def _sub_group_size(ckpt: Checkpoint) -> int:
    zero_cfg = (ckpt.optimizer.file_meta.get("ds_config") or {}).get("zero_optimization") or {}
    try:
        size = int(float(zero_cfg.get("sub_group_size", partition.DEFAULT_SUB_GROUP_SIZE)))
    except (TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"the run's zero_optimization.sub_group_size {short(zero_cfg.get('sub_group_size'), 30)} is not a number"
        ) from e
    return max(size, 1)


def _zero3_files(ckpt: Checkpoint, dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    if "ds_config" in meta:  # an NVMe run's output holds every byte in its rank files: resumed with CPU offload
        meta = {**meta, "ds_config": nvme.without_nvme(meta["ds_config"])}
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


def _zero3_model_files(ckpt: Checkpoint, subgroups: list[list[Param]], dp: int) -> list[dict[str, Any]]:
    flats = _Flats()
    model0 = ckpt.model_files[0]
    param_shapes = [OrderedDict((p.file_name, TorchSize(p.shape)) for p in members) for members in subgroups]
    module, frozen_shapes = stages.zero3_module(ckpt)
    changed = ckpt.zero_stage != 3
    frozen_raw = frozen_shapes if changed else (model0.get("frozen_param_shapes") or {})
    extra = {"module": module, "frozen_param_shapes": frozen_shapes,
             "ds_config": stages.ds_config_at(model0.get("ds_config"), 3)} if changed else {}  # fmt: skip
    if "ds_config" in model0:
        extra["ds_config"] = nvme.without_nvme(extra.get("ds_config", model0["ds_config"]))
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


def rank_files(ckpt: Checkpoint, dp: int, stage: int, mp: int = 0) -> dict[str, Any]:
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
        files[model_file_name(stage, r, mp)] = m
    return files


def model_file_name(stage: int, rank: int, mp: int = 0) -> str:
    return (
        f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt" if stage == 3 else f"mp_rank_{mp:02d}_model_states.pt"
    )


def sliced_rank_files(ckpt: Checkpoint, dp: int, stage: int) -> dict[str, Any]:
    """Pipeline / tensor-parallel: every slice re-cut on its own, the layout's other files kept."""
    files: dict[str, Any] = {}
    for mp, part in enumerate(ckpt.slices):
        files.update(rank_files(part, dp, stage, mp))
    return files


# --- Layouts made of data-parallel slices (pipeline stages, TP ranks) -----------------------------------------


def check_sliced_reshard(ckpt: Checkpoint, target: ReshardTarget, title: str) -> None:
    """What a layout of DP slices (pipeline stages, TP ranks) can be resharded to: another DP size, slice by slice,
    from the native checkpoint at its own ZeRO stage."""
    what = f"{ckpt.location.tag_dir} is a {title} checkpoint ({ckpt.layout.describe()})"
    if ckpt.source_format == "universal":
        raise UnsupportedCheckpointError(
            f"{what} in the universal format; writing native TP shards from it is not supported: load it in "
            'DeepSpeed with "checkpoint": {"load_universal": true}, or reshard the native checkpoint it came from'
        )
    if not ckpt.slices:
        raise UnsupportedCheckpointError(f"{what}; resharding it is not supported yet (consolidate works)")
    if target.stage != ckpt.zero_stage:
        raise UnsupportedCheckpointError(f"{what}; --stage is supported for data-parallel checkpoints only")


def sliced_tag_files(ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
    """Every slice re-cut for `target.dp` ranks, and the layout's DP-independent files (layer files, TP model
    files) rewritten, not copied: every record's CRC is checked on the way."""
    assert target.dp is not None
    files = sliced_rank_files(ckpt, target.dp, target.stage)
    for name in ckpt.layout_files:
        files[name] = load_pickle(ckpt.location.tag_dir / name)
    return files


def append_partitions(g: int, group: list[Param], osds: Sequence[dict[str, Any]],
                       group_scalars: Sequence[Mapping[str, Any]]) -> None:  # fmt: skip
    """Param group g cut over the ranks of `osds` (its expert-DP group, in expert-DP rank order) with the ZeRO-1/2
    arithmetic, each rank's partition appended to its optimizer dict."""
    scalars = group_scalars[g] if g < len(group_scalars) else {}
    for osd, part in zip(osds, cut_group(group, dict(scalars), len(osds)), strict=True):
        osd["single_partition_of_fp32_groups"].append(part.master)
        if part.state:  # before the first optimizer step the torch optimizer has no state at all
            osd["base_optimizer_state"]["state"][g] = part.state
        osd["group_paddings"].append(part.padding)
        osd["param_slice_mappings"].append(part.mapping)
        osd["partition_count"].append(len(osds))

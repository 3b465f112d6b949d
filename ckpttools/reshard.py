"""Reshard a ZeRO checkpoint to a new data-parallel size, as native DeepSpeed files.

DeepSpeed refuses to load a checkpoint saved at another DP size. The fp32 master weights and every
optimizer state are laid out by pure arithmetic (see `partition`), so they can be re-cut offline:
each new rank's tensors are planned as slices of the old files plus zero padding, exactly as
DeepSpeed lays them out for the new size, then streamed into new files. The result loads with a
plain `engine.load_checkpoint` at the new size and the user's unchanged config.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, partition
from .consolidate import _publish, check_free_space, check_output_dir
from .errors import CorruptCheckpointError, UsageError
from .reader import ZeroCheckpoint, read_checkpoint
from .torchfile import DEEPSPEED_STUBS, LazyTensor, RecordReader, TorchSize
from .torchwriter import Fill, NewTensor, Slice, write_torch_file

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default
_FRAGMENT = DEEPSPEED_STUBS[("deepspeed.utils.tensor_fragment", "fragment_address")]


@dataclass
class ReshardResult:
    output_dir: str | None
    tag: str
    zero_stage: int
    dp_from: int
    dp_to: int
    files: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fragment(numel: int, start: int) -> Any:
    frag = _FRAGMENT()
    frag.__dict__.update(numel=numel, start=start)
    return frag


def _pieces(old: Sequence[LazyTensor], old_counts: Sequence[int], start: int, count: int, base: int = 0) -> list[Slice]:
    """Elements [start, start+count) of the concatenation of `old[r][base : base+old_counts[r]]`."""
    return [Slice(old[p.rank], base + p.start, p.count) for p in partition.split_range(start, count, old_counts)]


def _new(pieces: list[Slice], pad: int = 0) -> NewTensor:
    return NewTensor(dtypes.FLOAT32, tuple(pieces) + ((Fill(pad),) if pad > 0 else ()))


def _moment_keys(state: dict[str, Any]) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, LazyTensor) and v.dim() > 0]


# --- ZeRO-1/2 (DeepSpeedZeroOptimizer, rigid or elastic; BF16_Optimizer) -------------------------------


def _zero12_files(ckpt: ZeroCheckpoint, new_dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    old_dp = ckpt.dp_world_size
    model0 = ckpt.rank_model_files[0]
    osds = [f["optimizer_state_dict"] for f in ckpt.rank_optim_files]
    bf16_optimizer = ckpt.optimizer_kind == "bf16_optimizer"
    elastic = isinstance(osds[0].get("base_optimizer_state"), list)
    align_all = osds[0].get("param_alignment_paddings")
    new_osds: list[dict[str, Any]] = [dict(osds[0]) for _ in range(new_dp)]
    for osd in new_osds:
        osd["single_partition_of_fp32_groups"], osd["group_paddings"], osd["param_slice_mappings"] = [], [], []
        osd["partition_count"] = [new_dp] * len(model0["param_shapes"])
        base = osds[0]["base_optimizer_state"]
        osd["base_optimizer_state"] = [] if elastic else {"state": {}, "param_groups": base["param_groups"]}
    for g, shapes in enumerate(model0["param_shapes"]):
        names = list(shapes)
        numels = [partition.ceil_div(_numel(shapes[n]), 1) for n in names]
        offsets = partition.zero12_param_offsets(numels, align_all[g] if align_all else None)
        total = offsets[-1] + numels[-1] if names else 0
        s_old, s_new = partition.zero12_partition_size(total, old_dp), partition.zero12_partition_size(total, new_dp)
        real_old = [max(0, min(s_old, total - r * s_old)) for r in range(old_dp)]
        fp32_old = [o["single_partition_of_fp32_groups"][g] for o in osds]
        states_old = [o["base_optimizer_state"][g] if elastic else o["base_optimizer_state"]["state"][g] for o in osds]
        keys = _moment_keys(states_old[0])
        for r, osd in enumerate(new_osds):
            lo = r * s_new
            n = max(0, min(s_new, total - lo))
            padded = s_new - n
            osd["single_partition_of_fp32_groups"].append(_new(_pieces(fp32_old, real_old, lo, n), padded if bf16_optimizer else 0))
            state = dict(states_old[0])
            for k in keys:
                state[k] = _new(_pieces([s[k] for s in states_old], real_old, lo, n), 0 if elastic else padded)
            if elastic:
                osd["base_optimizer_state"].append(state)
            else:
                osd["base_optimizer_state"]["state"][g] = state
            if bf16_optimizer:  # BF16_Optimizer records the whole group's padding on the last rank only
                osd["group_paddings"].append(s_new * new_dp - total if r == new_dp - 1 else 0)
            else:
                osd["group_paddings"].append(padded)
            osd["param_slice_mappings"].append(_slice_mappings(names, numels, offsets, lo, lo + n))
    optim_files = [{**ckpt.rank_optim_files[0], "optimizer_state_dict": osd} for osd in new_osds]
    model_files = [{**model0, "dp_world_size": new_dp}]
    return model_files, optim_files


def _slice_mappings(names: list[str], numels: list[int], offsets: list[int], lo: int, hi: int) -> OrderedDict[str, Any]:
    """DeepSpeed's param_slice_mappings: each param touching [lo, hi) with its (numel, start) in the partition."""
    mapping: OrderedDict[str, Any] = OrderedDict()
    for name, numel, off in zip(names, numels, offsets):
        start, end = max(off, lo), min(off + numel, hi)
        if start < end:
            mapping[name] = _fragment(end - start, start - lo)
    return mapping


# --- ZeRO-3 -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Z3Param:
    name: str
    numel: int
    shape: Any
    subgroup: int  # old sub-group
    offset: int  # old offset inside the sub-group's per-rank flat buffer


def split_subgroups(partition_numels: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's `_create_fp16_sub_groups`: close a sub-group once it reaches sub_group_size elements."""
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


def _zero3_params(ckpt: ZeroCheckpoint) -> list[list[_Z3Param]]:
    """The params of each optimizer param group, in flat order, with their old locations."""
    model0 = ckpt.rank_model_files[0]
    inner = ckpt.rank_optim_files[0]["optimizer_state_dict"]["optimizer_state_dict"]
    located: dict[int, list[_Z3Param]] = {}
    for sg, shapes in enumerate(model0["param_shapes"]):
        numels = [_numel(s) for s in shapes.values()]
        offsets = partition.zero3_subgroup_offsets(numels, ckpt.dp_world_size)
        located[sg] = [_Z3Param(n, numel, shapes[n], sg, off) for n, numel, off in zip(shapes, numels, offsets)]
    groups = []
    for pg in inner["param_groups"]:
        groups.append([p for sg in pg["params"] for p in located[int(sg)]])
    if sum(len(g) for g in groups) != sum(len(v) for v in located.values()):
        raise CorruptCheckpointError(f"{ckpt.location.tag_dir}: optimizer param groups do not cover param_shapes")
    return groups


def _zero3_slice(olds: Sequence[LazyTensor], p: _Z3Param, old_dp: int, new_dp: int, rank: int) -> list[Slice | Fill]:
    """New rank `rank`'s ceil(numel/new_dp) elements of param p, from the old ranks' flat buffers."""
    p_new = partition.zero3_partition_numel(p.numel, new_dp)
    lo = rank * p_new
    n = max(0, min(p_new, p.numel - lo))
    old_counts = [pc.count for pc in partition.zero3_pieces(p.numel, old_dp, 0)]
    pieces: list[Slice | Fill] = list(_pieces(olds, old_counts, lo, n, base=p.offset)) if n else []
    if p_new - n:
        pieces.append(Fill(p_new - n))  # padding is zero, never the old ranks' uninitialised tail
    return pieces


def _zero3_files(ckpt: ZeroCheckpoint, new_dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    old_dp = ckpt.dp_world_size
    osds = [f["optimizer_state_dict"] for f in ckpt.rank_optim_files]
    inner0 = osds[0]["optimizer_state_dict"]
    zero_cfg = ckpt.ds_config.get("zero_optimization") or {}
    sub_group_size = int(float(zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))
    new_groups: list[list[_Z3Param]] = []  # new sub-groups, numbered across param groups
    new_param_groups = []
    for pg, params in zip(inner0["param_groups"], _zero3_params(ckpt)):
        p_new = [partition.zero3_partition_numel(p.numel, new_dp) for p in params]
        ids = []
        for members in split_subgroups(p_new, sub_group_size):
            ids.append(len(new_groups))
            new_groups.append([params[i] for i in members])
        new_param_groups.append({**pg, "params": ids})
    first_state = {int(pg["params"][0]): inner0["state"][int(pg["params"][0])] for pg in inner0["param_groups"]}
    keys = _moment_keys(next(iter(first_state.values())))
    optim_files = []
    for r in range(new_dp):
        flat, state = [], {}
        for sg, members in enumerate(new_groups):
            old_sg_state = inner0["state"][members[0].subgroup]
            flat.append(_z3_tensor(members, lambda p: [o["fp32_flat_groups"][p.subgroup] for o in osds], old_dp, new_dp, r))
            entry = dict(old_sg_state)
            for k in keys:
                entry[k] = _z3_tensor(members, lambda p, k=k: [o["optimizer_state_dict"]["state"][p.subgroup][k] for o in osds], old_dp, new_dp, r)
            state[sg] = entry
        osd = {**osds[0], "partition_count": new_dp, "fp32_flat_groups": flat,
               "optimizer_state_dict": {**inner0, "state": state, "param_groups": new_param_groups}}  # fmt: skip
        optim_files.append({**ckpt.rank_optim_files[0], "optimizer_state_dict": osd})
    return _zero3_model_files(ckpt, new_groups, new_dp), optim_files


def _z3_tensor(members: list[_Z3Param], olds_of: Any, old_dp: int, new_dp: int, rank: int) -> NewTensor:
    pieces: list[Slice | Fill] = []
    for p in members:
        pieces += _zero3_slice(olds_of(p), p, old_dp, new_dp, rank)
    return NewTensor(dtypes.FLOAT32, tuple(pieces))


def _zero3_model_files(ckpt: ZeroCheckpoint, new_groups: list[list[_Z3Param]], new_dp: int) -> list[dict[str, Any]]:
    old_dp = ckpt.dp_world_size
    model0 = ckpt.rank_model_files[0]
    param_shapes = [OrderedDict((p.name, TorchSize(p.shape)) for p in members) for members in new_groups]
    frozen_shapes = model0.get("frozen_param_shapes") or {}
    files = []
    for r in range(new_dp):
        fragments: OrderedDict[str, Any] = OrderedDict()
        for name, shape in frozen_shapes.items():
            olds = [m["frozen_param_fragments"][name] for m in ckpt.rank_model_files]
            p = _Z3Param(name, _numel(shape), shape, 0, 0)
            fragments[name] = NewTensor(olds[0].dtype, tuple(_zero3_slice(olds, p, old_dp, new_dp, r)))
        files.append({
            **model0,
            "dp_world_size": new_dp,
            "param_shapes": param_shapes,
            "frozen_param_fragments": fragments if frozen_shapes else model0.get("frozen_param_fragments"),
            "shared_params": model0.get("shared_params") if r == 0 else {},
        })  # fmt: skip
    return files


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --- Files around the tag: latest, Trainer files, RNG states -------------------------------------------


def _copy_root_files(ckpt: ZeroCheckpoint, out: Path, new_dp: int) -> list[str]:
    """Everything beside the tag folders comes along; `latest` names the tag; RNG files follow the new ranks."""
    root = ckpt.location.root
    notes = []
    rng_files = sorted(p.name for p in root.glob("rng_state*.pth"))
    for item in root.iterdir():
        if item.name == "latest" or item.name in rng_files:
            continue
        if item.is_dir():
            if any(item.glob("*_model_states.pt")):
                continue  # tag folders: only the resharded one is written
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    (out / "latest").write_text(ckpt.location.tag)
    if rng_files:
        notes.append(_place_rng_states(root, out, ckpt.dp_world_size, new_dp))
    return notes


def _place_rng_states(root: Path, out: Path, old_dp: int, new_dp: int) -> str:
    """Trainer restores `rng_state_{rank}.pth` (or `rng_state.pth` at one process); keep what maps over."""
    def old_file(rank: int) -> Path | None:
        path = root / ("rng_state.pth" if old_dp == 1 else f"rng_state_{rank}.pth")
        return path if path.is_file() else None

    if new_dp == 1:
        src = old_file(0)
        if src:
            shutil.copy2(src, out / "rng_state.pth")
        return "RNG states: rank 0's state kept as rng_state.pth; the data order stays reproducible, per-rank dropout streams do not carry over"
    for rank in range(min(old_dp, new_dp)):
        src = old_file(rank)
        if src:
            shutil.copy2(src, out / f"rng_state_{rank}.pth")
    if new_dp > old_dp:
        return (f"RNG states: {_ranks(0, old_dp)} keep theirs; {_ranks(old_dp, new_dp)} have none, so the Trainer "
                "logs that it found no RNG file for them and continues with fresh random streams")
    return f"RNG states: {_ranks(0, new_dp)} keep theirs; those of {_ranks(new_dp, old_dp)} are dropped"


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


# --- Entry point -----------------------------------------------------------------------------------------


def default_output_dir(ckpt: ZeroCheckpoint, new_dp: int) -> Path:
    """`dp<M>-<checkpoint>` beside the checkpoint (never matched by Trainer's checkpoint rotation)."""
    root = ckpt.location.root
    return root.parent / f"dp{new_dp}-{root.name}"


def reshard(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    dp: int,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
) -> ReshardResult:
    """Write a native ZeRO checkpoint for `dp` data-parallel ranks.

    Args:
        path: the checkpoint (see `read_checkpoint`).
        out_dir: output folder; defaults to `dp<M>-<checkpoint name>` beside the checkpoint.
        dp: the new data-parallel size.

    Returns:
        A ReshardResult; when `dp` equals the current size and no `out_dir` is given, nothing is written.

    Example:
        >>> reshard("out/checkpoint-500", "out/checkpoint-500-dp8", dp=8).files[:1]
        ['global_step500/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt']
    """
    if dp < 1:
        raise UsageError(f"--dp must be at least 1, not {dp}")
    ckpt = read_checkpoint(path, tag=tag, step=step, best=best)
    loc = ckpt.location
    result = ReshardResult(None, loc.tag, ckpt.zero_stage, ckpt.dp_world_size, dp, [])
    if dp == ckpt.dp_world_size and out_dir is None:
        result.notes.append(f"the checkpoint is already at DP {dp}; nothing to do")
        return result
    out = check_output_dir(Path(out_dir) if out_dir else default_output_dir(ckpt, dp), ckpt, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out.parent, sum(p.stat().st_size for p in loc.root.rglob("*") if p.is_file()))
    tmp = out.parent / f".{out.name}.partial-{id(result)}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / loc.tag).mkdir(parents=True)
        if dp == ckpt.dp_world_size:
            shutil.copytree(loc.tag_dir, tmp / loc.tag, dirs_exist_ok=True)
            result.notes.append(f"the checkpoint is already at DP {dp}; copied unchanged")
        else:
            result.files = _write_tag(ckpt, dp, tmp / loc.tag)
        result.notes += _copy_root_files(ckpt, tmp, dp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.output_dir = str(out)
    return result


def _write_tag(ckpt: ZeroCheckpoint, new_dp: int, tag_dir: Path) -> list[str]:
    builder = _zero3_files if ckpt.zero_stage == 3 else _zero12_files
    model_files, optim_files = builder(ckpt, new_dp)
    prefix = ckpt.location.files.optim_prefix
    written = []
    with RecordReader() as reader:
        for r, obj in enumerate(optim_files):
            name = f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            write_torch_file(tag_dir / name, obj, reader)
            written.append(name)
        for r, obj in enumerate(model_files):
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if ckpt.zero_stage == 3 else "mp_rank_00_model_states.pt"
            write_torch_file(tag_dir / name, obj, reader)
            written.append(name)
        reader.finish()  # CRC-32 of every source record read
    return [f"{tag_dir.name}/{n}" for n in written]

"""Reshard a ZeRO checkpoint to a new data-parallel size, or to and from DeepSpeed's universal format.

DeepSpeed refuses to load a checkpoint saved at another DP size. The fp32 master weights and every
optimizer state are laid out by pure arithmetic (see `partition`), so they can be re-cut offline.
Every state of every parameter is first described as the flat list of stored slices it is made of
(a `_Sources`: from native rank files or from universal per-parameter files); the new files are then
planned as slices of those plus zero padding, exactly as DeepSpeed lays them out for the new size,
and streamed into place. Native results load with a plain `engine.load_checkpoint` at the new size
and the user's unchanged config; universal ones with `"checkpoint": {"load_universal": true}`.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, partition
from .consolidate import check_free_space, check_output_dir, publish
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from .layout import check_tag_name
from .reader import ZeroCheckpoint, read_checkpoint
from .torchfile import DEEPSPEED_STUBS, LazyTensor, RecordReader, TorchSize, load_pickle
from .torchwriter import Fill, NewTensor, ProgressFn, Slice, write_torch_files

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default
_ProgressFns = tuple[ProgressFn | None, ProgressFn | None]  # (on_start, on_progress)
_FRAGMENT = DEEPSPEED_STUBS[("deepspeed.utils.tensor_fragment", "fragment_address")]
Pieces = list[Slice | Fill]


@dataclass
class ReshardResult:
    output_dir: str | None
    tag: str
    zero_stage: int
    dp_from: int | None  # None when the source is a universal checkpoint
    dp_to: int | None  # None when the output is a universal checkpoint
    files: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- Piece arithmetic -------------------------------------------------------------------------------------


def take(pieces: Pieces, start: int, count: int) -> Pieces:
    """Elements [start, start+count) of the concatenation of `pieces`."""
    out: Pieces = []
    pos, end = 0, start + count
    for p in pieces:
        lo, hi = max(start, pos), min(end, pos + p.count)
        if lo < hi:
            out.append(Fill(hi - lo) if isinstance(p, Fill) else Slice(p.tensor, p.start + lo - pos, hi - lo))
        pos += p.count
        if pos >= end:
            break
    if sum(p.count for p in out) != count:
        raise CorruptCheckpointError(f"a flat state is shorter ({pos}) than its layout needs ({end})")
    return out


def padded(pieces: Pieces, pad: int) -> Pieces:
    return pieces + [Fill(pad)] if pad > 0 else pieces


def _flat(pieces: Pieces, shape: tuple[int, ...] | None = None) -> NewTensor:
    return NewTensor(dtypes.FLOAT32, tuple(pieces), shape)


def _master(pieces: Pieces) -> NewTensor:
    """A rank's fp32 master partition: DeepSpeed saves these with requires_grad set."""
    return NewTensor(dtypes.FLOAT32, tuple(pieces), requires_grad=True)


def _fragment(numel: int, start: int) -> Any:
    frag = _FRAGMENT()
    frag.__dict__.update(numel=numel, start=start)
    return frag


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --- Where each state of each parameter lives ---------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    name: str  # as DeepSpeed names it in param_shapes
    shape: tuple[int, ...]
    numel: int
    group: int  # optimizer param group
    align_pad: int = 0  # ZeRO-1/2 parameter_alignment padding after this param


@dataclass
class _Sources:
    """A checkpoint's parameters in flat order and, per state, the stored slices making up each one."""

    stage: int
    params: list[_Param]
    keys: list[str]  # "fp32" and the optimizer moments ("exp_avg", "exp_avg_sq")
    full: dict[tuple[str, str], Pieces]  # (param name, key) -> flat pieces of the whole parameter
    steps: list[Any]  # per param group: the optimizer `state` entries that are not tensors (step, ...)
    common: dict[str, Any]  # optimizer-state entries that are not sharded (loss scaler, param_groups, ...)
    wrapper: dict[str, Any]  # the rank file around them (ds_config, ds_version)
    model_files: list[dict[str, Any]]  # ZeRO-1/2: [mp_rank_00]; ZeRO-3: per old rank (frozen fragments)
    bf16_optimizer: bool = False
    elastic: bool = False

    def group_params(self, g: int) -> list[_Param]:
        return [p for p in self.params if p.group == g]

    @property
    def num_groups(self) -> int:
        return 1 + max((p.group for p in self.params), default=-1)


def _zero12_native(ckpt: ZeroCheckpoint) -> _Sources:
    model0 = ckpt.rank_model_files[0]
    osds = [f["optimizer_state_dict"] for f in ckpt.rank_optim_files]
    elastic = isinstance(osds[0].get("base_optimizer_state"), list)
    align = osds[0].get("param_alignment_paddings")
    params, full, steps = [], {}, []
    states = [o["base_optimizer_state"] if elastic else o["base_optimizer_state"]["state"] for o in osds]
    keys = ["fp32"] + _moment_keys(states[0][0])
    for g, shapes in enumerate(model0["param_shapes"]):
        group = [
            _Param(n, tuple(int(x) for x in s), _numel(s), g, align[g][i] if align else 0)
            for i, (n, s) in enumerate(shapes.items())
        ]
        total = sum(p.numel + p.align_pad for p in group)
        size = partition.zero12_partition_size(total, ckpt.dp_world_size)
        real = [max(0, min(size, total - r * size)) for r in range(ckpt.dp_world_size)]
        for key in keys:
            olds = (
                [o["single_partition_of_fp32_groups"][g] for o in osds]
                if key == "fp32"
                else [s[g][key] for s in states]
            )
            vector: Pieces = [Slice(olds[p.rank], p.start, p.count) for p in partition.split_range(0, total, real)]
            pos = 0
            for p in group:
                full[(p.name, key)] = take(vector, pos, p.numel)
                pos += p.numel + p.align_pad
        params += group
        steps.append({k: v for k, v in states[0][g].items() if k not in keys})
    sharded = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings")
    common = {k: v for k, v in osds[0].items() if k not in sharded}
    base = osds[0]["base_optimizer_state"]
    common["param_groups"] = None if elastic else base["param_groups"]
    return _Sources(ckpt.zero_stage, params, keys, full, steps, common, _wrapper(ckpt.rank_optim_files[0]),
                    [model0], ckpt.optimizer_kind == "bf16_optimizer", elastic)  # fmt: skip


def _zero3_native(ckpt: ZeroCheckpoint) -> _Sources:
    model0 = ckpt.rank_model_files[0]
    osds = [f["optimizer_state_dict"] for f in ckpt.rank_optim_files]
    inner = osds[0]["optimizer_state_dict"]
    keys = ["fp32"] + _moment_keys(inner["state"][0])
    group_of = {int(sg): g for g, pg in enumerate(inner["param_groups"]) for sg in pg["params"]}
    params, full = [], {}
    for sg, shapes in enumerate(model0["param_shapes"]):
        numels = [_numel(s) for s in shapes.values()]
        for (name, shape), numel, off in zip(
            shapes.items(), numels, partition.zero3_subgroup_offsets(numels, ckpt.dp_world_size)
        ):
            params.append(_Param(name, tuple(int(x) for x in shape), numel, group_of[sg]))
            for key in keys:
                olds = [
                    o["fp32_flat_groups"][sg] if key == "fp32" else o["optimizer_state_dict"]["state"][sg][key]
                    for o in osds
                ]
                full[(name, key)] = [
                    Slice(olds[p.rank], p.start, p.count)
                    for p in partition.zero3_pieces(numel, ckpt.dp_world_size, off)
                ]
    # flat order within each param group, as DeepSpeed builds its sub-groups
    params.sort(key=lambda p: p.group)
    first_sg = {g: int(pg["params"][0]) for g, pg in enumerate(inner["param_groups"])}
    steps = [{k: v for k, v in inner["state"][first_sg[g]].items() if k not in keys} for g in range(len(first_sg))]
    common = {k: v for k, v in osds[0].items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
    common["param_groups"] = inner["param_groups"]
    return _Sources(3, params, keys, full, steps, common, _wrapper(ckpt.rank_optim_files[0]), ckpt.rank_model_files)


def _wrapper(optim_file: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in optim_file.items() if k != "optimizer_state_dict"}


def _is_flat_state(value: Any) -> bool:
    return isinstance(value, LazyTensor) and value.dim() > 0  # `step` may be a 0-dim tensor: not sharded


def _moment_keys(state: dict[str, Any]) -> list[str]:
    return [k for k, v in state.items() if _is_flat_state(v)]


# --- Universal checkpoints (read) ---------------------------------------------------------------------------


def _universal_tensor(path: Path) -> LazyTensor:
    obj = load_pickle(path)
    tensor = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(tensor, LazyTensor):
        raise CorruptCheckpointError(f"{path} holds no tensor")
    return tensor


def _universal_sources(root: Path, tag: str | None) -> tuple[_Sources, str]:
    latest = root / "latest_universal"
    if tag is None:
        if not latest.is_file():
            raise CheckpointNotFoundError(f"{root} has no latest_universal file; pass --tag")
        tag = latest.read_text().strip()
    tag = check_tag_name(tag)
    tag_dir = root / tag
    zero = tag_dir / "zero"
    if not (zero / "optimizer_state.pt").is_file():
        raise CheckpointNotFoundError(f"{zero / 'optimizer_state.pt'} is missing: not a universal checkpoint tag")
    common = load_pickle(zero / "optimizer_state.pt")
    stage = int(common.get("zero_stage", 1))
    model_names = sorted(p.name for p in tag_dir.glob("*_model_states.pt"))
    if not model_names:
        raise CheckpointNotFoundError(f"{tag_dir} has no *_model_states.pt file")
    if stage == 3:
        ranked = sorted(model_names, key=lambda n: int(n.split("_")[3]))
        model_files = [load_pickle(tag_dir / n) for n in ranked]
        group_shapes = model_files[0]["param_shapes"]
        inner = common["optimizer_state_dict"]
        group_of = {int(sg): g for g, pg in enumerate(inner["param_groups"]) for sg in pg["params"]}
        shapes = [(n, s, group_of[sg]) for sg, g in enumerate(group_shapes) for n, s in g.items()]
        steps_src = [{k: v for k, v in inner["state"][int(pg["params"][0])].items() if not _is_flat_state(v)}
                     for pg in inner["param_groups"]]  # fmt: skip
    else:
        model_files = [load_pickle(tag_dir / "mp_rank_00_model_states.pt")]
        shapes = [(n, s, g) for g, group in enumerate(model_files[0]["param_shapes"]) for n, s in group.items()]
        steps_src = None
    align = common.get("param_alignment_paddings")
    params, full, keys = [], {}, ["fp32", "exp_avg", "exp_avg_sq"]
    index_in_group: dict[int, int] = {}
    for name, shape, g in shapes:
        i = index_in_group.get(g, 0)
        index_in_group[g] = i + 1
        pad = align[g][i] if (align and stage != 3) else 0
        params.append(_Param(name, tuple(int(x) for x in shape), _numel(shape), g, pad))
        for key in keys:
            path = zero / name / f"{key}.pt"
            if not path.is_file():
                raise CheckpointNotFoundError(f"universal checkpoint lacks {path}")
            tensor = _universal_tensor(path)
            if tensor.numel() != _numel(shape):
                raise CorruptCheckpointError(f"{path} holds {tensor.numel()} elements, {name} has {_numel(shape)}")
            full[(name, key)] = [Slice(tensor, 0, tensor.numel())]
    params.sort(key=lambda p: p.group)
    if steps_src is None:
        steps_src = []
        for g in range(1 + max(p.group for p in params)):
            first = next(p for p in params if p.group == g)
            step = zero / first.name / "step.pt"
            steps_src.append({"step": load_pickle(step)} if step.is_file() else {})
    wrapper = {"ds_config": model_files[0].get("ds_config"), "ds_version": model_files[0].get("ds_version")}
    src = _Sources(stage, params, keys, full, steps_src, {**common}, wrapper, model_files, "zero_stage" not in common)
    if stage == 3:
        src.model_files = model_files
    return src, tag


# --- Native ZeRO-1/2 rank files -----------------------------------------------------------------------------


def _zero12_files(src: _Sources, dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    common = {k: v for k, v in src.common.items() if k != "param_groups"}
    osds = [{**common, "single_partition_of_fp32_groups": [], "group_paddings": [], "param_slice_mappings": [],
             "partition_count": [dp] * src.num_groups,
             "base_optimizer_state": [] if src.elastic else {"state": {}, "param_groups": src.common["param_groups"]}}
            for _ in range(dp)]  # fmt: skip
    for g in range(src.num_groups):
        group = src.group_params(g)
        vectors = {
            key: [piece for p in group for piece in padded(src.full[(p.name, key)], p.align_pad)] for key in src.keys
        }
        total = sum(p.numel + p.align_pad for p in group)
        size = partition.zero12_partition_size(total, dp)
        for r, osd in enumerate(osds):
            lo = r * size
            n = max(0, min(size, total - lo))
            fp32 = take(vectors["fp32"], lo, n)
            osd["single_partition_of_fp32_groups"].append(
                _master(padded(fp32, size - n) if src.bf16_optimizer else fp32)
            )
            state = dict(src.steps[g])
            for key in src.keys[1:]:
                part = take(vectors[key], lo, n)
                state[key] = _flat(part if src.elastic else padded(part, size - n))
            if src.elastic:
                osd["base_optimizer_state"].append(state)
            else:
                osd["base_optimizer_state"]["state"][g] = state
            # BF16_Optimizer records the whole group's padding on the last rank only
            pad = (size * dp - total if r == dp - 1 else 0) if src.bf16_optimizer else size - n
            osd["group_paddings"].append(pad)
            osd["param_slice_mappings"].append(_slice_mappings(group, lo, lo + n))
    if src.bf16_optimizer:
        for osd in osds:
            osd.pop("param_alignment_paddings", None)
    return [{**src.model_files[0], "dp_world_size": dp}], [{**src.wrapper, "optimizer_state_dict": o} for o in osds]


def _slice_mappings(group: list[_Param], lo: int, hi: int) -> OrderedDict[str, Any]:
    """DeepSpeed's param_slice_mappings: each param touching [lo, hi) with its (numel, start) in the partition."""
    mapping: OrderedDict[str, Any] = OrderedDict()
    off = 0
    for p in group:
        start, end = max(off, lo), min(off + p.numel, hi)
        if start < end:
            mapping[p.name] = _fragment(end - start, start - lo)
        off += p.numel + p.align_pad
    return mapping


# --- Native ZeRO-3 rank files -------------------------------------------------------------------------------


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


def _zero3_slice(pieces: Pieces, numel: int, dp: int, rank: int) -> Pieces:
    """Rank `rank`'s ceil(numel/dp) elements of a parameter; padding is zero, never uninitialised memory."""
    p = partition.zero3_partition_numel(numel, dp)
    n = max(0, min(p, numel - rank * p))
    return padded(take(pieces, rank * p, n) if n else [], p - n)


def _zero3_files(src: _Sources, dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ds_config = src.wrapper.get("ds_config") or {}
    sub_group_size = int(
        float((ds_config.get("zero_optimization") or {}).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    )
    subgroups: list[list[_Param]] = []
    param_groups = []
    for g, pg in enumerate(src.common["param_groups"]):
        group = src.group_params(g)
        ids = []
        for members in split_subgroups([partition.zero3_partition_numel(p.numel, dp) for p in group], sub_group_size):
            ids.append(len(subgroups))
            subgroups.append([group[i] for i in members])
        param_groups.append({**pg, "params": ids})
    group_of = {id(p): p.group for p in src.params}
    common = {k: v for k, v in src.common.items() if k != "param_groups"}
    optim_files = []
    for r in range(dp):
        flat, state = [], {}
        for sg, members in enumerate(subgroups):

            def pieces(key: str) -> Pieces:
                return [x for p in members for x in _zero3_slice(src.full[(p.name, key)], p.numel, dp, r)]

            flat.append(_master(pieces("fp32")))
            steps = {k: _own_copy(v) for k, v in src.steps[group_of[id(members[0])]].items()}
            state[sg] = {**steps, **{k: _flat(pieces(k)) for k in src.keys[1:]}}
        osd = {**common, "partition_count": dp, "fp32_flat_groups": flat,
               "optimizer_state_dict": {"state": state, "param_groups": param_groups}}  # fmt: skip
        optim_files.append({**src.wrapper, "optimizer_state_dict": osd})
    return _zero3_model_files(src, subgroups, dp), optim_files


def _own_copy(value: Any) -> Any:
    """A stored tensor written as its own storage: torch AdamW's 0-dim `step` must not be shared between
    sub-groups, or each optimizer step would advance it once per sub-group."""
    if isinstance(value, LazyTensor):
        return NewTensor(value.dtype, (Slice(value, 0, value.numel()),), value.shape)
    return value


def _zero3_model_files(src: _Sources, subgroups: list[list[_Param]], dp: int) -> list[dict[str, Any]]:
    model0 = src.model_files[0]
    old_dp = len(src.model_files)
    param_shapes = [OrderedDict((p.name, TorchSize(p.shape)) for p in members) for members in subgroups]
    frozen = {}
    for name, shape in (model0.get("frozen_param_shapes") or {}).items():
        numel = _numel(shape)
        olds = [m["frozen_param_fragments"][name] for m in src.model_files]
        old_counts = [pc.count for pc in partition.zero3_pieces(numel, old_dp, 0)]
        frozen[name] = (
            [Slice(olds[p.rank], p.start, p.count) for p in partition.split_range(0, numel, old_counts)],
            olds[0].dtype,
        )
    files = []
    for r in range(dp):
        fragments = OrderedDict((n, NewTensor(dt, tuple(_zero3_slice(pcs, sum(x.count for x in pcs), dp, r))))
                                for n, (pcs, dt) in frozen.items())  # fmt: skip
        files.append({**model0, "dp_world_size": dp, "param_shapes": param_shapes,
                      "frozen_param_fragments": fragments if frozen else model0.get("frozen_param_fragments"),
                      "shared_params": model0.get("shared_params") if r == 0 else {}})  # fmt: skip
    return files


# --- Universal checkpoints (write) --------------------------------------------------------------------------


def _universal_files(src: _Sources) -> dict[str, Any]:
    """Relative path -> object: DeepSpeed's universal layout, one folder per parameter.

    Every state file is `{"param": full-shape fp32, "cat_dim": 0}` with a `step.pt` beside it, for all
    stages (ds_to_universal writes bare flat tensors and no step.pt for ZeRO-3; DeepSpeed reads both).
    The shared optimizer state is lean: no rank's shard is copied into it.
    """
    files: dict[str, Any] = {}
    for p in src.params:
        for key in src.keys:
            files[f"zero/{p.name}/{key}.pt"] = {"param": _flat(src.full[(p.name, key)], p.shape), "cat_dim": 0}
        if "step" in src.steps[p.group]:
            files[f"zero/{p.name}/step.pt"] = src.steps[p.group]["step"]
    common = dict(src.common)
    if src.stage == 3:  # DeepSpeed reads the step from state[0]; keyed like its sub-groups, without tensors
        groups = src.common["param_groups"]
        common["optimizer_state_dict"] = {
            "state": {int(pg["params"][0]): dict(src.steps[g]) for g, pg in enumerate(groups)},
            "param_groups": groups,
        }
    elif common.get("param_groups") is None:
        raise UnsupportedCheckpointError("elastic ZeRO-1/2 checkpoints carry no param_groups; reshard natively instead")
    files["zero/optimizer_state.pt"] = common
    return files


# --- Files around the tag: latest, Trainer files, RNG states ------------------------------------------------


def _copy_root_files(root: Path, out: Path, old_dp: int | None, new_dp: int | None, skip: set[str]) -> list[str]:
    """Everything beside the tag folders comes along; RNG files follow the new ranks."""
    rng_files = sorted(p.name for p in root.glob("rng_state*.pth"))
    for item in root.iterdir():
        if item.name in skip or item.name in rng_files:
            continue
        if item.is_dir():
            if not any(item.glob("*_model_states.pt")):  # tag folders: only the converted one is written
                shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    if not rng_files:
        return []
    if old_dp is None or new_dp is None:
        for name in rng_files:
            shutil.copy2(root / name, out / name)
        return ["RNG states copied as they are"]
    return [_place_rng_states(root, out, old_dp, new_dp)]


def _place_rng_states(root: Path, out: Path, old_dp: int, new_dp: int) -> str:
    """Trainer restores `rng_state_{rank}.pth` (or `rng_state.pth` at one process); keep what maps over."""

    def old_file(rank: int) -> Path | None:
        path = root / ("rng_state.pth" if old_dp == 1 else f"rng_state_{rank}.pth")
        return path if path.is_file() else None

    if new_dp == 1:
        if src := old_file(0):
            shutil.copy2(src, out / "rng_state.pth")
        return "RNG states: rank 0's kept as rng_state.pth; the other ranks' random streams do not carry over"
    for rank in range(min(old_dp, new_dp)):
        if src := old_file(rank):
            shutil.copy2(src, out / f"rng_state_{rank}.pth")
    if new_dp > old_dp:
        return (
            f"RNG states: carried over for {_ranks(0, old_dp)}; {_ranks(old_dp, new_dp)} start without one, so "
            "the Trainer logs that it found no RNG file and continues with fresh random streams there"
        )
    return f"RNG states: carried over for {_ranks(0, new_dp)}; those of {_ranks(new_dp, old_dp)} are dropped"


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


# --- Entry point --------------------------------------------------------------------------------------------


def is_universal(path: Path) -> bool:
    return (path / "latest_universal").is_file() or (path / "zero" / "optimizer_state.pt").is_file()


def reshard(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    dp: int | None = None,
    universal: bool = False,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> ReshardResult:
    """Write a native ZeRO checkpoint for `dp` ranks, or (`universal=True`) a universal checkpoint.

    Args:
        path: a native checkpoint (see `read_checkpoint`) or a universal one (holding `latest_universal`).
        out_dir: output folder; defaults to `dp<M>-<name>` or `universal-<name>` beside the input.
        dp: the new data-parallel size (native output).
        universal: write DeepSpeed's universal format instead, loadable at any DP size.
        on_start: called once with the number of tensor bytes to write.
        on_progress: called with the number of bytes written after each chunk.

    Example:
        >>> reshard("out/checkpoint-500", "out/dp8-checkpoint-500", dp=8).files[0]
        'global_step500/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'
    """
    if universal == (dp is not None):
        raise UsageError("pass exactly one of --dp M or --universal")
    if dp is not None and dp < 1:
        raise UsageError(f"--dp must be at least 1, not {dp}")
    path = Path(path)
    if path.is_dir() and is_universal(path):
        if universal:
            raise UsageError(f"{path} is already a universal checkpoint; pass --dp M to turn it into native shards")
        root, tag = (path.parent, path.name) if (path / "zero").is_dir() else (path, tag)
        src, tag = _universal_sources(root, tag)
        return _write(root, tag, src, None, dp, out_dir, overwrite, _universal_prefix(src), (on_start, on_progress))
    ckpt = read_checkpoint(path, tag=tag, step=step, best=best)
    if dp == ckpt.dp_world_size and out_dir is None:
        result = ReshardResult(None, ckpt.location.tag, ckpt.zero_stage, dp, dp, [])
        result.notes.append(f"the checkpoint is already at DP {dp}; nothing to do")
        return result
    src = _zero3_native(ckpt) if ckpt.zero_stage == 3 else _zero12_native(ckpt)
    return _write(ckpt.location.root, ckpt.location.tag, src, ckpt.dp_world_size, dp, out_dir, overwrite,
                  ckpt.location.files.optim_prefix, (on_start, on_progress))  # fmt: skip


def _universal_prefix(src: _Sources) -> str:
    ds_config = src.wrapper.get("ds_config") or {}
    return "bf16_" if (ds_config.get("bf16") or {}).get("enabled") else ""


def _default_out(root: Path, dp: int | None) -> Path:
    """`dp<M>-<name>` / `universal-<name>` beside the input (never matched by Trainer's checkpoint rotation)."""
    return root.parent / (f"dp{dp}-{root.name}" if dp else f"universal-{root.name}")


def _write(root: Path, tag: str, src: _Sources, old_dp: int | None, dp: int | None, out_dir: Any,
           overwrite: bool, prefix: str, progress: _ProgressFns) -> ReshardResult:  # fmt: skip
    out = check_output_dir(Path(out_dir) if out_dir else _default_out(root, dp), root, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out.parent, sum(p.stat().st_size for p in (root / tag).rglob("*") if p.is_file()))
    result = ReshardResult(None, tag, src.stage, old_dp, dp, [])
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / tag).mkdir(parents=True)
        if dp is not None and dp == old_dp:
            shutil.copytree(root / tag, tmp / tag, dirs_exist_ok=True)
            result.notes.append(f"the checkpoint is already at DP {dp}; copied unchanged")
        else:
            result.files = _write_tag(src, dp, tmp / tag, prefix, progress)
        skip = {tag, "latest", "latest_universal"}
        result.notes += _copy_root_files(root, tmp, old_dp, dp, skip)
        (tmp / ("latest" if dp else "latest_universal")).write_text(tag)
        if dp is None:
            result.notes.append('load it with "checkpoint": {"load_universal": true} in the DeepSpeed config')
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.output_dir = str(out)
    return result


def _write_tag(src: _Sources, dp: int | None, tag_dir: Path, prefix: str, progress: _ProgressFns) -> list[str]:
    if dp is None:
        files = _universal_files(src)
        for i, m in enumerate(src.model_files):
            name = f"zero_pp_rank_{i}_mp_rank_00_model_states.pt" if src.stage == 3 else "mp_rank_00_model_states.pt"
            files[name] = m
    else:
        model_files, optim_files = (_zero3_files if src.stage == 3 else _zero12_files)(src, dp)
        files = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt": o for r, o in enumerate(optim_files)}
        for r, m in enumerate(model_files):
            files[
                f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if src.stage == 3 else "mp_rank_00_model_states.pt"
            ] = m
    for name in files:
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
    with RecordReader() as reader:
        on_start, on_progress = progress
        write_torch_files([(tag_dir / name, obj) for name, obj in files.items()], reader, on_start=on_start,
                          on_progress=on_progress)  # fmt: skip
        reader.finish()  # CRC-32 of every source record read
    return [f"{tag_dir.name}/{n}" for n in files]

"""Open a DeepSpeed ZeRO checkpoint: check its rank files agree, and describe where every tensor lives.

`read_checkpoint` reads only the small pickles; tensor bytes stay on disk until a writer asks for them
through the `Segment`s of a `TensorSource`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, partition
from .dtypes import DType
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from .layout import CheckpointLocation, locate
from .torchfile import LazyTensor, load_pickle

STRIPPED_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class Segment:
    """`count` elements from element `start` of a stored tensor (read flat)."""

    tensor: LazyTensor
    start: int
    count: int


@dataclass(frozen=True)
class TensorSource:
    """One output tensor: its name, shape, stored dtype, and the stored segments that make it up, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    segments: tuple[Segment, ...]
    kind: str  # "trainable" | "frozen" | "buffer"

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class ZeroCheckpoint:
    """A parsed ZeRO checkpoint. `keys` is the model's state-dict order (without prefixes)."""

    location: CheckpointLocation
    zero_stage: int
    dp_world_size: int
    train_dtype: DType
    optimizer_kind: str  # "zero" (DeepSpeedZeroOptimizer / stage 3) or "bf16_optimizer"
    ds_version: str
    global_steps: int | None
    keys: list[str]
    masters: dict[str, TensorSource]  # trainable params, fp32 master weights
    bit16: dict[str, TensorSource]  # frozen params, and ZeRO-1/2 module copies of trainable ones
    buffers: dict[str, TensorSource]
    shared_params: dict[str, str]  # alias -> owner (tied weights)
    frozen_excluded: bool  # saved with exclude_frozen_parameters: frozen (base) weights are absent
    ds_config: dict[str, Any] = field(default_factory=dict)
    model_state: dict[str, Any] = field(default_factory=dict)
    rank_optim_files: list[dict[str, Any]] = field(default_factory=list)  # whole pickles, per DP rank
    rank_model_files: list[dict[str, Any]] = field(default_factory=list)  # ZeRO-3: per rank; else [rank 0]

    @property
    def frozen_names(self) -> list[str]:
        return [k for k in self.keys if k in self.bit16 and k not in self.masters]

    def sources(self, dtype: DType) -> list[TensorSource]:
        """The source of every output tensor (aliases excluded) for output `dtype`, in `keys` order.

        fp32 output takes trainable params from the fp32 masters (what zero_to_fp32 writes). 16-bit output
        takes ZeRO-1/2 module weights when they already are that dtype (the bytes the engine saves), and
        otherwise casts the fp32 masters, as the engine does after every step.
        """
        out = []
        for name in self.keys:
            if name in self.shared_params:
                continue
            if name in self.masters:
                module_copy = self.bit16.get(name)
                use_module = dtype != dtypes.FLOAT32 and module_copy is not None and module_copy.dtype == dtype
                out.append(module_copy if use_module else self.masters[name])
            elif name in self.bit16:
                out.append(self.bit16[name])
            elif name in self.buffers:
                out.append(self.buffers[name])
        return out

    def param_count(self) -> int:
        return sum(s.numel() for s in self.sources(dtypes.FLOAT32) if s.kind != "buffer")


def strip_prefixes(name: str) -> str:
    """Drop the `module.` (DDP / engine.state_dict) and `_orig_mod.` (torch.compile) wrappers."""
    changed = True
    while changed:
        changed = False
        for prefix in STRIPPED_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value)


def _whole(name: str, t: LazyTensor, kind: str) -> TensorSource:
    if not t.is_contiguous():
        raise CorruptCheckpointError(f"tensor {name} is stored non-contiguously; unexpected in a DeepSpeed file")
    t.check_bounds()
    return TensorSource(name, t.shape, t.dtype, (Segment(t, 0, t.numel()),), kind)


def _load_rank_files(loc: CheckpointLocation, names: Mapping[int, str], what: str, dp: int) -> list[dict[str, Any]]:
    missing = sorted(set(range(dp)) - set(names))
    extra = sorted(set(names) - set(range(dp)))
    if missing:
        raise CheckpointNotFoundError(
            f"{loc.tag_dir}: expected {dp} {what} files (dp_world_size={dp} recorded in the checkpoint), found "
            f"{len(names)}: rank {', '.join(map(str, missing))} missing. The save may have been interrupted; "
            "re-copy the folder or pick another tag with --tag"
        )
    if extra:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: {what} files for rank {', '.join(map(str, extra))} do not belong to a run with "
            f"dp_world_size={dp}; remove the stray files (left over from another run?)"
        )
    files = []
    for rank in range(dp):
        obj = load_pickle(loc.tag_dir / names[rank])
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(
                f"{loc.tag_dir / names[rank]} does not hold a dict: not a DeepSpeed {what} file"
            )
        files.append(obj)
    return files


def _require(obj: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in obj:
        raise CorruptCheckpointError(f"{path} lacks '{key}': not a DeepSpeed ZeRO checkpoint file (or a damaged one)")
    return obj[key]


def _refuse_unsupported(model_state: Mapping[str, Any], path: Path) -> None:
    if model_state.get("module") is None:
        raise UnsupportedCheckpointError(
            f"{path} has no module weights (module is None): a pipeline-parallel checkpoint"
        )
    if model_state.get("mp_world_size", 1) not in (1, None):
        raise UnsupportedCheckpointError(
            f"{path}: tensor/model parallel size {model_state['mp_world_size']} is not supported"
        )
    if model_state.get("num_experts") or model_state.get("ds_autoep_layers"):
        raise UnsupportedCheckpointError(f"{path} is a MoE checkpoint; MoE experts are not supported yet")
    dims = model_state.get("checkpoint_parallel_dimensions") or {}
    if dims.get("pp_degree", 1) > 1 or dims.get("tp_degree", 1) > 1:
        raise UnsupportedCheckpointError(f"{path}: pipeline/tensor parallel degrees {dims} are not supported")
    offload = ((model_state.get("ds_config") or {}).get("zero_optimization") or {}).get("offload_optimizer") or {}
    if isinstance(offload, dict) and offload.get("device") == "nvme":
        raise UnsupportedCheckpointError(
            f"{path}: the optimizer state was offloaded to NVMe; its fp32 weights are not in the checkpoint files"
        )


def _train_dtype(module: Mapping[str, Any], names: Iterable[str]) -> DType:
    for name in names:
        t = module.get(name)
        if isinstance(t, LazyTensor) and t.dtype.is_floating_point:
            return t.dtype
    return dtypes.FLOAT32


def read_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> ZeroCheckpoint:
    """Open a ZeRO checkpoint and check its rank files agree.

    Args:
        path: a save_dir (holding `latest`), a Trainer `checkpoint-N/` or output_dir, or a tag folder.
        tag: tag folder to read; defaults to `latest`.
        step, best: choose a `checkpoint-N` inside a Trainer output_dir.

    Raises:
        CkptError subclasses naming the problem: missing/extra rank files, disagreeing ranks, damaged files,
        unsupported layouts.

    Example:
        >>> ckpt = read_checkpoint("out/checkpoint-500")
        >>> ckpt.zero_stage, ckpt.dp_world_size
        (3, 8)
    """
    loc = locate(Path(path), tag=tag, step=step, best=best)
    first_model_path = loc.tag_dir / loc.files.model_files[min(loc.files.model_files)]
    model0 = load_pickle(first_model_path)
    if not isinstance(model0, dict):
        raise CorruptCheckpointError(f"{first_model_path} does not hold a dict: not a DeepSpeed model-states file")
    _refuse_unsupported(model0, first_model_path)
    dp = int(_require(model0, "dp_world_size", first_model_path))
    optims = _load_rank_files(loc, loc.files.optim_files, "*_optim_states.pt", dp)
    osds = [_require(o, "optimizer_state_dict", loc.tag_dir / loc.files.optim_files[r]) for r, o in enumerate(optims)]
    stages = {int(o.get("zero_stage", 1)) for o in osds}
    if len(stages) != 1:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: rank files disagree on the ZeRO stage ({sorted(stages)}); mixed runs?"
        )
    stage = stages.pop()
    if loc.files.zero3_layout != (stage == 3):
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: model-state file names do not match ZeRO stage {stage}; files from different runs mixed?"
        )
    if stage == 3:
        models = _load_rank_files(loc, loc.files.model_files, "*_model_states.pt", dp)
        ckpt = _read_zero3(loc, models, osds, dp)
    else:
        models = [model0]
        ckpt = _read_zero12(loc, model0, osds, dp, stage)
    ckpt.rank_optim_files, ckpt.rank_model_files = optims, models
    return ckpt


def _common(loc: CheckpointLocation, model0: dict[str, Any], dp: int) -> dict[str, Any]:
    module = model0["module"]
    keys_raw = list(module.keys())
    keys = [strip_prefixes(k) for k in keys_raw]
    if len(set(keys)) != len(keys):
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: parameter names collide after stripping module./_orig_mod. prefixes"
        )
    module = {strip_prefixes(k): v for k, v in module.items()}
    buffers = {}
    for raw in model0.get("buffer_names") or []:
        name = strip_prefixes(raw)
        if isinstance(module.get(name), LazyTensor):
            buffers[name] = _whole(name, module[name], "buffer")
    shared = {strip_prefixes(a): strip_prefixes(o) for a, o in (model0.get("shared_params") or {}).items()}
    return {"module": module, "keys": keys, "buffers": buffers, "shared": shared}


def _check_shapes(loc: CheckpointLocation, param_shapes: Any) -> list[dict[str, tuple[int, ...]]]:
    if not isinstance(param_shapes, list) or not all(isinstance(g, dict) for g in param_shapes):
        raise CorruptCheckpointError(f"{loc.tag_dir}: param_shapes is not a list of dicts")
    return [{strip_prefixes(n): _shape(s) for n, s in g.items()} for g in param_shapes]


def _read_zero12(
    loc: CheckpointLocation, model0: dict[str, Any], osds: list[dict[str, Any]], dp: int, stage: int
) -> ZeroCheckpoint:
    path0 = loc.tag_dir / loc.files.model_files[0]
    common = _common(loc, model0, dp)
    module = common["module"]
    groups = _check_shapes(loc, _require(model0, "param_shapes", path0))
    bf16_optimizer = "zero_stage" not in osds[0]
    counts = [o.get("partition_count") for o in osds]
    for rank, c in enumerate(counts):
        cs = set(c) if isinstance(c, (list, tuple)) else {c}
        if cs != {dp}:
            raise CorruptCheckpointError(
                f"{loc.tag_dir}: rank {rank}'s optimizer file was written at DP size {sorted(cs)}, but the model states "
                f"say dp_world_size={dp}; files from different runs are mixed"
            )
    masters: dict[str, TensorSource] = {}
    for g, shapes in enumerate(groups):
        parts = []
        for rank, osd in enumerate(osds):
            fp32 = osd["single_partition_of_fp32_groups"]
            if g >= len(fp32) or not isinstance(fp32[g], LazyTensor):
                raise CorruptCheckpointError(f"{loc.tag_dir}: rank {rank} has no fp32 partition for param group {g}")
            fp32[g].check_bounds()
            parts.append(fp32[g])
        names = list(shapes)
        numels = [_numel(shapes[n]) for n in names]
        align = (osds[0].get("param_alignment_paddings") or [None] * len(groups))[g]
        offsets = partition.zero12_param_offsets(numels, align)
        total = (offsets[-1] + numels[-1]) if names else 0
        lengths = [p.numel() for p in parts]
        available = sum(lengths)
        # Unstripped (BF16_Optimizer) partitions carry the group's alignment padding at the end.
        expected = partition.zero12_partition_size(total, dp) * dp if bf16_optimizer else total
        if available != expected:
            raise CorruptCheckpointError(
                f"{loc.tag_dir}: param group {g} should hold {expected} fp32 elements across {dp} ranks, "
                f"found {available}; the files do not match param_shapes (mixed runs or damaged files)"
            )
        for name, numel, off in zip(names, numels, offsets):
            segs = tuple(Segment(parts[p.rank], p.start, p.count) for p in partition.split_range(off, numel, lengths))
            masters[name] = TensorSource(name, shapes[name], dtypes.FLOAT32, segs, "trainable")
    bit16 = {}
    for name, value in module.items():
        if isinstance(value, LazyTensor) and name not in common["buffers"] and name not in common["shared"]:
            bit16[name] = _whole(name, value, "trainable" if name in masters else "frozen")
    for name, value in (model0.get("frozen_param_fragments") or {}).items():
        name = strip_prefixes(name)
        if isinstance(value, LazyTensor) and name not in bit16:
            bit16[name] = _whole(name, value, "frozen")
    return _assemble(loc, model0, common, stage, dp, "bf16_optimizer" if bf16_optimizer else "zero", masters, bit16)


def _read_zero3(
    loc: CheckpointLocation, models: list[dict[str, Any]], osds: list[dict[str, Any]], dp: int
) -> ZeroCheckpoint:
    model0 = models[0]
    path0 = loc.tag_dir / loc.files.model_files[0]
    common = _common(loc, model0, dp)
    for rank, (m, o) in enumerate(zip(models, osds)):
        if m.get("dp_world_size") != dp or int(o.get("partition_count", -1)) != dp:
            raise CorruptCheckpointError(
                f"{loc.tag_dir}: rank {rank} was written at DP size {m.get('dp_world_size')}/{o.get('partition_count')}, "
                f"rank 0 at {dp}; files from different runs are mixed"
            )
    subgroups = _check_shapes(loc, _require(model0, "param_shapes", path0))
    masters: dict[str, TensorSource] = {}
    for sg, shapes in enumerate(subgroups):
        names = list(shapes)
        numels = [_numel(shapes[n]) for n in names]
        offsets = partition.zero3_subgroup_offsets(numels, dp)
        flat_len = sum(partition.zero3_partition_numel(n, dp) for n in numels)
        flats = []
        for rank, osd in enumerate(osds):
            groups = osd.get("fp32_flat_groups") or []
            if sg >= len(groups) or not isinstance(groups[sg], LazyTensor) or groups[sg].numel() != flat_len:
                found = groups[sg].numel() if sg < len(groups) and isinstance(groups[sg], LazyTensor) else "none"
                raise CorruptCheckpointError(
                    f"{loc.tag_dir}: rank {rank} sub-group {sg} should hold {flat_len} fp32 elements, found {found}; "
                    "the files do not match param_shapes"
                )
            groups[sg].check_bounds()
            flats.append(groups[sg])
        for name, numel, off in zip(names, numels, offsets):
            segs = tuple(Segment(flats[p.rank], p.start, p.count) for p in partition.zero3_pieces(numel, dp, off))
            masters[name] = TensorSource(name, shapes[name], dtypes.FLOAT32, segs, "trainable")
    bit16 = _zero3_frozen(loc, models, dp)
    return _assemble(loc, model0, common, 3, dp, "zero", masters, bit16)


def _assemble(
    loc: CheckpointLocation,
    model0: dict[str, Any],
    common: dict[str, Any],
    stage: int,
    dp: int,
    optimizer_kind: str,
    masters: dict[str, TensorSource],
    bit16: dict[str, TensorSource],
) -> ZeroCheckpoint:
    _check_sources(loc, masters, bit16)
    return ZeroCheckpoint(
        location=loc,
        zero_stage=stage,
        dp_world_size=dp,
        train_dtype=_train_dtype(common["module"], masters),
        optimizer_kind=optimizer_kind,
        ds_version=str(model0.get("ds_version", "")),
        global_steps=model0.get("global_steps"),
        keys=common["keys"],
        masters=masters,
        bit16=bit16,
        buffers=common["buffers"],
        shared_params=common["shared"],
        frozen_excluded=_frozen_excluded(loc, masters, bit16),
        ds_config=model0.get("ds_config") or {},
        model_state=model0,
    )


def _zero3_frozen(loc: CheckpointLocation, models: list[dict[str, Any]], dp: int) -> dict[str, TensorSource]:
    shapes = {strip_prefixes(n): _shape(s) for n, s in (models[0].get("frozen_param_shapes") or {}).items()}
    out = {}
    for name, shape in shapes.items():
        numel = _numel(shape)
        p = partition.zero3_partition_numel(numel, dp)
        segs = []
        for rank, m in enumerate(models):
            frags = {strip_prefixes(k): v for k, v in (m.get("frozen_param_fragments") or {}).items()}
            frag = frags.get(name)
            if not isinstance(frag, LazyTensor) or frag.numel() != p:
                raise CorruptCheckpointError(
                    f"{loc.tag_dir}: rank {rank} lacks the {p}-element fragment of frozen param {name}"
                )
            frag.check_bounds()
            count = max(0, min(p, numel - rank * p))
            if count:
                segs.append(Segment(frag, 0, count))
        dtype = segs[0].tensor.dtype if segs else dtypes.FLOAT32
        out[name] = TensorSource(name, shape, dtype, tuple(segs), "frozen")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_sources(
    loc: CheckpointLocation, masters: Mapping[str, TensorSource], bit16: Mapping[str, TensorSource]
) -> None:
    for name, src in bit16.items():
        if name in masters and src.shape != masters[name].shape:
            raise CorruptCheckpointError(
                f"{loc.tag_dir}: {name} has shape {list(src.shape)} in the module but {list(masters[name].shape)} "
                "in param_shapes; mixed files?"
            )


def _frozen_excluded(loc: CheckpointLocation, masters: Mapping[str, Any], bit16: Mapping[str, Any]) -> bool:
    """True when a PEFT/LoRA run saved without its frozen base weights (exclude_frozen_parameters=True)."""
    peft = (loc.root / "adapter_config.json").is_file() or any("lora_" in k for k in masters)
    return peft and not any(name not in masters for name in bit16)

"""Open a DeepSpeed ZeRO checkpoint into one validated model that every command consumes.

`read_checkpoint` reads only the small pickles and checks every invariant they offer (rank identity,
agreement between ranks, partition arithmetic, dtypes, names); tensor bytes stay on disk until a writer
asks for them through the `Segment`s of a `TensorSource`. `check_module_copies` is the one check that
needs tensor bytes: the ZeRO-1/2 16-bit module weights against the cast fp32 masters.

The model describes each trainable parameter by its fp32 master and every optimizer state under the
key the optimizer saved it with, as flat slices of the stored partitions: consolidation, resharding and
the universal format all read from it, none re-parses the pickles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.torchfile import LazyTensor, PickledObject, RecordReader, load_pickle
from ckpttools.layouts import partition
from ckpttools.layouts.locate import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

STRIPPED_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")  # DDP/engine, torch.compile, Lightning < 2.1


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
    kind: str  # "trainable" | "frozen" | "buffer" | "state"

    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class Replica:
    """Elements the output takes from one rank, and another rank's copy of them, which must be equal (AutoTP keeps
    replicated parameters on every TP rank; a copy that differs means a file from another save or run)."""

    what: str  # "<name> (<fp32|state key|module>) on TP rank <r>"
    merged: TensorSource
    copy: TensorSource


@dataclass(frozen=True)
class Param:
    """A trainable parameter: its fp32 master and every optimizer state, in the optimizer's flat order."""

    name: str  # without module./_orig_mod. prefixes
    file_name: str  # as the checkpoint's param_shapes names it
    shape: tuple[int, ...]
    group: int  # optimizer param group
    align_pad: int  # ZeRO-1/2 parameter_alignment padding after it in the flat buffer
    fp32: TensorSource
    states: dict[str, TensorSource]  # by the optimizer's own key: exp_avg, momentum_buffer, sum, ...

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer saved besides the sharded tensors, checked equal on every rank."""

    group_scalars: list[dict[str, Any]]  # per param group: non-sharded state entries (step, ...)
    common: dict[str, Any]  # loss scaler, clip_grad, zero_stage, param_groups (hyper-parameters), ...
    file_meta: dict[str, Any]  # the rank file around it (ds_config, ds_version)
    elastic: bool = False

    @property
    def param_groups(self) -> list[dict[str, Any]] | None:
        groups = self.common.get("param_groups")
        return groups if isinstance(groups, list) else None


@dataclass
class ZeroCheckpoint:
    """A parsed, validated ZeRO checkpoint. `keys` is the model's state-dict order (without prefixes)."""

    location: CheckpointLocation
    zero_stage: int
    dp_world_size: int
    train_dtype: DType
    optimizer_kind: str  # "zero" (DeepSpeedZeroOptimizer / stage 3) or "bf16_optimizer"
    ds_version: str
    global_steps: int | None
    keys: list[str]
    params: list[Param]  # trainable params in flat order, group by group
    optimizer: OptimizerState
    bit16: dict[str, TensorSource]  # frozen params, and ZeRO-1/2 module copies of trainable ones
    buffers: dict[str, TensorSource]
    shared_params: dict[str, str]  # alias -> owner (tied weights)
    frozen_excluded: bool  # saved with exclude_frozen_parameters: frozen (base) weights are absent
    ds_config: dict[str, Any] = field(default_factory=dict)
    model_files: list[dict[str, Any]] = field(default_factory=list)  # ZeRO-3: per rank; else [mp_rank_00], as stored
    source_format: str = "native"  # or "universal"
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    # Pipeline / tensor-parallel: per model-parallel rank (stage or TP rank), that slice as the data-parallel
    # ZeRO checkpoint its files hold (names as stored); resharding re-cuts each. Empty for plain DP.
    slices: list[ZeroCheckpoint] = field(default_factory=list)
    layout_files: list[str] = field(default_factory=list)  # DP-independent files of the layout, kept as they are
    replicas: list[Replica] = field(default_factory=list)  # checked by crosscheck.check_module_copies

    @functools.cached_property
    def masters(self) -> dict[str, TensorSource]:
        return {p.name: p.fp32 for p in self.params}

    @property
    def model_state(self) -> dict[str, Any]:
        return self.model_files[0]

    @property
    def frozen_names(self) -> list[str]:
        masters = self.masters
        return [k for k in self.keys if k in self.bit16 and k not in masters]

    @property
    def state_keys(self) -> list[str]:
        """Every optimizer state key present (in first-seen order); empty before the first optimizer step."""
        seen: dict[str, None] = {}
        for p in self.params:
            seen.update(dict.fromkeys(p.states))
        return list(seen)

    def sources(self, dtype: DType) -> list[TensorSource]:
        """The source of every output tensor (aliases excluded) for output `dtype`, in `keys` order.

        fp32 output takes trainable params from the fp32 masters (what zero_to_fp32 writes). 16-bit output
        takes ZeRO-1/2 module weights when they already are that dtype (the bytes the engine saves; checked
        equal to the cast masters by `check_module_copies`), and otherwise casts the fp32 masters, as the
        engine does after every step.
        """
        masters = self.masters
        out = []
        for name in self.keys:
            if name in self.shared_params:
                continue
            if name in masters:
                module_copy = self.bit16.get(name)
                if dtype != dtypes.FLOAT32 and module_copy is not None and module_copy.dtype == dtype:
                    out.append(module_copy)
                else:
                    out.append(masters[name])
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


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- Small typed accessors: every assumption about a pickled value is checked here -------------------------


class RankFile:
    """One loaded rank file: its path (for messages) and its top-level dict."""

    def __init__(self, path: Path, obj: Any, what: str) -> None:
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(f"{path} does not hold a dict: not a DeepSpeed {what} file")
        self.path, self.obj, self.what = path, obj, what

    def fail(self, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {problem}; the file is damaged or not from this run, re-copy it")

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"lacks '{where}{key}'")
        value = obj[key]
        if not isinstance(value, kind):
            raise self.fail(f"'{where}{key}' is a {type(value).__name__}, not {_kind_name(kind)}")
        return value

    def opt(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        value = obj.get(key) if isinstance(obj, dict) else None
        if value is not None and not isinstance(value, kind):
            raise self.fail(f"'{where}{key}' is a {type(value).__name__}, not {_kind_name(kind)}")
        return value

    def tensor(self, value: Any, where: str, *, floating: bool = True) -> LazyTensor:
        if not isinstance(value, LazyTensor):
            raise self.fail(f"{where} is a {type(value).__name__}, not a tensor")
        if floating and not value.dtype.is_floating_point:
            raise self.fail(f"{where} is stored as {value.dtype.name}, not a floating-point tensor")
        if not value.is_contiguous():
            raise self.fail(f"{where} is stored non-contiguously (unexpected in a DeepSpeed file)")
        value.check_bounds()
        return value

    def master(self, value: Any, where: str) -> LazyTensor:
        t = self.tensor(value, where)
        if t.dtype != dtypes.FLOAT32:
            raise self.fail(f"{where} (an fp32 master partition) is stored as {t.dtype.name}, not float32")
        if t.dim() != 1:
            raise self.fail(f"{where} (a flat partition) has shape {list(t.shape)}, not 1-D")
        return t


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("a tensor" if k is LazyTensor else f"a {k.__name__}" for k in kinds)


def shape_of(f: RankFile, value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value
    ):
        raise f.fail(f"{where} is not a shape ({short(value, 60)})")
    return tuple(int(s) for s in value)


def param_shapes_of(f: RankFile, value: Any, key: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        raise f.fail(f"'{key}' is not a list of dicts")
    groups = []
    for g, group in enumerate(value):
        entries = []
        for name, shape in group.items():
            if not isinstance(name, str):
                raise f.fail(f"'{key}'[{g}] holds a parameter name that is not a string")
            entries.append((name, shape_of(f, shape, f"'{key}'[{g}][{short(name)}]")))
        groups.append(entries)
    return groups


def _check_param_groups(f: RankFile, groups: list[Any], expected: int | None) -> None:
    """The optimizer's param groups: dicts with a `params` list (one flat param per group for ZeRO-1/2)."""
    if expected is not None and len(groups) != expected:
        raise f.fail(f"the optimizer has {len(groups)} param groups, param_shapes {expected}")
    for g, pg in enumerate(groups):
        f.get(pg, "params", list, f"param_groups[{g}].")
        if any(not isinstance(k, str) for k in pg):
            raise f.fail(f"param_groups[{g}] has a key that is not a string")


def state_entries(f: RankFile, state: Any, where: str) -> dict[str, Any]:
    """One optimizer state: sharded tensors and scalars (a step as a number or a 0-dim tensor), nothing else."""
    if not isinstance(state, dict):
        raise f.fail(f"the optimizer state of {where} is a {type(state).__name__}, not a dict")
    for key, value in state.items():
        if not isinstance(key, str):
            raise f.fail(f"the optimizer state of {where} has a key that is not a string")
        if not isinstance(value, (LazyTensor, int, float)):
            raise f.fail(f"optimizer state {key!r} of {where} is a {type(value).__name__}, not a tensor or a number")
    return state


def same_keys_everywhere(f: RankFile, keys: Sequence[Sequence[str]], what: str) -> None:
    """A torch optimizer keeps the same state entries for every group once it has stepped."""
    sets = [sorted(k) for k in keys]
    for i, k in enumerate(sets):
        if k != sets[0]:
            raise f.fail(f"{what} {i} has optimizer states {k}, {what} 0 {sets[0]}: a state was lost or added")


def flat_state_keys(state: Mapping[str, Any]) -> list[str]:
    """The sharded entries of an optimizer state (`step` may be a 0-dim tensor: not sharded)."""
    return [k for k, v in state.items() if isinstance(v, LazyTensor) and v.dim() > 0]


def scalar_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    flat = set(flat_state_keys(state))
    return {k: v for k, v in state.items() if k not in flat}


# --- Values that must agree between ranks ------------------------------------------------------------------


def fingerprint(value: Any, reader: RecordReader | None = None) -> Any:
    """A comparable form of a pickled value; small tensors (0-dim steps, scalars) by their bytes.

    Each container is converted once (pickles can share references), so the work is linear in the file.
    """
    memo: dict[int, Any] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, (dict, list, tuple, PickledObject)):
            if id(v) not in memo:
                memo[id(v)] = convert(v)
            return memo[id(v)]
        return convert(v)

    def convert(v: Any) -> Any:
        if isinstance(v, LazyTensor):
            data = None
            if reader is not None and v.numel() <= 64:
                start, length = v.byte_span()
                buf = bytearray(length)
                reader.readinto(v.record, start, memoryview(buf))
                data = bytes(buf)
            return ("tensor", v.dtype.name, v.shape, data)
        if isinstance(v, PickledObject):
            return (type(v).__name__, walk({k: x for k, x in v.__dict__.items() if k != "args"}))
        if isinstance(v, dict):
            return tuple((str(k), walk(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return tuple(walk(x) for x in v)
        if isinstance(v, float) and math.isnan(v):
            return ("nan",)
        return v

    return walk(value)


def _describe(value: Any) -> str:
    return short(value, 60)


def check_agree(files: Sequence[RankFile], values: Sequence[Any], what: str, reader: RecordReader) -> None:
    """Every rank file must hold the same `what`; a file from another save or another run differs here."""
    first = fingerprint(values[0], reader)
    for f, value in zip(files[1:], values[1:], strict=True):
        if fingerprint(value, reader) != first:
            where, ours, theirs = _first_difference(value, values[0], reader)
            raise CorruptCheckpointError(
                f"{f.path} disagrees with {files[0].path.name} on {what}{where} ({_describe(_plain(ours, reader))} vs "
                f"{_describe(_plain(theirs, reader))}): a rank file from another save or run (stale copy?); "
                "re-copy the whole tag folder from one save"
            )


def _first_difference(a: Any, b: Any, reader: RecordReader, path: str = "") -> tuple[str, Any, Any]:
    """Where two pickled values first differ, as `.key[i]`, and the differing parts."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "(absent)"), b.get(key, "(absent)")
            if fingerprint(a[key], reader) != fingerprint(b[key], reader):
                return _first_difference(a[key], b[key], reader, f"{path}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if fingerprint(x, reader) != fingerprint(y, reader):
                return _first_difference(x, y, reader, f"{path}[{i}]")
    return path, a, b


def _plain(value: Any, reader: RecordReader) -> Any:
    """A readable form of a small value for messages (0-dim tensors as numbers)."""
    if isinstance(value, LazyTensor) and value.numel() == 1:
        try:
            return value.load(reader).item()
        except Exception:  # noqa: BLE001 - only for the message
            return value
    if isinstance(value, dict):
        return {k: _plain(v, reader) for k, v in value.items()}
    return value


# --- Loading -----------------------------------------------------------------------------------------------


# What differs between the rank files of one save by design; everything else in them must agree.
ZERO12_PER_RANK = frozenset({"single_partition_of_fp32_groups", "group_paddings", "param_slice_mappings",
                             "base_optimizer_state"})  # fmt: skip
ZERO3_PER_RANK = frozenset({"fp32_flat_groups", "optimizer_state_dict"})


def check_unsharded_agree(files: Sequence[RankFile], osds: Sequence[dict[str, Any]], per_rank: frozenset[str],
                           reader: RecordReader) -> None:  # fmt: skip
    """Every rank's optimizer file holds the same values outside its own shard (loss scaler, stage, counts, ...)."""
    keys = [sorted(str(k) for k in o if k not in per_rank) for o in osds]
    check_agree(files, keys, "the optimizer file's entries", reader)
    for key in keys[0]:
        check_agree(files, [o.get(key) for o in osds], key, reader)
    check_agree(files, [f.obj.get("ds_config") for f in files], "ds_config", reader)
    check_agree(files, [_file_meta(f) for f in files],
                 "the file's metadata", reader)  # fmt: skip


def _file_meta(f: RankFile) -> dict[str, Any]:
    """What an optimizer rank file holds around its optimizer state (ds_config, ds_version, ...)."""
    return {k: v for k, v in f.obj.items() if k != "optimizer_state_dict"}


def load_rank_files(loc: CheckpointLocation, names: Mapping[int, str], what: str, dp: int) -> list[RankFile]:
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
    return [RankFile(loc.tag_dir / names[r], load_pickle(loc.tag_dir / names[r]), what) for r in range(dp)]


def refuse_unsupported(f: RankFile) -> None:
    model_state = f.obj
    if model_state.get("module") is None:
        raise UnsupportedCheckpointError(
            f"{f.path} has no module weights (module is None): a pipeline-parallel checkpoint"
        )
    mp = f.opt(model_state, "mp_world_size", int)
    if isinstance(mp, bool):
        raise f.fail("mp_world_size is a bool, not a rank count")
    if mp not in (1, None):  # a TP or pipeline folder would have files of other mp ranks beside these
        others = "mp rank 1" if mp == 2 else f"mp ranks 1-{mp - 1}" if isinstance(mp, int) and mp > 2 else "the others"
        raise CheckpointNotFoundError(
            f"{f.path} records {short(mp, 20)} model-parallel ranks (tensor- or pipeline-parallel run), but the tag "
            f"folder holds the files of mp_rank_00 only: {others} missing; re-copy the whole tag folder"
        )
    if model_state.get("num_experts") or model_state.get("ds_autoep_layers"):
        raise UnsupportedCheckpointError(f"{f.path} is a MoE checkpoint; MoE experts are not supported yet")
    dims = f.opt(model_state, "checkpoint_parallel_dimensions", dict)
    if dims is not None and not all(is_int(dims.get(k)) for k in ("pp_degree", "tp_degree")):
        raise f.fail(f"checkpoint_parallel_dimensions {short(dims)} does not give pp_degree and tp_degree")
    dims = dims or {}
    if dims.get("pp_degree", 1) != 1 or dims.get("tp_degree", 1) != 1:
        raise UnsupportedCheckpointError(f"{f.path}: pipeline/tensor parallel degrees {dims} are not supported")
    offload = dict_at(model_state, "ds_config", "zero_optimization", "offload_optimizer")
    if offload.get("device") == "nvme":
        raise UnsupportedCheckpointError(
            f"{f.path}: the optimizer state was offloaded to NVMe; its fp32 weights are not in the checkpoint files"
        )


def dict_at(obj: Any, *keys: str) -> dict[str, Any]:
    """obj[k1][k2]...: a nested dict of a pickled config, or {} wherever a level is missing or not a dict."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj if isinstance(obj, dict) else {}


MODEL_KEYS = ("module", "buffer_names", "param_shapes", "dp_world_size", "mp_world_size", "ds_version")
OPTIM_KEYS = {
    "zero": ("loss_scaler", "dynamic_loss_scale", "overflow", "base_optimizer_state", "single_partition_of_fp32_groups",
             "zero_stage", "group_paddings", "partition_count", "ds_version"),
    "bf16_optimizer": ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count",
                       "ds_version", "clip_grad"),
    "zero3": ("zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count", "optimizer_state_dict",
              "fp32_flat_groups"),
}  # fmt: skip


def require_keys(f: RankFile, obj: dict[str, Any], keys: Iterable[str], what: str) -> None:
    """DeepSpeed reads these at load time; a file without them is damaged (and a converted one would be too)."""
    missing = [k for k in keys if k not in obj]
    if missing:
        raise f.fail(f"lacks {', '.join(repr(k) for k in missing)}, which every {what} holds")


def dp_size_of(f: RankFile) -> int:
    dp = f.get(f.obj, "dp_world_size", int)
    if isinstance(dp, bool) or not 1 <= dp <= 1 << 20:
        raise f.fail(f"dp_world_size {short(dp)} is not a positive rank count")
    return int(dp)


def zero_stage_of(f: RankFile, osd: dict[str, Any]) -> int:
    stage = osd.get("zero_stage", 1)  # BF16_Optimizer files carry none (ZeRO-1)
    if isinstance(stage, bool) or not isinstance(stage, int) or int(stage) not in (1, 2, 3):
        raise f.fail(f"zero_stage {short(stage, 30)} is not 1, 2 or 3")
    return int(stage)


def read_data_parallel(loc: CheckpointLocation) -> ZeroCheckpoint:
    """Read a located data-parallel ZeRO-1/2/3 tag folder (`sources.read_checkpoint` picks the reader)."""
    first = min(loc.files.model_files)
    model0 = RankFile(
        loc.tag_dir / loc.files.model_files[first],
        load_pickle(loc.tag_dir / loc.files.model_files[first]),
        "model-states",
    )
    refuse_unsupported(model0)
    require_keys(model0, model0.obj, MODEL_KEYS, "DeepSpeed model-states file")
    dp = dp_size_of(model0)
    optims = load_rank_files(loc, loc.files.optim_files, "*_optim_states.pt", dp)
    osds = [f.get(f.obj, "optimizer_state_dict", dict) for f in optims]
    stages = [zero_stage_of(f, o) for f, o in zip(optims, osds, strict=True)]
    for f, osd, stage in zip(optims, osds, stages, strict=True):
        kind = "zero3" if stage == 3 else "zero" if "zero_stage" in osd else "bf16_optimizer"
        require_keys(f, osd, OPTIM_KEYS[kind], "ZeRO optimizer file of its kind")
    if len(set(stages)) != 1:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: rank files disagree on the ZeRO stage ({sorted(set(stages))}); mixed runs?"
        )
    stage = stages[0]
    if loc.files.zero3_layout != (stage == 3):
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: model-state file names do not match ZeRO stage {stage}; files from different runs mixed?"
        )
    with RecordReader() as reader:
        for key in ("ds_config", "ds_version"):  # saved together: a model-states file from another run differs
            check_agree([model0, optims[0]], [model0.obj.get(key), optims[0].obj.get(key)], key, reader)
        if stage == 3:
            models = load_rank_files(loc, loc.files.model_files, "*_model_states.pt", dp)
            ckpt = _Zero3Reader(loc, models, optims, dp, reader).read()
        else:
            ckpt = Zero12Reader(loc, model0, optims, dp, stage, reader).read()
        reader.finish()  # the few tiny records read for comparisons (0-dim steps) pass their CRC
    return ckpt


# --- What both layouts share: the module, buffers, ties, frozen params ------------------------------------


@dataclass
class ModuleEntries:
    keys: list[str]
    tensors: dict[str, Any]  # stripped name -> stored value
    buffers: dict[str, TensorSource]
    shared: dict[str, str]


def read_module(f: RankFile) -> ModuleEntries:
    module = f.get(f.obj, "module", dict)
    keys = []
    for raw in module:
        if not isinstance(raw, str):
            raise f.fail("module holds a key that is not a string")
        keys.append(strip_prefixes(raw))
    if len(set(keys)) != len(keys):
        raise f.fail("parameter names collide after stripping module./_orig_mod. prefixes")
    tensors = {strip_prefixes(k): v for k, v in module.items()}
    for name, value in tensors.items():
        if not isinstance(value, LazyTensor):
            raise f.fail(f"module entry {name} is a {type(value).__name__}, not a tensor")
    buffers = {}
    names = f.get(f.obj, "buffer_names", (list, tuple))
    for raw in names:
        if not isinstance(raw, str):
            raise f.fail("buffer_names holds a name that is not a string")
        name = strip_prefixes(raw)
        if name not in tensors:
            raise f.fail(f"buffer_names lists {name}, which the module does not hold")
        t = f.tensor(tensors[name], f"buffer {name}", floating=False)
        buffers[name] = TensorSource(name, t.shape, t.dtype, (Segment(t, 0, t.numel()),), "buffer")
    shared_raw = f.opt(f.obj, "shared_params", dict) or {}
    shared = {}
    for alias, owner in shared_raw.items():
        if not isinstance(alias, str) or not isinstance(owner, str):
            raise f.fail("shared_params holds a name that is not a string")
        shared[strip_prefixes(alias)] = strip_prefixes(owner)
    return ModuleEntries(keys, tensors, buffers, shared)


def module_tensor(f: RankFile, name: str, value: Any, kind: str) -> TensorSource:
    """A module entry as one whole stored tensor (16-bit trainable copy or frozen param)."""
    t = f.tensor(value, f"module tensor {name}", floating=kind == "trainable")
    return TensorSource(name, t.shape, t.dtype, (Segment(t, 0, t.numel()),), kind)


def _drop_excluded_ties(
    loc: CheckpointLocation, mod: ModuleEntries, params: Mapping[str, Param], frozen: Mapping[str, TensorSource]
) -> None:
    """exclude_frozen_parameters drops a frozen tie owner (a PEFT run's wte.weight) but keeps its alias
    (lm_head.weight is not in named_parameters, so DeepSpeed does not drop it) and the tie: the alias is one of
    the absent base weights too, so it goes with its owner."""
    if not saved_without_frozen(loc, params, frozen):
        return
    for alias, owner in list(mod.shared.items()):
        if owner not in params and owner not in frozen:
            del mod.shared[alias]
            mod.tensors.pop(alias, None)
            mod.keys.remove(alias)


def check_ties(
    f: RankFile, mod: ModuleEntries, params: Mapping[str, Param], frozen: Mapping[str, TensorSource]
) -> None:
    """Each tie names a real owner and an alias that is not itself stored as a parameter."""
    for alias, owner in mod.shared.items():
        if alias in params or alias in frozen:
            raise f.fail(f"shared_params ties {alias} to {owner}, but {alias} is also stored as a parameter of its own")
        owner_shape = params[owner].shape if owner in params else frozen[owner].shape if owner in frozen else None
        if owner_shape is None:
            raise f.fail(f"shared_params ties {alias} to {owner}, which is no parameter of the checkpoint")
        if alias not in mod.tensors:
            raise f.fail(f"shared_params names {alias}, which the module does not hold")
        stored = mod.tensors[alias]
        if isinstance(stored, LazyTensor) and stored.numel() and stored.shape != owner_shape:
            raise f.fail(f"tied weight {alias} has shape {list(stored.shape)}, its owner {owner} {list(owner_shape)}")


def check_module_keys(
    f: RankFile, mod: ModuleEntries, params: Mapping[str, Param], frozen: Mapping[str, TensorSource]
) -> None:
    """Every module entry is a trained, frozen or tied parameter or a buffer; every parameter is in the module."""
    for name in mod.keys:
        if name not in params and name not in frozen and name not in mod.buffers and name not in mod.shared:
            raise f.fail(
                f"module entry {name} is neither a trained parameter (param_shapes), a frozen one, a tied weight "
                "(shared_params) nor a buffer"
            )
    for name in params:
        if name not in mod.tensors:
            raise f.fail(f"parameter {name} of param_shapes is missing from the module")
    for name in mod.buffers:
        if name in params or name in frozen or name in mod.shared:
            raise f.fail(f"{name} is listed both as a buffer (buffer_names) and as a parameter")


def check_ties_and_keys(
    f: RankFile, mod: ModuleEntries, params: Mapping[str, Param], frozen: Mapping[str, TensorSource]
) -> None:
    check_ties(f, mod, params, frozen)
    check_module_keys(f, mod, params, frozen)


def train_dtype_of(module: Mapping[str, Any], names: Iterable[str]) -> DType:
    for name in names:
        t = module.get(name)
        if isinstance(t, LazyTensor) and t.dtype.is_floating_point:
            return t.dtype
    return dtypes.FLOAT32


def saved_without_frozen(loc: CheckpointLocation, params: Mapping[str, Any], bit16: Mapping[str, Any]) -> bool:
    """True when a PEFT/LoRA run saved without its frozen base weights (exclude_frozen_parameters=True)."""
    peft = (loc.root / "adapter_config.json").is_file() or any("lora_" in k for k in params)
    return peft and not any(name not in params for name in bit16)


def check_unique_names(f: RankFile, groups: list[list[tuple[str, tuple[int, ...]]]]) -> None:
    seen: set[str] = set()
    for group in groups:
        for name, _ in group:
            stripped = strip_prefixes(name)
            if stripped in seen:
                raise f.fail(f"param_shapes lists {stripped} twice")
            seen.add(stripped)


def _identity_by_storage(t: Any) -> tuple[Any, ...] | None:
    if not isinstance(t, LazyTensor):
        return None
    return (t.record.path, t.record.name, t.storage_offset, t.shape)


def _undeclared_aliases(mod: ModuleEntries, params: Mapping[str, Param]) -> dict[str, str]:
    """Module entries sharing storage with another one (a trained parameter, or a frozen one before them) but not
    listed in shared_params (ZeRO-0/1/2), each with the entry it shares with."""
    owners: dict[tuple[Any, ...], str] = {}
    for n in params:
        ident = _identity_by_storage(mod.tensors.get(n))
        if ident is not None:
            owners.setdefault(ident, n)
    aliases = {}
    for name in mod.keys:
        if name in params or name in mod.shared or name in mod.buffers:
            continue
        ident = _identity_by_storage(mod.tensors.get(name))
        if ident is None:
            continue
        owner = owners.setdefault(ident, name)
        if owner != name:
            aliases[name] = owner
    return aliases


# --- ZeRO-1/2 ----------------------------------------------------------------------------------------------


class Zero12Reader:
    def __init__(
        self,
        loc: CheckpointLocation,
        model0: RankFile,
        optims: list[RankFile],
        dp: int,
        stage: int,
        reader: RecordReader,
    ) -> None:
        self.loc, self.model0, self.optims, self.dp, self.stage, self.reader = loc, model0, optims, dp, stage, reader
        self.osds = [f.obj["optimizer_state_dict"] for f in optims]
        self.bf16_optimizer = "zero_stage" not in self.osds[0]

    def read(self) -> ZeroCheckpoint:
        f0 = self.model0
        mod = read_module(f0)
        groups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, groups)
        self._check_ranks_agree(len(groups))
        elastic = isinstance(self.osds[0].get("base_optimizer_state"), list)
        states = [self._rank_states(f, o, len(groups), elastic) for f, o in zip(self.optims, self.osds, strict=True)]
        params: list[Param] = []
        for g, shapes in enumerate(groups):
            params += self._group_params(g, shapes, states)
        same_keys_everywhere(self.optims[0], [flat_state_keys(s) for s in states[0]], "param group")
        by_name = {p.name: p for p in params}
        bit16 = zero12_bit16(f0, mod, by_name)
        frozen = {n: s for n, s in bit16.items() if n not in by_name}
        _drop_excluded_ties(self.loc, mod, by_name, frozen)
        check_ties(f0, mod, by_name, frozen)
        check_module_keys(f0, mod, by_name, frozen)
        for name, src in bit16.items():
            if name in by_name and src.shape != by_name[name].shape:
                raise f0.fail(
                    f"{name} has shape {list(src.shape)} in the module but {list(by_name[name].shape)} in param_shapes"
                )
        return ZeroCheckpoint(
            location=self.loc,
            zero_stage=self.stage,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="bf16_optimizer" if self.bf16_optimizer else "zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=mod.keys,
            params=params,
            optimizer=self._optimizer_state(states, elastic),
            bit16=bit16,
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=saved_without_frozen(self.loc, by_name, bit16),
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[f0.obj],
            layout=ParallelLayout("dp", dp=self.dp),
        )

    def _check_ranks_agree(self, num_groups: int) -> None:
        for f, osd in zip(self.optims, self.osds, strict=True):
            counts = osd.get("partition_count")
            counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
            if any(c != self.dp for c in counts) or len(counts) != num_groups:
                raise CorruptCheckpointError(
                    f"{f.path} was written for DP size {short(counts, 40)} over {len(counts)} param groups, but the "
                    f"model states say dp_world_size={self.dp} and {num_groups} param groups: files from different "
                    "runs are mixed"
                )
            for key in ("single_partition_of_fp32_groups", "group_paddings"):
                value = f.get(osd, key, list)
                if len(value) != num_groups:
                    raise f.fail(f"'{key}' has {len(value)} entries for {num_groups} param groups")
        check_unsharded_agree(self.optims, self.osds, ZERO12_PER_RANK, self.reader)

    def _rank_states(self, f: RankFile, osd: dict[str, Any], num_groups: int, elastic: bool) -> list[dict[str, Any]]:
        """Per param group, this rank's optimizer state entries (empty before the first optimizer step)."""
        base = f.get(osd, "base_optimizer_state", (dict, list))
        if elastic:
            if not isinstance(base, list) or len(base) != num_groups:
                raise f.fail(f"elastic base_optimizer_state should hold {num_groups} dicts")
            return [state_entries(f, s, f"param group {g}") for g, s in enumerate(base)]
        if not isinstance(base, dict):
            raise f.fail("base_optimizer_state mixes elastic and rigid layouts across ranks")
        state = f.get(base, "state", dict, "base_optimizer_state.")
        _check_param_groups(f, f.get(base, "param_groups", list, "base_optimizer_state."), num_groups)
        if any(not isinstance(k, int) or not 0 <= k < num_groups for k in state):
            raise f.fail(
                f"base_optimizer_state.state is keyed {sorted(map(repr, state))[:4]}, not by param group "
                f"0-{num_groups - 1}"
            )
        return [state_entries(f, state.get(g, {}), f"param group {g}") for g in range(num_groups)]

    def _group_params(
        self, g: int, shapes: list[tuple[str, tuple[int, ...]]], states: list[list[dict[str, Any]]]
    ) -> list[Param]:
        numels = [_numel(s) for _, s in shapes]
        align = self._alignment(g, len(shapes))
        offsets = partition.zero12_param_offsets(numels, align)
        total = (offsets[-1] + numels[-1] + align[-1]) if shapes else 0
        size = partition.zero12_partition_size(total, self.dp)
        real = [max(0, min(size, total - r * size)) for r in range(self.dp)]
        masters = []
        for r, (f, osd) in enumerate(zip(self.optims, self.osds, strict=True)):
            t = f.master(osd["single_partition_of_fp32_groups"][g], f"the fp32 partition of param group {g}")
            want = size if self.bf16_optimizer else real[r]
            if t.numel() != want:
                raise CorruptCheckpointError(
                    f"{f.path}: param group {g}'s fp32 partition holds {t.numel()} elements; {len(shapes)} params of "
                    f"{total} elements at DP {self.dp} give rank {r} {want}. The file does not match param_shapes "
                    "(mixed runs or damaged files); re-copy the tag folder"
                )
            pad = osd["group_paddings"][g]
            want_pad = (size * self.dp - total if r == self.dp - 1 else 0) if self.bf16_optimizer else size - real[r]
            if pad != want_pad:
                raise f.fail(f"group_paddings[{g}] is {short(pad, 20)}, the partition arithmetic gives {want_pad}")
            masters.append(t)
        keys = self._state_keys(g, states)
        moments = {k: [self._moment(r, g, k, states[r][g][k], size, real[r]) for r in range(self.dp)] for k in keys}
        params: list[Param] = []
        for (name, shape), numel, off in zip(shapes, numels, offsets, strict=True):
            pieces = partition.split_range(off, numel, real)
            fp32 = TensorSource(strip_prefixes(name), shape, dtypes.FLOAT32, _segments(masters, pieces), "trainable")
            st = {
                k: TensorSource(fp32.name, shape, ts[0].dtype, _segments(ts, pieces), "state")
                for k, ts in moments.items()
            }
            params.append(Param(fp32.name, name, shape, g, align[len(params)], fp32, st))
        return params

    def _alignment(self, g: int, n: int) -> list[int]:
        pads = self.osds[0].get("param_alignment_paddings")
        if pads is None:
            return [0] * n
        f = self.optims[0]
        if not isinstance(pads, list) or g >= len(pads) or not isinstance(pads[g], list) or len(pads[g]) != n:
            raise f.fail(f"param_alignment_paddings does not list {n} paddings for param group {g}")
        if not all(isinstance(p, int) and p >= 0 for p in pads[g]):
            raise f.fail(f"param_alignment_paddings[{g}] holds a value that is not a non-negative int")
        return list(pads[g])

    def _state_keys(self, g: int, states: list[list[dict[str, Any]]]) -> list[str]:
        keys = [flat_state_keys(s[g]) for s in states]
        check_agree(self.optims, [sorted(k) for k in keys], f"the optimizer state keys of param group {g}", self.reader)
        check_agree(
            self.optims, [scalar_entries(s[g]) for s in states], f"the optimizer step of param group {g}", self.reader
        )
        return keys[0]

    def _moment(self, r: int, g: int, key: str, value: Any, size: int, real: int) -> LazyTensor:
        f = self.optims[r]
        t = f.tensor(value, f"optimizer state {short(key)} of param group {g}")
        want = real if isinstance(self.osds[r].get("base_optimizer_state"), list) else size
        if t.dim() != 1 or t.numel() != want:
            raise f.fail(
                f"optimizer state {short(key)} of param group {g} holds {t.numel()} elements, the partition {want}"
            )
        return t

    def _optimizer_state(self, states: list[list[dict[str, Any]]], elastic: bool) -> OptimizerState:
        osd = self.osds[0]
        sharded = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings")
        common = {k: v for k, v in osd.items() if k not in sharded}
        base = osd["base_optimizer_state"]
        if not elastic:
            check_agree(
                self.optims,
                [o["base_optimizer_state"]["param_groups"] for o in self.osds],
                "the optimizer hyper-parameters",
                self.reader,
            )
        common["param_groups"] = None if elastic else base["param_groups"]
        meta = _file_meta(self.optims[0])
        return OptimizerState([scalar_entries(s) for s in states[0]], common, meta, elastic)


def zero12_bit16(f0: RankFile, mod: ModuleEntries, params: Mapping[str, Param]) -> dict[str, TensorSource]:
    """The ZeRO-0/1/2 module's 16-bit copies of trained params, and the frozen params.

    ZeRO-2 also lists its frozen params in frozen_param_shapes with full copies in frozen_param_fragments;
    the three must agree. ZeRO-1 (and runs saved with exclude_frozen_parameters) record neither.
    """
    aliases = _undeclared_aliases(mod, params)
    if aliases:
        alias = min(aliases)
        raise f0.fail(
            f"module entry {alias} shares its storage with {aliases[alias]} but shared_params does not list it "
            "(a tied weight whose tie record was lost)"
        )
    frozen = _zero2_frozen_shapes(f0, mod, params)
    bit16 = {}
    for name, value in mod.tensors.items():
        if name in mod.buffers or name in mod.shared:
            continue
        if name in params:
            bit16[name] = module_tensor(f0, name, value, "trainable")
        elif frozen is None or name in frozen:
            bit16[name] = module_tensor(f0, name, value, "frozen")
    return bit16


def _zero2_frozen_shapes(
    f0: RankFile, mod: ModuleEntries, params: Mapping[str, Param]
) -> dict[str, tuple[int, ...]] | None:
    shapes_raw = f0.opt(f0.obj, "frozen_param_shapes", dict)
    fragments_raw = f0.opt(f0.obj, "frozen_param_fragments", dict)
    if shapes_raw is None:
        if fragments_raw:
            raise f0.fail("frozen_param_fragments is set but frozen_param_shapes is not")
        return None
    shapes = {
        strip_prefixes(str(k)): shape_of(f0, v, f"frozen_param_shapes[{short(k)}]") for k, v in shapes_raw.items()
    }
    fragments = {strip_prefixes(str(k)): v for k, v in (fragments_raw or {}).items()}
    for name in sorted(set(shapes) ^ set(fragments)):
        where = "frozen_param_shapes" if name in shapes else "frozen_param_fragments"
        raise f0.fail(f"frozen param {name} is in {where} only; the two must list the same params")
    for name, shape in shapes.items():
        frag = f0.tensor(fragments[name], f"the fragment of frozen param {name}", floating=False)
        module = mod.tensors.get(name)
        if name in params:
            raise f0.fail(f"{name} is listed both as a trained and as a frozen parameter")
        if not isinstance(module, LazyTensor):
            raise f0.fail(f"frozen param {name} (frozen_param_shapes) is missing from the module")
        if frag.shape != shape or module.shape != shape:
            raise f0.fail(f"frozen param {name} is {list(shape)} in frozen_param_shapes, its fragment "
                          f"{list(frag.shape)}, the module's {list(module.shape)}")  # fmt: skip
    return shapes


def _segments(tensors: Sequence[LazyTensor], pieces: Iterable[partition.Piece]) -> tuple[Segment, ...]:
    return tuple(Segment(tensors[p.rank], p.start, p.count) for p in pieces)


# --- ZeRO-3 ------------------------------------------------------------------------------------------------


class _Zero3Reader:
    def __init__(
        self, loc: CheckpointLocation, models: list[RankFile], optims: list[RankFile], dp: int, reader: RecordReader
    ) -> None:
        self.loc, self.models, self.optims, self.dp, self.reader = loc, models, optims, dp, reader
        self.osds = [f.obj["optimizer_state_dict"] for f in optims]

    def read(self) -> ZeroCheckpoint:
        f0 = self.models[0]
        mod = read_module(f0)
        self._check_ranks_agree()
        subgroups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, subgroups)
        group_of, scalars, common = zero3_optimizer_parts(self.optims[0], self.osds[0], len(subgroups))
        params: list[Param] = []
        for sg, shapes in enumerate(subgroups):
            params += self._subgroup_params(sg, shapes, group_of[sg])
        inner = self.osds[0]["optimizer_state_dict"]["state"]
        keys = [flat_state_keys(inner.get(sg, {})) for sg in range(len(subgroups))]
        same_keys_everywhere(self.optims[0], keys, "sub-group")
        params.sort(key=lambda p: p.group)  # flat order within each param group, as DeepSpeed builds sub-groups
        by_name = {p.name: p for p in params}
        frozen = zero3_frozen(self.models, self.dp)
        overlap = sorted(set(frozen) & set(by_name))
        if overlap:
            raise f0.fail(f"{overlap[0]} is listed both as a trained and as a frozen parameter")
        _drop_excluded_ties(self.loc, mod, by_name, frozen)
        check_ties(f0, mod, by_name, frozen)
        check_module_keys(f0, mod, by_name, frozen)
        return ZeroCheckpoint(
            location=self.loc,
            zero_stage=3,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=mod.keys,
            params=params,
            optimizer=OptimizerState(scalars, common, _file_meta(self.optims[0])),
            bit16=frozen,
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=saved_without_frozen(self.loc, by_name, frozen),
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[m.obj for m in self.models],
            layout=ParallelLayout("dp", dp=self.dp),
        )

    def _check_ranks_agree(self) -> None:
        for m, f, osd in zip(self.models, self.optims, self.osds, strict=True):
            require_keys(m, m.obj, MODEL_KEYS, "DeepSpeed model-states file")
            m.get(m.obj, "module", dict)
            count = osd.get("partition_count")
            if m.obj.get("dp_world_size") != self.dp or count != self.dp or isinstance(count, bool):
                raise CorruptCheckpointError(
                    f"{f.path} was written at DP size {short(m.obj.get('dp_world_size'), 20)}/{short(count, 20)}, "
                    f"rank 0 at {self.dp}; files from different runs are mixed"
                )
            f.get(osd, "fp32_flat_groups", list)
            inner = f.get(osd, "optimizer_state_dict", dict)
            f.get(inner, "state", dict, "optimizer_state_dict.")
            _check_param_groups(f, f.get(inner, "param_groups", list, "optimizer_state_dict."), None)
        model_keys = ("param_shapes", "frozen_param_shapes", "buffer_names", "global_steps", "global_samples",
                      "skipped_steps", "ds_config", "ds_version", "lr_scheduler", "mp_world_size", "dp_world_size",
                      "checkpoint_parallel_dimensions", "data_sampler", "random_ltd",
                      "sparse_tensor_module_names")  # fmt: skip
        for key in model_keys:
            check_agree(self.models, [m.obj.get(key) for m in self.models], key, self.reader)
        layouts = [{k: (v.dtype.name, v.shape) for k, v in read_module(m).tensors.items()} for m in self.models]
        check_agree(self.models, layouts, "the module's entries", self.reader)
        for m in self.models[1:]:
            if m.obj.get("shared_params") and m.obj.get("shared_params") != self.models[0].obj.get("shared_params"):
                raise m.fail("shared_params differs from rank 0's")
        check_unsharded_agree(self.optims, self.osds, ZERO3_PER_RANK, self.reader)
        inner = [o["optimizer_state_dict"] for o in self.osds]
        check_agree(self.optims, [i["param_groups"] for i in inner], "the optimizer hyper-parameters", self.reader)
        steps = [{k: scalar_entries(v) if isinstance(v, dict) else v for k, v in i["state"].items()} for i in inner]
        check_agree(self.optims, steps, "the optimizer step", self.reader)

    def _subgroup_params(self, sg: int, shapes: list[tuple[str, tuple[int, ...]]], group: int) -> list[Param]:
        numels = [_numel(s) for _, s in shapes]
        offsets = partition.zero3_subgroup_offsets(numels, self.dp)
        flat_len = sum(partition.zero3_partition_numel(n, self.dp) for n in numels)
        flats = []
        for f, osd in zip(self.optims, self.osds, strict=True):
            groups = osd["fp32_flat_groups"]
            if sg >= len(groups):
                raise f.fail(f"has no fp32 partition for sub-group {sg}")
            t = f.master(groups[sg], f"the fp32 partition of sub-group {sg}")
            if t.numel() != flat_len:
                raise CorruptCheckpointError(
                    f"{f.path}: sub-group {sg} should hold {flat_len} fp32 elements, found {t.numel()}; "
                    "the file does not match param_shapes (mixed runs or damaged files); re-copy the tag folder"
                )
            flats.append(t)
        keys = self._state_keys(sg)
        moments = {k: [self._moment(r, sg, k, flat_len) for r in range(self.dp)] for k in keys}
        params = []
        for (name, shape), numel, off in zip(shapes, numels, offsets, strict=True):
            pieces = partition.zero3_pieces(numel, self.dp, off)
            fp32 = TensorSource(strip_prefixes(name), shape, dtypes.FLOAT32, _segments(flats, pieces), "trainable")
            st = {
                k: TensorSource(fp32.name, shape, ts[0].dtype, _segments(ts, pieces), "state")
                for k, ts in moments.items()
            }
            params.append(Param(fp32.name, name, shape, group, 0, fp32, st))
        return params

    def _state_keys(self, sg: int) -> list[str]:
        keys = []
        for f, osd in zip(self.optims, self.osds, strict=True):
            state = state_entries(f, osd["optimizer_state_dict"]["state"].get(sg, {}), f"sub-group {sg}")
            keys.append(flat_state_keys(state))
        check_agree(self.optims, [sorted(k) for k in keys], f"the optimizer state keys of sub-group {sg}", self.reader)
        return keys[0]

    def _moment(self, r: int, sg: int, key: str, flat_len: int) -> LazyTensor:
        f = self.optims[r]
        state = self.osds[r]["optimizer_state_dict"]["state"].get(sg)
        t = f.tensor(
            state.get(key) if isinstance(state, dict) else None, f"optimizer state {short(key)} of sub-group {sg}"
        )
        if t.dim() != 1 or t.numel() != flat_len:
            raise f.fail(
                f"optimizer state {short(key)} of sub-group {sg} holds {t.numel()} elements, the partition {flat_len}"
            )
        return t


def zero3_optimizer_parts(
    f: RankFile, osd: dict[str, Any], num_subgroups: int
) -> tuple[dict[int, int], list[dict[str, Any]], dict[str, Any]]:
    """A ZeRO-3 optimizer dict (a rank file's, or a universal optimizer_state.pt): the param group of every
    sub-group (which must cover param_shapes' sub-groups once, in order), each group's scalar state (step, ...),
    and the entries that are not a rank's shard, with the hyper-parameters as `param_groups`."""
    inner = f.get(osd, "optimizer_state_dict", dict)
    param_groups = f.get(inner, "param_groups", list, "optimizer_state_dict.")
    states = f.opt(inner, "state", dict, "optimizer_state_dict.") or {}
    group_of: dict[int, int] = {}
    for g, pg in enumerate(param_groups):
        for sg in f.get(pg, "params", list, f"param_groups[{g}]."):
            if not is_int(sg) or sg in group_of or not 0 <= sg < num_subgroups:
                raise f.fail(
                    f"param_groups[{g}] lists sub-group {short(sg, 20)}, not one of the {num_subgroups} sub-groups "
                    "of param_shapes"
                )
            group_of[sg] = g
    if len(group_of) != num_subgroups:
        raise f.fail(f"the optimizer's param groups cover {len(group_of)} sub-groups, param_shapes has {num_subgroups}")
    if list(group_of.values()) != sorted(group_of.values()) or sorted(group_of) != list(group_of):
        raise f.fail("the optimizer's param groups do not list the sub-groups in order")
    extra = [k for k in states if not is_int(k) or not 0 <= k < num_subgroups]
    if extra:
        raise f.fail(f"optimizer state is keyed {short(extra[0], 20)}, no sub-group of param_shapes")
    scalars = [
        scalar_entries(state_entries(f, states.get(pg["params"][0], {}), f"sub-group {pg['params'][0]}"))
        if pg["params"] else {}
        for pg in param_groups
    ]  # fmt: skip
    common = {k: v for k, v in osd.items() if k not in ZERO3_PER_RANK}
    common["param_groups"] = param_groups
    return group_of, scalars, common


def zero3_frozen(models: Sequence[RankFile], dp: int) -> dict[str, TensorSource]:
    """ZeRO-3 frozen params: each rank's ceil(n/dp) fragment, in rank order."""
    f0 = models[0]
    shapes = f0.opt(f0.obj, "frozen_param_shapes", dict) or {}
    for m in models:
        extra = set(m.opt(m.obj, "frozen_param_fragments", dict) or {}) - set(shapes)
        if extra:
            raise m.fail(f"frozen_param_fragments holds {short(min(map(str, extra)))}, which frozen_param_shapes lacks")
    out = {}
    for raw, shape_value in shapes.items():
        name = strip_prefixes(str(raw))
        shape = shape_of(f0, shape_value, f"frozen_param_shapes[{short(name)}]")
        numel = _numel(shape)
        p = partition.zero3_partition_numel(numel, dp)
        segs = []
        dtype_seen = None
        for r, m in enumerate(models):
            frags = m.opt(m.obj, "frozen_param_fragments", dict) or {}
            frag = frags.get(raw)
            if not isinstance(frag, LazyTensor) or frag.numel() != p:
                raise m.fail(f"lacks the {p}-element fragment of frozen param {name}")
            m.tensor(frag, f"the fragment of frozen param {name}")
            if dtype_seen is not None and frag.dtype != dtype_seen:
                raise m.fail(f"the fragment of frozen param {name} is {frag.dtype.name}, rank 0's {dtype_seen.name}")
            dtype_seen = frag.dtype
            count = max(0, min(p, numel - r * p))
            if count:
                segs.append(Segment(frag, 0, count))
        out[name] = TensorSource(name, shape, dtype_seen or dtypes.FLOAT32, tuple(segs), "frozen")
    return out

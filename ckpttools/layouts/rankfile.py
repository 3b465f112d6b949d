"""DeepSpeed's per-rank files as every DeepSpeed layout reads them: typed accessors that check each assumption
about a pickled value, agreement between ranks, loading with the allowlist, and the module part (weights,
buffers, ties, frozen parameters) that all layouts share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.torchfile import LazyTensor, PickledObject, RecordReader, load_pickle
from ckpttools.model.checkpoint import Param, Segment, TensorSource, strip_prefixes
from ckpttools.model.origin import CheckpointLocation

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


def check_param_groups(f: RankFile, groups: list[Any], expected: int | None) -> None:
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
    check_agree(files, [file_meta(f) for f in files],
                 "the file's metadata", reader)  # fmt: skip


def file_meta(f: RankFile) -> dict[str, Any]:
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
    # NVMe optimizer offload is read by the ZeRO layout (layouts/zero/nvme.py): ZeRO-3's swapped sub-groups from
    # the swap files, everything else from these files as with any other run


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


def drop_excluded_ties(
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


def undeclared_aliases(mod: ModuleEntries, params: Mapping[str, Param]) -> dict[str, str]:
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

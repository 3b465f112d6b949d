"""Checkpoints of DeepSpeed engines without ZeRO (stage 0): the optimizer lives in `mp_rank_00_model_states.pt`.

There are no `*_optim_states.pt` files; `optimizer` in the model states holds the optimizer wrapper's state_dict,
one of three kinds (what DeepSpeed 0.19.8 picks in `engine._configure_optimizer`):

* "fp16_optimizer" (FP16_Optimizer: bf16/fp16 with a fused optimizer, e.g. the config's AdamW -> FusedAdam):
  `fp32_groups_flat` (one flat fp32 master per param group, the group's params concatenated without padding),
  `optimizer_state_dict` (the torch state_dict over those flat tensors: param group g holds param g), `clip_grad`,
  and for fp16 the loss scaler's `dynamic_loss_scale`, `cur_scale`, `cur_iter`, ...;
* "fp16_unfused_optimizer" (FP16_UnfusedOptimizer: bf16/fp16 with any other torch optimizer): `fp32_groups` (per
  param group, one fp32 master per param), `optimizer_state_dict`, the loss scaler's keys (always present);
* "torch" (fp32 training): the torch optimizer's own state_dict; the module's fp32 weights are the masters.

Stage 0 records no `param_shapes`: which module param is which optimizer entry is found here. Each param group
must be the module's trainable params in module order (a subsequence), the optimizer's shapes (and, for the 16-bit
wrappers, the engine's 16-bit module copies: the cast masters) must fit, and exactly one assignment may fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import UnsupportedCheckpointError, UsageError, short
from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, RecordReader, load_pickle
from ckpttools.layouts.base import ReshardTarget, no_universal_form
from ckpttools.layouts.crosscheck import OpenFiles, casts_equal, read_elements
from ckpttools.layouts.locate import OPTIM_RE, ZERO3_MODEL_RE, model_parallel_ranks
from ckpttools.layouts.rankfile import (
    ModuleEntries,
    RankFile,
    check_ties_and_keys,
    dict_at,
    fingerprint,
    is_int,
    module_tensor,
    read_module,
    refuse_unsupported,
    require_keys,
    saved_without_frozen,
    scalar_entries,
    state_entries,
    train_dtype_of,
)
from ckpttools.model.checkpoint import Checkpoint, OptimizerState, Param, Segment, TensorSource
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO0_MODEL_KEYS = ("module", "buffer_names", "optimizer", "dp_world_size", "mp_world_size", "ds_version")
LOSS_SCALER_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter")
COMPARE_FULL_ELEMS = 1 << 16  # smaller params are compared whole when matching masters to the module
COMPARE_END_ELEMS = 4096  # larger ones at both ends
MAX_SEARCH_STATES = 200_000


def read_zero0(loc: CheckpointLocation) -> Checkpoint:
    """Open a stage-0 tag folder (`mp_rank_00_model_states.pt` holding `optimizer`) into a `Checkpoint`.

    Raises:
        CorruptCheckpointError: missing keys, shapes or dtypes that do not fit, steps that disagree.
        UnsupportedCheckpointError: no optimizer state at all, an unknown optimizer wrapper, or param groups that
            cannot be matched to module params one way only.
    """
    f = RankFile(loc.tag_dir / MODEL_FILE, load_pickle(loc.tag_dir / MODEL_FILE), "model-states")
    refuse_unsupported(f)
    if f.obj.get("optimizer", "absent") is None:
        raise UnsupportedCheckpointError(
            f"{f.path} holds no optimizer state ('optimizer' is None: the engine had no optimizer, or the run saved "
            "without it): there are no fp32 masters; its 'module' entry is the model as trained"
        )
    require_keys(f, f.obj, ZERO0_MODEL_KEYS, "stage-0 DeepSpeed model-states file")
    _check_stage0(f)
    dp = f.get(f.obj, "dp_world_size", int)
    if isinstance(dp, bool) or not 1 <= dp <= 1 << 20:
        raise f.fail(f"dp_world_size {short(dp)} is not a positive rank count")
    mod = read_module(f)
    mod.shared.update(_storage_aliases(mod))
    with RecordReader() as reader:
        wrapper = _Wrapper.of(f, f.get(f.obj, "optimizer", dict), reader)
        params, frozen_names = _match(f, mod, wrapper)
        ckpt = _checkpoint(loc, f, mod, wrapper, params, frozen_names, int(dp))
        reader.finish()  # the few tiny records read to compare steps pass their CRC
    return ckpt


def _check_stage0(f: RankFile) -> None:
    stage = dict_at(f.obj, "ds_config", "zero_optimization").get("stage", 0)
    if stage not in (0, False, None):
        raise f.fail(f"ds_config says ZeRO stage {short(stage, 20)}, but the file holds a stage-0 optimizer")


def _storage_aliases(mod: ModuleEntries) -> dict[str, str]:
    """Tied weights: stage 0 records no shared_params; the module's entries share their storage instead."""
    owners: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for name in mod.keys:
        t = mod.tensors[name]
        if name in mod.buffers or name in mod.shared or not isinstance(t, LazyTensor) or not t.numel():
            continue
        key = (t.record.name, t.storage_offset, t.shape, t.stride)
        if key in owners:
            aliases[name] = owners[key]
        else:
            owners[key] = name
    return aliases


# --- The optimizer entry -----------------------------------------------------------------------------------


@dataclass
class _Wrapper:
    """The optimizer entry, parsed: per param group its fp32 masters (flat or per param) and torch states."""

    kind: str  # "fp16_optimizer" | "fp16_unfused_optimizer" | "torch"
    f: RankFile
    entry: dict[str, Any]  # the wrapper's state_dict
    inner: dict[str, Any]  # the torch optimizer's state_dict
    ids: list[list[int]]  # per param group: the torch state ids of its params
    masters: list[Any]  # per group: a flat LazyTensor, a list of per-param LazyTensors, or None (torch: the module)
    reader: RecordReader  # for comparing 0-dim step tensors by value

    @classmethod
    def of(cls, f: RankFile, entry: dict[str, Any], reader: RecordReader) -> _Wrapper:
        if "fp32_groups_flat" in entry:
            kind, key = "fp16_optimizer", "fp32_groups_flat"
        elif "fp32_groups" in entry:
            kind, key = "fp16_unfused_optimizer", "fp32_groups"
        elif "state" in entry and "param_groups" in entry:
            kind, key = "torch", None
        else:
            raise UnsupportedCheckpointError(
                f"{f.path}: the optimizer entry holds {short(sorted(map(str, entry)), 120)}: no optimizer wrapper "
                "DeepSpeed writes without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer or a plain torch optimizer)"
            )
        inner = entry if key is None else f.get(entry, "optimizer_state_dict", dict, "optimizer.")
        ids = _group_ids(f, inner)
        masters: list[Any] = [None] * len(ids)
        if key is not None:
            masters = _masters(f, f.get(entry, key, list, "optimizer."), key, ids, flat=kind == "fp16_optimizer")
            require_keys(f, entry, LOSS_SCALER_KEYS if kind == "fp16_unfused_optimizer" else (), "FP16 wrapper")
        return cls(kind, f, entry, inner, ids, masters, reader)

    def state(self, pid: int) -> dict[str, Any]:
        states = self.f.get(self.inner, "state", dict, "optimizer state_dict ")
        return state_entries(self.f, states.get(pid, {}), f"optimizer param {pid}")

    def flat_states(self, pid: int) -> dict[str, LazyTensor]:
        where = f"optimizer param {pid}"
        return {
            k: self.f.tensor(v, f"optimizer state {short(k)} of {where}")
            for k, v in self.state(pid).items()
            if isinstance(v, LazyTensor) and v.dim() > 0
        }

    def slot_shape(self, g: int, i: int) -> tuple[int, ...] | None:
        """What the optimizer says about the shape of param i of group g (None: nothing, e.g. before a step)."""
        if self.kind == "fp16_unfused_optimizer":
            return tuple(self.masters[g][i].shape)
        moments = self.flat_states(self.ids[g][i])
        return tuple(next(iter(moments.values())).shape) if moments else None


def _group_ids(f: RankFile, inner: dict[str, Any]) -> list[list[int]]:
    """The torch state ids per param group: torch's state_dict numbers params 0..N-1 over the groups in order."""
    groups = f.get(inner, "param_groups", list, "optimizer.")
    ids: list[list[int]] = []
    for g, pg in enumerate(groups):
        got = f.get(pg, "params", list, f"optimizer param_groups[{g}].")
        if any(not isinstance(k, str) for k in pg):
            raise f.fail(f"optimizer param_groups[{g}] has a key that is not a string")
        if not all(is_int(i) for i in got):
            raise f.fail(f"optimizer param_groups[{g}].params holds {short(got)}, not param ids")
        ids.append(list(got))
    flat = [i for g in ids for i in g]
    if flat != list(range(len(flat))):
        raise f.fail(f"optimizer param_groups number their params {short(flat)}, not 0..{len(flat) - 1} in order")
    states = f.get(inner, "state", dict, "optimizer state_dict ")
    stray = [k for k in states if not is_int(k) or not 0 <= k < len(flat)]
    if stray:
        raise f.fail(f"optimizer state is keyed {short(stray[0], 20)}, which no param group lists")
    return ids


def _masters(f: RankFile, value: list[Any], key: str, ids: list[list[int]], *, flat: bool) -> list[Any]:
    if len(value) != len(ids):
        raise f.fail(f"'optimizer.{key}' has {len(value)} entries for {len(ids)} param groups")
    out: list[Any] = []
    for g, (v, group_ids) in enumerate(zip(value, ids, strict=True)):
        if flat:
            if len(group_ids) != 1:
                raise f.fail(f"FP16_Optimizer param group {g} lists {len(group_ids)} params, not its one flat master")
            out.append(f.master(v, f"optimizer.{key}[{g}]"))
            continue
        if not isinstance(v, list) or len(v) != len(group_ids):
            raise f.fail(f"'optimizer.{key}[{g}]' does not hold one fp32 master per param of param group {g}")
        masters = [f.tensor(t, f"optimizer.{key}[{g}][{i}]") for i, t in enumerate(v)]
        for i, t in enumerate(masters):
            if t.dtype != dtypes.FLOAT32:
                raise f.fail(f"optimizer.{key}[{g}][{i}] (an fp32 master) is stored as {t.dtype.name}")
        out.append(masters)
    return out


# --- Which module param is which optimizer entry -------------------------------------------------------------

Pos = tuple[int, ...]  # per param group: elements (flat masters) or params (per-param entries) filled so far


class _Fit:
    """Can module param `name` be the next entry of param group g, at position `pos` of that group?"""

    def __init__(self, f: RankFile, mod: ModuleEntries, wrapper: _Wrapper) -> None:
        self.f, self.mod, self.w = f, mod, wrapper
        self.files = OpenFiles()
        self.cache: dict[tuple[str, int, int], int | None] = {}

    def __call__(self, name: str, g: int, pos: int) -> int | None:
        key = (name, g, pos)
        if key not in self.cache:
            self.cache[key] = self._fit(name, g, pos)
        return self.cache[key]

    def end(self, g: int) -> int:
        m = self.w.masters[g]
        return m.numel() if self.w.kind == "fp16_optimizer" else len(self.w.ids[g])

    def _fit(self, name: str, g: int, pos: int) -> int | None:
        t = self.mod.tensors[name]
        if self.w.kind == "fp16_optimizer":
            if pos + t.numel() > self.end(g):
                return None
            master = TensorSource(name, t.shape, dtypes.FLOAT32, (Segment(self.w.masters[g], pos, t.numel()),), "")
            return pos + t.numel() if self._same_as_module(master, t) else None
        if pos >= self.end(g):
            return None
        shape = self.w.slot_shape(g, pos)
        if shape is not None and shape != t.shape:
            return None
        if self.w.kind == "fp16_unfused_optimizer":
            m = self.w.masters[g][pos]
            if not self._same_as_module(
                TensorSource(name, t.shape, dtypes.FLOAT32, (Segment(m, 0, m.numel()),), ""), t
            ):
                return None
        return pos + 1

    def _same_as_module(self, master: TensorSource, t: LazyTensor) -> bool:
        """The engine copies the cast masters into the 16-bit module after every step: they must be equal."""
        copy = TensorSource("", t.shape, t.dtype, (Segment(t, 0, t.numel()),), "")
        n = t.numel()
        windows = (
            [(0, n)]
            if n <= COMPARE_FULL_ELEMS
            else [(0, COMPARE_END_ELEMS), (n - COMPARE_END_ELEMS, COMPARE_END_ELEMS)]
        )
        for start, count in windows:
            if not casts_equal(
                read_elements(master, start, count, self.files), read_elements(copy, start, count, self.files), t.dtype
            ):
                return False
        return True


def _candidates(f: RankFile, mod: ModuleEntries, wrapper: _Wrapper) -> list[str]:
    names = [n for n in mod.keys if n not in mod.buffers and n not in mod.shared]
    for n in names:
        f.tensor(mod.tensors[n], f"module tensor {n}", floating=False)
    if wrapper.kind != "torch":
        return [n for n in names if mod.tensors[n].dtype.is_floating_point and mod.tensors[n].numel()]
    return names


def _assign(names: Sequence[str], ends: Sequence[int], fit: Callable[[str, int, int], int | None]) -> list[int | None]:
    """The one way to give every module param a param group (or none: frozen), each group's params in module order,
    filling every group exactly. Forward search over (param, positions) with solution counts capped at 2."""
    layers: list[dict[Pos, tuple[int, Pos, int | None]]] = []
    states: dict[Pos, int] = {tuple(0 for _ in ends): 1}
    for name in names:
        nxt: dict[Pos, int] = {}
        back: dict[Pos, tuple[int, Pos, int | None]] = {}
        for pos, count in states.items():
            for g in (None, *range(len(ends))):
                if g is None:
                    new = pos
                else:
                    step = fit(name, g, pos[g])
                    if step is None:
                        continue
                    new = (*pos[:g], step, *pos[g + 1 :])
                nxt[new] = min(2, nxt.get(new, 0) + count)
                back.setdefault(new, (count, pos, g))
        if len(nxt) > MAX_SEARCH_STATES:
            raise _Ambiguous(f"too many ways to place the params up to {name}")
        layers.append(back)
        states = nxt
    final = tuple(ends)
    if states.get(final, 0) == 0:
        raise _NoFit()
    if states[final] > 1:
        raise _Ambiguous("more than one assignment fits")
    choice: list[int | None] = []
    pos = final
    for back in reversed(layers):
        _, pos, g = back[pos]
        choice.append(g)
    return choice[::-1]


class _Ambiguous(Exception):
    pass


class _NoFit(Exception):
    pass


def _match(f: RankFile, mod: ModuleEntries, wrapper: _Wrapper) -> tuple[list[Param], list[str]]:
    names = _candidates(f, mod, wrapper)
    fit = _Fit(f, mod, wrapper)
    ends = [fit.end(g) for g in range(len(wrapper.ids))]
    try:
        choice = _assign(names, ends, fit)
    except _NoFit:
        raise UnsupportedCheckpointError(
            f"{f.path}: the optimizer's {len(ends)} param groups ({', '.join(map(str, ends))} "
            f"{'elements' if wrapper.kind == 'fp16_optimizer' else 'params'}) do not fit the module's params taken in "
            "module order with their 16-bit copies; param groups in another order, or files mixed up"
        ) from None
    except _Ambiguous as e:
        raise UnsupportedCheckpointError(
            f"{f.path}: cannot tell which module param is which optimizer entry ({e}: same-shaped params in "
            "several param groups); stage 0 records no param names"
        ) from None
    finally:
        fit.files.close()
    groups: list[list[str]] = [[] for _ in ends]
    frozen: list[str] = []
    for name, g in zip(names, choice, strict=True):
        (frozen if g is None else groups[g]).append(name)
    params = [p for g, members in enumerate(groups) for p in _group_params(f, mod, wrapper, g, members)]
    return params, frozen


def _group_params(f: RankFile, mod: ModuleEntries, w: _Wrapper, g: int, members: list[str]) -> list[Param]:
    """The Params of group g: fp32 masters and every tensor state, as slices of the flat or per-param tensors."""
    per_param = w.kind != "fp16_optimizer"
    states = [w.flat_states(pid) for pid in w.ids[g]]
    keys = [sorted(s) for s in states]
    for pid, k in zip(w.ids[g], keys, strict=True):
        if k != keys[0]:
            raise f.fail(f"optimizer param {pid} has states {k}, param {w.ids[g][0]} {keys[0]}: a state was lost")
    group_scalars(w, g)
    out, off = [], 0
    for i, name in enumerate(members):
        t = mod.tensors[name]
        n = t.numel()
        if w.kind == "torch":
            master, start = f.tensor(t, f"module tensor {name}"), 0
        else:
            master, start = (w.masters[g][i], 0) if per_param else (w.masters[g], off)
        fp32 = TensorSource(name, t.shape, dtypes.FLOAT32, (Segment(master, start, n),), "trainable")
        st = {}
        for key, state in (states[i] if per_param else states[0]).items():
            _check_state_length(f, state, key, g, n if per_param else fp32_len(w, g))
            st[key] = TensorSource(name, t.shape, state.dtype, (Segment(state, 0 if per_param else off, n),), "state")
        out.append(Param(name, name, t.shape, g, 0, fp32, st))
        off += n
    return out


def group_scalars(w: _Wrapper, g: int) -> dict[str, Any]:
    """The scalar state (step) of param group g, which all its params share.

    Except with DeepSpeed's FusedAdam (its param groups carry their own 'step'): it counts the step in the state of
    the group's last param only (the loop variable left over after its loop), the others keep the step they were
    created with, the group's 'step'. DeepSpeed loads and trains on such files as they are.
    """
    ids = w.ids[g]
    steps = [scalar_entries(w.state(pid)) for pid in ids]
    if not steps:
        return {}
    pg = w.inner["param_groups"][g]
    created = {"step": pg["step"]} if "step" in pg and "bias_correction" in pg else None
    for pid, s in zip(ids[:-1], steps[:-1], strict=True):
        same = fingerprint(s, w.reader) == fingerprint(steps[-1], w.reader)
        if not same and (created is None or s != created):
            raise w.f.fail(f"optimizer param {pid} is at step {short(s)}, param {ids[-1]} at {short(steps[-1])}")
    return steps[-1]


def fp32_len(w: _Wrapper, g: int) -> int:
    return int(w.masters[g].numel())


def _check_state_length(f: RankFile, state: LazyTensor, key: str, g: int, want: int) -> None:
    if state.numel() != want:
        raise f.fail(
            f"optimizer state {short(key)} of param group {g} holds {state.numel()} elements, the master {want}"
        )


# --- The model ---------------------------------------------------------------------------------------------


def _checkpoint(
    loc: CheckpointLocation,
    f: RankFile,
    mod: ModuleEntries,
    w: _Wrapper,
    params: list[Param],
    frozen_names: list[str],
    dp: int,
) -> Checkpoint:
    by_name = {p.name: p for p in params}
    train_dtype = train_dtype_of(mod.tensors, by_name)
    if (w.kind == "torch") != (train_dtype == dtypes.FLOAT32):
        raise f.fail(
            f"the module is trained in {train_dtype.name} but the optimizer entry is a {w.kind} state_dict "
            "(fp32 masters belong with 16-bit weights only)"
        )
    bit16 = {n: module_tensor(f, n, mod.tensors[n], "frozen") for n in frozen_names}
    if w.kind != "torch":
        bit16.update({n: module_tensor(f, n, mod.tensors[n], "trainable") for n in by_name})
    check_ties_and_keys(f, mod, by_name, {n: bit16[n] for n in frozen_names})
    return Checkpoint(
        location=loc,
        zero_stage=0,
        dp_world_size=dp,
        train_dtype=train_dtype,
        optimizer_kind=w.kind,
        ds_version=str(f.obj.get("ds_version", "")),
        global_steps=f.obj.get("global_steps") if is_int(f.obj.get("global_steps")) else None,
        keys=mod.keys,
        params=params,
        optimizer=_optimizer_state(w),
        bit16=bit16,
        buffers=mod.buffers,
        shared_params=mod.shared,
        frozen_excluded=saved_without_frozen(loc, by_name, bit16),
        ds_config=dict_at(f.obj, "ds_config"),
        model_files=[f.obj],
        layout=ParallelLayout(kind="zero0", dp=dp),
    )


def _optimizer_state(w: _Wrapper) -> OptimizerState:
    """Per group the scalars (step) of its first param; the wrapper's own entries (loss scaler, clip_grad) and
    the hyper-parameters as common."""
    scalars = [group_scalars(w, g) for g in range(len(w.ids))]
    masters = ("fp32_groups_flat", "fp32_groups", "optimizer_state_dict", "state", "param_groups")
    common = {k: v for k, v in w.entry.items() if k not in masters}
    common["param_groups"] = w.inner["param_groups"]
    common["zero0_wrapper"] = w.kind
    return OptimizerState(scalars, common, {})


# --- Resharding ------------------------------------------------------------------------------------------------


def zero0_rank_files(ckpt: Checkpoint, dp: int) -> dict[str, Any]:
    """What `reshard --dp M` writes for a stage-0 checkpoint: the one model-states file, unchanged but for
    dp_world_size. Stage 0 keeps the whole optimizer state on every rank and DeepSpeed's load_checkpoint checks no
    DP size without ZeRO, so the file loads at any DP as it is; dp_world_size is kept truthful."""
    return {MODEL_FILE: {**ckpt.model_state, "dp_world_size": dp}}


def check_zero0_reshard(ckpt: Checkpoint, *, universal: bool, stage: int | None) -> None:
    """What `reshard` cannot write for a stage-0 checkpoint, refused before anything is written.

    DeepSpeed has no universal checkpoint without ZeRO: `ds_to_universal` wants `*_optim_states.pt` files, and
    `load_checkpoint` with `load_universal` at stage 0 ends in `optimizer.update_lp_params()`, which neither
    FP16_Optimizer nor a torch optimizer has (AttributeError). A stage change is not derived from stage 0 here.
    """
    if ckpt.zero_stage != 0:
        return
    where = ckpt.location.tag_dir
    if universal:
        raise UsageError(
            f"{where} was saved without ZeRO (stage 0), which DeepSpeed cannot load as a universal checkpoint; "
            "it loads at any DP size as it is (or pass --dp M to rewrite it for M ranks)"
        )
    if stage not in (None, 0):
        raise UnsupportedCheckpointError(
            f"{where} was saved without ZeRO (stage 0); changing it to ZeRO-{stage} is not supported"
        )


class ZeroZeroLayout:
    """Data parallel without ZeRO: one mp_rank_00_model_states.pt holding the module and the whole optimizer."""

    kind = "zero0"
    title = "data parallel without ZeRO"

    def claims(self, names: Sequence[str]) -> bool:
        has_optim = any(OPTIM_RE.match(n) or ZERO3_MODEL_RE.match(n) for n in names)
        return not has_optim and model_parallel_ranks(names) == {0}

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_zero0(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        return []

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_zero0_reshard(ckpt, universal=target.universal, stage=target.stage)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        raise no_universal_form(ckpt, self.title)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return self.universal_files(ckpt)
        return zero0_rank_files(ckpt, target.dp)


LAYOUT = ZeroZeroLayout()

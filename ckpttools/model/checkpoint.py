"""The neutral checkpoint model: what a sharded training checkpoint holds, whatever wrote it.

A `Checkpoint` is named logical tensors (`TensorSource`: name, shape, dtype, role) each made of byte ranges
(`Segment`s of stored tensor records), the trainable parameters with their fp32 masters and optimizer states by
the optimizer's own key (`Param`), the run's scalars (`OptimizerState`), and the parallel layout it was saved
with. Layouts read their folders into it; every command consumes it. Tensor bytes stay on disk until a writer asks
for them through the segments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.segments import Segment
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

MASTER = "fp32"  # the fp32 master among a parameter's states (as universal folders name its file: fp32.pt)
STRIPPED_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")  # DDP/engine, torch.compile, Lightning < 2.1


@dataclass(frozen=True)
class TensorSource:
    """One output tensor: its name, shape, stored dtype, and the stored segments that make it up, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    segments: tuple[Segment, ...]
    kind: str  # "trainable" | "frozen" | "buffer" | "state"

    def numel(self) -> int:
        return shape_numel(self.shape)


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
        return shape_numel(self.shape)


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer saved besides the sharded tensors, checked equal on every rank."""

    group_scalars: list[dict[str, Any]]  # per param group: non-sharded state entries (step, ...)
    common: dict[str, Any]  # loss scaler, clip_grad, zero_stage, param_groups (hyper-parameters), ...
    file_meta: dict[str, Any]  # the rank file around it (ds_config, ds_version)
    elastic: bool = False
    # Sources whose parameters carry no state tensors (torch DCP: optimizer chunks are never opened) describe it here,
    # from their metadata alone. DeepSpeed saves always hold optimizer state, described by `Param.states`.
    saved: bool = True  # False: the save holds no optimizer state at all (a model-only save)
    stored_keys: list[str] = field(default_factory=list)  # state keys (exp_avg, ...) from metadata
    stored_bytes: int | None = None  # bytes of the state tensors from metadata; None: not described apart
    where: str = ""  # files beside the model's holding it (accelerate's optimizer_0/); "" in the same files
    problem: str = ""  # why its description could not be read (the model is read all the same)
    # Such a source reads its state tensors on demand: (parameter, state key, tensor) in the parameters' order
    # (torch DCP: the optimizer chunks are opened only when a command asks for them, never by consolidate)
    read_states: Callable[[], list[tuple[str, str, TensorSource]]] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]] | None:
        groups = self.common.get("param_groups")
        return groups if isinstance(groups, list) else None


@dataclass
class Checkpoint:
    """A parsed, validated checkpoint, whatever layout read it: the tensors (`params` with their fp32 masters and
    optimizer states, `bit16`, `buffers`) as segments of stored records, ties, the run's scalars, and the parallel
    `layout`. `keys` is the model's state-dict order (without prefixes).

    The facts a DeepSpeed save records about its run (zero_stage, dp_world_size, optimizer_kind, ds_version,
    ds_config, model_files) are fields too: every layout read today is DeepSpeed's, and `reshard` writes them back.
    """

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
    slices: list[Checkpoint] = field(default_factory=list)
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

    @property
    def optimizer_state_keys(self) -> list[str]:
        """The optimizer's state keys, from the parameters' states or, where those are not read, the metadata."""
        return self.state_keys or list(self.optimizer.stored_keys)

    @property
    def optimizer_state_bytes(self) -> int | None:
        """Bytes of the optimizer's state tensors (moments, step counters); None when present but not described."""
        if not self.optimizer.saved:
            return 0
        if self.optimizer.stored_bytes is not None or self.optimizer.problem:
            return self.optimizer.stored_bytes
        return sum(s.numel() * s.dtype.itemsize for p in self.params for s in p.states.values())

    @property
    def kept_fp32(self) -> list[str]:
        """Floating buffers a 16-bit run stored in fp32, in `keys` order: the engine held them in fp32.

        DeepSpeed 0.19.8's keep_in_fp32 (`data_types.keep_in_fp32_modules`, by default the model's
        `_keep_in_fp32_modules_strict`) puts such buffers back to fp32 (DeepSeek-V3/GLM's
        `e_score_correction_bias`: bf16 changes which experts tokens are routed to); without
        `data_types.buffer_dtype` the engine casts no buffer at all. The checkpoint records no list: the
        stored dtype is the record (`module` of mp_rank_00 at ZeRO-1/2, of every rank file at ZeRO-3). 16-bit
        output keeps them fp32 (`io.safetensors_writer.written_dtype`), as the engine's save_16bit_model does.
        Empty for fp32 training, where nothing is kept.
        """
        if self.train_dtype not in (dtypes.BFLOAT16, dtypes.FLOAT16):
            return []
        return [k for k in self.keys if k in self.buffers and self.buffers[k].dtype == dtypes.FLOAT32]

    def sources(self, dtype: DType) -> list[TensorSource]:
        """The source of every output tensor (aliases excluded) for output `dtype`, in `keys` order.

        fp32 output takes trainable params from the fp32 masters (what zero_to_fp32 writes). 16-bit output
        takes ZeRO-1/2 module weights when they already are that dtype (the bytes the engine saves; checked
        equal to the cast masters by `check_module_copies`), and otherwise casts the fp32 masters, as the
        engine does after every step. Buffers come as stored; the writer keeps the fp32 ones (`kept_fp32`)
        in fp32 for 16-bit output.
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


ZeroCheckpoint = Checkpoint  # the name of ckpttools 0.1, kept for code written against it


def strip_prefixes(name: str) -> str:
    """Drop the `module.` (DDP / engine.state_dict) and `_orig_mod.` (torch.compile) wrappers."""
    changed = True
    while changed:
        changed = False
        for prefix in STRIPPED_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def shape_numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def slice_segments(src: TensorSource, start: int, count: int) -> Iterator[Segment]:
    """Elements [start, start + count) of a source, as segments of its stored tensors."""
    pos = 0
    for seg in src.segments:
        lo, hi = max(start, pos), min(start + count, pos + seg.count)
        if lo < hi:
            yield Segment(seg.tensor, seg.start + lo - pos, hi - lo)
        pos += seg.count
        if pos >= start + count:
            return

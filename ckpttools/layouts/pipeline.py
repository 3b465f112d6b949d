"""Read a DeepSpeed PipelineModule (pipeline-parallel) checkpoint into one whole-model `Checkpoint`.

A pipeline save of S stages x DP ranks holds, in the tag folder:
  - `mp_rank_{s:02d}_model_states.pt` per stage s: `module` is None; `param_shapes` names the stage's trainable
    params by their whole-model keys (`2.weight` for layer 2, `tied_modules.<key>.<name>` for TiedLayerSpec
    modules, listed by every stage that uses them); `buffer_names` likewise; `checkpoint_parallel_dimensions`
    gives `pp_degree`.
  - `layer_{i:02d}-model_states.pt` per layer i with a `state_dict` (parameterless functions have none): the
    layer's own state dict with LOCAL keys (`weight`, `bias`), in the training dtype. A tied module is saved by
    every layer that calls it directly (a TiedLayerSpec with a `forward_fn` is a partial: no file).
  - `{bf16_}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt` per stage s and DP rank d: an ordinary ZeRO-1 (or
    BF16_Optimizer) file over that stage's params (`mp_rank` is the stage here).
Without ZeRO (stage 0, bf16: BF16_Optimizer) the stage file has no param_shapes but DP rank 0's optimizer state;
the stage's params are then named by the optimizer files' param_slice_mappings, shaped by the layer files.
Each stage is read with reader.py's ZeRO-1/2 machinery over a module assembled from the layer files; the stages
are then merged, tied params once (from the first stage that has them).

DualPipeV (`deepspeed.pipe.DualPipeVModule`, #8576) saves the same files, but cuts the layers into 2P stages for P
pipe ranks and pipe rank r holds stages r and 2P-1-r: `mp_rank_{r:02d}` then names two non-adjacent layer ranges
(saved once per phase) and `mp_world_size` is P. Nothing else marks it; the owners' V-shaped order in layer index
order (`0 1 1 0`) tells it from swapped stage files. Each pipe rank is read as one "stage" here.
pipeline_tp.py reads each TP rank of a pipeline x tensor-parallel save with `read_pipeline(loc, files, tp)`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import DEEPSPEED_STUBS, LazyTensor, PickledObject, RecordReader, load_pickle
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.crosscheck import OpenFiles, first_difference
from ckpttools.layouts.locate import MODEL_RE, OPTIM_RE, PIPE_LAYER_RE, ZERO3_MODEL_RE
from ckpttools.layouts.megatron_args import ArgsGlobals, args_of, inert
from ckpttools.layouts.rankfile import (
    OPTIM_KEYS,
    RankFile,
    check_agree,
    check_unique_names,
    dict_at,
    dp_size_of,
    load_rank_files,
    param_shapes_of,
    require_keys,
    zero_stage_of,
)
from ckpttools.layouts.universal import param_files
from ckpttools.layouts.zero.read import Zero12Reader
from ckpttools.layouts.zero.write import check_sliced_reshard, sliced_tag_files
from ckpttools.model.checkpoint import MASTER, Checkpoint, Param, TensorSource
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

LAYER_RE = re.compile(r"^layer_(?P<layer>\d+)-model_states\.pt$")
LAYER_TP_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
LAYER_KEY_RE = re.compile(r"^(?P<layer>\d+)\.(?P<key>.+)$")
TIED = "tied_modules."
STAGE_KEYS = ("module", "buffer_names", "param_shapes", "dp_world_size", "mp_world_size", "ds_version",
              "checkpoint_parallel_dimensions")  # fmt: skip
# Saved by every stage from the same engine state: a stage file from another save or run differs here.
STAGES_AGREE = ("ds_config", "ds_version", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                "global_steps", "global_samples", "skipped_steps", "lr_scheduler")  # fmt: skip


WRITABLE_STUBS = tuple(v for v in DEEPSPEED_STUBS.values() if isinstance(v, type))  # torchwriter re-creates these


class StageGlobals(ArgsGlobals):
    """What Megatron-DeepSpeed's client state puts in the stage files besides tensors, as inert records (nothing
    is imported): its `args` (argparse.Namespace with Megatron enums, as layouts.megatron reads Megatron-LM's) and
    its `rng_state` (numpy's generator state pickles numpy arrays and dtypes)."""

    NUMPY = (("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
             ("numpy", "ndarray"), ("numpy", "dtype"))  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.update({key: inert(*key) for key in self.NUMPY})

    def __contains__(self, key: object) -> bool:
        return key in self.NUMPY or super().__contains__(key)


def refuse_inert_records(ckpt: Checkpoint) -> None:
    """A reshard writes every stage file back as it was read: one holding records read only as inert stand-ins (the
    args' Namespace and Megatron enums, numpy's RNG state), which the torch writer cannot re-create, is refused."""
    for obj in ckpt.model_files:
        found = _inert_record(obj, 0)
        if found is not None:
            raise UnsupportedCheckpointError(
                f"{ckpt.location.tag_dir}: its model-states files hold {found} (Megatron-DeepSpeed's args or RNG "
                "state), which ckpttools reads as inert records and cannot write back into resharded files; "
                "consolidate it, or reshard with Megatron-DeepSpeed's tools (ds_to_universal, --universal-checkpoint)"
            )


def _inert_record(obj: Any, depth: int) -> str | None:
    if isinstance(obj, PickledObject) and type(obj) not in WRITABLE_STUBS:
        return obj.qualname
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    if depth > 8:  # the client state is shallow; a deeper structure is not Megatron-DeepSpeed's
        return None
    return next((q for child in children if (q := _inert_record(child, depth + 1)) is not None), None)


# Set on the args object by pretrain_gpt's model_provider, not arguments: the causal mask and the RoPE table (tensors).
RUNTIME_ARGS = ("attn_mask", "rotary_pos_emb")


def run_args(stage: Mapping[str, Any]) -> dict[str, Any] | None:
    """The saving run's Megatron arguments (plain values) from a stage file, or None (a PipelineModule of one's own,
    saved without Megatron-DeepSpeed's client state)."""
    args = args_of(stage)
    return None if args is None else {k: v for k, v in args.items() if k not in RUNTIME_ARGS}


@dataclass(frozen=True)
class PipelineFiles:
    """The tag folder's files by role: stage model states, optimizer files by (stage, DP rank), layer files."""

    stages: dict[int, str]
    optims: dict[int, dict[int, str]]
    layers: dict[int, str]


def is_pipeline(names: Sequence[str]) -> bool:
    """Layer files (`layer_XX-model_states.pt`) are what only a PipelineModule save writes."""
    return any(LAYER_RE.match(n) or LAYER_TP_RE.match(n) for n in names)


def pipeline_files(names: Sequence[str], where: str) -> PipelineFiles:
    if any(LAYER_TP_RE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"{where} is a pipeline + tensor-parallel checkpoint (layer_XX-model_YY-model_states.pt); only pipeline "
            "with data parallelism is supported"
        )
    stages: dict[int, str] = {}
    optims: dict[int, dict[int, str]] = {}
    layers: dict[int, str] = {}
    prefixes = set()
    for name in names:
        if m := MODEL_RE.match(name):
            stages[int(m["mp"])] = name
        elif m := OPTIM_RE.match(name):
            optims.setdefault(int(m["mp"]), {})[int(m["dp"])] = name
            prefixes.add(m["prefix"] or "")
        elif m := LAYER_RE.match(name):
            if int(m["layer"]) in layers:
                raise CorruptCheckpointError(
                    f"{where} holds two files for layer {int(m['layer'])}; remove the stray one"
                )
            layers[int(m["layer"])] = name
        elif ZERO3_MODEL_RE.match(name):
            raise CorruptCheckpointError(
                f"{where} mixes a ZeRO-3 file ({name}) into a pipeline checkpoint (DeepSpeed refuses ZeRO-2/3 with "
                "PipelineModule); remove the files of the other run"
            )
    if len(prefixes) > 1:
        raise CorruptCheckpointError(
            f"{where} mixes optimizer files with different prefixes {sorted(prefixes)}; remove the stale ones"
        )
    if not stages:
        raise CheckpointNotFoundError(f"{where} has layer files but no mp_rank_XX_model_states.pt (stage) files")
    return PipelineFiles(stages, optims, layers)


def read_pipeline(loc: CheckpointLocation, files: PipelineFiles | None = None, tp: int = 1) -> Checkpoint:
    """Open a pipeline-parallel checkpoint: every stage checked, merged into whole-model keys.

    A tied param (`tied_modules.*`) has an fp32 master and optimizer state on every stage that uses it; the
    merged checkpoint takes the first stage's (the copies need not be bit-identical: every stage's own is in
    `slices`, one Checkpoint per stage). `layout_files` lists the layer files (the same at any DP size).

    Raises:
        CheckpointNotFoundError: a stage, optimizer or layer file is missing (named).
        CorruptCheckpointError: files that disagree, are swapped, or do not match the stage's param_shapes.
        UnsupportedCheckpointError: pipeline combined with tensor parallelism; tied weights no layer file holds.

    `files` and `tp` (pipeline_tp.py): the files of one TP rank of a pipeline x tensor-parallel save, whose stage
    files record `tp_degree` tp and `mp_world_size` stages x tp.
    """
    if files is None:
        names = getattr(loc.files, "names", None) or sorted(p.name for p in loc.tag_dir.iterdir())
        files = pipeline_files(list(names), str(loc.tag_dir))
    with RecordReader() as reader:
        stages = _load_stages(loc, files, reader, tp)
        dp = dp_size_of(stages[0])
        optims = [_load_stage_optims(loc, files, s, stages[s], dp, reader) for s in range(len(stages))]
        shapes = [_stage_names(f, o) for f, o in zip(stages, optims, strict=True)]
        layers = _load_layers(loc, files, shapes)
        modules = _stage_modules(loc, stages, shapes, layers)
        parts = []
        for s, f in enumerate(stages):
            obj = {**f.obj, "module": modules[s], "param_shapes": shapes[s].param_shapes(modules[s])}
            module_file = RankFile(f.path, obj, "model-states")
            part = Zero12Reader(loc, module_file, optims[s], dp, 1, reader).read()
            part.model_files = [f.obj]  # as stored (module None): what a reshard of the stage writes back
            parts.append(part)
        ckpt = _merge(loc, stages, parts, optims, layers, reader)
        reader.finish()
    return ckpt


def read_pipeline_stages(loc: CheckpointLocation) -> list[Checkpoint]:
    """Every stage as a checkpoint of its own (`slices`: the stage's whole-model keys, its optimizer files, its
    stage file as stored): what a per-stage reshard works on. Checked exactly as `read_pipeline` checks."""
    return read_pipeline(loc).slices


# --- Stage files ---------------------------------------------------------------------------------------------


def _load_stages(loc: CheckpointLocation, files: PipelineFiles, reader: RecordReader, tp: int = 1) -> list[RankFile]:
    first = min(files.stages)
    f0 = _stage_file(loc, files.stages[first])
    pp = _pp_degree(f0, tp)
    missing = [s for s in range(pp) if s not in files.stages]
    if missing:
        s = missing[0]
        raise CheckpointNotFoundError(
            f"{loc.tag_dir}: stage {s} (mp_rank_{s:02d}_model_states.pt) of the {pp} pipeline stages is missing; the "
            "save may have been interrupted: re-copy the folder or pick another tag with --tag"
        )
    extra = sorted(set(files.stages) - set(range(pp)))
    if extra:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: {files.stages[extra[0]]} is a stage beyond the {pp} stages "
            "(checkpoint_parallel_dimensions.pp_degree) of this save; remove the stray file"
        )
    stages = [f0 if s == first else _stage_file(loc, files.stages[s]) for s in range(pp)]
    for key in STAGES_AGREE:
        check_agree(stages, [f.obj.get(key) for f in stages], key, reader)
    return stages


def _stage_file(loc: CheckpointLocation, name: str) -> RankFile:
    obj = load_pickle(loc.tag_dir / name, extra_globals=StageGlobals())
    f = RankFile(loc.tag_dir / name, obj, "pipeline stage model-states")
    require_keys(f, f.obj, STAGE_KEYS, "DeepSpeed pipeline stage file")
    if f.obj["module"] is not None:
        raise f.fail("holds module weights, which a pipeline stage file never does (its layers have their own files)")
    return f


def _pp_degree(f: RankFile, tp_expected: int = 1) -> int:
    dims = f.get(f.obj, "checkpoint_parallel_dimensions", dict)
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree", 1)
    if not isinstance(pp, int) or isinstance(pp, bool) or not 1 <= pp <= 1 << 16:
        raise f.fail(f"checkpoint_parallel_dimensions.pp_degree {short(pp, 20)} is not a stage count")
    if tp_expected not in (1, tp):
        raise f.fail(f"records tp_degree {short(tp, 20)}, but the layer files name {tp_expected} TP ranks")
    if tp != tp_expected:  # plain layer file names but a TP degree: not a layout DeepSpeed writes
        raise UnsupportedCheckpointError(
            f"{f.path}: pipeline combined with tensor parallel degree {short(tp, 20)} is not supported"
        )
    if f.obj.get("mp_world_size") != pp * tp:
        raise f.fail(f"mp_world_size {short(f.obj.get('mp_world_size'), 20)} is not the {pp} pipeline stages x TP {tp}")
    return pp


def _load_stage_optims(
    loc: CheckpointLocation, files: PipelineFiles, s: int, stage: RankFile, dp: int, reader: RecordReader
) -> list[RankFile]:
    names = files.optims.get(s, {})
    missing = [r for r in range(dp) if r not in names]
    if missing:
        raise CheckpointNotFoundError(
            f"{loc.tag_dir}: stage {s} (mp_rank_{s:02d}) has no optimizer file for DP rank {missing[0]} "
            f"(*zero_pp_rank_{missing[0]}_mp_rank_{s:02d}_optim_states.pt missing, dp_world_size={dp}); the save may "
            "have been interrupted: re-copy the folder or pick another tag with --tag"
        )
    stray = sorted(set(files.optims) - set(files.stages))
    if stray:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: optimizer files for stage {stray[0]} (mp_rank_{stray[0]:02d}), which has no stage file "
            "in this save; remove the stray files"
        )
    optims = load_rank_files(loc, names, f"stage {s} *_optim_states.pt", dp)
    if stage.obj.get("optimizer") is not None:  # ZeRO stage 0: DP rank 0's optimizer state, also kept here
        what = "the optimizer state (DP rank 0's, saved in both without ZeRO)"
        check_agree(
            [stage, optims[0]], [stage.obj["optimizer"], optims[0].obj.get("optimizer_state_dict")], what, reader
        )
    for f in optims:
        osd = f.get(f.obj, "optimizer_state_dict", dict)
        if zero_stage_of(f, osd) != 1:
            stage_id = osd.get("zero_stage")
            raise f.fail(f"records ZeRO stage {stage_id}; DeepSpeed pipelines run without ZeRO or with ZeRO-1 only")
        require_keys(f, osd, OPTIM_KEYS["zero" if "zero_stage" in osd else "bf16_optimizer"], "ZeRO-1 optimizer file")
        for key in ("ds_config", "ds_version"):
            check_agree([stage, f], [stage.obj.get(key), f.obj.get(key)], key, reader)
    return optims


@dataclass(frozen=True)
class _StageNames:
    groups: list[list[tuple[str, tuple[int, ...] | None]]]  # param_shapes (shapes None: from the layer files)
    buffers: list[str]

    @property
    def shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {n: s for g in self.groups for n, s in g}

    def param_shapes(self, module: Mapping[str, LazyTensor]) -> list[dict[str, tuple[int, ...]]]:
        """param_shapes as DeepSpeed writes it, shapes it did not record taken from the module's tensors."""
        return [{n: s if s is not None else tuple(module[n].shape) for n, s in g} for g in self.groups]

    def layer_indices(self) -> list[int]:
        return sorted({int(m["layer"]) for n in [*self.shapes, *self.buffers] if (m := LAYER_KEY_RE.match(n))})


def _stage_names(f: RankFile, optims: Sequence[RankFile]) -> _StageNames:
    groups: list[list[tuple[str, tuple[int, ...] | None]]]
    if f.obj.get("param_shapes") is None and f.obj.get("optimizer") is not None:
        groups = _names_from_slices(optims)
    else:
        shaped = param_shapes_of(f, f.get(f.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f, shaped)
        groups = [list(g) for g in shaped]
    buffers = f.get(f.obj, "buffer_names", (list, tuple))
    for name in [n for g in groups for n, _ in g] + list(buffers):
        if not isinstance(name, str) or not (name.startswith(TIED) or LAYER_KEY_RE.match(name)):
            raise f.fail(f"names {short(name)}, which is neither a layer's (`<index>.<name>`) nor a tied module's")
    return _StageNames(groups, [str(b) for b in buffers])


def _names_from_slices(optims: Sequence[RankFile]) -> list[list[tuple[str, tuple[int, ...] | None]]]:
    """Without ZeRO (stage 0, BF16_Optimizer) DeepSpeed saves no param_shapes. The stage's params in flat order
    are then the names the DP ranks' param_slice_mappings list, rank after rank; their shapes come from the layer
    files, checked against the partition sizes by the ZeRO-1/2 reader."""
    groups: list[dict[str, None]] = []
    for f in optims:
        osd = f.obj["optimizer_state_dict"]
        mappings = f.get(osd, "param_slice_mappings", list, "optimizer_state_dict.")
        for g, mapping in enumerate(mappings):
            if not isinstance(mapping, Mapping) or not all(isinstance(n, str) for n in mapping):
                raise f.fail(f"param_slice_mappings[{g}] is not a mapping of parameter names")
            groups += [{} for _ in range(g + 1 - len(groups))]
            groups[g].update(dict.fromkeys(n for n in mapping if n not in groups[g]))
    return [[(n, None) for n in g] for g in groups]


# --- Layer files ---------------------------------------------------------------------------------------------


@dataclass
class _Layers:
    files: dict[int, RankFile]
    tied: dict[int, str]  # layer index -> tied module prefix (`tied_modules.embed.`)
    stage_of: dict[int, int | None]  # layer index -> stage (DualPipeV: pipe rank; None: cannot tell)
    dualpipev: bool = False  # DualPipeVModule: each stage file (pipe rank) holds two stages, r and 2P-1-r


def _load_layers(loc: CheckpointLocation, files: PipelineFiles, shapes: Sequence[_StageNames]) -> _Layers:
    indices = [s.layer_indices() for s in shapes]
    dualpipev = _is_dualpipev(loc, files, indices)
    for s, layer_ids in enumerate(indices):
        for i in layer_ids:
            if i not in files.layers:
                raise CheckpointNotFoundError(
                    f"{loc.tag_dir}: layer_{i:02d}-model_states.pt (layer {i} of stage {s}) is missing; the save may "
                    "have been interrupted: re-copy the folder or pick another tag with --tag"
                )
    loaded = {}
    for i, name in sorted(files.layers.items()):
        f = RankFile(loc.tag_dir / name, load_pickle(loc.tag_dir / name), "pipeline layer")
        for key, value in f.obj.items():
            if not isinstance(key, str):
                raise f.fail("holds a key that is not a string")
            f.tensor(value, f"layer tensor {key}", floating=False)
        loaded[i] = f
    owner = {i: s for s, layer_ids in enumerate(indices) for i in layer_ids}
    tied: dict[int, str] = {}
    for i, f in loaded.items():
        prefix = _tied_prefix(f, shapes) if i not in owner and f.obj else None
        if prefix is not None:
            tied[i] = prefix
        elif i not in owner and f.obj:
            raise UnsupportedCheckpointError(
                f"{f.path} holds {', '.join(sorted(f.obj))[:80]}, which no stage lists in param_shapes or buffer_names "
                "(a layer of frozen parameters only?); not supported"
            )
    stage_of: dict[int, int | None] = {i: owner.get(i) for i in loaded}
    for i, prefix in tied.items():
        stage_of[i] = (_tied_rank if dualpipev else _tied_stage)(i, prefix, indices, shapes)
    return _Layers(loaded, tied, stage_of, dualpipev)


def _owner_runs(indices: Sequence[list[int]]) -> list[tuple[int, int, int]]:
    """The layers in index order as runs of one owner: (stage or pipe rank, first layer, last layer)."""
    owner = {i: s for s, ids in enumerate(indices) for i in ids}
    runs: list[tuple[int, int, int]] = []
    for i in sorted(owner):
        if runs and runs[-1][0] == owner[i]:
            runs[-1] = (owner[i], runs[-1][1], i)
        else:
            runs.append((owner[i], i, i))
    return runs


def _is_dualpipev(loc: CheckpointLocation, files: PipelineFiles, indices: Sequence[list[int]]) -> bool:
    """Whether the stage files hold DualPipeV's layout (True) or PipelineModule's (False); neither is refused.

    PipelineModule: stage s holds one layer range, after stage s-1's. DualPipeVModule (#8576) cuts the layers into
    2P stages for P pipe ranks and rank r builds stages r and 2P-1-r, so in layer order the owners run up from
    rank 0 to P-1 and back down (`0 1 1 0` for P = 2). Nothing else in the files says which module saved them; a
    plain pipeline's swapped stage files never start at rank 0 and rise, so they are not taken for DualPipeV."""
    runs = _owner_runs(indices)
    ranks = [r for r, _, _ in runs]
    if all(a < b for a, b in itertools.pairwise(ranks)):
        return False
    peak = ranks.index(max(ranks))
    up, down = ranks[: peak + 1], ranks[peak:]
    rising = all(a < b for a, b in itertools.pairwise(up))
    if ranks[0] == 0 and rising and all(a > b for a, b in itertools.pairwise(down)):
        return True
    k = next(k for k in range(1, len(runs)) if ranks[k] < ranks[k - 1])
    raise CorruptCheckpointError(
        f"{loc.tag_dir}: {files.stages[ranks[k - 1]]} holds layer {runs[k - 1][2]} but stage {ranks[k]} layer "
        f"{runs[k][1]}: pipeline stages hold consecutive layer ranges (DualPipeV: rank r stages r and 2P-1-r), so "
        "stage files were swapped or come from different runs; restore the original files"
    )


def _tied_rank(i: int, prefix: str, indices: Sequence[list[int]], shapes: Sequence[_StageNames]) -> int | None:
    """DualPipeV: the pipe rank a tied layer file belongs to, that of the layers beside it (rank 0 holds the
    first and the last stage, where tied embeddings and heads sit), if that rank uses the tied module."""
    runs = _owner_runs(indices)
    below = [r for r, _, last in runs if last < i][-1:]
    above = [r for r, first, _ in runs if first > i][:1]
    near = set(below + above)
    fits = [s for s in near if any(n.startswith(prefix) for n in shapes[s].shapes)]
    return fits[0] if len(fits) == 1 else None


def _tied_prefix(f: RankFile, shapes: Sequence[_StageNames]) -> str | None:
    """Which tied module a layer file no stage names by index holds: the one whose trainable params it holds
    with their shapes. None: no tied module (a layer of frozen params only)."""
    candidates = set()
    all_shapes: dict[str, tuple[int, ...] | None] = {}
    for st in shapes:
        all_shapes.update({n: s for n, s in st.shapes.items() if all_shapes.get(n) is None})
    prefixes = {n[: len(TIED) + n[len(TIED) :].index(".") + 1] for n in all_shapes if n.startswith(TIED)}
    for prefix in prefixes:
        local = {n[len(prefix) :]: s for n, s in all_shapes.items() if n.startswith(prefix)}
        if all(isinstance(f.obj.get(k), LazyTensor) and s in (None, f.obj[k].shape) for k, s in local.items()):
            candidates.add(prefix)
    if len(candidates) > 1:
        raise UnsupportedCheckpointError(
            f"{f.path} could hold tied module {' or '.join(sorted(p[len(TIED) : -1] for p in candidates))} (same "
            "names and shapes); which one it is is not recorded in the checkpoint"
        )
    return candidates.pop() if candidates else None


def _tied_stage(i: int, prefix: str, indices: Sequence[list[int]], shapes: Sequence[_StageNames]) -> int | None:
    """The stage a tied layer file belongs to: one that uses the tied module and whose layer range can hold i."""
    fits = []
    for s, st in enumerate(shapes):
        before = max((x for ids in indices[:s] for x in ids), default=-1)
        after = min((x for ids in indices[s + 1 :] for x in ids), default=1 << 62)
        if before < i < after and any(n.startswith(prefix) for n in st.shapes):
            fits.append(s)
    return fits[0] if len(fits) == 1 else None


def _stage_modules(
    loc: CheckpointLocation, stages: Sequence[RankFile], shapes: Sequence[_StageNames], layers: _Layers
) -> list[dict[str, Any]]:
    """Per stage, the module state dict the stage would save (whole-model keys), made of layer-file tensors:
    its tied modules first (as PipelineModule registers them), then its layers in order."""
    tied_tensors: dict[str, LazyTensor] = {}
    for i, prefix in sorted(layers.tied.items()):
        f = layers.files[i]
        for key, t in f.obj.items():
            name = prefix + key
            first = tied_tensors.setdefault(name, t)
            if (first.shape, first.dtype) != (t.shape, t.dtype):
                raise f.fail(
                    f"holds tied {name} as {t.dtype.name}{list(t.shape)}, another layer file as "
                    f"{first.dtype.name}{list(first.shape)}: the copies of a tied module must be alike"
                )
    modules = []
    for s, (f, st) in enumerate(zip(stages, shapes, strict=True)):
        module: dict[str, Any] = {}
        wanted = st.shapes
        module.update({n: t for n, t in tied_tensors.items() if n.startswith(_prefixes(st))})
        for name in [n for n in [*wanted, *st.buffers] if n.startswith(TIED) and n not in module]:
            raise UnsupportedCheckpointError(
                f"{loc.tag_dir}: no layer file holds tied {name} ({f.path.name} lists it): its layer file is "
                "missing, or every layer using that tied module has a forward_fn and DeepSpeed saved none; its "
                "16-bit weights are not in the checkpoint (re-copy the folder if a layer_XX file was lost)"
            )
        for i in st.layer_indices():
            lf = layers.files[i]
            for key, t in lf.obj.items():
                module[f"{i}.{key}"] = t
        for name in [*wanted, *st.buffers]:
            if name not in module and not name.startswith(TIED):
                i = int(LAYER_KEY_RE.match(name)["layer"])  # type: ignore[index]
                raise layers.files[i].fail(f"lacks {name[len(str(i)) + 1 :]}, which stage {s}'s {f.path.name} lists")
        for name, shape in wanted.items():
            if name in module and shape is not None and module[name].shape != shape:
                where = layers.files[int(m["layer"])].path.name if (m := LAYER_KEY_RE.match(name)) else "a layer file"
                raise CorruptCheckpointError(
                    f"{loc.tag_dir}: {name} is {list(module[name].shape)} in {where} but {list(shape)} in "
                    f"{f.path.name}'s param_shapes; files from different runs are mixed: re-copy the tag folder"
                )
        modules.append(module)
    return modules


def _prefixes(st: _StageNames) -> tuple[str, ...]:
    return tuple({n[: len(TIED) + n[len(TIED) :].index(".") + 1] for n in st.shapes if n.startswith(TIED)})


# --- Merging the stages --------------------------------------------------------------------------------------


def _merge(
    loc: CheckpointLocation,
    stages: Sequence[RankFile],
    parts: Sequence[Checkpoint],
    optims: Sequence[Sequence[RankFile]],
    layers: _Layers,
    reader: RecordReader,
) -> Checkpoint:
    for s, part in enumerate(parts):
        _check_slice_names(optims[s], part)
    firsts = [o[0] for o in optims]
    check_agree(firsts, [p.optimizer.param_groups for p in parts], "the optimizer hyper-parameters", reader)
    check_agree(firsts, [p.optimizer.group_scalars for p in parts], "the optimizer step", reader)
    check_agree(firsts, [sorted(p.state_keys) for p in parts], "the optimizer state keys", reader)
    check_agree(firsts, [p.optimizer_kind for p in parts], "the optimizer wrapper", reader)
    params: dict[str, Param] = {}
    bit16: dict[str, TensorSource] = {}
    buffers: dict[str, TensorSource] = {}
    for s, part in enumerate(parts):
        for p in part.params:
            if p.name in params and params[p.name].shape != p.shape:
                raise stages[s].fail(
                    f"tied {p.name} is {list(p.shape)}, on an earlier stage {list(params[p.name].shape)}"
                )
            params.setdefault(p.name, p)
        for name, src in part.bit16.items():
            bit16.setdefault(name, src)
        for name, src in part.buffers.items():
            buffers.setdefault(name, src)
    keys = _whole_model_keys([p.keys for p in parts], layers.dualpipev)
    p0 = parts[0]
    return Checkpoint(
        location=loc,
        zero_stage=1,
        dp_world_size=p0.dp_world_size,
        train_dtype=p0.train_dtype,
        optimizer_kind=p0.optimizer_kind,
        ds_version=p0.ds_version,
        global_steps=p0.global_steps,
        keys=keys,
        params=list(params.values()),
        optimizer=p0.optimizer,
        bit16=bit16,
        buffers=buffers,
        shared_params={},  # a tied module has one key in the whole model: nothing is aliased
        frozen_excluded=False,
        ds_config=dict_at(stages[0].obj, "ds_config"),
        model_files=[f.obj for f in stages],
        layout=pipeline_layout(len(stages), p0.dp_world_size, parts, layers, run_args(stages[0].obj)),
        slices=list(parts),
        layout_files=[f.path.name for _, f in sorted(layers.files.items())],  # the layer files: DP-independent
    )


def _check_slice_names(optims: Sequence[RankFile], part: Checkpoint) -> None:
    """Each optimizer file names the params of its slice: they must be its stage's (a swapped file is not)."""
    by_group: dict[int, set[str]] = {}
    for p in part.params:
        by_group.setdefault(p.group, set()).add(p.file_name)
    for f in optims:
        mappings = f.obj["optimizer_state_dict"].get("param_slice_mappings")
        if not isinstance(mappings, list):
            continue  # older DeepSpeed writes none
        for g, mapping in enumerate(mappings):
            names = set(mapping) if isinstance(mapping, Mapping) else set()
            foreign = sorted(map(str, names - by_group.get(g, set())))
            if foreign:
                raise f.fail(
                    f"param_slice_mappings[{g}] names {short(foreign[0])}, which its stage's param_shapes lack: the "
                    "optimizer file belongs to another stage or run"
                )


def _whole_model_keys(stage_keys: Sequence[Sequence[str]], dualpipev: bool = False) -> list[str]:
    """PipelineModule.state_dict() order: tied modules first (first seen), then every stage's layers in order
    (DualPipeV: the layers in index order, as a whole model built from the same specs would list them)."""
    tied = {k: None for keys in stage_keys for k in keys if k.startswith(TIED)}
    layered = [k for keys in stage_keys for k in keys if not k.startswith(TIED)]
    if dualpipev:
        layered.sort(key=lambda k: int(k.split(".", 1)[0]))  # stable: a layer's own keys keep their order
    return [*tied, *layered]


def pipeline_layout(
    pp: int, dp: int, parts: Sequence[Checkpoint], layers: _Layers, args: dict[str, Any] | None = None
) -> ParallelLayout:
    tied: dict[str, dict[str, Any]] = {}
    for s, part in enumerate(parts):
        for name in part.keys:
            if name.startswith(TIED):
                key = name[len(TIED) :].split(".", 1)[0]
                entry = tied.setdefault(key, {"stages": [], "layer_files": []})
                if s not in entry["stages"]:
                    entry["stages"].append(s)
    for i, prefix in sorted(layers.tied.items()):
        tied[prefix[len(TIED) : -1]]["layer_files"].append(layers.files[i].path.name)
    details = {
        "layer_stage": {str(i): s for i, s in sorted(layers.stage_of.items())},
        "stage_params": {str(s): [p.name for p in part.params] for s, part in enumerate(parts)},
        "tied": tied,
    }
    if layers.dualpipev:
        details["schedule"] = "dualpipev"
        details["stages"] = 2 * pp
    if args:
        details["args"] = args  # Megatron-DeepSpeed's: what adapters.megatron_deepspeed maps the names with
    return ParallelLayout(kind="pipeline", dp=dp, pp=pp, details=details)


# --- The universal format ------------------------------------------------------------------------------------


def pipeline_universal_files(ckpt: Checkpoint) -> dict[str, Any]:
    """Relative path -> object: DeepSpeed's universal layout of a ZeRO-1 pipeline checkpoint.

    A universal load (`load_universal`) never reads the layer files (`_load_checkpoint` skips
    `load_module_state_dict`): each stage's ZeRO optimizer looks every param up as `zero/<name>/` under its
    `named_parameters()` name (`<layer index>.<name>`, `tied_modules.<key>.<name>`), which does not depend on
    the stage layout, and `update_lp_params` then copies the masters into the 16-bit module. So the folder is:
    every whole-model param once (a tied param, held by every stage that uses it, from the first, after its
    copies are checked bit-identical), `zero/optimizer_state.pt` (stage 0's shared state; the stages' param
    groups were checked equal) and every stage's model-states file unchanged (global_steps, lr_scheduler; the
    loader asserts their count equals their `mp_world_size`), as ds_to_universal writes it for pipelines.

    Raises:
        UnsupportedCheckpointError: the copies of a tied param differ between stages (one copy per name is all
            the universal format holds).
    """
    opt = ckpt.optimizer
    if opt.param_groups is None:
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: elastic ZeRO-1/2 checkpoints carry no param_groups for the universal format; "
            "reshard natively instead"
        )
    _check_tied_copies_equal(ckpt)
    files = param_files(ckpt.params, opt.group_scalars)
    files["zero/optimizer_state.pt"] = dict(opt.common)
    for s, model in enumerate(ckpt.model_files):
        files[f"mp_rank_{s:02d}_model_states.pt"] = model
    return files


def _check_tied_copies_equal(ckpt: Checkpoint) -> None:
    """Every stage's copy of a tied param (master and each state) must be bit-identical to the first stage's:
    the universal folder holds one, which every stage then loads."""
    first: dict[str, tuple[int, Param]] = {}
    files = OpenFiles()
    try:
        for s, part in enumerate(ckpt.slices):
            for p in part.params:
                if p.name not in first:
                    first[p.name] = (s, p)
                    continue
                s0, p0 = first[p.name]
                for key, src in {MASTER: p.fp32, **p.states}.items():
                    at = first_difference(p0.fp32 if key == MASTER else p0.states[key], src, files)
                    if at is not None:
                        raise UnsupportedCheckpointError(
                            f"{ckpt.location.tag_dir}: tied {p.name} differs between stage {s0} and stage {s} ({key}, "
                            f"from element {at}); the universal format holds one copy per parameter, so it cannot "
                            "keep both: reshard with --dp M instead"
                        )
    finally:
        files.close()


class PipelineLayout:
    """PipelineModule: one ZeRO data-parallel group per stage, the module saved as one file per layer."""

    kind = "pipeline"
    title = "pipeline-parallel (PipelineModule)"

    def claims(self, names: Sequence[str]) -> bool:
        return any(PIPE_LAYER_RE.match(n) for n in names)

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_pipeline(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        by_stage: dict[int, list[str]] = {}
        for layer, stage in (parallel.get("layer_stage") or {}).items():
            by_stage.setdefault(int(stage), []).append(str(layer))
        dualpipev = parallel.get("schedule") == "dualpipev"
        unit = "pipe rank" if dualpipev else "stage"
        stages = "; ".join(f"{unit} {s}: layers {', '.join(ls)}" for s, ls in sorted(by_stage.items()))
        tied = ", ".join(
            f"{name} ({unit}s {', '.join(map(str, t.get('stages', [])))})"
            for name, t in (parallel.get("tied") or {}).items()
        )
        lines = [f"stages         {stages or parallel.get('pp')}"] + ([f"tied modules   {tied}"] if tied else [])
        if dualpipev:
            pp = parallel.get("pp")
            lines.insert(0, f"schedule       DualPipeV: {parallel.get('stages')} stages on {pp} pipe ranks, rank r "
                         "holding stages r and 2P-1-r")  # fmt: skip
        return lines

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_sliced_reshard(ckpt, target, self.title)
        refuse_inert_records(ckpt)
        zero = ckpt.ds_config.get("zero_optimization")
        if (zero.get("stage", 0) if isinstance(zero, dict) else 0) == 0:
            raise UnsupportedCheckpointError(
                f"{ckpt.location.tag_dir} is a {self.title} checkpoint ({ckpt.layout.describe()}), saved without "
                "ZeRO (BF16_Optimizer keeps DP rank 0's state in every stage file); DeepSpeed 0.19.8 cannot resume "
                "such a checkpoint even at its own size (KeyError: 0 in _load_legacy_checkpoint), so resharding it "
                "is not supported (consolidate works)"
            )

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        return pipeline_universal_files(ckpt)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return pipeline_universal_files(ckpt)
        return sliced_tag_files(ckpt, target)


LAYOUT = PipelineLayout()

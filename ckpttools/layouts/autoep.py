"""Read a DeepSpeed AutoEP checkpoint (expert parallelism for transformers' own MoE models) into the one model,
every expert under its Hugging Face name.

AutoEP (DeepSpeed 0.19.8, `"expert_parallel": {"enabled": true, "autoep_size": K}`) replaces each MoE block of
a transformers model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, MiniMax: `module_inject/auto_ep_presets/`) by an
`AutoEPMoELayer`: the router's weight becomes `<layer>.router.gate.weight` (the module also keeps the old
`<layer>.gate.gate.weight` entry, the same parameter saved twice), and EP rank e holds experts
e*N/K ... (e+1)*N/K-1 of the layer as three grouped tensors `<layer>.experts.w1` (gate), `w3` (up)
[N/K, ffn, hidden] and `w2` (down) [N/K, hidden, ffn]. What DeepSpeed 0.19.8 writes (checked on the
autoep_* fixtures):

- `ds_autoep_layers` (legacy `autoep_layers`) in the model-states file(s): per layer its `module_path`,
  `num_experts`, `num_local_experts`, `ep_size`, `expert_placement` (version 1: the experts of every EP rank) and
  `affine_maps`; `param_shapes` lists the dense params in group 0 and every layer's local w1/w2/w3 in a group
  marked `moe: True`, `name: "ep_size_K"`.
- ZeRO-1/2: `mp_rank_00_model_states.pt` (module without experts) plus `layer_{L}_expert_{E}_mp_rank_00_model_
  states.pt` holding `<layer>.experts.w1.{E}`, `w2.{E}`, `w3.{E}` (16-bit, global expert E); the optimizer files
  cut the `moe` group of EP rank e over its expert-DP group (ranks e, e+K, ... by DeepSpeed's default).

- ZeRO-3: every rank's `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (its ds_autoep_layers name its EP and
  expert-DP rank, checkpoint_format `zero3_partitioned`) and optimizer file; `ds_zero_partition_groups` says per
  sub-group which ranks partition it (dense: every rank, family `replicated`; experts: the expert-DP group,
  family `autoep_expert`). DeepSpeed's zero_to_fp32/zero_to_torch refuse it ("Use ds_to_universal.py").

Transformers (5.x) names a layer's experts `<layer>.experts.gate_up_proj` [N, 2*ffn, hidden] (gate rows first:
DeepSpeed's `moe/ep_repack.py` splits it so, layout `gate_up_first`) and `<layer>.experts.down_proj`
[N, hidden, ffn], its router `<layer>.gate.weight`. Every one of them is a concatenation of whole rows of
the stored tensors, so the layout describes them as segments: no bytes are copied or read here.

Resharding (same ep size, DP a multiple of it) cuts each EP rank's grouped w1/w2/w3 back out of those params:
`--dp M` re-cuts the optimizer files (and, at ZeRO-3, writes every rank's partition groups and AutoEP facts for
the new topology: DeepSpeed checks them on load); `--universal` writes ds_to_universal's form. Each is proven by
DeepSpeed loading the result at another DP and training on (tests/test_autoep.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.io.torchwriter import whole_tensor
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.locate import EXPERT_RE, MODEL_RE
from ckpttools.layouts.rankfile import (
    MODEL_KEYS,
    OPTIM_KEYS,
    ModuleEntries,
    RankFile,
    check_agree,
    check_module_keys,
    check_unique_names,
    dict_at,
    dp_size_of,
    file_meta,
    flat_state_keys,
    is_int,
    load_rank_files,
    param_shapes_of,
    read_module,
    require_keys,
    same_keys_everywhere,
    train_dtype_of,
    zero_stage_of,
)
from ckpttools.layouts.universal import NAME_KEY, param_files
from ckpttools.layouts.zero.read import Zero12Reader, _Zero3Reader, zero3_optimizer_parts, zero12_bit16
from ckpttools.layouts.zero.write import append_partitions
from ckpttools.model.checkpoint import (
    MASTER,
    Checkpoint,
    OptimizerState,
    Param,
    Replica,
    Segment,
    TensorSource,
    slice_segments,
    strip_prefixes,
)
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")  # DeepSpeed's key, then its legacy name
GROUPED = ("w1", "w2", "w3")  # gate, down, up: AutoEP's grouped expert tensors
EP_GROUP_RE = re.compile(r"^ep_size_(?P<ep>\d+)$")


def autoep_entries(obj: Mapping[str, Any]) -> Any:
    """The AutoEP layer list of a model-states dict (None when the run had no AutoEP layer)."""
    for key in AUTOEP_KEYS:
        if obj.get(key):
            return obj[key]
    return None


def is_autoep(loc: CheckpointLocation) -> bool:
    """Whether a ZeRO-3 tag folder is an AutoEP run's (rank 0's model states list AutoEP layers)."""
    if not loc.files.zero3_layout or not loc.files.model_files:
        return False
    return autoep_entries(load_pickle(loc.tag_dir / loc.files.model_files[min(loc.files.model_files)])) is not None


@dataclass(frozen=True)
class EPLayer:
    """One AutoEP layer: module path, expert counts and the experts each EP rank holds (contiguous, uniform)."""

    index: int
    path: str
    num_experts: int
    ep: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep

    def grouped(self, w: str) -> str:
        return f"{self.path}.experts.{w}"

    @property
    def gate_up(self) -> str:
        return f"{self.path}.experts.gate_up_proj"

    @property
    def down(self) -> str:
        return f"{self.path}.experts.down_proj"

    @property
    def router(self) -> str:
        return f"{self.path}.router.gate.weight"

    @property
    def hf_router(self) -> str:
        return f"{self.path}.gate.weight"

    @property
    def stale_router(self) -> str:
        return f"{self.path}.gate.gate.weight"


def read_layers(f: RankFile) -> list[EPLayer]:
    """The AutoEP layers of a model-states file, each checked; placements other than DeepSpeed's uniform
    contiguous one (expert_placement of 0.19.8 #8544: non-uniform, non-contiguous, replicated) refused."""
    entries = autoep_entries(f.obj)
    if not isinstance(entries, list) or not entries:
        raise f.fail("holds no AutoEP layer list (ds_autoep_layers)")
    layers = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise f.fail(f"ds_autoep_layers[{i}] is a {type(entry).__name__}, not a dict")
        path, n, local, ep = (entry.get(k) for k in ("module_path", "num_experts", "num_local_experts", "ep_size"))
        counts = [v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0 for v in (n, local, ep)]
        if not isinstance(path, str) or not all(counts) or counts[0] != counts[1] * counts[2]:
            raise f.fail(f"ds_autoep_layers[{i}] says module_path {short(path)}, num_experts {short(n)}, "
                         f"num_local_experts {short(local)}, ep_size {short(ep)}: not N = local x ep")  # fmt: skip
        num, size = counts[0], counts[2]
        if entry.get("moe_layer_id", i) != i:
            raise f.fail(f"ds_autoep_layers[{i}] has moe_layer_id {short(entry.get('moe_layer_id'))}")
        _check_placement(f, i, entry.get("expert_placement"), num, size)
        layers.append(EPLayer(i, path, num, size))
    if len({layer.ep for layer in layers}) != 1:
        raise f.fail(f"AutoEP layers of several ep sizes {sorted({la.ep for la in layers})}: DeepSpeed saves one")
    return layers


def _check_placement(f: RankFile, i: int, placement: Any, n: int, ep: int) -> None:
    if placement is None:  # saves before expert_placement (#8544): DeepSpeed's uniform placement
        return
    want = [{"rank": e, "experts": list(range(e * n // ep, (e + 1) * n // ep))} for e in range(ep)]
    if not isinstance(placement, dict) or placement.get("version") != 1:
        raise UnsupportedCheckpointError(f"{f.path}: AutoEP expert_placement of layer {i} is of an unknown version "
                                         f"({short(placement, 60)}); this ckpttools reads version 1")  # fmt: skip
    ranks = [{"rank": r.get("rank"), "experts": list(r.get("experts") or [])} for r in placement.get("ranks") or []
             if isinstance(r, dict)]  # fmt: skip
    if ranks != want or placement.get("num_experts") != n or placement.get("ep_size") != ep:
        raise UnsupportedCheckpointError(
            f"{f.path}: AutoEP layer {i} places its experts {short(ranks, 120)}; only DeepSpeed's uniform, "
            f"contiguous placement ({want}) is read so far (non-uniform or replicated placements: not supported)"
        )


def expert_dp_ranks(ep_rank: int, ep: int, dp: int, data_before_expert: bool) -> list[int]:
    """The DP ranks holding EP rank `ep_rank`'s experts in expert-DP rank order (DeepSpeed's groups)."""
    edp = dp // ep
    if data_before_expert:
        return [ep_rank * edp + d for d in range(edp)]
    return [ep_rank + d * ep for d in range(edp)]


# --- ZeRO-1/2 ----------------------------------------------------------------------------------------------------


def read_autoep(loc: CheckpointLocation) -> Checkpoint:
    """Read a located AutoEP tag folder (ZeRO-1/2 or 3): every expert under its Hugging Face name.

    Raises:
        CheckpointNotFoundError: a missing expert file or rank file.
        CorruptCheckpointError: files that disagree (expert ids, shapes, partition arithmetic, ranks).
        UnsupportedCheckpointError: placements other than uniform, tensor parallel (folded AutoEP + AutoTP).
    """
    names = list(loc.files.names) or sorted(p.name for p in loc.tag_dir.iterdir())
    if loc.files.zero3_layout:
        return read_autoep_zero3(loc)
    model_name, expert_names = _classify(loc, names)
    model0 = RankFile(loc.tag_dir / model_name, load_pickle(loc.tag_dir / model_name), "model-states")
    require_keys(model0, model0.obj, MODEL_KEYS, "DeepSpeed model-states file")
    _refuse_model_parallel(model0)
    layers = read_layers(model0)
    dp = dp_size_of(model0)
    optims = load_rank_files(loc, loc.files.optim_files, "*_optim_states.pt", dp)
    stage = _zero12_stage(loc, optims)
    experts = _load_expert_files(loc, expert_names, layers)
    with RecordReader() as reader:
        for key in ("ds_config", "ds_version"):
            check_agree([model0, optims[0]], [model0.obj.get(key), optims[0].obj.get(key)], key, reader)
        ckpt = _AutoEPReader(loc, model0, optims, dp, stage, reader, layers, experts).read()
        reader.finish()
    return ckpt


def _classify(loc: CheckpointLocation, names: Sequence[str]) -> tuple[str, dict[tuple[int, int], str]]:
    experts: dict[tuple[int, int], str] = {}
    for name in names:
        if m := EXPERT_RE.match(name):
            if m["layer"] is None or int(m["mp"]) != 0:
                raise UnsupportedCheckpointError(f"{loc.tag_dir / name}: an AutoEP expert file of an unknown form")
            experts[(int(m["layer"]), int(m["expert"]))] = name
    plain = [n for n in names if MODEL_RE.match(n)]
    if plain != ["mp_rank_00_model_states.pt"]:
        raise (CheckpointNotFoundError if not plain else UnsupportedCheckpointError)(
            f"{loc.tag_dir}: expected one mp_rank_00_model_states.pt beside the AutoEP expert files, found "
            f"{', '.join(plain) or 'none'} (AutoEP folded with AutoTP is not supported)"
        )
    return plain[0], experts


def _refuse_model_parallel(f: RankFile) -> None:
    mp = f.obj.get("mp_world_size")
    if not is_int(mp) or mp != 1:
        raise UnsupportedCheckpointError(f"{f.path}: AutoEP with model parallel size {short(mp, 20)} is not supported")
    dims = f.opt(f.obj, "checkpoint_parallel_dimensions", dict) or {}
    if dims.get("pp_degree", 1) != 1 or dims.get("tp_degree", 1) != 1:
        raise UnsupportedCheckpointError(f"{f.path}: AutoEP with pipeline/tensor parallel degrees {dims}")
    if dict_at(f.obj, "ds_config", "zero_optimization", "offload_optimizer").get("device") == "nvme":
        raise UnsupportedCheckpointError(f"{f.path}: the optimizer state was offloaded to NVMe")


def _zero12_stage(loc: CheckpointLocation, optims: Sequence[RankFile]) -> int:
    stages = set()
    for f in optims:
        osd = f.get(f.obj, "optimizer_state_dict", dict)
        if "zero_stage" not in osd:
            raise UnsupportedCheckpointError(f"{f.path}: AutoEP with DeepSpeed's BF16_Optimizer is not supported")
        require_keys(f, osd, OPTIM_KEYS["zero"], "ZeRO optimizer file of its kind")
        if isinstance(osd.get("base_optimizer_state"), list):
            raise UnsupportedCheckpointError(f"{f.path}: elastic AutoEP checkpoints are not supported")
        stages.add(zero_stage_of(f, osd))
    if len(stages) != 1 or stages & {0, 3}:
        raise CorruptCheckpointError(f"{loc.tag_dir}: the optimizer files say ZeRO stage {sorted(stages)}, the "
                                     "file names ZeRO-1/2")  # fmt: skip
    return stages.pop()


def _load_expert_files(
    loc: CheckpointLocation, names: Mapping[tuple[int, int], str], layers: Sequence[EPLayer]
) -> dict[tuple[int, int], RankFile]:
    want = {(la.index, e) for la in layers for e in range(la.num_experts)}
    missing = sorted(want - set(names))
    if missing:
        layer, e = missing[0]
        raise CheckpointNotFoundError(
            f"{loc.tag_dir}: the weights of AutoEP layer {layer} expert {e} (layer_{layer}_expert_{e}_mp_rank_00_"
            f"model_states.pt) are missing ({len(missing)} of {len(want)} expert files); the save was interrupted "
            "or the folder copied in part; re-copy it"
        )
    extra = sorted(set(names) - want)
    if extra:
        raise CorruptCheckpointError(f"{loc.tag_dir}: {names[extra[0]]} is no expert of this run's AutoEP layers; "
                                     "remove the stray file (left over from another run?)")  # fmt: skip
    return {
        k: RankFile(loc.tag_dir / n, load_pickle(loc.tag_dir / n), "AutoEP expert") for k, n in sorted(names.items())
    }


class _AutoEPReader(Zero12Reader):
    """ZeRO-1/2: dense groups over every rank, the `ep_size_K` group per EP rank over its expert-DP group."""

    def __init__(self, loc: CheckpointLocation, model0: RankFile, optims: list[RankFile], dp: int, stage: int,
                 reader: RecordReader, layers: list[EPLayer], experts: dict[tuple[int, int], RankFile]
                 ) -> None:  # fmt: skip
        super().__init__(loc, model0, optims, dp, stage, reader)
        self.layers, self.experts = layers, experts
        self.ep = layers[0].ep
        self.dbe = bool(dict_at(model0.obj, "ds_config").get("use_data_before_expert_parallelism"))
        self.local_shapes: dict[str, tuple[int, ...]] = {}

    def read(self) -> Checkpoint:
        f0 = self.model0
        mod, stale = without_stale_routers(f0, read_module(f0), self.layers)
        groups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, groups)
        moe = self._moe_groups(groups)
        self._check_counts(moe)
        states = [self._rank_states(f, o, len(groups), False) for f, o in zip(self.optims, self.osds, strict=True)]
        same_keys_everywhere(self.optims[0], [flat_state_keys(s) for s in states[0]], "param group")
        dense: list[Param] = []
        per_ep: list[dict[str, Param]] = [{} for _ in range(self.ep)]
        for g, shapes in enumerate(groups):
            if g not in moe:
                dense += self._group_params(g, shapes, states)
                continue
            for e in range(self.ep):
                ranks = expert_dp_ranks(e, self.ep, self.dp, self.dbe)
                view = Zero12Reader(self.loc, f0, [self.optims[r] for r in ranks], len(ranks), self.stage,
                                    self.reader)  # fmt: skip
                per_ep[e].update({p.name: p for p in view._group_params(g, shapes, [states[r] for r in ranks])})
        by_name = {p.name: p for p in dense}
        bit16 = zero12_bit16(f0, mod, by_name)
        frozen = {n: s for n, s in bit16.items() if n not in by_name}
        check_module_keys(f0, mod, by_name, frozen)
        experts = [hf_expert_params(layer, per_ep, f0) for layer in self.layers]
        expert_bit16 = {s.name: s for layer in self.layers for s in self._expert_bit16(layer)}
        replicas = [Replica(f"{name} (module copy of {owner})", bit16[owner], src) for name, owner, src in stale]
        dense = [_renamed(p, hf_name(p.name, self.layers)) for p in dense]
        bit16 = {
            hf_name(n, self.layers): dataclasses.replace(s, name=hf_name(n, self.layers)) for n, s in bit16.items()
        }
        return Checkpoint(
            location=self.loc,
            zero_stage=self.stage,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=hf_keys(f0, mod.keys, self.layers),
            params=sorted(dense + [p for pair in experts for p in pair], key=lambda p: p.group),
            optimizer=self._optimizer_state(states, False),
            bit16={**bit16, **expert_bit16},
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=False,
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[f0.obj],
            layout_files=[f.path.name for _, f in sorted(self.experts.items())],
            layout=ParallelLayout(
                "autoep", dp=self.dp, ep=self.ep, details=layout_details(self.layers, self.dp, self.dbe)
            ),
            replicas=replicas,
        )

    def _details(self) -> dict[str, Any]:
        return layout_details(self.layers, self.dp, self.dbe)

    def _moe_groups(self, groups: list[list[tuple[str, tuple[int, ...]]]]) -> set[int]:
        """The param groups of the experts: marked moe, named ep_size_K, holding every layer's w1/w2/w3."""
        f = self.optims[0]
        pgs = f.get(self.osds[0]["base_optimizer_state"], "param_groups", list, "base_optimizer_state.")
        if len(pgs) != len(groups):
            raise f.fail(f"the optimizer has {len(pgs)} param groups, param_shapes {len(groups)}")
        grouped = {la.grouped(w): la for la in self.layers for w in GROUPED}
        moe, seen = set(), set()
        for g, (pg, shapes) in enumerate(zip(pgs, groups, strict=True)):
            names = [strip_prefixes(n) for n, _ in shapes]
            if not (isinstance(pg, dict) and pg.get("moe")):
                if any(n in grouped for n in names):
                    raise f.fail(f"param group {g} holds AutoEP expert tensors but is not marked moe")
                continue
            m = EP_GROUP_RE.match(str(pg.get("name")))
            if not m or int(m["ep"]) != self.ep or not all(n in grouped for n in names):
                raise f.fail(f"param group {g} ({short(pg.get('name'), 30)}) is marked moe but is not the "
                             f"ep_size_{self.ep} group of AutoEP's expert tensors")  # fmt: skip
            for (_, shape), n in zip(shapes, names, strict=True):
                self.local_shapes[n] = tuple(shape)
            moe.add(g)
            seen.update(names)
        if set(grouped) - seen:
            raise f.fail(f"param_shapes lacks the AutoEP expert tensor {min(set(grouped) - seen)}")
        for layer in self.layers:
            check_grouped_shapes(f, layer, {w: self.local_shapes[layer.grouped(w)] for w in GROUPED})
        return moe

    def _check_counts(self, moe: set[int]) -> None:
        edp = self.dp // self.ep
        if self.dp % self.ep:
            raise self.model0.fail(f"dp_world_size {self.dp} is not a multiple of the AutoEP ep_size {self.ep}")
        for f, osd in zip(self.optims, self.osds, strict=True):
            counts = osd.get("partition_count")
            want = [edp if g in moe else self.dp for g in range(len(counts or []))]
            if not isinstance(counts, list) or counts != want:
                raise CorruptCheckpointError(
                    f"{f.path} was written for partition counts {short(counts, 40)}; DP {self.dp} at ep_size "
                    f"{self.ep} gives {want}: files from different runs are mixed"
                )

    def _expert_bit16(self, layer: EPLayer) -> list[TensorSource]:
        """gate_up_proj and down_proj of the 16-bit module from the per-expert files (w1, w3 / w2 of expert E)."""
        tensors: dict[str, _Rows] = {}
        for e in range(layer.num_experts):
            f = self.experts[(layer.index, e)]
            want = {f"{layer.grouped(w)}.{e}" for w in GROUPED}
            got = {strip_prefixes(k) for k in f.obj if isinstance(k, str)}
            if got != want or len(f.obj) != len(want):
                raise f.fail(f"holds {short(sorted(map(str, f.obj)), 120)}, not the w1/w2/w3 of expert {e} of "
                             f"{layer.path}: expert files swapped or renamed")  # fmt: skip
            for raw, value in f.obj.items():
                name = strip_prefixes(raw)
                w = name.rsplit(".", 2)[-2]
                t = f.tensor(value, f"expert tensor {name}")
                shape = self.local_shapes[layer.grouped(w)][1:]
                if tuple(t.shape) != shape:
                    raise f.fail(f"{name} has shape {list(t.shape)}, the layer's experts {list(shape)}")
                src = TensorSource(name, shape, t.dtype, (Segment(t, 0, t.numel()),), "trainable")
                tensors[name] = _Rows(src, 0, t.numel(), shape)
        return expert_sources(layer, lambda w, e: tensors[f"{layer.grouped(w)}.{e}"], "trainable")


def check_grouped_shapes(f: RankFile, layer: EPLayer, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """w1 and w3 [num_local, F, H], w2 [num_local, H, F]: what ep_repack makes of gate_up_proj / down_proj."""
    w1 = shapes["w1"]
    if len(w1) != 3 or w1[0] != layer.num_local or shapes["w3"] != w1 or shapes["w2"] != (w1[0], w1[2], w1[1]):
        raise f.fail(f"the grouped experts of {layer.path} have shapes {dict(shapes)}; {layer.num_local} local "
                     "experts give w1 = w3 = [local, ffn, hidden], w2 = [local, hidden, ffn]")  # fmt: skip


def hf_expert_params(layer: EPLayer, per_ep: Sequence[Mapping[str, Param]], f0: RankFile) -> tuple[Param, Param]:
    """A layer's gate_up_proj and down_proj as params: fp32 masters and every optimizer state cut from each EP
    rank's grouped w1/w2/w3 (expert-local row blocks), experts in global order."""
    params = []
    for e, ranks in enumerate(per_ep):
        for w in GROUPED:
            if layer.grouped(w) not in ranks:
                raise f0.fail(f"EP rank {e} holds no {layer.grouped(w)}")
    first = per_ep[0][layer.grouped("w1")]
    keys = list(first.states)

    def source(which: str | None, hf: str) -> TensorSource:
        def tensor_of(w: str, e: int) -> _Rows:
            p = per_ep[e // layer.num_local][layer.grouped(w)]
            src = p.fp32 if which is None else p.states[which]
            per = src.numel() // layer.num_local
            return _Rows(src, (e % layer.num_local) * per, per, tuple(src.shape[1:]))

        srcs = expert_sources(layer, tensor_of, "trainable" if which is None else "state")
        return next(s for s in srcs if s.name == hf)

    for hf, group_of in ((layer.gate_up, "w1"), (layer.down, "w2")):
        fp32 = source(None, hf)
        states = {k: source(k, hf) for k in keys}
        params.append(Param(hf, hf, fp32.shape, per_ep[0][layer.grouped(group_of)].group, 0, fp32, states))
    return params[0], params[1]


@dataclass(frozen=True)
class _Rows:
    """Elements [start, start + count) of a flat source: one expert's block of a grouped tensor."""

    src: TensorSource
    start: int
    count: int
    shape: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return self.src.dtype

    def segments(self) -> list[Segment]:
        return list(slice_segments(self.src, self.start, self.count))


def expert_sources(layer: EPLayer, rows_of: Any, kind: str) -> list[TensorSource]:
    """gate_up_proj [N, 2F, H] (expert by expert: its w1 rows, then its w3 rows) and down_proj [N, H, F] from
    each expert's block of w1/w2/w3 (`rows_of(w, expert)` -> _Rows), experts in global order."""
    gate_up: list[Segment] = []
    down: list[Segment] = []
    for e in range(layer.num_experts):
        gate_up += rows_of("w1", e).segments() + rows_of("w3", e).segments()
        down += rows_of("w2", e).segments()
    w1, w2 = rows_of("w1", 0), rows_of("w2", 0)
    f, h = w1.shape
    return [
        TensorSource(layer.gate_up, (layer.num_experts, 2 * f, h), w1.dtype, tuple(gate_up), kind),
        TensorSource(layer.down, (layer.num_experts, *w2.shape), w2.dtype, tuple(down), kind),
    ]


def without_stale_routers(
    f: RankFile, mod: ModuleEntries, layers: Sequence[EPLayer]
) -> tuple[ModuleEntries, list[tuple[str, str, TensorSource]]]:
    """The module without AutoEP's second entry of each router (`<layer>.gate.gate.weight`, the replaced
    block's gate module, which shares the router's parameter), and those entries as (name, owner, source)."""
    stale = []
    for layer in layers:
        name = layer.stale_router
        if name in mod.tensors:
            t = f.tensor(mod.tensors[name], f"module entry {name}")
            stale.append((name, layer.router, TensorSource(name, t.shape, t.dtype, (Segment(t, 0, t.numel()),),
                                                           "trainable")))  # fmt: skip
    drop = {name for name, _, _ in stale}
    keys = [k for k in mod.keys if k not in drop]
    tensors = {k: v for k, v in mod.tensors.items() if k not in drop}
    return dataclasses.replace(mod, keys=keys, tensors=tensors), stale


def hf_name(name: str, layers: Sequence[EPLayer]) -> str:
    """A dense name as transformers names it: the AutoEP router is the MoE block's `gate`."""
    for layer in layers:
        if name == layer.router:
            return layer.hf_router
    return name


def hf_keys(f: RankFile, keys: Sequence[str], layers: Sequence[EPLayer]) -> list[str]:
    """The module's order under HF names, each layer's gate_up_proj and down_proj right after its gate."""
    out = []
    routers = {layer.router: layer for layer in layers}
    for k in keys:
        out.append(hf_name(k, layers))
        if k in routers:
            out += [routers[k].gate_up, routers[k].down]
    missing = [la.router for la in layers if la.router not in keys]
    if missing:
        raise f.fail(f"the module holds no router {missing[0]} of an AutoEP layer")
    return out


def layout_details(layers: Sequence[EPLayer], dp: int, dbe: bool) -> dict[str, Any]:
    return {
        "autoep_layers": [la.path for la in layers],
        "num_experts": [la.num_experts for la in layers],
        "ep_size": layers[0].ep,
        "expert_dp": dp // layers[0].ep,
        "topology": "data_before_expert" if dbe else "expert_before_data",
    }


def _named(s: TensorSource, name: str) -> TensorSource:
    return s if s.name == name else dataclasses.replace(s, name=name)


def _renamed(p: Param, name: str) -> Param:
    if name == p.name:
        return p
    states = {k: dataclasses.replace(s, name=name) for k, s in p.states.items()}
    return dataclasses.replace(p, name=name, fp32=dataclasses.replace(p.fp32, name=name), states=states)


# --- ZeRO-3 -------------------------------------------------------------------------------------------------------
#
# Every rank writes zero_pp_rank_{r}_mp_rank_00_model_states.pt (its ds_autoep_layers name its EP rank) and its
# optimizer file; `ds_zero_partition_groups` says per sub-group which ranks partition it: the dense sub-group all
# DP ranks, the experts' sub-group (family `autoep_expert`) the expert-DP group of the rank's EP rank.


def read_autoep_zero3(loc: CheckpointLocation) -> Checkpoint:
    """An AutoEP ZeRO-3 tag folder: each EP rank's expert sub-group read over its expert-DP group."""
    first = loc.tag_dir / loc.files.model_files[min(loc.files.model_files)]
    dp = dp_size_of(RankFile(first, load_pickle(first), "model-states"))
    models = load_rank_files(loc, loc.files.model_files, "*_model_states.pt", dp)
    for m in models:
        require_keys(m, m.obj, MODEL_KEYS, "DeepSpeed model-states file")
        _refuse_model_parallel(m)
    layers = read_layers(models[0])
    optims = load_rank_files(loc, loc.files.optim_files, "*_optim_states.pt", dp)
    for f in optims:
        osd = f.get(f.obj, "optimizer_state_dict", dict)
        require_keys(f, osd, OPTIM_KEYS["zero3"], "ZeRO-3 optimizer file")
        if zero_stage_of(f, osd) != 3:
            raise CorruptCheckpointError(f"{f.path}: not a ZeRO-3 optimizer file beside ZeRO-3 model-states files")
    with RecordReader() as reader:
        check_agree([models[0], optims[0]], [models[0].obj.get("ds_version"), optims[0].obj.get("ds_version")],
                    "ds_version", reader)  # fmt: skip
        ckpt = _AutoEPZero3Reader(loc, models, optims, dp, reader, layers).read()
        reader.finish()
    return ckpt


class _AutoEPZero3Reader(_Zero3Reader):
    def __init__(self, loc: CheckpointLocation, models: list[RankFile], optims: list[RankFile], dp: int,
                 reader: RecordReader, layers: list[EPLayer]) -> None:  # fmt: skip
        super().__init__(loc, models, optims, dp, reader)
        self.layers = layers
        self.ep = layers[0].ep
        self.dbe = bool(dict_at(models[0].obj, "ds_config").get("use_data_before_expert_parallelism"))

    def read(self) -> Checkpoint:
        f0 = self.models[0]
        mod, _ = without_stale_routers(f0, read_module(f0), self.layers)  # ZeRO-3 module entries are empty
        self._check_ep_ranks()
        self._check_ranks_agree()
        subgroups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, subgroups)
        group_of, scalars, common = zero3_optimizer_parts(self.optims[0], self.osds[0], len(subgroups))
        families = self._families(len(subgroups))
        dense: list[Param] = []
        per_ep: list[dict[str, Param]] = [{} for _ in range(self.ep)]
        grouped = {la.grouped(w) for la in self.layers for w in GROUPED}
        for sg, shapes in enumerate(subgroups):
            names = {strip_prefixes(n) for n, _ in shapes}
            if families[sg] != "autoep_expert":
                if names & grouped:
                    raise f0.fail(f"sub-group {sg} holds AutoEP expert tensors but is partitioned as {families[sg]}")
                dense += self._subgroup_params(sg, shapes, group_of[sg])
                continue
            for e in range(self.ep):
                ranks = expert_dp_ranks(e, self.ep, self.dp, self.dbe)
                view = _Zero3Reader(self.loc, [self.models[r] for r in ranks], [self.optims[r] for r in ranks],
                                    len(ranks), self.reader)  # fmt: skip
                per_ep[e].update({p.name: p for p in view._subgroup_params(sg, shapes, group_of[sg])})
        missing = grouped - set(per_ep[0])
        if missing:
            raise f0.fail(f"param_shapes lacks the AutoEP expert tensor {min(missing)}")
        for layer in self.layers:
            check_grouped_shapes(f0, layer, {w: per_ep[0][layer.grouped(w)].shape for w in GROUPED})
        by_name = {p.name: p for p in dense}
        check_module_keys(f0, mod, by_name, {})
        experts = [p for layer in self.layers for p in hf_expert_params(layer, per_ep, f0)]
        dense = [_renamed(p, hf_name(p.name, self.layers)) for p in dense]
        return Checkpoint(
            location=self.loc,
            zero_stage=3,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=hf_keys(f0, mod.keys, self.layers),
            params=sorted(dense + experts, key=lambda p: p.group),
            optimizer=OptimizerState(scalars, common, file_meta(self.optims[0])),
            bit16={},
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=False,
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[m.obj for m in self.models],
            layout=ParallelLayout("autoep", dp=self.dp, ep=self.ep, details=layout_details(self.layers, self.dp,
                                                                                           self.dbe)),
        )  # fmt: skip

    def _check_ep_ranks(self) -> None:
        """Each rank's ds_autoep_layers name the EP and expert-DP rank DeepSpeed's groups give it."""
        for r, m in enumerate(self.models):
            entries = autoep_entries(m.obj)
            if not isinstance(entries, list) or len(entries) != len(self.layers):
                raise m.fail(f"lists {short(entries, 40)} AutoEP layers, rank 0 {len(self.layers)}")
            for layer, entry in zip(self.layers, entries, strict=True):
                e = next(e for e in range(self.ep) if r in expert_dp_ranks(e, self.ep, self.dp, self.dbe))
                edp = expert_dp_ranks(e, self.ep, self.dp, self.dbe).index(r)
                got = (entry.get("module_path"), entry.get("ep_rank"), entry.get("expert_data_parallel_rank"))
                if got != (layer.path, e, edp):
                    raise m.fail(f"says AutoEP layer {short(got[0])} is at EP rank {short(got[1])}, expert-DP rank "
                                 f"{short(got[2])}; rank {r} of DP {self.dp} at ep_size {self.ep} is {e}, {edp}: "
                                 "files swapped or renamed")  # fmt: skip
                fmt = entry.get("checkpoint_format")
                if fmt != "zero3_partitioned":
                    raise UnsupportedCheckpointError(f"{m.path}: AutoEP ZeRO-3 expert state format {short(fmt)}")

    def _families(self, num_subgroups: int) -> list[str]:
        """Per sub-group: its partition family, checked against the ranks DeepSpeed's groups give it."""
        out: list[str] = []
        for r, (f, osd) in enumerate(zip(self.optims, self.osds, strict=True)):
            groups = f.get(osd, "ds_zero_partition_groups", list)
            if len(groups) != num_subgroups:
                raise f.fail(f"ds_zero_partition_groups lists {len(groups)} sub-groups, param_shapes {num_subgroups}")
            fams = []
            for sg, g in enumerate(groups):
                fam = (g.get("families") or [None])[0] if isinstance(g, dict) else None
                if fam == "autoep_expert":
                    e = next(e for e in range(self.ep) if r in expert_dp_ranks(e, self.ep, self.dp, self.dbe))
                    want = expert_dp_ranks(e, self.ep, self.dp, self.dbe)
                elif fam == "replicated":
                    want = list(range(self.dp))
                else:
                    raise UnsupportedCheckpointError(f"{f.path}: ZeRO-3 partition family {short(fam)} of sub-group "
                                                     f"{sg} is not supported")  # fmt: skip
                if g.get("partition_ranks") != want or g.get("partition_rank") != want.index(r):
                    raise f.fail(f"sub-group {sg} ({fam}) is partitioned over ranks {short(g.get('partition_ranks'))} "
                                 f"as rank {short(g.get('partition_rank'))}; DeepSpeed's groups give {want}: files "
                                 "swapped, renamed or from another topology")  # fmt: skip
                fams.append(fam)
            if out and fams != out:
                raise f.fail(f"partition families {fams}, rank 0 {out}")
            out = fams
        return out

    def _check_ranks_agree(self) -> None:
        """The ZeRO-3 checks but for the per-rank partition groups (checked by _families)."""
        full = self.osds
        self.osds = [{k: v for k, v in o.items() if k != "ds_zero_partition_groups"} for o in full]
        try:
            super()._check_ranks_agree()
        finally:
            self.osds = full


# --- the plug-in -------------------------------------------------------------------------------------------------


def check_autoep_reshard(ckpt: Checkpoint, target: ReshardTarget) -> None:
    """What reshard cannot write for an AutoEP checkpoint, refused before anything is written."""
    what = f"{ckpt.location.tag_dir} is a DeepSpeed AutoEP checkpoint ({ckpt.layout.describe()})"
    if target.universal:
        return
    if target.stage != ckpt.zero_stage:
        raise UnsupportedCheckpointError(f"{what}; --stage is refused: reshard AutoEP with --dp M at its own stage")
    ep = int(ckpt.layout.details.get("ep_size") or 1)
    if target.dp is not None and target.dp % ep:
        raise UnsupportedCheckpointError(
            f"{what}; DP {target.dp} is not a multiple of the AutoEP ep_size {ep}: DeepSpeed needs dp = ep x expert-DP"
        )


def autoep_rank_files(ckpt: Checkpoint, dp: int, stage: int) -> dict[str, Any]:
    """Relative path -> object: a ZeRO-1/2 AutoEP checkpoint at `dp` ranks, same ep size. Only the optimizer files
    change: dense groups re-cut over every rank, the expert group of each EP rank (its grouped w1/w2/w3, cut back
    out of gate_up_proj/down_proj) over its new expert-DP group; the module file gets the new dp_world_size, the
    expert files come along (their records CRC-checked on the way)."""

    check_autoep_reshard(ckpt, ReshardTarget(dp, stage))
    details = ckpt.layout.details
    ep = int(details["ep_size"])
    dbe = details.get("topology") == "data_before_expert"
    layers = _layers_of(ckpt)
    opt = ckpt.optimizer
    common = {k: v for k, v in opt.common.items() if k != "param_groups"}
    osds = [{**common, "single_partition_of_fp32_groups": [], "group_paddings": [], "param_slice_mappings": [],
             "partition_count": [], "base_optimizer_state": {"state": {}, "param_groups": opt.param_groups}}
            for _ in range(dp)]  # fmt: skip
    by_name = {p.name: p for p in ckpt.params}
    expert_names = {name for la in layers for name in (la.gate_up, la.down)}
    for g in sorted({p.group for p in ckpt.params}):
        members = [p for p in ckpt.params if p.group == g]
        if not any(p.name in expert_names for p in members):
            append_partitions(g, members, osds, opt.group_scalars)
            continue
        for e in range(ep):
            local = [native_expert_param(la, by_name, e, w) for la in layers for w in GROUPED]
            append_partitions(g, local, [osds[r] for r in expert_dp_ranks(e, ep, dp, dbe)], opt.group_scalars)
    prefix = ckpt.location.files.optim_prefix
    files: dict[str, Any] = {
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt": {"optimizer_state_dict": osd, **opt.file_meta}
        for r, osd in enumerate(osds)
    }
    files["mp_rank_00_model_states.pt"] = {**ckpt.model_files[0], "dp_world_size": dp}
    for name in ckpt.layout_files:
        files[name] = load_pickle(ckpt.location.tag_dir / name)
    return files


def autoep_zero3_rank_files(ckpt: Checkpoint, dp: int) -> dict[str, Any]:
    """Relative path -> object: a ZeRO-3 AutoEP checkpoint at `dp` ranks, same ep size: the dense sub-group cut
    over every rank, the expert sub-group of each EP rank (its grouped w1/w2/w3) over its new expert-DP group;
    each rank's `ds_zero_partition_groups` and `ds_autoep_layers` say which (DeepSpeed checks both on load)."""
    from ckpttools.layouts.zero.pieces import group_keys, master_partition, new_tensor
    from ckpttools.layouts.zero.write import _Flats, _own_copy, _rank_pieces

    details = ckpt.layout.details
    ep = int(details["ep_size"])
    dbe = details.get("topology") == "data_before_expert"
    layers = _layers_of(ckpt)
    opt = ckpt.optimizer
    groups = opt.param_groups or []
    by_name = {p.name: p for p in ckpt.params}
    hf_experts = {name for la in layers for name in (la.gate_up, la.down)}
    dense = [p for p in ckpt.params if p.name not in hf_experts]
    expert_group = next(p.group for p in ckpt.params if p.name in hf_experts)
    if len(groups) != 2 or {p.group for p in dense} != {1 - expert_group}:
        raise UnsupportedCheckpointError(f"{ckpt.location.tag_dir}: AutoEP ZeRO-3 with {len(groups)} param groups "
                                         "is not resharded (one dense and one expert group are)")  # fmt: skip
    local = [[native_expert_param(la, by_name, e, w) for la in layers for w in GROUPED] for e in range(ep)]
    saved = {int(entries[0]["ep_rank"]): m for m in ckpt.model_files if (entries := autoep_entries(m))}
    common = {k: v for k, v in opt.common.items() if k not in ("param_groups", "ds_zero_partition_groups")}
    param_groups = [{**pg, "params": [g]} for g, pg in enumerate(groups)]
    flats = _Flats()
    files: dict[str, Any] = {}
    for r in range(dp):
        e = next(e for e in range(ep) if r in expert_dp_ranks(e, ep, dp, dbe))
        peers = expert_dp_ranks(e, ep, dp, dbe)
        members = {expert_group: (local[e], len(peers), peers.index(r)), 1 - expert_group: (dense, dp, r)}
        flat, state, partition_groups = [], {}, []
        for sg in range(2):
            params, count, pos = members[sg]
            keys = group_keys(params)
            flat.append(master_partition(_rank_pieces(params, MASTER, count, pos, flats)))
            entry = {k: _own_copy(v) for k, v in opt.group_scalars[sg].items()}
            for k in keys:
                entry[k] = new_tensor(params[0].states[k].dtype, _rank_pieces(params, k, count, pos, flats))
            if entry:
                state[sg] = entry
            family = "autoep_expert" if sg == expert_group else "replicated"
            partition_groups.append({
                "sub_group": sg, "partition_count": count, "partition_rank": pos,
                "partition_ranks": peers if sg == expert_group else list(range(dp)),
                "families": [family], "group_names": [f"ep_size_{ep}" if sg == expert_group else "replicated"],
            })  # fmt: skip
        inner = {"state": state, "param_groups": param_groups}
        osd = {**common, "partition_count": dp, "ds_zero_partition_groups": partition_groups,
               "fp32_flat_groups": flat, "optimizer_state_dict": inner}  # fmt: skip
        files[f"{ckpt.location.files.optim_prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = {
            **opt.file_meta, "optimizer_state_dict": osd}  # fmt: skip
        model = saved[e]
        entries = [{**entry, "expert_data_parallel_rank": peers.index(r), "expert_data_parallel_world_size": len(peers)}
                   for entry in autoep_entries(model)]  # fmt: skip
        info = {**(model.get("universal_checkpoint_info") or {}), "ds_autoep_layers": entries}
        files[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = {
            **model, "dp_world_size": dp, "ds_autoep_layers": entries, "universal_checkpoint_info": info,
            "shared_params": model.get("shared_params") if r == 0 else {}}  # fmt: skip
    return files


def autoep_universal_files(ckpt: Checkpoint) -> dict[str, Any]:
    """Relative path -> object: the universal tag folder of an AutoEP checkpoint, as DeepSpeed's ds_to_universal
    writes it: one folder per engine parameter, each layer's grouped w1/w2/w3 whole ([N, ...], every expert, marked
    `is_expert_param`); ZeRO-1/2: the module file with the AutoEP facts its universal loader reads, ZeRO-3: every
    rank's model-states file as saved."""
    check_autoep_reshard(ckpt, ReshardTarget(None, ckpt.zero_stage))
    if ckpt.optimizer.param_groups is None:
        raise UnsupportedCheckpointError(f"{ckpt.location.tag_dir}: elastic AutoEP checkpoints have no universal form")
    layers = _layers_of(ckpt)
    by_name = {p.name: p for p in ckpt.params}
    hf_experts = {name for la in layers for name in (la.gate_up, la.down)}
    params = [p for p in ckpt.params if p.name not in hf_experts]
    params += [native_expert_param(la, by_name, None, w) for la in layers for w in GROUPED]
    experts = {la.grouped(w): la.num_experts for la in layers for w in GROUPED}

    def state_file(p: Param, src: TensorSource) -> dict[str, Any]:
        out = {"param": whole_tensor(src, p.shape), "cat_dim": 0, NAME_KEY: p.file_name}
        if p.file_name in experts:
            out.update({"is_expert_param": True, "ep_num_experts": experts[p.file_name]})
        return out

    opt = ckpt.optimizer
    files = param_files(params, opt.group_scalars, state_file)
    common = dict(opt.common)
    files["zero/optimizer_state.pt"] = common
    if ckpt.zero_stage == 3:  # as ds_to_universal: every rank's model states as saved, the step by sub-group
        groups = opt.param_groups or []
        state = {
            int(pg["params"][0]): dict(opt.group_scalars[g]) for g, pg in enumerate(groups) if opt.group_scalars[g]
        }
        common["optimizer_state_dict"] = {"state": state, "param_groups": groups}
        for r, model_state in enumerate(ckpt.model_files):
            files[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = model_state
        return files
    model = ckpt.model_files[0]
    info = dict(model.get("universal_checkpoint_info") or {})
    info["expert_parameter_patterns"] = [r"\.experts\.w[123]$"]  # what ds_to_universal writes
    info["ds_autoep_layers"] = [
        {"moe_layer_id": la.index, "module_path": la.path, "expert_key_prefix": f"{la.path}.experts",
         "num_experts": la.num_experts, "num_local_experts": la.num_local, "ep_size": la.ep}
        for la in layers
    ]  # fmt: skip
    files["mp_rank_00_model_states.pt"] = {**model, "universal_checkpoint_info": info}
    return files


def _layers_of(ckpt: Checkpoint) -> list[EPLayer]:
    details = ckpt.layout.details
    ep = int(details["ep_size"])
    paths, counts = details["autoep_layers"], details["num_experts"]
    return [EPLayer(i, path, n, ep) for i, (path, n) in enumerate(zip(paths, counts, strict=True))]


def native_expert_param(layer: EPLayer, by_name: Mapping[str, Param], e: int | None, w: str) -> Param:
    """EP rank e's grouped `w` (w1/w3: [local, F, H], w2: [local, H, F]) cut back out of the layer's HF params;
    e None: every expert's ([N, ...], as DeepSpeed's universal form holds it)."""
    hf = by_name[layer.down if w == "w2" else layer.gate_up]
    n = layer.num_experts
    per = hf.numel // n  # one expert's block: 2FH of gate_up_proj, HF of down_proj
    part = per if w == "w2" else per // 2
    skip = part if w == "w3" else 0
    count = n if e is None else layer.num_local
    experts = range(n) if e is None else range(e * layer.num_local, (e + 1) * layer.num_local)
    shape = (count, *hf.shape[1:]) if w == "w2" else (count, hf.shape[1] // 2, hf.shape[2])

    def cut(src: TensorSource, kind: str) -> TensorSource:
        segs = tuple(seg for x in experts for seg in slice_segments(src, x * per + skip, part))
        return TensorSource(layer.grouped(w), shape, src.dtype, segs, kind)

    fp32 = cut(hf.fp32, "trainable")
    states = {k: cut(v, "state") for k, v in hf.states.items()}
    return Param(layer.grouped(w), layer.grouped(w), shape, hf.group, 0, fp32, states)


class AutoEPLayout:
    """DeepSpeed AutoEP: transformers' MoE blocks replaced by grouped experts spread over expert-parallel ranks."""

    kind = "autoep"
    title = "AutoEP (DeepSpeed expert parallelism for transformers MoE models)"

    def claims(self, names: Sequence[str]) -> bool:
        """Expert files named after AutoEP's grouped tensors cannot be told from DeepSpeed-MoE's by name: the
        folder is claimed when an expert file or the model states say so (a small read of one file)."""
        return False

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_autoep(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        layers = parallel.get("autoep_layers") or []
        experts = parallel.get("num_experts") or []
        per_layer = ", ".join(f"{name} {n}" for name, n in zip(layers, experts, strict=False))
        line = f"experts        {per_layer} (EP {parallel.get('ep')}, expert-DP {parallel.get('expert_dp')}; "
        return [line + "under Hugging Face names: experts.gate_up_proj, experts.down_proj)"]

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_autoep_reshard(ckpt, target)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        return autoep_universal_files(ckpt)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return self.universal_files(ckpt)
        if ckpt.zero_stage == 3:
            check_autoep_reshard(ckpt, target)  # DeepSpeed checks the partition groups: written for the new DP
            return autoep_zero3_rank_files(ckpt, target.dp)
        return autoep_rank_files(ckpt, target.dp, target.stage)


LAYOUT = AutoEPLayout()

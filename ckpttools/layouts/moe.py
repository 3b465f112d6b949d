"""Read a DeepSpeed-MoE (`deepspeed.moe.layer.MoE`, expert parallel) ZeRO-1/2 checkpoint into the one model.

What DeepSpeed 0.19.8 writes (checked on the moe_* fixtures):

- `mp_rank_00_model_states.pt` (DP rank 0): the module WITHOUT expert weights (gates and dense layers stay),
  `num_experts` (one count per MoE layer, in `named_modules` order), `ds_autoep_layers` None, and
  `param_shapes` of DP rank 0: the expert param groups list rank 0's LOCAL experts (`...deepspeed_experts.0/1`).
- `layer_{L}_expert_{E}_mp_rank_00_model_states.pt`: the 16-bit weights of MoE layer L's GLOBAL expert E, under
  keys that already carry the global index, written by the expert-DP rank 0 of the expert-parallel rank that
  holds it (E = ep_rank * num_local_experts + local index).
- `*zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (every DP rank): dense groups partitioned over all DP ranks as
  usual; each group marked `moe: True` (`name: "ep_size_K"`) holds this rank's expert-parallel rank's local
  experts, partitioned over the expert-DP group (`partition_count` DP/K) with the ZeRO-1/2 arithmetic. The
  expert-DP group of EP rank e is ranks e, e+K, e+2K, ... (DeepSpeed's default), or e*DP/K ... (e+1)*DP/K-1
  with `use_data_before_expert_parallelism`.

Every expert param comes out under its global key; the fp32 masters and optimizer states of experts come from the
optimizer files of the ranks that hold them, the 16-bit copies from the expert files.

`moe_rank_files` writes the checkpoint back at another DP size (a multiple of every ep size): only the optimizer
files change (each `moe` group re-cut over the new expert-DP groups); the expert files and the module file come
along, the latter with its new dp_world_size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.layouts.autoep import autoep_entries, read_autoep
from ckpttools.layouts.base import ReshardTarget, no_universal_form
from ckpttools.layouts.locate import EXPERT_OPTIM_RE, EXPERT_RE, MODEL_RE
from ckpttools.layouts.rankfile import (
    MODEL_KEYS,
    OPTIM_KEYS,
    ZERO12_PER_RANK,
    RankFile,
    check_agree,
    check_module_keys,
    check_ties,
    check_unique_names,
    check_unsharded_agree,
    dict_at,
    dp_size_of,
    flat_state_keys,
    is_int,
    load_rank_files,
    param_shapes_of,
    read_module,
    require_keys,
    same_keys_everywhere,
    saved_without_frozen,
    train_dtype_of,
    zero_stage_of,
)
from ckpttools.layouts.zero.read import Zero12Reader, zero12_bit16
from ckpttools.layouts.zero.write import append_partitions
from ckpttools.model.checkpoint import Checkpoint, Param, Segment, TensorSource, strip_prefixes
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout

EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
EXPERT_KEY_RE = re.compile(r"^(?P<prefix>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<id>\d+)\.(?P<rest>.+)$")
EP_GROUP_RE = re.compile(r"^ep_size_(?P<ep>\d+)$")


@dataclass(frozen=True)
class ExpertKey:
    """A parameter name split around its expert index: `{prefix}.deepspeed_moe...deepspeed_experts.{id}.{rest}`."""

    prefix: str
    expert: int
    rest: str

    def renamed(self, expert: int) -> str:
        return f"{self.prefix}{EXPERTS}{expert}.{self.rest}"


def expert_key(name: str) -> ExpertKey | None:
    m = EXPERT_KEY_RE.match(name)
    return ExpertKey(m["prefix"], int(m["id"]), m["rest"]) if m else None


def expert_dp_ranks(ep_rank: int, ep: int, dp: int, data_before_expert: bool = False) -> list[int]:
    """The DP ranks holding expert-parallel rank `ep_rank`'s experts, in expert-DP rank order.

    DeepSpeed's default (E+D) puts EP rank e on ranks e, e+ep, e+2*ep, ...; `use_data_before_expert_parallelism`
    (D+E) on the contiguous ranks e*dp/ep ... (e+1)*dp/ep-1 (`groups._create_expert_and_data_parallel`).
    """
    edp = dp // ep
    if data_before_expert:
        return [ep_rank * edp + d for d in range(edp)]
    return [ep_rank + d * ep for d in range(edp)]


def local_expert_name(name: str, num_local: int) -> tuple[str, int]:
    """A global expert param name as the rank holding it names it (param_shapes, param_slice_mappings), and the
    expert-parallel rank that holds it; a non-expert name comes back unchanged with EP rank 0."""
    key = expert_key(name)
    if key is None:
        return name, 0
    return key.renamed(key.expert % num_local), key.expert // num_local


def _data_before_expert(model_state: Mapping[str, Any]) -> bool:
    return bool(dict_at(model_state, "ds_config").get("use_data_before_expert_parallelism"))


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: its index in the file names, module path, expert counts and expert files by global id."""

    index: int
    prefix: str
    num_experts: int
    ep: int
    files: dict[int, RankFile]

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep


def read_moe(loc: CheckpointLocation) -> Checkpoint:
    """Read a located DeepSpeed-MoE ZeRO-1/2 tag folder: every expert under its global index.

    Raises:
        CheckpointNotFoundError: a missing expert file (named by layer and global expert id) or rank file.
        CorruptCheckpointError: files that disagree (expert ids, shapes, partition arithmetic, ranks).
        UnsupportedCheckpointError: ZeRO-3 or ZeRO-0 MoE, legacy `expert_E_*` files, tensor parallel.

    AutoEP folders hold expert files of the same names: their model states (`ds_autoep_layers`) hand them to
    `layouts.autoep`, which reads them (ParallelLayout kind "autoep").
    """
    names = list(loc.files.names) or sorted(p.name for p in loc.tag_dir.iterdir())
    model_name, expert_names = _classify(loc, names)
    model0 = RankFile(loc.tag_dir / model_name, load_pickle(loc.tag_dir / model_name), "model-states")
    if autoep_entries(model0.obj):
        return read_autoep(loc)
    num_experts = _check_model_file(model0)
    require_keys(model0, model0.obj, MODEL_KEYS, "DeepSpeed model-states file")
    dp = dp_size_of(model0)
    optims = load_rank_files(loc, loc.files.optim_files, "*_optim_states.pt", dp)
    stage = _zero12_stage(loc, optims)
    experts = _load_expert_files(loc, expert_names, num_experts)
    with RecordReader() as reader:
        for key in ("ds_config", "ds_version"):  # saved together: a model-states file from another run differs
            check_agree([model0, optims[0]], [model0.obj.get(key), optims[0].obj.get(key)], key, reader)
        ckpt = _MoEReader(loc, model0, optims, dp, stage, reader, experts).read()
        reader.finish()
    return ckpt


def _classify(loc: CheckpointLocation, names: Sequence[str]) -> tuple[str, dict[tuple[int, int], str]]:
    """The model-states file and the expert files by (layer, global expert); other MoE layouts refused."""
    experts: dict[tuple[int, int], str] = {}
    for name in names:
        if EXPERT_OPTIM_RE.match(name):
            raise UnsupportedCheckpointError(
                f"{loc.tag_dir / name}: MoE without ZeRO (expp_rank_* optimizer files) is not supported; "
                "save the run with ZeRO stage 1 or 2"
            )
        if m := EXPERT_RE.match(name):
            if m["layer"] is None:
                raise UnsupportedCheckpointError(
                    f"{loc.tag_dir / name}: the pre-0.6 MoE layout (expert_E_* files without layer_L_) is not "
                    "supported; load it in DeepSpeed and save it again"
                )
            if int(m["mp"]) != 0:
                raise UnsupportedCheckpointError(f"{loc.tag_dir / name}: MoE with tensor parallelism is not supported")
            experts[(int(m["layer"]), int(m["expert"]))] = name
    if loc.files.zero3_layout:
        raise UnsupportedCheckpointError(f"{loc.tag_dir}: MoE with ZeRO stage 3 is not supported")
    plain = [n for n in names if MODEL_RE.match(n)]
    if plain != ["mp_rank_00_model_states.pt"]:
        raise (CheckpointNotFoundError if not plain else UnsupportedCheckpointError)(
            f"{loc.tag_dir}: expected one mp_rank_00_model_states.pt beside the expert files, found "
            f"{', '.join(plain) or 'none'}"
        )
    return plain[0], experts


def _check_model_file(f: RankFile) -> list[int]:
    """The MoE facts of mp_rank_00_model_states.pt: experts per layer; model parallelism refused."""
    obj = f.obj
    if obj.get("module") is None:
        raise UnsupportedCheckpointError(f"{f.path} has no module weights: a pipeline-parallel MoE checkpoint")
    mp = obj.get("mp_world_size")
    if not is_int(mp) or mp != 1:
        raise UnsupportedCheckpointError(f"{f.path}: model parallel size {short(mp, 20)} with MoE is not supported")
    dims = f.opt(obj, "checkpoint_parallel_dimensions", dict) or {}
    if dims.get("pp_degree", 1) != 1 or dims.get("tp_degree", 1) != 1:
        raise UnsupportedCheckpointError(f"{f.path}: pipeline/tensor parallel degrees {dims} are not supported")
    if dict_at(obj, "ds_config", "zero_optimization", "offload_optimizer").get("device") == "nvme":
        raise UnsupportedCheckpointError(f"{f.path}: the optimizer state was offloaded to NVMe")
    counts = f.get(obj, "num_experts", list)
    if not counts or not all(is_int(n) and n > 0 for n in counts):
        raise f.fail(f"num_experts {short(counts, 40)} is not a list of positive expert counts, one per MoE layer")
    return [int(n) for n in counts]


def _zero12_stage(loc: CheckpointLocation, optims: Sequence[RankFile]) -> int:
    osds = [f.get(f.obj, "optimizer_state_dict", dict) for f in optims]
    stages = {zero_stage_of(f, o) for f, o in zip(optims, osds, strict=True)}
    for f, osd in zip(optims, osds, strict=True):
        if "zero_stage" not in osd:
            raise UnsupportedCheckpointError(f"{f.path}: MoE with DeepSpeed's BF16_Optimizer is not supported")
        require_keys(f, osd, OPTIM_KEYS["zero"], "ZeRO optimizer file of its kind")
        if isinstance(osd.get("base_optimizer_state"), list):
            raise UnsupportedCheckpointError(f"{f.path}: elastic MoE checkpoints are not supported")
    if len(stages) != 1:
        raise CorruptCheckpointError(f"{loc.tag_dir}: rank files disagree on the ZeRO stage ({sorted(stages)})")
    stage = stages.pop()
    if stage == 3:
        raise UnsupportedCheckpointError(f"{loc.tag_dir}: MoE with ZeRO stage 3 is not supported")
    return stage


def _load_expert_files(
    loc: CheckpointLocation, names: Mapping[tuple[int, int], str], num_experts: Sequence[int]
) -> dict[tuple[int, int], RankFile]:
    """Every (layer, global expert) num_experts promises, no more; each file a dict of that expert's tensors."""
    want = {(layer, e) for layer, n in enumerate(num_experts) for e in range(n)}
    missing = sorted(want - set(names))
    if missing:
        layer, e = missing[0]
        raise CheckpointNotFoundError(
            f"{loc.tag_dir}: the weights of MoE layer {layer} expert {e} (layer_{layer}_expert_{e}_mp_rank_00_"
            f"model_states.pt) are missing ({len(missing)} of {len(want)} expert files; num_experts="
            f"{list(num_experts)}). "
            "The save was interrupted or the folder copied in part; re-copy it"
        )
    extra = sorted(set(names) - want)
    if extra:
        raise CorruptCheckpointError(
            f"{loc.tag_dir}: {names[extra[0]]} is no expert of this run (num_experts={list(num_experts)}); "
            "remove the stray file (left over from another run?)"
        )
    return {k: RankFile(loc.tag_dir / n, load_pickle(loc.tag_dir / n), "MoE expert") for k, n in sorted(names.items())}


class _MoEReader(Zero12Reader):
    """A ZeRO-1/2 reader whose `moe` param groups are read per expert-parallel rank over its expert-DP group."""

    def __init__(
        self,
        loc: CheckpointLocation,
        model0: RankFile,
        optims: list[RankFile],
        dp: int,
        stage: int,
        reader: RecordReader,
        experts: dict[tuple[int, int], RankFile],
    ) -> None:
        super().__init__(loc, model0, optims, dp, stage, reader)
        self.experts = experts

    def read(self) -> Checkpoint:
        f0 = self.model0
        mod = read_module(f0)
        groups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, groups)
        group_ep = self._group_ep_sizes(groups)
        self._check_counts(group_ep)
        states = [self._rank_states(f, o, len(groups), False) for f, o in zip(self.optims, self.osds, strict=True)]
        same_keys_everywhere(self.optims[0], [flat_state_keys(s) for s in states[0]], "param group")
        layers = self._layers(groups, group_ep)
        dense: list[Param] = []
        expert_params: list[Param] = []
        for g, shapes in enumerate(groups):
            if group_ep[g] is None:
                dense += self._group_params(g, shapes, states)
            else:
                expert_params += self._expert_group_params(g, shapes, states, group_ep[g] or 1, layers)
        by_name = {p.name: p for p in dense}
        bit16 = zero12_bit16(f0, mod, by_name)
        frozen = {n: s for n, s in bit16.items() if n not in by_name}
        check_ties(f0, mod, by_name, frozen)
        check_module_keys(f0, mod, by_name, frozen)
        for name, src in bit16.items():
            if name in by_name and src.shape != by_name[name].shape:
                raise f0.fail(f"{name} has shape {list(src.shape)} in the module, {list(by_name[name].shape)} in "
                              "param_shapes")  # fmt: skip
        copies = self._expert_copies(layers, {p.name: p for p in expert_params})
        params = dense + expert_params
        eps = sorted({layer.ep for layer in layers})
        return Checkpoint(
            location=self.loc,
            zero_stage=self.stage,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=_full_keys(f0, mod.keys, layers, copies),
            params=sorted(params, key=lambda p: p.group),
            optimizer=self._optimizer_state(states, False),
            bit16={**bit16, **copies},
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=saved_without_frozen(self.loc, by_name, bit16),
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[f0.obj],
            layout_files=[f.path.name for layer in layers for _, f in sorted(layer.files.items())],  # DP-independent
            layout=ParallelLayout("moe", dp=self.dp, ep=max(eps), details=_details(self, layers)),
        )

    # --- param groups --------------------------------------------------------------------------------------

    def _group_ep_sizes(self, groups: list[list[tuple[str, tuple[int, ...]]]]) -> list[int | None]:
        """Per param group: the expert-parallel size of a `moe` group (from its name `ep_size_K`), None if dense."""
        f = self.optims[0]
        pgs = f.get(self.osds[0]["base_optimizer_state"], "param_groups", list, "base_optimizer_state.")
        if len(pgs) != len(groups):
            raise f.fail(f"the optimizer has {len(pgs)} param groups, param_shapes {len(groups)}")
        out: list[int | None] = []
        for g, (pg, shapes) in enumerate(zip(pgs, groups, strict=True)):
            experts = [expert_key(strip_prefixes(n)) is not None for n, _ in shapes]
            if not (isinstance(pg, dict) and pg.get("moe")):
                if any(experts):
                    raise f.fail(f"param group {g} holds expert parameters but is not marked moe")
                out.append(None)
                continue
            m = EP_GROUP_RE.match(str(pg.get("name")))
            if not m or int(m["ep"]) < 1 or self.dp % int(m["ep"]):
                raise f.fail(f"MoE param group {g} is named {short(pg.get('name'), 30)}, not ep_size_K with K "
                             f"dividing dp_world_size={self.dp}")  # fmt: skip
            if not all(experts):
                raise f.fail(f"MoE param group {g} holds a parameter that is no expert's")
            out.append(int(m["ep"]))
        if all(ep is None for ep in out):
            raise f.fail("no param group is marked moe, but the folder holds expert files")
        return out

    def _check_counts(self, group_ep: list[int | None]) -> None:
        """partition_count: DP for dense groups, the expert-DP size DP/K for each `ep_size_K` group."""
        want = [self.dp if ep is None else self.dp // ep for ep in group_ep]
        for f, osd in zip(self.optims, self.osds, strict=True):
            counts = osd.get("partition_count")
            if not isinstance(counts, (list, tuple)) or list(counts) != want:
                raise CorruptCheckpointError(
                    f"{f.path} was written for partition counts {short(counts, 40)}; dp_world_size={self.dp} and the "
                    f"expert-parallel sizes of the param groups give {want}: files from different runs are mixed"
                )
            for key in ("single_partition_of_fp32_groups", "group_paddings"):
                if len(f.get(osd, key, list)) != len(group_ep):
                    raise f.fail(f"'{key}' has {len(osd[key])} entries for {len(group_ep)} param groups")
        check_unsharded_agree(self.optims, self.osds, ZERO12_PER_RANK, self.reader)

    def _expert_dp_ranks(self, ep_rank: int, ep: int) -> list[int]:
        return expert_dp_ranks(ep_rank, ep, self.dp, _data_before_expert(self.model0.obj))

    def _expert_group_params(
        self,
        g: int,
        shapes: list[tuple[str, tuple[int, ...]]],
        states: list[list[dict[str, Any]]],
        ep: int,
        layers: Sequence[MoELayer],
    ) -> list[Param]:
        """A `moe` group: one ZeRO-1/2 partitioning per expert-parallel rank, its params renamed to global experts."""
        by_prefix = {layer.prefix: layer for layer in layers}
        out = []
        for e in range(ep):
            ranks = self._expert_dp_ranks(e, ep)
            view = Zero12Reader(self.loc, self.model0, [self.optims[r] for r in ranks], len(ranks), self.stage,
                                 self.reader)  # fmt: skip
            for p in view._group_params(g, shapes, [states[r] for r in ranks]):
                key = expert_key(p.name)
                assert key is not None  # _group_ep_sizes checked every name
                out.append(_renamed(p, key.renamed(e * by_prefix[key.prefix].num_local + key.expert)))
        return out

    # --- layers and expert files ---------------------------------------------------------------------------

    def _layers(self, groups: list[list[tuple[str, tuple[int, ...]]]], group_ep: list[int | None]) -> list[MoELayer]:
        """The MoE layers: module path from the expert files' keys, ep size from the groups of their params."""
        f0 = self.model0
        num_experts = [int(n) for n in f0.obj["num_experts"]]
        ep_of: dict[str, set[int]] = {}
        local_ids: dict[str, set[int]] = {}
        for g, shapes in enumerate(groups):
            for name, _ in shapes:
                key = expert_key(strip_prefixes(name))
                if key is not None:
                    ep_of.setdefault(key.prefix, set()).add(group_ep[g] or 0)
                    local_ids.setdefault(key.prefix, set()).add(key.expert)
        layers = []
        for index, n in enumerate(num_experts):
            prefix = self._layer_prefix(index, n)
            eps = ep_of.get(prefix, set())
            if len(eps) != 1:
                raise f0.fail(f"MoE layer {index} ({prefix}) has its expert params in param groups of expert-parallel "
                              f"sizes {sorted(eps)}, not in the groups of one size")  # fmt: skip
            ep = eps.pop()
            if n % ep or local_ids[prefix] != set(range(n // ep)):
                raise f0.fail(f"param_shapes lists local experts {sorted(local_ids[prefix])} of MoE layer {index} "
                              f"({prefix}); {n} experts at ep_size {ep} give 0-{n // ep - 1}")  # fmt: skip
            files = {e: f for (layer, e), f in self.experts.items() if layer == index}
            layers.append(MoELayer(index, prefix, n, ep, files))
        unknown = sorted(set(ep_of) - {layer.prefix for layer in layers})
        if unknown:
            raise f0.fail(f"param_shapes lists experts of {unknown[0]}, which has no expert files")
        return layers

    def _layer_prefix(self, index: int, n: int) -> str:
        """The module path of MoE layer `index`: every key of each of its expert files names it and that expert."""
        prefixes = set()
        for e in range(n):
            f = self.experts[(index, e)]
            if not f.obj:
                raise f.fail("holds no tensors")
            for raw in f.obj:
                key = expert_key(strip_prefixes(raw)) if isinstance(raw, str) else None
                if key is None:
                    raise f.fail(f"holds {short(raw)}, which is no expert parameter")
                if key.expert != e:
                    raise f.fail(f"holds the weights of expert {key.expert} ({short(raw)}), not of expert {e}: "
                                 "expert files swapped or renamed")  # fmt: skip
                prefixes.add(key.prefix)
        if len(prefixes) != 1:
            raise CorruptCheckpointError(
                f"{self.loc.tag_dir}: the expert files of MoE layer {index} name the layers {sorted(prefixes)}, not one"
            )
        return prefixes.pop()

    def _expert_copies(self, layers: Sequence[MoELayer], params: Mapping[str, Param]) -> dict[str, TensorSource]:
        """The 16-bit weights of every expert (expert files), matched one to one with the expert params."""
        copies: dict[str, TensorSource] = {}
        for layer in layers:
            for e, f in layer.files.items():
                for raw, value in f.obj.items():
                    name = strip_prefixes(raw)
                    param = params.get(name)
                    if param is None:
                        raise UnsupportedCheckpointError(
                            f"{f.path} holds {name}, which no optimizer file trains (a frozen expert param or an "
                            "expert buffer): not supported"
                        )
                    t = f.tensor(value, f"expert tensor {name}")
                    if t.shape != param.shape:
                        raise f.fail(f"{name} has shape {list(t.shape)}, param_shapes {list(param.shape)}")
                    copies[name] = TensorSource(name, t.shape, t.dtype, (Segment(t, 0, t.numel()),), "trainable")
                expected = {n for n in params if (k := expert_key(n)) and k.prefix == layer.prefix and k.expert == e}
                absent = sorted(expected - set(copies))
                if absent:
                    raise f.fail(f"lacks {absent[0]}, which the optimizer files train")
        return copies


def _renamed(p: Param, name: str) -> Param:
    """A param under its global expert name (file_name too: every expert's name is unique only globally)."""
    states = {k: dataclasses.replace(s, name=name) for k, s in p.states.items()}
    return dataclasses.replace(p, name=name, file_name=name, fp32=dataclasses.replace(p.fp32, name=name), states=states)


def _full_keys(
    f0: RankFile, keys: list[str], layers: Sequence[MoELayer], copies: Mapping[str, TensorSource]
) -> list[str]:
    """The full model's state-dict order: each layer's experts (0..N-1, in file order) right after its gate."""
    out = list(keys)
    for layer in layers:
        gate = [i for i, k in enumerate(out) if k.startswith(f"{layer.prefix}.deepspeed_moe.gate.")]
        if not gate:
            raise f0.fail(f"the module holds no gate of MoE layer {layer.index} ({layer.prefix})")
        expert_keys = [strip_prefixes(k) for e in sorted(layer.files) for k in layer.files[e].obj]
        out[gate[-1] + 1 : gate[-1] + 1] = [k for k in expert_keys if k in copies]
    return out


def _details(reader: _MoEReader, layers: Sequence[MoELayer]) -> dict[str, Any]:
    """What `ParallelLayout.details` says of a MoE run (reshard needs all of it to write the expert groups back)."""
    return {
        "num_experts": [layer.num_experts for layer in layers],
        "moe_layers": [layer.prefix for layer in layers],
        "ep_sizes": [layer.ep for layer in layers],
        "expert_dp": {str(layer.ep): reader.dp // layer.ep for layer in layers},
        "topology": "data_before_expert" if _data_before_expert(reader.model0.obj) else "expert_before_data",
    }


# --- Resharding ------------------------------------------------------------------------------------------------
#
# Only the optimizer files depend on the DP size. A dense group is cut over all `dp` ranks as in plain ZeRO-1/2;
# an `ep_size_K` group on rank r holds the local experts of r's expert-parallel rank, cut over that rank's
# expert-DP group of dp/K ranks. The expert files and the module file (but its dp_world_size) stay as they are.


def check_moe_reshard(ckpt: Checkpoint, *, universal: bool, stage: int | None, dp: int | None = None) -> None:
    """What `reshard` cannot write for a DeepSpeed-MoE checkpoint, refused before anything is written."""
    what = f"{ckpt.location.tag_dir} is a DeepSpeed-MoE checkpoint ({ckpt.layout.describe()})"
    if universal:
        raise UnsupportedCheckpointError(
            f"{what}; --universal is refused: DeepSpeed's universal loader looks experts up by their local name, "
            "so every expert-parallel rank but the first would silently load another rank's experts; reshard "
            "with --dp M instead"
        )
    if stage is not None and stage != ckpt.zero_stage:
        raise UnsupportedCheckpointError(
            f"{what}; --stage is refused: DeepSpeed-MoE runs at ZeRO-1 or 2 only and changing between them is not "
            "proven for MoE; reshard with --dp M at its own stage"
        )
    if ckpt.zero_stage not in (1, 2) or ckpt.optimizer.elastic or ckpt.optimizer.param_groups is None:
        raise UnsupportedCheckpointError(f"{what}; only rigid ZeRO-1/2 MoE checkpoints can be resharded")
    eps = sorted(set(_group_ep_sizes(ckpt)) - {1})
    if dp is not None and any(dp % ep for ep in eps):
        raise UnsupportedCheckpointError(
            f"{what}; DP {dp} is not a multiple of the expert-parallel size "
            f"{' and '.join(map(str, eps))}: DeepSpeed needs dp = ep x expert-DP; pick a multiple of "
            f"{math.lcm(*eps)}"
        )


def moe_rank_files(ckpt: Checkpoint, dp: int, stage: int) -> dict[str, Any]:
    """Relative path -> object: every rank file of the checkpoint at `dp` ranks (experts stay where they are).

    The optimizer files are planned from the checkpoint model; the module file gets the new dp_world_size; the
    expert files are rewritten from `load_pickle` objects so every record's CRC is checked on the way.
    """
    check_moe_reshard(ckpt, universal=False, stage=stage, dp=dp)
    opt = ckpt.optimizer
    common = {k: v for k, v in opt.common.items() if k != "param_groups"}
    osds = [{**common, "single_partition_of_fp32_groups": [], "group_paddings": [], "param_slice_mappings": [],
             "partition_count": [], "base_optimizer_state": {"state": {}, "param_groups": opt.param_groups}}
            for _ in range(dp)]  # fmt: skip
    dbe = ckpt.layout.details.get("topology") == "data_before_expert"
    for g, ep in enumerate(_group_ep_sizes(ckpt)):
        for e, group in enumerate(_local_members(ckpt, g, ep)):
            ranks = expert_dp_ranks(e, ep, dp, dbe)
            append_partitions(g, group, [osds[r] for r in ranks], opt.group_scalars)
    prefix = ckpt.location.files.optim_prefix
    files: dict[str, Any] = {
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt": {"optimizer_state_dict": osd, **opt.file_meta}
        for r, osd in enumerate(osds)
    }
    files["mp_rank_00_model_states.pt"] = {**ckpt.model_files[0], "dp_world_size": dp}
    for name in ckpt.layout_files:
        files[name] = load_pickle(ckpt.location.tag_dir / name)
    return files


def _group_ep_sizes(ckpt: Checkpoint) -> list[int]:
    """Per param group: K of an `ep_size_K` MoE group, 1 for a dense group (its experts-DP group is every rank)."""
    out = []
    for pg in ckpt.optimizer.param_groups or []:
        m = EP_GROUP_RE.match(str(pg.get("name"))) if pg.get("moe") else None
        out.append(int(m["ep"]) if m else 1)
    return out


def _local_members(ckpt: Checkpoint, g: int, ep: int) -> list[list[Param]]:
    """Per expert-parallel rank: the params of group g it holds, in file order, under the names it gives them."""
    details = ckpt.layout.details
    layers = zip(details["moe_layers"], details["num_experts"], details["ep_sizes"], strict=True)
    num_local = {prefix: n // k for prefix, n, k in layers}
    members: list[list[Param]] = [[] for _ in range(ep)]
    for p in ckpt.params:
        if p.group != g:
            continue
        key = expert_key(p.name)
        if ep == 1 or key is None:
            members[0].append(p)
            continue
        local, e = local_expert_name(p.file_name, num_local[key.prefix])
        members[e].append(dataclasses.replace(p, file_name=local))
    if any(not m for m in members):
        raise CorruptCheckpointError(
            f"{ckpt.location.tag_dir}: param group {g} has no params for some of its {ep} expert-parallel ranks"
        )
    return members


class MoeLayout:
    """DeepSpeed-MoE: dense ZeRO-1/2 groups plus one file per expert and expert-parallel optimizer groups."""

    kind = "moe"
    title = "MoE (DeepSpeed-MoE expert-parallel)"

    def claims(self, names: Sequence[str]) -> bool:
        return any(EXPERT_RE.match(n) or EXPERT_OPTIM_RE.match(n) for n in names)

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_moe(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        layers = parallel.get("moe_layers") or []
        experts = parallel.get("num_experts") or []
        per_layer = ", ".join(f"{name} {n}" for name, n in zip(layers, experts, strict=False))
        expert_dp = ", ".join(map(str, (parallel.get("expert_dp") or {}).values()))
        return [f"experts        {per_layer} (EP {parallel.get('ep')}, expert-DP {expert_dp})"]

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        check_moe_reshard(ckpt, universal=target.universal, stage=target.stage, dp=target.dp)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        raise no_universal_form(ckpt, self.title)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:
            return self.universal_files(ckpt)
        return moe_rank_files(ckpt, target.dp, target.stage)


LAYOUT = MoeLayout()

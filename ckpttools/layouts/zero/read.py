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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ckpttools.errors import CorruptCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, RecordReader, load_pickle
from ckpttools.layouts.rankfile import (
    MODEL_KEYS,
    OPTIM_KEYS,
    ZERO3_PER_RANK,
    ZERO12_PER_RANK,
    ModuleEntries,
    RankFile,
    check_agree,
    check_module_keys,
    check_param_groups,
    check_ties,
    check_unique_names,
    check_unsharded_agree,
    dict_at,
    dp_size_of,
    drop_excluded_ties,
    file_meta,
    flat_state_keys,
    is_int,
    load_rank_files,
    module_tensor,
    param_shapes_of,
    read_module,
    refuse_unsupported,
    require_keys,
    saved_without_frozen,
    scalar_entries,
    shape_of,
    state_entries,
    train_dtype_of,
    undeclared_aliases,
    zero_stage_of,
)
from ckpttools.layouts.zero import nvme, partition
from ckpttools.layouts.zero.pieces import MUON_MOMENTUM, is_muon_group, whole_params_in_partition
from ckpttools.model.checkpoint import (
    Checkpoint,
    OptimizerState,
    Param,
    Segment,
    TensorSource,
    shape_numel,
    strip_prefixes,
)
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import ParallelLayout


def read_data_parallel(loc: CheckpointLocation) -> Checkpoint:
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

    def read(self) -> Checkpoint:
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
        muon = [is_muon_group(pg) for pg in self._param_groups(len(groups))]
        same_keys_per_kind(self.optims[0], [flat_state_keys(s) for s in states[0]], muon, "param group")
        by_name = {p.name: p for p in params}
        bit16 = zero12_bit16(f0, mod, by_name)
        frozen = {n: s for n, s in bit16.items() if n not in by_name}
        drop_excluded_ties(self.loc, mod, by_name, frozen)
        check_ties(f0, mod, by_name, frozen)
        check_module_keys(f0, mod, by_name, frozen)
        for name, src in bit16.items():
            if name in by_name and src.shape != by_name[name].shape:
                raise f0.fail(
                    f"{name} has shape {list(src.shape)} in the module but {list(by_name[name].shape)} in param_shapes"
                )
        return Checkpoint(
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
            layout=ParallelLayout("dp", dp=self.dp, details=nvme.zero12_details(f0.obj.get("ds_config"))),
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
        check_param_groups(f, f.get(base, "param_groups", list, "base_optimizer_state."), num_groups)
        if any(not isinstance(k, int) or not 0 <= k < num_groups for k in state):
            raise f.fail(
                f"base_optimizer_state.state is keyed {sorted(map(repr, state))[:4]}, not by param group "
                f"0-{num_groups - 1}"
            )
        return [state_entries(f, state.get(g, {}), f"param group {g}") for g in range(num_groups)]

    def _group_params(
        self, g: int, shapes: list[tuple[str, tuple[int, ...]]], states: list[list[dict[str, Any]]]
    ) -> list[Param]:
        numels = [shape_numel(s) for _, s in shapes]
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
        muon = is_muon_group(self._param_groups(g + 1)[g])
        whole = [k for k in keys if muon and k == MUON_MOMENTUM]
        moments = {
            k: [self._moment(r, g, k, states[r][g][k], size, real[r]) for r in range(self.dp)]
            for k in keys
            if k not in whole
        }
        held = {k: self._whole_param_moments(g, k, states, numels, offsets, size) for k in whole}
        params: list[Param] = []
        for i, ((name, shape), numel, off) in enumerate(zip(shapes, numels, offsets, strict=True)):
            pieces = partition.split_range(off, numel, real)
            fp32 = TensorSource(strip_prefixes(name), shape, dtypes.FLOAT32, _segments(masters, pieces), "trainable")
            st = {
                k: TensorSource(fp32.name, shape, ts[0].dtype, _segments(ts, pieces), "state")
                for k, ts in moments.items()
            }
            for k, (ts, where) in held.items():
                st[k] = TensorSource(fp32.name, shape, ts[0].dtype, (Segment(ts[where[i][0]], where[i][1], numel),),
                                     "state")  # fmt: skip
            params.append(Param(fp32.name, name, shape, g, align[len(params)], fp32, {k: st[k] for k in keys}))
        return params

    def _param_groups(self, n: int) -> list[Any]:
        """The optimizer's hyper-parameters per param group (rank 0's; elastic checkpoints keep none)."""
        base = self.osds[0].get("base_optimizer_state")
        groups = base.get("param_groups") if isinstance(base, dict) else None
        return list(groups) if isinstance(groups, list) and len(groups) >= n else [{}] * n

    def _whole_param_moments(
        self, g: int, key: str, states: list[list[dict[str, Any]]], numels: list[int], offsets: list[int], size: int
    ) -> tuple[list[LazyTensor], list[tuple[int, int]]]:
        """A ZeRO-1/2 Muon momentum: each rank holds the whole params of its partition (pieces.py says why).
        Returns the rank tensors and, per param, (rank, offset) of the first rank holding it."""
        tensors: list[LazyTensor] = []
        where: dict[int, tuple[int, int]] = {}
        for r in range(self.dp):
            f = self.optims[r]
            t = f.tensor(states[r][g][key], f"optimizer state {short(key)} of param group {g}")
            members = whole_params_in_partition(numels, offsets, size, r)
            want = sum(numels[i] for i in members)
            if t.dim() != 1 or t.numel() != want:
                raise f.fail(
                    f"Muon momentum {short(key)} of param group {g} holds {t.numel()} elements; DeepSpeed keeps the "
                    f"{len(members)} whole params of the partition there, {want} elements"
                )
            pos = 0
            for i in members:
                where.setdefault(i, (r, pos))
                pos += numels[i]
            tensors.append(t)
        if len(where) != len(numels):
            raise self.optims[0].fail(f"no rank holds the Muon momentum of every param of param group {g}")
        return tensors, [where[i] for i in range(len(numels))]

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
        meta = file_meta(self.optims[0])
        return OptimizerState([scalar_entries(s) for s in states[0]], common, meta, elastic)


def zero12_bit16(f0: RankFile, mod: ModuleEntries, params: Mapping[str, Param]) -> dict[str, TensorSource]:
    """The ZeRO-0/1/2 module's 16-bit copies of trained params, and the frozen params.

    ZeRO-2 also lists its frozen params in frozen_param_shapes with full copies in frozen_param_fragments;
    the three must agree. ZeRO-1 (and runs saved with exclude_frozen_parameters) record neither.
    """
    aliases = undeclared_aliases(mod, params)
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
        self.offloaded = nvme.Offloaded(loc, models[0])  # NVMe-swapped sub-groups: bytes from the swap files

    def read(self) -> Checkpoint:
        f0 = self.models[0]
        mod = read_module(f0)
        self._check_ranks_agree()
        subgroups = param_shapes_of(f0, f0.get(f0.obj, "param_shapes", list), "param_shapes")
        check_unique_names(f0, subgroups)
        group_of, scalars, common = zero3_optimizer_parts(self.optims[0], self.osds[0], len(subgroups))
        self.offloaded.check_subgroups(f0, subgroups, group_of, self.dp)
        params: list[Param] = []
        for sg, shapes in enumerate(subgroups):
            params += self._subgroup_params(sg, shapes, group_of[sg])
        inner = self.osds[0]["optimizer_state_dict"]["state"]
        keys = [flat_state_keys(inner.get(sg, {})) for sg in range(len(subgroups))]
        param_groups = self.osds[0]["optimizer_state_dict"]["param_groups"]
        muon = [is_muon_group(param_groups[group_of[sg]]) for sg in range(len(subgroups))]
        same_keys_per_kind(self.optims[0], keys, muon, "sub-group")
        params.sort(key=lambda p: p.group)  # flat order within each param group, as DeepSpeed builds sub-groups
        by_name = {p.name: p for p in params}
        frozen = zero3_frozen(self.models, self.dp)
        overlap = sorted(set(frozen) & set(by_name))
        if overlap:
            raise f0.fail(f"{overlap[0]} is listed both as a trained and as a frozen parameter")
        drop_excluded_ties(self.loc, mod, by_name, frozen)
        check_ties(f0, mod, by_name, frozen)
        check_module_keys(f0, mod, by_name, frozen)
        return Checkpoint(
            location=self.loc,
            zero_stage=3,
            dp_world_size=self.dp,
            train_dtype=train_dtype_of(mod.tensors, by_name),
            optimizer_kind="zero",
            ds_version=str(f0.obj.get("ds_version", "")),
            global_steps=f0.obj.get("global_steps") if isinstance(f0.obj.get("global_steps"), int) else None,
            keys=mod.keys,
            params=params,
            optimizer=OptimizerState(scalars, common, file_meta(self.optims[0])),
            bit16=frozen,
            buffers=mod.buffers,
            shared_params=mod.shared,
            frozen_excluded=saved_without_frozen(self.loc, by_name, frozen),
            ds_config=dict_at(f0.obj, "ds_config"),
            model_files=[m.obj for m in self.models],
            layout=ParallelLayout("dp", dp=self.dp, details=self._details(len(subgroups))),
        )

    def _details(self, num_subgroups: int) -> dict[str, Any]:
        return {"nvme_offload": self.offloaded.facts(num_subgroups)} if self.offloaded.active else {}

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
            check_param_groups(f, f.get(inner, "param_groups", list, "optimizer_state_dict."), None)
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
        numels = [shape_numel(s) for _, s in shapes]
        offsets = partition.zero3_subgroup_offsets(numels, self.dp)
        flat_len = sum(partition.zero3_partition_numel(n, self.dp) for n in numels)
        flats = []
        for r, (f, osd) in enumerate(zip(self.optims, self.osds, strict=True)):
            groups = osd["fp32_flat_groups"]
            if sg >= len(groups):
                raise f.fail(f"has no fp32 partition for sub-group {sg}")
            t = f.master(groups[sg], f"the fp32 partition of sub-group {sg}")
            t = self.offloaded.resolve(f, r, sg, None, t, flat_len)
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
        if t.dim() == 1:
            t = self.offloaded.resolve(f, r, sg, key, t, flat_len)
        if t.dim() != 1 or t.numel() != flat_len:
            raise f.fail(
                f"optimizer state {short(key)} of sub-group {sg} holds {t.numel()} elements, the partition {flat_len}"
            )
        return t


def same_keys_per_kind(f: RankFile, keys: Sequence[Sequence[str]], muon: Sequence[bool], what: str) -> None:
    """Every group of one kind holds the same state keys. DeepSpeed's Muon (MuonWithAuxAdam) keeps different keys
    per kind of group: `momentum_buffer` in its Muon groups, `exp_avg`, `exp_avg_sq` (and `step`) in its auxiliary
    Adam groups; that is normal, not damage."""
    for kind in (True, False):
        members = [i for i, m in enumerate(muon) if m is kind]
        if not members:
            continue
        sets = [sorted(keys[i]) for i in members]
        for i, k in zip(members, sets, strict=True):
            if k != sets[0]:
                label = f"{what} {i}" if not any(muon) else f"{'Muon' if kind else 'Adam'} {what} {i}"
                raise f.fail(
                    f"{label} has optimizer states {k}, {what} {members[0]} {sets[0]}: a state was lost or added"
                )


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
        numel = shape_numel(shape)
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

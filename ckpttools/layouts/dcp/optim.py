"""What an FSDP2 save holds of the optimizer, from `.metadata` and pickles alone: no chunk is read.

The optimizer's state lies in one of three places: the model's own DCP folder (`dcp.save({"model", "optim"})`,
torchtitan's flattened `state.<fqn>.<key>`), a DCP folder beside the model's (accelerate and the Trainer:
`optimizer_N/` beside `pytorch_model_fsdp_N/`), or per-rank `torch.save` files (accelerate `use_dcp=False`:
`optimizer_N_rank{R}.bin`). Or nowhere: a model-only save (`dcp.save(model.state_dict())`, torch's Hugging Face
safetensors shards). Which parameters the optimizer holds state for also tells the trained ones from the frozen ones
and from a tied weight's second name (FSDP2's `named_parameters()` yields a shared Parameter once).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.errors import CkptError, CorruptCheckpointError, short
from ckpttools.io.source import list_names, open_source, read_full
from ckpttools.io.torchfile import LazyTensor, load_pickle
from ckpttools.layouts.dcp.metadata import MAX_METADATA_BYTES, METADATA_FILE, DcpMetadata, parse_metadata
from ckpttools.layouts.dcp.rankfiles import DTENSOR_GLOBALS
from ckpttools.model.checkpoint import OptimizerState, TensorSource, shape_numel, strip_prefixes

OPTIM_ROOTS = frozenset({"optim", "optimizer", "optimizers", "optim_state", "state", "param_groups"})
NON_MODEL_ROOTS = OPTIM_ROOTS | {
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "dataloader",
    "data_loader",
    "train_state",
    "trainer_state",
    "rng",
    "rng_state",
    "rng_states",
    "extra_state",
}  # fmt: skip  ("state", "param_groups": a flattened optimizer, torchtitan's state.<fqn>.exp_avg)
MODEL_FOLDER_RE = re.compile(r"^pytorch_model_fsdp_(?P<n>\d+)$")  # accelerate / Trainer SHARDED_STATE_DICT


@dataclass(frozen=True)
class OptimizerFacts:
    """The optimizer state a save holds: its keys, the model names it holds state for, its tensors' bytes."""

    saved: bool
    keys: list[str] = field(default_factory=list)
    trained: set[str] = field(default_factory=set)
    nbytes: int | None = 0  # None: present, but its description could not be read
    where: str = ""  # beside the model's files (optimizer_0/, optimizer_0_rank*.bin); "" in the model's own
    problem: str = ""  # why its description could not be read

    def state(self, folder: Path, root: Path, tag: str) -> OptimizerState:
        """The neutral description, with the reader of the state tensors of the save whose model is `folder`."""
        return OptimizerState([], {}, {}, saved=self.saved, stored_keys=list(self.keys), stored_bytes=self.nbytes,
                              where=self.where, problem=self.problem,
                              read_states=functools.partial(state_tensors, folder, root, tag))  # fmt: skip


NONE_SAVED = OptimizerFacts(saved=False)


def read_metadata(folder: Path) -> DcpMetadata:
    path = folder / METADATA_FILE
    with contextlib.closing(open_source(path)) as source:
        size = source.size()
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(f"{path} is {size} bytes: too large for DCP metadata")
        data = bytearray(size)
        if read_full(source, 0, memoryview(data)) != size:
            raise CorruptCheckpointError(f"{path} is truncated; re-copy it")
    return parse_metadata(bytes(data), str(path))


def optimizer_facts(folder: Path, root: Path, tag: str, meta: DcpMetadata | None) -> OptimizerFacts:
    """The optimizer state of the save whose model is `folder` (tag `tag`, in checkpoint folder `root`)."""
    own = from_metadata(meta) if meta is not None else None
    if own is not None:
        return own
    if m := MODEL_FOLDER_RE.match(tag):
        beside = root / f"optimizer_{m['n']}"
        if (beside / METADATA_FILE).is_file():
            return _described(beside.name, lambda: from_metadata(read_metadata(beside)) or OptimizerFacts(True))
        files = _rank_files(list_names(folder), m["n"])
        if files:
            return _described(f"optimizer_{m['n']}_rank*.bin", lambda: _from_rank_file(folder / files[0], len(files)))
    return NONE_SAVED


def _described(where: str, read: Any) -> OptimizerFacts:
    """The facts `read` gives, named by where they are; a description that cannot be read only says so (the model
    is what every command reads: a damaged optimizer file is no reason to refuse it)."""
    try:
        facts = read()
    except CkptError as e:
        return OptimizerFacts(True, nbytes=None, where=where, problem=short(e, 160))
    return OptimizerFacts(facts.saved, facts.keys, facts.trained, facts.nbytes, where)


def from_metadata(meta: DcpMetadata) -> OptimizerFacts | None:
    """The optimizer entries of a DCP folder's metadata (None: it holds none)."""
    keys: dict[str, None] = {}
    trained: set[str] = set()
    nbytes, any_entry = 0, False
    for fqn in [*meta.tensors, *meta.byte_entries]:
        path = tuple(str(p) for p in (meta.key_paths.get(fqn) or tuple(fqn.split("."))))
        if not path or path[0] not in OPTIM_ROOTS:
            continue
        any_entry = True
        name = _state_param(path)
        if name is None:
            continue
        keys[path[-1]] = None
        trained.add(name)
        entry = meta.tensors.get(fqn)
        if entry is not None:
            nbytes += shape_numel(entry.size) * entry.dtype.itemsize
    return OptimizerFacts(True, list(keys), trained, nbytes) if any_entry else None


def _state_param(path: tuple[str, ...]) -> str | None:
    """The parameter a per-parameter state entry belongs to: `optim.state.<fqn>.<key>` (get_state_dict, the fqn one
    key), or torchtitan's flattened `state.<dotted fqn>.<key>`; None for any other entry (param_groups, ...)."""
    if len(path) >= 4 and path[1] == "state":
        return strip_prefixes(path[2])
    if len(path) >= 3 and path[0] == "state":
        return strip_prefixes(".".join(path[1:-1]))
    return None


def _rank_files(names: list[str], n: str) -> list[str]:
    pattern = re.compile(rf"^optimizer_{n}_rank(?P<rank>\d+)\.bin$")
    ranked = {int(m["rank"]): name for name in names if (m := pattern.match(name))}
    return [ranked[r] for r in sorted(ranked)]


def _from_rank_file(path: Path, ranks: int) -> OptimizerFacts:
    """accelerate's use_dcp=False optimizer file of rank 0: `{"state": {fqn: {key: DTensor | tensor}},
    "param_groups": [...]}`; DTensors carry the whole tensor's size, so rank 0's file describes them all."""
    obj = load_pickle(path, check_identity=False, extra_globals=DTENSOR_GLOBALS)
    state = obj.get("state") if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path} does not hold an optimizer state dict")
    keys: dict[str, None] = {}
    nbytes = 0
    for entries in state.values():
        if not isinstance(entries, dict):
            raise CorruptCheckpointError(f"{path}: a parameter's state is {short(entries, 60)}")
        for key, value in entries.items():
            keys[str(key)] = None
            nbytes += _whole_bytes(value)
    return OptimizerFacts(True, list(keys), {strip_prefixes(str(k)) for k in state}, nbytes)


def _whole_bytes(value: Any) -> int:
    if isinstance(value, LazyTensor):  # a plain tensor (step): each rank holds it whole
        return value.nbytes
    size, dtype = getattr(value, "size", None), getattr(value, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(size, tuple) and isinstance(itemsize, int):  # a DTensor: its global size
        return shape_numel(int(s) for s in size) * itemsize
    return 0  # a python number (step as int)


def state_tensors(folder: Path, root: Path, tag: str) -> list[tuple[str, str, TensorSource]]:
    """The optimizer state tensors of the save whose model is `folder`, as (parameter, state key, tensor), read where
    they lie: the model's own DCP folder (`dcp.save({"model", "optim"})`, torchtitan's flattened
    `state.<fqn>.<key>`) or accelerate's `optimizer_N/` beside `pytorch_model_fsdp_N/`; step counters left out.
    accelerate's per-rank `optimizer_N_rank*.bin` files are described (`optimizer_facts`), not read as tensors."""
    from ckpttools.layouts.dcp.chunks import ChunkFiles, chunk_tensor, tensor_segments

    folders = [folder]
    if m := MODEL_FOLDER_RE.match(tag):
        folders.append(root / f"optimizer_{m['n']}")
    out: list[tuple[str, str, TensorSource]] = []
    for where in folders:
        names = set(list_names(where)) if where.is_dir() else set()
        if METADATA_FILE not in names:
            continue
        meta = read_metadata(where)
        files = ChunkFiles(where, names)
        try:
            for fqn, entry in meta.tensors.items():
                key_path = meta.key_paths.get(fqn) or (fqn,)  # torchtitan: ("optimizer", "state.<fqn>.exp_avg")
                found = _state_of(tuple(".".join(map(str, key_path)).split(".")))
                if found is None or found[1] == "step":
                    continue
                param, key = found
                segments = tensor_segments(entry, [chunk_tensor(files, entry, c) for c in entry.chunks])
                out.append((param, key, TensorSource(param, entry.size, entry.dtype, segments, "state")))
        finally:
            files.close()
    return out


def _state_of(path: tuple[str, ...]) -> tuple[str, str] | None:
    """(parameter, state key) of a DCP key path `optim.state.<param>.<key>` or torchtitan's `state.<param>.<key>`."""
    if len(path) >= 4 and path[1] == "state":
        return strip_prefixes(".".join(path[2:-1])), path[-1]
    if len(path) >= 3 and path[0] == "state":
        return strip_prefixes(".".join(path[1:-1])), path[-1]
    return None

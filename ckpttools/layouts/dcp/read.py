"""torch Distributed Checkpoint (DCP) folders, as FSDP2 runs save them, read into the neutral model.

Where they are: a DCP folder holds `.metadata` and `__{rank}_{i}.distcp` files. torchtitan-style runs save
`<run>/step-N/`, accelerate and the Trainer `checkpoint-N/pytorch_model_fsdp_0/` (the model; `optimizer_0/` beside
it). The user may point at the DCP folder, at the folder holding it, or at a run folder of `step-N`/`checkpoint-N`
folders (the newest is read, or `--step`).

What is read: only `.metadata` and the records of the model's tensors. The model is the sub-tree `model` of the
saved state dict when there is one (`get_state_dict`, accelerate: `{"model": ..., "optim": ...}`; OpenRLHF nests it
under `app`), otherwise every tensor outside the optimizer, scheduler and loader entries (`dcp.save(model.state_dict
())`, torchtitan's flattened model). Optimizer chunks are never opened: their state keys come from `.metadata`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, SelectionError, short
from ckpttools.io import dtypes
from ckpttools.io.source import list_names
from ckpttools.layouts.base import ReadOnlyLayout
from ckpttools.layouts.dcp.chunks import ChunkFiles, chunk_tensor, tensor_segments
from ckpttools.layouts.dcp.hf_shards import is_dcp_shard, read_hf_shards
from ckpttools.layouts.dcp.metadata import METADATA_FILE, DcpMetadata, TensorEntry
from ckpttools.layouts.dcp.optim import MODEL_FOLDER_RE, NON_MODEL_ROOTS, optimizer_facts, read_metadata
from ckpttools.layouts.dcp.rankfiles import RANK_FILE_RE as RANK_BIN_RE
from ckpttools.layouts.dcp.rankfiles import rank_files, read_rank_files
from ckpttools.layouts.dcp.ties import tied_weights
from ckpttools.layouts.locate import HF_SIDE_FILES, best_checkpoint, check_selection, refuse_selection
from ckpttools.model.checkpoint import Checkpoint, Param, TensorSource, strip_prefixes
from ckpttools.model.origin import CheckpointLocation, TagFiles
from ckpttools.model.parallel import ParallelLayout

KIND = "dcp"
RANK_FILE_RE = re.compile(r"^__(?P<rank>\d+)_(?P<i>\d+)\.distcp$")
HF_SHARD_RE = re.compile(r"^shard-(?P<rank>\d+)-model-\d+-of-\d+\.safetensors$")  # rank + 1, from 00001
STEP_FOLDER_RE = re.compile(r"^(?:step|checkpoint|global_step|iter|epoch)[-_]?(?P<n>\d+)$")
MODEL_ROOTS = ("model", "module", "models")


@dataclass(frozen=True)
class DcpFolder:
    """A located DCP folder: the folder itself, the checkpoint root (config.json, default output beside it)."""

    folder: Path
    root: Path
    tag: str
    output_dir: Path | None = None


def is_dcp_folder(path: Path) -> bool:
    """A DCP folder: `.metadata` beside `.distcp` files, or safetensors shards carrying DCP sharding metadata."""
    if (path / METADATA_FILE).is_file():
        return True
    shards = sorted(path.glob("*.safetensors"))
    return bool(shards) and is_dcp_shard(shards[0])


def find_dcp(path: Path, *, tag: str | None = None, step: int | None = None, best: bool = False) -> DcpFolder | None:
    """The DCP folder `path` is, holds, or (a run folder of step folders) the newest one / `step` / `best` of; else
    None. A selection that cannot apply to `path` is refused (locate.refuse_selection), never ignored."""
    if not path.is_dir():
        return None
    check_selection(step, best)
    if is_dcp_folder(path):
        parent = path.parent
        named = MODEL_FOLDER_RE.match(path.name) or STEP_FOLDER_RE.match(path.name)
        owned = named or (parent / "config.json").is_file()
        here = DcpFolder(path, parent, path.name) if owned else DcpFolder(path, path, ".")
        own_step = _step_in(path.name) if STEP_FOLDER_RE.match(path.name) else _step_in(parent.name)
        own_tags = [path.name] if MODEL_FOLDER_RE.match(path.name) else []
        refuse_selection(path, "one torch DCP folder", tag=tag, step=step, best=best, own_step=own_step, tags=own_tags)
        return here
    per_rank = rank_files(sorted(p.name for p in path.iterdir()))
    if per_rank:  # accelerate's use_dcp=False files, in the checkpoint folder itself
        refuse_selection(path, "one FSDP checkpoint", step=step, best=best, own_step=_step_in(path.name))
        name = tag if tag is not None else min(per_rank)
        if name not in per_rank:
            raise SelectionError(
                f"--tag {short(name)}: {path} has no FSDP rank files of it (it has {', '.join(per_rank)})"
            )
        return DcpFolder(path, path, name)
    models = _children(path, MODEL_FOLDER_RE)
    if models:
        refuse_selection(path, "one FSDP checkpoint", step=step, best=best, own_step=_step_in(path.name))
        name = tag if tag is not None else min(models, key=lambda n: int(MODEL_FOLDER_RE.match(n)["n"]))  # type: ignore[index]
        if name not in models:
            raise SelectionError(
                f"--tag {short(name)}: {path} has no DCP model folder of it (it has {', '.join(models)})"
            )
        return DcpFolder(path / name, path, name)
    steps = {int(STEP_FOLDER_RE.match(n)["n"]): n for n in _children(path, STEP_FOLDER_RE)}  # type: ignore[index]
    if not steps:
        return None
    if step is not None and step not in steps:
        raise SelectionError(f"--step {step}: {path} has no step {step} (steps: {', '.join(map(str, sorted(steps)))})")
    if best:
        step = best_checkpoint(path, {n: path / name for n, name in steps.items()})
    chosen = path / steps[step if step is not None else max(steps)]
    found = find_dcp(chosen, tag=tag, step=_step_in(chosen.name))
    if found is not None and found.output_dir is None:
        found = DcpFolder(found.folder, found.root, found.tag, output_dir=path)
    return found


def _step_in(name: str) -> int | None:
    """The step a step-N / checkpoint-N folder's name says."""
    m = STEP_FOLDER_RE.match(name)
    return int(m["n"]) if m else None


def _children(path: Path, pattern: re.Pattern[str]) -> list[str]:
    """Sub-folders named by `pattern` that are, or hold, a DCP folder."""
    return [
        child.name
        for child in sorted(path.iterdir())
        if pattern.match(child.name) and child.is_dir() and (is_dcp_folder(child) or _holds_model_folder(child))
    ]


def _holds_model_folder(path: Path) -> bool:
    return any(
        (MODEL_FOLDER_RE.match(c.name) and is_dcp_folder(c)) or RANK_BIN_RE.match(c.name) for c in path.iterdir()
    )


def read_dcp(found: DcpFolder) -> Checkpoint:
    """Open a located DCP folder into the checkpoint model (metadata and the model's chunk headers only)."""
    names = list_names(found.folder)
    per_rank = rank_files(names).get(found.tag)
    if per_rank is not None:  # accelerate's per-rank torch.save files of DTensors
        return _checkpoint(found, list(per_rank.values()), None, read_rank_files(found.folder, per_rank))
    if METADATA_FILE not in names:  # Hugging Face safetensors shards with DCP saved_offsets
        return _checkpoint(found, names, None, read_hf_shards(found.folder, names))
    meta = read_metadata(found.folder)
    model = model_tensors(meta, found.folder)
    files = ChunkFiles(found.folder, set(names))
    try:
        files.check_sizes(meta.file_ends)
        sources = _sources(files, model)
    finally:
        files.close()
    return _checkpoint(found, names, meta, sources)


def model_tensors(meta: DcpMetadata, where: Path) -> dict[str, TensorEntry]:
    """The model's tensors by their names in the model (the state dict's model sub-tree, prefixes stripped)."""
    paths = {fqn: meta.key_paths.get(fqn) or tuple(fqn.split(".")) for fqn in meta.tensors}
    roots = {str(p[0]) for p in paths.values() if p}
    prefix: tuple[str, ...] = ()
    if roots & set(MODEL_ROOTS):
        prefix = (next(r for r in MODEL_ROOTS if r in roots),)
    elif len(roots) == 1 and (only := next(iter(roots))) not in NON_MODEL_ROOTS:
        nested = {str(p[1]) for p in paths.values() if len(p) > 2}
        if nested & set(MODEL_ROOTS):  # OpenRLHF: app.model.*
            prefix = (only, next(r for r in MODEL_ROOTS if r in nested))
    out: dict[str, TensorEntry] = {}
    for fqn, entry in meta.tensors.items():
        path = paths[fqn]
        if prefix:
            if tuple(str(p) for p in path[: len(prefix)]) != prefix:
                continue
            name = ".".join(str(p) for p in path[len(prefix) :])
        elif path and str(path[0]) in NON_MODEL_ROOTS:
            continue
        else:
            name = fqn
        out[strip_prefixes(name)] = entry
    renamed = peft_model_names(list(out))
    if renamed:
        out = {renamed.get(name, name): entry for name, entry in out.items()}
    if not out:
        raise CorruptCheckpointError(
            f"{where} holds no model tensors (its entries: {short(', '.join(sorted(roots)), 120)}); "
            "point at the folder of the model's DCP save"
        )
    return out


# PEFT's saved form (get_peft_model_state_dict, adapter_model.safetensors) drops the adapter name that the model's
# own state dict carries: X.lora_A.weight is X.lora_A.default.weight in the model. DCP saves of adapter-only state
# dicts hold the saved form; the model takes the model form, which every command reads.
_PEFT_SAVED = re.compile(r"^(?P<module>.+\.(?:lora_A|lora_B))\.(?P<leaf>weight|bias)$")
_PEFT_SAVED_BARE = re.compile(r"^(?P<module>.+\.(?:lora_embedding_A|lora_embedding_B|lora_magnitude_vector))$")
PEFT_DEFAULT = "default"


def peft_model_names(names: list[str]) -> dict[str, str]:
    """Saved-form LoRA names -> model-form names (adapter `default`), when every LoRA name is in saved form."""
    out = {}
    for name in names:
        if m := _PEFT_SAVED.match(name):
            out[name] = f"{m['module']}.{PEFT_DEFAULT}.{m['leaf']}"
        elif m := _PEFT_SAVED_BARE.match(name):
            leaf = ".weight" if name.endswith("lora_magnitude_vector") else ""
            out[name] = f"{m['module']}.{PEFT_DEFAULT}{leaf}"
    return out


OPEN_THREADS = 16  # chunk headers are small reads spread over the files: overlap their latency (cold storage)


def _sources(files: ChunkFiles, model: dict[str, TensorEntry]) -> dict[str, TensorSource]:
    """Every model tensor's source; each chunk's zip headers are read by one of a few threads."""
    if sum(len(e.chunks) for e in model.values()) < 64:
        return {name: _source(files, name, entry) for name, entry in model.items()}
    with ThreadPoolExecutor(OPEN_THREADS, thread_name_prefix="ckpt-dcp-open") as pool:
        built = list(pool.map(lambda item: _source(files, *item), model.items()))
    return dict(zip(model, built, strict=True))


def _source(files: ChunkFiles, name: str, entry: TensorEntry) -> TensorSource:
    tensors = [chunk_tensor(files, entry, chunk) for chunk in entry.chunks]
    segments = tensor_segments(entry, tensors)
    return TensorSource(name, entry.size, entry.dtype, segments, "trainable")


def _checkpoint(
    found: DcpFolder, names: Sequence[str], meta: DcpMetadata | None, sources: dict[str, TensorSource]
) -> Checkpoint:
    ranks = {int(m["rank"]) for n in names if (m := RANK_FILE_RE.match(n))}
    ranks |= {int(m["rank"]) - 1 for n in names if (m := HF_SHARD_RE.match(n))}
    ranks |= {int(m["rank"]) for n in names if (m := RANK_BIN_RE.match(n))}
    world = max(ranks) + 1 if ranks else 1
    floating = [s.dtype for s in sources.values() if s.dtype.is_floating_point]
    train_dtype = max(set(floating), key=floating.count) if floating else dtypes.FLOAT32
    optim = optimizer_facts(found.folder, found.root, found.tag, meta)
    ties = tied_weights(sources, optim.trained)
    trained = optim.trained if optim.keys else set(sources)
    params, bit16 = [], {}
    for name, src in sources.items():
        if name in ties:
            continue  # a tied weight's second name: its owner's tensor (shared_params), stored once in an HF folder
        if src.dtype is dtypes.FLOAT32 and train_dtype is not dtypes.FLOAT32:
            # kept fp32 in a 16-bit model on purpose (a buffer, a router bias): 16-bit output keeps it so
            bit16[name] = TensorSource(name, src.shape, src.dtype, src.segments, "buffer")
        elif name in trained:
            params.append(Param(name, name, src.shape, 0, 0, src, {}))
        else:
            bit16[name] = TensorSource(name, src.shape, src.dtype, src.segments, "frozen")
    side = [n for n in ("config.json", *HF_SIDE_FILES) if (found.root / n).is_file()]
    files = TagFiles({}, {}, "", False, layout=KIND, names=tuple(names))
    loc = CheckpointLocation(found.root, found.tag, found.folder, files, found.output_dir, side, _tags(found, names))
    form = "torch DCP" if meta else _form(names)
    details: dict[str, Any] = {"format": form, "world_size": world}
    tp = _tensor_parallel(meta, world)
    if meta and meta.version:
        details["dcp_version"] = meta.version
    step = STEP_FOLDER_RE.match(found.folder.name) or STEP_FOLDER_RE.match(found.root.name)
    return Checkpoint(
        location=loc, zero_stage=0, dp_world_size=world, train_dtype=train_dtype, optimizer_kind="",
        ds_version="", global_steps=int(step["n"]) if step else None, keys=list(sources), params=params,
        optimizer=optim.state(found.folder, found.root, found.tag), bit16=bit16, buffers={}, shared_params=ties,
        frozen_excluded=False,
        layout=ParallelLayout(kind=KIND, dp=world // tp, tp=tp, details=details),
    )  # fmt: skip


def _tensor_parallel(meta: DcpMetadata | None, world: int) -> int:
    """The TP degree of a 2-D (DP, TP) mesh, from the chunk grid: FSDP2 shards dim 0 only, so a tensor cut along a
    later dim too (a row-wise parallel `o_proj`, `down_proj`) shows TP's pieces there; 1 for FSDP2 alone."""
    if meta is None:
        return 1
    cuts = [len({c.offsets[d] for c in e.chunks}) for e in meta.tensors.values() for d in range(1, len(e.size))]
    tp = max(cuts, default=1)
    return tp if 1 < tp < world and world % tp == 0 else 1


def _tags(found: DcpFolder, names: Sequence[str]) -> list[str]:
    """The DCP saves beside this one (step-N, pytorch_model_fsdp_N, per-rank models): what --step/--tag choose."""
    if found.folder == found.root:
        return sorted(rank_files(list(names))) or [found.tag]
    return _children(found.root, STEP_FOLDER_RE) + _children(found.root, MODEL_FOLDER_RE) or [found.tag]


def _form(names: Sequence[str]) -> str:
    if any(RANK_BIN_RE.match(n) for n in names):
        return "per-rank DTensor files (accelerate use_dcp=False)"
    return "torch DCP (Hugging Face safetensors shards)"


class DcpLayout(ReadOnlyLayout):
    """torch Distributed Checkpoint folders (FSDP2, torchtitan, accelerate SHARDED_STATE_DICT): read only."""

    kind = KIND
    title = "torch Distributed Checkpoint (FSDP2)"

    def claims(self, names: Sequence[str]) -> bool:
        return False  # never a DeepSpeed tag folder: found as a folder format (FOLDER)

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_dcp(DcpFolder(loc.tag_dir, loc.root, loc.tag, loc.output_dir))

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        version = f" {parallel['dcp_version']}" if parallel.get("dcp_version") else ""
        return [f"saved by       {parallel.get('world_size', '?')} ranks ({parallel.get('format')}{version})"]


class DcpFolderFormat:
    def recognizes(self, path: Path) -> bool:
        try:
            return find_dcp(path) is not None
        except CheckpointNotFoundError:
            return True  # it is one; `open` says what is missing

    def open(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> Checkpoint:
        return read_dcp(self._find(path, tag, step, best))

    def root(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> tuple[Path, str]:
        found = self._find(path, tag, step, best)
        return found.root, found.tag

    def _find(self, path: Path, tag: str | None, step: int | None, best: bool) -> DcpFolder:
        found = find_dcp(path, tag=tag, step=step, best=best)
        if found is None:
            raise CheckpointNotFoundError(f"{path} holds no torch DCP folder (.metadata)")
        return found


LAYOUT = DcpLayout()
FOLDER = DcpFolderFormat()

"""Megatron-Core `torch_dist` checkpoints (Megatron-LM, Megatron-Bridge, NeMo 2), read into the neutral model.

Where they are: Megatron-LM's save dir holds `latest_checkpointed_iteration.txt` (the iteration, or `release`) and
one `iter_NNNNNNN/` folder per save; each is a torch DCP folder (`.metadata`, `__{rank}_{i}.distcp`) marked by
`metadata.json` (`{"sharded_backend": "torch_dist", ...}`). The user may point at the save dir (the tracker's
iteration, or `--step`) or at an `iter_*` folder.

What is read: `.metadata` (through the DCP allowlist, Megatron's `all_local_plans` included) and the chunks of the
model's tensors: every tensor entry except Transformer Engine's `_extra_state`, the `optimizer.*` state (the
per-bucket default layout and `--dist-ckpt-optim-fully-reshardable`'s per-parameter states alike) and the RNG
state. The names stay Megatron's (`decoder.layers.self_attention.linear_qkv.weight` `[L, ...]`); the architecture
adapters (`ckpttools.adapters`) map them. The run's arguments come from the `common_state` object (megatron-core
>= 0.19: a `torch.save` of the non-sharded entries, stored as bytes inside the DCP) or an older `common.pt`,
unpickled through the allowlist: the `argparse.Namespace`, Megatron's enums and `signal.Signals` become inert
records, torch dtypes ckpttools' own.

Megatron-Bridge's save dir is the same (its `save_checkpoint` writes the tracker file too), plus
`latest_train_state.pt` (the step, as `train_state.pt` in each iteration folder: chooses the iteration when an
older Bridge wrote no tracker). Its distcp files carry no Megatron-LM `args`: the run's config is the `model:`
section of the iteration's `run_config.yaml`, translated to Megatron-LM's argument names by
`layouts.megatron_config` (read with yaml.safe_load: its `_target_` strings stay data).

NeMo 2 saves one folder per checkpoint, `<run>/checkpoints/<name>/{weights,context}/` (nemo.lightning.ckpt_utils'
WEIGHTS_PATH, CONTEXT_PATH), named by its ModelCheckpoint `<model>--<metric>=...-step=<N>-consumed_samples=...`, the
newest also as `...-last`. `weights/` is the torch_dist folder of `MegatronParallel.sharded_state_dict()`: each
Megatron-Core name under the prefix `module.` (the LightningModule's `module`), stripped here so the adapters see
Megatron's names. The config is the `config:` section of `context/model.yaml` (`io_dump` of the LightningModule).
The user may point at the run's checkpoints folder (`--step`, else the newest `-last`, else the highest step), a
checkpoint folder, or its `weights/`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError, short
from ckpttools.io import dtypes, integrity, torchfile
from ckpttools.io.source import list_names, open_stream
from ckpttools.layouts.base import ReadOnlyLayout
from ckpttools.layouts.dcp.chunks import ZIP_MAGIC, ChunkFiles, WindowedSource, chunk_tensor, tensor_segments
from ckpttools.layouts.dcp.metadata import DcpMetadata, StoredChunk, TensorEntry
from ckpttools.layouts.dcp.read import read_metadata
from ckpttools.layouts.megatron_args import ArgsGlobals, args_of
from ckpttools.layouts.megatron_config import RUN_CONFIG, read_nemo_context, read_run_config
from ckpttools.model.checkpoint import Checkpoint, OptimizerState, Param, TensorSource
from ckpttools.model.origin import CheckpointLocation, TagFiles
from ckpttools.model.parallel import ParallelLayout

KIND = "megatron"
TITLE = "Megatron-Core torch_dist"
TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_STATE, LATEST_TRAIN_STATE = "train_state.pt", "latest_train_state.pt"  # Megatron-Bridge's
BRIDGE = "Megatron-Bridge"
BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"  # megatron-core < 0.19: the non-sharded entries in a torch.save file of their own
ITER_RE = re.compile(r"^iter_(?P<n>\d+)$")
COMMON_STATE = "common_state"
NOT_WEIGHTS = re.compile(r"(^|\.)_extra_state(/|$)|^optimizer(\.|/)|^rng_state(/|$)|^common_state(/|$)")
MAX_COMMON_BYTES = 64 << 20  # args, iteration, scheduler: kilobytes
NEMO2, NEMO_WEIGHTS, NEMO_CONTEXT, NEMO_MODEL = "NeMo 2", "weights", "context", "model.yaml"
NEMO_PREFIX = "module."  # MegatronParallel: the LightningModule's `module` (the Megatron-Core model)
NEMO_STEP_RE = re.compile(r"(?:^|-)step=(?P<n>\d+)(?:-|$)")
NEMO_LAST = "-last"


def is_megatron_folder(path: Path) -> bool:
    """A torch_dist folder: `.metadata` beside `metadata.json` naming the torch_dist backend."""
    return (path / ".metadata").is_file() and backend(path) == "torch_dist"


def backend(path: Path) -> str | None:
    """`sharded_backend` of a Megatron `metadata.json`, or None (absent, unreadable, not Megatron's)."""
    try:
        data = json.loads((path / BACKEND_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data.get("sharded_backend") if isinstance(data, dict) else None


def find_megatron(path: Path, step: int | None = None) -> tuple[Path, Path, str] | None:
    """(iteration folder, save dir, tag) that `path` is or holds; None when it is no Megatron checkpoint."""
    if not path.is_dir():
        return None
    if is_nemo_weights(path):
        return path, path.parent.parent, path.parent.name
    if is_nemo_weights(path / NEMO_WEIGHTS):
        return path / NEMO_WEIGHTS, path.parent, path.name
    if is_megatron_folder(path):
        saved_in = path.parent if ITER_RE.match(path.name) else path
        return path, saved_in, path.name
    if nemo := _nemo_checkpoints(path):
        chosen = _nemo_choice(path, nemo, step)
        return chosen / NEMO_WEIGHTS, path, chosen.name
    iters = {int(m["n"]): c for c in sorted(path.iterdir()) if (m := ITER_RE.match(c.name)) and is_megatron_folder(c)}
    if not iters:
        return None
    if step is None:
        step = _tracked(path, iters)
    if step not in iters:
        raise CheckpointNotFoundError(
            f"{path} has no iteration {step} (iterations: {', '.join(map(str, sorted(iters)))})"
        )
    return iters[step], path, iters[step].name


def is_nemo_weights(path: Path) -> bool:
    """A NeMo 2 checkpoint's `weights/`: a torch_dist folder beside `context/`."""
    return path.name == NEMO_WEIGHTS and (path.parent / NEMO_CONTEXT).is_dir() and is_megatron_folder(path)


def _nemo_checkpoints(path: Path) -> list[Path]:
    return [c for c in sorted(path.iterdir()) if c.is_dir() and is_nemo_weights(c / NEMO_WEIGHTS)]


def nemo_step(name: str) -> int | None:
    """The `step=N` of a NeMo ModelCheckpoint folder name, None when the name has none."""
    m = NEMO_STEP_RE.search(name.removesuffix(NEMO_LAST))
    return int(m["n"]) if m else None


def _nemo_choice(path: Path, found: list[Path], step: int | None) -> Path:
    """`--step`'s checkpoint (its `-last` copy only when no other holds that step), else what NeMo resumes
    from: the newest `-last`, else the highest step."""
    steps = {c: nemo_step(c.name) for c in found}
    if step is not None:
        matching = sorted((c for c, s in steps.items() if s == step), key=lambda c: c.name.endswith(NEMO_LAST))
        if not matching:
            listed = sorted({s for s in steps.values() if s is not None})
            raise CheckpointNotFoundError(
                f"{path} has no NeMo checkpoint of step {step} (steps: {', '.join(map(str, listed)) or 'none named'})"
            )
        return matching[0]
    last = [c for c in found if c.name.endswith(NEMO_LAST)]
    pool = last or found
    return max(pool, key=lambda c: (steps[c] if steps[c] is not None else -1, c.stat().st_mtime, c.name))


def _tracked(path: Path, iters: dict[int, Path]) -> int:
    """The iteration Megatron-LM would load: the tracker file's, else the newest folder."""
    try:
        text = (path / TRACKER).read_text().strip()
    except OSError:
        step = train_step(path / LATEST_TRAIN_STATE)
        if step is not None and step not in iters:
            raise CheckpointNotFoundError(
                f"{path / LATEST_TRAIN_STATE} names step {step}, but {path} has no such iter_* folder (it has "
                f"{', '.join(map(str, sorted(iters)))}); the save did not finish or was not copied: pass --step"
            ) from None
        return max(iters) if step is None else step
    if not text.isdigit():
        raise CheckpointNotFoundError(
            f"{path / TRACKER} says {short(text, 40)!s}, not an iteration; pass --step with one of "
            f"{', '.join(map(str, sorted(iters)))}"
        )
    if int(text) not in iters:
        raise CheckpointNotFoundError(
            f"{path / TRACKER} names iteration {int(text)}, but {path} has no such iter_* folder (it has "
            f"{', '.join(map(str, sorted(iters)))}); the save did not finish or was not copied: pass --step"
        )
    return int(text)


def is_weight(fqn: str) -> bool:
    """A model weight: not Transformer Engine's FP8 metadata, optimizer state, RNG state or the common state."""
    return NOT_WEIGHTS.search(fqn) is None


def read_megatron(folder: Path, saved_in: Path, tag: str) -> Checkpoint:
    """Open an iteration folder: the model's tensors by Megatron's names, the run's args in `layout.details`."""
    names = list_names(folder)
    meta = read_metadata(folder)
    model = {fqn: entry for fqn, entry in meta.tensors.items() if is_weight(fqn)}
    if not model:
        raise CorruptCheckpointError(f"{folder} holds no model tensors (only optimizer or extra state)")
    nemo = is_nemo_weights(folder)
    strip = nemo and all(fqn.startswith(NEMO_PREFIX) for fqn in model)
    files = ChunkFiles(folder, set(names))
    try:
        files.check_sizes(meta.file_ends)
        sources = {
            (name := fqn.removeprefix(NEMO_PREFIX) if strip else fqn): _source(files, name, entry)
            for fqn, entry in model.items()
        }
        args, common_problem = _common(files, folder, meta) if not nemo else (None, "")
    finally:
        files.close()
    if nemo:
        return _nemo(folder, saved_in, tag, names, meta, sources)
    source = ""
    if args is None and (folder / RUN_CONFIG).is_file():  # Megatron-Bridge: its run config, not Megatron-LM's args
        source = BRIDGE
        try:
            args, common_problem = read_run_config(folder / RUN_CONFIG), ""
        except CkptError as e:
            common_problem = str(e)
    ckpt = _checkpoint(folder, saved_in, tag, names, meta, sources, args, common_problem)
    if source:
        step = train_step(folder / TRAIN_STATE)
        ckpt.layout.details.update(source=source, args_from=RUN_CONFIG if args else None)
        if step is not None:
            ckpt.layout.details["iteration"] = ckpt.global_steps = step
    return ckpt


def _nemo(
    folder: Path, saved_in: Path, tag: str, names: Sequence[str], meta: DcpMetadata, sources: dict[str, TensorSource]
) -> Checkpoint:
    """A NeMo 2 checkpoint: the config from `context/model.yaml` (its common.pt holds the trainer's state, no
    config), the step from the folder's name."""
    context = folder.parent / NEMO_CONTEXT / NEMO_MODEL
    args, problem = None, f"{context} is missing"
    if context.is_file():
        try:
            args, problem = read_nemo_context(context, _embedding_rows(sources)), ""
        except CkptError as e:
            problem = str(e)
    siblings = [c.name for c in _nemo_checkpoints(saved_in)] or [tag]  # what --step chooses among
    ckpt = _checkpoint(folder, saved_in, tag, names, meta, sources, args, problem, siblings)
    step = nemo_step(tag)
    ckpt.layout.details.update(source=NEMO2, args_from=f"{NEMO_CONTEXT}/{NEMO_MODEL}" if args else None,
                               iteration=step)  # fmt: skip
    ckpt.global_steps = step
    return ckpt


def _embedding_rows(sources: dict[str, TensorSource]) -> int | None:
    embedding = sources.get("embedding.word_embeddings.weight")
    return int(embedding.shape[0]) if embedding is not None else None


def train_step(path: Path) -> int | None:
    """The `step` of a Megatron-Bridge train state (`torch.save` of a dict of 0-dim tensors), None if there is no
    such file or it records none. Bridge writes `latest_train_state.pt` as a copy of the iteration's
    `train_state.pt`: the name torch.save records inside is the original's, so that check is off here."""
    if not path.is_file():
        return None
    try:
        state = torchfile.load_pickle(path, check_identity=False)
    except CkptError as e:
        raise CorruptCheckpointError(f"{path}: not Megatron-Bridge's train state ({short(e, 120)})") from e
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, torchfile.LazyTensor) or step.numel() != 1 or step.dtype != dtypes.INT64:
        return None
    start, length = step.byte_span()
    buf = bytearray(length)
    with torchfile.RecordReader() as reader:
        reader.readinto(step.record, start, memoryview(buf))
        reader.finish()  # the record's CRC-32
    return int.from_bytes(buf, "little", signed=True)


def _source(files: ChunkFiles, name: str, entry: TensorEntry) -> TensorSource:
    tensors = [chunk_tensor(files, entry, chunk) for chunk in entry.chunks]
    return TensorSource(name, entry.size, entry.dtype, tensor_segments(entry, tensors), "trainable")


# --- The run's arguments --------------------------------------------------------------------------------------


def _common(files: ChunkFiles, folder: Path, meta: DcpMetadata) -> tuple[dict[str, Any] | None, str]:
    """The run's args as plain values, and why they could not be read ("" when they were, or were not saved):
    from the `common_state` object (megatron-core >= 0.19), else `common.pt` (older saves)."""
    stored = next((s for fqn, s in sorted(meta.byte_storage.items()) if fqn.startswith(f"{COMMON_STATE}/")), None)
    try:
        args = args_of(_load_common_bytes(files, folder, stored)) if stored is not None else None
        if args is None and (folder / COMMON_FILE).is_file():
            args = args_of(torchfile.load_pickle(folder / COMMON_FILE, extra_globals=ArgsGlobals()))
    except CkptError as e:
        return None, str(e)
    return args, ""


def _load_common_bytes(files: ChunkFiles, folder: Path, stored: StoredChunk) -> Any:
    """Unpickle the torch.save bytes of the common state object (allowlist + the args' stand-ins)."""
    where = folder / stored.relative_path
    if stored.length > MAX_COMMON_BYTES:
        raise CorruptCheckpointError(f"{where}: the common state is {stored.length} bytes: not Megatron's")
    part = WindowedSource(files.source(stored, COMMON_STATE), stored.offset, stored.length)
    if part.head[:4] != ZIP_MAGIC:
        raise CorruptCheckpointError(f"{where}: the common state is not a torch.save record")
    try:
        with contextlib.closing(part), open_stream(part) as fh:
            data, records, _ = torchfile._read_zip(where, fh)
    except CkptError:
        raise
    except Exception as e:  # zipfile raises many kinds on damaged input
        raise CorruptCheckpointError(f"{where}: the common state is damaged ({type(e).__name__})") from e
    unpickler = torchfile._AllowlistUnpickler(data, records, where, extra_globals=ArgsGlobals())
    try:
        return unpickler.load()
    except CkptError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: cannot read the common state ({type(e).__name__})") from e


# --- The neutral model ----------------------------------------------------------------------------------------

OPTIMIZER_PREFIX = "optimizer."


def _checkpoint(
    folder: Path, saved_in: Path, tag: str, names: Sequence[str], meta: DcpMetadata,
    sources: dict[str, TensorSource], args: dict[str, Any] | None, common_problem: str,
    tags: list[str] | None = None,
) -> Checkpoint:  # fmt: skip
    floating = [s.dtype for s in sources.values() if s.dtype.is_floating_point]
    train_dtype = max(set(floating), key=floating.count) if floating else dtypes.FLOAT32
    params = [Param(name, name, src.shape, 0, 0, src, {}) for name, src in sources.items()]
    optim = [fqn for fqn in [*meta.tensors, *meta.byte_entries] if fqn.startswith(OPTIMIZER_PREFIX)]
    optim_bytes = sum(
        e.dtype.itemsize * _numel(e.size) for fqn, e in meta.tensors.items() if fqn.startswith(OPTIMIZER_PREFIX)
    )
    a = args or {}
    tp = int(a.get("tensor_model_parallel_size") or _vocab_shards(meta))
    pp = int(a.get("pipeline_model_parallel_size") or 1)
    ep = int(a.get("expert_model_parallel_size") or 1)
    world = 1 + max((int(m[1]) for n in names if (m := re.match(r"^__(\d+)_\d+\.distcp$", n))), default=0)
    dp = int(a.get("data_parallel_size") or max(1, world // (tp * pp)))
    details: dict[str, Any] = {
        "format": TITLE, "world_size": world, "iteration": a.get("iteration") or _iteration(tag),
        "dcp_version": meta.version, "args": args, "args_problem": common_problem,
        "optimizer_entries": len(optim), "optimizer_layout": _optimizer_layout(optim),
        "integrity": integrity.read_manifest(folder),  # --verify-integrity's digests: consolidate, verify check them
    }  # fmt: skip
    files = TagFiles({}, {}, "", False, layout=KIND, names=tuple(names))
    side = [n for n in ("config.json",) if (saved_in / n).is_file()]
    if tags is None:  # the iterations --step chooses among
        tags = _iterations(saved_in) if saved_in != folder else [tag]
    loc = CheckpointLocation(saved_in, tag, folder, files, None, side, tags)
    optimizer = OptimizerState([], {}, {}, saved=bool(optim), stored_keys=_state_keys(meta),
                               stored_bytes=optim_bytes if optim else 0)  # fmt: skip
    return Checkpoint(
        location=loc, zero_stage=0, dp_world_size=dp, train_dtype=train_dtype, optimizer_kind="", ds_version="",
        global_steps=details["iteration"], keys=list(sources), params=params, optimizer=optimizer, bit16={},
        buffers={}, shared_params={}, frozen_excluded=False,
        layout=ParallelLayout(kind=KIND, dp=dp, tp=tp, pp=pp, ep=ep, details=details),
    )  # fmt: skip


def _state_keys(meta: DcpMetadata) -> list[str]:
    """The optimizer's state keys: `optimizer.state.<key>.<param>` (per parameter) or the last part of a bucket's
    name (`....bucket_idx_0.exp_avg`); `param` is the fp32 master."""
    seen: dict[str, None] = {}
    for fqn in meta.tensors:
        if fqn.startswith("optimizer.state."):
            seen[fqn.split(".")[2]] = None
        elif fqn.startswith("optimizer.distributed."):
            seen[fqn.rsplit(".", 1)[1]] = None
    return list(seen)


def _iterations(saved_in: Path) -> list[str]:
    return sorted(c.name for c in saved_in.iterdir() if ITER_RE.match(c.name) and is_megatron_folder(c))


def _vocab_shards(meta: DcpMetadata) -> int:
    """Without args: TP from the vocabulary-parallel embedding's row blocks (one per TP rank)."""
    entry = meta.tensors.get("embedding.word_embeddings.weight")
    return len({c.offsets[0] for c in entry.chunks}) if entry is not None else 1


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _iteration(tag: str) -> int | None:
    m = ITER_RE.match(tag)
    return int(m["n"]) if m else None


def _optimizer_layout(entries: list[str]) -> str | None:
    if not entries:
        return None
    if any(e.startswith("optimizer.state.") for e in entries):
        return "per-parameter (fully reshardable)"
    return "per-bucket (distributed optimizer)" if any(".distributed." in e for e in entries) else "per-parameter"


class MegatronLayout(ReadOnlyLayout):
    """Megatron-Core `torch_dist` folders: read only (Megatron reshards on load)."""

    kind = KIND
    title = TITLE

    def claims(self, names: Sequence[str]) -> bool:
        return False  # found as a folder format (FOLDER), never as a DeepSpeed tag folder

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        return read_megatron(loc.tag_dir, loc.root, loc.tag)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        args = parallel.get("args")
        title = f"{parallel['source']}, {TITLE}" if parallel.get("source") else TITLE
        saved = f"{parallel.get('world_size', '?')} ranks ({title}, iteration {parallel.get('iteration')})"
        lines = [f"saved by       {saved}"]
        if args:
            lines.append(f"run arguments  {len(args)} ({parallel.get('args_from') or 'common_state'}): hidden "
                         f"{args.get('hidden_size')}, layers {args.get('num_layers')}, vocab "
                         f"{args.get('padded_vocab_size')} padded")  # fmt: skip
        else:
            why = parallel.get("args_problem") or "a plain dist_checkpointing.save holds none"
            lines.append(f"run arguments  none ({why}): consolidate needs --config")
        layout = parallel.get("optimizer_layout")
        lines.append(f"optimizer      {layout + ', ' if layout else ''}{parallel.get('optimizer_entries', 0)} entries, "
                     "not read")  # fmt: skip
        if (listed := integrity.count(parallel.get("integrity"))) is not None:
            lines.append(listed)  # counted only: inspect reads no tensor bytes, so it hashes none
        return lines


class MegatronFolderFormat:
    def recognizes(self, path: Path) -> bool:
        try:
            return find_megatron(path) is not None
        except CheckpointNotFoundError:
            return True  # it is one; `open` says what is missing

    def open(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> Checkpoint:
        return read_megatron(*self._find(path, step))

    def root(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> tuple[Path, str]:
        _, saved_in, name = self._find(path, step)
        return saved_in, name

    def _find(self, path: Path, step: int | None) -> tuple[Path, Path, str]:
        found = find_megatron(path, step)
        if found is None:
            raise CheckpointNotFoundError(f"{path} holds no Megatron torch_dist folder (metadata.json + .metadata)")
        return found


LAYOUT = MegatronLayout()
FOLDER = MegatronFolderFormat()

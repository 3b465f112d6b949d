"""Live DeepSpeed engine -> a folder `from_pretrained` loads, without holding the model on rank 0.

`engine.save_16bit_model` and the Trainer's ZeRO-3 save gather the whole 16-bit model into rank 0's host
memory (`_zero3_consolidated_16bit_state_dict`) and refuse to run unless
`stage3_gather_16bit_weights_on_model_save` is on. Here every name, shape and dtype is known before any
gather (`ds_shape` under ZeRO-3), so the shards and their safetensors headers are planned first; then the
parameters are gathered a bounded group at a time and rank 0 streams each group's bytes straight into the
open shard before the next group is gathered.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from ckpttools.errors import CkptError, OutputError, UnsupportedCheckpointError, UsageError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import CHUNK_BYTES, safetensors_header, written_dtype
from ckpttools.io.staging import StagedFolder, WriteBehind, check_output_dir, move_files_into
from ckpttools.ops import hf

DEFAULT_MAX_GATHER_BYTES = 64 << 20  # 64 MiB: large enough to keep all-gathers efficient, small beside any real model
SAFE_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
IF_EXISTS = ("error", "replace", "add")


@dataclass
class EngineSaveResult:
    """What was written (on rank 0) and what it cost (on this rank)."""

    output_dir: str
    files: list[str]
    dtype: str
    num_tensors: int
    num_parameters: int
    total_size: int
    zero_stage: int | None
    gathers: int  # all-gather rounds (0 unless the weights are ZeRO-3 partitioned)
    peak_gathered_bytes: int  # most bytes of full parameters materialised by our gathers at once
    peak_buffer_bytes: int  # largest host buffer used for a cast or a device->host copy
    omitted_aliases: dict[str, str] = field(default_factory=dict)  # tied alias -> stored owner
    copied_aliases: dict[str, str] = field(default_factory=dict)  # shared but not declared tied: stored twice
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Entry:
    """One tensor of the output: where its values live and how it is written."""

    name: str
    kind: str  # "param" or "buffer"
    tensor: Any  # the live Parameter or buffer
    shape: tuple[int, ...]
    src_dtype: DType
    dtype: DType
    partitioned: bool  # a ZeRO-3 param: its values must be gathered first
    ident: tuple[Any, ...]  # equal for tensors that are the same storage (ties)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# --------------------------------------------------------------------------------------------------
# Distributed helpers (no-ops in a single process)
# --------------------------------------------------------------------------------------------------


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def rank0_decides(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 and hand its result (or its error) to every rank.

    Every step that depends on rank 0's filesystem goes through here, so all ranks take the same branch
    and nobody is left waiting in a collective that rank 0 skipped. Rank 0 re-raises its own exception;
    the other ranks raise the same CkptError, or a CkptError naming what rank 0 hit.
    """
    d = _dist()
    if d is None:
        return fn()
    box: list[Any] = [None]
    error: BaseException | None = None
    if d.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            box[0] = ("error", _portable(e))
    d.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "ok":
        return value
    if error is not None:
        raise error
    raise value


def _portable(e: BaseException) -> CkptError:
    """The exception to raise on the other ranks: rank 0's own CkptError if it pickles, else a summary."""
    if isinstance(e, CkptError) and _pickles(e):
        return e
    return CkptError(f"rank 0 failed: {type(e).__name__}: {e}")


def _pickles(e: CkptError) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - whatever stops it pickling, the summary is sent instead
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Planning: which tensors, in which dtype, under which name (identical on every rank)
# --------------------------------------------------------------------------------------------------


def _is_engine(obj: Any) -> bool:
    return hasattr(obj, "module") and callable(getattr(obj, "zero_optimization_stage", None))


def _unwrap(module: Any) -> Any:
    """The module whose names match the HF keys (torch.compile wraps it in `_orig_mod`)."""
    while hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
        module = module._orig_mod
    return module


def _check_engine(engine: Any) -> None:
    kind = type(engine).__name__
    if kind == "PipelineEngine":
        raise UnsupportedCheckpointError("pipeline-parallel engines are not supported: each stage holds other layers")
    autotp = getattr(engine, "autotp_size", None)
    if callable(autotp) and autotp() > 1:
        raise UnsupportedCheckpointError("AutoTP (tensor parallel) engines are not supported: weights are TP-sharded")
    has_autoep = getattr(engine, "_has_autoep_layers", None)
    if callable(has_autoep) and engine.zero_optimization_stage() == 3 and has_autoep():
        raise UnsupportedCheckpointError(
            "AutoEP + ZeRO-3 is not supported: expert weights are partitioned per replica group"
        )


def _to_dtype(dtype: Any) -> DType | None:
    if dtype is None or isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        found = dtypes.SHORT.get(dtype) or dtypes.BY_NAME.get(dtype.removeprefix("torch."))
        if found is None or not found.is_floating_point:
            raise UsageError(f"dtype must be one of {', '.join(dtypes.SHORT)} (or a torch dtype), not {dtype!r}")
        return found
    return dtypes.from_torch(dtype)


def _ident(t: Any, partitioned: bool) -> tuple[Any, ...]:
    """Same storage -> same key. ZeRO-3 reuses data pointers between gathers, but `ds_id` is unique."""
    if partitioned:
        return ("ds", t.ds_id)
    if t.numel() == 0:
        return ("obj", id(t))
    storage = t.untyped_storage().data_ptr()
    return ("ptr", t.device.type, storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _walk(module: Any) -> Iterator[tuple[str, str, Any]]:
    """(name, kind, tensor) in `state_dict()` order: each module's params, then its persistent buffers."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        base = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None:
                yield base + name, "param", p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield base + name, "buffer", b


def tied_target_matcher(module: Any) -> Callable[[str], bool]:
    """Which names the model re-ties on load (so a copy of them need not be stored).

    transformers v5 lists them, config-aware, in `all_tied_weights_keys` ({target: source}); older versions
    only declare `_tied_weights_keys` per submodule (a list of patterns in v4). Plain modules tie nothing.
    """
    expanded = getattr(module, "all_tied_weights_keys", None)
    if isinstance(expanded, dict):
        names = {str(k) for k in expanded}
        return names.__contains__
    patterns: list[str] = []
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or []
        patterns += [f"{prefix}.{k}" if prefix else str(k) for k in declared]
    if not patterns:
        return lambda name: False
    return lambda name: any(name == p or re.search(p, name) for p in patterns)


def plan_tensors(
    module: Any, dtype: DType | None, *, exclude_frozen_parameters: bool = False
) -> tuple[list[_Entry], dict[str, str], dict[str, str]]:
    """Output tensors in state_dict order, the tied aliases left out, and shared names stored as copies.

    Tensors that are the same parameter (same `ds_id` under ZeRO-3, same storage otherwise) are stored
    once when the model declares all but one of the names as tied targets, as `save_pretrained` does;
    otherwise every name is written (a copy), so `load_state_dict(strict=True)` works on plain modules.
    """
    entries: list[_Entry] = []
    for name, kind, t in _walk(module):
        if exclude_frozen_parameters and kind == "param" and not t.requires_grad:
            continue
        if t.device.type == "meta":
            raise UsageError(f"{name} is on the meta device: there are no values to save")
        partitioned = kind == "param" and hasattr(t, "ds_id")
        shape = tuple(int(d) for d in (t.ds_shape if partitioned else t.shape))
        src = dtypes.from_torch(t.dtype)
        out = src
        if dtype is not None and t.dtype.is_floating_point:
            out = written_dtype(src, kind, dtype)  # the rule `ckpt consolidate` follows
        entries.append(_Entry(name, kind, t, shape, src, out, partitioned, _ident(t, partitioned)))
    groups: dict[tuple[Any, ...], list[str]] = {}
    for e in entries:
        groups.setdefault(e.ident, []).append(e.name)
    is_target = tied_target_matcher(module)
    omitted: dict[str, str] = {}
    copied: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        kept = [n for n in names if not is_target(n)] or names[:1]
        owner = kept[0]
        omitted.update({n: owner for n in names if n not in kept})
        copied.update(dict.fromkeys(kept[1:], owner))
    return [e for e in entries if e.name not in omitted], omitted, copied


def plan_gathers(shards: dict[str, list[_Entry]], max_gather_bytes: int) -> list[list[tuple[str, _Entry]]]:
    """Split the write order (shard by shard) into groups whose partitioned params fit `max_gather_bytes`.

    A param larger than the budget gets a group of its own. Tensors that need no gather never split a group.
    """
    groups: list[list[tuple[str, _Entry]]] = []
    current: list[tuple[str, _Entry]] = []
    held: set[tuple[Any, ...]] = set()
    size = 0
    for fname, entries in shards.items():
        for e in entries:
            extra = e.numel * e.src_dtype.itemsize if e.partitioned and e.ident not in held else 0
            if current and extra and size + extra > max_gather_bytes:
                groups.append(current)
                current, held, size = [], set(), 0
            current.append((fname, e))
            if e.partitioned:
                held.add(e.ident)
            size += extra
    if current:
        groups.append(current)
    return groups


# --------------------------------------------------------------------------------------------------
# Writing (rank 0)
# --------------------------------------------------------------------------------------------------


class _ShardWriter:
    """Rank 0's side: opens each shard when its first tensor comes, header first, then bytes in order.

    A failure is remembered, not raised, so rank 0 keeps joining the remaining gathers and the error can be
    raised on every rank at the end instead of leaving the other ranks blocked in an all-gather.
    """

    def __init__(self, folder: Path, shards: dict[str, list[_Entry]], chunk_bytes: int) -> None:
        self.folder = folder
        self.shards = shards
        self.chunk_bytes = chunk_bytes
        self.fh: IO[bytes] | None = None
        self.behind: WriteBehind | None = None
        self.fname: str | None = None
        self.expected = 0
        self.written = 0
        self.error: BaseException | None = None
        self.peak_buffer = 0

    def write(self, fname: str, entry: _Entry) -> None:
        if self.error is not None:
            return
        try:
            if fname != self.fname:
                self._open(fname)
            self._write_tensor(entry)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by the caller
            self.error = e
            self._close_quietly()

    def _open(self, fname: str) -> None:
        self.finish_file()
        header = safetensors_header(self.shards[fname], {"format": "pt"})
        self.fh = open(self.folder / fname, "wb")  # noqa: SIM115 - closed in finish_file
        self.behind = WriteBehind(self.fh)
        self.fname = fname
        self.fh.write(header)
        self.expected = len(header) + sum(e.nbytes for e in self.shards[fname])
        self.written = len(header)

    def _write_tensor(self, entry: _Entry) -> None:
        import torch

        t = entry.tensor.data if entry.partitioned else entry.tensor.detach()
        if t.numel() != entry.numel:
            raise RuntimeError(f"{entry.name}: {t.numel()} elements after the gather, expected {entry.numel}")
        out = entry.dtype.to_torch()
        if t.is_contiguous():
            flat = t.reshape(-1)
        else:  # a strided buffer: one contiguous copy
            flat = t.contiguous().reshape(-1)
            self.peak_buffer = max(self.peak_buffer, flat.numel() * flat.element_size())
        step = max(1, self.chunk_bytes // max(entry.src_dtype.itemsize, entry.dtype.itemsize))
        assert self.fh is not None
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            copied = False
            if chunk.dtype != out:
                chunk, copied = chunk.to(out), True  # round to nearest even, as DeepSpeed's fp32 -> 16-bit copy
            if chunk.device.type != "cpu":
                chunk, copied = chunk.cpu(), True
            if copied:
                self.peak_buffer = max(self.peak_buffer, chunk.numel() * chunk.element_size())
            data = chunk.view(torch.uint8).numpy()
            self.fh.write(memoryview(data))
            if self.behind is not None:
                self.behind.wrote()
            self.written += data.nbytes

    def finish_file(self) -> None:
        if self.fh is None:
            return
        fh, self.fh = self.fh, None
        try:
            if self.behind is not None:
                self.behind.finish()
        finally:
            self.behind = None
            fh.close()
        if self.written != self.expected:
            raise RuntimeError(f"{self.fname}: wrote {self.written} bytes, the header promises {self.expected}")

    def _close_quietly(self) -> None:
        if self.behind is not None:
            self.behind.settle()
            self.behind = None
        if self.fh is not None:
            with contextlib.suppress(OSError):
                self.fh.close()
            self.fh = None


# --------------------------------------------------------------------------------------------------
# config.json and friends
# --------------------------------------------------------------------------------------------------


def _config_dict(module: Any, config: Any) -> tuple[dict[str, Any] | None, bool]:
    """(config as a dict, whether it came from the module) - None if there is none to write."""
    from_module = config is None
    if config is None:
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_json_string"):
            return None, False
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"config {path} could not be read as JSON ({e})") from e
    elif isinstance(config, dict):
        data = dict(config)
    elif hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string(use_diff=True))
    else:
        kind = type(config).__name__
        raise UsageError(f"config must be a transformers config, a dict or a config.json path, not {kind}")
    return data, from_module


def _write_side_files(folder: Path, module: Any, config: Any, dtype: DType, notes: list[str]) -> list[str]:
    data, from_module = _config_dict(module, config)
    if data is None:
        return []
    if from_module and _is_pretrained_model(module):
        data["architectures"] = [type(module).__name__]  # as save_pretrained sets it
    path = folder / "config.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    hf.write_config(path, path, dtype)
    files = ["config.json"]
    gen = getattr(module, "generation_config", None) if from_module else None
    can_generate = getattr(module, "can_generate", None)
    if gen is not None and callable(can_generate) and can_generate():
        try:
            gen.save_pretrained(folder)
            files.append("generation_config.json")
        except Exception as e:  # noqa: BLE001 - the weights are still good
            notes.append(f"generation_config.json not written ({type(e).__name__}: {e})")
    return files


def _is_pretrained_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def _conversion_note(module: Any) -> str | None:
    """transformers v5 renames/fuses some weights in memory (MoE experts); save_pretrained reverts that."""
    if not _is_pretrained_model(module):
        return None
    try:
        conversions = getattr(module, "_weight_conversions", None)
        if conversions is None:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange

            mapping = get_model_conversion_mapping(module, add_legacy=False)
            conversions = [c for c in mapping if not isinstance(c, PrefixChange)]
    except Exception:  # noqa: BLE001 - internal API; only a note depends on it
        return None
    if not conversions:
        return None
    return (
        f"{type(module).__name__} converts weights on load in transformers v5; they are written under their "
        "in-memory names, which v5 loads but older loaders may not (save_pretrained would revert the conversion)"
    )


# --------------------------------------------------------------------------------------------------
# Output folder
# --------------------------------------------------------------------------------------------------


def _prepare(out: Path, if_exists: str, needed: int, notes: list[str]) -> StagedFolder:
    """Rank 0: check the target and make an empty staging folder beside it."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and if_exists == "error":
        raise OutputError(f"output folder {out} already exists and is not empty; pass if_exists='replace' or 'add'")
    if if_exists != "add" or not out.is_dir():  # replace: only a folder ckpt wrote, or an empty one
        out = check_output_dir(out, None, overwrite=True)
    return StagedFolder(out, overwrite=True, needed_bytes=needed, notes=notes)


def _publish_into(tmp: Path, out: Path) -> None:
    """`add` mode, as save_pretrained writes into a folder: drop stale safetensors weights (they would shadow the
    new ones), then move the files in, the file from_pretrained looks for last."""
    for old in out.iterdir():
        if old.is_file() and SAFE_WEIGHTS.fullmatch(old.name):
            old.unlink()
    move_files_into(tmp, out, last=("model.safetensors.index.json", "model.safetensors"))


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def save_pretrained_from_engine(
    engine: Any,
    out_dir: Path | str,
    *,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    config: Any = None,
    max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
    if_exists: str = "error",
    exclude_frozen_parameters: bool = False,
    adapter: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> EngineSaveResult:
    """Write the engine's weights as a Hugging Face folder (safetensors shards, index, config.json).

    Collective: call it on every rank, at the same point, like `engine.save_checkpoint`. Rank 0 writes.

    Under ZeRO-3 the parameters are gathered with `deepspeed.zero.GatheredParameters(group,
    modifier_rank=None)` a group at a time (groups hold up to `max_gather_bytes` of full parameters, in the
    order they are written), and rank 0 streams each group into the open shard before the next gather.
    Shards, headers and the index are planned from `ds_shape` before anything is gathered. This works
    whatever `stage3_gather_16bit_weights_on_model_save` says; that flag only governs DeepSpeed's own
    `save_16bit_model` and the Trainer's save. Under ZeRO-0/1/2 every rank holds the full 16-bit weights
    already, so nothing is gathered or copied: rank 0 writes from the live parameters.

    Costs:
        - Communication: one all-gather per group (about `total size / max_gather_bytes` rounds), the
          same volume `save_16bit_model` moves, and no broadcast back (nothing is modified). None under
          ZeRO-0/1/2.
        - Memory, every rank: at most one gathered group, i.e. max(`max_gather_bytes`, largest parameter),
          on the device the parameters are gathered to (host memory on CPU), freed when the group is
          re-partitioned. `save_16bit_model` gathers a module at a time too, but keeps a host copy of every
          tensor on rank 0: the whole 16-bit model.
        - Host memory, rank 0: one `chunk_bytes` buffer for a cast (e.g. `dtype="fp32"`) or a
          device-to-host copy; zero-copy when the weights are already on the CPU in the output dtype.
        - Disk: the output size once, in a temporary sibling folder renamed into place when complete.

    Args:
        engine: a `DeepSpeedEngine` (e.g. `trainer.model_wrapped`), or its module (ZeRO-3 is then detected
            from the parameters' `ds_id`).
        out_dir: output folder. Written into a staging folder beside it (`.<name>.ckpt-staging.<host>.<pid>...`)
            and published whole, with `.ckpt-manifest.json` listing what was written.
        dtype: "bf16", "fp16", "fp32" or a torch dtype for floating parameters. Default: each keeps the
            dtype the engine trains it in, which is what `engine.save_16bit_model` writes. Integer and
            bool tensors always keep theirs; floating buffers keep theirs unless fp32 is asked for (or they
            are 16-bit), as `ckpt consolidate` does.
        max_shard_size: largest shard, e.g. "5GB" (huggingface_hub's splitting).
        config: config.json source: a transformers config, a dict, or a path; default `module.config`.
            No config.json is written for a module without one.
        max_gather_bytes: budget of full ZeRO-3 parameters gathered at once (default 64 MiB); a parameter
            larger than that is gathered alone. Smaller means less memory and more all-gather rounds.
        if_exists: what to do when `out_dir` exists and is not empty: "error", "replace" (the whole folder,
            only when ckpt wrote it: its content matches its `.ckpt-manifest.json`; anything else is refused and
            nothing deleted) or "add" (write the weights and config.json into it as save_pretrained does, removing
            stale `model*.safetensors` files that would shadow the new ones; used for a Trainer `checkpoint-N/`).
        exclude_frozen_parameters: leave out parameters with requires_grad=False, as
            `save_16bit_model(exclude_frozen_parameters=True)` does (e.g. PEFT base weights).
        adapter: the module is a PEFT model (LoRA): write the adapter folder PEFT's `save_pretrained` writes
            instead (`adapter_model.safetensors` under PEFT's saved names and `adapter_config.json`; adapters
            other than `default` in sub-folders of their name), from the live (gathered) weights. Only the
            adapter tensors are gathered; `max_shard_size`, `config` and `exclude_frozen_parameters` do not
            apply (one file per adapter, no model card).
        chunk_bytes: size of the cast / copy buffer.

    Returns:
        An EngineSaveResult on every rank (file names are those rank 0 wrote; the peaks are this rank's).

    Raises:
        OutputError: the folder exists (with if_exists="error"), cannot be written, or the disk is too
            small; raised on every rank before anything is gathered.
        UnsupportedCheckpointError: pipeline, AutoTP or AutoEP+ZeRO-3 engines.
        UsageError: a bad `dtype`, `if_exists` or `config`.
        Any error rank 0 hits while writing is raised on every rank after the last gather.

    Example:
        >>> save_pretrained_from_engine(engine, "out/model", max_shard_size="2GB").files  # on every rank
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors',
         'model.safetensors.index.json', 'config.json', 'generation_config.json']
    """
    if if_exists not in IF_EXISTS:
        raise UsageError(f"if_exists must be one of {', '.join(IF_EXISTS)}, not {if_exists!r}")
    if max_gather_bytes <= 0 or chunk_bytes <= 0:
        raise UsageError("max_gather_bytes and chunk_bytes must be positive")
    out_dtype = _to_dtype(dtype)
    if _is_engine(engine):
        _check_engine(engine)
        module, stage = _unwrap(engine.module), int(engine.zero_optimization_stage())
    else:
        module, stage = _unwrap(engine), None
    out = Path(out_dir).absolute()

    omitted: dict[str, str] = {}
    copied: dict[str, str] = {}
    adapter_configs: dict[str, Any] = {}
    if adapter:
        entries, shards, adapter_configs = _plan_adapters(module, out_dtype)
    else:
        entries, omitted, copied = plan_tensors(module, out_dtype, exclude_frozen_parameters=exclude_frozen_parameters)
        if not entries:
            raise UsageError("the module has no parameters or persistent buffers to save")
        shards = hf.plan_shards(entries, "safetensors", max_shard_size)
    partitioned = any(e.partitioned for e in entries)
    if stage is None and partitioned:
        stage = 3
    groups = plan_gathers(shards, max_gather_bytes)
    num_parameters = _count_parameters(entries)
    written_dtype = out_dtype or _main_dtype(entries)
    notes = [n for n in [_conversion_note(module)] if n]
    if copied:
        some = ", ".join(sorted(copied)[:3])
        notes.append(f"{len(copied)} shared tensors not declared tied are stored as copies ({some})")

    rank = _rank()
    staged: list[StagedFolder] = []  # rank 0's temp folder

    def prepare() -> Path:
        staged.append(_prepare(out, if_exists, sum(e.nbytes for e in entries), notes))
        for fname in shards:  # adapters other than `default` go to sub-folders
            (staged[0].path / fname).parent.mkdir(parents=True, exist_ok=True)
        return staged[0].path

    tmp: Path = rank0_decides(prepare)
    writer = _ShardWriter(tmp, shards, chunk_bytes) if rank == 0 else None
    peak_gathered = _gather_and_write(engine, groups, writer)

    def finish() -> list[str]:
        assert writer is not None
        try:
            if writer.error is None:
                writer.finish_file()
            if writer.error is not None:
                raise writer.error
            names = list(shards)
            if adapter:
                names += _write_adapter_configs(tmp, adapter_configs)
            else:  # the index (config.json comes from the live module below, not from a folder)
                names += hf.write_folder_files(tmp, shards, total_parameters=num_parameters, model_config=None,
                                               dtype=written_dtype)  # fmt: skip
            if not adapter:
                names += _write_side_files(tmp, module, config, written_dtype, notes)
            if if_exists == "add" and staged[0].out.is_dir():
                staged[0].wait_for_disk()
                _publish_into(tmp, staged[0].out)
            else:
                staged[0].commit()
            return names
        except BaseException:
            staged[0].abort()
            raise

    files = rank0_decides(finish)
    d = _dist()
    if d is not None:
        d.barrier()
    return EngineSaveResult(
        output_dir=str(out),
        files=files,
        dtype=written_dtype.name,
        num_tensors=len(entries),
        num_parameters=num_parameters,
        total_size=sum(e.nbytes for e in entries),
        zero_stage=stage,
        gathers=sum(1 for g in groups if any(e.partitioned for _, e in g)),
        peak_gathered_bytes=peak_gathered,
        peak_buffer_bytes=writer.peak_buffer if writer else 0,
        omitted_aliases=omitted,
        copied_aliases=copied,
        notes=notes,
    )


def _plan_adapters(module: Any, dtype: DType | None) -> tuple[list[_Entry], dict[str, list[_Entry]], dict[str, Any]]:
    """A PEFT model's adapter tensors under PEFT's saved names, one file per adapter, and each adapter's config."""
    from ckpttools.ops import peft

    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise UsageError("adapter=True needs a PEFT model (a PeftModel, with peft_config); this module has none")
    entries, _, _ = plan_tensors(module, dtype)
    shards: dict[str, list[_Entry]] = {}
    folders = {name: ("" if name == peft.DEFAULT_ADAPTER else f"{name}/") for name in configs}
    for e in entries:
        owner = peft.adapter_of(e.name)
        if owner is not None and owner in folders:
            renamed = dataclasses.replace(e, name=peft.saved_name(e.name, owner))
            shards.setdefault(folders[owner] + peft.ADAPTER_WEIGHTS, []).append(renamed)
    if not shards:
        raise UsageError(f"the PEFT model holds no tensors of its adapters {', '.join(configs)}")
    kept = {name: cfg for name, cfg in configs.items() if folders[name] + peft.ADAPTER_WEIGHTS in shards}
    return [e for group in shards.values() for e in group], shards, kept


def _write_adapter_configs(tmp: Path, configs: dict[str, Any]) -> list[str]:
    """adapter_config.json as PeftModel.save_pretrained writes it: a copy of the config with inference_mode on."""
    from ckpttools.ops import peft

    names = []
    for name, config in configs.items():
        folder = "" if name == peft.DEFAULT_ADAPTER else f"{name}/"
        saved = copy.deepcopy(config)
        saved.inference_mode = True
        saved.save_pretrained(str(tmp / folder))
        names.append(folder + peft.ADAPTER_CONFIG)
    return names


def _gather_and_write(engine: Any, groups: Sequence[list[tuple[str, _Entry]]], writer: _ShardWriter | None) -> int:
    """Gather each group (ZeRO-3), let rank 0 write it, release it. Returns the peak bytes gathered."""
    optimizer = getattr(engine, "optimizer", None) if _is_engine(engine) else None
    partitioned = any(e.partitioned for g in groups for _, e in g)
    prologue = getattr(optimizer, "checkpoint_event_prologue", None) if partitioned else None
    epilogue = getattr(optimizer, "checkpoint_event_epilogue", None) if partitioned else None
    if callable(prologue):
        prologue()  # as DeepSpeed's own consolidation: everything partitioned, hpZ secondaries dropped
    peak = 0
    try:
        for group in groups:
            params = _unique(e.tensor for _, e in group if e.partitioned and not _available(e.tensor))
            with _gathered(params):
                peak = max(peak, sum(p.data.numel() * p.data.element_size() for p in params))
                if writer is not None:
                    for fname, entry in group:
                        writer.write(fname, entry)
    finally:
        if callable(epilogue):
            epilogue()  # re-gathers the persistent (small) params, as after DeepSpeed's own save
    return peak


def _available(p: Any) -> bool:
    """Persistent ZeRO-3 params are always held in full; they need no gather (and must stay held)."""
    status = getattr(p, "ds_status", None)
    return status is not None and status.name == "AVAILABLE"


def _unique(params: Iterable[Any]) -> list[Any]:
    seen: dict[int, Any] = {}
    for p in params:
        seen.setdefault(p.ds_id, p)
    return list(seen.values())


@contextlib.contextmanager
def _gathered(params: list[Any]) -> Iterator[None]:
    if not params:
        yield
        return
    import deepspeed

    # modifier_rank=None: nobody modifies the values, so nothing is broadcast back on exit; the full
    # tensors are freed when the params are re-partitioned.
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def _count_parameters(entries: Sequence[_Entry]) -> int:
    """Parameters written, each shared parameter counted once."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for e in entries:
        if e.kind == "param" and e.ident not in seen:
            seen.add(e.ident)
            total += e.numel
    return total


def _main_dtype(entries: Sequence[_Entry]) -> DType:
    """The floating dtype holding most parameter bytes: what config.json should say."""
    sizes: dict[DType, int] = {}
    for e in entries:
        if e.kind == "param" and e.dtype.is_floating_point:
            sizes[e.dtype] = sizes.get(e.dtype, 0) + e.nbytes
    return max(sizes, key=lambda d: sizes[d]) if sizes else dtypes.FLOAT32

"""Drop-in for DeepSpeed's `zero_to_fp32.py`: the same command line, functions and output, on ckpttools' reader.

    python -m ckpttools.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB]
                                     [-t TAG] [--exclude_frozen_parameters] [-d]

writes what DeepSpeed 0.19.8's script writes: `pytorch_model.bin` (or `model.safetensors`), or when the
tensors exceed `--max_shard_size` `pytorch_model-00001-of-0000N.bin` ... with `pytorch_model.bin.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {...}}`, `indent=2, sort_keys=True`, byte for byte DeepSpeed's),
split by huggingface_hub's planner exactly as DeepSpeed calls it. The keys are DeepSpeed's, in its order: the
persistent buffers, the frozen params (only where the checkpoint records `frozen_param_shapes`: ZeRO-2/3, not
ZeRO-1), the trainable params from their fp32 masters, then the tied aliases. Every floating tensor is written
as float32 and integer buffers keep their dtype, as DeepSpeed does.

Where DeepSpeed fails, this works:
- tied weights with `--safe_serialization` (DeepSpeed's `save_file` raises on shared tensors): safetensors has
  no aliasing, so each tied name is stored as its own copy of the owner's values. The file then holds the same
  keys as DeepSpeed's `.bin` and `get_fp32_state_dict_from_zero_checkpoint`, so `load_state_dict(strict=True)`
  works without knowing about the tie (`from_pretrained` re-ties as usual); the cost is the alias's bytes.
- BF16_Optimizer checkpoints (DeepSpeed: "is not a zero checkpoint"), universal checkpoints, a Trainer
  `output_dir` or a tag folder given as CHECKPOINT_DIR.

Memory stays bounded: tensors are streamed into both formats, the `.bin` files by ckpt's own torch.save writer
(io/torchwriter.py: the pickle torch.save writes, without torch), so the base install runs this. A checkpoint of
another format (torch DCP / FSDP2) is refused in one line naming `ckpt consolidate`, and OUTPUT_DIR may not be the
checkpoint's own folder (DeepSpeed's script writes there).
Every record read is checked against its CRC-32 before anything is moved into OUTPUT_DIR, and the ZeRO-1/2
module weights are compared with the fp32 masters first, so a damaged or mixed-up checkpoint fails with one
line instead of being written. Files are written into a private temporary folder inside OUTPUT_DIR and each
is renamed into place only when all are complete; other files in OUTPUT_DIR are left alone (as DeepSpeed does).

The module also exports DeepSpeed's functions with its signatures: `get_fp32_state_dict_from_zero_checkpoint`,
`convert_zero_checkpoint_to_fp32_state_dict` and `load_state_dict_from_zero_checkpoint`.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ckpttools.errors import OutputError, UnsupportedCheckpointError, UsageError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import OutputTensor, ProgressFn, read_tensor, write_safetensors
from ckpttools.io.staging import check_files_replaceable, staged_files
from ckpttools.io.torchfile import RecordReader
from ckpttools.io.torchwriter import NewTensor, whole_tensor, write_torch_files
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import UNIVERSAL, folder_format_of, layouts, open_checkpoint
from ckpttools.model.checkpoint import Checkpoint, TensorSource, strip_prefixes
from ckpttools.ops import hf

DEFAULT_MAX_SHARD_SIZE = "5GB"
LOAD_CHUNK_BYTES = 64 << 20  # load_state_dict_from_zero_checkpoint: fp32 bytes materialised per load_state_dict call

__all__ = [
    "GatheredTensor",
    "cli",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


# --- What DeepSpeed's zero_to_fp32 puts in the state dict ---------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Entry:
    """One tensor of the state dict; tied names share one entry (DeepSpeed: the very same tensor object)."""

    source: TensorSource
    dtype: DType  # as get_fp32_state_dict_from_zero_checkpoint returns it

    @property
    def file_dtype(self) -> DType:
        """As the converter writes it: floating tensors as float32, integer buffers unchanged."""
        return dtypes.FLOAT32 if self.source.dtype.is_floating_point else self.source.dtype

    @property
    def file_nbytes(self) -> int:
        return self.source.numel() * self.file_dtype.itemsize


def _plan(ckpt: Checkpoint, exclude_frozen_parameters: bool) -> OrderedDict[str, _Entry]:
    """DeepSpeed's keys, in its order, with the names as the checkpoint stores them (no prefix stripped).

    Buffers (module order, floating ones as float32), frozen params (`frozen_param_shapes` order, the training
    dtype; none when the checkpoint records no frozen_param_shapes, as in ZeRO-1), trainable params
    (`param_shapes` order, fp32 masters), then each `shared_params` alias whose owner is present.
    """
    entries: OrderedDict[str, _Entry] = OrderedDict()
    if ckpt.layout.kind != "dp":  # layouts DeepSpeed's script cannot read: the whole model, as `consolidate` writes
        for src in ckpt.sources(dtypes.FLOAT32):
            entries[src.name] = _Entry(src, dtypes.FLOAT32 if src.dtype.is_floating_point else src.dtype)
        for alias, owner in ckpt.shared_params.items():
            if owner in entries:
                entries[alias] = entries[owner]
        return entries
    model = ckpt.model_state
    module = model.get("module") or {}
    for raw in module:
        buf = ckpt.buffers.get(strip_prefixes(raw))
        if buf is not None:
            entries[raw] = _Entry(buf, dtypes.FLOAT32 if buf.dtype.is_floating_point else buf.dtype)
    if not exclude_frozen_parameters:
        for raw in model.get("frozen_param_shapes") or {}:
            src = ckpt.bit16[strip_prefixes(raw)]
            entries[raw] = _Entry(src, src.dtype)
    for p in ckpt.params:
        entries[p.file_name] = _Entry(p.fp32, dtypes.FLOAT32)
    for alias, owner in (model.get("shared_params") or {}).items():
        if owner in entries:
            entries[alias] = entries[owner]
    return entries


def _dropped_frozen(ckpt: Checkpoint, exclude_frozen_parameters: bool) -> list[str]:
    """Frozen params the checkpoint holds but DeepSpeed's format leaves out (ZeRO-1 records no frozen shapes)."""
    if exclude_frozen_parameters or ckpt.model_state.get("frozen_param_shapes") is not None:
        return []
    return ckpt.frozen_names


def _open(
    checkpoint_dir: Any, tag: str | None, exclude_frozen_parameters: bool
) -> tuple[Checkpoint, OrderedDict[str, _Entry]]:
    ckpt = open_deepspeed(checkpoint_dir, tag=tag)
    return ckpt, _plan(ckpt, exclude_frozen_parameters)


def open_deepspeed(checkpoint_dir: Any, *, tag: str | None = None) -> Checkpoint:
    """The checkpoint at `checkpoint_dir`, refused when it is not a DeepSpeed one (the drop-ins' input).

    DeepSpeed's scripts read DeepSpeed checkpoints only; a folder of another format ckpt reads (torch DCP / FSDP2)
    would otherwise fail somewhere inside with a misleading message, or be converted as if it were one. The one
    line says what it is and what reads it. Checked before anything but the folder's names and small files is read.
    """
    path = Path(checkpoint_dir)
    fmt = folder_format_of(path)
    if fmt is not None and fmt is not UNIVERSAL:  # DeepSpeed's universal folders are DeepSpeed's; the rest is not
        # the layout living beside the folder format names it (torch DCP: "torch Distributed Checkpoint (FSDP2)")
        title = next((lay.title for lay in layouts() if type(lay).__module__ == type(fmt).__module__), "")
        what = f"is a {title}, not a DeepSpeed checkpoint" if title else "is not a DeepSpeed checkpoint"
        raise UnsupportedCheckpointError(
            f"{path} {what}: DeepSpeed's scripts and these drop-ins read DeepSpeed checkpoints only; run "
            f"`ckpt consolidate {shlex.quote(str(path))}` instead"
        )
    return open_checkpoint(path, tag=tag)


# --- Lazy tensors ------------------------------------------------------------------------------------------


class _Reads:
    """One reader shared by the lazy tensors of a state dict; its files close when the last tensor is gone.

    Every record a tensor touches is verified against its CRC-32 before the tensor is handed out, so no
    damaged byte reaches the caller; each record is checksummed once, whatever the order of the reads.
    """

    def __init__(self) -> None:
        self.reader = RecordReader()
        self.lock = threading.Lock()
        self.verified: set[tuple[Path, str]] = set()
        weakref.finalize(self, self.reader.close)

    def read(self, source: TensorSource, dtype: DType) -> Any:
        with self.lock:
            tensor = read_tensor(source, self.reader, dtype)
            for seg in source.segments:
                record = seg.tensor.record
                if (record.path, record.name) not in self.verified:
                    self.reader.verify(record)
                    self.verified.add((record.path, record.name))
        return tensor


class GatheredTensor:
    """A consolidated tensor not read yet, as DeepSpeed's `lazy_mode=True` returns them.

    `.contiguous()` reads it (from every rank's partition) into a new torch tensor; nothing is cached, so
    memory holds only the tensors the caller keeps. `.shape` (a torch.Size) and `.dtype` (a torch dtype)
    are known without reading, which is what DeepSpeed's `to_torch_tensor(..., return_empty_tensor=True)`
    and huggingface_hub's shard planner need.
    """

    def __init__(self, source: TensorSource, dtype: DType, reads: _Reads) -> None:
        self._source, self._dtype, self._reads = source, dtype, reads

    @property
    def shape(self) -> Any:
        import torch

        return torch.Size(self._source.shape)

    @property
    def dtype(self) -> Any:
        return self._dtype.to_torch()

    @property
    def ndim(self) -> int:
        return len(self._source.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self._source.numel()

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    def contiguous(self) -> Any:
        """The tensor's values, read now (a CPU torch tensor of `shape` and `dtype`)."""
        return self._reads.read(self._source, self._dtype)

    def __repr__(self) -> str:
        return f"GatheredTensor(shape={list(self._source.shape)}, dtype={self.dtype})"


# --- DeepSpeed's functions ---------------------------------------------------------------------------------


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The consolidated state dict of a ZeRO checkpoint, as DeepSpeed's function of the same name returns it.

    Same keys in the same order, same dtypes (fp32 masters for trainable params, frozen params in their stored
    training dtype, floating buffers as float32, integer buffers unchanged), and tied names mapped to the very
    same tensor object. With `lazy_mode=True` the values are `GatheredTensor`s: call `.contiguous()` on one to
    read it; memory then stays bounded by what the caller keeps.

    Raises:
        CkptError subclasses (FileNotFoundError / ValueError ones for missing or damaged checkpoints).
    """
    ckpt, entries = _open(checkpoint_dir, tag, exclude_frozen_parameters)
    check_module_copies(ckpt)
    if lazy_mode:
        reads = _Reads()
        lazy: dict[int, GatheredTensor] = {}
        out: dict[str, Any] = OrderedDict()
        for name, e in entries.items():
            if id(e) not in lazy:
                lazy[id(e)] = GatheredTensor(e.source, e.dtype, reads)
            out[name] = lazy[id(e)]
        return out
    tensors: dict[int, Any] = {}
    state: dict[str, Any] = {}
    with RecordReader() as reader:
        for name, e in entries.items():
            if id(e) not in tensors:
                tensors[id(e)] = read_tensor(e.source, reader, e.dtype)
            state[name] = tensors[id(e)]
        reader.finish()  # CRC-32 of every record read
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the consolidated fp32 weights into `output_dir` as DeepSpeed's function does (see the module doc)."""
    _convert(checkpoint_dir, output_dir, max_shard_size, safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(
    model: Any, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> Any:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (`strict=False`), as DeepSpeed does.

    The model ends in the state DeepSpeed's function leaves it in, but the weights are read and loaded a few
    modules at a time (about 64 MB of fp32 per `load_state_dict` call, each module's keys together), so the
    whole fp32 state dict never sits in memory beside the model. Size mismatches raise one RuntimeError after
    everything else was loaded, as `load_state_dict` itself does.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, lazy_mode=True)
    model = model.cpu()
    errors: list[str] = []
    for chunk in _load_chunks(state):
        read: dict[int, Any] = {}
        tensors = {}
        for name, lazy in chunk.items():
            if id(lazy) not in read:
                read[id(lazy)] = lazy.contiguous()
            tensors[name] = read[id(lazy)]
        try:
            model.load_state_dict(tensors, strict=False)
        except RuntimeError as e:
            errors.append(str(e))
        del tensors, read
    if errors:
        raise RuntimeError("\n".join(errors))
    return model


def _load_chunks(state: Mapping[str, GatheredTensor], budget: int | None = None) -> Iterator[dict[str, Any]]:
    """The state dict in pieces of about `budget` bytes; all keys of one module stay in the same piece."""
    budget = LOAD_CHUNK_BYTES if budget is None else budget
    by_module: dict[str, list[str]] = {}
    for name in state:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    chunk: dict[str, Any] = {}
    size = 0
    for names in by_module.values():
        nbytes = sum(state[n].numel() * state[n].dtype.itemsize for n in names)
        if chunk and size + nbytes > budget:
            yield chunk
            chunk, size = {}, 0
        chunk.update({n: state[n] for n in names})
        size += nbytes
    if chunk:
        yield chunk


# --- Writing -----------------------------------------------------------------------------------------------


@dataclass
class _Split:
    filename_to_tensors: dict[str, list[str]]
    tensor_to_filename: dict[str, str]
    metadata: dict[str, Any]

    @property
    def is_sharded(self) -> bool:
        return len(self.filename_to_tensors) > 1


def _split(entries: Mapping[str, _Entry], weights_name: str, max_shard_size: int | str | None) -> _Split:
    """DeepSpeed's shard plan: huggingface_hub's planner over the fp32 sizes, tied names kept with their owner.

    DeepSpeed plans on `torch.empty` stand-ins whose storage ids come from their data pointers: tied names
    share one (the same stand-in), and every empty tensor has data pointer 0, so all empty tensors count as one
    storage and go into the shard of the first. The ids here reproduce both.
    """
    if max_shard_size is None:
        names = list(entries)
        return _Split({weights_name: names}, dict.fromkeys(names, weights_name), {})
    from huggingface_hub import split_state_dict_into_shards_factory

    stem, ext = os.path.splitext(weights_name)
    try:
        split = split_state_dict_into_shards_factory(
            dict(entries),
            get_storage_size=lambda e: e.file_nbytes,
            get_storage_id=lambda e: ("empty",) if e.source.numel() == 0 else id(e),
            filename_pattern=stem + "{suffix}" + ext,
            max_shard_size=max_shard_size,
        )
    except ValueError as e:
        raise UsageError(
            f"--max_shard_size {max_shard_size!r} is not a size: give digits followed by a unit (KB, MB, GB, TB), "
            "like 5GB"
        ) from e
    return _Split(split.filename_to_tensors, split.tensor_to_filename, split.metadata)


@dataclass
class _Written:
    output_dir: Path
    files: list[str]
    num_tensors: int
    total_size: int
    notes: list[str]


def _convert(
    checkpoint_dir: Any,
    output_dir: Any,
    max_shard_size: int | str | None,
    safe_serialization: bool,
    tag: str | None,
    exclude_frozen_parameters: bool,
    *,
    debug: Callable[[str], None] | None = None,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> _Written:
    ckpt, entries = _open(checkpoint_dir, tag, exclude_frozen_parameters)
    notes = []
    dropped = [n for n in _dropped_frozen(ckpt, exclude_frozen_parameters) if n not in entries]  # said if so only
    if dropped:
        notes.append(
            f"{len(dropped)} frozen parameters ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}) are "
            "left out, as DeepSpeed's zero_to_fp32 leaves them out of this checkpoint (it records no "
            "frozen_param_shapes); `ckpt consolidate` includes them"
        )
    tied = [n for n, e in entries.items() if e.source.name != strip_prefixes(n)]
    if safe_serialization and tied:
        notes.append(
            f"tied weights ({', '.join(tied[:3])}) are stored as their own copies: safetensors cannot alias tensors"
        )
    return write_entries(
        ckpt, entries, Path(checkpoint_dir), Path(output_dir), max_shard_size, safe_serialization, notes,
        debug=debug, on_start=on_start, on_progress=on_progress,
    )  # fmt: skip


def write_entries(
    ckpt: Checkpoint,
    entries: Mapping[str, _Entry],
    checkpoint_dir: Path,
    output_dir: Path,
    max_shard_size: int | str | None,
    safe_serialization: bool,
    notes: list[str],
    *,
    debug: Callable[[str], None] | None = None,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> _Written:
    """Write the state dict `entries` into `output_dir` as DeepSpeed's converters do (zero_to_fp32, zero_to_torch).

    `.bin` shards are written by ckpt's own torch.save writer (no torch needed, tensors streamed); tied names are
    one tensor within a shard, as torch.save stores the one tensor object DeepSpeed maps them to.
    """
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    split = _split(entries, weights_name, max_shard_size)
    if debug:
        debug(f"zero stage {ckpt.zero_stage}, dp {ckpt.dp_world_size}, tag {ckpt.location.tag}")
        for name, e in entries.items():
            debug(
                f"{name}: {list(e.source.shape)} {e.file_dtype.name} ({e.source.kind}) "
                f"-> {split.tensor_to_filename[name]}"
            )
    check_module_copies(ckpt)  # before anything is written
    out = _output_dir(output_dir, ckpt, checkpoint_dir)
    files = list(split.filename_to_tensors)
    index_name = f"{weights_name}.index.json"
    check_files_replaceable(out, files + ([index_name] if split.is_sharded else []))  # DeepSpeed's would replace them
    unique = {id(e): e for e in entries.values()}
    if safe_serialization:  # every name is its own tensor
        written_bytes = sum(entries[n].file_nbytes for names in split.filename_to_tensors.values() for n in names)
    else:  # tied names are one tensor within a shard
        shards = split.filename_to_tensors.values()
        written_bytes = sum(
            e.file_nbytes for names in shards for e in {id(entries[n]): entries[n] for n in names}.values()
        )
    last = (index_name, weights_name)  # the file a loader looks for goes in once the rest is there
    with staged_files(out, needed_bytes=written_bytes, notes=notes, last=last) as tmp:
        if on_start:
            on_start(written_bytes)
        with RecordReader() as reader:
            if safe_serialization:
                for fname, names in split.filename_to_tensors.items():
                    group = [OutputTensor(n, entries[n].source, entries[n].file_dtype) for n in names]
                    write_safetensors(tmp / fname, group, reader, metadata={"format": "pt"}, on_progress=on_progress)
            else:
                bins = [(tmp / fname, _bin_state(names, entries)) for fname, names in split.filename_to_tensors.items()]
                write_torch_files(bins, reader, on_progress=on_progress)
            reader.finish()  # CRC-32 of every record read: nothing is moved into place before this passes
        if split.is_sharded:  # DeepSpeed's index: huggingface_hub's metadata (total_size only)
            files.append(hf.write_index_json(tmp, index_name, split.metadata, split.tensor_to_filename))
    return _Written(out, files, len(entries), sum(e.file_nbytes for e in unique.values()), notes)


def _output_dir(output_dir: Path, ckpt: Checkpoint, checkpoint_dir: Path) -> Path:
    """The absolute output folder, refused when it is the checkpoint itself or lies among its rank files.

    DeepSpeed's script writes wherever it is told, the checkpoint folder included; here the input is never
    written into: not the folder given, not the checkpoint root (holding `latest`), not the tag folder or a
    folder inside it. A new folder inside the checkpoint root (`python zero_to_fp32.py . output_dir/`, DeepSpeed's
    own example) adds files beside the checkpoint's without touching them, so it stays allowed.
    """
    out = output_dir.absolute()
    if out.is_symlink() and not out.exists():
        raise OutputError(
            f"output_dir {out} is a symlink to {out.resolve()}, which does not exist; nothing was written"
        )
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"output_dir {out} exists and is not a folder")
    resolved = out.resolve()
    tag_dir = ckpt.location.tag_dir.resolve()
    inputs = {checkpoint_dir.resolve(), ckpt.location.root.resolve(), tag_dir}
    if resolved in inputs or tag_dir in resolved.parents:
        raise OutputError(
            f"output_dir {out} is the checkpoint's own folder: the drop-ins never write into their input "
            "(DeepSpeed's script would); choose a new folder, such as one beside the checkpoint"
        )
    return out


def _bin_state(names: Sequence[str], entries: Mapping[str, _Entry]) -> dict[str, NewTensor]:
    """One `.bin` shard's state dict as DeepSpeed's torch.save gets it, tensors still to be read: tied names are the
    same tensor object, so the file stores it once and torch.load gives them one storage."""
    made: dict[int, NewTensor] = {}
    state = {}
    for name in names:
        e = entries[name]
        if id(e) not in made:
            made[id(e)] = whole_tensor(e.source, e.source.shape, e.file_dtype)
        state[name] = made[id(e)]
    return state


# --- The command line --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with DeepSpeed's options; a usage error is one `Error:` line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        from ckpttools.cli._common import echo_error

        echo_error(f"{message} (see {self.prog} --help)")
        sys.exit(UsageError.exit_code)


def run_cli(body: Callable[[], None], *, debug: bool = False) -> int:
    """The `ckpt` CLI's error boundary, for these argparse entry points."""
    from ckpttools.cli._common import run_guarded

    return run_guarded(body, debug=debug)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m ckpttools.zero_to_fp32",
        description="Consolidate a DeepSpeed ZeRO checkpoint into fp32 weights (a drop-in for DeepSpeed's "
        "zero_to_fp32.py: same options, same files).",
    )
    parser.add_argument(
        "checkpoint_dir", type=str, help="path to the desired checkpoint folder, e.g., path/checkpoint-12"
    )
    parser.add_argument(
        "output_dir",
        type=str,
        help="directory to the pytorch fp32 state_dict output files (e.g. path/checkpoint-12-output/)",
    )
    parser.add_argument(
        "--max_shard_size",
        type=str,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="The maximum size of one output file before the weights are sharded: digits followed by a unit "
        "(like 5MB). Default 5GB.",
    )
    parser.add_argument(
        "--safe_serialization", default=False, action="store_true", help="Save with safetensors instead of torch.save."
    )
    parser.add_argument(
        "-t", "--tag", type=str, default=None, help="checkpoint tag, e.g., global_step1 (default: latest)"
    )
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="list every tensor; show tracebacks on errors")
    return parser


def run_drop_in(name: str, args: argparse.Namespace, convert: Callable[..., _Written]) -> int:
    """A drop-in script's run: `convert(debug=, on_start=, on_progress=)` under progress, its notes, one summary
    line, the exit code (shared by zero_to_fp32 and zero_to_torch)."""

    def debug(line: str) -> None:
        print(line, file=sys.stderr)

    def body() -> None:
        from ckpttools.cli._common import echo_notes, human_size, progress_callbacks

        with progress_callbacks(name, quiet=False) as progress:
            result = convert(debug=debug if args.debug else None, **progress)
        echo_notes(result.notes)
        print(
            f"Wrote {result.num_tensors} tensors ({human_size(result.total_size)}) to {result.output_dir}: "
            f"{', '.join(result.files)}"
        )

    return run_cli(body, debug=args.debug)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m ckpttools.zero_to_fp32 ...`; returns the exit code."""
    args = _parser().parse_args(argv)
    return run_drop_in("zero_to_fp32", args, functools.partial(
        _convert, args.checkpoint_dir, args.output_dir, args.max_shard_size, args.safe_serialization, args.tag,
        args.exclude_frozen_parameters,
    ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(cli())

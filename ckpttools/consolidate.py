"""ZeRO checkpoint -> a folder `from_pretrained` loads: safetensors (or .bin) shards, index, config.

Output goes to a temporary sibling folder that is renamed into place only when complete and verified;
inputs are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, hf
from .dtypes import DType
from .errors import CkptError, OutputError, UsageError
from .reader import TensorSource, ZeroCheckpoint, read_checkpoint
from .torchfile import RecordReader
from .writer import OutputTensor, ProgressFn, output_dtype, read_tensor, write_pt, write_safetensors

DTYPES = dtypes.SHORT
FORMATS = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}
SPACE_MARGIN = 64 << 20


@dataclass
class ConsolidateResult:
    output_dir: str
    files: list[str]
    dtype: str
    format: str
    num_parameters: int
    num_tensors: int
    total_size: int
    source: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_output_dir(ckpt: ZeroCheckpoint) -> Path:
    """`hf-<checkpoint>` beside the checkpoint (a name Trainer's checkpoint rotation never matches)."""
    root = ckpt.location.root
    return root.parent / f"hf-{root.name}"


def plan_tensors(ckpt: ZeroCheckpoint, dtype: DType, *, hf_folder: bool) -> tuple[list[OutputTensor], dict[str, str]]:
    """Output tensors in model order, and the tied aliases left out.

    In a Hugging Face folder whose config ties word embeddings, a tied alias (lm_head.weight -> wte.weight)
    is stored once, under its owner, as save_pretrained does; from_pretrained re-ties it. Bare checkpoints
    (and configs with tie_word_embeddings false) keep every alias as its own tensor, so
    `load_state_dict(strict=True)` works.
    """
    config = hf.read_config(ckpt.location.root / "config.json") or {}
    hf_folder = hf_folder and config.get("tie_word_embeddings", True) is not False
    tensors = [OutputTensor(s.name, s, output_dtype(s, dtype)) for s in ckpt.sources(dtype)]
    by_name = {t.name: t for t in tensors}
    omitted: dict[str, str] = {}
    for alias, owner in ckpt.shared_params.items():
        if owner not in by_name:
            continue
        if hf_folder:
            omitted[alias] = owner
        else:
            src = by_name[owner].source
            aliased = TensorSource(alias, src.shape, src.dtype, src.segments, src.kind)
            tensors.append(OutputTensor(alias, aliased, by_name[owner].dtype))
    return tensors, omitted


def plan_shards(tensors: list[OutputTensor], fmt: str, max_shard_size: int | str) -> dict[str, list[OutputTensor]]:
    from huggingface_hub import split_state_dict_into_shards_factory

    stem, ext = FORMATS[fmt]
    split = split_state_dict_into_shards_factory(
        {t.name: t for t in tensors},
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=stem + "{suffix}" + ext,
        max_shard_size=max_shard_size,
    )
    by_name = {t.name: t for t in tensors}
    return {fname: [by_name[n] for n in names] for fname, names in split.filename_to_tensors.items()}


def check_output_dir(out: Path, input_root: Path, overwrite: bool) -> Path:
    """Refuse an output folder that exists (without overwrite), or that overlaps the input checkpoint."""
    out = out.absolute()
    root = input_root.resolve()
    resolved = out.resolve()
    if resolved == root or root in resolved.parents:
        raise OutputError(f"output folder {out} lies inside the checkpoint {root}; choose a folder outside it")
    if resolved in root.parents:
        raise OutputError(f"output folder {out} contains the checkpoint {root}; writing there could destroy the input")
    if out.exists() and not overwrite:
        raise OutputError(
            f"output folder {out} already exists; pass --overwrite to replace it, or choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder")
    return out


def check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + SPACE_MARGIN:
        raise OutputError(
            f"not enough free disk space in {folder}: the output needs {_gb(needed)}, {_gb(free)} is free; "
            "free some space or pass --out on another disk"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class _KeyCheck:
    """Builds the model on the meta device in a child process while the shards are written."""

    def __init__(self, config: Path | None) -> None:
        self.proc = hf.start_model_keys(config) if config else None

    def cancel(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def problems(self, ckpt: ZeroCheckpoint, written: list[str], omitted: dict[str, str], notes: list[str]) -> None:
        if self.proc is None:
            return
        result = hf.finish_model_keys(self.proc)
        if isinstance(result, str):
            notes.append(f"keys not checked against the model: {result}")
            return
        missing, unexpected = hf.key_problems(result, written, omitted)
        if ckpt.frozen_excluded:
            notes.append(
                f"{len(missing)} base-model weights are absent (the checkpoint was saved without frozen params)"
            )
            missing = []
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
            if unexpected:
                parts.append(
                    f"unexpected {len(unexpected)} ({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''})"
                )
            raise CkptError(
                f"the consolidated keys do not match {result.architecture} from config.json: {'; '.join(parts)}. "
                "Is config.json from the same model?"
            )


def consolidate(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    to: str = "safetensors",
    dtype: str = "fp32",
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
    check_existing: bool = True,
    check_keys: bool = False,
    on_progress: ProgressFn | None = None,
    on_start: Any = None,
) -> ConsolidateResult:
    """Consolidate a ZeRO checkpoint into a Hugging Face-loadable folder.

    Args:
        path: checkpoint folder (see `read_checkpoint`).
        out_dir: output folder; defaults to `hf-<checkpoint name>` beside the checkpoint.
        to: "safetensors" or "pt".
        dtype: "fp32" (bit-identical to zero_to_fp32) or "bf16"/"fp16" (bit-identical to the engine's
            16-bit weights when that is the training dtype).
        max_shard_size: largest shard, e.g. "5GB".
        overwrite: replace an existing output folder.
        check_existing: compare with 16-bit weights a Trainer already saved beside the shards.
        check_keys: also build the model from config.json on the meta device (in a child process that
            imports transformers and torch: about 3 s and 350 MB more) and fail on missing or unexpected
            keys. `ckpt verify` always does this check.
        on_progress: called with the number of bytes written after each chunk.
        on_start: called once with the total bytes to write.

    Example:
        >>> consolidate("out/checkpoint-500", "out/model", dtype="bf16").files
        ['model.safetensors', 'config.json', ...]
    """
    if to not in FORMATS:
        raise UsageError(f"--to must be one of {', '.join(FORMATS)}, not {to!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    ckpt = read_checkpoint(path, tag=tag, step=step, best=best)
    out = check_output_dir(Path(out_dir) if out_dir else default_output_dir(ckpt), ckpt.location.root, overwrite)
    out_dtype = DTYPES[dtype]
    config = ckpt.location.root / "config.json"
    hf_folder = config.is_file()
    keycheck = _KeyCheck(config if (hf_folder and check_keys) else None)
    tensors, omitted = plan_tensors(ckpt, out_dtype, hf_folder=hf_folder)
    shards = plan_shards(tensors, to, max_shard_size)
    total = sum(t.nbytes for t in tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out.parent, total)
    notes: list[str] = []
    if ckpt.frozen_excluded:
        notes.append("this checkpoint holds only trainable (e.g. LoRA) weights: base weights are absent, as saved")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if on_start:
            on_start(total)
        with RecordReader() as reader:
            files = _write_shards(tmp, shards, to, reader, on_progress)
            keycheck.problems(ckpt, [t.name for t in tensors], omitted, notes)
            files += _write_hf_files(tmp, ckpt, shards, tensors, to, out_dtype)
            if check_existing and hf_folder:
                notes += compare_with_existing(ckpt, reader)
            reader.finish()  # CRC-32 of every record read; raises before anything is published
        publish(tmp, out)
    except BaseException:
        keycheck.cancel()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConsolidateResult(
        output_dir=str(out),
        files=files,
        dtype=dtype,
        format=to,
        num_parameters=_param_count(tensors, ckpt),
        num_tensors=len(tensors),
        total_size=total,
        source=source_summary(ckpt),
        notes=notes,
    )


def _param_count(tensors: list[OutputTensor], ckpt: ZeroCheckpoint) -> int:
    """Parameters written, each tied weight counted once."""
    return sum(t.source.numel() for t in tensors if t.source.kind != "buffer" and t.name not in ckpt.shared_params)


def source_summary(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    return {
        "path": str(ckpt.location.root),
        "tag": ckpt.location.tag,
        "zero_stage": ckpt.zero_stage,
        "dp_world_size": ckpt.dp_world_size,
        "train_dtype": ckpt.train_dtype.name,
        "ds_version": ckpt.ds_version,
        "global_steps": ckpt.global_steps,
    }


def _write_shards(
    tmp: Path, shards: dict[str, list[OutputTensor]], to: str, reader: RecordReader, on_progress: ProgressFn | None
) -> list[str]:
    for fname, group in shards.items():
        if to == "safetensors":
            write_safetensors(tmp / fname, group, reader, metadata={"format": "pt"}, on_progress=on_progress)
        else:
            write_pt(tmp / fname, group, reader, on_progress=on_progress)
    return list(shards)


def _write_hf_files(
    tmp: Path,
    ckpt: ZeroCheckpoint,
    shards: dict[str, list[OutputTensor]],
    tensors: list[OutputTensor],
    to: str,
    dtype: DType,
) -> list[str]:
    files = []
    if len(shards) > 1:
        stem, ext = FORMATS[to]
        index = {
            "metadata": {
                "total_size": sum(t.nbytes for t in tensors),
                "total_parameters": _param_count(tensors, ckpt),
            },
            "weight_map": {t.name: fname for fname, group in shards.items() for t in group},
        }
        name = f"{stem}{ext}.index.json"
        (tmp / name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(name)
    root = ckpt.location.root
    if (root / "config.json").is_file():
        hf.write_config(root / "config.json", tmp / "config.json", dtype)
        files.append("config.json")
    files += hf.copy_side_files(root, ckpt.location.side_files, tmp)
    return files


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an old output is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def compare_with_existing(ckpt: ZeroCheckpoint, reader: RecordReader) -> list[str]:
    """Check 16-bit weights a Trainer saved beside the shards against the shards themselves."""
    from safetensors import safe_open

    files = hf.existing_weight_files(ckpt.location.root)
    if not files:
        return []
    import torch

    notes = []
    differing: list[str] = []
    seen: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                seen.add(key)
                name = ckpt.shared_params.get(key, key)
                src = ckpt.masters.get(name) or ckpt.bit16.get(name) or ckpt.buffers.get(name)
                if src is None:
                    differing.append(f"{key} (not in the shards)")
                    continue
                saved = f.get_tensor(key)
                saved_dtype = dtypes.from_torch(saved.dtype)
                if src.kind == "trainable" and name in ckpt.bit16 and ckpt.bit16[name].dtype is saved_dtype:
                    src = ckpt.bit16[name]
                ours = read_tensor(src, reader, saved_dtype if saved_dtype.is_floating_point else None)
                if ours.shape != saved.shape or not torch.equal(ours, saved):
                    differing.append(key)
    absent = [k for k in ckpt.keys if k not in seen and k not in ckpt.shared_params]
    where = ", ".join(p.name for p in files)
    if differing or absent:
        notes.append(
            f"the weights already saved beside the shards ({where}) differ from the shards: "
            f"{len(differing)} differing ({', '.join(differing[:3])}), {len(absent)} absent ({', '.join(absent[:3])})"
        )
    else:
        notes.append(f"the weights already saved beside the shards ({where}) match the shards exactly")
    return notes

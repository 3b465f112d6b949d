"""Where things are in a DeepSpeed checkpoint: folders, tags and per-rank file names.

`classify_tag_files` and `check_tag_name` are pure (names in, names out); `locate` looks at the disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

from ckpttools.errors import (
    CheckpointNotFoundError,
    CkptError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    short,
)
from ckpttools.model.origin import TagFiles

OPTIM_RE = re.compile(r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
# PipelineModule: one file per layer, `-model_XX` only when the stage is also tensor parallel
PIPE_LAYER_RE = re.compile(r"^layer_(?P<layer>\d+)(-model_(?P<mp>\d+))?-model_states\.pt$")
# DeepSpeed-MoE: one file per global expert (older DeepSpeed: no layer_ prefix, expp_rank_* optimizer files)
EXPERT_RE = re.compile(r"^(layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
EXPERT_OPTIM_RE = re.compile(r"^expp_rank_(?P<ep>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Files a Trainer folder carries that belong with the consolidated model.
HF_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "adapter_config.json",
)


def check_tag_name(tag: str) -> str:
    """A tag as one plain folder name inside the checkpoint (it may come from `latest`, so never trust it).

    `./global_step5` and `global_step5/` mean the folder DeepSpeed means and come back as `global_step5`.
    """
    tag = tag.strip()
    if not tag or tag in (".", "..") or len(tag) > 255:
        raise CheckpointNotFoundError(f"empty or invalid tag {short(tag)}")
    if "\x00" in tag:
        raise UnsafeCheckpointError(f"tag {short(tag)} contains a NUL byte")
    parts = []
    for pure in (PurePosixPath(tag), PureWindowsPath(tag)):
        if pure.is_absolute() or pure.drive or pure.root or len(pure.parts) != 1 or ".." in pure.parts:
            raise UnsafeCheckpointError(
                f"tag {short(tag)} is not a plain folder name inside the checkpoint; refusing to follow it"
            )
        parts.append(pure.parts[0])
    return parts[0]


def classify_tag_files(names: Sequence[str], where: str = "", layout: str = "dp") -> TagFiles:
    """Sort a tag folder's file names into per-rank model and optimizer files, for the layout that claimed them
    (`registry.detect_layout`); layouts other than "dp" classify `names` further in their readers. Every file is
    kept by its full rank coordinates, so a file of another stage or TP rank is never taken for a duplicate.

    Raises:
        UnsupportedCheckpointError: NVMe-offloaded optimizer state.
        CheckpointNotFoundError: no optimizer or model-state files at all.
    """
    where = where or "the tag folder"
    if "offloaded_tensors" in names:
        raise UnsupportedCheckpointError(
            f"{where} holds NVMe-offloaded optimizer state (offloaded_tensors/); its fp32 weights live in "
            "per-rank swap files that ckpttools cannot read offline. Load it in DeepSpeed and save without NVMe offload"
        )
    optim: dict[tuple[int, int], str] = {}
    prefixes: set[str] = set()
    zero3_models: dict[tuple[int, int], str] = {}
    plain_models: dict[int, str] = {}
    for name in names:
        if m := OPTIM_RE.match(name):
            key = (int(m["dp"]), int(m["mp"]))
            if key in optim:
                raise CkptError(
                    f"{where} holds two optimizer files for data-parallel rank {key[0]}, model-parallel rank "
                    f"{key[1]} ({optim[key]}, {name}): files of two runs are mixed; re-copy the folder from the run"
                )
            optim[key] = name
            prefixes.add(m["prefix"] or "")
        elif m := ZERO3_MODEL_RE.match(name):
            zero3_models[(int(m["dp"]), int(m["mp"]))] = name
        elif m := MODEL_RE.match(name):
            plain_models[int(m["mp"])] = name
    if len(prefixes) > 1:
        raise CkptError(
            f"{where} mixes optimizer files with different prefixes {sorted(prefixes)}; remove the stale ones"
        )
    prefix = prefixes.pop() if prefixes else ""
    if layout == "dp" and not optim:
        hint = (
            "it holds model states only (saved without optimizer state?)"
            if zero3_models
            else "no *_model_states.pt either"
        )
        raise CheckpointNotFoundError(
            f"{where} has no *_optim_states.pt files: {hint}; this is not a ZeRO checkpoint tag folder"
        )
    slice0_optim = {dp: n for (dp, mp), n in optim.items() if mp == 0}
    if zero3_models:
        models = {dp: n for (dp, mp), n in zero3_models.items() if mp == 0}
        return TagFiles(models, slice0_optim, prefix, True, layout, tuple(names))
    if layout == "dp" and not plain_models:
        raise CheckpointNotFoundError(f"{where} has no *_model_states.pt file (expected mp_rank_00_model_states.pt)")
    models = {0: plain_models[0]} if 0 in plain_models else {}
    return TagFiles(models, slice0_optim, prefix, False, layout, tuple(names))


def model_parallel_ranks(names: Sequence[str]) -> set[int]:
    """The model-parallel ranks (`mp_rank_NN`) the optimizer and model-states files of a tag folder name."""
    ranks: set[int] = set()
    for name in names:
        if m := OPTIM_RE.match(name) or ZERO3_MODEL_RE.match(name) or MODEL_RE.match(name):
            ranks.add(int(m["mp"]))
    return ranks


def _trainer_checkpoints(folder: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for child in sorted(folder.iterdir()):
        if (m := CHECKPOINT_DIR_RE.match(child.name)) and child.is_dir():
            step = int(m[1])
            if step in found:
                raise CkptError(
                    f"{folder} holds two folders for step {step} ({found[step].name}, {child.name}); pass one of them"
                )
            found[step] = child
    return found


def _lightning_checkpoints(folder: Path) -> list[Path]:
    """Lightning's ModelCheckpoint with DeepSpeedStrategy: each `<name>.ckpt/` is a DeepSpeed save_dir."""
    return sorted(p for p in folder.iterdir() if p.suffix == ".ckpt" and p.is_dir() and (p / "latest").is_file())


def _tag_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))


def _pick_trainer_checkpoint(folder: Path, step: int | None, best: bool) -> Path:
    ckpts = _trainer_checkpoints(folder)
    if not ckpts:
        raise CheckpointNotFoundError(f"{folder} has no checkpoint-N folders")
    if best:
        newest = ckpts[max(ckpts)]
        state_file = newest / "trainer_state.json"
        try:
            state = json.loads(state_file.read_bytes().decode("utf-8-sig"))
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointNotFoundError(f"cannot read {state_file} to find the best checkpoint: {e!s:.100}") from e
        best_path = state.get("best_model_checkpoint") if isinstance(state, dict) else None
        if best_path is not None and not isinstance(best_path, str):
            raise CheckpointNotFoundError(
                f"{state_file} records best_model_checkpoint {short(best_path, 40)}, not a path"
            )
        if not best_path:
            raise CheckpointNotFoundError(
                f"{state_file} records no best_model_checkpoint (the run had no metric_for_best_model); use --step"
            )
        m = CHECKPOINT_DIR_RE.match(Path(best_path).name)
        if not m or int(m[1]) not in ckpts:
            raise CheckpointNotFoundError(f"the best checkpoint {best_path} is no longer in {folder} (rotated away?)")
        return ckpts[int(m[1])]
    if step is not None:
        if step not in ckpts:
            raise CheckpointNotFoundError(f"{folder} has no checkpoint-{step}; found steps {sorted(ckpts)}")
        return ckpts[step]
    return ckpts[max(ckpts)]


_Found = tuple[Path, Path | None, str | None]  # (root, Trainer output_dir or None, tag implied by the path)


def _save_dir(path: Path, step: int | None, best: bool) -> _Found | None:
    """DeepSpeed's save_dir (accelerate's and Lightning's too): `latest` and the tag folders."""
    return (path, None, None) if (path / "latest").is_file() or _tag_dirs(path) else None


def _tag_folder(path: Path, step: int | None, best: bool) -> _Found | None:
    """A tag folder itself (global_step500/)."""
    if any(path.glob("*_optim_states.pt")) or any(path.glob("*_model_states.pt")):
        return path.parent, None, path.name
    return None


def _trainer_output_dir(path: Path, step: int | None, best: bool) -> _Found | None:
    """A Hugging Face Trainer output_dir: its checkpoint-N/ folders, the newest, --step or --best."""
    return (_pick_trainer_checkpoint(path, step, best), path, None) if _trainer_checkpoints(path) else None


def _lightning_folder(path: Path, step: int | None, best: bool) -> _Found | None:
    """Lightning's ModelCheckpoint folder: one `<name>.ckpt/` save_dir."""
    lightning = _lightning_checkpoints(path)
    if len(lightning) > 1:
        raise CkptError(
            f"{path} holds {len(lightning)} Lightning checkpoints ({', '.join(p.name for p in lightning[:4])}"
            f"{', ...' if len(lightning) > 4 else ''}); pass the one to read"
        )
    return (lightning[0], None, None) if lightning else None


# What a user may point at, asked in order: the first that recognises the folder finds the checkpoint root.
LOCATORS = (_save_dir, _tag_folder, _trainer_output_dir, _lightning_folder)


def _resolve_root(path: Path, step: int | None, best: bool) -> _Found:
    """Return (root, trainer output_dir or None, tag implied by PATH or None)."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file; pass the checkpoint folder (the one holding `latest`)")
    for locator in LOCATORS:
        found = locator(path, step, best)
        if found is not None:
            return found
    _refuse_other_folder(path)
    raise CheckpointNotFoundError(
        f"{path} is not a DeepSpeed checkpoint: no `latest` file, no global_step*/ folder, no checkpoint-N/ folders"
    )


def _refuse_other_folder(path: Path) -> None:
    """Folders that are no sharded checkpoint, each told what it is."""
    if (path / "latest_universal").is_file() or (path / "zero").is_dir():
        raise UnsupportedCheckpointError(
            f"{path} is a DeepSpeed universal checkpoint; open it with ckpttools.open_checkpoint or read_universal"
        )
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if present:
        raise CkptError(
            f"{path} already holds plain weights ({', '.join(present)}) and no DeepSpeed shards "
            "(saved with save_only_model?); it loads with from_pretrained as it is, nothing to consolidate"
        )


def _resolve_tag(root: Path, tag: str | None, advice: str = "pass --tag") -> str:
    if tag is not None:
        return check_tag_name(tag)
    latest = root / "latest"
    if latest.is_file():
        try:
            return check_tag_name(latest.read_text(encoding="utf-8", errors="strict"))
        except UnicodeDecodeError as e:
            raise CheckpointNotFoundError(f"{latest} is not a text file naming a tag; {advice}") from e
    tags = _tag_dirs(root)
    raise CheckpointNotFoundError(
        f"{root} has no `latest` file; {advice} (found: {', '.join(tags) or 'no tag folders'})"
    )


def _advice(root: Path, output_dir: Path | None) -> str:
    """What helps when the tag cannot be found: --tag in a checkpoint, --step in a Trainer output_dir whose other
    checkpoint-N folders may be complete."""
    if output_dir is None:
        return "pass --tag"
    others = sorted(step for step, p in _trainer_checkpoints(output_dir).items() if p != root)
    if not others:
        return "pass --tag"
    return f"pass --step to read another checkpoint (steps {', '.join(map(str, others))}), or --tag"


def find_tag_folder(
    path: Path, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> tuple[Path, str, Path | None, list[str]]:
    """Resolve what the user pointed at into (checkpoint root, tag, Trainer output_dir or None, HF side files).

    Args:
        path: a save_dir, a Trainer `checkpoint-N/`, a Trainer output_dir, a Lightning folder, or a tag folder.
        tag: the tag folder name; defaults to the content of `latest`.
        step: with a Trainer output_dir, which `checkpoint-N` to take (default: the newest).
        best: with a Trainer output_dir, take `best_model_checkpoint` from trainer_state.json.
    """
    path = Path(path)
    root, output_dir, implied_tag = _resolve_root(path, step, best)
    advice = _advice(root, output_dir)
    tag = _resolve_tag(root, tag if tag is not None else implied_tag, advice)
    if not (root / tag).is_dir():
        available = _tag_dirs(root)
        raise CheckpointNotFoundError(
            f"tag {short(tag)} has no folder in {root} (available: {', '.join(available) or 'none'}); {advice}"
        )
    side = [name for name in ("config.json", *HF_SIDE_FILES) if (root / name).is_file()]
    return root, tag, output_dir, side

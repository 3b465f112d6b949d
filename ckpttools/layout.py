"""Where things are in a DeepSpeed checkpoint: folders, tags and per-rank file names.

`classify_tag_files` and `check_tag_name` are pure (names in, names out); `locate` looks at the disk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import CheckpointNotFoundError, CkptError, UnsafeCheckpointError, UnsupportedCheckpointError, short

OPTIM_RE = re.compile(r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
PIPE_LAYER_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
EXPERT_RE = re.compile(
    r"^(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$"
)
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


@dataclass(frozen=True)
class TagFiles:
    """The per-rank files of one tag folder, by data-parallel rank."""

    model_files: dict[int, str]  # ZeRO-3: one per rank; ZeRO-0/1/2: {0: mp_rank_00_model_states.pt}
    optim_files: dict[int, str]
    optim_prefix: str  # "bf16_" or ""
    zero3_layout: bool


@dataclass(frozen=True)
class CheckpointLocation:
    """A resolved checkpoint: the folder holding `latest`, the tag and its files, and HF side files."""

    root: Path  # folder with `latest` and the tag folders (a Trainer checkpoint-N/ or a save_dir)
    tag: str
    tag_dir: Path
    files: TagFiles
    output_dir: Path | None = None  # the Trainer output_dir when PATH was one
    side_files: list[str] = field(default_factory=list)

    @property
    def is_trainer_folder(self) -> bool:
        return (self.root / "trainer_state.json").is_file() or (self.root / "config.json").is_file()


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


def classify_tag_files(names: list[str], where: str = "") -> TagFiles:
    """Sort a tag folder's file names into per-rank model and optimizer files.

    Raises:
        UnsupportedCheckpointError: pipeline, tensor-parallel, MoE or NVMe-offloaded layouts.
        CheckpointNotFoundError: no optimizer or model-state files at all.
    """
    where = where or "the tag folder"
    if "offloaded_tensors" in names:
        raise UnsupportedCheckpointError(
            f"{where} holds NVMe-offloaded optimizer state (offloaded_tensors/); its fp32 weights live in "
            "per-rank swap files that ckpttools cannot read offline. Load it in DeepSpeed and save without NVMe offload"
        )
    if any(PIPE_LAYER_RE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"{where} is a pipeline-parallel checkpoint (layer_XX-model_YY-model_states.pt files); not supported yet"
        )
    if any(EXPERT_RE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"{where} holds MoE expert files (expert_*/expp_rank_*); MoE is not supported yet"
        )
    optim: dict[int, str] = {}
    prefixes: set[str] = set()
    zero3_models: dict[int, str] = {}
    plain_models: dict[int, str] = {}
    mp_ranks: set[int] = set()
    for name in names:
        if m := OPTIM_RE.match(name):
            dp = int(m["dp"])
            if dp in optim:
                raise CkptError(
                    f"{where} holds two optimizer files for rank {dp} ({optim[dp]}, {name}); remove the stray one"
                )
            optim[dp] = name
            prefixes.add(m["prefix"] or "")
            mp_ranks.add(int(m["mp"]))
        elif m := ZERO3_MODEL_RE.match(name):
            zero3_models[int(m["dp"])] = name
            mp_ranks.add(int(m["mp"]))
        elif m := MODEL_RE.match(name):
            plain_models[int(m["mp"])] = name
            mp_ranks.add(int(m["mp"]))
    if len(mp_ranks) > 1 or (mp_ranks and mp_ranks != {0}):
        raise UnsupportedCheckpointError(
            f"{where} is a tensor/model-parallel checkpoint (mp_rank {sorted(mp_ranks)}); only mp_rank_00 is supported"
        )
    if len(prefixes) > 1:
        raise CkptError(
            f"{where} mixes optimizer files with different prefixes {sorted(prefixes)}; remove the stale ones"
        )
    if not optim:
        hint = (
            "it holds model states only (saved without optimizer state?)"
            if (zero3_models or plain_models)
            else "no *_model_states.pt either"
        )
        raise CheckpointNotFoundError(
            f"{where} has no *_optim_states.pt files: {hint}; this is not a ZeRO checkpoint tag folder"
        )
    if zero3_models:
        return TagFiles(zero3_models, optim, prefixes.pop(), True)
    if not plain_models:
        raise CheckpointNotFoundError(f"{where} has no *_model_states.pt file (expected mp_rank_00_model_states.pt)")
    return TagFiles({0: plain_models[0]}, optim, prefixes.pop(), False)


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


def _resolve_root(path: Path, step: int | None, best: bool) -> tuple[Path, Path | None, str | None]:
    """Return (root, trainer output_dir or None, tag implied by PATH or None)."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file; pass the checkpoint folder (the one holding `latest`)")
    if (path / "latest").is_file() or _tag_dirs(path):
        return path, None, None
    if any(path.glob("*_optim_states.pt")) or any(path.glob("*_model_states.pt")):
        return path.parent, None, path.name  # PATH is the tag folder itself
    if _trainer_checkpoints(path):
        return _pick_trainer_checkpoint(path, step, best), path, None
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
    raise CheckpointNotFoundError(
        f"{path} is not a DeepSpeed checkpoint: no `latest` file, no global_step*/ folder, no checkpoint-N/ folders"
    )


def _resolve_tag(root: Path, tag: str | None) -> str:
    if tag is not None:
        return check_tag_name(tag)
    latest = root / "latest"
    if latest.is_file():
        try:
            return check_tag_name(latest.read_text(encoding="utf-8", errors="strict"))
        except UnicodeDecodeError as e:
            raise CheckpointNotFoundError(f"{latest} is not a text file naming a tag; pass --tag") from e
    tags = _tag_dirs(root)
    raise CheckpointNotFoundError(
        f"{root} has no `latest` file; pass --tag (found: {', '.join(tags) or 'no tag folders'})"
    )


def locate(path: Path, *, tag: str | None = None, step: int | None = None, best: bool = False) -> CheckpointLocation:
    """Resolve what the user pointed at into a checkpoint root, a tag and its rank files.

    Args:
        path: a save_dir, a Trainer `checkpoint-N/`, a Trainer output_dir, or a tag folder.
        tag: the tag folder name; defaults to the content of `latest`.
        step: with a Trainer output_dir, which `checkpoint-N` to take (default: the newest).
        best: with a Trainer output_dir, take `best_model_checkpoint` from trainer_state.json.
    """
    path = Path(path)
    root, output_dir, implied_tag = _resolve_root(path, step, best)
    tag = _resolve_tag(root, tag if tag is not None else implied_tag)
    tag_dir = root / tag
    if not tag_dir.is_dir():
        available = _tag_dirs(root)
        raise CheckpointNotFoundError(
            f"tag {short(tag)} has no folder in {root} (available: {', '.join(available) or 'none'}); pass --tag"
        )
    files = classify_tag_files(sorted(p.name for p in tag_dir.iterdir()), where=str(tag_dir))
    side = [name for name in ("config.json", *HF_SIDE_FILES) if (root / name).is_file()]
    return CheckpointLocation(root, tag, tag_dir, files, output_dir, side)

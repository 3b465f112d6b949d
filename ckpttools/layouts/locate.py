"""Where things are in a DeepSpeed checkpoint: folders, tags and per-rank file names.

`classify_tag_files` and `check_tag_name` are pure (names in, names out); `locate` looks at the disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

from ckpttools.errors import (
    CheckpointNotFoundError,
    CkptError,
    SelectionError,
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
# What `ckpt` reads, for the message of a folder that is none of them.
KNOWN_INPUTS = (
    "a DeepSpeed save_dir (`latest`, global_stepN/), a Trainer checkpoint-N/ or output_dir, an accelerate or "
    "Lightning folder, a DeepSpeed universal checkpoint (`latest_universal`), a torch DCP/FSDP2 folder "
    "(`.metadata` + *.distcp, or a run folder of step-N/ folders)"
)

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
        UnsupportedCheckpointError: NVMe-offloaded optimizer state in a layout other than data parallel.
        CheckpointNotFoundError: no optimizer or model-state files at all.
    """
    where = where or "the tag folder"
    if "offloaded_tensors" in names and layout != "dp":  # the data-parallel ZeRO layout reads swap files
        raise UnsupportedCheckpointError(
            f"{where} holds NVMe-offloaded optimizer state (offloaded_tensors/) in a {layout} layout; ckpttools reads "
            "swap files of data-parallel ZeRO-3 runs only. Load it in DeepSpeed and save without NVMe offload"
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


def check_selection(step: int | None, best: bool) -> None:
    """What --step and --best say on their own: a step is a number >= 0, and only one of them chooses."""
    if step is not None and step < 0:
        raise SelectionError(f"--step {step}: a step is a number >= 0 (the N of checkpoint-N or step-N)")
    if best and step is not None:
        raise SelectionError(f"--best and --step {step} both choose the checkpoint to read; give one of them")


def refuse_selection(
    path: Path,
    what: str,
    *,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    own_step: int | None = None,
    tags: Collection[str] | None = None,
) -> None:
    """PATH names one checkpoint (`what`): --step or --best choosing another is a usage error, never ignored.

    `own_step`: the step PATH's folder name says (checkpoint-N, step-N), which --step may repeat. `tags`: the tags
    --tag may name here (None: --tag chooses among tags PATH holds, checked where they are read).
    """
    if best:
        raise SelectionError(
            f"--best cannot apply: {path} is {what}, not a run's output folder whose trainer_state.json names the "
            "best checkpoint; pass the Trainer output_dir, or leave --best out"
        )
    if step is not None and step != own_step:
        mine = f" (step {own_step})" if own_step is not None else ""
        named = re.search(r"\d+$", path.name)  # PATH is the checkpoint-N/step-N folder itself: its parent is the run
        run = str(path.parent) if named and int(named[0]) == own_step else "the run's folder"
        hint = f"; its tag global_step{step} is chosen with --tag" if (path / f"global_step{step}").is_dir() else ""
        raise SelectionError(
            f"--step {step} cannot apply: {path} is {what}{mine}; --step chooses among the checkpoint-N or step-N "
            f"folders of a run's output folder: pass {run} --step {step}, or leave --step out{hint}"
        )
    if tag is not None and tags is not None and tag.strip().strip("/") not in tags:
        hint = f" (its tag: {', '.join(sorted(tags))})" if tags else ", which has no tags to choose from"
        raise SelectionError(
            f"--tag {short(tag)} cannot apply: {path} is {what}{hint}; pass the folder holding the tags, or leave "
            "--tag out"
        )


def refuse_absent_tag(root: Path, tag: str, tags: Sequence[str]) -> None:
    """The user's --tag names no tag folder of `root`: a usage error listing the tags there are."""
    if tag not in tags:
        raise SelectionError(
            f"--tag {short(tag)}: {root} has no tag folder {short(tag)}; its tags: {', '.join(tags) or 'none'}"
        )


def step_of(path: Path) -> int | None:
    """The step a checkpoint-N folder's name says."""
    m = CHECKPOINT_DIR_RE.match(path.name)
    return int(m[1]) if m else None


def best_checkpoint(folder: Path, ckpts: dict[int, Path]) -> int:
    """The step of the `best_model_checkpoint` the newest checkpoint's trainer_state.json records (the Trainer
    writes the same field into every checkpoint's state; the newest knows the latest best)."""
    steps = ", ".join(map(str, sorted(ckpts)))
    state_file = ckpts[max(ckpts)] / "trainer_state.json"
    if not state_file.is_file():
        raise SelectionError(
            f"--best cannot apply: {ckpts[max(ckpts)]} has no trainer_state.json naming a best checkpoint (only the "
            f"Hugging Face Trainer records one); pass --step N (steps here: {steps}), or leave --best out"
        )
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8-sig"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointNotFoundError(f"cannot read {state_file} to find the best checkpoint: {e!s:.100}") from e
    best_path = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    if best_path is not None and not isinstance(best_path, str):
        raise CheckpointNotFoundError(f"{state_file} records best_model_checkpoint {short(best_path, 40)}, not a path")
    if not best_path:
        raise SelectionError(
            f"--best cannot apply: {state_file} records no best_model_checkpoint (the run set no "
            f"metric_for_best_model); pass --step N (steps here: {steps}), or leave --best out for the newest"
        )
    m = CHECKPOINT_DIR_RE.match(Path(best_path).name)
    if not m or int(m[1]) not in ckpts:
        raise SelectionError(
            f"--best: the best checkpoint {best_path} is no longer in {folder} (rotated away?); steps here: {steps}"
        )
    return int(m[1])


def _pick_trainer_checkpoint(folder: Path, step: int | None, best: bool) -> Path:
    ckpts = _trainer_checkpoints(folder)
    if not ckpts:
        raise CheckpointNotFoundError(f"{folder} has no checkpoint-N folders")
    if best:
        return ckpts[best_checkpoint(folder, ckpts)]
    if step is not None:
        if step not in ckpts:
            raise SelectionError(f"--step {step}: {folder} has no checkpoint-{step}; found steps {sorted(ckpts)}")
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
        raise CheckpointNotFoundError(f"{path} is a file; pass the checkpoint's folder: {KNOWN_INPUTS}")
    for locator in LOCATORS:
        found = locator(path, step, best)
        if found is not None:
            return found
    _refuse_other_folder(path)
    raise CheckpointNotFoundError(f"{path} is not a checkpoint ckpt reads; it reads {KNOWN_INPUTS}")


def _refuse_other_folder(path: Path) -> None:
    """Folders that are no sharded checkpoint, each told what it is."""
    if (path / "latest_universal").is_file() or (path / "zero").is_dir():
        raise UnsupportedCheckpointError(
            f"{path} is a DeepSpeed universal checkpoint; open it with ckpttools.open_checkpoint or read_universal"
        )
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if present:
        raise CkptError(
            f"{path} already holds plain weights ({', '.join(present)}) and no sharded checkpoint (no DeepSpeed "
            "`latest` or rank files, no torch DCP `.metadata`; saved with save_only_model?); it loads with "
            "from_pretrained as it is, nothing to consolidate"
        )


def _resolve_tag(root: Path, tag: str | None, advice: str) -> str:
    if tag is not None:
        return check_tag_name(tag)
    latest = root / "latest"
    if latest.is_file():
        try:
            return check_tag_name(latest.read_text(encoding="utf-8", errors="strict"))
        except UnicodeDecodeError as e:
            raise CheckpointNotFoundError(f"{latest} is not a text file naming a tag; {advice}") from e
    raise CheckpointNotFoundError(f"{root} has no `latest` file naming the tag to read; {advice}")


def _advice(root: Path, output_dir: Path | None) -> str:
    """What helps when the tag cannot be found: the tags there are (--tag), and in a Trainer output_dir the other
    checkpoint-N folders (--step), which may be complete."""
    tags = _tag_dirs(root)
    by_tag = f"--tag with one of its tags ({', '.join(tags)})" if tags else ""
    others = []
    if output_dir is not None:
        others = sorted(step for step, p in _trainer_checkpoints(output_dir).items() if p != root)
    if others:
        by_step = f"pass --step to read another checkpoint (steps {', '.join(map(str, others))})"
        return f"{by_step}, or {by_tag}" if by_tag else by_step
    return f"pass {by_tag}" if by_tag else "it holds no tag folder (global_stepN/) either"


def _check_selection_applies(path: Path, root: Path, output_dir: Path | None, implied_tag: str | None,
                             tag: str | None, step: int | None, best: bool) -> None:  # fmt: skip
    """--step and --best choose inside a Trainer output_dir, --tag inside a save_dir: given with a PATH that
    names one checkpoint or one tag folder, they are refused unless they repeat what PATH names."""
    if output_dir is not None:
        return
    what = "a tag folder" if implied_tag is not None else "one checkpoint"
    tags = [implied_tag] if implied_tag is not None else None
    refuse_selection(path, what, tag=tag, step=step, best=best, own_step=step_of(root), tags=tags)


def find_tag_folder(
    path: Path, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> tuple[Path, str, Path | None, list[str]]:
    """Resolve what the user pointed at into (checkpoint root, tag, Trainer output_dir or None, HF side files).

    Args:
        path: a save_dir, a Trainer `checkpoint-N/`, a Trainer output_dir, a Lightning folder, or a tag folder.
        tag: the tag folder name; defaults to the content of `latest`.
        step: with a Trainer output_dir, which `checkpoint-N` to take (default: the newest); with PATH naming one
            checkpoint-N, only N.
        best: with a Trainer output_dir, take `best_model_checkpoint` from trainer_state.json.

    Raises:
        SelectionError (a usage error): --step, --best or --tag that cannot apply to PATH, or name a checkpoint
            or tag it does not hold.
    """
    path = Path(path)
    check_selection(step, best)
    root, output_dir, implied_tag = _resolve_root(path, step, best)
    _check_selection_applies(path, root, output_dir, implied_tag, tag, step, best)
    advice = _advice(root, output_dir)
    chosen = tag is not None and implied_tag is None  # the user's --tag, not the folder PATH names
    tag = _resolve_tag(root, tag if tag is not None else implied_tag, advice)
    if not (root / tag).is_dir():
        available = _tag_dirs(root)
        if chosen:
            refuse_absent_tag(root, tag, available)
        listed = ", ".join(available) or "none"
        raise CheckpointNotFoundError(
            f"{root / 'latest'} names tag {short(tag)}, which has no folder in {root} (its tags: {listed}); {advice}"
        )
    side = [name for name in ("config.json", *HF_SIDE_FILES) if (root / name).is_file()]
    return root, tag, output_dir, side

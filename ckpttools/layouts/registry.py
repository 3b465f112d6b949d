"""Every kind of checkpoint folder ckpttools reads, detected and opened into the one checkpoint model.

A layout is one module holding a `LAYOUT` plug-in (`base.Layout`) plus its line in `LAYOUTS`: the first layout
whose `claims` accepts a tag folder's file names reads it. Folder formats that are not DeepSpeed tag folders
(DeepSpeed's universal folders, torch Distributed Checkpoint folders) are `base.FolderFormat`s in `FOLDER_FORMATS`,
recognised before any tag folder is looked for.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path

from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.layouts.base import FolderFormat, Layout
from ckpttools.layouts.locate import (
    check_selection,
    check_tag_name,
    classify_tag_files,
    find_tag_folder,
    refuse_absent_tag,
    refuse_selection,
)
from ckpttools.layouts.universal import is_universal, read_universal, resolve_root
from ckpttools.model.checkpoint import Checkpoint
from ckpttools.model.origin import CheckpointLocation

# Detection order: the first whose LAYOUT claims a tag folder's file names reads it (one line per layout).
LAYOUTS = (
    "ckpttools.layouts.megatron",  # Megatron-Core torch_dist: claims no tag folder (found as a folder format)
    "ckpttools.layouts.dcp",  # torch DCP: claims no tag folder (found as a folder format), read-only
    "ckpttools.layouts.pipeline_tp",  # pipeline x TP: layer_NN-model_TT-model_states.pt (before pipeline)
    "ckpttools.layouts.pipeline",  # PipelineModule: layer_NN-model_states.pt
    "ckpttools.layouts.autoep",  # AutoEP: claims no names (its files look like MoE's or ZeRO-3's); moe reads it
    "ckpttools.layouts.moe",  # DeepSpeed-MoE: expert files
    "ckpttools.layouts.autotp",  # AutoTP: several mp_rank_NN
    "ckpttools.layouts.zero0",  # no ZeRO: the optimizer inside mp_rank_00_model_states.pt
    "ckpttools.layouts.dp",  # data-parallel ZeRO-1/2/3: everything else
)


# Folder formats, asked in this order before a DeepSpeed tag folder is looked for (one line per format).
FOLDER_FORMATS = (
    "ckpttools.layouts.registry:UNIVERSAL",  # ds_to_universal output: <root>/<tag>/zero/<param>/fp32.pt
    "ckpttools.layouts.megatron",  # Megatron-Core torch_dist: metadata.json + .metadata (before plain DCP)
    "ckpttools.layouts.dcp",  # torch Distributed Checkpoint (FSDP2): .metadata + __R_I.distcp
)


class _UniversalFolder:
    """DeepSpeed's universal folders, as a folder format."""

    def recognizes(self, path: Path) -> bool:
        return path.is_dir() and is_universal(path)

    def open(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> Checkpoint:
        return read_universal(path, tag=self._selected(path, tag, step, best))

    def root(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> tuple[Path, str]:
        return resolve_root(path, self._selected(path, tag, step, best))

    @staticmethod
    def _selected(path: Path, tag: str | None, step: int | None, best: bool) -> str | None:
        """--tag chooses among a root's tags; --step and --best, and --tag with a tag folder, cannot apply."""
        check_selection(step, best)
        tags = [path.name] if (path / "zero").is_dir() else None  # a tag folder: only its own name
        refuse_selection(path, "a DeepSpeed universal checkpoint", tag=tag, step=step, best=best, tags=tags)
        if tag is not None and tags is None:  # a root: the tag must be one of its tag folders
            refuse_absent_tag(
                path, check_tag_name(tag), sorted(p.name for p in path.iterdir() if (p / "zero").is_dir())
            )
        return tag


UNIVERSAL = _UniversalFolder()


@functools.cache
def folder_formats() -> tuple[FolderFormat, ...]:
    """The folder formats, in the order they are asked (imported on first use)."""
    found = []
    for entry in FOLDER_FORMATS:
        module, _, name = entry.partition(":")
        found.append(getattr(importlib.import_module(module), name or "FOLDER"))
    return tuple(found)


def folder_format_of(path: Path) -> FolderFormat | None:
    """The folder format that recognises `path`, if any (None: look for a DeepSpeed tag folder)."""
    return next((fmt for fmt in folder_formats() if fmt.recognizes(path)), None)


@functools.cache
def layouts() -> tuple[Layout, ...]:
    """The plug-ins, in detection order (imported on first use)."""
    return tuple(importlib.import_module(name).LAYOUT for name in LAYOUTS)


def detect_layout(names: Sequence[str]) -> Layout:
    """The layout of a tag folder holding these file names."""
    return next(layout for layout in layouts() if layout.claims(names))


def layout_named(kind: str) -> Layout:
    """The plug-in of a checkpoint whose ParallelLayout.kind (or JSON `parallel.kind`) is `kind`."""
    for layout in layouts():
        if layout.kind == kind:
            return layout
    raise UnsupportedCheckpointError(f"no layout named {kind!r} in this version of ckpttools")


def layout_of(ckpt: Checkpoint) -> Layout:
    """The plug-in that read `ckpt` (universal folders: the layout of the run that wrote them)."""
    return layout_named(ckpt.layout.kind)


def locate(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> CheckpointLocation:
    """Resolve what the user pointed at (save_dir, Trainer checkpoint-N/ or output_dir, Lightning folder, tag
    folder) into a checkpoint root, a tag and its rank files, sorted for the layout that claims them."""
    root, tag, output_dir, side = find_tag_folder(Path(path), tag=tag, step=step, best=best)
    tag_dir = root / tag
    names = sorted(p.name for p in tag_dir.iterdir())
    files = classify_tag_files(names, where=str(tag_dir), layout=detect_layout(names).kind)
    return CheckpointLocation(root, tag, tag_dir, files, output_dir, side)


def open_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> Checkpoint:
    """A checkpoint of any supported layout: a DeepSpeed save_dir, Trainer folder or output_dir, tag folder, or a
    folder of one of the `FOLDER_FORMATS` (universal, torch DCP)."""
    path = Path(path)
    fmt = folder_format_of(path)
    if fmt is not None:
        return fmt.open(path, tag=tag, step=step, best=best)
    return read_checkpoint(path, tag=tag, step=step, best=best)


def checkpoint_root(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> tuple[Path, str]:
    """The checkpoint root and tag `open_checkpoint` reads, from file names and the small files that select them
    (`latest`, trainer_state.json) alone."""
    path = Path(path)
    fmt = folder_format_of(path)
    if fmt is not None:
        return fmt.root(path, tag=tag, step=step, best=best)
    loc = locate(path, tag=tag, step=step, best=best)
    return loc.root, loc.tag


def read_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> Checkpoint:
    """Open a native checkpoint of any layout and check everything its files say about each other.

    Args:
        path: a save_dir (holding `latest`), a Trainer `checkpoint-N/` or output_dir, or a tag folder.
        tag: tag folder to read; defaults to `latest`.
        step, best: choose a `checkpoint-N` inside a Trainer output_dir.

    Raises:
        CkptError subclasses naming the problem and the file: missing/extra/swapped/stale rank files,
        ranks that disagree, damaged files, unsupported layouts.

    Example:
        >>> ckpt = read_checkpoint("out/checkpoint-500")
        >>> ckpt.zero_stage, ckpt.dp_world_size
        (3, 8)
    """
    return read_located(locate(Path(path), tag=tag, step=step, best=best))


def read_located(loc: CheckpointLocation) -> Checkpoint:
    """Open a located tag folder with the reader of its layout."""
    return layout_named(loc.files.layout).read(loc)

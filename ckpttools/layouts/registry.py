"""Every kind of checkpoint folder ckpttools reads, detected and opened into the one checkpoint model.

A layout is one reader module plus its entry in `LAYOUT_READERS`; `layout.classify_tag_files` tells which one a
tag folder needs from its file names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.layouts.locate import locate
from ckpttools.layouts.universal import is_universal, read_universal, resolve_root
from ckpttools.model.checkpoint import ZeroCheckpoint
from ckpttools.model.origin import CheckpointLocation
from ckpttools.model.parallel import KIND_NAMES

# layout -> (module, function): imported when a checkpoint of that layout is opened
LAYOUT_READERS = {
    "dp": ("ckpttools.layouts.zero.read", "read_data_parallel"),
    "zero0": ("ckpttools.layouts.zero0", "read_zero0"),
    "tensor": ("ckpttools.layouts.autotp", "read_tensor_parallel"),
    "pipeline": ("ckpttools.layouts.pipeline", "read_pipeline"),
    "moe": ("ckpttools.layouts.moe", "read_moe"),
}


def open_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> ZeroCheckpoint:
    """A native checkpoint of any supported layout (save_dir, Trainer folder or output_dir, tag folder), or a
    universal one."""
    path = Path(path)
    if path.is_dir() and is_universal(path):
        return read_universal(path, tag=tag)
    return read_checkpoint(path, tag=tag, step=step, best=best)


def checkpoint_root(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> tuple[Path, str]:
    """The checkpoint root and tag `open_checkpoint` reads, from file names and the small files that select them
    (`latest`, trainer_state.json) alone."""
    path = Path(path)
    if path.is_dir() and is_universal(path):
        return resolve_root(path, tag)
    loc = locate(path, tag=tag, step=step, best=best)
    return loc.root, loc.tag


def read_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> ZeroCheckpoint:
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


def read_located(loc: CheckpointLocation) -> ZeroCheckpoint:
    """Open a located tag folder with the reader of its layout."""
    return _reader_for(loc)(loc)


def _reader_for(loc: CheckpointLocation) -> Callable[[CheckpointLocation], ZeroCheckpoint]:
    layout = loc.files.layout
    module_name, function = LAYOUT_READERS[layout]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise UnsupportedCheckpointError(
            f"{loc.tag_dir} is a {KIND_NAMES[layout]} checkpoint, which this version of ckpttools cannot read yet"
        ) from e
    reader: Callable[[CheckpointLocation], ZeroCheckpoint] = getattr(module, function)
    return reader

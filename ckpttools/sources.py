"""Every kind of checkpoint folder ckpttools reads, detected and opened into the one checkpoint model."""

from __future__ import annotations

from pathlib import Path

from .reader import ZeroCheckpoint, read_checkpoint
from .universal import is_universal, read_universal


def open_checkpoint(
    path: Path | str, *, tag: str | None = None, step: int | None = None, best: bool = False
) -> ZeroCheckpoint:
    """A native ZeRO checkpoint (save_dir, Trainer folder or output_dir, tag folder) or a universal one."""
    path = Path(path)
    if path.is_dir() and is_universal(path):
        return read_universal(path, tag=tag)
    return read_checkpoint(path, tag=tag, step=step, best=best)

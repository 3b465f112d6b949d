"""What a layout plug-in provides: the contract between the commands and one kind of checkpoint folder.

A layout is one module with a `LAYOUT` object implementing `Layout`, plus one line in `registry.LAYOUTS`. The
commands never branch on a layout's kind: `consolidate`, `verify` and `push` consume the model the layout reads,
`inspect` prints what `describe` adds, and `reshard` asks `check_reshard` and `tag_files`. docs/adding-a-layout.md
is the checklist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckpttools.errors import UnsupportedCheckpointError

if TYPE_CHECKING:
    from pathlib import Path

    from ckpttools.model.checkpoint import Checkpoint
    from ckpttools.model.origin import CheckpointLocation


@dataclass(frozen=True)
class ReshardTarget:
    """What `reshard` writes: native rank files for `dp` ranks at ZeRO `stage`, or (dp None) a universal tag."""

    dp: int | None
    stage: int

    @property
    def universal(self) -> bool:
        return self.dp is None


class Layout(Protocol):
    """A kind of native tag folder (DeepSpeed's data parallel, AutoTP, pipeline, MoE, ...)."""

    kind: str  # stable name in JSON output and in ParallelLayout.kind
    title: str  # what messages and `inspect` call it

    def claims(self, names: Sequence[str]) -> bool:
        """Whether a tag folder holding these file names is of this layout (file names only; no I/O)."""
        ...

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        """The folder as the neutral model, after every invariant check its files offer."""
        ...

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        """Lines `ckpt inspect` adds for this layout, from the JSON form of its ParallelLayout (`as_dict`)."""
        ...

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        """Raise UnsupportedCheckpointError unless the output is one DeepSpeed is proven to load."""
        ...

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        """Relative path -> object: the universal tag folder of `ckpt` (as DeepSpeed's ds_to_universal writes it),
        or UnsupportedCheckpointError."""
        ...

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        """Relative path -> object (torch-file content): every file of the output's tag folder."""
        ...


class FolderFormat(Protocol):
    """A checkpoint folder that is not a DeepSpeed tag folder (universal, torch DCP): recognised from what `path`
    holds, before any tag folder is looked for. `registry.FOLDER_FORMATS` lists them."""

    def recognizes(self, path: Path) -> bool:
        """Whether `path` (as the user gave it) is, or holds, a checkpoint of this format (small reads only)."""
        ...

    def open(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> Checkpoint:
        """The checkpoint as the neutral model, after every check its files offer."""
        ...

    def root(self, path: Path, *, tag: str | None, step: int | None, best: bool) -> tuple[Path, str]:
        """The folder and the tag (or step) `open` reads, without reading tensor metadata."""
        ...


class ReadOnlyLayout:
    """Defaults for a layout that `ckpttools` reads but cannot write yet: nothing to describe, no reshard."""

    kind = ""
    title = ""

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        return []

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} is a {self.title} checkpoint ({ckpt.layout.describe()}); resharding it is "
            "not supported yet (consolidate works)"
        )

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        raise no_universal_form(ckpt, self.title)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        raise AssertionError("check_reshard refuses first")  # pragma: no cover


def no_universal_form(ckpt: Checkpoint, title: str) -> UnsupportedCheckpointError:
    """The refusal of a layout that has no universal form (yet): what its `universal_files` raises."""
    return UnsupportedCheckpointError(
        f"{ckpt.location.tag_dir} is a {title} checkpoint ({ckpt.layout.describe()}); writing it in the universal "
        "format is not supported yet"
    )

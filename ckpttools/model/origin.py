"""Where a checkpoint was read from: its root folder, tag and tag folder, the file names its layout sorted
by rank, and the Hugging Face side files beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TagFiles:
    """The per-rank files of one tag folder, by data-parallel rank (of model-parallel rank 0 in other layouts)."""

    model_files: dict[int, str]  # ZeRO-3: one per rank; ZeRO-0/1/2: {0: mp_rank_00_model_states.pt}
    optim_files: dict[int, str]
    optim_prefix: str  # "bf16_" or ""
    zero3_layout: bool
    layout: str = "dp"  # the kind of the layout plug-in that claimed the folder (layouts.registry)
    names: tuple[str, ...] = ()  # every file name in the tag folder, for the layout readers


@dataclass(frozen=True)
class CheckpointLocation:
    """A resolved checkpoint: the folder holding `latest`, the tag and its files, and HF side files."""

    root: Path  # folder with `latest` and the tag folders (a Trainer checkpoint-N/ or a save_dir)
    tag: str
    tag_dir: Path
    files: TagFiles
    output_dir: Path | None = None  # the Trainer output_dir when PATH was one
    side_files: list[str] = field(default_factory=list)
    tags: list[str] | None = None  # the checkpoints beside this one that --tag/--step choose among (None: not listed)

    @property
    def is_trainer_folder(self) -> bool:
        return (self.root / "trainer_state.json").is_file() or (self.root / "config.json").is_file()

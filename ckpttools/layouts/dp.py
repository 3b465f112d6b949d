"""The data-parallel ZeRO-1/2/3 layout as a plug-in (registry.LAYOUTS): DeepSpeed's default folder, read and written
by the ZeRO machinery in `layouts/zero/`, its universal form by `layouts/universal.py`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpttools.layouts.autoep import is_autoep, read_autoep
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.universal import universal_files
from ckpttools.layouts.zero import nvme
from ckpttools.layouts.zero.read import read_data_parallel
from ckpttools.layouts.zero.write import model_file_name, rank_files
from ckpttools.model.checkpoint import Checkpoint
from ckpttools.model.origin import CheckpointLocation


class DataParallelLayout:
    kind = "dp"
    title = "data parallel"

    def claims(self, names: Sequence[str]) -> bool:
        return True  # last in the registry: every ZeRO tag folder no other layout claims

    def read(self, loc: CheckpointLocation) -> Checkpoint:
        if is_autoep(loc):  # AutoEP ZeRO-3 files carry ZeRO-3's names: its model states tell it apart
            return read_autoep(loc)
        return read_data_parallel(loc)

    def describe(self, parallel: dict[str, Any]) -> list[str]:
        return nvme.describe(parallel)

    def check_reshard(self, ckpt: Checkpoint, target: ReshardTarget) -> None:
        return None  # any DP size, any ZeRO stage (stages.check_stage_change checks the stage change itself)

    def universal_files(self, ckpt: Checkpoint) -> dict[str, Any]:
        return universal_files(ckpt)

    def tag_files(self, ckpt: Checkpoint, target: ReshardTarget) -> dict[str, Any]:
        if target.dp is None:  # the universal tag keeps the model-states files, as ds_to_universal's does
            files = universal_files(ckpt)
            for rank, model in enumerate(ckpt.model_files):
                files[model_file_name(ckpt.zero_stage, rank)] = model
            return files
        return rank_files(ckpt, target.dp, target.stage)


LAYOUT = DataParallelLayout()

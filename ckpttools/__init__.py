"""ckpttools: consolidate, inspect and reshard DeepSpeed ZeRO checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

from .consolidate import ConsolidateResult, consolidate
from .engine_save import EngineSaveResult, save_pretrained_from_engine
from .errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    OutputError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from .hub import PushResult, push
from .inspect import inspect_checkpoint
from .reader import ZeroCheckpoint
from .reshard import ReshardResult, reshard
from .sources import open_checkpoint, read_checkpoint
from .universal import read_universal
from .verify import VerifyReport, verify_folder

__all__ = [
    "CheckpointNotFoundError",
    "CkptError",
    "ConsolidateResult",
    "CorruptCheckpointError",
    "EngineSaveResult",
    "OutputError",
    "PushResult",
    "ReshardResult",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
    "VerifyReport",
    "ZeroCheckpoint",
    "__version__",
    "consolidate",
    "inspect_checkpoint",
    "open_checkpoint",
    "push",
    "read_checkpoint",
    "read_universal",
    "reshard",
    "save_pretrained_from_engine",
    "verify_folder",
]

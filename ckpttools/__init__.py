"""ckpttools: sharded training checkpoints (DeepSpeed ZeRO and universal, FSDP2/torch DCP, Megatron-Core,
torchtitan) inspected, compared, consolidated into Hugging Face folders, resharded, verified and published.

The names below load on first use (PEP 562), so `import ckpttools.cli` costs what the command needs and the
`ckpt` command can install its signal handler before anything heavy loads.
"""

from __future__ import annotations

import importlib

from ckpttools._version import __version__

TYPE_CHECKING = False  # not `from typing import TYPE_CHECKING`: typing costs 2 ms before the CLI's signal handler

# Each public name -> the module that defines it.
_EXPORTS = {
    "CheckpointNotFoundError": "errors", "CkptError": "errors", "CorruptCheckpointError": "errors",
    "OutputError": "errors", "UnsafeCheckpointError": "errors", "UnsupportedCheckpointError": "errors",
    "ConsolidateOptions": "ops.consolidate", "ConsolidateResult": "ops.consolidate", "consolidate": "ops.consolidate",
    "EngineSaveResult": "live.engine_save", "save_pretrained_from_engine": "live.engine_save",
    "PushResult": "ops.push", "push": "ops.push",
    "inspect_checkpoint": "ops.inspect",
    "Checkpoint": "model.checkpoint", "ZeroCheckpoint": "model.checkpoint",
    "ReshardResult": "ops.reshard", "reshard": "ops.reshard",
    "open_checkpoint": "layouts.registry", "read_checkpoint": "layouts.registry",
    "read_universal": "layouts.universal",
    "VerifyReport": "ops.verify", "verify_folder": "ops.verify",
}  # fmt: skip

if TYPE_CHECKING:
    from typing import Any

    from ckpttools.errors import (
        CheckpointNotFoundError,
        CkptError,
        CorruptCheckpointError,
        OutputError,
        UnsafeCheckpointError,
        UnsupportedCheckpointError,
    )
    from ckpttools.layouts.registry import open_checkpoint, read_checkpoint
    from ckpttools.layouts.universal import read_universal
    from ckpttools.live.engine_save import EngineSaveResult, save_pretrained_from_engine
    from ckpttools.model.checkpoint import Checkpoint, ZeroCheckpoint
    from ckpttools.ops.consolidate import ConsolidateOptions, ConsolidateResult, consolidate
    from ckpttools.ops.inspect import inspect_checkpoint
    from ckpttools.ops.push import PushResult, push
    from ckpttools.ops.reshard import ReshardResult, reshard
    from ckpttools.ops.verify import VerifyReport, verify_folder

__all__ = [
    "Checkpoint",
    "CheckpointNotFoundError",
    "CkptError",
    "ConsolidateOptions",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""ckpttools: consolidate, inspect and reshard DeepSpeed ZeRO checkpoints.

The names below load on first use (PEP 562), so `import ckpttools.cli` costs what the command needs and the
`ckpt` command can install its signal handler before anything heavy loads.
"""

from __future__ import annotations

import importlib
import sys
import types

TYPE_CHECKING = False  # not `from typing import TYPE_CHECKING`: typing costs 2 ms before the CLI's signal handler

__version__ = "0.1.0"

# Each public name -> the module that defines it.
_EXPORTS = {
    "CheckpointNotFoundError": "errors", "CkptError": "errors", "CorruptCheckpointError": "errors",
    "OutputError": "errors", "UnsafeCheckpointError": "errors", "UnsupportedCheckpointError": "errors",
    "ConsolidateResult": "consolidate", "consolidate": "consolidate",
    "EngineSaveResult": "engine_save", "save_pretrained_from_engine": "engine_save",
    "PushResult": "hub", "push": "hub",
    "inspect_checkpoint": "inspect",
    "ZeroCheckpoint": "reader",
    "ReshardResult": "reshard", "reshard": "reshard",
    "open_checkpoint": "sources", "read_checkpoint": "sources",
    "read_universal": "universal",
    "VerifyReport": "verify", "verify_folder": "verify",
}  # fmt: skip

if TYPE_CHECKING:
    from typing import Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`ckpttools.consolidate` and `ckpttools.reshard` stay the functions once their modules load.

    Importing a submodule binds it on the package (`ckpttools.consolidate = <module>`); the functions of the
    same name, which the package exports, would be hidden by their modules. (`from ckpttools.consolidate
    import X` reads the module from sys.modules, as before.)
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

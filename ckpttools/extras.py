"""Which optional extra provides a missing module, so a command can say in one line what to install.

`pip install ckpttools` runs `consolidate`, `inspect` and `reshard` with click, numpy and huggingface_hub only;
torch, transformers, safetensors, peft and deepspeed come with the extras declared in pyproject.toml. A command
that reaches for one of them without it raises ModuleNotFoundError, which the CLI's error boundary turns into
`describe_missing`'s line instead of an internal error.
"""

from __future__ import annotations

import importlib.util
import re

# Top-level module -> the smallest extra that installs it (keep in step with pyproject.toml).
EXTRA_FOR_MODULE = {
    "torch": "verify",
    "transformers": "verify",
    "safetensors": "verify",
    "peft": "peft",
    "deepspeed": "engine",
    "s3fs": "s3",  # s3:// sources (io/remote.py)
    "gcsfs": "gcs",
    "adlfs": "azure",
}

# Commands whose own extra is the one to name, whatever module they missed first: `push` verifies with
# torch before it uploads, and `ckpttools[hub]` is what the user reads about for pushing.
EXTRA_FOR_COMMAND = {"push": "hub", "distributed": "distributed"}

# Modules of the base install: missing one means a broken install, not a missing extra.
BASE_MODULES = frozenset({"click", "numpy", "huggingface_hub"})

_NO_MODULE_NAMED = re.compile(r"No module named '([^']+)'")


def missing_module(error: ModuleNotFoundError) -> str | None:
    """The name of the module that could not be imported (`torch.distributed`), from the error or its text."""
    if error.name:
        return error.name
    found = _NO_MODULE_NAMED.search(str(error))
    return found.group(1) if found else None


def describe_missing(error: ModuleNotFoundError, command: str | None = None) -> str | None:
    """One line naming the extra to install for `error`, or None when no extra provides the missing module.

    `command` is the `ckpt` subcommand that failed (`push`, `verify`, ...), when the caller knows it.
    A missing submodule of an installed package (`transformers.conversion_mapping` on an old transformers)
    is a version problem, not a missing extra: None, so the caller reports it as it would any other error.

    Example:
        >>> describe_missing(ModuleNotFoundError("No module named 'torch'", name="torch"))
        "this command needs torch, which is not installed: pip install 'ckpttools[verify]'"
    """
    name = missing_module(error)
    if name is None:
        return None
    top = name.partition(".")[0]
    if top != name and _installed(top):
        return None
    if top in BASE_MODULES:
        return f"ckpttools needs {top}, which is not installed: pip install --force-reinstall ckpttools"
    extra = EXTRA_FOR_MODULE.get(top)
    if extra is None:
        return None
    extra = EXTRA_FOR_COMMAND.get(command or "", extra)
    return f"this command needs {top}, which is not installed: pip install 'ckpttools[{extra}]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken package, or one whose __spec__ is unset
        return False


def require(*modules: str) -> None:
    """Raise ModuleNotFoundError for the first of `modules` that is not installed, before any work starts.

    A command checks what an option needs up front (`--check-keys` needs torch and transformers), so a missing
    extra is one line at once, not a failure, or a silently skipped check, after the conversion.
    """
    for module in modules:
        if not _installed(module):
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)

"""Every error ckpttools raises on purpose. The CLI turns these into one line and an exit code."""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any


class CkptError(Exception):
    """Base class: a problem with the user's input or environment, shown as one line, not a traceback."""

    exit_code = 1
    problems: Sequence[str] = ()  # the findings behind the message, if any: the CLI prints one per line before it


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """A path, tag, `latest` file or rank file that should exist does not."""


class CorruptCheckpointError(CkptError, ValueError):
    """Files exist but disagree with each other or with their own checksums."""


class UnsupportedCheckpointError(CkptError, ValueError):
    """A layout ckpttools recognises but cannot convert (pipeline, tensor parallel, MoE, NVMe offload)."""


class UnsafeCheckpointError(CkptError, ValueError):
    """A pickle asks for code outside the allowlist, or a path escapes its folder."""


class OutputError(CkptError, OSError):
    """The output folder exists, lies inside the input, or the disk is too small."""


class UsageError(CkptError):
    """Options that contradict each other or the checkpoint."""

    exit_code = 2


class SelectionError(UsageError, CheckpointNotFoundError):
    """--step, --best or --tag chose a checkpoint PATH does not hold, or cannot choose among (PATH names one
    checkpoint): a usage error (exit 2), and still a CheckpointNotFoundError for callers of the library."""


class VerificationError(CkptError):
    """A consolidated folder failed a check (missing keys, bad header, tensors differing from the shards)."""


class RemoteError(CkptError):
    """The Hub or the network failed in a way that retrying later may help: CI gets its own exit code."""

    exit_code = 3


class AuthError(CkptError):
    """No token, a rejected token, or no right to write the repo: retrying cannot help, logging in can."""

    exit_code = 4


def short(value: Any, n: int = 40) -> str:
    """repr(value) cut to n characters, safe on any pickled value (huge ints cannot be printed)."""
    try:
        text = _REPR.repr(value) if not isinstance(value, BaseException) else str(value)
    except Exception:  # noqa: BLE001 - a message must not fail
        return f"<a {type(value).__name__}>"
    return text if len(text) <= n else text[: n - 3] + "..."


_REPR = reprlib.Repr()  # bounded work on any structure: a few levels, a few items each
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40

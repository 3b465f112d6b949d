"""What every `ckpt` command shares: the one error boundary, shared options, progress bars, output helpers.

Every line that starts with `Error: ` is written by `echo_error`, and every exception that leaves a command
becomes one such line and an exit code in `CkptGroup.invoke`. This module imports click, the standard
library and `ckpttools.errors` only: the command modules import it, and `ckpt --help` should stay cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import click

from ..errors import CkptError
from ..staging import sigterm_as_interrupt as _sigterm_as_interrupt

if TYPE_CHECKING:
    from ..distributed import Launch, ProcessGroup

EPILOG = """\b
Examples:
  ckpt inspect out/checkpoint-500
  ckpt consolidate out/checkpoint-500 --to safetensors --dtype bf16 --out out/model
  ckpt consolidate out/ --step 500 --json
  ckpt reshard out/checkpoint-500 --dp 8
  ckpt reshard out/checkpoint-500 --universal
  ckpt verify out/model --against out/checkpoint-500
  ckpt push out/model --repo my-org/my-model

\b
Exit codes: 0 success, 1 bad checkpoint or failed check, 2 usage error
            (or HF_HUB_OFFLINE set for push), 3 remote/auth/network failure.
Set CKPT_DEBUG=1 to see tracebacks."""

EXIT_INTERRUPTED = 130
INTERNAL_ERROR = "internal error ({what}); please report it, rerun with CKPT_DEBUG=1 for the traceback"


# --------------------------------------------------------------------------------------------------
# The error boundary
# --------------------------------------------------------------------------------------------------


def echo_error(message: str) -> None:
    """One `Error: ` line on stderr."""
    click.echo(f"Error: {message}", err=True)


def _debug() -> bool:
    """CKPT_DEBUG set: let exceptions through, so Python prints the traceback."""
    return bool(os.environ.get("CKPT_DEBUG"))


def _one_line(text: str) -> str:
    return " ".join(text.split())


class CkptGroup(click.Group):
    """The one place where exceptions become a message and an exit code.

    CkptError: its message (after its `problems`, one per line) and its exit code (1, 2 or 3). OSError: the
    system's reason and the file, exit 1. KeyboardInterrupt: exit 130. Anything else is a bug: one line
    naming the exception, exit 1. click's own exceptions (usage errors, `ctx.exit`) pass through to click.
    With CKPT_DEBUG set, everything but KeyboardInterrupt is re-raised for the traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        result: list[Any] = []
        code = run_guarded(lambda: result.append(super(CkptGroup, self).invoke(ctx)))
        if code:
            ctx.exit(code)
        return result[0] if result else None


def run_guarded(body: Callable[[], object], *, debug: bool = False, silent: bool = False) -> int:
    """Run a command body; the one place exceptions become a message and an exit code (see CkptGroup).

    Used by `ckpt` and by the argparse entry points that mirror DeepSpeed's scripts. SIGTERM is handled
    like Ctrl-C, so staged outputs are removed either way. `silent`: the same exit code, nothing printed
    (the ranks other than 0 of a run on many processes).
    """
    show = debug or _debug()
    say = (lambda message: None) if silent else echo_error
    with _sigterm_as_interrupt():
        try:
            body()
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except CkptError as e:
            for problem in e.problems:
                say(problem)
            if show:
                raise
            say(str(e))
            return e.exit_code
        except KeyboardInterrupt:
            if not silent:
                click.echo("Interrupted; nothing was published.", err=True)
            return EXIT_INTERRUPTED
        except OSError as e:  # disk full, permissions: the user's environment, not a bug
            if show:
                raise
            say(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
            return 1
        except Exception as e:  # a bug: one line that says so instead of a traceback
            if show:
                raise
            message = _one_line(str(e))
            say(INTERNAL_ERROR.format(what=f"{type(e).__name__}: {message}" if message else type(e).__name__))
            return 1
    return 0


def run_on_ranks(launch: Launch, body: Callable[[ProcessGroup], object]) -> None:
    """A command on every rank of a launcher's group (torchrun): errors agreed by all, printed by rank 0 only.

    Every rank exits with the same code (a `RankFailedError` names the rank that failed), and none leaves
    before rank 0 has cleaned up and printed: a launcher stops the remaining ranks once one has exited.
    """
    from ..distributed import join_group

    joined: list[ProcessGroup] = []

    def run() -> None:
        joined.append(join_group(launch))
        body(joined[0])

    try:
        code = run_guarded(run, silent=launch.rank != 0)
    finally:
        if joined:
            joined[0].close()
    if code:
        raise click.exceptions.Exit(code)


# --------------------------------------------------------------------------------------------------
# Options shared by several commands
# --------------------------------------------------------------------------------------------------

checkpoint_path = click.argument("path", type=click.Path(path_type=Path))
tag_option = click.option("--tag", help="Tag folder to read (default: the content of `latest`).")
step_option = click.option("--step", type=int, help="With a Trainer output_dir: use checkpoint-STEP (default: newest).")
best_option = click.option("--best", is_flag=True, help="With a Trainer output_dir: use best_model_checkpoint.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
workers_option = click.option(
    "--workers",
    type=click.IntRange(min=1, max=1024),
    metavar="N",
    help="Threads for 16-bit casts and CRC-32 checks (default: this process's share of the cores, at most 8).",
)
config_option = click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path),
    metavar="PATH",
    help="The model's config.json (or its folder; tokenizer files come too), when the checkpoint has none.",
)


def checkpoint_selection(f: Callable[..., Any]) -> Callable[..., Any]:
    """--tag, --step and --best: which checkpoint and tag inside PATH to read."""
    return tag_option(step_option(best_option(f)))


# --------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------


def progress_enabled(quiet: bool) -> bool:
    """Bars only for a person watching: stderr is a terminal and this is not CI."""
    if quiet or os.environ.get("CI") or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        return False
    return sys.stderr.isatty()


class _Progress:
    """Bytes done / total on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str) -> None:
        self.label, self.total, self.done, self.last = label, 0, 0, 0.0
        self.start = time.monotonic()

    def begin(self, total: int) -> None:
        self.total = total

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            pct = 100 * self.done / self.total if self.total else 100
            rate = self.done / max(now - self.start, 1e-6) / 1e6
            sys.stderr.write(
                f"\r{self.label}: {self.done / 1e6:,.0f}/{self.total / 1e6:,.0f} MB ({pct:3.0f}%) {rate:,.0f} MB/s"
            )
            sys.stderr.flush()

    def end(self) -> None:
        if self.last:  # a bar was drawn
            sys.stderr.write("\n")


class ProgressArgs(TypedDict):
    """The `on_start` / `on_progress` keyword arguments of consolidate and reshard."""

    on_start: Callable[[int], None] | None
    on_progress: Callable[[int], None] | None


@contextlib.contextmanager
def progress_callbacks(label: str, quiet: bool) -> Iterator[ProgressArgs]:
    """Arguments that draw a bar on stderr, or None for both when no one watches."""
    if not progress_enabled(quiet):
        yield {"on_start": None, "on_progress": None}
        return
    bar = _Progress(label)
    try:
        yield {"on_start": bar.begin, "on_progress": bar.advance}
    finally:
        bar.end()


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def echo_json(data: dict[str, Any]) -> None:
    """The result as one JSON object on stdout (--json)."""
    click.echo(json.dumps(data, indent=None, default=str))


def emit(data: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """The result on stdout: one JSON object, or the human summary."""
    if as_json:
        echo_json(data)
    else:
        click.echo(human(data))


def echo_notes(notes: Iterable[str], prefix: str = "Note: ") -> None:
    for note in notes:
        click.echo(f"{prefix}{note}", err=True)


def report(data: dict[str, Any], as_json: bool, quiet: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Notes on stderr (unless quiet), then the result on stdout."""
    if not quiet:
        echo_notes(data.get("notes", []))
    emit(data, as_json, human)


# --------------------------------------------------------------------------------------------------
# Parameter types: every option checked at parse time (usage error, exit 2)
# --------------------------------------------------------------------------------------------------

if TYPE_CHECKING:  # click 8.5 made ParamType generic; the click >= 8.1 users have may not subscript it
    _IntParam = click.ParamType[int]
    _StrParam = click.ParamType[str]
else:
    _IntParam = _StrParam = click.ParamType

# Decimal units as huggingface_hub's shard planning reads them, binary units as people write them.
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`5GB` -> 5_000_000_000, `5GiB` -> 5 * 2**30, `1048576` -> bytes; ValueError for anything else or <= 0."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size")
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()]
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


class SizeType(_IntParam):
    """A positive byte size: `5GB`, `500MB`, `5GiB` or a number of bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and value > 0:
            return value
        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size; use forms such as 5GB, 500MB, 5GiB or a number of bytes", param, ctx)


# Every spelling a user may type -> the short name the library takes.
DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}  # fmt: skip


class DTypeType(_StrParam):
    """fp32, bf16 or fp16, also spelled float32, bfloat16, float16 (as torch and config.json write them)."""

    name = "[fp32|bf16|fp16]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        short = DTYPE_ALIASES.get(str(value).strip().lower())
        if short is None:
            self.fail(f"{value!r} is not a dtype; use fp32, bf16 or fp16 (or float32, bfloat16, float16)", param, ctx)
        return short


SIZE = SizeType()
DTYPE = DTypeType()

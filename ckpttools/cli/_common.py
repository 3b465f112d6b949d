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
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import click

from ckpttools import signals
from ckpttools.errors import CkptError

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import Launch, ProcessGroup

EXIT_CODES = """\b
Exit codes: 0 success (also when a signal comes after the output was published),
            1 bad checkpoint, failed check or unusable output folder,
            2 usage error, 3 remote or network failure (a retry may help),
            4 authentication refused (a retry cannot help),
            130 SIGINT, 143 SIGTERM, 129 SIGHUP (nothing was published).
Set CKPT_DEBUG=1 to see tracebacks."""

EPILOG = f"""\b
Examples:
  ckpt inspect out/checkpoint-500
  ckpt consolidate out/checkpoint-500 --to safetensors --dtype bf16 --out out/model
  ckpt consolidate out/ --step 500 --json
  ckpt reshard out/checkpoint-500 --dp 8
  ckpt reshard out/checkpoint-500 --universal
  ckpt verify out/model --against out/checkpoint-500
  ckpt push out/model --repo my-org/my-model
  torchrun --nproc-per-node 8 --no-python ckpt consolidate out/checkpoint-500 --distributed

{EXIT_CODES}"""

INTERNAL_ERROR = "internal error ({what}); please report it, rerun with CKPT_DEBUG=1 for the traceback"
TEST_DELAY_VAR = "CKPT_TEST_SLOW_WRITE_MS"  # tests only: see slow_down_for_tests


# --------------------------------------------------------------------------------------------------
# The error boundary
# --------------------------------------------------------------------------------------------------


def echo_error(message: str) -> None:
    """One `Error: ` line on stderr (a mounted remote checkpoint's local folder named by its URL)."""
    click.echo(f"Error: {_remote_names(message)}", err=True)


def _remote_names(text: str) -> str:
    remote = sys.modules.get("ckpttools.io.remote")
    return remote.describe(text) if remote is not None else text


def _remote_cleanup() -> None:
    """Remove the scratch folders of mounted remote checkpoints (os._exit skips atexit)."""
    remote = sys.modules.get("ckpttools.io.remote")
    if remote is not None:
        remote.cleanup()


def _debug() -> bool:
    """CKPT_DEBUG set: let exceptions through, so Python prints the traceback."""
    return bool(os.environ.get("CKPT_DEBUG"))


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _JsonRun:
    """--json for the run under way: whether its command line asked for it, and whether its one object is out.

    With --json, stdout carries exactly one JSON object whatever happens: the result, or on failure (also a
    usage error click raises while parsing, a signal) `{"error": {"message", "exit_code", "problems"}}`
    (docs/json.md). The `Error:` lines still go to stderr.
    """

    wanted = False
    printed = False


_JSON = _JsonRun()


def _asks_for_json(args: Iterable[str]) -> bool:
    """Whether a command line asks for JSON, read before (or though) its parsing fails: `--json` before `--`."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def echo_json_error(message: str, exit_code: int, problems: Iterable[str] = ()) -> None:
    """The failure as the run's one JSON object on stdout, when --json was asked for and nothing is out yet."""
    if _JSON.wanted and not _JSON.printed:
        error = {"message": _one_line(message), "exit_code": exit_code, "problems": list(problems)}
        echo_json({"error": error})


class _Said:
    """The lines a failure printed (problems first, the message last): the JSON error object repeats them."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.lines: list[str] = []
        self._say = say

    def __call__(self, message: str) -> None:
        self.lines.append(message)
        self._say(message)

    def as_json(self, code: int) -> None:
        if self.lines:
            echo_json_error(self.lines[-1], code, self.lines[:-1])


class CkptGroup(click.Group):
    """The one place where exceptions become a message and an exit code.

    CkptError: its message (after its `problems`, one per line) and its exit code (1, 2, 3 or 4).
    ModuleNotFoundError of an optional dependency: the pip extra to install, exit 1. OSError: the system's
    reason and the file, exit 1. A signal (KeyboardInterrupt): one line, exit 128 + its number, or 0 with a
    line saying so when the output was already published. Anything else is a bug: one line naming the
    exception, exit 1. click's own exceptions (usage errors, `ctx.exit`) pass through to click. With
    CKPT_DEBUG set, everything but a signal is re-raised for the traceback.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Note whether the command line asks for --json first: a failure from here on, a usage error of click's
        included, is then the run's JSON object too."""
        _JSON.wanted, _JSON.printed = _asks_for_json(args), False
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            echo_json_error(e.format_message(), e.exit_code)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        result: list[Any] = []
        code = run_guarded(
            lambda: result.append(super(CkptGroup, self).invoke(ctx)), command=lambda: ctx.invoked_subcommand
        )
        if code:
            ctx.exit(code)
        return result[0] if result else None

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """As the `ckpt` process (signals.install() ran): a signal at any moment, also during start-up, while
        click parses or after the command printed, ends the run with its line and code, and the process leaves
        through a flushed os._exit (signals.exit_now). Interpreter shutdown would put the default handlers
        back (a signal then kills the process, -15, after the output was published) and runs torch's native
        teardown, which can abort; nothing is left to run by then. Elsewhere (CliRunner, a program calling
        main), click's own main."""
        if not signals.installed():
            try:
                return super().main(*args, **kwargs)
            finally:  # a program running several commands (CliRunner): the next one asks for itself
                _JSON.wanted = _JSON.printed = False
        published_before = len(_published_outputs())
        try:
            super().main(*args, **kwargs)
            code: Any = 0
        except SystemExit as e:
            code = e.code
        except Exception as e:  # raised outside the command's body (click itself): still one line, no traceback
            if _debug():
                raise
            said = _Said(echo_error)
            code = _report_failure(e, False, said, None)
            said.as_json(code)
        code = code if isinstance(code, int) else (0 if code is None else 1)
        signum = signals.received()
        if signum is not None and not signals.reported():  # came before the command's body or after it ended
            code = _interrupted(signum, published_before, silent=False) if code == 0 else code
        _remote_cleanup()
        signals.exit_now(code)


def _published_outputs() -> list[Path]:
    """The output folders this process published that are still there (staging.published_outputs()); a
    temporary folder that was published and removed again (push's) does not count. Never imports staging:
    unloaded, it published nothing."""
    staging = sys.modules.get("ckpttools.io.staging")
    listed = getattr(staging, "published_outputs", None)
    return [Path(p) for p in listed() if Path(p).exists()] if listed is not None else []


def _interrupted(signum: int | None, published_before: int, *, silent: bool) -> int:
    """The one line for a run a signal ended, and its exit code: 128 + the signal's number, or 0 when the
    output had been published (it is complete and stays)."""
    signals.mark_reported()
    published = _published_outputs()[published_before:]
    if published:
        if not silent:
            outs = ", ".join(map(str, published))
            _say_interrupted(f"Interrupted after publishing {outs}; the output is complete.", 0)
        return 0
    code = signals.exit_code(signum) if signum is not None else signals.exit_code(signal.SIGINT)
    if not silent:
        what = f" ({signals.signal_name(signum)})" if signum is not None else ""
        _say_interrupted(f"Interrupted{what}; nothing was published.", code)
    return code


def _say_interrupted(line: str, code: int) -> None:
    click.echo(line, err=True)
    echo_json_error(line, code)


def _was_interrupted(error: BaseException) -> int | bool | None:
    """Whether `error` means this process was interrupted; False, or the signal's number (None: not known).

    A KeyboardInterrupt; a rank failure agreed on after this rank's own interrupt; or an error Python made of
    one (a signal inside a class body's `__set_name__` is re-raised as RuntimeError, caused by it). A CkptError
    is a message its raiser chose (push saying whether its commit landed): it stands, whatever caused it.
    """
    from ckpttools.ranks.distributed import RankFailedError

    link: BaseException | None = error.__cause__ or error if isinstance(error, RankFailedError) else error
    for _ in range(16):  # the chain of causes, never past a CkptError
        if link is None or isinstance(link, CkptError):
            return False
        if isinstance(link, KeyboardInterrupt):
            return getattr(link, "signum", None) or signals.received()
        link = link.__cause__ or link.__context__
    return False


def _missing_extra(error: ModuleNotFoundError, command: str | None) -> str | None:
    """The line naming the pip extra that provides the missing module (ckpttools.extras), or None."""
    try:
        from ckpttools.extras import describe_missing
    except ImportError:  # pragma: no cover - extras.py ships with the package
        return None
    return describe_missing(error, command)


def run_guarded(
    body: Callable[[], object],
    *,
    debug: bool = False,
    silent: bool = False,
    silent_interrupt: bool = False,
    command: Callable[[], str | None] | None = None,
    as_json: bool | None = None,
) -> int:
    """Run a command body; the one place exceptions become a message and an exit code (see CkptGroup).

    Used by `ckpt` and by the argparse entry points that mirror DeepSpeed's scripts. SIGINT, SIGTERM and
    SIGHUP raise `signals.Interrupted` inside the body, so staged outputs are removed. `silent`: the same
    exit code, nothing printed (the ranks other than 0 of a run on many processes); `silent_interrupt`: the
    same for a signal only. `command`: the subcommand's name, for the pip extra a missing module needs.
    `as_json`: the command line asked for --json (None: as the run this body is part of said), so a failure
    is also the run's one JSON object on stdout (`echo_json_error`), unless the result was printed already.
    """
    if as_json is not None:
        _JSON.wanted, _JSON.printed = as_json, False
    show = debug or _debug()
    said = _Said((lambda message: None) if silent else echo_error)
    published_before = len(_published_outputs())
    try:
        with signals.handling():
            body()
            signals.raise_if_received()  # a signal whose exception was swallowed (a finalizer) still ends the run
    except click.ClickException as e:  # a usage error click found: click prints it (and the usage) on stderr
        if not silent:
            echo_json_error(e.format_message(), e.exit_code)
        raise
    except (click.exceptions.Exit, click.Abort):
        raise
    except BaseException as e:  # every exception becomes one line and a code (_report_failure)
        interrupted = _was_interrupted(e)
        if interrupted is not False:
            return _interrupted(interrupted or None, published_before, silent=silent or silent_interrupt)
        if not isinstance(e, Exception):  # SystemExit and the like: not ours to turn into a message
            raise
        code = _report_failure(e, show, said, command)
        said.as_json(code)
        return code
    return 0


def _report_failure(e: Exception, show: bool, say: Callable[[str], None], command: Callable[[], str | None] | None
                    ) -> int:  # fmt: skip
    """An exception from a command body: its line(s) and exit code (re-raised with CKPT_DEBUG)."""
    if isinstance(e, CkptError):
        for problem in e.problems:
            say(problem)
        if show:
            raise e
        say(str(e))
        return e.exit_code
    if show:
        raise e
    if isinstance(e, ModuleNotFoundError):
        line = _missing_extra(e, command() if command else None)
        if line is not None:
            say(line)
            return 1
    if isinstance(e, OSError):  # disk full, permissions: the user's environment, not a bug
        say(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
        return 1
    message = _one_line(str(e))  # a bug: one line that says so instead of a traceback
    say(INTERNAL_ERROR.format(what=f"{type(e).__name__}: {message}" if message else type(e).__name__))
    return 1


def run_on_ranks(launch: Launch, body: Callable[[ProcessGroup], object]) -> None:
    """A command on every rank of a launcher's group (torchrun --distributed): errors agreed by all, printed by
    rank 0 only.

    Joining is bounded (CKPT_RENDEZVOUS_TIMEOUT) and every rank says why it could not join: the group that would
    agree on one line does not exist yet. Then every rank exits with the same code (a `RankFailedError` names
    the rank that failed), and none leaves before rank 0 has cleaned up and printed: a launcher stops the
    remaining ranks once one has exited. A rank lost after rank 0 published the output does not make the run
    a failure: the output is complete, rank 0 says so in a note and exits 0.
    """
    from ckpttools.ranks.distributed import join_group

    if launch.rank != 0:  # rank 0 prints the run's one JSON object, result or error; the others' lines are stderr's
        _JSON.wanted = False
    joined: list[ProcessGroup] = []
    code = run_guarded(lambda: joined.append(join_group(launch)), silent_interrupt=launch.rank != 0,
                       command=lambda: "distributed")  # fmt: skip
    if code:
        raise click.exceptions.Exit(code)
    group = joined[0]
    before = len(_published_outputs())
    noted: list[str] = []
    try:
        code = run_guarded(lambda: _published_despite_lost_rank(group, body, noted), silent=launch.rank != 0)
    finally:
        with signals.disarmed():  # a signal from here on is reported by _signal_after_the_body, not raised
            lost = group.close()
    with signals.disarmed():
        if lost is not None and not code and not noted:
            _note_lost_after_publishing(before, "a rank", lost.reason, noted)
        code = _signal_after_the_body(code, before, launch.rank)
    if code:
        raise click.exceptions.Exit(code)


def _signal_after_the_body(code: int, published_before: int, rank: int) -> int:
    """A signal that came once this rank's part was done (while it waited for the others to leave): rank 0
    says so ("after publishing" when it published), the others stay silent with the run's code."""
    signum = signals.received()
    if signum is None or signals.reported():
        return code
    if rank != 0 or code:
        signals.mark_reported()
        return code
    return _interrupted(signum, published_before, silent=False)


def _published_despite_lost_rank(group: ProcessGroup, body: Callable[[ProcessGroup], object], noted: list[str]) -> None:
    """`body(group)`; a failure after this rank published the output (a peer lost after the rename) becomes a
    note, since the output is complete."""
    from ckpttools.ranks.distributed import RankFailedError, RankLostError

    before = len(_published_outputs())
    try:
        body(group)
    except Exception as e:
        if _was_interrupted(e) is not False:  # this rank's own signal: the boundary says so
            raise
        who = f"rank {e.rank}" if isinstance(e, RankFailedError) and e.rank is not None else "a rank"
        reason = (e.failed_message if isinstance(e, RankFailedError) else e.reason if isinstance(e, RankLostError)
                  else f"{type(e).__name__}: {_one_line(str(e))}")  # fmt: skip
        if not _note_lost_after_publishing(before, who, reason, noted):
            raise


def _note_lost_after_publishing(published_before: int, who: str, reason: str, noted: list[str]) -> bool:
    """The note for a rank lost after this rank published the output; False when it published nothing."""
    published = _published_outputs()[published_before:]
    if not published:
        return False
    outs = ", ".join(map(str, published))
    noted.append(f"published {outs}; the output is complete; {who} was lost after ({reason})")
    echo_notes(noted[-1:])
    return True


@contextlib.contextmanager
def launch_for(distributed: bool, quiet: bool, workers: int | None) -> Iterator[Launch | None]:
    """The launcher's group to join with --distributed, else None: one process, whatever the environment says.

    A `ckpt` started by a training rank inherits RANK, WORLD_SIZE and MASTER_*: without --distributed they are
    ignored (one note), and nothing of torch.distributed is imported. Inside the block the threads are
    `workers` (--workers), else this process's share of the cores, which follows LOCAL_WORLD_SIZE only with
    --distributed; both settings end with the block (a program running several commands, a test).
    """
    from ckpttools.io.threads import set_workers, share_cores_with_local_ranks
    from ckpttools.ranks.distributed import ignored_launcher_note, launch_from_env

    launch = launch_from_env() if distributed else None
    note = None if distributed else ignored_launcher_note()
    if note and not quiet:
        echo_notes([note])
    set_workers(workers)
    try:
        with share_cores_with_local_ranks(distributed):
            yield launch
    finally:
        set_workers(None)


def slow_down_for_tests() -> None:
    """Tests only: sleep CKPT_TEST_SLOW_WRITE_MS milliseconds (after each chunk written, and once the command's
    work is done, before its result is printed), so a test's signal can land mid-run or after publishing."""
    ms = os.environ.get(TEST_DELAY_VAR)
    if ms:
        time.sleep(float(ms) / 1000)


# --------------------------------------------------------------------------------------------------
# Options shared by several commands
# --------------------------------------------------------------------------------------------------

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class CheckpointPathType(click.Path):
    """A local path that exists (a missing one is a usage error, as click's own for --config), or the URL of a
    remote checkpoint (s3://, gs://, az://, hf://: io/remote.py), which is mounted as a local folder of its small
    files whose rank files are read by byte range."""

    def __init__(self) -> None:
        super().__init__(exists=True, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and _URL.match(value) and not value.lower().startswith("file://"):
            from ckpttools.io.remote import is_remote, mount

            if not is_remote(value):
                self.fail(f"{value!r}: only local paths and s3://, gs://, az://, hf:// URLs can be read", param, ctx)
            return mount(value)
        return super().convert(value, param, ctx)


class OutputPathType(click.Path):
    """A local output folder. A remote URL is refused: an object store cannot publish a folder at once (objects
    land one by one), so the staging guarantee (nothing visible until complete) could not be kept."""

    def __init__(self) -> None:
        super().__init__(path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and _URL.match(value) and not value.lower().startswith("file://"):
            self.fail(
                f"{value!r}: the output must be a local folder: an object store publishes files one by one, so a "
                "half-written model could be seen; write it locally, then upload it (aws s3 sync, gcloud storage "
                "cp, azcopy), or `ckpt push` it to the Hub",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


def needs_out(path: Path, out: Path | None) -> None:
    """A remote checkpoint has no folder beside it to write into: --out is required."""
    if out is None and "ckpttools.io.remote" in sys.modules:
        from ckpttools.io.remote import url_of

        if (url := url_of(path)) is not None:
            raise click.UsageError(f"{url} is remote: give --out, the local folder to write into")


CHECKPOINT_PATH = CheckpointPathType()
OUTPUT_PATH = OutputPathType()
checkpoint_path = click.argument("path", type=CHECKPOINT_PATH)
INPUTS = (
    "PATH may be a DeepSpeed ZeRO checkpoint (a save_dir holding `latest`, a tag folder, a universal checkpoint), "
    "a Trainer checkpoint-N/ or output_dir, an accelerate save_state or Lightning folder, an FSDP2 / torch DCP "
    "folder (`.metadata` + *.distcp, HF safetensors shards, accelerate's per-rank files) or a run folder of its "
    "step-N/ folders (torchtitan's too), a Megatron-Core torch_dist folder (Megatron-LM's or Megatron-Bridge's "
    "iter_NNNNNNN/ and the folder holding them, a NeMo 2 checkpoint or its checkpoints/ folder), or the URL of "
    "any of these (s3://, gs://, az://, hf://)."
)
STEP = click.IntRange(min=0)
tag_option = click.option(
    "--tag",
    help="DeepSpeed: the tag folder to read (default: the one `latest` names); accelerate FSDP: the model folder "
    "(pytorch_model_fsdp_N). Refused where PATH has no tags to choose from.",
)
step_option = click.option(
    "--step",
    type=STEP,
    help="With a run's output folder: read its checkpoint-STEP or step-STEP folder (default: the newest). Refused "
    "when PATH is one checkpoint of another step.",
)
best_option = click.option(
    "--best",
    is_flag=True,
    help="With a Trainer output_dir: read the best_model_checkpoint its trainer_state.json names. Refused "
    "elsewhere, and with --step.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
workers_option = click.option(
    "--workers",
    type=click.IntRange(min=1, max=1024),
    metavar="N",
    help="Threads for 16-bit casts and CRC-32 checks (default: this process's share of the cores, at most 8).",
)
distributed_option = click.option(
    "--distributed",
    is_flag=True,
    envvar="CKPT_DISTRIBUTED",
    show_envvar=True,
    help="Share the work among the ranks a launcher started (torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). "
    "Each rank waits up to CKPT_RENDEZVOUS_TIMEOUT seconds (default 300) for the others to join, then "
    "CKPT_DIST_TIMEOUT (default 3600) at each step. Without it those variables are ignored: one process.",
)
config_option = click.option(
    "--config",
    "config",
    type=click.Path(exists=True, path_type=Path),
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
    slow = bool(os.environ.get(TEST_DELAY_VAR))
    if not progress_enabled(quiet):
        yield {"on_start": None, "on_progress": (lambda n: slow_down_for_tests()) if slow else None}
        return
    bar = _Progress(label)

    def advance(n: int) -> None:
        bar.advance(n)
        slow_down_for_tests()

    try:
        yield {"on_start": bar.begin, "on_progress": advance if slow else bar.advance}
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
    click.echo(_remote_names(json.dumps(data, indent=None, default=str)))
    _JSON.printed = True


def emit(data: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """The result on stdout: one JSON object, or the human summary."""
    if as_json:
        echo_json(data)
    else:
        click.echo(_remote_names(human(data)))


def echo_notes(notes: Iterable[str], prefix: str = "Note: ") -> None:
    for note in notes:
        click.echo(_remote_names(f"{prefix}{note}"), err=True)


def report(data: dict[str, Any], as_json: bool, quiet: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Notes on stderr (unless quiet), then the result on stdout."""
    slow_down_for_tests()
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

"""SIGINT, SIGTERM and SIGHUP at any moment: one line, exit 128 + the signal's number, never a traceback.

Standard library only, so `ckpttools.cli` can install the handler as its first statement, before click or the
library load: a signal during start-up is then recorded instead of landing as a KeyboardInterrupt inside an
import.

One handler for the three signals. It records every signal and raises `Interrupted` (a KeyboardInterrupt that
carries the signal's number, so every cleanup path runs) only where a command asked for it:

- inside `armed()` (a command's body): the first signal raises at once; one that came before the body began is
  raised when it begins;
- while staging cleanup or a publish runs (`staging.shielded()`) nothing is raised: the signal is handed to
  `staging.defer_signal`, which delivers it again when the cleanup ends, unless an exception is already on its
  way out;
- after the first `Interrupted`, later signals are only recorded: a second Ctrl-C cannot break the cleanup the
  first one started.

A raise that is swallowed (it landed in a finalizer: Python prints "Exception ignored in ...") is delivered again
(`_unraisable`), and `raise_if_received` lets the boundary treat a run that saw a signal as interrupted even when
its body returned. Python runs signal handlers in the main thread, between bytecodes: a blocking socket read
or sleep is interrupted (EINTR), the handler raises, and the exception leaves the wait (PEP 475).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

TYPE_CHECKING = False  # not from typing: the handler goes in before anything that is not needed loads
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType
    from typing import Any, ClassVar, NoReturn

HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A handled signal, raised in the main thread: SIGINT, SIGTERM or SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal_name(self.signum)

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (SIGHUP 129, SIGINT 130, SIGTERM 143)."""
    return 128 + signum


class _State:
    received: ClassVar[list[int]] = []  # every handled signal, in order
    live = False  # an Interrupted was raised and has not been swallowed
    armed = 0  # depth of armed() blocks
    process = False  # install(): the handler belongs to this process (the `ckpt` command) for good
    reported = False  # the boundary has told the user about the signal
    in_hook = False  # _unraisable is running: raise nothing there
    installs = 0  # depth of handling() blocks that installed the handler (outside the `ckpt` process)
    previous_hook: Callable[[Any], Any] = sys.unraisablehook


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _handler(signum: int, frame: FrameType | None) -> None:
    _State.received.append(signum)
    if _cleanup_in_progress():
        sys.modules["ckpttools.io.staging"].defer_signal(signum)  # delivered again when the cleanup ends
        return
    if _State.armed and not _State.live and _in_import(frame):
        _redeliver_after_import(signum)
        return
    _raise_pending()


def _in_import(frame: FrameType | None) -> bool:
    """The main thread is importing a module. An exception raised there can land in Python code that native
    code called back (torch's import runs pybind11 registrations): C++ cannot pass it on and aborts the process
    (SIGABRT, `terminate called after throwing an instance of 'pybind11::error_already_set'`), leaving the
    staging folder behind. So a signal is delivered again once the import is over, a second or two at most."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _redeliver_after_import(signum: int) -> None:
    def wait_then_send() -> None:
        main = threading.main_thread().ident or 0
        while _in_import(sys._current_frames().get(main)):
            time.sleep(0.01)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(main, signum)

    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down: the boundary's check remains
        threading.Thread(target=wait_then_send, daemon=True, name="ckpt-signal-after-import").start()


def _cleanup_in_progress() -> bool:
    """Staging cleanup or a publish is running (`staging.shielded()`); never imports staging: unloaded, it runs
    nothing."""
    staging = sys.modules.get("ckpttools.io.staging")
    return staging is not None and bool(getattr(staging, "cleanup_in_progress", lambda: False)())


def _raise_pending() -> None:
    """Raise the first recorded signal if this is a place to raise it (armed, no cleanup running, not raised
    yet)."""
    if _State.received and _State.armed and not _State.live and not _State.in_hook and not _cleanup_in_progress():
        _State.live = True
        raise Interrupted(_State.received[0])


def _unraisable(args: Any) -> None:
    """An Interrupted raised inside a finalizer is printed and dropped by Python: deliver the signal again, once
    this hook has returned, so that it lands in the code the finalizer interrupted; print nothing."""
    if not isinstance(args.exc_value, Interrupted):
        _State.previous_hook(args)
        return
    _State.in_hook, _State.live = True, False  # the handler records but does not raise inside this hook
    try:
        threading.Thread(target=_redeliver, args=(args.exc_value.signum,), daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: the boundary's check at the end remains
        pass
    finally:
        _State.in_hook = False


def _redeliver(signum: int) -> None:
    while _State.in_hook:
        time.sleep(0.001)
    time.sleep(0.001)  # the hook's last instructions
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_kill(threading.main_thread().ident or 0, signum)


def _set_handlers() -> Callable[[], None]:
    """Put the handler (and the finalizer hook) in place; returns what puts the previous ones back."""
    previous = {signum: signal.signal(signum, _handler) for signum in HANDLED}
    previous_hook = sys.unraisablehook
    if previous_hook is not _unraisable:
        _State.previous_hook, sys.unraisablehook = previous_hook, _unraisable

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = previous_hook

    return restore


def install(early: list[int] | None = None) -> None:
    """The handler for this whole process: the `ckpt` command itself, never a program that imports ckpttools.

    `early`: signals a provisional handler recorded before this module could load; they count as received.
    """
    if _on_main_thread():
        _set_handlers()
        _State.process = True
        _State.received.extend(early or ())


def installed() -> bool:
    """install() ran: this process is the `ckpt` command, and ends through `exit_now` (cli._common.CkptGroup.main)."""
    return _State.process


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Signals raise Interrupted inside the block (main thread only; elsewhere the block runs as it is).

    In the `ckpt` process the handler is already installed and stays; in a program that imports ckpttools (or a
    test) it is installed for the block and the previous handlers come back after it.
    """
    if not _on_main_thread():
        yield
        return
    if _State.process or _State.installs:  # installed for the process, or by an enclosing block
        with armed():
            yield
        return
    restore = _set_handlers()
    _reset()
    _State.installs += 1
    try:
        with armed():
            yield
    finally:
        _State.installs -= 1
        restore()


def _reset() -> None:
    _State.received, _State.live, _State.reported = [], False, False


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Inside, a signal raises Interrupted at once; one recorded before the block is raised as it begins."""
    if not _on_main_thread():
        yield
        return
    _State.armed += 1
    try:
        _raise_pending()
        yield
    finally:
        _State.armed -= 1


@contextlib.contextmanager
def disarmed() -> Iterator[None]:
    """Inside, a signal is only recorded, even within an armed block: for code between two boundaries that
    reports a signal itself once the block ends (a rank leaving its group)."""
    if not _on_main_thread():
        yield
        return
    depth, _State.armed = _State.armed, 0
    try:
        yield
    finally:
        _State.armed += depth


def received() -> int | None:
    """The first signal this process handled (since `handling` installed the handler), or None."""
    return _State.received[0] if _State.received else None


def count() -> int:
    """How many handled signals this process has received: a wait that a second Ctrl-C ends compares it."""
    return len(_State.received)


def raise_if_received() -> None:
    """At the end of a command's body: a signal that came, even one whose exception was swallowed, ends the run
    as interrupted. Once the boundary reported it (an inner boundary: a rank's), nothing is raised again."""
    if _State.received and not _State.reported:
        _State.live = True
        raise Interrupted(_State.received[0])


def mark_reported() -> None:
    """The boundary told the user about the signal (or chose to say nothing): CkptGroup.main adds no line."""
    _State.reported = True


def reported() -> bool:
    return _State.reported


def exit_now(code: int) -> NoReturn:
    """End the process with `code` after flushing stdout and stderr, skipping interpreter teardown.

    How the `ckpt` process ends once its command is done, interrupted or not: interpreter shutdown puts the
    default handlers back (a late signal would kill a run whose output is published), and what it runs
    (torch's native teardown, finalizers of objects half-built when a signal landed in an import) can abort
    (SIGABRT was seen after SIGTERM during `import torch`) or print "Exception ignored in ..." over the one
    line the user was given.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

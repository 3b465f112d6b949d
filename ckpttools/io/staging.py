"""The one way every command writes an output folder: a private staging sibling, published whole when complete.

Guarantees (README "Safety"):

- An output folder appears only complete. It is written into a staging folder beside it, put on the disk
  (`DiskFlush`) and then published by one rename: `renameat2(RENAME_NOREPLACE)` for a new output (a folder
  that appeared meanwhile is never replaced), `renameat2(RENAME_EXCHANGE)` for `--overwrite` (the old output
  is swapped out in one step, then removed). Where the filesystem lacks renameat2, the check and the renames
  run under an `flock` on the parent folder, which every publisher also holds around its final checks, so
  two runs racing for one folder end with one complete output and a clear line for the loser.
- `--overwrite` replaces only what ckpt wrote: every published folder carries `.ckpt-manifest.json` (each
  file with its size, written last), and a folder is replaced only when its whole content matches it, or
  it is empty. The working directory, the home directory, a filesystem root or mount point, and anything
  that holds a DeepSpeed/Trainer checkpoint are never replaced. Checked before any work and again, under the
  lock, just before the exchange.
- Nothing is left behind: staging folders are named `.<out>.ckpt-staging.<host>.<pid>.<start>.<hex>`, so a
  later run beside the same output removes those whose owner process is gone (a kill, a power cut) and says
  so in a note; it never touches a live run's or another host's (the owner is the host name with its pid
  namespace, the pid and the process's start time, so a reused pid is recognised). Debris of earlier versions
  (`.<out>.partial-<pid>-<hex>`, `.<out>.old-<pid>-<hex>`) records no host, so whether its run is over cannot
  be proven: it is left where it is and named in a note. A failed run removes its staging folder and the parent
  folders it created. Out of space while writing is one line naming the output, the bytes needed
  and free, and "nothing was published".

Signals during cleanup (the contract with the CLI's handlers): cleanup runs inside `shielded()`. While
`cleanup_in_progress` is non-zero, a signal handler that would raise must instead call `defer_signal(signum)`
and return; wrapping the handler with `shield_aware(handler)` does exactly that. When the outermost shielded
block ends, a deferred signal is delivered again (`signal.raise_signal`) unless an exception is already on
its way out (the run is ending anyway). `sigterm_as_interrupt` (SIGTERM raises KeyboardInterrupt) is
shield-aware and leaves a handler someone else installed in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, ClassVar, Protocol, TypeVar

from ckpttools.errors import OutputError

_T = TypeVar("_T")


class ProcessGroup(Protocol):
    """What a shared output folder needs of the ranks writing it (`ckpttools.ranks.distributed.ProcessGroup`)."""

    rank: int
    world_size: int

    def share(self, text: str) -> str: ...  # rank 0's text, on every rank

    def agree(self, error: BaseException | None) -> None: ...  # raises on every rank when one failed

    def run_agreed(self, fn: Callable[[], _T]) -> _T: ...  # fn on every rank; any failure fails all

    def barrier(self) -> None: ...


SPACE_MARGIN = 64_000_000  # left free beyond the output: logs, the page cache's write-back, other processes
MANIFEST = ".ckpt-manifest.json"
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)

# --------------------------------------------------------------------------------------------------
# Signals during cleanup
# --------------------------------------------------------------------------------------------------


class _Shield:
    depth = 0  # > 0 while staging cleanup or a publish runs
    deferred: ClassVar[list[int]] = []


def cleanup_in_progress() -> bool:
    """Whether staging cleanup (or a publish) is running now: a signal handler defers (see the docstring)."""
    return _Shield.depth > 0


def defer_signal(signum: int) -> None:
    """Called by a signal handler during cleanup: the signal is delivered again when cleanup ends."""
    _Shield.deferred.append(signum)


def shield_aware(handler: Callable[[int, FrameType | None], Any]) -> Callable[[int, FrameType | None], Any]:
    """`handler`, deferred while staging cleanup runs."""

    def aware(signum: int, frame: FrameType | None) -> Any:
        if cleanup_in_progress():
            defer_signal(signum)
            return None
        return handler(signum, frame)

    return aware


class shielded:  # used like a function: `with shielded():`
    """Run a block (cleanup, publishing) to its end even when a signal arrives; idempotent blocks only."""

    def __enter__(self) -> None:
        _Shield.depth += 1

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _Shield.depth -= 1
        if _Shield.depth or not _Shield.deferred:
            return
        signum = _Shield.deferred[0]
        _Shield.deferred.clear()
        ending = exc_type is not None or sys.exc_info()[0] is not None  # raised, or cleaning up in an `except`
        if not ending and threading.current_thread() is threading.main_thread():
            signal.raise_signal(signum)  # the run was to stop: it stops now


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every cleanup path runs."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (main thread only), so every cleanup path runs.

    A handler installed by someone else (the CLI's) stays; the one installed here defers during cleanup.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Terminated()

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, shield_aware(handler))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts_deferred_in_cleanup() -> Iterator[None]:
    """Python's own Ctrl-C handler, made shield-aware for the block (a second Ctrl-C cannot cut cleanup short)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = signal.signal(signal.SIGINT, shield_aware(signal.default_int_handler))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------------------------------
# Owned staging names, and stale ones
# --------------------------------------------------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22); "0" where there is no
    /proc; None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else _alive_without_proc(pid)
    except (OSError, ValueError, IndexError):
        return "0"


def _alive_without_proc(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass  # another user's process: alive
    return "0"


@functools.cache
def _host() -> str:
    """This machine as staging names record it: the host name, and the pid namespace where there is one (two
    containers may share a host name and a volume, but a pid means something only within its namespace)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
    try:
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return host
    return f"{host}-pidns{namespace}" if namespace else host


def _owner() -> str:
    pid = os.getpid()
    return f"{_host()}.{pid}.{_process_start(pid) or '0'}"


def staging_name(name: str) -> str:
    """A fresh staging name for output `name`, naming this process as its owner."""
    return f".{name}.ckpt-staging.{_owner()}.{secrets.token_hex(4)}"


def _is_stale(entry: str, prefix: str) -> bool | None:
    """Whether a staging entry's owner is gone: True/False, None for another host's (never judged)."""
    parts = entry[len(prefix) :].rsplit(".", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    host, pid, start, _ = parts
    if host != _host():
        return None
    now = _process_start(int(pid))
    return now is None or (now != start and "0" not in (now, start))


_LEGACY = re.compile(r"\.(partial|old)-\d+(-[0-9a-f]+)?")


def sweep_stale(parent: Path, name: str) -> list[str]:
    """Remove staging entries beside `parent/name` whose owner process on this host is gone; the notes to print.

    Debris of earlier versions (`.<name>.partial-<pid>-<hex>`, `.<name>.old-<pid>-<hex>`) carries no host, so
    whether its run is over cannot be proven: it stays, and a note names it.
    """
    prefix = f".{name}.ckpt-staging."
    removed, legacy = [], []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    for entry in entries:
        if entry.startswith(prefix) and _is_stale(entry, prefix):
            with shielded():
                _remove(parent / entry)
            removed.append(entry)
        elif entry.startswith(f".{name}.") and _LEGACY.fullmatch(entry[len(name) + 1 :]):
            legacy.append(entry)
    notes = []
    if removed:
        notes.append(
            f"removed {len(removed)} staging folder(s) left in {parent} by ckpt runs that are gone: "
            + ", ".join(removed)
        )
    if legacy:
        old_output = any(".old-" in e for e in legacy) and not (parent / name).exists()
        notes.append(
            f"left {', '.join(str(parent / e) for e in legacy)}: debris of an earlier ckpt version, whose run cannot "
            "be told over; remove it once no ckpt run uses it"
            + (" (the .old folder may hold the previous output)" if old_output else "")
        )
    return notes


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# --------------------------------------------------------------------------------------------------
# What may be replaced: the manifest
# --------------------------------------------------------------------------------------------------


def write_manifest(folder: Path, files: dict[str, int] | None = None) -> None:
    """`.ckpt-manifest.json`, last: every file in `folder` (or `files`) with its size.

    No timestamp: two runs on the same input give byte-identical folders (the tests compare one process's
    output with a torchrun's, file for file), and the folder's own mtime says when it was written.
    """
    from ckpttools._version import __version__

    if files is None:
        files = {rel: size for rel, size in _listing(folder) if size is not None and rel != MANIFEST}
    manifest = {
        "tool": "ckpttools",
        "version": __version__,
        "files": dict(sorted(files.items())),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def read_manifest(folder: Path) -> dict[str, int] | None:
    """The files a folder's manifest lists, with their sizes; None without a readable manifest."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = data["files"] if data.get("tool") == "ckpttools" else None
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
        return None
    return files


def _listing(folder: Path) -> Iterator[tuple[str, int | None]]:
    """(relative path, size) of every entry under `folder`, sorted; size None for a folder, -1 for anything that is
    not a plain file or folder (a symlink, a socket). Links are not followed."""
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        rel_top = os.path.relpath(top, folder)
        for name in sorted(dirs + files):
            path = os.path.join(top, name)
            rel = name if rel_top == "." else f"{rel_top}/{name}".replace(os.sep, "/")
            st = os.lstat(path)
            if os.path.islink(path):
                yield rel, -1
            elif name in dirs:
                yield rel, None
            else:
                yield rel, st.st_size if os.path.isfile(path) else -1
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]


_CHECKPOINT_MARKERS = re.compile(
    r"latest|latest_universal|trainer_state\.json|training_args\.bin|zero_to_fp32\.py|global_step\d+|"
    r".*_optim_states\.pt|.*_model_states\.pt|rng_state(_\d+)?\.pth|optimizer\.pt|scheduler\.pt"
)


def _protected(path: Path) -> str | None:
    """Why `path` must never be replaced as a whole, or None."""
    real = path.resolve()
    for what, place in (("the working directory", Path.cwd), ("the home directory", Path.home)):
        with contextlib.suppress(OSError, RuntimeError, KeyError):
            where = place().resolve()
            if real == where:
                return f"is {what}"
            if real in where.parents:
                return f"contains {what} ({where})"
    if real == Path(real.anchor):
        return "is a filesystem root"
    if os.path.ismount(real):
        return "is a mount point"
    return None


def first_foreign(folder: Path) -> str | None:
    """What keeps `folder` from being replaced ("holds X, which ckpt did not write"), or None when it is empty or an
    earlier ckpt output (its whole content matches its manifest). A checkpoint anywhere in it is named first."""
    listed = read_manifest(folder)
    files = listed or {}
    folders = {parent.as_posix() for rel in files for parent in Path(rel).parents if parent.as_posix() != "."}
    first = None
    for rel, size in _listing(folder):
        if (rel == MANIFEST and listed is not None) or (size is None and rel in folders):
            continue
        if size is not None and size >= 0 and files.get(rel) == size:
            continue
        if _CHECKPOINT_MARKERS.fullmatch(rel.rsplit("/", 1)[-1]):
            return f"holds a DeepSpeed/Trainer checkpoint ({rel})"
        if first is None:
            differs = rel in files and size is not None and size >= 0
            first = f"holds {rel}, " + (
                "whose size differs from what ckpt wrote" if differs else "which ckpt did not write"
            )
    return first


def why_not_replaceable(out: Path) -> str | None:
    """Why `out` must not be replaced as a whole (the end of a sentence: "it holds X, which ckpt did not write"),
    or None when it is an earlier ckpt output or empty, in a place that is safe to replace."""
    if os.path.islink(out) or (os.path.lexists(out) and not out.is_dir()):
        return "is not a folder ckpt wrote"
    why = _protected(out)
    if why is None and out.is_dir():
        why = first_foreign(out)
    return why


def check_replaceable(out: Path, *, published: bool = False) -> None:
    """Refuse to replace `out` unless it is an earlier ckpt output (or empty) in a place that is safe to replace."""
    why = why_not_replaceable(out)
    if why is not None:
        outcome = "nothing was deleted or published" if published else "nothing was deleted"
        raise OutputError(
            f"refusing to replace output folder {out}: it {why}; {outcome} (only a folder ckpt wrote is replaced; "
            "choose another output folder)"
        )


def check_output_dir(out: Path, input_root: Path | None, overwrite: bool) -> Path:
    """The output folder to stage beside: refused when it exists (without overwrite; with it, unless ckpt wrote
    it), overlaps the input checkpoint, or is a dangling symlink. A symlink is resolved here, once: the output
    is staged and published beside its target and the link stays."""
    out = Path(out).absolute()
    if out.is_symlink():
        target = out.resolve()
        if not target.exists():
            raise OutputError(
                f"output folder {out} is a symlink to {target}, which does not exist; nothing was written"
            )
        out = target
    resolved = out.resolve()
    if input_root is not None:
        root = input_root.resolve()
        if resolved == root or root in resolved.parents:
            raise OutputError(f"output folder {out} lies inside the checkpoint {root}; choose a folder outside it")
        if resolved in root.parents:
            raise OutputError(
                f"output folder {out} contains the checkpoint {root}; writing there could destroy the input"
            )
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder")
    _check_parent_usable(out)
    if out.exists() and not overwrite:
        raise OutputError(
            f"output folder {out} already exists; pass --overwrite to replace it, or choose another --out"
        )
    if out.exists():
        check_replaceable(out)
    return out


def _check_parent_usable(out: Path) -> None:
    """The nearest existing ancestor of `out` is a folder this process may write into (checked before any work:
    the staging folder is created beside `out`, and its hidden name must never be what the user reads)."""
    ancestor = out.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"cannot create output folder {out}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"cannot create output folder {out}: {ancestor} is not writable by this user")


# --------------------------------------------------------------------------------------------------
# Space
# --------------------------------------------------------------------------------------------------


def check_free_space(
    folder: Path, needed: int, hint: str = "free some space or pass --out on another disk", output: Path | None = None
) -> None:
    """Refuse before writing when `folder`'s disk has less than `needed` plus the margin free (the message says
    both, and names `output` when given)."""
    free = shutil.disk_usage(folder).free
    if free < needed + SPACE_MARGIN:
        where = f"for {output}" if output is not None else f"in {folder}"
        raise OutputError(
            f"not enough free disk space {where}: the output needs {_size(needed)} plus a {_size(SPACE_MARGIN)} "
            f"safety margin, {_size(free)} is free; {hint}"
        )


def _size(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _space_error(error: BaseException) -> OSError | None:
    """The out-of-space error (ENOSPC, EDQUOT) behind `error`, if any."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _OUT_OF_SPACE:
            return e
        e = e.__cause__ or e.__context__
    return None


def _inodes_left(folder: Path) -> bool:
    try:
        return os.statvfs(folder).f_favail > 0
    except (OSError, AttributeError):
        return True


def out_of_space(
    error: BaseException, out: Path, needed: int, cleanup: Callable[[], None] = lambda: None
) -> OutputError | None:
    """One line for an out-of-space error (ENOSPC, EDQUOT) met while writing `out`: the output, the bytes needed and
    free once `cleanup` removed what was written; None for any other error (`cleanup` runs either way)."""
    cause = _space_error(error)
    inodes = _inodes_left(out.parent) if cause is not None else True
    cleanup()
    if cause is None:
        return None
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        free = 0
    need = f"it needs {_size(needed)} plus a {_size(SPACE_MARGIN)} safety margin, " if needed else ""
    what = "no free inodes (files) were left" if not inodes else f"{_size(free)} is free"
    kind = "quota" if cause.errno == errno.EDQUOT else "disk"
    return OutputError(
        f"the {kind} holding {out} ran out of space while the output was written ({need}{what}); nothing was published"
    )


# --------------------------------------------------------------------------------------------------
# Staging
# --------------------------------------------------------------------------------------------------

_published: list[Path] = []


def published_outputs() -> list[Path]:
    """The output folders this process has published, in order (a signal after publishing leaves them)."""
    return list(_published)


def _make_parents(folder: Path, created: list[Path]) -> None:
    """Create `folder` and its missing parents, adding each one created here to `created` (deepest first) as soon
    as it exists, so that an interrupt at any moment leaves the list complete for `_remove_parents`."""
    missing = []
    for p in [folder, *folder.parents]:
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:
            continue  # another run made it: not ours to remove
        except OSError as e:
            raise OutputError(f"cannot create {p}: {e.strerror or e}") from e
        created.insert(0, p)


def _remove_parents(created: list[Path]) -> None:
    for p in created:  # deepest first; only while empty
        with contextlib.suppress(OSError):
            p.rmdir()


class StagedFolder:
    """A fresh staging folder beside `out`, committed into place as a whole or removed.

    For flows that cannot hold a `with` block open (a collective save whose ranks meet in between);
    `staged_folder` is the usual way in.

    Args:
        out: the final folder (checked with `check_output_dir`).
        overwrite: an existing `out` that ckpt wrote is replaced.
        needed_bytes: refuse before writing anything when the disk has less free space than this (plus margin).
        notes: where the note about removed stale staging folders goes (the result's notes).
    """

    def __init__(
        self, out: Path, *, overwrite: bool, needed_bytes: int = 0, notes: list[str] | None = None, start: bool = True
    ) -> None:
        self.out = Path(out).absolute()
        self.overwrite, self.needed, self.notes = overwrite, needed_bytes, notes
        self.path = self.out.parent / staging_name(self.out.name)
        self.created: list[Path] = []
        self.flush: DiskFlush | None = None
        self.published = False
        if start:
            self.start()

    def start(self) -> None:
        """Create the staging folder (and missing parents); on any failure, or an interrupt, nothing is left.
        (`start=False` and then `start()` lets a caller hold the object before anything exists on disk.)"""
        try:
            _make_parents(self.out.parent, self.created)
            found = sweep_stale(self.out.parent, self.out.name)
            if self.notes is not None:
                self.notes += found
            if self.needed:
                check_free_space(self.out.parent, self.needed, output=self.out)
            self.path.mkdir()
            self.flush = DiskFlush(self.path, self.out)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        write_manifest(self.path)
        self.wait_for_disk()
        mark = len(_published)
        try:
            publish(self.path, self.out, self.overwrite)
        finally:
            self.published = self.out in _published[mark:]  # a signal deferred during publishing lands after it

    def wait_for_disk(self) -> None:
        if self.flush is not None:
            self.flush.wait()

    def abort(self) -> None:
        """Remove the staging folder and the parents this run created (idempotent; completes despite signals)."""
        with shielded():
            if self.flush is not None:
                self.flush.close()
            shutil.rmtree(self.path, ignore_errors=True)
            if not self.published:
                _remove_parents(self.created)

    def failed(self, error: BaseException) -> BaseException:
        """Clean up after `error`; the error to raise instead (one line for out of space), or `error`."""
        return out_of_space(error, self.out, self.needed, self.abort) or error


@contextlib.contextmanager
def staged_folder(
    out: Path, *, overwrite: bool, needed_bytes: int = 0, notes: list[str] | None = None
) -> Iterator[Path]:
    """Yield a fresh staging folder beside `out`; on success it becomes `out`, on any failure it is removed.

    Args:
        out: the final folder (already checked with `check_output_dir`).
        overwrite: an existing `out` is replaced (exchanged, then removed) only when set and ckpt wrote it.
        needed_bytes: refuse before writing anything when the disk has less free space than this.
        notes: where notes about stale staging folders go.
    """
    staged: StagedFolder | None = None
    with _interrupts_deferred_in_cleanup(), sigterm_as_interrupt():
        try:
            staged = StagedFolder(out, overwrite=overwrite, needed_bytes=needed_bytes, notes=notes, start=False)
            staged.start()
            yield staged.path
            staged.commit()
        except BaseException as e:
            instead = staged.failed(e) if staged is not None else e
            if instead is not e:
                raise instead from e
            raise


@contextlib.contextmanager
def shared_staged_folder(
    out: Path, *, overwrite: bool, needed_bytes: int = 0, group: ProcessGroup, notes: list[str] | None = None
) -> Iterator[Path]:
    """`staged_folder` for a run on many ranks that all see one filesystem.

    Rank 0 creates the staging folder and every rank writes its own files into it. On leaving the block the ranks
    agree: rank 0 renames the folder into place only when every rank succeeded, and removes it when any failed;
    then every rank raises the same `RankFailedError` (see `ckpttools.ranks.distributed`).
    """
    staged: StagedFolder | None = None
    flushes: list[DiskFlush] = []  # this rank's, opened once the folder is visible here
    out = Path(out).absolute()

    def create() -> str:
        nonlocal staged
        if group.rank == 0:
            staged = StagedFolder(out, overwrite=overwrite, needed_bytes=needed_bytes, notes=notes, start=False)
            staged.start()
            return str(staged.path)
        return ""

    def visible(path: Path) -> None:
        _check_visible(path)
        flushes.append(DiskFlush(path, out))

    with _interrupts_deferred_in_cleanup(), sigterm_as_interrupt():
        try:
            path = Path(group.share(group.run_agreed(create)))
            group.run_agreed(lambda: visible(path))
            try:
                yield path
                flushes[0].wait()  # on shared storage a node's dirty pages can be flushed from that node only
            except BaseException as e:
                space = out_of_space(e, out, needed_bytes)  # named before cleanup: every rank gets the same line
                group.agree(space or e)
                if space is not None:
                    raise space from e
                raise
            group.agree(None)
            group.run_agreed(staged.commit if staged is not None else lambda: None)
            if staged is None and out not in _published:  # rank 0 published it: a late signal here is after too
                _published.append(out)
        except BaseException:
            with shielded():
                for flush in flushes:
                    flush.close()
                if staged is not None:
                    staged.abort()
            _wait_for_cleanup(group)
            raise


def _check_visible(path: Path) -> None:
    if not path.is_dir():
        raise OutputError(
            f"the staging folder {path} that rank 0 created is not visible here; the output folder must be "
            "on a filesystem every rank sees (pass --out on shared storage)"
        )


def _wait_for_cleanup(group: ProcessGroup) -> None:
    """No rank leaves before rank 0 removed the staging folder (a launcher kills the others once one exits)."""
    with contextlib.suppress(Exception):
        group.barrier()


# --------------------------------------------------------------------------------------------------
# Publishing
# --------------------------------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_RENAMEAT2_SYSCALL = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2): True when done, False where the system or filesystem does not offer it; OSError otherwise."""
    libc = _libc()
    if libc is None:
        return False
    args = (ctypes.c_int(_AT_FDCWD), os.fsencode(src), ctypes.c_int(_AT_FDCWD), os.fsencode(dst), ctypes.c_uint(flags))
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        result = fn(*args)
    elif platform.system() == "Linux" and platform.machine().lower() in _RENAMEAT2_SYSCALL:
        result = libc.syscall(ctypes.c_long(_RENAMEAT2_SYSCALL[platform.machine().lower()]), *args)
    else:
        return False
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


@contextlib.contextmanager
def _parent_locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder itself (no lock file left behind), where the filesystem offers one."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # NFS and some others refuse flock on a folder: renameat2 still holds
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished folder `tmp` into place at `out` in one step; an earlier ckpt output there is exchanged
    with it (overwrite) and removed after. A folder that appeared meanwhile is never replaced."""
    with shielded():
        with _parent_locked(out.parent):
            if os.path.lexists(out):
                if not overwrite:
                    raise _appeared(out)
                check_replaceable(out, published=True)  # again: the folder may have changed during the run
                _exchange(tmp, out)
                old: Path | None = tmp  # the previous output, now at the staging path
            else:
                _rename_new(tmp, out)
                old = None
            _published.append(out)
        _fsync_dir(out.parent)  # the rename itself
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _appeared(out: Path) -> OutputError:
    return OutputError(f"output folder {out} appeared while this run was writing (another run?); nothing was published")


def _rename_new(tmp: Path, out: Path) -> None:
    try:
        if _renameat2(tmp, out, _RENAME_NOREPLACE):
            return
        if os.path.lexists(out):  # checked under the folder's lock: a plain rename replaces an empty folder
            raise _appeared(out)
        tmp.rename(out)
    except FileExistsError as e:
        raise _appeared(out) from e
    except OSError as e:
        if isinstance(e, OutputError):
            raise
        if e.errno == errno.ENOTEMPTY:
            raise _appeared(out) from e
        raise OutputError(f"cannot move the finished output into {out} ({e.strerror}); nothing was published") from e


def _exchange(tmp: Path, out: Path) -> None:
    try:
        if _renameat2(tmp, out, _RENAME_EXCHANGE):
            return
        aside = out.parent / staging_name(out.name)  # a kill in between leaves stale staging, not an .old folder
        out.rename(aside)
        try:
            tmp.rename(out)
        except BaseException:
            aside.rename(out)  # put the previous output back
            raise
        aside.rename(tmp)
    except OSError as e:
        raise OutputError(f"cannot move the finished output into {out} ({e.strerror}); nothing was replaced") from e


# --------------------------------------------------------------------------------------------------
# Files into an existing folder (the drop-ins' and save_pretrained's way)
# --------------------------------------------------------------------------------------------------


def check_files_replaceable(out: Path, names: list[str]) -> None:
    """Refuse to write `names` into `out` when one exists there and ckpt did not write it (per the manifest)."""
    listed = read_manifest(out) or {}
    for name in names:
        path = out / name
        if os.path.lexists(path) and (
            path.is_symlink() or not path.is_file() or listed.get(name) != path.stat().st_size
        ):
            raise OutputError(
                f"{out} already holds {name}, which ckpt did not write; refusing to replace it, nothing was "
                "deleted (choose another output folder, or remove it yourself)"
            )


@contextlib.contextmanager
def staged_files(
    out: Path, *, needed_bytes: int = 0, notes: list[str] | None = None, last: tuple[str, ...] = ()
) -> Iterator[Path]:
    """Yield a staging folder inside `out` (an existing folder with other files); on success each file in it is
    moved into `out` (`os.replace`, one at a time, those named in `last` last) and the folder's
    manifest gains them; on failure the staging folder is removed and `out` is as it was."""
    out = Path(out).absolute()
    created: list[Path] = []
    tmp: Path | None = None
    with _interrupts_deferred_in_cleanup(), sigterm_as_interrupt():
        try:
            _make_parents(out, created)
            found = sweep_stale(out, "ckpt-files")
            if notes is not None:
                notes += found
            if needed_bytes:
                check_free_space(out, needed_bytes, output=out)
            tmp = out / staging_name("ckpt-files")
            tmp.mkdir()
            flush = DiskFlush(tmp, out)
            yield tmp
            flush.wait()
            move_files_into(tmp, out, last)
        except BaseException as e:

            def cleanup() -> None:
                with shielded():
                    if tmp is not None:
                        shutil.rmtree(tmp, ignore_errors=True)
                    _remove_parents(created)

            space = out_of_space(e, out, needed_bytes, cleanup)
            if space is not None:
                raise space from e
            raise


def move_files_into(tmp: Path, out: Path, last: tuple[str, ...] = ()) -> None:
    """Move every file of the staging folder `tmp` into the existing folder `out` (those named in `last` last: the
    file a loader looks for goes in once the rest is there); `out`'s manifest gains them; `tmp` is removed."""
    with shielded():
        names = [rel for rel, size in _listing(tmp) if size is not None and size >= 0]
        names = [n for n in names if n not in last] + [n for n in last if n in names]
        listed = read_manifest(out) or {}
        kept = {rel: n for rel, n in listed.items() if (out / rel).is_file() and (out / rel).stat().st_size == n}
        with _parent_locked(out):
            for rel in names:
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                kept[rel] = (tmp / rel).stat().st_size
                os.replace(tmp / rel, out / rel)
            write_manifest(tmp, kept)
            os.replace(tmp / MANIFEST, out / MANIFEST)
            _published.append(out)
        shutil.rmtree(tmp, ignore_errors=True)
    flush_to_disk(out)  # the moves into it


def write_text_atomically(path: Path, text: str) -> None:
    """A small file replaced in one step (`latest_universal`): written beside it under an owned staging name."""
    tmp = path.parent / staging_name(path.name)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with shielded(), contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------------
# Bytes to the disk
# --------------------------------------------------------------------------------------------------


class WriteBehind:
    """Hands written bytes to the disk a window behind the writer (POSIX_FADV_DONTNEED on written ranges).

    Left alone, the kernel starts write-back only once a few GB are dirty and then throttles the writer;
    asked early, the disk writes while the next bytes are still being read (355M ZeRO-2 -> DP 2, 5 GB
    written: median 9.0 s instead of 10.5 s over 5 alternating cold runs), and the flush before publishing
    finds little left to wait for. While a file is written the hints run on a background thread: on a busy
    disk one can block for 100 ms, which the writer should not wait for. `finish` (the file is complete,
    before it is closed) waits for that thread and hands over the tail. Only a hint: errors are ignored, and
    write errors surface at the flush.
    """

    WINDOW = 64 << 20

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.done = fh, 0  # bytes before `done` have been handed over
        self.pending: Future[None] | None = None

    def wrote(self) -> None:
        end = self.fh.tell() - self.WINDOW
        if end - self.done < self.WINDOW or not _CAN_ADVISE or (self.pending and not self.pending.done()):
            return
        start, self.done = self.done, end
        try:
            self.pending = _hint_thread().submit(_advise_written, self.fh.fileno(), start, end - start)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            _advise_written(self.fh.fileno(), start, end - start)

    def settle(self) -> None:
        """Wait for the background hint, if any (before closing a file that failed part-way)."""
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending.result()
            self.pending = None

    def finish(self) -> None:
        """Hand over the rest (15 shards of 200 MB left 1.5 GB for the final flush otherwise: 0.9 s); the file
        must stay open until this returns, since the background hint uses its descriptor."""
        self.settle()
        self.fh.flush()
        end = self.fh.tell()
        if end > self.done and _CAN_ADVISE:
            _advise_written(self.fh.fileno(), self.done, end - self.done)
        self.done = end


_CAN_ADVISE = hasattr(os, "posix_fadvise")


def _advise_written(fd: int, offset: int, nbytes: int) -> None:
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


@functools.cache
def _hint_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="ckpt-write-behind")


def wait_for_hints() -> None:
    """Return once every hint handed to the background thread so far has run (tests, benchmarks)."""
    _hint_thread().submit(lambda: None).result()


if hasattr(os, "register_at_fork"):  # a forked child has the executor but not its thread
    os.register_at_fork(after_in_child=_hint_thread.cache_clear)


class DiskFlush:
    """Waits, at commit, until what this node wrote to a folder's filesystem is on the disk (`syncfs`).

    The folder is opened when staging starts, so that a write-back error the kernel records for that
    filesystem from then on (EIO, ENOSPC; reported by Linux 5.8 and later) is this run's to see, even when
    another process's flush saw it first. `syncfs` flushes the whole filesystem from this node (other
    processes' dirty data too): one call, however many files were written. Without it (not Linux),
    `os.sync()`.
    """

    def __init__(self, folder: Path, output: Path | None = None) -> None:
        self.folder, self.output = folder, output or folder  # the output is what messages name
        self.fd: int | None = os.open(folder, os.O_RDONLY) if _libc_syncfs() is not None else None

    def wait(self) -> None:
        try:
            syncfs = _libc_syncfs()
            if syncfs is None or self.fd is None:
                if hasattr(os, "sync"):
                    os.sync()
                return
            if syncfs(self.fd) != 0:
                err = ctypes.get_errno()
                if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    error = OutputError(
                        f"writing the output {self.output} failed on the disk ({os.strerror(err)}); nothing was "
                        "published"
                    )
                    error.errno = err  # out of space: the caller's one line with sizes
                    raise error
                os.sync()
        finally:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


def flush_to_disk(folder: Path) -> None:
    """`DiskFlush` for a folder written by the caller just now."""
    DiskFlush(folder).wait()


def _libc_syncfs() -> Callable[[int], int] | None:
    libc = _libc()
    return getattr(libc, "syncfs", None) if libc is not None else None


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a hint where the platform cannot open folders)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""One command on many processes: the launcher's group, work balanced by bytes, and failures agreed by all.

Asked for with `--distributed` (or CKPT_DISTRIBUTED=1) under `torchrun` (or any launcher that sets WORLD_SIZE,
RANK, MASTER_ADDR and MASTER_PORT): every rank runs the same command, plans the same output, writes its own
share of the files and meets the others at a few agreement points: if any rank failed, every rank raises the
same `RankFailedError`, naming the first rank that failed and its message. Without it the launcher's variables
are ignored: a `ckpt` that a training rank starts inherits them, and no variable proves the launch was for
`ckpt`. The ranks meet under their own `ckpt/` keys of the store (never a training job's), within
CKPT_RENDEZVOUS_TIMEOUT, polling so a signal stops the wait. The group is gloo, so no GPU is needed. Only
`join_group` imports torch.distributed: a one-process run never loads it. Messages travel as UTF-8 bytes in
tensors, never as pickles.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ckpttools import signals
from ckpttools.errors import CkptError, UsageError

if TYPE_CHECKING:
    from ckpttools.io.torchfile import Record, RecordReader

DEFAULT_TIMEOUT_S = 3600  # a rank waits this long at an agreement point for the slowest one
DEFAULT_RENDEZVOUS_S = 300  # a rank waits this long for the others to join (CKPT_RENDEZVOUS_TIMEOUT)
POLL_S = 0.1  # the rendezvous checks this often (and a signal stops it within this)
STORE_PREFIX = "ckpt"  # every key ckpt sets in the launcher's store lies under it
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
EXIT_INTERRUPTED = 130
MOVE_WINDOW = 4  # transfers in flight per rank in ProcessGroup.move (each a buffer of its size)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process: its rank, the number of ranks and where rank 0 listens."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def ignored_launcher_note(env: Mapping[str, str] | None = None) -> str | None:
    """The note for a one-process run that found a launcher's variables (a `ckpt` started by a training rank
    inherits them), or None when there are none."""
    env = os.environ if env is None else env
    found = [name for name in LAUNCHER_VARS if env.get(name)]
    found += sorted(name for name in env if name.startswith("TORCHELASTIC_"))
    if not found:
        return None
    shown = f"WORLD_SIZE={env['WORLD_SIZE']}" if env.get("WORLD_SIZE") else ", ".join(found[:3])
    return f"launcher variables found ({shown}); running as one process, pass --distributed to share the work"


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher's settings, or None for a one-process run (WORLD_SIZE unset or 1).

    Raises:
        UsageError: WORLD_SIZE > 1 with RANK, MASTER_ADDR or MASTER_PORT missing or malformed.
    """
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE", default=1)
    if world <= 1:
        return None
    rank = _env_int(env, "RANK")
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}); check the launcher's settings")
    addr = env.get("MASTER_ADDR")
    if not addr:
        raise UsageError(f"WORLD_SIZE={world} but MASTER_ADDR is not set; launch with torchrun or set it")
    return Launch(rank, world, addr, _env_int(env, "MASTER_PORT"))


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise UsageError(f"WORLD_SIZE > 1 but {name} is not set; launch with torchrun or set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None


def plan_by_bytes(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that handles each item, so that every rank gets about the same number of bytes.

    Largest first, each to the least loaded rank (lowest rank on ties): the classic LPT schedule, within 4/3
    of the best split. Deterministic, so every rank computes the same plan on its own.

    Example:
        >>> plan_by_bytes([10, 3, 7, 4], 2)  # 10 -> 0, 7 -> 1, 4 -> 1, 3 -> 0
        [0, 0, 1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    loads = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += sizes[i]
    return owner


def records_to_verify(records: Iterable[Record], rank: int, world_size: int) -> list[Record]:
    """This rank's share of the CRC-32 checks of `records` (duplicates dropped): each record is checked by one
    rank, whole, balanced by bytes, so a flat partition every rank reads a piece of is not read by all."""
    unique = list({(r.path, r.name): r for r in records}.values())
    owners = plan_by_bytes([r.nbytes for r in unique], world_size)
    return [r for r, owner in zip(unique, owners, strict=True) if owner == rank]


def check_records(group: ProcessGroup, reader: RecordReader, records: Sequence[Record]) -> None:
    """Collective, after every rank read what it needed with a `RecordReader(pieces=True)`: each record's CRC-32 is
    checked by one rank (`records_to_verify`), from the pieces every rank read of it, so each byte is read once in
    all. Raises CorruptCheckpointError on this rank for a damaged record of its share (the caller agrees on it)."""
    unique = list({(r.path, r.name): r for r in records}.values())
    index = {(r.path, r.name): i for i, r in enumerate(unique)}
    mine = [[index[key], start, n, crc] for key, start, n, crc in reader.pieces or [] if key in index]
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in unique]
    for report in group.gather_bytes(json.dumps(mine).encode()):
        for i, start, n, crc in json.loads(report):
            pieces[i].append((start, n, crc))
    for record in records_to_verify(unique, group.rank, group.world_size):
        reader.verify_pieces(record, pieces[index[(record.path, record.name)]])


class RankFailedError(CkptError):
    """A rank failed, so every rank fails: raised on all of them with the first failing rank's message.

    `rank` is None when every rank failed alike (a refusal all of them met, such as an existing output folder):
    the message is then the plain one a one-process run prints.
    """

    def __init__(self, rank: int | None, world_size: int, message: str, exit_code: int = 1) -> None:
        super().__init__(message if rank is None else f"rank {rank} of {world_size} failed: {message}")
        self.rank, self.failed_message, self.exit_code = rank, message, exit_code


class RankLostError(CkptError):
    """This rank lost the others in a collective: a peer ended or was killed, or did not answer in time."""

    def __init__(self, rank: int, world_size: int, error: BaseException) -> None:
        reason = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error).split())).split(". ")[0][:200]
        self.reason = reason
        super().__init__(f"rank {rank} of {world_size} lost contact with the other ranks ({reason}); one of them ended "
                         "or was killed, or did not answer within CKPT_DIST_TIMEOUT")  # fmt: skip


def describe_failure(error: BaseException) -> tuple[int, str]:
    """The exit code and one line a rank reports for its own failure (what the CLI would have printed)."""
    if isinstance(error, CkptError):
        return error.exit_code, " ".join(str(error).split())
    if isinstance(error, KeyboardInterrupt):
        signum = getattr(error, "signum", None)
        if signum is None:
            return EXIT_INTERRUPTED, "interrupted"
        from ckpttools.signals import exit_code, signal_name

        return exit_code(signum), f"interrupted ({signal_name(signum)})"
    if isinstance(error, OSError):
        return 1, f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}"
    text = " ".join(str(error).split())
    return 1, f"internal error ({type(error).__name__}{f': {text}' if text else ''})"


class ProcessGroup:
    """The launcher's ranks in a gloo group: agreement on failures, rank 0's text to all, barrier, teardown."""

    def __init__(self, launch: Launch, dist: Any) -> None:
        self.rank, self.world_size = launch.rank, launch.world_size
        self._dist = dist

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, on every rank (lengths first, then the padded payloads)."""
        import torch

        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros_like(length) for _ in range(self.world_size)]
        with self._peers():
            self._dist.all_gather(lengths, length)
        payload = _byte_tensor(data, max(int(n.item()) for n in lengths))
        payloads = [torch.zeros_like(payload) for _ in range(self.world_size)]
        with self._peers():
            self._dist.all_gather(payloads, payload)
        return [p[: int(n.item())].numpy().tobytes() for p, n in zip(payloads, lengths, strict=True)]

    def share(self, text: str) -> str:
        """Rank 0's text, on every rank (what the others pass is ignored): one broadcast, not a gather."""
        import torch

        data = text.encode() if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        with self._peers():
            self._dist.broadcast(length, 0)
        payload = _byte_tensor(data, int(length.item()))
        with self._peers():
            self._dist.broadcast(payload, 0)
        return str(payload[: int(length.item())].numpy().tobytes().decode())

    def agree(self, error: BaseException | None) -> None:
        """Meet every rank; if any failed, raise RankFailedError for the first one that did, on every rank."""
        code, message = describe_failure(error) if error is not None else (0, "")
        reports = self.gather_bytes(f"{code}\n{message}".encode() if error is not None else b"")
        failed = [(rank, report.decode(errors="replace")) for rank, report in enumerate(reports) if report]
        if not failed:
            return
        rank, report = failed[0]
        code_text, _, text = report.partition("\n")
        alike = len(failed) == self.world_size and all(r == report for _, r in failed)
        raise RankFailedError(None if alike else rank, self.world_size, text, int(code_text)) from error

    def run_agreed(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on this rank, then agree: its result if every rank succeeded, else RankFailedError."""
        try:
            result = fn()
        except BaseException as e:  # reported to every rank, then raised there as RankFailedError
            self.agree(e)
            raise  # unreachable: agree raises for a failed rank
        self.agree(None)
        return result

    def move(self, plan: Sequence[tuple[int, int, int]], read: Callable[[int, memoryview], None],
             write: Callable[[int, memoryview], None], window: int = MOVE_WINDOW) -> None:  # fmt: skip
        """Collective: move chunk i of `plan` ((source rank, destination rank, bytes) each) point to point.

        The source fills a buffer with `read(i, buf)`, the destination gets it in `write(i, buf)`. Every rank walks
        the same plan in order with at most `window` transfers in flight, so the first unfinished transfer is
        always posted at both ends and the walk cannot deadlock. A failing `read` or `write` does not stop the
        walk (the peer would wait forever): the rest is sent as zeros or dropped, and the first error is raised
        at the end, for `agree` to fail every rank.
        """
        import torch

        inflight: collections.deque[tuple[Any, int, Any, bool]] = collections.deque()
        errors: list[BaseException] = []

        def settle() -> None:
            work, i, tensor, is_recv = inflight.popleft()
            with self._peers():
                work.wait()
            if is_recv and not errors:
                try:
                    write(i, tensor.numpy().data)
                except Exception as e:  # noqa: BLE001 - raised after the walk
                    errors.append(e)

        for i, (src, dst, nbytes) in enumerate(plan):
            if self.rank not in (src, dst) or src == dst:
                continue
            tensor = torch.zeros(nbytes, dtype=torch.uint8)
            if self.rank == src:
                if not errors:
                    try:
                        read(i, tensor.numpy().data)
                    except Exception as e:  # noqa: BLE001 - raised after the walk
                        errors.append(e)
                with self._peers():
                    inflight.append((self._dist.isend(tensor, dst), i, tensor, False))
            else:
                with self._peers():
                    inflight.append((self._dist.irecv(tensor, src), i, tensor, True))
            if len(inflight) >= window:
                settle()
        while inflight:
            settle()
        if errors:
            raise errors[0]

    def barrier(self) -> None:
        with self._peers():
            self._dist.barrier()

    @contextlib.contextmanager
    def _peers(self) -> Iterator[None]:
        """Around each collective. A failure of the group itself (a peer ended or was killed: gloo's "Connection
        closed by peer"; a timeout) is RankLostError: one line that says so, not an internal error.

        A rank that a signal reached enters no collective any more: the others may be waiting in a different one
        (a signal lands between any two), and a mismatched pair waits for CKPT_DIST_TIMEOUT. It cleans up on its
        own and exits; its peers' wait then ends with "Connection closed by peer"."""
        signum = signals.received()
        if signum is not None:
            raise signals.Interrupted(signum)
        try:
            yield
        except RuntimeError as e:  # torch.distributed's DistError and gloo's errors are RuntimeErrors
            raise RankLostError(self.rank, self.world_size, e) from e

    def close(self) -> RankLostError | None:
        """Wait for every rank (so nobody exits while rank 0 still cleans up or prints), then leave the group.
        Returns the failure of that last wait (a peer gone by then), or None.

        A rank a signal stopped waits for no one: the others may be inside another collective, and its exit is
        what ends their wait ("Connection closed by peer")."""
        if signals.received() is not None:
            return None
        lost = None
        try:
            self.barrier()
        except RankLostError as e:  # a peer already gone: leaving is all that is left to do
            lost = e
        except Exception:  # noqa: BLE001 - the group is left either way; nothing of this run depends on it
            lost = None
        if not signals.installed():  # the `ckpt` process ends through os._exit next: no teardown to wait for
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group()
        return lost


def _byte_tensor(data: bytes, size: int) -> Any:
    """`data` at the front of a zeroed uint8 tensor of `size` bytes (never empty, so every rank sends a tensor)."""
    import torch

    tensor = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


def join_group(launch: Launch, timeout_s: float | None = None, rendezvous_s: float | None = None) -> ProcessGroup:
    """Join the launcher's ranks in a gloo group, through the store at MASTER_ADDR:MASTER_PORT.

    Under torchrun the store is its agent's; otherwise rank 0 opens it. Every rank sets its own key under
    `ckpt/` and waits, in short polls, until every rank's key is there: a rank that never comes ends the wait
    after `rendezvous_s` with one line naming it, and a signal ends it at once.

    Args:
        launch: from `launch_from_env`.
        timeout_s: how long a collective waits for the other ranks; default CKPT_DIST_TIMEOUT or an hour.
        rendezvous_s: how long to wait for every rank to join; default CKPT_RENDEZVOUS_TIMEOUT or 300 s.
    """
    import torch.distributed as dist

    if timeout_s is None:
        timeout_s = _env_seconds("CKPT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)
    if rendezvous_s is None:
        rendezvous_s = _env_seconds("CKPT_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_S)
    store = _rendezvous(launch, rendezvous_s)
    try:
        with _gloo_connect_noise_held_back():
            _interruptible(
                lambda: dist.init_process_group(
                    "gloo",
                    store=dist.PrefixStore("group", store),
                    rank=launch.rank,
                    world_size=launch.world_size,
                    timeout=timedelta(seconds=timeout_s),
                )
            )
    except Exception as e:  # every rank joined, yet the group failed: one line, not a traceback
        raise CkptError(
            f"rank {launch.rank} cannot join the group at {_where(launch)} ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ) from e
    return ProcessGroup(launch, dist)


# What gloo's C++ transport writes to fd 2 while it connects the group: one line per failed attempt to reach a rank
# that died, and the failure itself; the one line `join_group` raises names the cause already.
_GLOO_CONNECT_NOISE = re.compile(
    r"gloo/transport/tcp/\S+:\d+\] ERROR failed to connect|ProcessGroupGloo\.cpp:\d+\] Gloo connectFullMesh failed"
)


@contextlib.contextmanager
def _gloo_connect_noise_held_back() -> Iterator[None]:
    """Hold what native code writes to fd 2 while the group connects, then pass on every line but gloo's connect
    retries. Python's own stderr keeps writing to the real stream meanwhile (a signal's one line goes out once)."""
    python_stderr = sys.stderr
    python_stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        sys.stderr = open(saved, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            replacement = sys.stderr
            replacement.flush()
            os.dup2(saved, 2)
            sys.stderr = python_stderr
            replacement.close()  # the wrapper only: closefd=False leaves `saved` to the next line
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not _GLOO_CONNECT_NOISE.search(line)]  # fmt: skip
            python_stderr.write("".join(kept))
            python_stderr.flush()


def _interruptible(call: Callable[[], object]) -> None:
    """`call()` on a helper thread while this one waits in short joins, so a signal is handled at once.

    For a wait inside C++ that nothing else ends: gloo's connection to a rank that set its rendezvous key
    and then died before connecting waits the whole CKPT_DIST_TIMEOUT, and Python runs signal handlers only
    between bytecodes. On a signal the helper is left behind (a daemon; the process ends through os._exit)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            errors.append(e)

    helper = threading.Thread(target=run, name="ckpt-join", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(POLL_S)
    if errors:
        raise errors[0]


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return float(default)
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise UsageError(f"{name}={value!r} must be more than 0 seconds")
    return seconds


def _where(launch: Launch) -> str:
    return f"{launch.master_addr}:{launch.master_port}"


def _seconds(s: float) -> str:
    return f"{s:g} s"


def _agent_store() -> bool:
    """torchrun's workers share their agent's store (it listens at MASTER_ADDR:MASTER_PORT) instead of rank 0's."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _rendezvous(launch: Launch, limit_s: float) -> Any:
    """The launcher's store, once every rank has joined, as a store whose keys lie under `ckpt/`."""
    import torch.distributed as dist

    deadline = time.monotonic() + limit_s
    store = _open_store(launch, limit_s, deadline)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"  # a restarted launch meets under fresh keys
    ours = dist.PrefixStore(f"{STORE_PREFIX}/{attempt}", store)
    ours.set(f"joined/{launch.rank}", str(os.getpid()))
    everyone = [f"joined/{r}" for r in range(launch.world_size)]
    while not ours.check(everyone):
        if time.monotonic() >= deadline:
            missing = [r for r in range(launch.world_size) if not ours.check([f"joined/{r}"])]
            raise RendezvousError(
                f"rank {launch.rank} waited {_seconds(limit_s)} for {len(missing)} of {launch.world_size} ranks to "
                f"join at {_where(launch)} (missing: {', '.join(f'rank {r}' for r in missing)}); start every rank "
                "with --distributed"
            )
        time.sleep(POLL_S)  # a signal interrupts the sleep and its handler raises
    return ours


def _open_store(launch: Launch, limit_s: float, deadline: float) -> Any:
    """Rank 0 opens the store (unless torchrun's agent holds it); the others connect once it listens.

    Whether it listens is probed with a plain socket first: a TCPStore client retries inside C++ (a signal
    waits for it, and each failed try logs a warning), a Python connect returns at once.
    """
    import torch.distributed as dist

    if launch.rank == 0 and not _agent_store():
        try:
            return dist.TCPStore(launch.master_addr, launch.master_port, None, True, timedelta(seconds=limit_s),
                                 wait_for_workers=False)  # fmt: skip
        except Exception as e:  # the port is taken (a training job's store?) or the address is not this host's
            raise RendezvousError(
                f"rank 0 cannot open the rendezvous at {_where(launch)} ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:160]}); choose a free MASTER_PORT"
            ) from e
    reason = "nothing listens there"
    while True:
        try:
            with socket.create_connection((launch.master_addr, launch.master_port), timeout=1):
                break
        except OSError as e:
            reason = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {launch.rank} waited {_seconds(limit_s)} for rank 0's rendezvous at {_where(launch)} "
                f"({reason}); start every rank with --distributed"
            )
        time.sleep(POLL_S)
    try:
        return dist.TCPStore(launch.master_addr, launch.master_port, None, False,
                             timedelta(seconds=max(1.0, deadline - time.monotonic())))  # fmt: skip
    except Exception as e:
        raise RendezvousError(
            f"rank {launch.rank} cannot reach the rendezvous at {_where(launch)} ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:160]}); start every rank with --distributed"
        ) from e


class RendezvousError(CkptError):
    """The ranks did not all join within CKPT_RENDEZVOUS_TIMEOUT, or the store could not be reached."""

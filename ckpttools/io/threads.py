"""Threads for the CPU-bound steps of a conversion (16-bit casts, cross-checks): how many, and how work splits.

numpy's ufuncs release the GIL, so a cast split over threads runs on as many cores. The default is the cores
this process may use, shared among the processes a launcher started on this node (LOCAL_WORLD_SIZE; the
`ckpt` command reads it only with --distributed, see `share_cores_with_local_ranks`), and at most
`MAX_DEFAULT`: beyond that the disk, not the CPU, is the limit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ckpttools.errors import UsageError

if TYPE_CHECKING:
    from typing_extensions import Self

MAX_DEFAULT = 8
MAX_WORKERS = 1024
_chosen: dict[str, int] = {}  # set_workers: the process-wide choice, as torch.set_num_threads
_local_ranks: dict[str, bool] = {}  # share_cores_with_local_ranks: whether LOCAL_WORLD_SIZE counts


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@contextmanager
def share_cores_with_local_ranks(enabled: bool) -> Iterator[None]:
    """Inside, whether the default shares the cores among LOCAL_WORLD_SIZE processes: the `ckpt` command says
    True only with --distributed (a `ckpt` started by a training rank inherits the variable but runs alone).
    Outside, the variable counts (a program using the library under its own launcher)."""
    previous = _local_ranks.get("enabled")
    _local_ranks["enabled"] = enabled
    try:
        yield
    finally:
        if previous is None:
            _local_ranks.pop("enabled", None)
        else:
            _local_ranks["enabled"] = previous


def set_workers(n: int | None) -> None:
    """Threads every later conversion in this process uses (None: back to the default)."""
    _chosen.pop("workers", None)
    if n is not None:
        _chosen["workers"] = resolve_workers(n)


@contextmanager
def whole_node() -> Iterator[None]:
    """Inside, the default is all of this node's cores (up to MAX_DEFAULT): for a rank that works while the other
    ranks on its node wait. A choice made with `set_workers` stays."""
    if "workers" in _chosen:
        yield
        return
    _chosen["workers"] = min(MAX_DEFAULT, usable_cores())
    try:
        yield
    finally:
        _chosen.pop("workers", None)


def default_workers(env: Mapping[str, str] | None = None) -> int:
    """Threads per process when the call does not say: `set_workers`' choice, else this process's share of the
    node's cores."""
    if "workers" in _chosen:
        return _chosen["workers"]
    env = os.environ if env is None else env
    if not _local_ranks.get("enabled", True):
        env = {}
    try:
        local = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local = 1
    return max(1, min(MAX_DEFAULT, usable_cores() // local))


def resolve_workers(workers: int | None) -> int:
    """`workers` as given (checked), or the default for None."""
    if workers is None:
        return default_workers()
    if not 1 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers {workers}: give 1 to {MAX_WORKERS}")
    return workers


class Workers:
    """`n` threads: the caller's own and `n - 1` pool threads, used by `run` to do parts of one job at once."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self._pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="ckpt-worker") if self.n > 1 else None

    def run(self, parts: Sequence[Callable[[], None]]) -> None:
        """Run every part, the first on the calling thread; returns when all are done, raising the first error."""
        if self._pool is None or len(parts) < 2:
            for part in parts:
                part()
            return
        futures = [self._pool.submit(part) for part in parts[1:]]
        try:
            parts[0]()
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

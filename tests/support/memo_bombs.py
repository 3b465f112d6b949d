"""Memo bombs (pickles whose memo index makes CPython's unpickler allocate by its value) and a cap on this process's
address space for the span of a test: an allocation sized by damaged input then fails with MemoryError (and the test
with it) instead of getting the test run OOM-killed."""

from __future__ import annotations

import contextlib
import pickletools
import resource
from collections.abc import Iterator

BOMB = b"}r" + (2**31).to_bytes(4, "little") + b"."  # an empty dict put at memo index 2**31: 32 GiB of memo table
FUZZ_INDEX = 1393191011  # the damaged LONG_BINPUT that got a fuzz run OOM-killed


def plant_long_binput(data: bytes, index: int, start: int = 0) -> bytes:
    """`data` with the index of the first LONG_BINPUT of the pickle at `start` replaced by `index` (same length)."""
    at = next(pos for op, _, pos in pickletools.genops(data[start:]) if op.name == "LONG_BINPUT" and pos is not None)
    at += start
    return data[: at + 1] + index.to_bytes(4, "little") + data[at + 5 :]


def _address_space() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def capped_memory(headroom: int = 512 << 20) -> Iterator[None]:
    """Allow `headroom` bytes of address space beyond what the process has mapped now (only lowers the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + headroom
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, soft)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

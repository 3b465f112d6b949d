"""The framing of torch's legacy (non-zip) `torch.save` files: what surrounds the data pickle.

`torch.save(obj, f, _use_new_zipfile_serialization=False)` (DeepSpeed's `"checkpoint": {"checkpoint_serialization":
false}`) writes, one after another: a pickle of torch's magic number, a pickle of the protocol version (1001), a
pickle of `sys_info` (byte order, C type sizes), the data pickle (its storages as persistent ids
`('storage', storage_type, key, location, numel, view_metadata)`), a pickle of the sorted list of storage keys, then
for each key in that order an 8-byte little-endian element count and the storage's raw bytes. Nothing else: there is
no checksum, so the checks that stand in for a zip's CRC-32 are structural (`storage_spans`).

The small pickles here hold only numbers, strings, lists and dicts, and are read by an unpickler that accepts no
global and no persistent id. The data pickle is torchfile's business (its allowlist). Every pickle is first walked op
by op (`read_pickle`, `pickles.walk`) to find where it ends, so that unpickling works on its bytes alone, and to
refuse what would make the unpickler allocate by a damaged value: with no CRC, a flipped bit reaches the unpickler,
and a memo index of 2**31 makes CPython's grow its memo table to 32 GiB.
"""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path
from typing import Any

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io import pickles
from ckpttools.io.source import ByteSource, read_full

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
PROTOCOL_VERSION = 1001  # torch.serialization.PROTOCOL_VERSION (torch >= 0.4)
# The magic-number pickle as torch.save writes it with each pickle protocol it may be given (default 2).
_MAGIC_PICKLES = tuple(pickle.dumps(MAGIC_NUMBER, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1))
_COUNT = struct.Struct("<q")  # a storage's element count, before its bytes
MAX_KEYS = 1 << 24  # far beyond any checkpoint file; a damaged key list must not make the walk run for hours


def is_legacy(head: bytes) -> bool:
    """Whether a file starting with `head` (at least 32 bytes of it, when the file has them) is a legacy file."""
    return head.startswith(_MAGIC_PICKLES)


class _PlainUnpickler(pickle.Unpickler):
    """Numbers, strings, lists and dicts only: the framing pickles hold nothing else."""

    path: Path

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to unpickle '{module}.{name}' in the framing of a legacy torch file, which holds "
            "only numbers and strings; ckpttools never runs code from checkpoint files"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: unexpected persistent id {short(pid, 80)} in a legacy torch file")


_WINDOW = 4 << 10  # read at first while walking a pickle, doubled as it goes on (the framing pickles are tiny)
_MAX_STEP = 1 << 20  # read at most at a time, but for an opcode longer than that (the walk skips long arguments)
_MAX_WINDOW = 1 << 26  # a text argument (protocol 0) longer than this is damage, not something torch.save writes


def read_pickle(path: Path, fh: Any, size: int, what: str) -> bytes:
    """The bytes of the pickle at `fh`'s position (of a file of `size` bytes), `fh` left just after it.

    Walked op by op first (`pickles.walk`), which also refuses a memo index that would make the unpickler allocate a
    table by its value."""
    start = fh.tell()
    try:
        end = _pickle_end(fh, start, size)
    except pickles.Damaged as e:
        raise CorruptCheckpointError(
            f"{path}: cannot read the {what} of this legacy torch file ({e}); the file is truncated or damaged"
        ) from e
    fh.seek(start)
    return bytes(fh.read(end - start))


def _pickle_end(fh: Any, start: int, size: int) -> int:
    """Where the pickle at `start` ends, walked a window at a time: little is read past it (the windows double
    from 4 KiB to 1 MiB), and a damaged length asks for nothing (the walk skips arguments without reading them)."""
    at, puts, window = start, 0, _WINDOW
    while True:
        fh.seek(at)
        chunk = bytes(fh.read(max(0, min(window, size - at))))
        try:
            return at + pickles.walk(chunk, 0, puts)
        except pickles.Truncated as cut:
            if at + len(chunk) >= size:
                raise pickles.Damaged("it runs past the end of the file") from cut
            if cut.at == 0 and window >= _MAX_WINDOW:
                raise pickles.Damaged(f"an opcode longer than {_MAX_WINDOW >> 20} MiB") from cut
            window = window * 2 if cut.at == 0 else min(window * 2, _MAX_STEP)  # cut.at 0: one opcode is longer
            at, puts = at + cut.at, cut.puts


def _load_plain(path: Path, fh: Any, size: int, what: str) -> Any:
    """One framing pickle from `fh`'s position; `fh` is left just after it."""
    unpickler = _PlainUnpickler(io.BytesIO(read_pickle(path, fh, size, what)), encoding="utf-8")
    unpickler.path = path
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # UnpicklingError, ... on a damaged file
        raise CorruptCheckpointError(
            f"{path}: cannot read the {what} of this legacy torch file ({type(e).__name__}: {short(e, 100)}); "
            "the file is truncated or damaged"
        ) from e


def read_preamble(path: Path, fh: Any, size: int) -> None:
    """Check the magic number, protocol version and byte order, leaving `fh` at the data pickle."""
    fh.seek(0)
    if _load_plain(path, fh, size, "magic number") != MAGIC_NUMBER:
        raise CorruptCheckpointError(f"{path} is not a torch checkpoint (wrong magic number): truncated or damaged")
    version = _load_plain(path, fh, size, "protocol version")
    if version != PROTOCOL_VERSION:
        raise UnsupportedCheckpointError(
            f"{path} is a legacy torch file of protocol version {short(version)}; ckpttools reads version "
            f"{PROTOCOL_VERSION} (torch 0.4 and later): load and re-save it once with torch"
        )
    sys_info = _load_plain(path, fh, size, "system information")
    if not isinstance(sys_info, dict):
        raise CorruptCheckpointError(f"{path}: the system information of this legacy torch file is damaged")
    if sys_info.get("little_endian") is not True:
        raise UnsupportedCheckpointError(f"{path} was written on a big-endian machine")


def read_keys(path: Path, fh: Any, size: int) -> list[str]:
    """The storage keys, in the order their bytes follow (from `fh`'s position, just after the data pickle)."""
    keys = _load_plain(path, fh, size, "storage key list")
    if (
        not isinstance(keys, list)
        or len(keys) > MAX_KEYS
        or not all(isinstance(k, str) for k in keys)
        or len(set(keys)) != len(keys)
    ):
        raise CorruptCheckpointError(f"{path}: the storage key list of this legacy torch file is damaged")
    return keys


def storage_spans(
    path: Path, source: ByteSource, start: int, keys: list[str], itemsizes: dict[str, int]
) -> dict[str, tuple[int, int]]:
    """(offset, byte count) of each key's bytes, found by reading only the 8-byte counts from `start` on.

    These checks stand in for the CRC-32 a zip stores (legacy files have none): every storage's bytes lie within
    the file, and they end exactly where the file ends. `itemsizes` gives each key's element size, from the data
    pickle (the count is in elements); a key no tensor uses is refused.
    """
    size = source.size()
    spans: dict[str, tuple[int, int]] = {}
    pos, header = start, bytearray(_COUNT.size)
    for key in keys:
        if key not in itemsizes:
            raise CorruptCheckpointError(
                f"{path}: storage {key} belongs to no tensor (torch.save writes none such); the file was altered"
            )
        if read_full(source, pos, memoryview(header)) < len(header):
            raise CorruptCheckpointError(f"{path} is truncated: storage {key} runs past the end of the file")
        (count,) = _COUNT.unpack(header)
        nbytes = count * itemsizes[key]
        if count < 0 or pos + len(header) + nbytes > size:
            raise CorruptCheckpointError(
                f"{path} is truncated or damaged: storage {key} counts {count} elements, which run past the end of "
                "the file"
            )
        spans[key] = (pos + len(header), nbytes)
        pos += len(header) + nbytes
    if pos != size:
        raise CorruptCheckpointError(
            f"{path} holds {size - pos} bytes after its last storage, which torch.save never writes; the file was "
            "altered or appended to"
        )
    return spans

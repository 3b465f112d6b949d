"""`integrity.json`: the SHA-256 of every file of a save, checked before any tensor is read from it.

Megatron-LM's `--verify-integrity` (megatron-core's `dist_checkpointing.save(..., verify_integrity=True)`) hashes
every file of the iteration folder once the save is complete and writes, in that folder,

    {"algorithm": "sha256", "files": {"<file name>": "<64 hex digits>", ...}}

(the manifest itself left out, no sub-folders, no sizes). Megatron's own load with `verify_integrity=True` re-hashes
every listed file on rank 0 before it reads a tensor. `ckpt consolidate` and `ckpt verify --against` do the same:
a listed file missing or with another digest means the checkpoint was damaged or changed since the save, and the
command fails before anything is written.

Why a pass of its own rather than hashing as consolidate streams: a digest covers the whole file, and a `.distcp`
file also holds the optimizer state consolidate never reads, so every byte must be read anyway; and the verdict
must come before the output is planned. The files are hashed on `default_workers()` threads at once (hashlib
releases the GIL), 8 MiB reads through the byte source interface, so a remote (mounted) checkpoint is hashed by
ranged reads like any other. `inspect` only counts the listing (`read_manifest`); it never hashes.

CKPT_SKIP_INTEGRITY=1 skips the check (a note says so), for a user who knows the copy is good and cannot afford to
read every byte (an object store billed per byte, optimizer state many times the weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpttools.errors import CorruptCheckpointError, short
from ckpttools.io.source import location_name, open_source, read_full
from ckpttools.io.threads import default_workers

MANIFEST = "integrity.json"
ALGORITHM = "sha256"  # the one Megatron writes and accepts
MAX_MANIFEST_BYTES = 16 << 20  # a name and 64 hex digits per file: 100,000 rank files are ~10 MB
READ_BYTES = 8 << 20
SKIP_VAR = "CKPT_SKIP_INTEGRITY"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """`folder`'s integrity.json for a layout's details: None when there is none, else `{"algorithm", "files":
    {name: digest}}`, or `{"problem": why}` when it cannot be used (reported by `check`, so `inspect` still works)."""
    try:
        source = open_source(folder / MANIFEST)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"problem": f"cannot be read ({e.strerror or type(e).__name__})"}
    try:
        size = source.size()
        if size > MAX_MANIFEST_BYTES:
            return {"problem": f"is {size} bytes, more than any Megatron manifest ({MAX_MANIFEST_BYTES})"}
        buffer = bytearray(size)
        read_full(source, 0, memoryview(buffer))
    except OSError as e:
        return {"problem": f"cannot be read ({e.strerror or type(e).__name__})"}
    finally:
        source.close()
    return _parse(bytes(buffer))


def _parse(data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        return {"problem": "is not JSON"}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {"problem": 'has no "files" object (Megatron writes {"algorithm": "sha256", "files": {...}})'}
    algorithm = manifest.get("algorithm", ALGORITHM)  # Megatron's load takes a missing one for sha256 too
    if algorithm != ALGORITHM:
        return {"problem": f"names the algorithm {short(algorithm, 40)!s}; Megatron writes and checks only sha256"}
    files = manifest["files"]
    for name, digest in files.items():
        if not _plain_name(name):
            return {"problem": f"lists {short(name, 60)!s}, not a file name of the folder"}
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            return {"problem": f"gives {name} the digest {short(digest, 70)!s}, not 64 lowercase hex digits"}
    return {"algorithm": algorithm, "files": dict(files)}


def _plain_name(name: str) -> bool:
    """A file directly in the folder, as Megatron lists them: never a path reaching elsewhere."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def count(manifest: dict[str, Any] | None) -> str | None:
    """What `inspect` says of a manifest (it never hashes)."""
    if manifest is None:
        return None
    if "problem" in manifest:
        return f"{MANIFEST}: unusable, it {manifest['problem']} (consolidate and verify refuse the checkpoint)"
    return f"{MANIFEST}: {len(manifest['files'])} files listed (checked by consolidate and verify)"


def check(folder: Path, manifest: dict[str, Any] | None, *, part: tuple[int, int] = (0, 1)) -> str | None:
    """Hash every file `manifest` lists (this rank's `part`: (rank, ranks) of the names, in order) against it.

    Returns the note saying what was checked (None when the save has no manifest).

    Raises:
        CorruptCheckpointError: the manifest is unusable, or a listed file is missing or has another digest (the
            first one in the listing's order is named, and how many more there are).
    """
    if manifest is None:
        return None
    where = location_name(folder / MANIFEST)
    if skipped():
        listed = f"{len(manifest['files'])} files'" if "files" in manifest else "the files'"
        return f"{MANIFEST} not checked ({SKIP_VAR} is set): {listed} SHA-256 not compared with the save"
    if "problem" in manifest:
        raise CorruptCheckpointError(
            f"{where} {manifest['problem']}: the checkpoint cannot be checked against its save; restore the file "
            f"from the source (or set {SKIP_VAR}=1 to skip the check)"
        )
    files: dict[str, str] = manifest["files"]
    rank, ranks = part
    mine = sorted(files)[rank::ranks]
    with ThreadPoolExecutor(max(1, min(default_workers(), len(mine))), thread_name_prefix="ckpt-sha256") as pool:
        found = list(pool.map(lambda name: _problem(folder / name, files[name]), mine))
    problems = [p for p in found if p]
    if problems:
        more = f" (and {len(problems) - 1} more listed)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(f"{problems[0]}{more}: the checkpoint was damaged or changed since it was "
                                     f"saved; copy it again from the source")  # fmt: skip
    return f"{MANIFEST}: the SHA-256 of all {len(files)} files listed match the save"


def skipped() -> bool:
    """Whether the user asked to skip the check (CKPT_SKIP_INTEGRITY set, not to 0)."""
    return os.environ.get(SKIP_VAR, "").strip() not in ("", "0")


def _problem(path: Path, expected: str) -> str | None:
    """Why `path` is not the file the save hashed, or None."""
    name = location_name(path)
    try:
        source = open_source(path)
    except FileNotFoundError:
        return f"{name} is listed in {MANIFEST} but missing"
    except OSError as e:
        return f"{name} is listed in {MANIFEST} but cannot be read ({e.strerror or type(e).__name__})"
    try:
        digest, size = _sha256(source)
    finally:
        source.close()
    if digest != expected:
        return f"{name} ({size} bytes) has SHA-256 {digest[:16]}..., {MANIFEST} says {expected[:16]}..."
    return None


def _sha256(source: Any) -> tuple[str, int]:
    """The digest of a source's bytes, read in order in READ_BYTES pieces, and how many there were."""
    h = hashlib.sha256()
    buffer = memoryview(bytearray(READ_BYTES))
    size, offset = source.size(), 0
    source.advise(0, min(size, 4 * READ_BYTES))
    while True:
        n = read_full(source, offset, buffer)
        if n <= 0:
            break
        source.advise(offset + n + 3 * READ_BYTES, READ_BYTES)
        h.update(buffer[:n])
        offset += n
    return h.hexdigest(), offset

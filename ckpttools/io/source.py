"""Where checkpoint bytes come from: a `ByteSource` is one file's bytes, read by byte range into caller buffers.

Every read of a checkpoint file goes through `open_source`, so no reader or layout knows whether the bytes lie on
a local disk. Reads have `pread` semantics (the offset is given, there is no shared file position), so one source
serves many worker threads at once, and the bytes land in the caller's buffer with no copy in between. A remote
source (s3://, gs://, az://, hf:// through fsspec: io/remote.py) is one more entry of `SCHEMES`: a ranged read
becomes a ranged GET. A remote checkpoint folder mounted by `io.remote.mount` reads as a local one whose rank
files `_open_local` answers with remote sources.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

try:  # imported now: importing it needs a file descriptor, which is what runs out when it is wanted
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

from ckpttools.errors import CkptError
from ckpttools.io.remote import MOUNTS_VAR  # set while a remote checkpoint is mounted (remote's own imports are light)


class ByteSource(Protocol):
    """One file's bytes, read by range. Safe to read from several threads at once."""

    name: str  # what messages call it: the path, or the URL of a remote file

    def size(self) -> int:
        """The number of bytes it holds now."""
        ...

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from `offset` on, as `pread` does: the number of bytes read, which may be fewer than asked
        (0 at or past the end). `read_full` loops until the buffer is full."""
        ...

    def advise(self, offset: int, nbytes: int) -> None:
        """A hint that these bytes will be read soon (read-ahead, prefetch); never fails, may do nothing."""
        ...

    def close(self) -> None: ...


def read_full(source: ByteSource, offset: int, buffer: memoryview) -> int:
    """Read until `buffer` is full or the source ends: the number of bytes read (short only at the end)."""
    done = 0
    while done < len(buffer):
        n = source.read_into(offset + done, buffer[done:])
        if n <= 0:
            break
        done += n
    return done


# --- Local files -----------------------------------------------------------------------------------------------

DEFAULT_READAHEAD = 128 << 10  # the kernel's default read-ahead window


class LocalFile:
    """A local file read with `preadv` on one read-only descriptor, held until `close`.

    Opened as `open(path, "rb")` opens it (symbolic links followed, a folder refused with the same error), and
    with more descriptors allowed when a checkpoint of 1,000+ rank files needs them (`open_readonly`).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self.name = os.fspath(path)
        self.fd = open_readonly(path)
        try:
            if stat.S_ISDIR(os.fstat(self.fd).st_mode):  # os.open opens a folder; open() and the readers do not
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.name)
        except BaseException:
            os.close(self.fd)
            raise

    def _open_fd(self) -> int:
        fd = self.fd
        if fd < 0:
            raise ValueError(f"{self.name}: read from a closed byte source")
        return fd

    def size(self) -> int:
        return os.fstat(self._open_fd()).st_size

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return os.preadv(self._open_fd(), [buffer], offset)

    def advise(self, offset: int, nbytes: int) -> None:
        """POSIX_FADV_WILLNEED over the range, in pieces the kernel honours whole (`advise_piece`)."""
        if not hasattr(os, "posix_fadvise") or self.fd < 0:
            return
        pos, end = offset, offset + nbytes
        try:
            piece = advise_piece(os.fstat(self.fd).st_dev)
            while pos < end:
                n = min(piece, end - pos)
                os.posix_fadvise(self.fd, pos, n, os.POSIX_FADV_WILLNEED)
                pos += n
        except OSError:
            pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __repr__(self) -> str:
        return f"LocalFile({self.name!r})"


@functools.cache
def advise_piece(st_dev: int) -> int:
    """The most bytes one WILLNEED hint makes the kernel read on this device.

    Linux caps each hint at max(read-ahead window, largest I/O) of the backing device and ignores the
    rest, so a long range must be hinted in pieces of this size. Falls back to the default window.
    """
    dev = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
    for queue in (f"{dev}/queue", f"{dev}/../queue"):  # a partition's queue is its disk's
        try:
            limits = [int(Path(queue, name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(DEFAULT_READAHEAD, max(limits) << 10)
    return DEFAULT_READAHEAD


def open_readonly(path: Path | str) -> int:
    """A read-only descriptor, kept open while a conversion runs. Checkpoints of 1,000+ ranks need more than the
    usual soft limit of 1,024 open files: on EMFILE the soft limit is raised to the hard one (by whichever thread
    gets there first) and the open retried once."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        _raise_open_file_limit()
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        raise CkptError(
            f"too many open files reading {path}: the checkpoint has more rank files than the limit allows; "
            "raise it (ulimit -n) and run again"
        ) from e


def _raise_open_file_limit() -> bool:
    if resource is None:
        return False
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft >= hard:
            return False
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return True
    except (ValueError, OSError):
        return False


def list_local(path: Path | str) -> list[str]:
    """The names in a local folder, sorted."""
    return sorted(os.listdir(_local_path(path)))


def _local_path(location: Path | str) -> Path | str:
    """A path as given, or the path of a file:// URL."""
    if isinstance(location, str) and location[:7].lower() == "file://":
        return location[7:]
    return location


def _open_local(location: Path | str) -> ByteSource:
    """A local file, or the remote object behind a placeholder of a mounted remote checkpoint (io.remote.mount)."""
    path = _local_path(location)
    if os.environ.get(MOUNTS_VAR):
        from ckpttools.io.remote import open_mounted

        remote = open_mounted(path)
        if remote is not None:
            return remote
    return LocalFile(path)


# --- Remote files (io.remote, imported when one is opened: fsspec and its stores are optional) -------------------


def location_name(path: Path | str) -> str:
    """What to call a location in messages and records: the URL of a path inside a mounted remote checkpoint,
    else the path itself."""
    if os.environ.get(MOUNTS_VAR):
        from ckpttools.io.remote import url_of

        url = url_of(path)
        if url is not None:
            return url
    return os.fspath(path)


def _open_remote(location: Path | str) -> ByteSource:
    from ckpttools.io.remote import open_remote

    return open_remote(location)


def _list_remote(location: Path | str) -> list[str]:
    from ckpttools.io.remote import list_remote

    return list_remote(location)


# --- Opening a source -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    """How to reach the files of one URL scheme: open one, and (where the store can) list a folder's names."""

    open: Callable[[Path | str], ByteSource]
    list: Callable[[Path | str], list[str]] | None = None


SCHEMES: dict[str, Scheme] = {
    "file": Scheme(_open_local, list_local),
    # object stores through fsspec (s3fs, gcsfs, adlfs: optional extras) and the Hub through HfFileSystem
    **{name: Scheme(_open_remote, _list_remote) for name in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf")},
}
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(location: Path | str) -> str:
    """`file` for a `Path` or a plain path; the scheme of a URL such as s3://bucket/key."""
    if isinstance(location, str) and (m := _URL.match(location)):
        return m["scheme"].lower()
    return "file"


def _scheme(location: Path | str) -> Scheme:
    name = scheme_of(location)
    scheme = SCHEMES.get(name)
    if scheme is None:
        raise CkptError(
            f"cannot read {location}: {name}:// locations are not supported (readable: "
            f"{', '.join(sorted(SCHEMES))}); copy the checkpoint to a local folder first"
        )
    return scheme


def open_source(location: Path | str) -> ByteSource:
    """The bytes of one file: a local path (`Path` or str), or a URL of a registered scheme (`SCHEMES`).

    Raises:
        OSError: the file cannot be opened (missing, a folder, no permission), as `open` raises it.
        CkptError: too many open files, or a scheme no source is registered for.
    """
    return _scheme(location).open(location)


def list_names(location: Path | str) -> list[str]:
    """The names in a folder, where its scheme can list (CkptError where it cannot)."""
    scheme = _scheme(location)
    if scheme.list is None:
        raise CkptError(f"cannot list {location}: {scheme_of(location)}:// locations cannot be listed")
    return scheme.list(location)


# --- A file object over a source -----------------------------------------------------------------------------------


class SourceStream(io.RawIOBase):
    """A read-only, seekable file object over a source, for code that wants one (zipfile). It has its own
    position, so it must not be shared between threads; the source may be. Closing it leaves the source open."""

    def __init__(self, source: ByteSource) -> None:
        super().__init__()
        self.source = source
        self.pos = 0

    @property
    def name(self) -> str:
        return self.source.name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.source.read_into(self.pos, memoryview(buffer).cast("B"))
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self.pos + offset
        elif whence == io.SEEK_END:
            pos = self.source.size() + offset
        else:
            raise ValueError(f"invalid whence ({whence})")
        if pos < 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))  # what lseek says, as a file object would
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos


def open_stream(source: ByteSource) -> io.BufferedReader:
    """A buffered file object over `source` (what `open(path, "rb")` returns for a local file)."""
    return io.BufferedReader(SourceStream(source))

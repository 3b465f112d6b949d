"""ckpttools.io.source: LocalFile reads like pread into caller buffers and opens what `open(path, "rb")` opens,
refusing what it refuses with the same error; open_source is the one place a scheme plugs in."""

from __future__ import annotations

import errno
import io
import os
import threading
import zipfile
from pathlib import Path

import pytest

from ckpttools.errors import CkptError
from ckpttools.io import source
from ckpttools.io.source import ByteSource, LocalFile, Scheme, list_names, open_source, open_stream, read_full

DATA = bytes(range(256)) * 64  # 16 KiB, every offset's byte known


class MemorySource:
    """A ByteSource over bytes that returns at most `step` bytes a read, as a remote source may."""

    def __init__(self, data: bytes, step: int = 3) -> None:
        self.name, self.data, self.step, self.closed = "mem://x", data, step, False

    def size(self) -> int:
        return len(self.data)

    def read_into(self, offset: int, buffer: memoryview) -> int:
        chunk = self.data[offset : offset + min(len(buffer), self.step)]
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def advise(self, offset: int, nbytes: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    return path


def test_read_into_fills_the_callers_buffer_from_an_offset(data_file: Path) -> None:
    src = LocalFile(data_file)
    try:
        buf = bytearray(1000)
        assert src.read_into(12345, memoryview(buf)) == 1000
        assert buf == DATA[12345:13345]
        assert src.size() == len(DATA)
        assert src.name == str(data_file)
    finally:
        src.close()


def test_a_read_across_the_end_is_short_and_one_past_it_reads_nothing(data_file: Path) -> None:
    with_source = LocalFile(data_file)
    try:
        buf = bytearray(100)
        assert with_source.read_into(len(DATA) - 40, memoryview(buf)) == 40
        assert buf[:40] == DATA[-40:]
        assert with_source.read_into(len(DATA), memoryview(buf)) == 0
        assert with_source.read_into(len(DATA) + 10_000, memoryview(buf)) == 0
        assert read_full(with_source, len(DATA) - 40, memoryview(buf)) == 40
    finally:
        with_source.close()


def test_read_full_loops_over_short_reads() -> None:
    mem = MemorySource(DATA, step=7)
    buf = bytearray(500)
    assert read_full(mem, 100, memoryview(buf)) == 500
    assert buf == DATA[100:600]
    assert read_full(mem, len(DATA) - 3, memoryview(buf)) == 3


def test_reads_from_many_threads_at_once_do_not_disturb_each_other(data_file: Path) -> None:
    src = LocalFile(data_file)
    bad: list[int] = []

    def reader(seed: int) -> None:
        for i in range(200):
            off = (seed * 977 + i * 131) % (len(DATA) - 64)
            buf = bytearray(64)
            if src.read_into(off, memoryview(buf)) != 64 or buf != DATA[off : off + 64]:
                bad.append(off)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    src.close()
    assert bad == []


def test_a_closed_source_refuses_reads_and_closes_once(data_file: Path) -> None:
    src = LocalFile(data_file)
    fd = src.fd
    src.close()
    with pytest.raises(ValueError, match="closed"):
        src.read_into(0, memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="closed"):
        src.size()
    src.advise(0, 100)  # a hint: never fails
    src.close()  # twice is fine, and must not close a descriptor reused since
    with pytest.raises(OSError):
        os.fstat(fd)


def test_advise_is_a_hint_that_never_fails(data_file: Path) -> None:
    src = LocalFile(data_file)
    try:
        src.advise(0, 1 << 40)  # far past the end
        src.advise(len(DATA), 0)
    finally:
        src.close()


def _open_error(path: Path) -> tuple[type, int | None, str | None, str | None]:
    with pytest.raises(OSError) as info:
        LocalFile(path)
    return type(info.value), info.value.errno, info.value.strerror, info.value.filename


def _builtin_open_error(path: Path) -> tuple[type, int | None, str | None, str | None]:
    with pytest.raises(OSError) as info, open(path, "rb"):
        pass
    return type(info.value), info.value.errno, info.value.strerror, info.value.filename


@pytest.mark.parametrize("kind", ["missing", "folder", "link_to_folder", "dangling_link", "link_loop"])
def test_what_open_refuses_is_refused_with_the_same_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "rank.pt"
    if kind == "folder":
        path.mkdir()
    elif kind == "link_to_folder":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "dangling_link":
        path.symlink_to(tmp_path / "does-not-exist.pt")
    elif kind == "link_loop":
        path.symlink_to(path.name)
    got = _open_error(path)
    assert got == _builtin_open_error(path)
    assert got[1] == {"missing": errno.ENOENT, "dangling_link": errno.ENOENT, "link_loop": errno.ELOOP}.get(
        kind, errno.EISDIR
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_an_unreadable_file_is_refused_as_open_refuses_it(data_file: Path) -> None:
    data_file.chmod(0)
    assert _open_error(data_file) == _builtin_open_error(data_file)


def test_symbolic_links_to_files_are_followed_as_open_follows_them(tmp_path: Path, data_file: Path) -> None:
    link = tmp_path / "link.pt"
    link.symlink_to(data_file)
    src = open_source(link)
    try:
        buf = bytearray(10)
        assert src.read_into(5, memoryview(buf)) == 10 and buf == DATA[5:15]
    finally:
        src.close()


def test_a_character_device_opens_and_reads_as_empty_as_open_reads_it() -> None:
    src = LocalFile("/dev/null")
    try:
        assert src.size() == 0
        assert src.read_into(0, memoryview(bytearray(8))) == 0
    finally:
        src.close()


def test_too_many_open_files_raises_the_limit_then_says_so(monkeypatch: pytest.MonkeyPatch, data_file: Path) -> None:
    real_open, calls = os.open, []

    def no_descriptors(path: object, flags: int, *args: object) -> int:
        calls.append(path)
        if len(calls) == 1 or fail_always:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    raised: list[bool] = []

    def raise_limit() -> bool:
        raised.append(True)
        return True

    monkeypatch.setattr(source, "_raise_open_file_limit", raise_limit)
    monkeypatch.setattr(source.os, "open", no_descriptors)
    fail_always = False
    LocalFile(data_file).close()
    assert len(calls) == 2 and raised == [True]
    fail_always = True
    with pytest.raises(CkptError, match=r"too many open files reading .*data\.bin.*ulimit -n"):
        LocalFile(data_file)


def test_open_source_opens_paths_and_file_urls_locally(data_file: Path) -> None:
    for location in (data_file, str(data_file), f"file://{data_file}"):
        src = open_source(location)
        try:
            assert isinstance(src, LocalFile) and src.size() == len(DATA)
        finally:
            src.close()
    assert source.scheme_of(Path("s3://not-a-url")) == "file"  # a Path is always local


def test_a_scheme_without_a_source_is_refused_by_name() -> None:
    with pytest.raises(CkptError, match=r"cannot read ftp://host/x\.pt: ftp:// locations are not supported"):
        open_source("ftp://host/x.pt")


def test_a_registered_scheme_is_where_a_remote_source_plugs_in(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[object] = []

    def open_mem(location: Path | str) -> ByteSource:
        opened.append(location)
        return MemorySource(DATA)

    monkeypatch.setitem(source.SCHEMES, "mem", Scheme(open_mem))
    src = open_source("mem://bucket/x.pt")
    assert opened == ["mem://bucket/x.pt"] and src.size() == len(DATA)
    with pytest.raises(CkptError, match="cannot be listed"):
        list_names("mem://bucket")


def test_list_names_lists_a_local_folder_sorted(tmp_path: Path) -> None:
    for name in ("b.pt", "a.pt", "latest"):
        (tmp_path / name).write_bytes(b"")
    assert list_names(tmp_path) == ["a.pt", "b.pt", "latest"]


def test_a_stream_over_a_source_is_a_seekable_file_object_zipfile_reads() -> None:
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", b"pickle bytes")
        zf.writestr("archive/data/0", DATA)
    mem = MemorySource(raw.getvalue(), step=5)  # short reads all the way
    with open_stream(mem) as fh, zipfile.ZipFile(fh) as zf:
        assert zf.read("archive/data/0") == DATA
        assert zf.read("archive/data.pkl") == b"pickle bytes"
        assert fh.seek(-4, io.SEEK_END) == len(raw.getvalue()) - 4
        with pytest.raises(OSError):
            fh.seek(-1)
    assert not mem.closed  # the stream does not own its source

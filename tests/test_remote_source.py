"""The remote ByteSource (io/remote.py) over a fake fsspec filesystem: ranged reads, retries, errors, mounts.

The end-to-end runs against real local servers (moto's S3, the Hub test server) are in tests/test_remote.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from ckpttools.errors import AuthError, CheckpointNotFoundError, CkptError, RemoteError
from ckpttools.io import remote
from ckpttools.io.source import SCHEMES, LocalFile, open_source, read_full


class FakeFS:
    """An async-style fsspec filesystem in memory: `cat_file(path, start, end)` is the ranged GET; `faults` is a
    list of exceptions raised by the next calls, one each. `timeout` is what fsspec's blocking wrappers take."""

    async_impl = True

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.calls: list[tuple[str, int | None, int | None]] = []
        self.faults: list[BaseException] = []
        self.lock = threading.Lock()

    def _strip_protocol(self, url: str) -> str:
        return url.split("://", 1)[1].rstrip("/")

    def _fault(self) -> None:
        with self.lock:
            if self.faults:
                raise self.faults.pop(0)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, timeout: float | None = None
                 ) -> bytes:  # fmt: skip
        self._fault()
        with self.lock:
            self.calls.append((path, start, end))
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path][start:end]

    def info(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        self._fault()
        if path in self.files:
            return {"name": path, "size": len(self.files[path]), "type": "file"}
        if any(p.startswith(path + "/") for p in self.files):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def find(self, path: str, detail: bool = False, timeout: float | None = None) -> dict[str, Any]:
        return {p: self.info(p) for p in sorted(self.files) if p.startswith(path + "/")}

    def ls(self, path: str, detail: bool = False, timeout: float | None = None) -> list[str]:
        return sorted({path + "/" + p[len(path) + 1 :].split("/")[0] for p in self.files if p.startswith(path + "/")})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFS:
    fs = FakeFS({"bucket/obj": bytes(range(256)) * 40})
    monkeypatch.setattr(remote, "_make_filesystem", lambda scheme: fs)
    monkeypatch.setattr(remote, "_FILESYSTEMS", {})
    monkeypatch.setattr(remote, "BACKOFF", 0.0)
    remote.STATS.reset()
    remote.SMALL_READS.clear()
    remote.PREFETCH.pending = 0
    return fs


def test_read_into_is_one_ranged_get_of_exactly_the_bytes_asked(fake: FakeFS) -> None:
    source = open_source("s3://bucket/obj")
    assert isinstance(source, remote.RemoteFile) and source.size() == 10240
    buf = bytearray(100)
    assert source.read_into(1000, memoryview(buf)) == 100
    assert bytes(buf) == fake.files["bucket/obj"][1000:1100]
    assert fake.calls == [("bucket/obj", 1000, 1100)]
    assert source.read_into(10240, memoryview(bytearray(10))) == 0  # at the end: nothing asked of the store
    assert source.read_into(10200, memoryview(buf)) == 40  # short at the end, as pread
    assert remote.STATS.ranged_bytes == 140 and remote.STATS.ranged_requests == 2


def test_a_small_read_is_fetched_once(fake: FakeFS) -> None:
    source = open_source("s3://bucket/obj")
    for _ in range(3):
        buf = bytearray(100)
        assert open_source("s3://bucket/obj").read_into(1000, memoryview(buf)) == 100
        assert bytes(buf) == fake.files["bucket/obj"][1000:1100]
    assert source.read_into(1010, memoryview(bytearray(50))) == 50  # inside a kept read
    buf = bytearray(300)
    assert source.read_into(900, memoryview(buf)) == 300  # around it: only the two gaps are fetched
    assert bytes(buf) == fake.files["bucket/obj"][900:1200]
    assert fake.calls == [("bucket/obj", 1000, 1100), ("bucket/obj", 900, 1000), ("bucket/obj", 1100, 1200)]


def test_small_reads_kept_are_bounded(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "CACHE_BYTES", 250)
    source = open_source("s3://bucket/obj")
    for i in range(5):
        source.read_into(i * 100, memoryview(bytearray(100)))
    assert remote.SMALL_READS.size <= 250 and len(remote.SMALL_READS.order) == 2


def test_a_large_buffer_is_read_in_gets_of_at_most_max_get(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "MAX_GET", 4096)
    source = open_source("s3://bucket/obj")
    buf = bytearray(10000)
    assert read_full(source, 100, memoryview(buf)) == 10000
    assert bytes(buf) == fake.files["bucket/obj"][100:10100]
    assert [end - start for _, start, end in fake.calls] == [4096, 4096, 1808]  # type: ignore[operator]


def test_reads_from_many_threads_at_once(fake: FakeFS) -> None:
    source = open_source("s3://bucket/obj")
    data = fake.files["bucket/obj"]
    results: dict[int, bytes] = {}

    def read(i: int) -> None:
        buf = bytearray(97)
        read_full(source, i * 97, memoryview(buf))
        results[i] = bytes(buf)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == data[i * 97 : i * 97 + 97] for i in range(64))


def test_advised_bytes_are_fetched_ahead_in_the_pieces_read_asks_for(
    fake: FakeFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "MAX_GET", 4096)
    source = open_source("s3://bucket/obj")
    source.advise(100, 9000)
    assert sorted(fake_calls_after(fake)) == [(100, 4196), (4196, 8292)]  # the last piece may still grow
    buf = bytearray(9000)
    assert read_full(source, 100, memoryview(buf)) == 9000 and bytes(buf) == fake.files["bucket/obj"][100:9100]
    assert len(fake.calls) == 3 and remote.STATS.ranged_bytes == 9000  # each byte fetched once
    assert remote.PREFETCH.pending == 0


def test_adjacent_advice_grows_into_one_get(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "MAX_GAP", 1000)
    source = open_source("s3://bucket/obj")
    for start in (0, 100, 200):
        source.advise(start, 100)
    source.advise(5000, 50)  # not close: a range of its own
    for start in (0, 100, 200):
        buf = bytearray(100)
        assert source.read_into(start, memoryview(buf)) == 100
        assert bytes(buf) == fake.files["bucket/obj"][start : start + 100]
    assert source.read_into(4990, memoryview(bytearray(100))) == 10  # stops where the next advised range starts
    assert [(a, b) for _, a, b in fake.calls] == [(0, 300), (4990, 5000)]
    source.advise(5100, 50)  # close enough: joins the growing range, the bytes between fetched once
    ahead = source._ahead  # type: ignore[attr-defined]
    assert [(r.start, r.end, r.unread) for r in ahead] == [(5000, 5150, 100)]
    assert remote.PREFETCH.pending == 150
    source.close()
    assert remote.PREFETCH.pending == 0


def test_advice_past_the_budget_is_dropped(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "PREFETCH_BYTES", 1000)
    source = open_source("s3://bucket/obj")
    source.advise(0, 5000)
    assert fake_calls_after(fake) == [] and remote.PREFETCH.pending == 0
    source.advise(0, 800)
    source.close()  # advised, never read: the budget comes back
    assert remote.PREFETCH.pending == 0


def fake_calls_after(fake: FakeFS) -> list[tuple[int | None, int | None]]:
    """The ranges GET so far, once the prefetch threads are done."""
    import time

    for _ in range(100):
        if remote.PREFETCH.pool is None or remote.PREFETCH.pool._work_queue.empty():
            break
        time.sleep(0.01)
    time.sleep(0.05)
    return [(a, b) for _, a, b in fake.calls]


def test_transient_errors_are_retried_with_backoff(fake: FakeFS) -> None:
    source = open_source("s3://bucket/obj")
    fake.faults = [ConnectionResetError("connection reset by peer"), TimeoutError("read timed out")]
    buf = bytearray(10)
    assert source.read_into(5, memoryview(buf)) == 10 and bytes(buf) == fake.files["bucket/obj"][5:15]
    assert remote.STATS.retries == 2


def test_a_store_that_keeps_failing_gives_one_remote_error_line(fake: FakeFS) -> None:
    source = open_source("s3://bucket/obj")
    fake.faults = [ConnectionResetError("reset")] * remote.TRIES
    with pytest.raises(
        RemoteError, match=r"s3://bucket/obj: reading bytes 0-10 \(5 tries\) failed \(ConnectionResetError"
    ):
        source.read_into(0, memoryview(bytearray(10)))
    assert remote.STATS.retries == remote.TRIES - 1


def test_refused_credentials_fail_at_once_and_are_never_printed(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value-123")
    source = open_source("s3://bucket/obj")
    fake.faults = [PermissionError("InvalidAccessKeyId for key sekrit-value-123")]
    with pytest.raises(AuthError) as e:
        source.read_into(0, memoryview(bytearray(10)))
    assert "sekrit" not in str(e.value) and "***" in str(e.value) and "\n" not in str(e.value)
    assert remote.STATS.retries == 0


def test_a_store_that_ignores_the_range_is_refused(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_source("s3://bucket/obj")
    monkeypatch.setattr(fake, "cat_file", lambda path, start=None, end=None, timeout=None: fake.files[path])
    with pytest.raises(RemoteError, match="it ignores byte ranges"):
        source.read_into(5, memoryview(bytearray(10)))


def test_a_missing_object_is_file_not_found(fake: FakeFS) -> None:
    with pytest.raises(FileNotFoundError):
        open_source("s3://bucket/nothing")


def test_every_remote_scheme_is_registered() -> None:
    for scheme in ("s3", "gs", "az", "hf"):
        assert SCHEMES[scheme].open.__name__ == "_open_remote"


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "filesystem", missing)
    monkeypatch.setattr(remote, "_FILESYSTEMS", {})
    with pytest.raises(CkptError, match=r"needs s3fs, which is not installed: pip install 'ckpttools\[s3\]'"):
        open_source("s3://bucket/obj")


@pytest.fixture
def tree(fake: FakeFS, monkeypatch: pytest.MonkeyPatch) -> FakeFS:
    monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
    monkeypatch.setattr(remote, "_MOUNTS", {})
    fake.files.update({
        "bucket/run/checkpoint-2/latest": b"global_step2",
        "bucket/run/checkpoint-2/config.json": b"{}",
        "bucket/run/checkpoint-2/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"A" * 5000,
        "bucket/run/checkpoint-2/global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt": b"B" * 300,
        "bucket/run/checkpoint-2/rng_state_0.pth": b"rng",
    })  # fmt: skip
    return fake


def test_a_mount_downloads_small_files_and_leaves_rank_files_remote(tree: FakeFS) -> None:
    root = remote.mount("s3://bucket/run/checkpoint-2/")
    assert root.name == "checkpoint-2"
    assert (root / "latest").read_text() == "global_step2" and (root / "rng_state_0.pth").read_bytes() == b"rng"
    optim = root / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert optim.stat().st_size == 5000 and optim.stat().st_blocks == 0  # a sparse placeholder
    assert remote.STATS.small_files == 3 and remote.STATS.ranged_bytes == 0
    source = open_source(optim)
    assert isinstance(source, remote.RemoteFile) and source.name == (
        "s3://bucket/run/checkpoint-2/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    buf = bytearray(10)
    assert source.read_into(4995, memoryview(buf)) == 5 and bytes(buf[:5]) == b"AAAAA"
    assert isinstance(open_source(root / "latest"), LocalFile)  # a downloaded file reads locally
    assert remote.url_of(root / "global_step2") == "s3://bucket/run/checkpoint-2/global_step2"
    assert remote.describe(f"{root}/latest is bad") == "s3://bucket/run/checkpoint-2/latest is bad"
    assert remote.mount("s3://bucket/run/checkpoint-2") == root  # mounted once


def test_a_process_started_by_the_command_finds_the_mount(tree: FakeFS, monkeypatch: pytest.MonkeyPatch) -> None:
    root = remote.mount("s3://bucket/run/checkpoint-2")
    monkeypatch.setattr(remote, "_MOUNTS", {})  # as a child process sees it: only the environment variable
    assert os.environ[remote.MOUNTS_VAR]
    source = open_source(root / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert isinstance(source, remote.RemoteFile) and source.size() == 300


def test_mounting_a_missing_folder(tree: FakeFS) -> None:
    with pytest.raises(CheckpointNotFoundError, match="s3://bucket/nope does not exist"):
        remote.mount("s3://bucket/nope")


def test_rank_files_are_recognised() -> None:
    assert remote.is_rank_file("ck/global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert remote.is_rank_file("ck/global_step2/layer_01-model_states.pt")
    assert remote.is_rank_file("ck/global_step2/zero/layer.weight/fp32.pt")
    assert not remote.is_rank_file("ck/scheduler.pt") and not remote.is_rank_file("ck/rng_state_0.pth")


def test_a_local_path_outside_every_mount_is_a_local_file(tmp_path: Path, tree: FakeFS) -> None:
    remote.mount("s3://bucket/run/checkpoint-2")
    (tmp_path / "f").write_bytes(b"x")
    assert isinstance(open_source(tmp_path / "f"), LocalFile)

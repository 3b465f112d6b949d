"""The one staging helper: outputs appear only complete; failures, Ctrl-C and SIGTERM leave nothing behind."""

import itertools
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ckpttools.errors import OutputError
from ckpttools.io.staging import StagedFolder, check_output_dir, staged_folder


def _siblings(folder):
    return sorted(p.name for p in folder.iterdir())


def test_success_renames_the_complete_folder_into_place(tmp_path):
    with staged_folder(tmp_path / "out", overwrite=False) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.ckpt-staging.")
        (tmp / "a.txt").write_text("x")
    assert _siblings(tmp_path) == ["out"] and (tmp_path / "out" / "a.txt").read_text() == "x"
    assert _siblings(tmp_path / "out") == [".ckpt-manifest.json", "a.txt"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failure_removes_the_temp_folder_and_keeps_an_old_output(tmp_path, exc):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(exc), staged_folder(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise exc()
    assert _siblings(tmp_path) == ["out"] and _siblings(tmp_path / "out") == ["old.txt"]


def test_overwrite_replaces_and_leaves_no_aside_folder(tmp_path):
    with staged_folder(tmp_path / "out", overwrite=False) as tmp:
        (tmp / "old.txt").write_text("old")
    with staged_folder(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _siblings(tmp_path) == ["out"] and _siblings(tmp_path / "out") == [".ckpt-manifest.json", "new.txt"]


def test_two_runs_never_share_a_temp_folder_and_the_late_one_fails(tmp_path):
    first = StagedFolder(tmp_path / "out", overwrite=False)
    second = StagedFolder(tmp_path / "out", overwrite=False)
    assert first.path != second.path
    (first.path / "a").write_text("first")
    (second.path / "a").write_text("second")
    first.commit()
    with pytest.raises(OutputError, match="appeared while this run was writing"):
        second.commit()
    second.abort()
    assert _siblings(tmp_path) == ["out"] and (tmp_path / "out" / "a").read_text() == "first"


def test_output_inside_or_around_the_input_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(OutputError, match="inside the checkpoint"):
        check_output_dir(tmp_path / "ckpt" / "out", tmp_path / "ckpt", False)
    with pytest.raises(OutputError, match="contains the checkpoint"):
        check_output_dir(tmp_path, tmp_path / "ckpt", True)


def test_sigterm_while_writing_leaves_nothing(tmp_path):
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from ckpttools.io.staging import staged_folder
        with staged_folder(pathlib.Path({str(tmp_path / "out")!r}), overwrite=False) as tmp:
            (tmp / "part").write_text("x")
            print("writing", flush=True)
            time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=20)
    assert proc.returncode != 0 and _siblings(tmp_path) == []


def test_the_folder_reaches_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """A crash after the rename must not leave a published folder of unwritten files."""
    from ckpttools.io import staging

    events = []
    monkeypatch.setattr(staging.DiskFlush, "wait", lambda self: events.append(("flush", self.folder.name)))
    real_publish = staging.publish
    monkeypatch.setattr(staging, "publish", lambda *a: (events.append(("publish", a[0].name)), real_publish(*a)))
    with staged_folder(tmp_path / "out", overwrite=False) as tmp:
        (tmp / "a.txt").write_text("x")
    assert events == [("flush", tmp.name), ("publish", tmp.name)]
    assert (tmp_path / "out" / "a.txt").read_text() == "x"


def test_a_write_back_error_fails_the_run_and_publishes_nothing(tmp_path, monkeypatch):
    """EIO from syncfs: bytes the kernel accepted never reached the disk."""
    import errno

    from ckpttools.io import staging

    def failing_syncfs(fd):
        staging.ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(staging, "_libc_syncfs", lambda: failing_syncfs)
    with (
        pytest.raises(OutputError, match="failed on the disk") as info,
        staged_folder(tmp_path / "out", overwrite=False) as tmp,
    ):
        (tmp / "a.txt").write_text("x")
    assert "nothing was published" in str(info.value)
    assert _siblings(tmp_path) == []


def test_flush_falls_back_to_sync_without_syncfs(tmp_path, monkeypatch):
    from ckpttools.io import staging

    calls = []
    monkeypatch.setattr(staging, "_libc_syncfs", lambda: None)
    monkeypatch.setattr(staging.os, "sync", lambda: calls.append("sync"))
    staging.flush_to_disk(tmp_path)
    assert calls == ["sync"]


def test_syncfs_is_found_on_linux():
    from ckpttools.io import staging

    if sys.platform.startswith("linux"):
        assert staging._libc_syncfs() is not None
        staging.flush_to_disk(staging.Path("."))  # a real call succeeds


def test_write_behind_hands_over_every_byte_by_the_end(tmp_path, monkeypatch):
    """Ranges a window behind the writer while it writes, then the tail when the file is complete."""
    from ckpttools.io import staging

    calls = []
    monkeypatch.setattr(staging.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)),
                        raising=False)  # fmt: skip
    window = staging.WriteBehind.WINDOW
    with open(tmp_path / "f", "wb") as fh:
        behind = staging.WriteBehind(fh)
        for _ in range(5):
            fh.write(bytes(window // 2 + 1))
            behind.wrote()
        behind.finish()
        size = fh.tell()
        staging.wait_for_hints()
    assert calls[0][0] == 0 and all(a + n == b for (a, n, _), (b, _, _) in itertools.pairwise(calls))
    assert calls[-1][0] + calls[-1][1] == size and len(calls) >= 2
    assert {advice for *_, advice in calls} == {os.POSIX_FADV_DONTNEED}


def test_chunk_buffers_are_kept_for_the_next_file_only_inside_reused_buffers():
    from ckpttools.io import safetensors_writer as writer

    first = writer._spare_buffers(4, 1024)
    writer._keep_buffers(first)
    assert writer._spare_buffers(4, 1024) is not first  # outside the block nothing is kept
    with writer.reused_buffers():
        first = writer._spare_buffers(4, 1024)
        writer._keep_buffers(first)
        again = writer._spare_buffers(4, 1024)
        assert again is first  # the same buffers, not new ones
        assert writer._spare_buffers(4, 1024) is not first  # taken: a second pump at once gets its own
        writer._keep_buffers(again)
        assert all(len(b) == 2048 for b in writer._spare_buffers(4, 2048))  # another size: new ones
        writer._keep_buffers(again)
    assert writer._spare.buffers == []  # freed when the block ends


def test_a_pump_run_to_the_end_leaves_its_buffers_for_the_next_file():
    from ckpttools.io import safetensors_writer as writer

    with writer.reused_buffers():
        pump = writer._ChunkPump([], None, 1024)
        assert list(pump) == []
        assert writer._spare.buffers == pump.buffers


def test_a_forked_child_gets_a_new_hint_thread(tmp_path):
    """The parent's background thread does not exist in a child: the child must not wait on it forever."""
    from ckpttools.io import staging

    staging.wait_for_hints()  # the parent's thread exists
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(20)  # a hang fails the test instead of stalling it
            staging.wait_for_hints()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked child reports anything at all as its exit status
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

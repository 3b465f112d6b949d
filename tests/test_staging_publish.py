"""Publishing: one step (renameat2, or a lock where it is missing), racing runs, stale staging, shielded cleanup."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from ckpttools.errors import OutputError
from ckpttools.io import staging
from ckpttools.io.staging import MANIFEST, StagedFolder, published_outputs, staged_folder


def _siblings(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(params=["renameat2", "lock"])
def publish_path(request, monkeypatch):
    """Every publishing test runs both ways: with renameat2, and as where the filesystem lacks it."""
    if request.param == "lock":
        monkeypatch.setattr(staging, "_renameat2", lambda src, dst, flags: False)
    return request.param


def test_renameat2_is_used_on_linux(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    assert staging._renameat2(tmp_path / "a", tmp_path / "b", staging._RENAME_EXCHANGE)
    assert (tmp_path / "b" / "x").read_text() == "a" and not list((tmp_path / "a").iterdir())
    with pytest.raises(FileExistsError):
        staging._renameat2(tmp_path / "a", tmp_path / "b", staging._RENAME_NOREPLACE)


def test_an_empty_folder_that_appeared_meanwhile_is_not_replaced(tmp_path, publish_path):
    staged = StagedFolder(tmp_path / "out", overwrite=False)
    (staged.path / "a").write_text("new")
    (tmp_path / "out").mkdir()  # a plain rename would silently replace this empty folder
    with pytest.raises(OutputError, match=r"appeared while this run was writing.*nothing was published"):
        staged.commit()
    staged.abort()
    assert _siblings(tmp_path) == ["out"] and _siblings(tmp_path / "out") == []


def test_overwrite_exchanges_and_removes_the_old_output(tmp_path, publish_path):
    out = tmp_path / "out"
    with staged_folder(out, overwrite=False) as tmp:
        (tmp / "old.txt").write_text("old")
    with staged_folder(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _siblings(tmp_path) == ["out"] and _siblings(out) == [MANIFEST, "new.txt"]
    assert published_outputs()[-2:] == [out, out]


def _race(out, overwrite, n, use_threads):
    """n runs stage their own content and publish at the same moment: how each ended."""
    results = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        staged = StagedFolder(out, overwrite=overwrite)
        try:
            for k in range(20):
                (staged.path / f"f{k}").write_text(str(i))
            barrier.wait()
            staged.commit()
            results[i] = "published"
        except OutputError as e:
            staged.abort()
            results[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _complete(out):
    """One run's files, all of them, and its manifest: never a mix."""
    names = _siblings(out)
    values = {(out / f"f{k}").read_text() for k in range(20)}
    return names == sorted([MANIFEST, *[f"f{k}" for k in range(20)]]) and len(values) == 1


@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_publishers_end_with_one_complete_output(tmp_path, publish_path, overwrite):
    for trial in range(5):
        out = tmp_path / f"out{trial}"
        results = _race(out, overwrite, 4, use_threads=True)
        assert _complete(out), _siblings(out)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging, no aside folder
        if overwrite:  # every run published in turn (the last one's output stays)
            assert results == ["published"] * 4
        else:  # one won; the others were told, one line each
            assert results.count("published") == 1, results
            assert all("appeared while this run was writing" in r for r in results if r != "published")


def _publish_in_process(out, overwrite, value, start, done):
    staged = StagedFolder(out, overwrite=overwrite)
    for k in range(20):
        (staged.path / f"f{k}").write_text(value)
    start.wait()
    try:
        staged.commit()
        done.put("published")
    except OutputError as e:
        staged.abort()
        done.put(str(e))


@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_processes_end_with_one_complete_output(tmp_path, overwrite):
    out = tmp_path / "out"
    if overwrite:
        with staged_folder(out, overwrite=False) as tmp:
            for k in range(20):
                (tmp / f"f{k}").write_text("earlier")
    ctx = multiprocessing.get_context("fork")
    start, done = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_publish_in_process, args=(out, overwrite, str(i), start, done)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = [done.get(timeout=10) for _ in procs]
    assert _complete(out) and (out / "f0").read_text() != "earlier"
    assert _siblings(tmp_path) == ["out"]
    assert results.count("published") == (3 if overwrite else 1), results


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_staging_of_a_dead_run_is_removed_with_a_note(tmp_path):
    host = staging._host()
    me = os.getpid()
    dead = tmp_path / f".out.ckpt-staging.{host}.{_dead_pid()}.123.abcd0123"
    reused = tmp_path / f".out.ckpt-staging.{host}.{me}.1.abcd0124"  # this pid, another start time: pid reuse
    live = tmp_path / f".out.ckpt-staging.{host}.{me}.{staging._process_start(me)}.abcd0125"
    other_host = tmp_path / f".out.ckpt-staging.{host}x.{_dead_pid()}.123.abcd0126"
    other_out = tmp_path / f".out2.ckpt-staging.{host}.{_dead_pid()}.123.abcd0127"
    for p in (dead, reused, live, other_host, other_out):
        p.mkdir()
        (p / "part").write_text("x")
    notes = []
    with staged_folder(tmp_path / "out", overwrite=False, notes=notes) as tmp:
        (tmp / "a").write_text("x")
    assert _siblings(tmp_path) == sorted([live.name, other_host.name, other_out.name, "out"])
    assert len(notes) == 1 and "removed 2 staging folder(s)" in notes[0] and dead.name in notes[0], notes


def test_a_killed_run_leaves_staging_the_next_run_removes(tmp_path):
    script = textwrap.dedent(f"""
        import pathlib, time
        from ckpttools.io.staging import staged_folder
        with staged_folder(pathlib.Path({str(tmp_path / "out")!r}), overwrite=False) as tmp:
            (tmp / "part").write_text("x")
            print(tmp.name, flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(".out.ckpt-staging.")
    notes = []
    with staged_folder(tmp_path / "other", overwrite=False, notes=notes):
        pass
    with pytest.raises(OutputError), staged_folder(tmp_path / "out", overwrite=False, notes=notes):
        raise OutputError("a live run's staging is kept")
    assert name in _siblings(tmp_path) and notes == []
    proc.kill()
    proc.wait()
    with staged_folder(tmp_path / "out", overwrite=False, notes=notes) as tmp:
        (tmp / "a").write_text("x")
    assert _siblings(tmp_path) == ["other", "out"] and name in notes[0]


def test_debris_of_earlier_versions_is_named_not_removed(tmp_path):
    partial = tmp_path / ".out.partial-12345-abcd0123"
    old = tmp_path / ".out.old-12345-abcd0123"
    partial.mkdir()
    old.mkdir()
    notes = []
    with staged_folder(tmp_path / "out", overwrite=False, notes=notes):
        pass
    assert partial.is_dir() and old.is_dir()
    assert len(notes) == 1 and str(partial) in notes[0] and str(old) in notes[0], notes


def test_parent_folders_a_failed_run_created_are_removed(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep").write_text("x")
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "a" / "b" / "c" / "model", overwrite=False) as tmp:
        (tmp / "part").write_text("x")
        raise RuntimeError
    assert _siblings(tmp_path) == ["a"] and _siblings(tmp_path / "a") == ["keep"]
    with staged_folder(tmp_path / "x" / "y" / "model", overwrite=False):
        pass
    assert (tmp_path / "x" / "y" / "model" / MANIFEST).is_file()


def _patch_rmtree(monkeypatch, rmtree):
    """staging's shutil.rmtree only (pytest's own cleanup uses the real one)."""
    monkeypatch.setattr(staging, "shutil", types.SimpleNamespace(**{**vars(shutil), "rmtree": rmtree}))


def test_a_second_ctrl_c_during_cleanup_cannot_cut_it_short(tmp_path, monkeypatch):
    """The cleanup defers the signal; the first failure is the one raised, and nothing is left."""
    real_rmtree = shutil.rmtree
    seen = []

    def rmtree_interrupted(path, ignore_errors=False):
        seen.append(staging.cleanup_in_progress())
        signal.raise_signal(signal.SIGINT)  # a second Ctrl-C lands in the middle of the cleanup
        real_rmtree(path, ignore_errors=ignore_errors)

    _patch_rmtree(monkeypatch, rmtree_interrupted)
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "a" / "out", overwrite=False) as tmp:
        (tmp / "part").write_text("x")
        raise RuntimeError
    assert seen == [True] and _siblings(tmp_path) == []
    assert not staging.cleanup_in_progress() and staging._Shield.deferred == []


def test_a_signal_while_publishing_lands_after_it(tmp_path, monkeypatch):
    """The output is complete and listed in published_outputs() when the deferred Ctrl-C is raised."""
    out = tmp_path / "out"
    with staged_folder(out, overwrite=False) as tmp:
        (tmp / "old").write_text("x")
    real_rmtree = shutil.rmtree

    def rmtree_interrupted(path, ignore_errors=False):
        signal.raise_signal(signal.SIGINT)
        real_rmtree(path, ignore_errors=ignore_errors)

    _patch_rmtree(monkeypatch, rmtree_interrupted)
    with pytest.raises(KeyboardInterrupt), staged_folder(out, overwrite=True) as tmp:
        (tmp / "new").write_text("x")
    assert _siblings(out) == [MANIFEST, "new"] and _siblings(tmp_path) == ["out"]
    assert published_outputs()[-1] == out


def test_shield_aware_handlers_defer_and_deliver_later():
    calls = []
    handler = staging.shield_aware(lambda signum, frame: calls.append(signum))
    with staging.shielded():
        handler(signal.SIGTERM, None)
        assert calls == [] and staging._Shield.deferred == [signal.SIGTERM]
        previous = signal.signal(signal.SIGTERM, handler)
    try:
        assert calls == [signal.SIGTERM]  # delivered again as the block ended
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_as_interrupt_leaves_a_handler_someone_else_installed():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with staging.sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_latest_file_is_replaced_in_one_step(tmp_path):
    staging.write_text_atomically(tmp_path / "latest_universal", "global_step2")
    staging.write_text_atomically(tmp_path / "latest_universal", "global_step3")
    assert _siblings(tmp_path) == ["latest_universal"]
    assert (tmp_path / "latest_universal").read_text() == "global_step3"


def test_an_interrupt_while_staging_starts_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C right after the staging folder was made (before the block runs): it and the new parents go."""

    def interrupted(self, folder, output=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(staging.DiskFlush, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt), staged_folder(tmp_path / "a" / "b" / "out", overwrite=False):
        pass
    assert _siblings(tmp_path) == []

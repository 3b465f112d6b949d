"""Out of space: the pre-check states what it checks; ENOSPC while writing is one line naming the output, with sizes."""

import errno
import os
import shutil
import subprocess
import sys
import uuid
from typing import NamedTuple

import pytest

from ckpttools import consolidate, reshard
from ckpttools.errors import OutputError
from ckpttools.io import safetensors_writer as writer
from ckpttools.io import staging
from ckpttools.io.staging import SPACE_MARGIN, check_free_space, staged_folder

from .conftest import FIXTURES

SRC = FIXTURES / "z2_dp2_fp32" / "checkpoint"
TRAINER = FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2"


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def _siblings(folder):
    return sorted(p.name for p in folder.iterdir())


def test_the_pre_check_states_the_margin_it_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: Usage(0, 0, 1_800_000))
    with pytest.raises(OutputError) as info:
        check_free_space(tmp_path, 300_000)
    assert "needs 0.3 MB plus a 64.0 MB safety margin, 1.8 MB is free" in str(info.value)
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: Usage(0, 0, 300_000 + SPACE_MARGIN))
    check_free_space(tmp_path, 300_000)  # exactly what the message says is needed: accepted
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: Usage(0, 0, 300_000 + SPACE_MARGIN - 1))
    with pytest.raises(OutputError, match="safety margin"):
        check_free_space(tmp_path, 300_000)


def _full_after(nbytes, code=errno.ENOSPC):
    class FullDisk(staging.WriteBehind):
        def wrote(self):
            if self.fh.tell() >= nbytes:
                raise OSError(code, os.strerror(code), self.fh.name)

    return FullDisk


@pytest.mark.parametrize(("code", "kind"), [(errno.ENOSPC, "disk"), (errno.EDQUOT, "quota")])
def test_out_of_space_while_writing_is_one_line_naming_the_output(tmp_path, monkeypatch, code, kind):
    monkeypatch.setattr(writer, "WriteBehind", _full_after(100, code))
    out = tmp_path / "a" / "b" / "model"
    with pytest.raises(OutputError) as info:
        consolidate(SRC, out, max_shard_size="10KB")
    message = str(info.value)
    assert message.startswith(f"the {kind} holding {out} ran out of space") and "nothing was published" in message
    assert "needs" in message and "is free" in message and ".ckpt-staging" not in message, message
    assert _siblings(tmp_path) == []  # the staging folder and the parents this run created are gone


def test_a_write_back_failure_for_lack_of_space_names_the_output(tmp_path, monkeypatch):
    def syncfs_full(fd):
        staging.ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(staging, "_libc_syncfs", lambda: syncfs_full)
    out = tmp_path / "model"
    with pytest.raises(OutputError) as info, staged_folder(out, overwrite=False, needed_bytes=1000) as tmp:
        (tmp / "a").write_text("x")
    assert str(info.value).startswith(f"the disk holding {out} ran out of space") and ".ckpt-staging" not in str(
        info.value
    )
    assert _siblings(tmp_path) == []


def test_reshard_universal_counts_everything_it_writes(tmp_path, monkeypatch):
    asked = []
    real = staging.check_free_space
    monkeypatch.setattr(
        staging, "check_free_space", lambda folder, needed, *a, **k: (asked.append(needed), real(folder, 0))
    )
    reshard(TRAINER, tmp_path / "u", universal=True)
    on_disk = sum(p.stat().st_blocks * 512 for p in (tmp_path / "u").rglob("*"))
    written = sum(p.stat().st_size for p in (tmp_path / "u").rglob("*") if p.is_file())
    tag = sum(p.stat().st_size for p in (TRAINER / "global_step2").rglob("*") if p.is_file())
    assert asked[0] >= max(on_disk, written) > tag, (asked, on_disk, written, tag)


# --- A real small filesystem (root only) ------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of the given size and inode count; skipped where it cannot be mounted (not root, no tmpfs)."""
    mounted = []

    def mount(size, inodes):
        where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(where)],
                             capture_output=True, check=False)  # fmt: skip
        if run.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {run.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _ckpt(*args, precheck=True):
    """`ckpt ...`; precheck=False: without the free-space pre-check, so the disk fills while writing."""
    code = "import sys; from ckpttools.cli import main; sys.argv[0] = 'ckpt'; main()"
    if not precheck:
        code = "import ckpttools.io.staging as s; s.check_free_space = lambda *a, **k: None; " + code
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=300)


def test_a_small_disk_is_refused_before_writing_with_the_real_need(small_fs):
    fs = small_fs("2m", 64)
    run = _ckpt("consolidate", SRC, "--out", fs / "model")
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and "plus a 64.0 MB safety margin, 2.1 MB is free" in line, line
    assert os.listdir(fs) == []


def test_a_disk_that_fills_while_writing(small_fs):
    fs = small_fs("2m", 64)
    filler = fs / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(fs).free - 8192))  # room for 8 KiB of the output
    run = _ckpt("consolidate", TRAINER, "--out", fs / "a" / "model", "--dtype", "fp32", precheck=False)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and line.startswith(f"Error: the disk holding {fs / 'a' / 'model'} ran out of space"), line
    assert "nothing was published" in line and ".ckpt-staging" not in line
    assert os.listdir(fs) == ["filler"]


def test_a_disk_without_inodes_left(small_fs):
    fs = small_fs("200m", 64)  # bytes enough, files not: a universal checkpoint is many small files
    run = _ckpt("reshard", TRAINER, "--universal", "--out", fs / "u")
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and f"the disk holding {fs / 'u'} ran out of space" in line, line
    assert "no free inodes" in line and "nothing was published" in line
    assert os.listdir(fs) == []

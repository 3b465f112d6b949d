"""--overwrite replaces only what ckpt wrote (its manifest): never the user's files, a checkpoint, `.`, $HOME."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttools import consolidate, reshard
from ckpttools.errors import OutputError
from ckpttools.io.staging import MANIFEST, StagedFolder, check_output_dir, read_manifest, staged_folder

from .conftest import FIXTURES, tree_digest

SRC = FIXTURES / "z2_dp2_fp32" / "checkpoint"


def _ckpt(*args, cwd=None):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "ckpttools.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=cwd, env=env, timeout=300)


def _earlier_output(out):
    with staged_folder(out, overwrite=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.json").write_text("{}")
    return out


def test_every_output_gets_a_manifest_of_what_was_written(tmp_path):
    result = consolidate(SRC, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["tool"] == "ckpttools" and manifest["version"]
    assert "created" not in manifest  # no timestamp: two runs give byte-identical folders
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "out").iterdir() if p.name != MANIFEST}
    assert manifest["files"] == on_disk and set(result.files) <= set(on_disk)


def test_nested_files_are_listed_by_relative_path(tmp_path):
    out = _earlier_output(tmp_path / "out")
    assert read_manifest(out) == {"model.safetensors": 10, "sub/a.json": 2}


def test_an_earlier_ckpt_output_is_replaced(tmp_path):
    out = tmp_path / "out"
    consolidate(SRC, out)
    (out / "model.safetensors").write_bytes(b"mark")  # proves the old folder went: the size differs from the manifest
    with pytest.raises(OutputError, match=r"model.safetensors, whose size differs"):
        consolidate(SRC, out, overwrite=True)
    consolidate(SRC, tmp_path / "first")
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "first", out)
    result = consolidate(SRC, out, overwrite=True, dtype="bf16")
    assert result.output_dir == str(out) and sorted(p.name for p in tmp_path.iterdir()) == ["first", "out"]


def test_cli_overwrite_refuses_foreign_files_and_deletes_nothing(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    (precious / "train.py").write_text("print()")
    before = tree_digest(precious)
    run = _ckpt("consolidate", SRC, "--out", precious, "--overwrite")
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "notes.txt" in lines[0] and "nothing was deleted" in lines[0], run.stderr
    assert "Traceback" not in run.stderr and tree_digest(precious) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]  # no staging folder either


def test_a_foreign_file_beside_an_earlier_output_is_refused(tmp_path):
    out = _earlier_output(tmp_path / "out")
    (out / "sub" / "mine.txt").write_text("x")
    with pytest.raises(OutputError, match=r"sub/mine.txt, which ckpt did not write; nothing was deleted"):
        check_output_dir(out, SRC, True)
    (out / "sub" / "mine.txt").unlink()
    (out / "empty").mkdir()  # a folder the manifest does not imply
    with pytest.raises(OutputError, match=r"empty, which ckpt did not write"):
        check_output_dir(out, SRC, True)
    (out / "empty").rmdir()
    os.symlink("/etc", out / "link")
    with pytest.raises(OutputError, match=r"link, which ckpt did not write"):
        check_output_dir(out, SRC, True)
    (out / "link").unlink()
    assert check_output_dir(out, SRC, True) == out


def test_a_checkpoint_copy_is_never_replaced(tmp_path):
    copy = tmp_path / "other-checkpoint"
    shutil.copytree(SRC, copy)
    before = tree_digest(copy)
    run = _ckpt("consolidate", SRC, "--out", copy, "--overwrite")
    assert run.returncode == 1 and "DeepSpeed/Trainer checkpoint" in run.stderr, run.stderr
    assert tree_digest(copy) == before
    (copy / MANIFEST).write_text(json.dumps({"tool": "ckpttools", "files": {}}))  # a manifest does not excuse it
    with pytest.raises(OutputError, match=r"DeepSpeed/Trainer checkpoint"):
        check_output_dir(copy, SRC, True)
    nested = tmp_path / "runs"
    shutil.copytree(SRC, nested / "checkpoint-2")
    with pytest.raises(OutputError, match=r"DeepSpeed/Trainer checkpoint"):
        check_output_dir(nested, SRC, True)


def test_the_working_directory_is_never_replaced(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print()")
    run = _ckpt("consolidate", SRC, "--out", ".", "--overwrite", cwd=work)
    assert run.returncode == 1 and "is the working directory" in run.stderr and "nothing was deleted" in run.stderr
    assert sorted(os.listdir(work)) == ["train.py"]
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(OutputError, match=r"is the working directory"):  # even empty
        check_output_dir(Path("."), SRC, True)
    with pytest.raises(OutputError, match=r"contains the working directory"):
        check_output_dir(tmp_path, SRC, True)


def test_home_and_roots_and_mount_points_are_never_replaced(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(OutputError, match=r"is the home directory"):
        check_output_dir(home, SRC, True)
    with pytest.raises(OutputError, match=r"nothing was deleted"):
        check_output_dir(Path("/"), None, True)
    monkeypatch.chdir(home)
    monkeypatch.setenv("HOME", str(tmp_path / "home2"))
    with pytest.raises(OutputError, match=r"contains the working directory"):
        check_output_dir(Path("/"), None, True)

    def gone():
        raise FileNotFoundError("the working directory was removed")

    monkeypatch.setattr(Path, "cwd", gone)  # nothing to compare with: the root is still refused
    monkeypatch.setattr(Path, "home", gone)
    with pytest.raises(OutputError, match=r"is a filesystem root"):
        check_output_dir(Path("/"), None, True)
    mounted = tmp_path / "mnt"
    mounted.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(mounted))
    with pytest.raises(OutputError, match=r"is a mount point"):
        check_output_dir(mounted, SRC, True)


def test_an_empty_folder_may_be_used(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputError, match=r"already exists"):
        consolidate(SRC, tmp_path / "out")
    consolidate(SRC, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / MANIFEST).is_file()


def test_a_symlink_to_elsewhere_is_followed_once_and_stays(tmp_path):
    target = tmp_path / "elsewhere" / "model"
    target.parent.mkdir()
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    link = tmp_path / "model"
    link.symlink_to(target)
    with pytest.raises(OutputError, match=r"notes.txt, which ckpt did not write"):
        consolidate(SRC, link, overwrite=True)
    assert os.listdir(target) == ["notes.txt"] and link.is_symlink()
    (target / "notes.txt").unlink()
    result = consolidate(SRC, link, overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(target) and (target / "model.safetensors").is_file()
    assert result.output_dir == str(target)
    consolidate(SRC, link, overwrite=True, dtype="bf16")  # an earlier output behind the link: replaced
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["elsewhere", "model"]
    assert sorted(os.listdir(target.parent)) == ["model"]  # no staging left beside the target


def test_a_dangling_symlink_is_refused_before_any_work(tmp_path):
    link = tmp_path / "model"
    link.symlink_to(tmp_path / "gone")
    run = _ckpt("consolidate", SRC, "--out", link)
    assert run.returncode == 1 and "does not exist" in run.stderr and "gone" in run.stderr, run.stderr
    assert sorted(os.listdir(tmp_path)) == ["model"] and link.is_symlink()


def test_the_folder_is_checked_again_just_before_the_exchange(tmp_path):
    out = _earlier_output(tmp_path / "out")
    check_output_dir(out, SRC, True)
    staged = StagedFolder(out, overwrite=True)
    (staged.path / "new.txt").write_text("new")
    (out / "added-meanwhile.txt").write_text("mine")  # the user wrote into it during the run
    with pytest.raises(OutputError, match=r"added-meanwhile.txt.*nothing was deleted or published"):
        staged.commit()
    staged.abort()
    assert sorted(os.listdir(out)) == [MANIFEST, "added-meanwhile.txt", "model.safetensors", "sub"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_reshard_overwrite_follows_the_same_rule(tmp_path):
    out = tmp_path / "dp3"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match=r"keep.txt, which ckpt did not write"):
        reshard(SRC, out, dp=3, overwrite=True)
    assert os.listdir(out) == ["keep.txt"]
    (out / "keep.txt").unlink()
    reshard(SRC, out, dp=3, overwrite=True)
    reshard(SRC, out, dp=3, overwrite=True)  # its own output, `latest` and global_step* included: replaced
    assert (out / "latest").is_file() and (out / MANIFEST).is_file()


def test_ds_to_universal_replaces_only_its_own_conversion(tmp_path):
    from ckpttools.compat.ds_to_universal import convert_to_universal

    root = tmp_path / "ckpt"
    shutil.copytree(SRC, root)
    out = root / "global_step2_universal"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"notes.txt, which ckpt did not write"):
        convert_to_universal(root / "global_step2", out)
    (out / "notes.txt").unlink()
    convert_to_universal(root / "global_step2", out)  # empty: used
    first = tree_digest(out)
    convert_to_universal(root / "global_step2", out)  # its own earlier conversion: replaced
    assert tree_digest(out).keys() == first.keys()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no staging, no .partial latest_universal


def test_zero_to_fp32_never_replaces_a_file_it_did_not_write(tmp_path):
    from ckpttools.compat.zero_to_fp32 import _convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the user's own weights")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"model.safetensors, which ckpt did not write"):
        _convert(SRC, out, "5GB", True, None, False)
    (out / "model.safetensors").unlink()
    _convert(SRC, out, "5GB", True, None, False)
    _convert(SRC, out, "5GB", True, None, False)  # its own file from the first run: replaced
    assert sorted(os.listdir(out)) == [MANIFEST, "model.safetensors", "notes.txt"]
    assert set(read_manifest(out) or {}) == {"model.safetensors"}
    _convert(SRC, out, "5GB", False, None, False)  # another file beside it: the manifest lists both
    assert set(read_manifest(out) or {}) == {"model.safetensors", "pytorch_model.bin"}


def test_engine_save_replace_follows_the_same_rule(tmp_path):
    torch = pytest.importorskip("torch")
    from ckpttools import save_pretrained_from_engine

    model = torch.nn.Linear(4, 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match=r"keep.txt, which ckpt did not write"):
        save_pretrained_from_engine(model, out, if_exists="replace")
    assert os.listdir(out) == ["keep.txt"]
    save_pretrained_from_engine(model, out, if_exists="add")  # writes into it, as save_pretrained does
    assert sorted(os.listdir(out)) == [MANIFEST, "keep.txt", "model.safetensors"]
    assert set(read_manifest(out) or {}) == {"model.safetensors"}
    (out / "keep.txt").unlink()
    save_pretrained_from_engine(model, out, if_exists="replace")  # only ckpt's files left: replaced
    assert sorted(os.listdir(out)) == [MANIFEST, "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]

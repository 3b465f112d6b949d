"""`python -m ckpttools.ds_to_universal` against DeepSpeed's own ds_to_universal on the real fixtures.

DeepSpeed's `main(args)` runs in this process with one extract and one merge worker (no process pool), which is
what its command line does after parsing the arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, open_checkpoint, read_checkpoint
from ckpttools.compat.ds_to_universal import cli, convert_to_universal
from ckpttools.io.staging import MANIFEST

from .conftest import FIXTURES

os.environ.setdefault("DS_ACCELERATOR", "cpu")
dsu = pytest.importorskip("deepspeed.checkpoint.ds_to_universal")

CASES = ["z1_dp2_bf16", "z2_dp3_fp32", "z2_dp2_bf16", "z1_dp2_bf16_bf16opt", "z3_dp2_bf16", "z3_dp3_fp32",
         "trainer_z2_bf16", "trainer_z3_gather_bf16"]  # fmt: skip


def _root(name: str) -> Path:
    out = FIXTURES / name / "out"
    return max(out.glob("checkpoint-*")) if out.exists() else FIXTURES / name / "checkpoint"


def _tag_dir(name: str) -> Path:
    root = _root(name)
    return root / (root / "latest").read_text().strip()


def _deepspeed(tag_dir: Path, out: Path) -> None:
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # fmt: skip
    dsu.main(args)


def _files(folder: Path) -> list[str]:
    """Every file but the manifest ckpt writes into its outputs (.ckpt-manifest.json: what --overwrite may replace)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _load(path: Path):
    return torch.load(path, weights_only=False)


def _same_value(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", CASES)
def test_same_files_and_tensors_as_ds_to_universal(name, tmp_path, capsys):
    tag = _tag_dir(name)
    _deepspeed(tag, tmp_path / "ds" / "universal_tag")
    capsys.readouterr()
    assert cli(["--input_folder", str(tag), "--output_folder", str(tmp_path / "ours" / "universal_tag")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "load_universal" in err  # one note: how to load it; nothing about options
    # the same file set: latest_universal in the parent of --output_folder, the tag folder at --output_folder
    assert _files(tmp_path / "ours") == _files(tmp_path / "ds")
    for side in ("ours", "ds"):
        assert (tmp_path / side / "latest_universal").read_text() == "universal_tag"
    zero3 = read_checkpoint(tag).zero_stage == 3
    ours_dir, ds_dir = tmp_path / "ours" / "universal_tag", tmp_path / "ds" / "universal_tag"
    for rel in _files(ds_dir):
        if not rel.startswith("zero/") or rel == "zero/optimizer_state.pt":
            continue
        a, b = _load(ours_dir / rel), _load(ds_dir / rel)
        if rel.endswith("/step.pt"):
            assert _same_value(a, b), rel
            continue
        if isinstance(b, dict) and "cat_dim" not in b:  # a module entry without optimizer state: {param: .float()}
            assert list(a) == list(b) == ["param"] and _same_value(a["param"], b["param"]), rel
            continue
        ta, tb = a["param"], (b["param"] if isinstance(b, dict) else b)
        assert ta.dtype == tb.dtype and torch.equal(ta.flatten(), tb.flatten()), rel
        if not zero3:  # ZeRO-1/2: the same container, shape and cat_dim; ZeRO-3: DeepSpeed writes bare flat tensors
            assert ta.shape == tb.shape and a["cat_dim"] == b["cat_dim"] == 0, rel
    a, b = _load(ours_dir / "zero/optimizer_state.pt"), _load(ds_dir / "zero/optimizer_state.pt")
    assert a["param_groups"] == b["param_groups"]
    if zero3:  # DeepSpeed's keeps rank 0's shards too; the step DeepSpeed's loader reads is the same
        assert set(a) <= set(b)
        assert _same_value(a["optimizer_state_dict"]["state"][0]["step"], b["optimizer_state_dict"]["state"][0]["step"])
    else:
        assert set(a) == set(b)
    for rel in _files(ds_dir):
        if rel.endswith("_model_states.pt"):
            a, b = _load(ours_dir / rel), _load(ds_dir / rel)
            assert set(a) == set(b) and list(a["module"]) == list(b["module"])
            assert all(_same_value(a["module"][k], b["module"][k]) for k in b["module"])


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp3_fp32", "trainer_z3_nogather_bf16"])
def test_loads_back_with_open_checkpoint(name, tmp_path, capsys):
    out = tmp_path / "u" / "global_step_universal"
    convert_to_universal(_tag_dir(name), out)
    consolidate(_root(name), tmp_path / "native")
    for path in (out, out.parent):  # the tag folder, or the folder holding latest_universal
        ckpt = open_checkpoint(path)
        assert ckpt.source_format == "universal"
        consolidate(path, tmp_path / f"from-{path.name}")
        got = load_file(tmp_path / f"from-{path.name}" / "model.safetensors")
        want = load_file(tmp_path / "native" / "model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want)
        # a Trainer folder's config.json stays beside the native tag (DeepSpeed's layout moves nothing else), so
        # the universal folder is a bare checkpoint and keeps the tied alias as its own tensor
        assert set(got) - set(want) <= set(ckpt.shared_params)


def test_canonical_layout_beside_the_input(tmp_path, capsys):
    """The usual call: output beside the tag folder; latest_universal lands in the checkpoint folder."""
    root = tmp_path / "ckpt"
    shutil.copytree(_root("z2_dp2_bf16"), root)
    assert (
        cli(["--input_folder", str(root / "global_step2"), "--output_folder", str(root / "global_step2_universal/")])
        == 0
    )
    assert (root / "latest_universal").read_text() == "global_step2_universal"  # trailing slash ignored
    assert (root / "latest").read_text().strip() == "global_step2"
    assert open_checkpoint(root).location.tag == "global_step2_universal"
    assert read_checkpoint(root).location.tag == "global_step2"  # the native checkpoint is untouched
    # running it again replaces the previous conversion
    assert (
        cli(["--input_folder", str(root / "global_step2"), "--output_folder", str(root / "global_step2_universal")])
        == 0
    )
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_obsolete_options_are_accepted_and_noted_once(tmp_path, capsys):
    args = ["--input_folder", str(_tag_dir("z2_dp2_bf16")), "--output_folder", str(tmp_path / "u" / "t"),
            "--num_extract_workers", "4", "--num_merge_workers", "2", "--keep_temp_folder", "--no_strict",
            "--inject_missing_state"]  # fmt: skip
    assert cli(args) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "no effect" in line]
    assert len(notes) == 1
    for flag in ("--num_extract_workers", "--num_merge_workers", "--keep_temp_folder", "--no_strict",
                 "--inject_missing_state"):  # fmt: skip
        assert flag in notes[0]
    assert not (tmp_path / "u" / "t" / "tmp").exists()


@pytest.mark.parametrize("name,error", [("z2_dp2_bf16_sgd", "exp_avg"), ("z3_dp2_bf16_sgd", "exp_avg"),
                                        ("z3_dp2_bf16_step0", "0"), ("z3_dp2_bf16_adagrad", "exp_avg")])  # fmt: skip
def test_converts_where_ds_to_universal_crashes(name, error, tmp_path, capsys):
    with pytest.raises(KeyError, match=error):
        _deepspeed(_tag_dir(name), tmp_path / "ds" / "t")
    convert_to_universal(_tag_dir(name), tmp_path / "ours" / "t")
    native, universal = read_checkpoint(_root(name)), open_checkpoint(tmp_path / "ours")
    assert universal.state_keys == native.state_keys
    consolidate(_root(name), tmp_path / "a")
    consolidate(tmp_path / "ours", tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line(tmp_path, capsys):
    tag = _tag_dir("z2_dp2_bf16")
    assert cli(["--input_folder", str(tmp_path / "missing"), "--output_folder", str(tmp_path / "o")]) == 1
    assert "does not exist" in _one_error_line(capsys.readouterr().err)
    assert cli(["--input_folder", str(tag), "--output_folder", str(tag)]) == 1
    assert "inside the input" in _one_error_line(capsys.readouterr().err)
    assert cli(["--input_folder", str(tag), "--output_folder", str(tag.parent.parent)]) == 1
    assert "contains the input" in _one_error_line(capsys.readouterr().err)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert cli(["--input_folder", str(tag), "--output_folder", str(busy)]) == 1
    assert "not a universal checkpoint folder" in _one_error_line(capsys.readouterr().err)
    assert (busy / "notes.txt").read_text() == "mine" and not (tmp_path / "latest_universal").exists()
    assert cli(["--input_folder", str(_tag_dir("z2_dp2_bf16_elastic")), "--output_folder", str(tmp_path / "e")]) == 1
    assert "elastic" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        cli(["--input_folder", str(tag)])
    assert e.value.code == 2
    assert "--output_folder" in _one_error_line(capsys.readouterr().err)

"""`python -m ckpttools.zero_to_torch` against DeepSpeed 0.19.8's own zero_to_torch on the real fixtures.

DeepSpeed's `convert_zero_checkpoint_to_state_dict` (what its zero_to_torch.py command calls after parsing the same
arguments) runs in this process; one slow test runs both command lines as subprocesses. The files must be the same:
names, keys in order, dtypes, torch.equal values, the tie as one storage, the shard index byte for byte, except for
the buffers a bf16/fp16 run kept in fp32 (`Checkpoint.kept_fp32`), which stay fp32 in ours.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttools.compat import zero_to_torch as ours
from ckpttools.compat.zero_to_torch import cli
from ckpttools.io.staging import MANIFEST
from ckpttools.layouts.registry import open_checkpoint

from .conftest import FIXTURES, fixture_meta, fixture_names

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds = pytest.importorskip("deepspeed.utils.zero_to_fp32")

KEEP_FP32 = ["keep_fp32_z1_bf16", "keep_fp32_z2_bf16", "keep_fp32_z3_bf16"]
ALL = [*fixture_names(), *(n for n in KEEP_FP32 if n not in fixture_names())]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# DeepSpeed's script fails on these (the errors it gives are checked below)
DS_FAILS = {
    "z1_dp2_bf16_bf16opt": "is not a zero checkpoint",
    "pp2_dp1_z1_bf16": "'NoneType' object has no attribute 'items'",
    "pp2_dp2_z1_bf16": "'NoneType' object has no attribute 'items'",
    "pp2_dp2_z0_bf16": "'NoneType' object has no attribute 'items'",
    "moe_ep2_dp2_z2_bf16": "is not a model state checkpoint",
    "moe_ep2_dp4_z2_bf16": "is not a model state checkpoint",
    "moe_ep2_dp2_z1_bf16": "is not a model state checkpoint",
    "moe_ep2_dp4_z2_bf16_dbe": "is not a model state checkpoint",
    "autotp_tp2_dp2_z1_bf16": "Expected 2 of '\\*_optim_states.pt'",
    "autotp_tp2_dp2_z2_bf16": "Expected 2 of '\\*_optim_states.pt'",
    "autotp_trainer_tp2_dp2_z1_bf16": "Expected 2 of '\\*_optim_states.pt'",
    "accelerate_autotp_tp2_dp2_z1_bf16": "Expected 2 of '\\*_optim_states.pt'",
    "z0_dp2_bf16": "'NoneType' object is not iterable",
    "z0_dp2_bf16_client": "'NoneType' object is not iterable",
    "z0_dp2_fp32": "'NoneType' object is not iterable",
    "z0_dp2_fp32_client": "'NoneType' object is not iterable",
}
SUPPORTED = [n for n in ALL if n not in DS_FAILS]


def _src(name: str) -> Path:
    """The folder DeepSpeed's script is given: the one holding `latest` (a Trainer's checkpoint-N)."""
    out = FIXTURES / name / "out"
    if out.exists():
        return max(out.glob("checkpoint-*"))
    saved = fixture_meta(name).get("checkpoint")
    return FIXTURES / name / (saved if isinstance(saved, str) else "checkpoint")


def _deepspeed(name: str, out: Path, **kwargs) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds.convert_zero_checkpoint_to_state_dict(str(_src(name)), str(out), **kwargs)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's .bin (in file order) or .safetensors files."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".bin":
            state.update(torch.load(path, weights_only=True))
        elif path.suffix == ".safetensors":
            state.update(load_file(path))
    return state


def _kept(name: str) -> list[str]:
    return open_checkpoint(_src(name)).kept_fp32


def _assert_deepspeeds_but_kept(got: dict, theirs: dict, kept: list[str], dtype: torch.dtype) -> None:
    """DeepSpeed's tensors, except that the kept buffers are fp32 (and cast to `dtype` give DeepSpeed's)."""
    assert list(got) == list(theirs)
    for key, tensor in theirs.items():
        if key in kept and dtype != torch.float32:
            assert got[key].dtype == torch.float32, key
            assert torch.equal(got[key].to(dtype), tensor), key
        else:
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("name", SUPPORTED)
def test_bf16_files_equal_deepspeeds(name, tmp_path, capsys):
    _deepspeed(name, tmp_path / "ds", dtype="bf16")
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--dtype", "bf16"]) == 0
    assert _files(tmp_path / "ours") == _files(tmp_path / "ds") == ["pytorch_model.bin"]
    kept = _kept(name)
    _assert_deepspeeds_but_kept(_tensors(tmp_path / "ours"), _tensors(tmp_path / "ds"), kept, torch.bfloat16)
    err = capsys.readouterr().err
    assert ("stay fp32" in err) == bool(kept)


@pytest.mark.parametrize("dtype", ["fp16", "float32", "torch.bfloat16"])
@pytest.mark.parametrize(
    "name", ["z1_dp2_bf16", "z2_dp3_fp32", "z3_dp3_bf16", "keep_fp32_z3_bf16", "gpu/gpu_z2_dp1_fp16"]
)
def test_other_dtypes_equal_deepspeeds(name, dtype, tmp_path):
    """DeepSpeed's dtype names, torch's casts (fp32 masters and bf16 frozen params to fp16, ...)."""
    _deepspeed(name, tmp_path / "ds", dtype=dtype)
    ours.convert_zero_checkpoint_to_state_dict(_src(name), tmp_path / "ours", dtype=dtype)
    want = ds._resolve_output_dtype(dtype)
    _assert_deepspeeds_but_kept(_tensors(tmp_path / "ours"), _tensors(tmp_path / "ds"), _kept(name), want)


def test_keep_in_fp32_buffer_is_the_engines(tmp_path):
    """The routing bias stays the engine's fp32 values (its 16-bit save); DeepSpeed's bf16 leaves 2 of 16 values."""
    name = "keep_fp32_z2_bf16"
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--dtype", "bf16", "--safe_serialization"]) == 0
    got = load_file(tmp_path / "ours" / "model.safetensors")
    engine = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    assert sorted(got) == sorted(engine)
    assert all(got[k].dtype == engine[k].dtype and torch.equal(got[k], engine[k]) for k in engine)
    theirs = load_file(FIXTURES / name / "reference" / "zero_to_torch_bf16.safetensors")  # the script, as a command
    assert theirs["router.e_score_correction_bias"].unique().numel() == 2
    assert got["router.e_score_correction_bias"].unique().numel() == 16


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp3_bf16", "z1_dp2_fp32", "keep_fp32_z3_bf16"])
def test_sharded_files_and_index(name, tmp_path, capsys):
    """The shard plan is DeepSpeed's over the output sizes: with nothing kept, the index byte for byte."""
    _deepspeed(name, tmp_path / "ds", dtype="bf16", max_shard_size="0.3KB")
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--dtype", "bf16", "--max_shard_size", "0.3KB"]) == 0
    names = _files(tmp_path / "ds")
    assert _files(tmp_path / "ours") == names and len(names) > 2
    index = "pytorch_model.bin.index.json"
    kept = _kept(name)
    ours_index, ds_index = (json.loads((tmp_path / d / index).read_text()) for d in ("ours", "ds"))
    assert ours_index["weight_map"] == ds_index["weight_map"]
    if not kept:
        assert (tmp_path / "ours" / index).read_bytes() == (tmp_path / "ds" / index).read_bytes()
    for fname in names:
        if fname.endswith(".bin"):
            a = torch.load(tmp_path / "ours" / fname, weights_only=True)
            b = torch.load(tmp_path / "ds" / fname, weights_only=True)
            _assert_deepspeeds_but_kept(a, b, kept, torch.bfloat16)
            for k in b:  # a tie is one storage in DeepSpeed's file, and in ours
                for j in b:
                    same = b[k].untyped_storage().data_ptr() == b[j].untyped_storage().data_ptr()
                    assert same == (a[k].untyped_storage().data_ptr() == a[j].untyped_storage().data_ptr()), (k, j)


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp3_bf16"])
def test_safe_serialization_works_where_deepspeed_raises(name, tmp_path, capsys):
    """Tied models: DeepSpeed's save_file refuses the shared tensors; ours stores each tied name as a copy."""
    with pytest.raises(RuntimeError, match="share memory"):
        _deepspeed(name, tmp_path / "dsst", dtype="bf16", safe_serialization=True)
    _deepspeed(name, tmp_path / "ds", dtype="bf16")
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--dtype", "bf16", "--safe_serialization"]) == 0
    assert "stored as their own copies" in capsys.readouterr().err
    assert _files(tmp_path / "ours") == ["model.safetensors"]
    got, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "ds")
    assert set(got) == set(theirs)
    _assert_deepspeeds_but_kept({k: got[k] for k in theirs}, theirs, _kept(name), torch.bfloat16)
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("name", sorted(DS_FAILS))
def test_layouts_deepspeeds_script_refuses_give_the_whole_model(name, tmp_path, capsys):
    """Where DeepSpeed's script fails, ours writes what `ckpt consolidate` writes, in the requested dtype (less the
    frozen params of a ZeRO-1 run, which zero_to_torch's format leaves out)."""
    from ckpttools.ops.consolidate import consolidate

    with pytest.raises(Exception, match=DS_FAILS[name]):
        _deepspeed(name, tmp_path / "ds", dtype="bf16")
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--dtype", "bf16", "--safe_serialization"]) == 0
    consolidate(_src(name), tmp_path / "ckpt")  # fp32
    got, want = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "ckpt" / "model.safetensors")
    ckpt = open_checkpoint(_src(name))
    kept = ckpt.kept_fp32
    dropped = ours._dropped_frozen(ckpt, False) if ckpt.layout.kind == "dp" else []  # ZeRO-1: no frozen_param_shapes
    assert sorted(got) == sorted(k for k in want if k not in dropped)
    for key, tensor in want.items():
        if key in dropped:
            continue
        dtype = tensor.dtype if not tensor.is_floating_point() or key in kept else torch.bfloat16
        assert got[key].dtype == dtype and torch.equal(got[key], tensor.to(dtype)), key


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line(tmp_path, capsys):
    src = str(_src("z2_dp2_bf16"))
    assert cli([str(tmp_path / "missing"), str(tmp_path / "out"), "--dtype", "bf16"]) == 1
    assert "does not exist" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:  # --dtype is required, as in DeepSpeed's
        cli([src, str(tmp_path / "o")])
    assert e.value.code == 2 and "--dtype" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        cli([src, str(tmp_path / "o"), "--dtype", "int8"])
    assert e.value.code == 2 and "int8" in _one_error_line(capsys.readouterr().err)
    assert cli([src, str(tmp_path / "o"), "--dtype", "bf16", "--max_shard_size", "12"]) == 2
    assert "--max_shard_size" in _one_error_line(capsys.readouterr().err)
    assert cli([src, str(tmp_path / "o"), "--dtype", "bf16", "--tag", "global_step9"]) == 2  # a usage error
    assert "global_step9" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(ours.UsageError, match="Choose one of: bf16, bfloat16"):
        ours.convert_zero_checkpoint_to_state_dict(src, tmp_path / "o", dtype=torch.int8)


def test_help_names_the_difference(capsys):
    with pytest.raises(SystemExit):
        cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "keep_in_fp32" in text and "stay fp32" in text
    assert "{bf16,bfloat16,float16,float32,fp16,fp32}" in text


@pytest.mark.slow
def test_command_lines_side_by_side(tmp_path):
    """Both scripts as real subprocesses, the same arguments: the same files."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CI": "1"}
    src = str(_src("z2_dp2_bf16"))
    for module, out in (("deepspeed.utils.zero_to_torch", "ds"), ("ckpttools.zero_to_torch", "ours")):
        subprocess.run([sys.executable, "-m", module, src, str(tmp_path / out), "--dtype", "fp16",
                        "--max_shard_size", "1KB", "--exclude_frozen_parameters"],
                       check=True, capture_output=True, env=env)  # fmt: skip
    assert _files(tmp_path / "ours") == _files(tmp_path / "ds")
    got, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "ds")
    _assert_deepspeeds_but_kept(got, theirs, ["scale"], torch.float16)

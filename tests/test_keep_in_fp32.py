"""DeepSpeed 0.19.8's keep_in_fp32: buffers a bf16 run kept in fp32 stay fp32 in ckpt's 16-bit output.

The fixtures (fixtures/build/fixture_keep_fp32.py) are real 2-rank bf16 runs (ZeRO-1, 2, 3) of a model whose
`_keep_in_fp32_modules_strict` names the MoE routing bias `router.e_score_correction_bias` (a buffer) and the
parameter `router.expert_scale` (DeepSpeed keeps only buffers); the ordinary buffer `scale` is fp32 at ZeRO-1 (the
engine casts no buffer by default) and bf16 at ZeRO-2 (`data_types.buffer_dtype`) and ZeRO-3 (zero.Init).
The checkpoint records no list: the bias is simply stored as fp32 in the module state dict. References are the
engine's own 16-bit state dict (what save_16bit_model writes) and DeepSpeed's zero_to_torch --dtype bf16 output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops.consolidate import consolidate
from ckpttools.ops.reshard import reshard

from .conftest import FIXTURES

os.environ.setdefault("DS_ACCELERATOR", "cpu")

NAMES = ["keep_fp32_z1_bf16", "keep_fp32_z2_bf16", "keep_fp32_z3_bf16"]
KEPT = "router.e_score_correction_bias"


def _ref(name: str, ref: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "reference" / f"{ref}.safetensors"))


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


def _consolidated(src: Path, out: Path, dtype: str) -> dict[str, torch.Tensor]:
    consolidate(src, out, dtype=dtype)
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("name", NAMES)
def test_fixture_holds_what_deepspeed_does(name):
    """What the engine did (meta.json, from the live engine) and what the files say (the checkpoint model)."""
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    assert meta["ds_version"] == "0.19.8"
    scale = "float32" if name == "keep_fp32_z1_bf16" else "bfloat16"  # z2: buffer_dtype bf16, z3: zero.Init
    assert meta["engine_buffer_dtypes"] == {"scale": scale, "counts": "int64", KEPT: "float32"}
    assert meta["engine_param_dtypes"]["router.expert_scale"] == "bfloat16"  # named by the list, but a parameter
    for facts in meta["stored"].values():  # no key records the list; only the stored dtype does
        assert facts["module_dtypes"][KEPT] == "float32" and facts["keys_mentioning_fp32"] == []
    ckpt = open_checkpoint(FIXTURES / name / "checkpoint")
    assert ckpt.kept_fp32 == ([KEPT] if scale == "bfloat16" else ["scale", KEPT])
    assert ckpt.buffers["scale"].dtype.name == scale


def test_fp32_runs_keep_nothing():
    assert open_checkpoint(FIXTURES / "z2_dp2_fp32" / "checkpoint").kept_fp32 == []
    assert open_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint").kept_fp32 == ["scale"]  # no buffer_dtype


@pytest.mark.parametrize("name", NAMES)
def test_bf16_output_equals_the_engines_16bit_save(name, tmp_path):
    got = _consolidated(FIXTURES / name / "checkpoint", tmp_path / "out", "bf16")
    _assert_identical(got, _ref(name, "bit16"))
    assert got[KEPT].dtype == torch.float32 and got["router.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
def test_deepspeeds_zero_to_torch_collapses_the_routing_bias(name, tmp_path):
    """The bug ckpt avoids: zero_to_torch's bf16 bias holds 2 distinct values of the engine's 16."""
    theirs, engine = _ref(name, "zero_to_torch_bf16"), _ref(name, "bit16")
    assert theirs[KEPT].dtype == torch.bfloat16
    assert engine[KEPT].unique().numel() == 16 and theirs[KEPT].unique().numel() == 2
    got = _consolidated(FIXTURES / name / "checkpoint", tmp_path / "out", "bf16")
    kept = open_checkpoint(FIXTURES / name / "checkpoint").kept_fp32
    for key in theirs:  # everything else is DeepSpeed's zero_to_torch bit for bit
        if key not in kept:
            assert got[key].dtype == theirs[key].dtype and torch.equal(got[key], theirs[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_fp16_and_fp32_output(name, tmp_path):
    fp16 = _consolidated(FIXTURES / name / "checkpoint", tmp_path / "fp16", "fp16")
    assert fp16[KEPT].dtype == torch.float32 and torch.equal(fp16[KEPT], _ref(name, "bit16")[KEPT])
    assert fp16["router.weight"].dtype == torch.float16
    assert fp16["scale"].dtype == (torch.float32 if name == "keep_fp32_z1_bf16" else torch.float16)
    fp32 = _consolidated(FIXTURES / name / "checkpoint", tmp_path / "fp32", "fp32")
    _assert_identical(fp32, _ref(name, "zero_to_fp32"))


@pytest.mark.parametrize("how", [{"dp": 1}, {"universal": True}], ids=["dp1", "universal"])
@pytest.mark.parametrize("name", NAMES)
def test_reshard_keeps_the_fp32_buffer(name, how, tmp_path):
    reshard(FIXTURES / name / "checkpoint", tmp_path / "resharded", **how)
    got = _consolidated(tmp_path / "resharded", tmp_path / "out", "bf16")
    _assert_identical(got, _ref(name, "bit16"))


def test_consolidate_help_says_so():
    from click.testing import CliRunner

    from ckpttools.cli import main

    result = CliRunner().invoke(main, ["consolidate", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "keep_in_fp32" in result.output and "save_16bit_model" in result.output

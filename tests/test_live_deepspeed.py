"""Regenerate a few fixtures with the installed DeepSpeed and check ckpt still agrees with it.

This catches a DeepSpeed upgrade that changes the on-disk format or zero_to_fp32's output.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _make_fixtures():
    pytest.importorskip("deepspeed")
    from fixtures.build import make_fixtures

    return make_fixtures


@pytest.mark.parametrize("name", ["z2_dp3_bf16", "z3_dp2_fp32", "trainer_z3_nogather_bf16"])
def test_live_fixture_consolidates_bit_identically(name, tmp_path):
    fixture = _make_fixtures().make_fixture(name, tmp_path / "fx")
    src = fixture / ("out" if (fixture / "out").exists() else "checkpoint")
    consolidate(src, tmp_path / "fp32")
    ours = load_file(tmp_path / "fp32" / "model.safetensors")
    ref = load_file(fixture / "reference" / "zero_to_fp32.safetensors")
    tied = set(ref) - set(ours)
    assert tied <= {"lm_head.weight"}
    for key in ours:
        expected = ref[key].float() if ref[key].is_floating_point() else ref[key]
        assert torch.equal(ours[key], expected), key

    dtype = "fp32" if name.endswith("fp32") else "bf16"
    consolidate(src, tmp_path / "b16", dtype=dtype)
    ours = load_file(tmp_path / "b16" / "model.safetensors")
    ref = load_file(fixture / "reference" / "bit16.safetensors")
    for key in ours:
        assert torch.equal(ours[key], ref[key]), key

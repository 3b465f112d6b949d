"""Universal checkpoints read into the same model as native ones: consolidating one is bit-identical to
consolidating the native checkpoint it came from (ours and DeepSpeed's ds_to_universal output), and a damaged
or incomplete universal folder is refused by name."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, inspect_checkpoint, open_checkpoint, read_checkpoint
from ckpttools.errors import CkptError
from ckpttools.ops.reshard import reshard

from .conftest import FIXTURES, tree_digest
from .test_reshard import _ds_to_universal, _src

NATIVE = ["z1_dp2_bf16", "z2_dp3_fp32", "z3_dp2_bf16", "z3_dp3_fp32", "z2_dp2_bf16_sgd", "z3_dp2_bf16_adagrad",
          "z2_dp2_bf16_step0", "z3_dp2_bf16_step0"]  # fmt: skip


def _tensors(folder):
    return load_file(folder / "model.safetensors")


def _equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidating_our_universal_output_equals_the_native_consolidation(name, dtype, tmp_path):
    src = FIXTURES / name / "checkpoint"
    reshard(src, tmp_path / "u", universal=True)
    consolidate(src, tmp_path / "native", dtype=dtype)
    before = tree_digest(tmp_path / "u")
    for path in (tmp_path / "u", next(p for p in (tmp_path / "u").iterdir() if p.is_dir())):  # root and tag folder
        out = tmp_path / f"from-{path.name}"
        consolidate(path, out, dtype=dtype)
        _equal(_tensors(out), _tensors(tmp_path / "native"))
    assert tree_digest(tmp_path / "u") == before


@pytest.mark.parametrize("name", ["z2_dp2_fp32", "z3_dp3_bf16"])
def test_consolidating_ds_to_universal_output_equals_the_native_consolidation(name, tmp_path):
    pytest.importorskip("deepspeed")
    src = _src(name)
    _ds_to_universal(src, tmp_path / "ds")
    consolidate(src, tmp_path / "native")
    consolidate(tmp_path / "ds" / "global_step2", tmp_path / "from-ds")
    _equal(_tensors(tmp_path / "from-ds"), _tensors(tmp_path / "native"))


def test_the_universal_model_carries_every_state_under_its_own_key(tmp_path):
    src = FIXTURES / "z3_dp2_bf16_sgd" / "checkpoint"
    reshard(src, tmp_path / "u", universal=True)
    native, universal = read_checkpoint(src), open_checkpoint(tmp_path / "u")
    assert universal.source_format == "universal" and native.state_keys == universal.state_keys == ["momentum_buffer"]
    assert [p.name for p in native.params] == [p.name for p in universal.params]
    info = inspect_checkpoint(tmp_path / "u")
    assert info["format"] == "universal" and info["optimizer_states"] == ["momentum_buffer"]


def _universal_copy(tmp_path, name="z2_dp2_bf16"):
    reshard(FIXTURES / name / "checkpoint", tmp_path / "u", universal=True)
    return tmp_path / "u", tmp_path / "u" / "global_step2" / "zero"


def _refused(path, tmp_path, match):
    before = tree_digest(path)
    with pytest.raises(CkptError, match=match):
        consolidate(path, tmp_path / "out")
    with pytest.raises(CkptError, match=match):
        reshard(path, tmp_path / "out2", dp=3)
    assert tree_digest(path) == before and not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_a_missing_state_file_is_named(tmp_path):
    root, zero = _universal_copy(tmp_path)
    (zero / "fc1.weight" / "exp_avg_sq.pt").unlink()
    _refused(root, tmp_path, "lacks .*fc1.weight/exp_avg_sq.pt")


def test_a_missing_master_is_named(tmp_path):
    root, zero = _universal_copy(tmp_path)
    (zero / "fc1.weight" / "fp32.pt").unlink()
    _refused(root, tmp_path, "lacks .*fc1.weight/fp32.pt")


def test_swapped_state_files_betray_themselves(tmp_path):
    root, zero = _universal_copy(tmp_path)
    a, b = zero / "fc1.weight" / "exp_avg.pt", zero / "fc1.weight" / "exp_avg_sq.pt"
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    _refused(root, tmp_path, "holds the data of")


def test_a_state_of_another_parameter_is_refused(tmp_path):
    root, zero = _universal_copy(tmp_path)
    shutil.copy(zero / "fc1.bias" / "exp_avg.pt", zero / "fc1.weight" / "exp_avg.pt")
    _refused(root, tmp_path, "holds a state of|elements")


def test_steps_that_differ_between_parameters_are_refused(tmp_path):
    root, zero = _universal_copy(tmp_path)  # FusedAdam: the step is an int
    step = zero / "fc1.weight" / "step.pt"
    torch.save(torch.load(step, weights_only=True) + 1, step)
    _refused(root, tmp_path, "records step")

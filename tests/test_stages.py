"""layouts/zero/stages: files at another ZeRO stage hold what DeepSpeed's own files at that stage hold."""

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.io.torchfile import LazyTensor, RecordReader
from ckpttools.io.torchwriter import Fill, NewTensor
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.zero import stages

from .conftest import FIXTURES

pytest.importorskip("deepspeed")  # torch.load of DeepSpeed's files needs its classes

ZERO12_SHARDED = {"base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "param_slice_mappings",
                  "param_alignment_paddings", "partition_count"}  # fmt: skip
ZERO3_SHARDED = {"optimizer_state_dict", "fp32_flat_groups", "partition_count"}


def _ckpt(name):
    return read_checkpoint(FIXTURES / name / "checkpoint")


def _tag_dir(name):
    return next((FIXTURES / name / "checkpoint").glob("global_step*"))


def _load(name, pattern):
    return torch.load(next(_tag_dir(name).glob(pattern)), weights_only=False)


def _optim(name):
    return _load(name, "*zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _model(name):
    return _load(name, "*mp_rank_00_model_states.pt")


def _materialize(value, reader):
    """A NewTensor or LazyTensor as the torch tensor a writer would store."""
    if isinstance(value, LazyTensor):
        return value.load(reader)
    assert isinstance(value, NewTensor)
    dtype = value.dtype.to_torch()
    parts = [
        torch.zeros(p.count, dtype=dtype)
        if isinstance(p, Fill)
        else p.tensor.load(reader).reshape(-1)[p.start : p.start + p.count].to(dtype)
        for p in value.pieces
    ]
    return (torch.cat(parts) if parts else torch.empty(0, dtype=dtype)).view(value.view_shape())


def _shapes(groups):
    return [[(k, tuple(v)) for k, v in g.items()] for g in groups]


@pytest.mark.parametrize("src,dst", [("z2_dp2_bf16", "z3_dp2_bf16"), ("z1_dp2_fp32", "z3_dp2_fp32")])
def test_optimizer_common_at_zero3_has_the_entries_of_a_zero3_file(src, dst):
    common = stages.optimizer_common(_ckpt(src), 3)
    theirs = _optim(dst)["optimizer_state_dict"]
    assert set(common) | ZERO3_SHARDED == set(theirs)
    assert common["zero_stage"] == theirs["zero_stage"] == 3
    for key in ("dynamic_loss_scale", "overflow"):
        assert common[key] == theirs[key]


@pytest.mark.parametrize("src,dst,stage", [("z3_dp2_bf16", "z2_dp2_bf16", 2), ("z3_dp2_fp32", "z1_dp2_fp32", 1)])
def test_optimizer_common_from_zero3_has_the_entries_of_a_zero12_file(src, dst, stage):
    common = stages.optimizer_common(_ckpt(src), stage)
    theirs = _optim(dst)["optimizer_state_dict"]
    assert set(common) | ZERO12_SHARDED == set(theirs)
    assert common["zero_stage"] == theirs["zero_stage"] == stage
    assert common["clip_grad"] == theirs["clip_grad"]  # from the recorded ds_config's gradient_clipping
    assert common["ds_version"] == theirs["ds_version"]


def test_optimizer_common_between_zero1_and_zero2_changes_only_the_stage():
    ckpt = _ckpt("z1_dp2_bf16")
    common = stages.optimizer_common(ckpt, 2)
    theirs = _optim("z2_dp2_bf16")["optimizer_state_dict"]
    assert set(common) | ZERO12_SHARDED == set(theirs)
    assert common["zero_stage"] == 2
    assert {k: v for k, v in common.items() if k != "zero_stage"} == {
        k: v for k, v in ckpt.optimizer.common.items() if k not in ("param_groups", "zero_stage")
    }


def test_file_meta_at_sets_the_stage_and_keeps_the_rest():
    ckpt = _ckpt("z2_dp2_bf16")
    before = copy.deepcopy(ckpt.optimizer.file_meta)
    meta = stages.file_meta_at(ckpt, 3)
    assert ckpt.optimizer.file_meta == before  # the checkpoint read is not changed
    assert meta["ds_config"]["zero_optimization"]["stage"] == 3
    assert set(meta) == set(before)
    assert {k: v for k, v in meta["ds_config"].items() if k != "zero_optimization"} == {
        k: v for k, v in before["ds_config"].items() if k != "zero_optimization"
    }
    assert meta["ds_version"] == before["ds_version"]


def test_ds_config_at_passes_non_dicts_and_adds_a_missing_zero_section():
    assert stages.ds_config_at(None, 3) is None
    assert stages.ds_config_at("cfg.json", 1) == "cfg.json"
    assert stages.ds_config_at({"train_batch_size": 4}, 2) == {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    assert stages.ds_config_at({"zero_optimization": None}, 1) == {"zero_optimization": {"stage": 1}}
    zero = {"stage": 3, "sub_group_size": 64}
    assert stages.ds_config_at({"zero_optimization": zero}, 1) == {
        "zero_optimization": {"stage": 1, "sub_group_size": 64}
    }
    assert zero == {"stage": 3, "sub_group_size": 64}


@pytest.mark.parametrize("stage,theirs", [(2, "z2_dp2_bf16"), (1, "z1_dp2_bf16")])
def test_zero12_model_state_from_zero3_is_laid_out_as_deepspeeds(stage, theirs):
    ckpt = _ckpt("z3_dp2_bf16")
    ours = stages.zero12_model_state(ckpt, stage, 4)
    ref = _model(theirs)
    assert set(ours) == set(ref)
    assert ours["dp_world_size"] == 4
    assert ours["ds_config"]["zero_optimization"]["stage"] == stage
    assert _shapes(ours["param_shapes"]) == _shapes(ref["param_shapes"])
    assert ours["shared_params"] == ref["shared_params"]
    if stage == 1:
        assert ours["frozen_param_shapes"] is None and ours["frozen_param_fragments"] is None
    else:
        assert [(k, tuple(v)) for k, v in ours["frozen_param_shapes"].items()] == [
            (k, tuple(v)) for k, v in ref["frozen_param_shapes"].items()
        ]
        assert list(ours["frozen_param_fragments"]) == list(ref["frozen_param_fragments"])
    assert list(ours["module"]) == list(ref["module"])
    with RecordReader() as reader:
        for key, value in ours["module"].items():
            t = _materialize(value, reader)
            assert (tuple(t.shape), t.dtype) == (tuple(ref["module"][key].shape), ref["module"][key].dtype), key


def test_zero12_model_state_from_zero3_holds_the_engines_16bit_weights():
    """The 16-bit weights are the fp32 masters cast to bf16: DeepSpeed's own consolidated 16-bit state dict."""
    ckpt = _ckpt("z3_dp2_bf16")
    ours = stages.zero12_model_state(ckpt, 2, 2)["module"]
    bit16 = load_file(FIXTURES / "z3_dp2_bf16" / "reference" / "bit16.safetensors")
    with RecordReader() as reader:
        for key, ref in bit16.items():
            got = _materialize(ours[key], reader)
            assert got.dtype == ref.dtype and torch.equal(got, ref), key
    assert ours["head.weight"] is ours["emb.weight"]  # a tied alias shares its owner's tensor, as in a state_dict


def test_zero12_model_state_between_zero1_and_zero2_keeps_the_module():
    ckpt = _ckpt("z2_dp2_bf16")
    ours = stages.zero12_model_state(ckpt, 1, 2)
    assert all(ours["module"][k] is v for k, v in ckpt.model_state["module"].items())
    assert set(ours) == set(_model("z1_dp2_bf16"))
    assert ours["frozen_param_shapes"] is None


def test_zero3_module_has_deepspeeds_placeholders():
    ckpt = _ckpt("z2_dp2_bf16")
    module, frozen_shapes = stages.zero3_module(ckpt)
    ref = _model("z3_dp2_bf16")
    assert list(module) == list(ref["module"])
    with RecordReader() as reader:
        for key, value in module.items():
            t = _materialize(value, reader)
            assert (tuple(t.shape), t.dtype) == (tuple(ref["module"][key].shape), ref["module"][key].dtype), key
        for key in ("scale", "counts"):  # buffers stay whole, with their values
            assert torch.equal(_materialize(module[key], reader), ref["module"][key])
    assert module["head.weight"] is module["emb.weight"]
    assert [(k, tuple(v)) for k, v in frozen_shapes.items()] == [
        (k, tuple(v)) for k, v in ref["frozen_param_shapes"].items()
    ]


def test_zero3_module_of_a_zero3_checkpoint_is_its_own():
    ckpt = _ckpt("z3_dp2_bf16")
    module, _ = stages.zero3_module(ckpt)
    assert all(module[k] is v for k, v in ckpt.model_state["module"].items())


def test_check_stage_change_refuses_what_cannot_be_carried_over():
    stages.check_stage_change(_ckpt("z2_dp2_bf16"), 3)
    stages.check_stage_change(_ckpt("z3_dp2_bf16"), 1)
    with pytest.raises(UnsupportedCheckpointError, match="BF16_Optimizer"):
        stages.check_stage_change(_ckpt("z1_dp2_bf16_bf16opt"), 2)
    with pytest.raises(UnsupportedCheckpointError, match="elastic"):
        stages.check_stage_change(_ckpt("z2_dp2_bf16_elastic"), 3)


def test_check_stage_change_refuses_parameter_alignment_below_zero3():
    ckpt = _ckpt("z3_dp2_bf16")
    meta = ckpt.optimizer.file_meta
    zero = {**meta["ds_config"]["zero_optimization"], "parameter_alignment": 8}
    aligned = dataclasses.replace(
        ckpt,
        optimizer=dataclasses.replace(
            ckpt.optimizer, file_meta={**meta, "ds_config": {**meta["ds_config"], "zero_optimization": zero}}
        ),
    )
    stages.check_stage_change(aligned, 3)
    with pytest.raises(UnsupportedCheckpointError, match="parameter_alignment"):
        stages.check_stage_change(aligned, 2)

"""model/checkpoint: the neutral model read from DeepSpeed folders lists the tensors, states and counts DeepSpeed's
own references hold."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.model.checkpoint import Segment, TensorSource, shape_numel, slice_segments, strip_prefixes

from .conftest import FIXTURES

ENGINE = ["z1_dp2_bf16", "z2_dp3_fp32", "z3_dp2_bf16", "z3_dp4_fp32", "z1_dp2_bf16_bf16opt"]


def _read(name):
    return read_checkpoint(next((FIXTURES / name).rglob("latest")).parent)


def _meta(name):
    return json.loads((FIXTURES / name / "meta.json").read_text())


@pytest.mark.parametrize("name", ENGINE)
def test_every_source_is_made_of_exactly_its_elements(name):
    ckpt = _read(name)
    for src in ckpt.sources(dtypes.FLOAT32) + [s for p in ckpt.params for s in p.states.values()]:
        assert src.numel() == shape_numel(src.shape) == sum(seg.count for seg in src.segments), src.name
        for seg in src.segments:
            assert seg.start >= 0 and seg.start + seg.count <= seg.tensor.numel()


@pytest.mark.parametrize("name", ENGINE[:-1])  # zero_to_fp32 cannot read BF16_Optimizer files
def test_fp32_sources_are_zero_to_fp32s_tensors_in_state_dict_order(name):
    ckpt = _read(name)
    meta = _meta(name)
    ref = load_file(FIXTURES / name / "reference" / "zero_to_fp32.safetensors")
    sources = ckpt.sources(dtypes.FLOAT32)
    assert [s.name for s in sources] == [k for k in meta["state_dict_keys"] if k not in meta["tied"]]
    with RecordReader() as reader:
        for src in sources:
            if src.name in ref:  # zero_to_fp32 leaves out the frozen params of fp32 runs
                assert torch.equal(read_tensor(src, reader), ref[src.name].to(src.dtype.to_torch())), src.name


@pytest.mark.parametrize("name", ["z1_dp2_bf16", "z2_dp2_bf16", "z3_dp2_bf16"])
def test_bf16_sources_are_the_engines_16bit_state_dict(name):
    """ZeRO-1/2 take the module copies the engine saved; ZeRO-3 the masters, cast as the engine casts them."""
    ckpt = _read(name)
    ref = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    with RecordReader() as reader:
        for src in ckpt.sources(dtypes.BFLOAT16):
            if src.kind == "trainable":
                assert (src.dtype == dtypes.BFLOAT16) == (ckpt.zero_stage != 3), src.name
            want = ref[src.name]
            got = read_tensor(src, reader, dtypes.BFLOAT16 if want.dtype == torch.bfloat16 else None)
            assert torch.equal(got, want), src.name


@pytest.mark.parametrize(
    "name,keys",
    [("z2_dp2_bf16", ["exp_avg", "exp_avg_sq"]), ("z2_dp2_bf16_sgd", ["momentum_buffer"]),
     ("z3_dp2_bf16_adagrad", ["sum"]), ("z1_dp2_bf16_step0", [])],
)  # fmt: skip
def test_state_keys_are_the_torch_optimizers_own(name, keys):
    ckpt = _read(name)
    assert ckpt.state_keys == keys
    assert all(list(p.states) == keys for p in ckpt.params)


@pytest.mark.parametrize("name", [*ENGINE, "trainer_z2_bf16"])
def test_names_and_counts_are_the_runs(name):
    ckpt = _read(name)
    meta = _meta(name)
    assert [p.name for p in ckpt.params] == [n for group in meta["param_groups"] for n in group]
    assert ckpt.frozen_names == meta.get("frozen", [])
    assert ckpt.shared_params == meta.get("tied", {})
    assert ckpt.masters == {p.name: p.fp32 for p in ckpt.params}
    assert ckpt.masters is ckpt.masters  # computed once
    shapes = meta["param_shapes"]
    counted = [k for k in meta["state_dict_keys"] if k in shapes and k not in meta.get("tied", {})]
    assert ckpt.param_count() == sum(shape_numel(shapes[k]) for k in counted)


def test_param_count_is_what_transformers_counts():
    transformers = pytest.importorskip("transformers")
    folder = FIXTURES / "trainer_z3_gather_bf16" / "out" / "checkpoint-2"
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert read_checkpoint(folder).param_count() == model.num_parameters()


def test_slice_segments_cuts_across_the_ranks_segments():
    ckpt = _read("z3_dp3_fp32")  # every ZeRO-3 param is spread over the 3 ranks' partitions
    src = next(p.fp32 for p in ckpt.params if len(p.fp32.segments) == 3)
    with RecordReader() as reader:
        whole = read_tensor(src, reader).reshape(-1)
        n = src.numel()
        for start, count in [(0, n), (0, 0), (1, n - 2), (src.segments[0].count - 1, 2), (n - 1, 1)]:
            part = TensorSource("p", (count,), src.dtype, tuple(slice_segments(src, start, count)), src.kind)
            assert all(isinstance(s, Segment) and s.count > 0 for s in part.segments)
            assert torch.equal(read_tensor(part, reader), whole[start : start + count]), (start, count)


@pytest.mark.parametrize(
    "raw,name",
    [("module.fc.weight", "fc.weight"), ("_orig_mod.module.fc.weight", "fc.weight"),
     ("module._orig_mod.fc.weight", "fc.weight"), ("_forward_module.module.fc.weight", "fc.weight"),
     ("fc.module.weight", "fc.module.weight"), ("modules.fc", "modules.fc"), ("module.", "")],
)  # fmt: skip
def test_strip_prefixes_drops_only_leading_wrappers(raw, name):
    assert strip_prefixes(raw) == name


def test_shape_numel():
    assert shape_numel(()) == 1 and shape_numel((0, 5)) == 0 and shape_numel((2, 3, 4)) == 24

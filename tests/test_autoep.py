"""DeepSpeed AutoEP (expert parallelism for transformers' MoE models) at ZeRO-2 and ZeRO-3: read with every expert
under its Hugging Face name (experts.gate_up_proj / experts.down_proj, the router as gate.weight), consolidated
bit-identical to the live engine's full weights, loaded by from_pretrained of the MoE model, broken folders
refused by name, reshard refused with the reason.

The fixtures (fixtures/build/fixture_autoep.py) were trained with transformers 5.15 (DeepSpeed 0.19.8's AutoEP
fails in deepspeed.initialize with 5.24); these tests need only the committed fixtures and the project's
transformers. The live rebuild test runs only where a transformers 5.15 folder is present (CKPT_AUTOEP_TRANSFORMERS,
default /work/tf515).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, read_checkpoint
from ckpttools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.autoep import expert_dp_ranks

from .conftest import FIXTURES, tree_digest

Z2 = "autoep_ep2_dp2_z2_bf16"
Z3 = "autoep_ep2_dp2_z3_bf16"
BOTH = [Z2, Z3]
TF515 = Path(os.environ.get("CKPT_AUTOEP_TRANSFORMERS", "/work/tf515"))
NO_TF515 = (f"no transformers 5.15 folder at {TF515}: AutoEP trains only with it (DeepSpeed 0.19.8 with the "
            "pinned transformers 5.24 fails in deepspeed.initialize)")  # fmt: skip


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


def _ref(name: str, which: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference" / which)


def _copy(tmp_path: Path, name: str) -> tuple[Path, Path]:
    shutil.copytree(FIXTURES / name / "checkpoint", tmp_path / "ckpt")
    return tmp_path / "ckpt", tmp_path / "ckpt" / _meta(name)["tag"]


def _edit(path: Path, change) -> None:
    obj = torch.load(path, weights_only=False, map_location="cpu")
    obj = change(obj) or obj
    torch.save(obj, path)


def _refused(ckpt: Path, tmp_path: Path, error: type[CkptError], match: str) -> None:
    before = tree_digest(ckpt)
    with pytest.raises(error, match=match):
        consolidate(ckpt, tmp_path / "out")
    assert tree_digest(ckpt) == before
    assert not (tmp_path / "out").exists()


# --- reading and consolidating ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BOTH)
def test_every_expert_is_read_under_its_hugging_face_name(name):
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    meta = _meta(name)
    assert ckpt.layout.kind == "autoep"
    assert (ckpt.layout.dp, ckpt.layout.ep, ckpt.zero_stage) == (4, 2, meta["zero_stage"])
    assert ckpt.keys == meta["hf_state_dict_keys"]  # transformers' own state-dict order
    shapes = {p.name: list(p.shape) for p in ckpt.params}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == [4, 12, 8]
    assert shapes["model.layers.1.mlp.experts.down_proj"] == [4, 8, 6]
    assert not [k for k in ckpt.keys if ".experts.w" in k or ".router." in k or ".gate.gate." in k]


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidate_is_bit_identical_to_the_live_engine(name, dtype, tmp_path):
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", dtype=dtype)
    ours = load_file(tmp_path / "out" / "model.safetensors")
    if dtype == "fp32":
        want = {k[len("fp32/") :]: v for k, v in _ref(name, "full_state.safetensors").items() if k.startswith("fp32/")}
    else:
        want = _ref(name, "bit16.safetensors")
    assert sorted(ours) == sorted(want)
    assert not [k for k in want if not torch.equal(ours[k], want[k])]


@pytest.mark.parametrize("name", BOTH)
def test_the_optimizer_states_are_the_live_engines_under_hf_names(name):
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    ref = _ref(name, "full_state.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            assert torch.equal(read_tensor(p.fp32, reader).reshape(p.shape), ref[f"fp32/{p.name}"]), p.name
            for key in ("exp_avg", "exp_avg_sq"):
                got = read_tensor(p.states[key], reader).reshape(p.shape)
                assert torch.equal(got, ref[f"{key}/{p.name}"]), (key, p.name)


@pytest.mark.parametrize("name", BOTH)
def test_the_output_loads_with_from_pretrained_of_the_moe_model(name, tmp_path):
    from transformers import MixtralForCausalLM

    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", config=FIXTURES / name / "model_config")
    model = MixtralForCausalLM.from_pretrained(tmp_path / "out")
    ref = _ref(name, "full_state.safetensors")
    state = model.state_dict()
    assert sorted(state) == sorted(k[len("fp32/") :] for k in ref if k.startswith("fp32/"))
    assert not [k for k, v in state.items() if not torch.equal(v, ref[f"fp32/{k}"])]


def test_deepspeeds_own_converters_refuse_the_folders():
    """What the fixtures recorded: no DeepSpeed route from AutoEP to Hugging Face weights."""
    z2 = json.loads((FIXTURES / Z2 / "reference" / "tools.json").read_text())
    z3 = json.loads((FIXTURES / Z3 / "reference" / "tools.json").read_text())
    assert "is not a model state checkpoint" in z2["zero_to_fp32"]["error"]
    assert "does not support AutoEP ZeRO-3" in z3["zero_to_fp32"]["error"]
    assert "does not support AutoEP ZeRO-3" in z3["zero_to_torch"]["error"]
    assert z3["ds_to_universal"]["shapes"]["zero/model.embed_tokens.weight"] == [192]  # dense 2-D written 1-D


def test_expert_dp_groups_are_deepspeeds():
    assert expert_dp_ranks(0, 2, 4, False) == [0, 2] and expert_dp_ranks(1, 2, 4, False) == [1, 3]
    assert expert_dp_ranks(1, 2, 4, True) == [2, 3]


@pytest.mark.parametrize("name", BOTH)
def test_inspect_names_the_layout(name):
    from ckpttools.layouts.registry import layout_of

    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    (line,) = layout_of(ckpt).describe(ckpt.layout.as_dict())
    assert "model.layers.0.mlp 4" in line and "EP 2" in line and "gate_up_proj" in line


def test_reshards_deepspeed_cannot_load_are_refused_with_the_reason():
    from ckpttools.layouts.base import ReshardTarget
    from ckpttools.layouts.registry import layout_of

    ckpt = read_checkpoint(FIXTURES / Z3 / "checkpoint")
    with pytest.raises(UnsupportedCheckpointError, match="--stage is refused"):
        layout_of(ckpt).check_reshard(ckpt, ReshardTarget(2, 2))
    ckpt = read_checkpoint(FIXTURES / Z2 / "checkpoint")
    with pytest.raises(UnsupportedCheckpointError, match="not a multiple of the AutoEP ep_size 2"):
        layout_of(ckpt).check_reshard(ckpt, ReshardTarget(3, 2))


def _universal(tmp_path: Path, name: str = Z2) -> Path:
    from ckpttools import reshard

    reshard(FIXTURES / name / "checkpoint", tmp_path / "universal", universal=True)
    return tmp_path / "universal"


@pytest.mark.parametrize("name", BOTH)
def test_the_universal_form_holds_the_engines_tensors_as_ds_to_universal_names_them(name, tmp_path):
    """Every engine parameter's folder (each layer's grouped w1/w2/w3 with all experts, as ds_to_universal writes
    them), equal to the live engine's fp32 masters; the module file carries ds_to_universal's AutoEP facts."""
    tag = _universal(tmp_path, name) / _meta(name)["tag"]
    native = _ref(name, "native_fp32.safetensors")
    tools = json.loads((FIXTURES / name / "reference" / "tools.json").read_text())
    params = {k.split("@")[0] for k in native}
    assert sorted(p.name for p in (tag / "zero").iterdir() if p.is_dir()) == sorted(params)
    for param in params:
        got = torch.load(tag / "zero" / param / "fp32.pt", weights_only=False)
        expert = ".experts.w" in param
        want = torch.cat([native[f"{param}@ep{e}"] for e in range(2)]) if expert else native[param]
        assert torch.equal(got["param"], want), param
        assert got.get("is_expert_param", False) == expert
        if expert or _meta(name)["zero_stage"] != 3:  # ds_to_universal writes ZeRO-3's dense params 1-D
            assert list(got["param"].shape) == tools["ds_to_universal"]["shapes"][f"zero/{param}"]
    model = torch.load(tag / min(p.name for p in tag.glob("*model_states.pt")), weights_only=False)
    layers = model["universal_checkpoint_info"]["ds_autoep_layers"]
    assert [la["expert_key_prefix"] for la in layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def _resharded(tmp_path: Path, dp: int, name: str = Z2) -> Path:
    from ckpttools import reshard

    reshard(FIXTURES / name / "checkpoint", tmp_path / f"dp{dp}", dp=dp)
    return tmp_path / f"dp{dp}"


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_a_dp_reshard_reads_back_bit_identical(name, dp, tmp_path):
    out = _resharded(tmp_path, dp, name)
    tag = out / _meta(name)["tag"]
    assert len(list(tag.glob("*_optim_states.pt"))) == dp
    if name == Z2:
        assert len(list(tag.glob("layer_*_expert_*_model_states.pt"))) == 8
    else:
        assert len(list(tag.glob("zero_pp_rank_*_model_states.pt"))) == dp
    ckpt = read_checkpoint(out)
    assert (ckpt.layout.dp, ckpt.layout.ep, ckpt.zero_stage) == (dp, 2, _meta(name)["zero_stage"])
    ref = _ref(name, "full_state.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            for key, src in (("fp32", p.fp32), *p.states.items()):
                assert torch.equal(read_tensor(src, reader).reshape(p.shape), ref[f"{key}/{p.name}"]), (key, p.name)


def test_a_zero3_reshard_at_the_same_dp_writes_the_same_rank_files(tmp_path):
    out = _resharded(tmp_path, 4, Z3)
    tag = _meta(Z3)["tag"]
    for r in range(4):
        name = f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        ours = torch.load(out / tag / name, weights_only=False)["optimizer_state_dict"]
        theirs = torch.load(FIXTURES / Z3 / "checkpoint" / tag / name, weights_only=False)["optimizer_state_dict"]
        assert ours["ds_zero_partition_groups"] == theirs["ds_zero_partition_groups"]
        for a, b in zip(ours["fp32_flat_groups"], theirs["fp32_flat_groups"], strict=True):
            assert torch.equal(a, b)
        for sg, st in theirs["optimizer_state_dict"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours["optimizer_state_dict"]["state"][sg][k], st[k]), (r, sg, k)
        model = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        ours_m = torch.load(out / tag / model, weights_only=False)
        theirs_m = torch.load(FIXTURES / Z3 / "checkpoint" / tag / model, weights_only=False)
        assert str(ours_m["ds_autoep_layers"]) == str(theirs_m["ds_autoep_layers"])


def test_a_reshard_at_the_same_dp_writes_the_same_optimizer_tensors(tmp_path):
    out = _resharded(tmp_path, 4)
    tag = _meta(Z2)["tag"]
    for r in range(4):
        name = f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        ours = torch.load(out / tag / name, weights_only=False)["optimizer_state_dict"]
        theirs = torch.load(FIXTURES / Z2 / "checkpoint" / tag / name, weights_only=False)["optimizer_state_dict"]
        for a, b in zip(
            ours["single_partition_of_fp32_groups"], theirs["single_partition_of_fp32_groups"], strict=True
        ):
            assert torch.equal(a, b)
        for g, st in theirs["base_optimizer_state"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours["base_optimizer_state"]["state"][g][k], st[k]), (r, g, k)
        assert ours["partition_count"] == theirs["partition_count"]


# --- broken folders -----------------------------------------------------------------------------------------------


def test_a_missing_expert_file_is_named(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    (tag / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    _refused(ckpt, tmp_path, CheckpointNotFoundError, "AutoEP layer 1 expert 2")


def test_swapped_expert_files_are_caught(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    a, b = tag / "layer_0_expert_0_mp_rank_00_model_states.pt", tag / "layer_0_expert_1_mp_rank_00_model_states.pt"
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    _refused(ckpt, tmp_path, CorruptCheckpointError, "renamed, swapped")


def test_swapped_zero3_rank_files_are_caught(tmp_path):
    ckpt, tag = _copy(tmp_path, Z3)
    a, b = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt", tag / "zero_pp_rank_2_mp_rank_00_model_states.pt"
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    _refused(ckpt, tmp_path, CkptError, "rank")


def test_swapped_zero3_optimizer_files_are_caught(tmp_path):
    ckpt, tag = _copy(tmp_path, Z3)
    a, b = (
        tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    )
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    _refused(ckpt, tmp_path, CkptError, "rank")


def test_a_router_copy_that_differs_from_the_router_is_caught(tmp_path):
    """AutoEP keeps the replaced block's gate in the module (`gate.gate.weight`, the router's parameter saved a
    second time): a copy that differs means a file from another save."""
    ckpt, tag = _copy(tmp_path, Z2)

    def zero(sd):
        sd["module"]["model.layers.0.mlp.gate.gate.weight"] = torch.zeros(4, 8, dtype=torch.bfloat16)

    _edit(tag / "mp_rank_00_model_states.pt", zero)
    _refused(ckpt, tmp_path, CorruptCheckpointError, "gate.gate.weight .module copy of model.layers.0.mlp.router")


@pytest.mark.parametrize("name", BOTH)
def test_a_non_uniform_expert_placement_is_refused_by_name(name, tmp_path):
    ckpt, tag = _copy(tmp_path, name)

    def reorder(sd):
        for entry in sd["ds_autoep_layers"]:
            ranks = entry["expert_placement"]["ranks"]
            ranks[0]["experts"], ranks[1]["experts"] = ranks[1]["experts"], ranks[0]["experts"]

    for f in sorted(tag.glob("*model_states.pt")):
        if "expert" not in f.name:
            _edit(f, reorder)
    _refused(ckpt, tmp_path, UnsupportedCheckpointError, "uniform, contiguous placement")


# --- DeepSpeed itself ---------------------------------------------------------------------------------------------


def _deepspeed_resumes(ckpt: Path, ranks: int, info: Path, load_universal: bool = False, name: str = Z2) -> dict:
    """DeepSpeed (with transformers 5.15) loads `ckpt` at `ranks` ranks, its fp32 masters and Adam moments equal to
    the reference, and trains one more step."""
    from fixtures.build import ds_launch, fixture_autoep

    spec = {**next(s for s in fixture_autoep.specs() if s["name"] == name), "load_universal": load_universal}
    args = ["resume", "--spec", json.dumps(spec), "--ckpt", ckpt,
            "--ref", FIXTURES / name / "reference" / "full_state.safetensors", "--out", info]  # fmt: skip
    run = ds_launch.torchrun(ranks, "fixtures.build.fixture_autoep", args, env=fixture_autoep.worker_env(), timeout=900)
    assert run.rc == 0, run.tail()
    result = json.loads(info.read_text())
    assert result["ok"], result
    assert result["world_size"] == ranks
    assert result["global_steps_after"] == result["global_steps_loaded"] + 1 == _meta(name)["global_steps"] + 1
    return result


@pytest.mark.slow
@pytest.mark.skipif(not (TF515 / "transformers").is_dir(), reason=NO_TF515)
def test_deepspeed_loads_the_fixture_and_trains_one_more_step(tmp_path):
    _deepspeed_resumes(FIXTURES / Z2 / "checkpoint", 4, tmp_path / "resume.json")


@pytest.mark.slow
@pytest.mark.skipif(not (TF515 / "transformers").is_dir(), reason=NO_TF515)
@pytest.mark.parametrize("name", BOTH)
def test_deepspeed_loads_the_universal_form_at_dp2_and_trains_one_more_step(name, tmp_path):
    _deepspeed_resumes(_universal(tmp_path, name), 2, tmp_path / "resume.json", load_universal=True, name=name)


@pytest.mark.slow
@pytest.mark.skipif(not (TF515 / "transformers").is_dir(), reason=NO_TF515)
@pytest.mark.parametrize("name", BOTH)
def test_deepspeed_loads_a_dp2_reshard_and_trains_one_more_step(name, tmp_path):
    """EP 2 x expert-DP 2 (4 ranks) resharded to EP 2 x expert-DP 1 (2 ranks)."""
    _deepspeed_resumes(_resharded(tmp_path, 2, name), 2, tmp_path / "resume.json", name=name)

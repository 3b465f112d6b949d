"""`ckpt stats`: statistics equal torch's on the loaded tensors (NaN-aware), for the weights and every optimizer
state; a NaN planted in one Adam moment of a real rank file is reported by layer and state."""

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpttools.cli import main
from ckpttools.ops.stats import stats

from .conftest import FIXTURES


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def torch_stats(t: torch.Tensor) -> dict:
    """What `ckpt stats` reports, computed by torch on the whole tensor in float64."""
    x = t.double().flatten()
    f = x[torch.isfinite(x)]
    out = {"count": x.numel(), "nan": int(torch.isnan(x).sum()), "posinf": int(torch.isposinf(x).sum()),
           "neginf": int(torch.isneginf(x).sum()), "l2": float(f.norm())}  # fmt: skip
    if f.numel():
        out.update(min=float(f.min()), max=float(f.max()), mean=float(f.mean()), rms=float(f.square().mean().sqrt()))
    return out


def assert_matches(ours: dict, theirs: dict) -> None:
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12, abs=1e-300), key


# Every fixture whose live engine's fp32 masters and optimizer states were saved, but the pipeline x TP one that
# ckpt refuses to read (its files do not say how parameters split over TP).
LIVE_STATE = sorted(p.parts[-3] for p in FIXTURES.glob("*/reference/full_state.safetensors")
                    if p.parts[-3] != "pp2_tp2_dp1_z1_bf16")  # fmt: skip


def _checkpoint(name: str):
    folder = FIXTURES / name / "checkpoint"
    return folder if folder.is_dir() else max((FIXTURES / name / "out").glob("checkpoint-*"))


@pytest.mark.parametrize("name", LIVE_STATE)
def test_weights_and_optimizer_states_equal_torch_on_the_live_engines_tensors(name):
    """full_state.safetensors holds the live engine's fp32 masters and optimizer states (`<state>/<name>`): Adam's
    moments, Muon's momentum_buffer, Adagrad's sum, in every layout (ZeRO-0..3, pipeline, MoE, AutoEP, PEFT, ...)."""
    ref = load_file(FIXTURES / name / "reference" / "full_state.safetensors")
    result = stats(_checkpoint(name))
    seen = set()
    for t in result.tensors:
        key = f"{'fp32' if t.what == 'weight' else t.what}/{t.name}"
        if key not in ref:
            continue  # buffers and frozen weights: the engine's state holds trainable parameters only
        assert_matches(t.moments.to_dict(), torch_stats(ref[key]))
        seen.add(key)
    assert seen == set(ref)  # every master and every state of every parameter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_aware_statistics_equal_torch(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 37, generator=g) * 3).to(dtype)
    x.view(-1)[[5, 900, 30000]] = float("nan")
    x.view(-1)[77] = float("inf")
    x.view(-1)[[78, 79]] = float("-inf")
    tensors = {"x": x, "ints": torch.arange(-5, 17), "allnan": torch.full((3,), float("nan"), dtype=dtype),
               "empty": torch.zeros(0, 4, dtype=dtype)}  # fmt: skip
    save_file(tensors, tmp_path / "w.safetensors")
    result = stats(tmp_path / "w.safetensors")
    by_name = {t.name: t.moments.to_dict() for t in result.tensors}
    for name, t in tensors.items():
        assert_matches(by_name[name], torch_stats(t))
    assert by_name["allnan"]["min"] is None and by_name["allnan"]["nan"] == 3
    assert [t["name"] for t in result.nonfinite()] == ["allnan", "x"]


def test_a_nan_planted_in_one_adam_moment_is_reported_by_layer_and_state(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    rank0 = ckpt / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(rank0, map_location="cpu", weights_only=False)  # the fixture's own rank file, DeepSpeed's
    # rank 0's flat partition of group 0 starts with emb.weight (the group's first parameter): element 0 is [0, 0]
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][0] = float("nan")
    torch.save(state, rank0)
    result = run("stats", ckpt, "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["nonfinite"] == [{"name": "emb.weight", "what": "exp_avg_sq", "layer": "emb", "nan": 1, "posinf": 0,
                               "neginf": 0}]  # fmt: skip
    layers = {(r["layer"], r["what"]): r for r in d["layers"]}
    assert layers[("emb", "exp_avg_sq")]["nan"] == 1
    assert sum(r["nan"] for r in d["layers"]) == 1
    human = run("stats", ckpt)
    assert "emb.weight [exp_avg_sq] (1 NaN)" in human.stdout


def test_the_plot_is_one_self_contained_page(tmp_path):
    page = tmp_path / "norms.html"
    result = run("stats", FIXTURES / "muon_z2_dp2_bf16" / "checkpoint", "--plot", page, "-q")
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text and "http" not in text.replace(
        "http://www.w3.org/2000/svg", "")  # fmt: skip
    for what in ("weight", "momentum_buffer", "exp_avg", "exp_avg_sq"):
        assert f"<h2>{what}</h2>" in text
    assert run("stats", FIXTURES / "z2_dp2_bf16" / "checkpoint", "--plot", tmp_path / "x.png").exit_code == 2


def test_layers_are_summed_in_model_order(tmp_path):
    tensors = {f"model.layers.{i}.mlp.weight": torch.full((4,), float(i + 1)) for i in range(12)}
    tensors["model.embed_tokens.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "w.safetensors")
    layers = stats(tmp_path / "w.safetensors").layers()
    names = [r["layer"] for r in layers]
    assert names == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(12))]  # 10 after 9, not after 1
    nine = next(r for r in layers if r["layer"] == "model.layers.9")
    assert nine["l2"] == pytest.approx(math.sqrt(4 * 100.0)) and nine["max_abs"] == 10.0


@pytest.mark.parametrize("name", ["fsdp2_dcp_dp2_fp32", "fsdp2_dcp_dp3_bf16", "accelerate_fsdp2_sharded"])
def test_torch_dcp_optimizer_states_equal_torch_on_dcp_to_torch_save(name):
    """The moments of an FSDP2 save (in the model's DCP folder, or accelerate's optimizer_0/ beside it) against
    reference/optim.safetensors: torch's dcp_to_torch_save of the same save, keys flattened."""
    ref = load_file(FIXTURES / name / "reference" / "optim.safetensors")
    result = stats(FIXTURES / name / "checkpoint")
    states = [t for t in result.tensors if t.what != "weight"]
    seen = set()
    for t in states:
        key = next(k for k in (f"optim.state.{t.name}.{t.what}", f"optimizer.state.{t.name}.{t.what}") if k in ref)
        assert_matches(t.moments.to_dict(), torch_stats(ref[key]))
        seen.add(key)
    assert seen == {k for k in ref if k.endswith((".exp_avg", ".exp_avg_sq"))}  # every moment, each once


def test_a_layout_whose_optimizer_states_are_not_read_says_so():
    result = stats(FIXTURES / "megatron_tp2_llama_adam" / "checkpoint")
    assert {t.what for t in result.tensors} == {"weight"}
    assert any("exp_avg" in n and "not read as tensors" in n for n in result.notes)


def test_a_checkpoint_whose_names_need_a_config_is_reported_under_the_trainers_names():
    """torchtitan records no model config: the adapter cannot map its names, the values are reported all the same."""
    result = stats(FIXTURES / "torchtitan_llama3_step2" / "checkpoint")
    assert "tok_embeddings.weight" in {t.name for t in result.tensors}
    assert any(n.startswith("names as the trainer saved them") for n in result.notes)

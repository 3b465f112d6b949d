"""Megatron-DeepSpeed 3D (pipeline 2 x TP 2) mapped to Hugging Face names (adapters/megatron_deepspeed.py), against
Megatron-DeepSpeed's own forward. The fixtures are real runs of Megatron-DeepSpeed (fixtures/build/
fixture_megatron_deepspeed.py): the classic GPT (-> GPTBigCode) and a Llama-style run (-> Llama, GQA)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.adapters import ConfigNeededError, adapt, megatron_deepspeed, megatron_gpt
from ckpttools.adapters.registry import adapter_for
from ckpttools.adapters.segments import concat, grouped_rows, split_rows
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.layouts.registry import open_checkpoint
from tests.support.megatron import ckpt_cli, logits_error, run_folder

from .conftest import FIXTURES

GPT, LLAMA = "megatron_deepspeed_gpt_pp2_tp2", "megatron_deepspeed_llama_pp2_tp2"
FUSED = "megatron_deepspeed_gpt_pp2_tp2_fused_gelu"  # --bias-gelu-fusion (the default): tanh GeLU
BF16 = "megatron_deepspeed_gpt_pp2_tp2_bf16_z0"  # bf16 without ZeRO (BF16_Optimizer): bf16 layers, fp32 masters
TP1 = "megatron_deepspeed_llama_pp2_tp1"  # the Llama over pipeline 2 alone (layer_XX-model_00 files)
AFTER_FPDT = "megatron_deepspeed_gpt_pp2_tp2_after_fpdt"  # Megatron-DeepSpeed after #441: [q; k; v] per TP rank
TOY = "pp2_tp2_dp1_z1_bf16_megatron"  # a PipelineModule of the fixture's own (toy TP layers), no args
TOLERANCE = 1e-5


@pytest.mark.parametrize(
    ("name", "arch"),
    [(GPT, "GPTBigCodeForCausalLM"), (FUSED, "GPTBigCodeForCausalLM"), (AFTER_FPDT, "GPTBigCodeForCausalLM"),
     (LLAMA, "LlamaForCausalLM"), (TP1, "LlamaForCausalLM")],
)  # fmt: skip
def test_consolidated_logits_equal_megatron_deepspeeds(tmp_path: Path, name: str, arch: str) -> None:
    result = consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and config["vocab_size"] == 251  # padded 256 -> the tokenizer's 251
    assert any("generated from the run's arguments" in n for n in result.notes)
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


def test_config_is_generated_from_the_runs_args(tmp_path: Path) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "llama")
    llama = json.loads((tmp_path / "llama" / "config.json").read_text())
    want = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 4, "intermediate_size": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
            "attention_bias": False, "hidden_act": "silu"}  # fmt: skip
    assert {k: llama[k] for k in want} == want
    consolidate(run_folder(GPT), tmp_path / "gpt")
    gpt = json.loads((tmp_path / "gpt" / "config.json").read_text())
    want = {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_inner": 128, "n_positions": 32, "multi_query": False,
            "activation_function": "gelu", "tie_word_embeddings": True}  # fmt: skip
    assert {k: gpt[k] for k in want} == want


@pytest.mark.parametrize("name", [GPT, LLAMA])
def test_output_keys_and_shapes_are_the_classs(tmp_path: Path, name: str) -> None:
    import transformers

    consolidate(run_folder(name), tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert written == expected


def test_the_layout_carries_the_args_and_merges_swiglu_halves() -> None:
    ckpt = open_checkpoint(run_folder(LLAMA))
    assert ckpt.layout.kind == "pipeline_tp" and (ckpt.layout.tp, ckpt.layout.pp) == (2, 2)
    args = ckpt.layout.details["args"]
    assert (args["swiglu"], args["num_key_value_heads"], args["params_dtype"]) == (True, 4, "float32")
    assert "attn_mask" not in args and "rotary_pos_emb" not in args  # tensors pretrain_gpt sets on args
    assert ckpt.masters["2.mlp.dense_h_to_4h.weight"].shape == (128, 32)  # [gate; up] of both TP ranks
    assert "2.mlp.dense_h_to_4h.weight" in ckpt.layout.details["tp_split"]["halves of each rank, joined ([gate; up])"]
    assert ckpt.masters["1.word_embeddings.weight"].shape == (251, 32)  # vocabulary cut by the layout


def test_inspect_names_the_adapter() -> None:
    for name, arch in ((GPT, "GPTBigCodeForCausalLM"), (LLAMA, "LlamaForCausalLM")):
        r = ckpt_cli("inspect", str(run_folder(name)))
        assert r.returncode == 0, r.stderr
        assert f"megatron-deepspeed -> {arch}" in r.stdout, r.stdout


def _naive_qkv(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    """q, k, v as three consecutive blocks (ignoring the per-group interleave)."""
    return split_rows(src, (d.heads * d.head_dim, d.groups * d.head_dim, d.groups * d.head_dim), names)


def _swapped_halves(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    return megatron_gpt.halves(src, (names[1], names[0]), d)


def _c_attn_as_blocks(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    """GPTBigCode's c_attn written as [all q; all k; all v] instead of per head [q; k; v]."""
    return [concat(grouped_rows(src, d.heads, (d.head_dim,) * 3, (names[0],) * 3), names[0])]


@pytest.mark.parametrize(
    ("name", "table", "key", "op"),
    [(LLAMA, "LAYER", "self_attention.linear_qkv.weight", _naive_qkv),
     (LLAMA, "LAYER", "mlp.linear_fc1.weight", _swapped_halves),
     (GPT, "BIGCODE_LAYER", "self_attention.linear_qkv.weight", _c_attn_as_blocks)],
)  # fmt: skip
def test_negative_controls_fail_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, table: str, key: str, op: Any
) -> None:
    rules = getattr(megatron_gpt, table)
    monkeypatch.setitem(rules, key, (rules[key][0], op))
    consolidate(run_folder(name), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", name) > 1e-2  # the comparison catches a wrong mapping


def test_a_bf16_run_gives_its_masters_in_fp32_and_its_weights_in_bf16(tmp_path: Path) -> None:
    """fp32 output: the optimizer's fp32 masters (as zero_to_fp32); bf16 output: them cast, bit-identical to the bf16
    weights the run computed with (its layer files), with logits equal to its forward on those weights."""
    consolidate(run_folder(BF16), tmp_path / "bf16", dtype="bf16")
    assert logits_error(tmp_path / "bf16", BF16) <= TOLERANCE
    step = run_folder(BF16) / "global_step2"
    shards = [torch.load(step / f"layer_01-model_{t:02d}-model_states.pt", weights_only=True) for t in (0, 1)]
    module = torch.cat([s["word_embeddings.weight"] for s in shards])[:251]
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    assert bf16["transformer.wte.weight"].dtype == torch.bfloat16 and torch.equal(
        bf16["transformer.wte.weight"], module
    )
    consolidate(run_folder(BF16), tmp_path / "fp32")
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")["transformer.wte.weight"]
    assert fp32.dtype == torch.float32 and not torch.equal(fp32, module.float())  # the masters, not the bf16 copy
    assert torch.equal(fp32.bfloat16(), module)


def test_verify_against_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "hf")
    r = ckpt_cli("verify", str(tmp_path / "hf"), "--against", str(run_folder(LLAMA)))
    assert r.returncode == 0 and "all 39 tensors bit-identical" in r.stdout + r.stderr, r.stdout + r.stderr
    rules = megatron_gpt.LAYER
    monkeypatch.setitem(rules, "mlp.linear_fc1.weight", (rules["mlp.linear_fc1.weight"][0], _swapped_halves))
    consolidate(run_folder(LLAMA), tmp_path / "swapped")  # written with gate/up swapped: verify must not vouch for it
    monkeypatch.undo()
    r = ckpt_cli("verify", str(tmp_path / "swapped"), "--against", str(run_folder(LLAMA)))
    assert r.returncode == 1 and "gate_proj" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("how", [("--universal",), ("--dp", "2")])
def test_reshard_is_refused_in_one_line(tmp_path: Path, how: tuple[str, ...]) -> None:
    """The args and RNG state are read as inert records, which a reshard could not write back: refused (it was an
    internal error), nothing written."""
    r = ckpt_cli("reshard", str(run_folder(GPT)), *how, "--out", str(tmp_path / "out"))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and "cannot write back" in last, r.stderr
    assert not (tmp_path / "out").exists()


def test_the_gelu_variant_follows_the_run(tmp_path: Path) -> None:
    """The fused bias GeLU is the tanh approximation: exact GeLU in its place is off by more than the tolerance."""
    for name, act in ((GPT, "gelu"), (FUSED, "gelu_pytorch_tanh")):
        consolidate(run_folder(name), tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["activation_function"] == act
    fused = json.loads((tmp_path / FUSED / "config.json").read_text())
    (tmp_path / FUSED / "config.json").write_text(json.dumps({**fused, "activation_function": "gelu"}))
    assert logits_error(tmp_path / FUSED, FUSED) > TOLERANCE


def test_a_config_of_another_architecture_is_refused(tmp_path: Path) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "llama")
    r = ckpt_cli("consolidate", str(run_folder(GPT)), "--out", str(tmp_path / "hf"), "--config",
                 str(tmp_path / "llama" / "config.json"))  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and "2.self_attention.query_key_value" in last, r.stderr
    assert not (tmp_path / "hf").exists()
    (tmp_path / "qwen3").mkdir()
    qwen3 = {**json.loads((tmp_path / "llama" / "config.json").read_text()), "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(qwen3))
    r = ckpt_cli("consolidate", str(run_folder(LLAMA)), "--out", str(tmp_path / "hf"), "--config",
                 str(tmp_path / "qwen3" / "config.json"))  # fmt: skip
    assert r.returncode != 0 and "Qwen3ForCausalLM" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "hf").exists()


def test_with_the_runs_own_config_given(tmp_path: Path) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "ref")
    result = consolidate(run_folder(LLAMA), tmp_path / "hf", config=tmp_path / "ref" / "config.json")
    assert not any("generated from the run's arguments" in n for n in result.notes)
    assert logits_error(tmp_path / "hf", LLAMA) <= TOLERANCE


def test_without_args_it_needs_config(monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = open_checkpoint(run_folder(GPT))
    monkeypatch.delitem(ckpt.layout.details, "args")
    with pytest.raises(ConfigNeededError, match="--config"):
        adapt(ckpt, None)


def test_a_pipeline_module_of_ones_own_is_not_claimed() -> None:
    ckpt = open_checkpoint(FIXTURES / TOY / "checkpoint")
    assert "args" not in ckpt.layout.details and adapter_for(ckpt) is None


def test_after_fpdt_the_qkv_rows_are_put_back_per_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: read as the older per-head layout, the run after #441 is caught by the comparison."""
    monkeypatch.setattr(megatron_deepspeed, "after_fpdt", lambda args: False)
    consolidate(run_folder(AFTER_FPDT), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", AFTER_FPDT) > 1e-2


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"num_key_value_heads": 2}, "GQA after #441"),
        ({"use_rotary_position_embeddings": True}, "rotary embeddings after #441"),
    ],
)
def test_what_after_fpdt_cannot_be_checked_is_refused(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], what: str
) -> None:
    ckpt = open_checkpoint(run_folder(AFTER_FPDT))
    monkeypatch.setitem(ckpt.layout.details, "args", {**ckpt.layout.details["args"], **change})
    with pytest.raises(UnsupportedCheckpointError, match=what):
        adapt(ckpt, None)


def test_a_model_only_megatron_cores_table_maps_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """LayerNorm + SwiGLU + RoPE would be StableLM for Megatron-Core; no Megatron-DeepSpeed run of it was checked."""
    ckpt = open_checkpoint(run_folder(LLAMA))
    monkeypatch.setitem(ckpt.layout.details, "args", {**ckpt.layout.details["args"], "normalization": "layernorm"})
    with pytest.raises(UnsupportedCheckpointError, match="StableLmForCausalLM model"):
        adapt(ckpt, None)

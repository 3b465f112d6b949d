"""Megatron checkpoints beyond the first fixtures' release and model: older megatron-core releases, and the model
configurations Megatron-LM users train (Qwen2's q/k/v biases, --add-bias-linear, Llama 3.1's RoPE scaling with a
head_dim of its own, Mistral's sliding window, StableLM's LayerNorm + SwiGLU + partial RoPE, the classic GPT), each
mapped with logits equal to Megatron's own forward or refused in one line.

The fixtures were saved by megatron-core itself (fixtures/build/fixture_megatron.py for 0.19.2's variants, whose
arguments come from Megatron-LM's own parser and validate_args, ~800 fields; fixture_megatron_versions.py for 0.13.0
and 0.16.1), each with the logits of its own forward; megatron-core is not needed here. Refusals are checked on the
arguments of a real save with one Megatron-LM flag changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpttools import consolidate
from ckpttools.adapters import MappingError, adapt, megatron_gpt
from ckpttools.adapters.segments import concat, grouped_rows
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.layouts.registry import open_checkpoint
from tests.support.megatron import FIXTURES, ckpt_cli, logits_error, run_folder

V0_13 = "megatron_v0_13_0_tp2_llama_adam"  # MCoreSavePlan in .metadata, common.pt, fully_sharded_model_space Adam
V0_16 = "megatron_v0_16_1_tp2_llama"  # common.pt
V0_18 = "megatron_v0_18_2_tp2_llama_lmsave"  # 0.18.2's Megatron-LM save_checkpoint: its parser's args in common.pt
QWEN2 = "megatron_tp2_qwen2"  # --add-qkv-bias, args without vocab_size (a Hugging Face tokenizer's run)
BIAS = "megatron_tp2_llama_bias"  # --add-bias-linear: qkv, proj, fc1, fc2 biases
LLAMA31 = "megatron_tp2_llama31"  # --use-rope-scaling, RoPE base 500000, kv_channels 16 != hidden 32 / 4 heads
GPT = "megatron_tp2_gpt"  # Megatron-LM's defaults: LayerNorm, GeLU, learned positions, biases, tied
INTERP = "megatron_tp2_llama_interp"  # --rotary-seq-len-interpolation-factor 4 (transformers' linear RoPE)
MISTRAL = "megatron_tp2_mistral"  # --window-size (3,0): itself and the 3 tokens before it
STABLELM = "megatron_tp2_stablelm"  # LayerNorm + SwiGLU + RoPE on half of each head, --add-qkv-bias
LMSAVE = "megatron_tp2_llama_lmsave"  # Megatron-LM's own save_checkpoint: DDP + distributed optimizer, rng_state
PP2_TIED = "megatron_tp2_pp2_llama_tied"  # the last stage's tied output layer saved under the embedding's key
LLAMA, MOE, DEEPSEEK = "megatron_tp2_llama", "megatron_tp2_qwen3_moe", "megatron_moe_ep2_deepseek_v3"
TOLERANCE = 1e-5


@pytest.mark.parametrize(("name", "release"), [(V0_13, "0.13.0"), (V0_16, "0.16.1"), (V0_18, "0.18.2")])
def test_older_releases_convert_with_megatrons_logits(tmp_path: Path, name: str, release: str) -> None:
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    assert meta["versions"]["megatron-core"] == release
    folder = run_folder(name) / "iter_0000002"
    assert (folder / "common.pt").is_file()  # the args beside the DCP files, not in common_state
    r = ckpt_cli("inspect", str(run_folder(name)))
    assert r.returncode == 0 and "megatron-core -> LlamaForCausalLM" in r.stdout, r.stdout + r.stderr
    if release == "0.13.0":  # its SavePlan subclass is pickled in .metadata's all_local_plans
        assert b"MCoreSavePlan" in (folder / ".metadata").read_bytes()
        # its distributed optimizer's default layout: optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<weight>
        assert "per-parameter" in r.stdout and "fp32_param" in r.stdout, r.stdout
        assert len(open_checkpoint(run_folder(name)).keys) == 9  # the optimizer state is not read as weights
    if release == "0.18.2":  # Megatron-LM's own save: ~760 arguments, each rank's rng_state, per-bucket optimizer
        assert len(open_checkpoint(run_folder(name)).layout.details["args"]) > 500 and "per-bucket" in r.stdout
    consolidate(run_folder(name), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 61
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


@pytest.mark.parametrize(
    ("name", "arch", "fields"),
    [(QWEN2, "Qwen2ForCausalLM", {"vocab_size": 64, "rope_theta": 1e6}),
     (BIAS, "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
     (LLAMA31, "LlamaForCausalLM", {"head_dim": 16, "rope_theta": 500000.0}),
     (MISTRAL, "MistralForCausalLM", {"sliding_window": 4}),
     (INTERP, "LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}}),
     (STABLELM, "StableLmForCausalLM", {"partial_rotary_factor": 0.5, "use_qkv_bias": True}),
     (LMSAVE, "LlamaForCausalLM", {"vocab_size": 61, "tie_word_embeddings": False}),
     (PP2_TIED, "LlamaForCausalLM", {"tie_word_embeddings": True, "num_hidden_layers": 4}),
     (GPT, "GPTBigCodeForCausalLM", {"multi_query": False, "tie_word_embeddings": True,
                                     "activation_function": "gelu"})],
)  # fmt: skip
def test_variants_convert_with_megatrons_logits(tmp_path: Path, name: str, arch: str, fields: dict[str, Any]) -> None:
    args = open_checkpoint(run_folder(name)).layout.details["args"]
    assert len(args) > 500 and args["transformer_impl"] == "local"  # Megatron-LM's own parser wrote them
    consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert {k: config[k] for k in fields} == fields
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE
    if name == LLAMA31:
        assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["factor"] == 8.0


def test_megatron_lms_own_save_is_read_as_it_wrote_it() -> None:
    """save_checkpoint's iteration folder: the model, the distributed optimizer's buckets, each rank's rng_state and
    the common_state with Megatron-LM's ~800 arguments; only the 9 model tensors are weights."""
    ckpt = open_checkpoint(run_folder(LMSAVE))
    assert len(ckpt.keys) == 9 and not [k for k in ckpt.keys if k.startswith(("rng_state", "optimizer"))]
    r = ckpt_cli("inspect", str(run_folder(LMSAVE)))
    assert r.returncode == 0 and "per-bucket (distributed optimizer)" in r.stdout and "exp_avg_sq" in r.stdout
    assert "run arguments  8" in r.stdout and "megatron-core -> LlamaForCausalLM" in r.stdout, r.stdout


def test_a_padded_vocabulary_without_the_tokenizers_size_is_kept_and_said(tmp_path: Path) -> None:
    """Megatron-LM records vocab_size only for --vocab-size; with a tokenizer its args hold padded_vocab_size alone:
    the padding rows are kept (the tokenizer's size is not known) and a note says so."""
    assert open_checkpoint(run_folder(QWEN2)).layout.details["args"]["vocab_size"] is None
    result = consolidate(run_folder(QWEN2), tmp_path / "hf")
    assert any("padded vocabulary" in n and "--config" in n for n in result.notes), result.notes
    assert not any("padded vocabulary" in n for n in consolidate(run_folder(LLAMA), tmp_path / "ll").notes)


@pytest.mark.parametrize(
    ("name", "rope"),
    [(LLAMA31, {"rope_type": "default"}),  # without Llama 3.1's scaling
     (INTERP, {"rope_type": "default"}),  # positions not interpolated
     (STABLELM, {"rope_type": "default", "partial_rotary_factor": 1.0})],  # RoPE over the whole head
)  # fmt: skip
def test_rope_not_the_runs_is_caught(tmp_path: Path, name: str, rope: dict[str, Any]) -> None:
    consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(rope_parameters={**rope, "rope_theta": config["rope_theta"]}, partial_rotary_factor=1.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert logits_error(tmp_path / "hf", name) > 1e-3  # the oracle sees the RoPE


@pytest.mark.parametrize("window", [3, None])  # Megatron's `left` taken as the window, or no window
def test_a_sliding_window_not_the_runs_is_caught(tmp_path: Path, window: int | None) -> None:
    consolidate(run_folder(MISTRAL), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    assert logits_error(tmp_path / "hf", MISTRAL) > 1e-2


def _gpt2_style_qkv(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    """[all q; all k; all v] (GPT-2's c_attn) instead of the per-head [q; k; v] GPTBigCode reads."""
    per = (d.head_dim, d.head_dim, d.head_dim)
    return [concat(grouped_rows(src, d.heads, per, ("q", "k", "v")), names[0])]


def test_gpt_with_a_regrouped_qkv_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        targets, _ = megatron_gpt.BIGCODE_LAYER[key]
        monkeypatch.setitem(megatron_gpt.BIGCODE_LAYER, key, (targets, _gpt2_style_qkv))
    consolidate(run_folder(GPT), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", GPT) > 1e-2


def test_biases_the_configs_class_lacks_are_refused(tmp_path: Path) -> None:
    """--config naming Llama without attention_bias for the Qwen2-like run: from_pretrained would drop the q/k/v
    biases and load at exit 0; the mapping refuses naming the first."""
    consolidate(run_folder(LLAMA), tmp_path / "ref")
    (tmp_path / "cfg").mkdir()
    llama = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({**llama, "vocab_size": 64, "rope_theta": 1e6}))
    r = ckpt_cli(
        "consolidate", str(run_folder(QWEN2)), "--out", str(tmp_path / "hf"), "--config", str(tmp_path / "cfg")
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and "q_proj.bias" in last, r.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("name", "change", "said"),
    [(LLAMA, {"rotary_interleaved": True}, "--rotary-interleaved"),
     (LLAMA, {"rotary_percent": 0.5}, "partial rotary embeddings (0.5) with RMSNorm"),
     (LLAMA, {"normalization": "LayerNorm", "swiglu": False}, "LayerNorm with this MLP"),
     (STABLELM, {"add_bias_linear": True}, "--add-bias-linear"),
     (STABLELM, {"kv_channels": 16}, "kv_channels other than hidden/heads"),
     (STABLELM, {"qk_layernorm": True}, "qk-norm with LayerNorm"),
     (LLAMA, {"apply_residual_connection_post_layernorm": True}, "after the norm"),
     (LLAMA, {"apply_layernorm_1p": True}, "--apply-layernorm-1p"),
     (LLAMA, {"layernorm_zero_centered_gamma": True}, "--apply-layernorm-1p"),
     (LLAMA, {"window_size": [3, 2]}, "looks ahead"),
     (LLAMA, {"window_size": [3, 0], "window_attn_skip_freq": 2}, "--window-attn-skip-freq"),
     (QWEN2, {"window_size": [3, 0]}, "sliding-window attention with Qwen2ForCausalLM"),
     (MOE, {"window_size": [3, 0]}, "sliding-window attention"),
     (LLAMA, {"rotary_seq_len_interpolation_factor": 4, "use_rope_scaling": True}, "combines"),
     (MOE, {"rotary_seq_len_interpolation_factor": 4}, "position interpolation"),
     (LLAMA, {"no_rope_freq": 4}, "--no-rope-freq"),
     (LLAMA, {"softmax_type": "off-by-one"}, "off-by-one softmax"),
     (LLAMA, {"qk_layernorm": True, "add_qkv_bias": True}, "biases with qk-norm"),
     (GPT, {"group_query_attention": True, "num_query_groups": 2}, "2 query groups for 4 heads"),
     (GPT, {"add_bias_linear": False}, "--disable-bias-linear"),
     (GPT, {"squared_relu": True}, "squared-ReLU"),
     (MOE, {"add_qkv_bias": True}, "linear biases"),
     (MOE, {"use_rope_scaling": True}, "RoPE scaling"),
     (DEEPSEEK, {"rotary_interleaved": True}, "--rotary-interleaved")],  # on top of MLA's own interleave
)  # fmt: skip
def test_what_is_not_mapped_is_refused_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, change: dict[str, Any], said: str
) -> None:
    ckpt = open_checkpoint(run_folder(name))
    monkeypatch.setitem(ckpt.layout.details, "args", {**ckpt.layout.details["args"], **change})
    with pytest.raises(UnsupportedCheckpointError, match="nothing written") as e:
        adapt(ckpt, None)
    assert said in str(e.value)


def test_a_variants_config_not_the_runs_is_refused(tmp_path: Path) -> None:
    """The Llama 3.1-like run's head_dim 16 is not hidden/heads: a config without head_dim is refused by shape."""
    consolidate(run_folder(LLAMA31), tmp_path / "ref")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    del config["head_dim"]
    ckpt = open_checkpoint(run_folder(LLAMA31))
    with pytest.raises(MappingError, match=r"linear_qkv\.weight"):
        adapt(ckpt, config)

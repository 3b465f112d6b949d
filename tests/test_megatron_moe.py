"""Megatron-Core MoE `torch_dist` input mapped to Mixtral / Qwen3-MoE, against Megatron's own forward.

The fixtures (fixtures/megatron_moe_*) were saved by megatron-core 0.19.2 itself (fixtures/build/
fixture_megatron_moe.py, expert-parallel 2 over gloo on CPU, sequential experts of the local spec); each carries the
logits of the Megatron model's forward on a fixed input. The oracle is behaviour: the model transformers builds from
`ckpt consolidate`'s output gives the same logits (fp32, <= 1e-5). Negative controls (the experts swapped under
their router, each expert's gate and up halves swapped) must fail the same comparison. megatron-core is not needed
here: only the committed folders are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttools import consolidate
from ckpttools.adapters import adapt, megatron_moe
from ckpttools.adapters.segments import permuted_rows
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.model.checkpoint import TensorSource
from tests.support.megatron import ckpt_cli, logits_error, run_folder

MIXTRAL = "megatron_moe_ep2_mixtral"  # EP 2: each rank saved 2 of the 4 experts
QWEN3_MOE = "megatron_moe_tp2_ep2_qwen3"  # TP 2 x EP 2: each expert split over 2 ranks, softmax before the top-k
QWEN2_MOE = "megatron_moe_ep2_qwen2_shared"  # EP 2, a shared expert behind a sigmoid gate
DEEPSEEK = "megatron_moe_ep2_deepseek_v3"  # EP 2, MLA, sigmoid router with expert_bias, groups, ungated shared expert
TOLERANCE = 1e-5
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def test_experts_of_every_expert_parallel_rank_read_as_one_stack() -> None:
    ckpt = open_checkpoint(run_folder(MIXTRAL))
    assert ckpt.layout.kind == "megatron" and ckpt.layout.details["args"]["expert_model_parallel_size"] == 2
    assert ckpt.masters[FC1].shape == (2, 4, 48, 32)  # [L, E, 2F, H]: experts 0-1 from rank 0, 2-3 from rank 1
    segments = ckpt.masters[FC1].segments  # per layer, expert and half (Megatron saves gate and up apart)
    assert len(segments) == 2 * 4 * 2
    assert {seg.tensor.storage.record.path.name for seg in segments} == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize(
    ("name", "arch", "fields"),
    [(MIXTRAL, "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24}),
     (QWEN3_MOE, "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 16, "norm_topk_prob": False}),
     (QWEN2_MOE, "Qwen2MoeForCausalLM", {"num_experts": 4, "shared_expert_intermediate_size": 32, "qkv_bias": False}),
     (DEEPSEEK, "DeepseekV3ForCausalLM", {"n_routed_experts": 4, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                                          "routed_scaling_factor": 2.5, "q_lora_rank": 16, "rope_interleave": True})],
)  # fmt: skip
def test_consolidated_logits_equal_megatrons(tmp_path: Path, name: str, arch: str, fields: dict[str, Any]) -> None:
    result = consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and config["vocab_size"] == 61  # padded 64 -> the run's 61
    assert {k: config[k] for k in fields} == fields
    assert any("generated from the run's arguments" in n for n in result.notes)
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


def test_the_adapter_reads_no_bytes_and_keeps_the_experts_fused() -> None:
    mapped = adapt(open_checkpoint(run_folder(MIXTRAL)), None)
    assert mapped is not None and mapped.adapter == "megatron-core -> MixtralForCausalLM"
    sources = {s.name: s for s in mapped.checkpoint.sources(mapped.checkpoint.train_dtype)}
    gate_up = sources["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 48, 32) and sum(seg.count for seg in gate_up.segments) == 4 * 48 * 32
    assert sources["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 24)
    assert sources["model.layers.0.mlp.gate.weight"].shape == (4, 32)
    assert not [n for n in sources if "q_norm" in n or n.startswith("decoder.")]


def _experts_swapped(src: TensorSource, name: str, m: megatron_moe.Moe) -> TensorSource:
    """Experts 0 and 1 exchanged (fc1 and fc2 alike), the router left as it is."""
    return permuted_rows(src, [1, 0, *range(2, m.experts)], name)


def _halves_swapped(src: TensorSource, name: str, m: megatron_moe.Moe) -> TensorSource:
    """Each expert's fc1 read as [up; gate]: rows of [2E, F, H] blocks, each expert's two halves exchanged."""
    blocks = TensorSource(src.name, (2 * m.experts, m.expert_ffn, m.dense.hidden), src.dtype, src.segments, src.kind)
    swapped = permuted_rows(blocks, [b ^ 1 for b in range(2 * m.experts)], name)
    return TensorSource(name, src.shape, src.dtype, swapped.segments, src.kind)


@pytest.mark.parametrize(
    "patches",
    [{megatron_moe.FC1: _experts_swapped, megatron_moe.FC2: _experts_swapped}, {megatron_moe.FC1: _halves_swapped}],
    ids=["experts-swapped", "gate-up-swapped"],
)
def test_negative_controls_fail_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patches: dict[str, Any]
) -> None:
    for key, op in patches.items():
        target, _ = megatron_moe.MOE_LAYER[key]
        monkeypatch.setitem(megatron_moe.MOE_LAYER, key, (target, op))
    consolidate(run_folder(MIXTRAL), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", MIXTRAL) > 1e-2  # the comparison catches a wrong mapping


def test_shared_expert_halves_swapped_fail_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "mlp.shared_experts.linear_fc1.weight"
    (gate, up), op = megatron_moe.SHARED_LAYER[key]
    monkeypatch.setitem(megatron_moe.SHARED_LAYER, key, ((up, gate), op))
    consolidate(run_folder(QWEN2_MOE), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", QWEN2_MOE) > 1e-2


def test_expert_bias_is_the_routers_correction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek's router picks experts by sigmoid score + expert_bias: the bias mapped to the wrong experts changes
    the routing, and the comparison fails."""
    key = "mlp.router.expert_bias"
    target, op = megatron_moe.MOE_LAYER[key]
    mapped = adapt(open_checkpoint(run_folder(DEEPSEEK)), None)
    assert mapped is not None
    bias = {s.name: s for s in mapped.checkpoint.params}["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (4,) and bias.fp32.dtype.name == "float32"
    # the groups' biases exchanged (within a group, a swap would keep the group's score: 2 of 2 experts are taken)
    swapped = lambda src, name, m: permuted_rows(op(src, name, m), [2, 3, 0, 1], name)  # noqa: E731
    monkeypatch.setitem(megatron_moe.MOE_LAYER, key, (target, swapped))
    consolidate(run_folder(DEEPSEEK), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", DEEPSEEK) > 1e-2


def test_expert_bias_stays_fp32_in_16_bit_output(tmp_path: Path) -> None:
    from safetensors import safe_open

    consolidate(run_folder(DEEPSEEK), tmp_path / "hf", dtype="bf16")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    kept = {k for k, dt in dtypes.items() if dt == torch.float32}
    assert kept == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(2)}
    assert dtypes["model.layers.0.mlp.gate.weight"] == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "field", "value", "tensor"),
    [(MIXTRAL, "num_local_experts", 8, "decoder.layers.mlp.router.weight"),
     (MIXTRAL, "intermediate_size", 16, FC1),
     (MIXTRAL, "num_hidden_layers", 3, "decoder.layers."),
     (DEEPSEEK, "kv_lora_rank", 8, "decoder.layers.self_attention.linear_kv_down_proj.weight"),
     (DEEPSEEK, "n_shared_experts", 2, "decoder.layers.mlp.shared_experts.linear_fc1.weight"),
     (DEEPSEEK, "n_routed_experts", 8, "decoder.layers.mlp.router.weight")],
)  # fmt: skip
def test_a_config_not_the_runs_is_refused_naming_the_tensor(
    tmp_path: Path, name: str, field: str, value: int, tensor: str
) -> None:
    consolidate(run_folder(name), tmp_path / "ref")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, field: value}))
    r = ckpt_cli(
        "consolidate", str(run_folder(name)), "--out", str(tmp_path / "hf"), "--config", str(tmp_path / "wrong")
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and tensor in last, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("change", "what"),
    [({"moe_shared_expert_intermediate_size": 32}, "shared experts without a gate"),
     ({"moe_router_score_function": "sigmoid"}, "sigmoid MoE router"),
     ({"moe_router_enable_expert_bias": True}, "expert_bias"),
     ({"moe_layer_freq": "([0]+[1]*1)"}, "MoE on some layers only"),
     ({"moe_router_pre_softmax": True}, "unrenormalised top-k"),
     ({"multi_latent_attention": True, "rope_type": "yarn", "moe_router_score_function": "sigmoid"}, "YaRN"),
     ({"multi_latent_attention": True}, "DeepSeek-V2")],
)  # fmt: skip
def test_runs_using_what_is_not_mapped_are_refused(change: dict[str, Any], what: str) -> None:
    args = open_checkpoint(run_folder(MIXTRAL)).layout.details["args"]
    with pytest.raises(UnsupportedCheckpointError, match=what) as caught:
        megatron_moe.config_from_args({**args, **change})
    assert "nothing written" in str(caught.value)

"""Megatron-Core GPT with MoE layers (`torch_dist`) -> MixtralForCausalLM, Qwen3MoeForCausalLM or Qwen2MoeForCausalLM.

The attention, norms, embedding and output layer follow the dense Megatron GPT table (`megatron_gpt`, reused as
it is); this module adds the MoE layer's conventions (megatron/core/transformer/moe/*):
- `mlp.router.weight` `[E, H]` is Hugging Face's `mlp.gate.weight`;
- the experts are saved under one key per weight, `mlp.experts.experts.linear_fc1.weight` `[E, 2F, H]` and
  `linear_fc2.weight` `[E, H, F]` (stacked over layers: `[L, E, ...]`), whatever the expert-parallel and expert
  tensor-parallel sizes: `SequentialMLP.sharded_state_dict` (the local spec's `local_experts.<n>`) maps each local
  expert onto the global expert axis, and the grouped MLP saves under the same keys. Each expert's fc1 is
  [gate; up], which is transformers 5's fused `experts.gate_up_proj` `[E, 2F, H]` as it is (one segment run per
  expert-parallel shard, no byte read), and fc2 its `experts.down_proj`;
- a shared expert (`mlp.shared_experts.linear_fc1/fc2`, a dense SwiGLU MLP) behind a sigmoid gate
  (`moe_shared_expert_gate`: `mlp.shared_experts.gate_weight` `[1, H]`) is Qwen2-MoE's `mlp.shared_expert.*` and
  `mlp.shared_expert_gate.weight`.
The router's softmax over the top-k logits (`moe_router_pre_softmax` false) is Mixtral's and Qwen3-MoE's softmax
over all experts, top-k, renormalised; a softmax over all experts without renormalising is Qwen3-MoE with
`norm_topk_prob` false. Shared experts without a gate (DeepSeek), sigmoid routers (`expert_bias`), grouped
routing and MoE on some layers only are refused naming what is not mapped, as is every shape that does not follow
from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttools.adapters import megatron_gpt as gpt
from ckpttools.adapters.base import ConfigNeededError
from ckpttools.adapters.segments import MappingError, expect_shape, renamed, split_rows
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.model.checkpoint import Checkpoint, TensorSource

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
QWEN_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
ROUTER = "mlp.router.weight"
FC1, FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
# The dense table's rules that a MoE layer keeps: attention, qk-norm, the two norms (not the dense MLP's fc1/fc2).
DENSE_KEPT = {k: rule for k, rule in gpt.LAYER.items() if not k.startswith("mlp.") or k.endswith("layer_norm_weight")}


@dataclass(frozen=True)
class Moe:
    """The dense shapes (`megatron_gpt.Dims`) and the MoE ones the config implies."""

    dense: gpt.Dims
    arch: str
    experts: int
    expert_ffn: int
    shared_ffn: int = 0  # Qwen2-MoE's shared expert

    @classmethod
    def of(cls, config: dict[str, Any]) -> Moe:
        try:
            arch = config["architectures"][0]
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            shared_ffn = 0
            if arch in QWEN_MOE:
                if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
                    raise UnsupportedCheckpointError(
                        "config.json has dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step): "
                        "not mapped from Megatron yet"
                    )
                experts, expert_ffn = int(config["num_experts"]), int(config["moe_intermediate_size"])
                if arch == "Qwen2MoeForCausalLM":
                    shared_ffn = int(config["shared_expert_intermediate_size"])
                    if config.get("qkv_bias", True):  # Qwen2-MoE's default; a Megatron run with biases is refused
                        raise MappingError("config.json has qkv_bias (q/k/v biases), but the Megatron run saved no "
                                           "linear_qkv.bias: set qkv_bias false, or use the run's config")  # fmt: skip
            else:  # Mixtral: every layer is MoE, intermediate_size is each expert's
                experts, expert_ffn = int(config["num_local_experts"]), int(config["intermediate_size"])
            dense = gpt.Dims(
                hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
                groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads), ffn=expert_ffn,
                vocab=int(config["vocab_size"]), qk_norm=arch == "Qwen3MoeForCausalLM",
                tied=bool(config.get("tie_word_embeddings", False)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MappingError(f"config.json lacks a usable {e} for a Megatron MoE mapping") from e
        return cls(dense, arch, experts, expert_ffn, shared_ffn)


def router(src: TensorSource, name: str, m: Moe) -> TensorSource:
    return renamed(expect_shape(src, (m.experts, m.dense.hidden), "num_experts and hidden_size"), name)


def experts_fc1(src: TensorSource, name: str, m: Moe) -> TensorSource:
    """[E, 2F, H], each expert [gate; up]: the fused `experts.gate_up_proj` as it is."""
    shape = (m.experts, 2 * m.expert_ffn, m.dense.hidden)
    return renamed(expect_shape(src, shape, "the experts' count, FFN size (x2: gate and up) and hidden_size"), name)


def experts_fc2(src: TensorSource, name: str, m: Moe) -> TensorSource:
    shape = (m.experts, m.dense.hidden, m.expert_ffn)
    return renamed(expect_shape(src, shape, "the experts' count, hidden_size and FFN size"), name)


def shared_fc1(src: TensorSource, names: tuple[str, ...], m: Moe) -> list[TensorSource]:
    """The shared expert's fc1 = [gate; up]."""
    expect_shape(src, (2 * m.shared_ffn, m.dense.hidden), "shared_expert_intermediate_size and hidden_size")
    return split_rows(src, (m.shared_ffn, m.shared_ffn), names)


def shared_fc2(src: TensorSource, names: tuple[str, ...], m: Moe) -> list[TensorSource]:
    shape = (m.dense.hidden, m.shared_ffn)
    return [renamed(expect_shape(src, shape, "hidden_size and shared_expert_intermediate_size"), names[0])]


def shared_gate(src: TensorSource, names: tuple[str, ...], m: Moe) -> list[TensorSource]:
    return [renamed(expect_shape(src, (1, m.dense.hidden), "hidden_size (one sigmoid gate)"), names[0])]


SHARED_LAYER = {
    "mlp.shared_experts.linear_fc1.weight": (("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                                             shared_fc1),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), shared_fc2),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), shared_gate),
}  # fmt: skip
MOE_LAYER = {
    ROUTER: ("mlp.gate.weight", router),
    FC1: ("mlp.experts.gate_up_proj", experts_fc1),
    FC2: ("mlp.experts.down_proj", experts_fc2),
}


class MegatronMoe:
    convention = "megatron-core"
    architectures = ARCHITECTURES

    def claims(self, ckpt: Checkpoint) -> bool:
        """A Megatron checkpoint with a MoE router (stacked or per layer); dense ones are `megatron_gpt`'s."""
        return ckpt.layout.kind == "megatron" and any(
            k.endswith(ROUTER) and k.startswith(gpt.STACKED) for k in ckpt.keys
        )

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        if given is not None:
            arch = (given.get("architectures") or [None])[0]
            if arch not in ARCHITECTURES:
                raise UnsupportedCheckpointError(
                    f"--config names {arch or 'no architecture'}; Megatron GPT checkpoints with MoE layers are "
                    f"mapped to {' or '.join(ARCHITECTURES)} so far"
                )
            return dict(given), False
        args = ckpt.layout.details.get("args")
        if not args:
            why = ckpt.layout.details.get("args_problem") or "it was saved without the run's arguments"
            raise ConfigNeededError(
                f"{ckpt.location.tag_dir} keeps Megatron's names and {why}: pass --config with the Hugging Face "
                f"config.json of the model ({' or '.join(ARCHITECTURES)}) to map them"
            )
        return config_from_args(args), True

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        m = Moe.of(config)
        d = m.dense
        sources = {s.name: s for s in ckpt.sources(ckpt.train_dtype)}
        out: dict[str, TensorSource] = {}
        used: set[str] = set()
        for name, (targets, op) in gpt.TOP.items():
            if name in sources:
                used.add(name)
                gpt._put(out, op(sources[name], targets, d))
        for short_name, (targets, op) in DENSE_KEPT.items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, op(src, tuple(f"model.layers.{i}.{t}" for t in targets), d))
        for short_name, (target, moe_op) in MOE_LAYER.items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, [moe_op(src, f"model.layers.{i}.{target}", m)])
        for short_name, (targets, shared_op) in SHARED_LAYER.items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, shared_op(src, tuple(f"model.layers.{i}.{t}" for t in targets), m))
        unused = sorted(set(sources) - used)
        if unused:
            raise UnsupportedCheckpointError(
                f"{unused[0]} has no rule in the Megatron MoE -> {m.arch} mapping ({len(unused)} such tensors); "
                "shared experts without a gate, sigmoid routers' expert_bias, MLA and biases are not mapped yet"
            )
        if "lm_head.weight" in out and d.tied:
            raise MappingError("output_layer.weight: the run kept its own output layer, but config.json ties word "
                               "embeddings (tie_word_embeddings true): the output layer would be lost")  # fmt: skip
        if "lm_head.weight" not in out and not d.tied:
            raise MappingError("output_layer.weight is absent (tied to the embedding in the run?), but config.json "
                               "does not tie word embeddings: lm_head would load random")  # fmt: skip
        expected = [n for n in _order(m) if not (d.tied and n == "lm_head.weight")]
        missing = [n for n in expected if n not in out]
        if missing:  # from_pretrained would fill it with random weights at exit 0
            raise MappingError(f"{missing[0]} has no Megatron tensor ({len(missing)} missing); a layer's weights are "
                               "absent from the checkpoint, or the config is not the run's")  # fmt: skip
        return [out[n] for n in expected], []


def _order(m: Moe) -> list[str]:
    """The Hugging Face state-dict order (what save_pretrained writes)."""
    names = ["model.embed_tokens.weight"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for i in range(m.dense.layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if m.dense.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        mlp = [*experts, "mlp.gate.weight"] if m.arch == "Qwen3MoeForCausalLM" else ["mlp.gate.weight", *experts]
        if m.arch == "Qwen2MoeForCausalLM":
            mlp += [f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
            mlp += ["mlp.shared_expert_gate.weight"]
        names += [p + x for x in mlp]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


# --- config.json from Megatron-LM's arguments -----------------------------------------------------------------


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    """Mixtral (no qk-norm), Qwen3-MoE (qk-norm) or Qwen2-MoE (a gated shared expert): the dense GPT's config
    (its refusals included) plus the MoE fields, or a refusal naming the MoE feature not mapped yet."""
    _refuse_unmapped(args)
    dense_args = {
        **args,
        "num_experts": None,
        "qk_layernorm": False,
        "moe_shared_expert_intermediate_size": None,
    }  # the dense refusals, without MoE's
    config = gpt.config_from_args(dense_args)
    topk, experts = int(args.get("moe_router_topk") or 2), int(args["num_experts"])
    expert_ffn = int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
    common = {"num_experts_per_tok": topk, "router_aux_loss_coef": 0.0, "output_router_logits": False}
    if args.get("moe_shared_expert_intermediate_size"):
        config.update(common, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=experts,
                      moe_intermediate_size=expert_ffn, norm_topk_prob=not args.get("moe_router_pre_softmax"),
                      shared_expert_intermediate_size=int(args["moe_shared_expert_intermediate_size"]),
                      decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=False, use_sliding_window=False)  # fmt: skip
    elif args.get("qk_layernorm"):
        config.update(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                      moe_intermediate_size=expert_ffn, norm_topk_prob=not args.get("moe_router_pre_softmax"),
                      decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    else:
        config.update(common, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      intermediate_size=expert_ffn, router_jitter_noise=0.0, sliding_window=None)  # fmt: skip
        for key in ("mlp_bias", "attention_bias"):  # Llama's, not Mixtral's
            config.pop(key, None)
    return config


def _refuse_unmapped(args: dict[str, Any]) -> None:
    scaling = args.get("moe_router_topk_scaling_factor")
    checks = [
        (not args.get("moe_shared_expert_intermediate_size") or bool(args.get("moe_shared_expert_gate")),
         "shared experts without a gate (DeepSeek's)"),
        (not (args.get("moe_shared_expert_intermediate_size") and args.get("qk_layernorm")),
         "a shared expert with qk-norm (no transformers class has both with this attention)"),
        (not args.get("moe_shared_expert_glu_interleave_size"), "an interleaved shared-expert fc1"),
        (args.get("moe_router_score_function", "softmax") == "softmax",
         f"a {args.get('moe_router_score_function')} MoE router"),
        (not args.get("moe_router_enable_expert_bias"), "a router expert_bias"),
        (not args.get("moe_router_num_groups"), "grouped routing (moe_router_num_groups)"),
        (scaling in (None, 1, 1.0), f"a top-k scaling factor {scaling}"),
        (str(args.get("moe_layer_freq") or 1) == "1", "MoE on some layers only (moe_layer_freq)"),
        (not args.get("moe_router_pre_softmax") or bool(args.get("qk_layernorm"))
         or bool(args.get("moe_shared_expert_intermediate_size")),
         "an unrenormalised top-k (moe_router_pre_softmax) in a Mixtral-like model (Mixtral renormalises)"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise UnsupportedCheckpointError(
                f"the Megatron run uses {what}, which the Mixtral/Qwen-MoE mapping does not cover yet; nothing written"
            )
    if not args.get("num_experts"):
        raise ConfigNeededError("the run's arguments lack num_experts for its MoE router: pass --config")


ADAPTER = MegatronMoe()

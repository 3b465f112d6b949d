"""Megatron-Core GPT with MoE layers (`torch_dist`) -> Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 (...ForCausalLM).

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
  `mlp.shared_expert_gate.weight`;
- DeepSeek-V3: multi-latent attention (`linear_q_down_proj` / `q_layernorm` / `linear_q_up_proj` or
  `linear_q_proj`, `linear_kv_down_proj` = [kv latent; shared rope key], `kv_layernorm`, `linear_kv_up_proj`
  per head [k nope; v]: HF's q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
  as they are; Megatron's MLA RoPE is always the interleaved one, HF's `rope_interleave`), a sigmoid router with
  `expert_bias` (`mlp.gate.e_score_correction_bias`), group-limited routing, top-k scaling
  (`routed_scaling_factor`) and a shared expert without a gate (`mlp.shared_experts.*`).
The router's softmax over the top-k logits (`moe_router_pre_softmax` false) is Mixtral's and Qwen3-MoE's softmax
over all experts, top-k, renormalised; a softmax over all experts without renormalising is Qwen3-MoE with
`norm_topk_prob` false. Shared experts without a gate (DeepSeek), sigmoid routers (`expert_bias`), grouped
routing and MoE on some layers only are refused naming what is not mapped, as is every shape that does not follow
from the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpttools.adapters import megatron_gpt as gpt
from ckpttools.adapters.base import ConfigNeededError
from ckpttools.adapters.segments import MappingError, expect_shape, renamed, split_rows
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.model.checkpoint import Checkpoint, TensorSource

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK = "DeepseekV3ForCausalLM"
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
    shared_ffn: int = 0  # Qwen2-MoE's and DeepSeek's shared expert
    mla: tuple[int, int, int, int, int] | None = None  # DeepSeek: q_lora_rank (0: none), kv_lora_rank, nope, rope, v

    @classmethod
    def of(cls, config: dict[str, Any]) -> Moe:
        try:
            arch = config["architectures"][0]
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            shared_ffn, mla = 0, None
            if arch == DEEPSEEK:
                if int(config.get("first_k_dense_replace") or 0):
                    raise UnsupportedCheckpointError("config.json has dense layers first (first_k_dense_replace): "
                                                     "not mapped from Megatron yet")  # fmt: skip
                experts, expert_ffn = int(config["n_routed_experts"]), int(config["moe_intermediate_size"])
                shared_ffn = expert_ffn * int(config.get("n_shared_experts") or 0)
                mla = (
                    int(config.get("q_lora_rank") or 0),
                    int(config["kv_lora_rank"]),
                    int(config["qk_nope_head_dim"]),
                    int(config["qk_rope_head_dim"]),
                    int(config["v_head_dim"]),
                )
            elif arch in QWEN_MOE:
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
                head_dim=mla[4] if mla else int(config.get("head_dim") or hidden // heads), ffn=expert_ffn,
                vocab=int(config["vocab_size"]), qk_norm=arch == "Qwen3MoeForCausalLM",
                tied=bool(config.get("tie_word_embeddings", False)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MappingError(f"config.json lacks a usable {e} for a Megatron MoE mapping") from e
        return cls(dense, arch, experts, expert_ffn, shared_ffn, mla)


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


def expert_bias(src: TensorSource, name: str, m: Moe) -> TensorSource:
    """A buffer, in Megatron (fp32 whatever the model's dtype) and in transformers (`_keep_in_fp32_modules_strict`):
    written as one, a 16-bit output keeps it fp32 (`io.safetensors_writer.written_dtype`), since rounding it to
    bf16 changes which experts tokens are routed to."""
    bias = expect_shape(src, (m.experts,), "the experts' count")
    return TensorSource(name, bias.shape, bias.dtype, bias.segments, "buffer")


def _mla_op(rows_of: Callable[[Moe], int], cols_of: Callable[[Moe], int | None], why: str) -> Callable[..., Any]:
    """An MLA projection or norm kept as it is, its shape checked: [rows, cols] (cols None: a norm's [rows])."""

    def op(src: TensorSource, names: tuple[str, ...], m: Moe) -> list[TensorSource]:
        cols = cols_of(m)
        return [renamed(expect_shape(src, (rows_of(m),) if cols is None else (rows_of(m), cols), why), names[0])]

    return op


def _heads(m: Moe, width: int) -> int:
    return m.dense.heads * width


def _la(m: Moe) -> tuple[int, int, int, int, int]:
    """MLA's dims (q_lora_rank, kv_lora_rank, nope, rope, v); the rules using them apply to DeepSeek configs only."""
    return m.mla or (0, 0, 0, 0, 0)


_MLA = {  # (q_lora, kv_lora, nope, rope, v)
    "q_down": _mla_op(lambda m: _la(m)[0], lambda m: m.dense.hidden, "q_lora_rank and hidden_size"),
    "q_norm": _mla_op(lambda m: _la(m)[0], lambda m: None, "q_lora_rank"),
    "q_up": _mla_op(lambda m: _heads(m, _la(m)[2] + _la(m)[3]), lambda m: _la(m)[0],
                    "heads x (qk_nope_head_dim + qk_rope_head_dim) and q_lora_rank"),
    "q": _mla_op(lambda m: _heads(m, _la(m)[2] + _la(m)[3]), lambda m: m.dense.hidden,
                 "heads x (qk_nope_head_dim + qk_rope_head_dim) and hidden_size"),
    "kv_down": _mla_op(lambda m: _la(m)[1] + _la(m)[3], lambda m: m.dense.hidden,
                       "kv_lora_rank + qk_rope_head_dim and hidden_size"),
    "kv_norm": _mla_op(lambda m: _la(m)[1], lambda m: None, "kv_lora_rank"),
    "kv_up": _mla_op(lambda m: _heads(m, _la(m)[2] + _la(m)[4]), lambda m: _la(m)[1],
                     "heads x (qk_nope_head_dim + v_head_dim) and kv_lora_rank"),
}  # fmt: skip
MLA_LAYER = {  # two spellings of the fused norms: the local spec's own module, Transformer Engine's layer_norm_weight
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), _MLA["q_down"]),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), _MLA["q_norm"]),
    "self_attention.linear_q_up_proj.layer_norm_weight": (("self_attn.q_a_layernorm.weight",), _MLA["q_norm"]),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), _MLA["q_up"]),
    "self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), _MLA["q"]),
    "self_attention.linear_kv_down_proj.weight": (("self_attn.kv_a_proj_with_mqa.weight",), _MLA["kv_down"]),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), _MLA["kv_norm"]),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (("self_attn.kv_a_layernorm.weight",), _MLA["kv_norm"]),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), _MLA["kv_up"]),
}
# What a DeepSeek layer keeps of the dense table: the two norms and the output projection (linear_proj).
_MLA_KEEPS = ("linear_proj.weight", "linear_fc1.layer_norm_weight")
MLA_DENSE_KEPT = {k: rule for k, rule in DENSE_KEPT.items() if "norm" in k.split(".")[0] or k.endswith(_MLA_KEEPS)}
MOE_LAYER = {
    ROUTER: ("mlp.gate.weight", router),
    FC1: ("mlp.experts.gate_up_proj", experts_fc1),
    FC2: ("mlp.experts.down_proj", experts_fc2),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", expert_bias),
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
        return gpt.run_config(ckpt, given, ARCHITECTURES, "Megatron GPT checkpoints with MoE layers", config_from_args)

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
        for short_name, (targets, op) in (MLA_DENSE_KEPT if m.mla else DENSE_KEPT).items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, op(src, tuple(f"model.layers.{i}.{t}" for t in targets), d))
        for short_name, (targets, mla_op) in (MLA_LAYER if m.mla else {}).items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, mla_op(src, tuple(f"model.layers.{i}.{t}" for t in targets), m))
        for short_name, (target, moe_op) in MOE_LAYER.items():
            for i, src in gpt._layers(sources, short_name, d, used):
                gpt._put(out, [moe_op(src, f"model.layers.{i}.{target}", m)])
        for short_name, (targets, shared_op) in SHARED_LAYER.items():
            if m.arch == DEEPSEEK and short_name.endswith("gate_weight"):
                continue  # DeepSeek's shared expert has no gate: a gate_weight is left unused, refused below
            for i, src in gpt._layers(sources, short_name, d, used):
                names = tuple(f"model.layers.{i}.{_shared_name(t, m)}" for t in targets)
                gpt._put(out, shared_op(src, names, m))
        unused = sorted(set(sources) - used)
        if unused:
            raise UnsupportedCheckpointError(
                f"{unused[0]} has no rule in the Megatron MoE -> {m.arch} mapping ({len(unused)} such tensors); "
                "biases, and a sigmoid router's or MLA's tensors outside a DeepSeek-V3 config, are not mapped"
            )
        return gpt.in_class_order(out, _order(m), d.tied), _notes(m, config)


def _shared_name(target: str, m: Moe) -> str:
    """Qwen2-MoE's `mlp.shared_expert.*`, DeepSeek's `mlp.shared_experts.*`."""
    return target.replace("shared_expert.", "shared_experts.") if m.arch == DEEPSEEK else target


def _notes(m: Moe, config: dict[str, Any]) -> list[str]:
    eps = float(config.get("rms_norm_eps") or 1e-6)
    if m.mla and eps != 1e-6:  # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): the class's default eps
        note = f"transformers' DeepSeek-V3 normalises the MLA latents with eps 1e-6, the run with {eps:g}"
        return [f"{note}: logits differ from the run's by about that much"]
    return []


def _order(m: Moe) -> list[str]:
    """The Hugging Face state-dict order (what save_pretrained writes)."""
    names = ["model.embed_tokens.weight"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for i in range(m.dense.layers):
        p = f"model.layers.{i}."
        if m.mla:
            names += _order_deepseek(p, m)
            continue
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


def _order_deepseek(p: str, m: Moe) -> list[str]:
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if m.mla and m.mla[0] else ["q_proj"]
    attn += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    names = [f"{p}self_attn.{x}.weight" for x in attn]
    names += [f"{p}mlp.experts.gate_up_proj", f"{p}mlp.experts.down_proj", f"{p}mlp.gate.weight",
              f"{p}mlp.gate.e_score_correction_bias"]  # fmt: skip
    if m.shared_ffn:
        names += [f"{p}mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
    return [*names, f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]


# --- config.json from Megatron-LM's arguments -----------------------------------------------------------------


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    """Mixtral (no qk-norm), Qwen3-MoE (qk-norm) or Qwen2-MoE (a gated shared expert): the dense GPT's config
    (its refusals included) plus the MoE fields, or a refusal naming the MoE feature not mapped yet."""
    _refuse_unmapped(args)
    if args.get("multi_latent_attention"):
        return _deepseek_config(args)
    dense_args = {
        **args,
        "num_experts": None,
        "qk_layernorm": False,
        "moe_shared_expert_intermediate_size": None,
    }  # the dense refusals, without MoE's
    config = gpt.llama_config(dense_args)
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


def _deepseek_config(args: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3: the dense GPT's config for the common fields, MLA's and the sigmoid router's added."""
    # --rotary-interleaved stays refused (gpt's common refusals): MLA's own interleave (HF's rope_interleave) comes
    # on top of it in Megatron's rotate-half, which no transformers class does
    config = gpt.llama_config({**args, "num_experts": None, "qk_layernorm": False, "multi_latent_attention": False,
                                   "moe_shared_expert_intermediate_size": None, "group_query_attention": False,
                                   "moe_router_score_function": "softmax"})  # fmt: skip
    expert_ffn = int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
    shared = int(args.get("moe_shared_expert_intermediate_size") or 0)
    if shared % expert_ffn:
        raise UnsupportedCheckpointError(f"the Megatron run's shared expert FFN {shared} is not a multiple of the "
                                         f"experts' {expert_ffn} (DeepSeek's n_shared_experts)")  # fmt: skip
    heads, topk = int(args["num_attention_heads"]), int(args.get("moe_router_topk") or 2)
    rope = int(args["qk_pos_emb_head_dim"])
    scaling = args.get("moe_router_topk_scaling_factor")
    for key in ("mlp_bias", "head_dim"):
        config.pop(key, None)
    config.update(
        architectures=[DEEPSEEK], model_type="deepseek_v3", num_key_value_heads=heads,
        n_routed_experts=int(args["num_experts"]), num_experts_per_tok=topk, moe_intermediate_size=expert_ffn,
        n_shared_experts=shared // expert_ffn, n_group=int(args.get("moe_router_num_groups") or 1),
        topk_group=int(args.get("moe_router_group_topk") or 1), routed_scaling_factor=float(scaling or 1.0),
        norm_topk_prob=topk > 1, first_k_dense_replace=0, q_lora_rank=args.get("q_lora_rank") or None,
        kv_lora_rank=int(args["kv_lora_rank"]), qk_nope_head_dim=int(args["qk_head_dim"]), qk_rope_head_dim=rope,
        v_head_dim=int(args["v_head_dim"]), head_dim=rope, rope_interleave=True, attention_bias=False,
    )  # fmt: skip
    return config


def _refuse_unmapped(args: dict[str, Any]) -> None:
    if args.get("multi_latent_attention"):
        return _refuse_unmapped_deepseek(args)
    scaling = args.get("moe_router_topk_scaling_factor")
    checks = [
        (not args.get("add_bias_linear") and not args.get("add_qkv_bias"), "linear biases"),
        (not args.get("use_rope_scaling"), "Llama 3.1's RoPE scaling"),
        (not args.get("window_size"), f"sliding-window attention (--window-size {args.get('window_size')})"),
        (not args.get("rotary_seq_len_interpolation_factor"), "RoPE position interpolation"),
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


def _refuse_unmapped_deepseek(args: dict[str, Any]) -> None:
    """What DeepSeek-V3's transformers class computes: a sigmoid router (renormalised when top-k > 1, as Megatron
    does for sigmoid), group scores as the sum of each group's best 2 experts (Megatron: top-k / group top-k)."""
    groups, group_topk = int(args.get("moe_router_num_groups") or 1), int(args.get("moe_router_group_topk") or 1)
    topk = int(args.get("moe_router_topk") or 2)
    checks = [
        (not args.get("add_bias_linear") and not args.get("add_qkv_bias"), "linear biases with MLA"),
        (not args.get("window_size"), "sliding-window attention with MLA"),
        (not args.get("rotary_seq_len_interpolation_factor"), "RoPE position interpolation with MLA"),
        (args.get("moe_router_score_function") == "sigmoid",
         f"multi-latent attention with a {args.get('moe_router_score_function', 'softmax')} router (DeepSeek-V2)"),
        (args.get("rope_type", "yarn") == "rope", f"MLA with {args.get('rope_type', 'yarn')} RoPE (YaRN)"),
        (groups == 1 or topk // group_topk == 2,
         f"group-limited routing scoring groups by their best {topk // group_topk} experts (DeepSeek-V3: 2)"),
        (not args.get("moe_shared_expert_gate"), "a gated shared expert with MLA"),
        (str(args.get("moe_layer_freq") or 1) == "1", "MoE on some layers only (first_k_dense_replace)"),
        (not args.get("moe_router_pre_softmax"), "a pre-softmax sigmoid router"),
        (not args.get("moe_shared_expert_glu_interleave_size"), "an interleaved shared-expert fc1"),
        (bool(args.get("kv_lora_rank")) and bool(args.get("qk_pos_emb_head_dim")), "MLA without its dimensions"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise UnsupportedCheckpointError(
                f"the Megatron run uses {what}, which the DeepSeek-V3 mapping does not cover yet; nothing written"
            )


ADAPTER = MegatronMoe()

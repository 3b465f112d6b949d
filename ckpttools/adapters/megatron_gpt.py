"""Megatron-Core GPT (`torch_dist`) -> LlamaForCausalLM (GQA, SwiGLU, RMSNorm, RoPE) or Qwen3ForCausalLM (qk-norm).

Megatron's conventions (megatron/core/transformer/*, checked against Megatron-Bridge's `param_mapping.py`):
- homogeneous layer stacks are one key with a leading layer axis (`decoder.layers.<x>` `[L, ...]`); per-layer keys
  (`decoder.layers.<i>.<x>`) otherwise;
- `linear_qkv` rows are grouped per query group: [q of heads/groups heads, k, v] x groups, each head `kv_channels`
  rows, whatever the TP size;
- `linear_fc1` (SwiGLU) = [all gate; all up]; with `singleton_local_shards` it is `weight_w` (gate) / `weight_v` (up);
- the norms are fused into the next linear (`linear_qkv.layer_norm_weight` is the input norm,
  `linear_fc1.layer_norm_weight` the post-attention norm; the local spec saves them under these names too);
- the vocabulary is padded (`padded_vocab_size`): rows past the config's `vocab_size` are dropped.

The table (`TOP`, `LAYER`) says, for each Megatron name, which Hugging Face names it becomes and by which operation;
`tensors` applies it. Every shape is checked against the config before any byte is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpttools.adapters.base import ConfigNeededError
from ckpttools.adapters.segments import (
    MappingError,
    expect_shape,
    grouped_rows,
    layer,
    renamed,
    rows,
    split_rows,
)
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.model.checkpoint import Checkpoint, TensorSource

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class Dims:
    """The shapes the config implies."""

    hidden: int
    layers: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    qk_norm: bool
    tied: bool

    @classmethod
    def of(cls, config: dict[str, Any]) -> Dims:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
                groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads), ffn=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]), qk_norm=config["architectures"][0] == "Qwen3ForCausalLM",
                tied=bool(config.get("tie_word_embeddings", False)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MappingError(f"config.json lacks a usable {e} for a Megatron GPT mapping") from e


# An operation: (source tensor, HF names, dims, what the shape is checked against) -> HF tensors.
Op = Callable[[TensorSource, tuple[str, ...], Dims], list[TensorSource]]


def same(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(src, names[0])]


def norm(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(expect_shape(src, (d.hidden,), "hidden_size"), names[0])]


def head_norm(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(expect_shape(src, (d.head_dim,), "head_dim"), names[0])]


def qkv(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """Per query group [q x heads/groups, k, v] -> q, k, v (each a group's blocks in group order)."""
    if d.heads % d.groups:
        raise MappingError(f"{src.name}: {d.heads} heads do not divide into {d.groups} query groups")
    per = d.heads // d.groups
    expect_shape(src, ((d.heads + 2 * d.groups) * d.head_dim, *src.shape[1:]), "heads, groups and head_dim")
    if src.shape[1:] not in ((d.hidden,), ()):
        raise MappingError(f"{src.name} is {list(src.shape)}: rows of {d.hidden} (hidden_size) expected")
    return grouped_rows(src, d.groups, (per * d.head_dim, d.head_dim, d.head_dim), names)


def halves(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """SwiGLU fc1 = [gate; up]."""
    expect_shape(src, (2 * d.ffn, d.hidden), "intermediate_size and hidden_size")
    return split_rows(src, (d.ffn, d.ffn), names)


def proj(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(expect_shape(src, (d.hidden, d.heads * d.head_dim), "hidden, heads and head_dim"), names[0])]


def up_half(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(expect_shape(src, (d.ffn, d.hidden), "intermediate_size and hidden_size"), names[0])]


def down(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    return [renamed(expect_shape(src, (d.hidden, d.ffn), "hidden_size and intermediate_size"), names[0])]


def vocab(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """Padded vocabulary rows dropped: the first `vocab_size` rows (Megatron pads at the end)."""
    if len(src.shape) != 2 or src.shape[1] != d.hidden or src.shape[0] < d.vocab:
        raise MappingError(
            f"{src.name} is {list(src.shape)}, but vocab_size {d.vocab} x hidden_size {d.hidden} must fit in it; "
            "is the config the run's?"
        )
    return [rows(src, 0, d.vocab, names[0])]


# Megatron name -> (Hugging Face names, operation). Layer names are relative to `decoder.layers[.<i>]` and
# `model.layers.<i>`. Several Megatron spellings of one weight (Transformer Engine's fused norms, the local spec's
# own, singleton fc1 halves) map to the same Hugging Face name; a checkpoint holds one of them.
TOP: dict[str, tuple[tuple[str, ...], Op]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), vocab),
    "decoder.final_layernorm.weight": (("model.norm.weight",), norm),
    "output_layer.weight": (("lm_head.weight",), vocab),
}
LAYER: dict[str, tuple[tuple[str, ...], Op]] = {
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), norm),
    "input_layernorm.weight": (("input_layernorm.weight",), norm),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), qkv),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), head_norm),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), head_norm),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), proj),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), norm),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), norm),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), halves),
    "mlp.linear_fc1.weight_w": (("mlp.gate_proj.weight",), up_half),
    "mlp.linear_fc1.weight_v": (("mlp.up_proj.weight",), up_half),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), down),
}  # fmt: skip
STACKED = "decoder.layers."


class MegatronGpt:
    convention = "megatron-core"
    architectures = ARCHITECTURES

    def claims(self, ckpt: Checkpoint) -> bool:
        return ckpt.layout.kind == "megatron"

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        return run_config(ckpt, given, ARCHITECTURES, "Megatron GPT checkpoints", config_from_args)

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        d = Dims.of(config)
        sources = {s.name: s for s in ckpt.sources(ckpt.train_dtype)}
        out: dict[str, TensorSource] = {}
        used: set[str] = set()
        for name, (targets, op) in TOP.items():
            if name in sources:
                used.add(name)
                _put(out, op(sources[name], targets, d))
        for short_name, (targets, op) in LAYER.items():
            for i, src in _layers(sources, short_name, d, used):
                _put(out, op(src, tuple(f"model.layers.{i}.{t}" for t in targets), d))
        unused = sorted(set(sources) - used)
        if unused:
            raise UnsupportedCheckpointError(
                f"{unused[0]} has no rule in the Megatron GPT -> {config['architectures'][0]} mapping "
                f"({len(unused)} such tensors); MoE, MLA and biases are not mapped yet"
            )
        return in_class_order(out, _order(d), d.tied), []


def in_class_order(out: dict[str, TensorSource], order: list[str], tied: bool) -> list[TensorSource]:
    """The mapped tensors in the class's order, every weight it has present: an output layer the config ties away,
    a tie the run did not make, or a weight no Megatron tensor gives is refused (from_pretrained would lose the
    output layer, or fill the weight with random values, at exit 0)."""
    if "lm_head.weight" in out and tied:
        raise MappingError("output_layer.weight: the run kept its own output layer, but config.json ties word "
                           "embeddings (tie_word_embeddings true): the output layer would be lost")  # fmt: skip
    if "lm_head.weight" not in out and not tied:
        raise MappingError("output_layer.weight is absent (tied to the embedding in the run?), but config.json "
                           "does not tie word embeddings: lm_head would load random")  # fmt: skip
    expected = [n for n in order if not (tied and n == "lm_head.weight")]
    missing = [n for n in expected if n not in out]
    if missing:
        raise MappingError(f"{missing[0]} has no Megatron tensor ({len(missing)} missing); a layer's weights are "
                           "absent from the checkpoint, or the config is not the run's")  # fmt: skip
    return [out[n] for n in expected]


def _put(out: dict[str, TensorSource], tensors: list[TensorSource]) -> None:
    for t in tensors:
        if t.name in out:
            raise MappingError(f"{t.name} comes from two Megatron tensors; the checkpoint mixes conventions")
        out[t.name] = t


def _layers(
    sources: dict[str, TensorSource], short_name: str, d: Dims, used: set[str]
) -> list[tuple[int, TensorSource]]:
    """Layer i's tensor of `short_name`: from the stacked `[L, ...]` key, or the per-layer keys."""
    stacked = sources.get(STACKED + short_name)
    if stacked is not None:
        used.add(stacked.name)
        if not stacked.shape or stacked.shape[0] != d.layers:
            raise MappingError(f"{stacked.name} is {list(stacked.shape)}: {d.layers} layers (num_hidden_layers) "
                               "expected on its leading axis; is the config the run's?")  # fmt: skip
        return [(i, layer(stacked, i, f"{stacked.name}[{i}]")) for i in range(d.layers)]
    found = []
    for i in range(d.layers):
        src = sources.get(f"{STACKED}{i}.{short_name}")
        if src is not None:
            used.add(src.name)
            found.append((i, src))
    extra = [n for n in sources if n.startswith(f"{STACKED}{d.layers}.") and n.endswith(short_name)]
    if extra:
        raise MappingError(f"{extra[0]}: the checkpoint has more than {d.layers} layers (num_hidden_layers)")
    return found


def _order(d: Dims) -> list[str]:
    """The Hugging Face state-dict order (what save_pretrained writes)."""
    names = ["model.embed_tokens.weight"]
    for i in range(d.layers):
        p = f"model.layers.{i}."
        attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
        names += [f"{p}self_attn.{m}.weight" for m in attn]
        if d.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        names += [f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


# --- config.json from Megatron-LM's arguments -----------------------------------------------------------------


def run_config(
    ckpt: Checkpoint, given: dict[str, Any] | None, architectures: tuple[str, ...], what: str,
    from_args: Callable[[dict[str, Any]], dict[str, Any]],
) -> tuple[dict[str, Any], bool]:  # fmt: skip
    """The config.json a Megatron checkpoint is mapped with, and whether it was generated: --config's (naming one
    of `architectures`), else `from_args` of the run's Megatron arguments; neither is ConfigNeededError."""
    if given is not None:
        arch = (given.get("architectures") or [None])[0]
        if arch not in architectures:
            raise UnsupportedCheckpointError(
                f"--config names {arch or 'no architecture'}; {what} are mapped to {' or '.join(architectures)} so far"
            )
        return dict(given), False
    args = ckpt.layout.details.get("args")
    if not args:
        why = ckpt.layout.details.get("args_problem") or "it was saved without the run's arguments"
        raise ConfigNeededError(
            f"{ckpt.location.tag_dir} keeps Megatron's names and {why}: pass --config with the Hugging Face "
            f"config.json of the model ({' or '.join(architectures)}) to map them"
        )
    return from_args(args), True


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config of the model the args describe, or a refusal naming what is not mapped yet."""
    _refuse_unmapped(args)
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    qk_norm = bool(args.get("qk_layernorm"))
    vocab = args.get("vocab_size") or args.get("padded_vocab_size")
    if not vocab:
        raise ConfigNeededError("the run's arguments give no vocabulary size: pass --config")
    theta = args.get("rotary_base") or 10000
    return {
        "architectures": ["Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if qk_norm else "llama",
        "hidden_size": hidden,
        "intermediate_size": int(args.get("ffn_hidden_size") or 4 * hidden),
        "num_hidden_layers": int(args["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(args.get("kv_channels") or hidden // heads),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        "rms_norm_eps": float(args.get("layernorm_epsilon") or args.get("norm_epsilon") or 1e-5),
        "rope_theta": float(theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)},
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": float(args.get("init_method_std") or 0.02),
    }


def _refuse_unmapped(args: dict[str, Any]) -> None:
    checks = [
        (args.get("normalization", "LayerNorm") == "RMSNorm", f"normalization {args.get('normalization')}"),
        (bool(args.get("swiglu")), "a non-SwiGLU MLP"),
        (args.get("position_embedding_type", "learned_absolute") == "rope",
         f"position embeddings {args.get('position_embedding_type')}"),
        (not args.get("add_bias_linear") and not args.get("add_qkv_bias"), "linear biases"),
        (not args.get("num_experts"), "MoE experts (adapters.megatron_moe maps those it can)"),
        (not args.get("multi_latent_attention"), "multi-latent attention"),
        (not args.get("use_rope_scaling"), "RoPE scaling"),
        (float(args.get("rotary_percent") or 1.0) == 1.0, "partial rotary embeddings"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise UnsupportedCheckpointError(
                f"the Megatron run uses {what}, which the Llama/Qwen3 mapping does not cover yet; nothing written"
            )
    for key in ("hidden_size", "num_attention_heads", "num_layers"):
        if not args.get(key):
            raise ConfigNeededError(f"the run's arguments lack {key}: pass --config")


ADAPTER = MegatronGpt()

"""Megatron-Core GPT (`torch_dist`) -> LlamaForCausalLM (GQA, SwiGLU, RMSNorm, RoPE; Llama 3.1's RoPE scaling;
`--add-bias-linear`'s biases), MistralForCausalLM (`--window-size (left, 0)`: sliding_window = left + 1),
Qwen2ForCausalLM (`--add-qkv-bias`), Qwen3ForCausalLM (qk-norm), StableLmForCausalLM (LayerNorm + SwiGLU + RoPE,
partial with `--rotary-percent`), or GPTBigCodeForCausalLM (the classic Megatron GPT: LayerNorm, GeLU, learned
absolute positions, biases, tied).

Megatron's conventions (megatron/core/transformer/*, checked against Megatron-Bridge's `param_mapping.py`):
- homogeneous layer stacks are one key with a leading layer axis (`decoder.layers.<x>` `[L, ...]`); per-layer keys
  (`decoder.layers.<i>.<x>`) otherwise;
- `linear_qkv` rows are grouped per query group: [q of heads/groups heads, k, v] x groups, each head `kv_channels`
  rows, whatever the TP size;
- `linear_fc1` (SwiGLU) = [all gate; all up]; with `singleton_local_shards` it is `weight_w` (gate) / `weight_v` (up);
- the norms are fused into the next linear (`linear_qkv.layer_norm_weight` is the input norm,
  `linear_fc1.layer_norm_weight` the post-attention norm; the local spec saves them under these names too);
- the vocabulary is padded (`padded_vocab_size`): rows past the config's `vocab_size` are dropped;
- biases (`linear_qkv.bias` grouped like its rows, `linear_fc1.bias` = [gate; up]) follow their weights;
- the classic GPT's `linear_qkv` with as many query groups as heads is per head [q; k; v]: GPTBigCode's `c_attn`
  (multi_query false) as it is, no row moved. (One group would be [all q; k; v], its multi_query true; no save of
  it has been checked, tensor-parallel 2 needs 2 groups: refused.)
What changes the computation and no target class has (interleaved or partial RoPE, zero-centered norms, post-norm
residuals, sliding windows, ...) is refused from the run's arguments in one line, before anything is written.

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

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "StableLmForCausalLM", "GPTBigCodeForCausalLM")  # fmt: skip
BIGCODE, STABLELM = "GPTBigCodeForCausalLM", "StableLmForCausalLM"


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
    qkv_bias: bool = False  # q/k/v biases (Qwen2, Llama's attention_bias, the classic GPT)
    o_bias: bool = False  # o_proj's bias (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)
    norm_bias: bool = False  # LayerNorm's bias beside its weight (StableLM)

    @classmethod
    def of(cls, config: dict[str, Any]) -> Dims:
        try:
            arch = config["architectures"][0]
            if arch == BIGCODE:
                return cls._bigcode(config)
            if arch == STABLELM:
                return cls._stablelm(config)
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            attention_bias = bool(config.get("attention_bias", False)) and arch == "LlamaForCausalLM"
            return cls(
                hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
                groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads), ffn=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]), qk_norm=arch == "Qwen3ForCausalLM",
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias, o_bias=attention_bias,
                mlp_bias=bool(config.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MappingError(f"config.json lacks a usable {e} for a Megatron GPT mapping") from e

    @classmethod
    def _stablelm(cls, config: dict[str, Any]) -> Dims:
        """StableLM: LayerNorm with biases, SwiGLU without, q/k/v biases with use_qkv_bias, head_dim hidden/heads."""
        if config.get("qk_layernorm") or config.get("use_parallel_residual"):
            raise UnsupportedCheckpointError("config.json asks StableLM for per-head qk LayerNorms or parallel "
                                             "residuals: not mapped from Megatron")  # fmt: skip
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
            groups=int(config.get("num_key_value_heads") or heads), head_dim=hidden // heads,
            ffn=int(config["intermediate_size"]), vocab=int(config["vocab_size"]), qk_norm=False,
            tied=bool(config.get("tie_word_embeddings", False)), qkv_bias=bool(config.get("use_qkv_bias")),
            norm_bias=True,
        )  # fmt: skip

    @classmethod
    def _bigcode(cls, config: dict[str, Any]) -> Dims:
        """GPTBigCode: multi-head attention (as many query groups as heads), every linear biased."""
        hidden, heads = int(config["n_embd"]), int(config["n_head"])
        return cls(
            hidden=hidden, layers=int(config["n_layer"]), heads=heads, groups=1 if config.get("multi_query") else heads,
            head_dim=hidden // heads, ffn=int(config.get("n_inner") or 4 * hidden), vocab=int(config["vocab_size"]),
            qk_norm=False, tied=bool(config.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True,
            mlp_bias=True,
        )  # fmt: skip


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
    """SwiGLU fc1 = [gate; up] (its bias too)."""
    expect_shape(src, (2 * d.ffn, d.hidden)[: len(src.shape) or 1], "intermediate_size and hidden_size")
    return split_rows(src, (d.ffn, d.ffn), names)


def hidden_bias(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """A bias over the hidden size (linear_proj's, linear_fc2's, a LayerNorm's)."""
    return [renamed(expect_shape(src, (d.hidden,), "hidden_size"), names[0])]


def fused_qkv(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """The classic GPT's linear_qkv (weight or bias) as GPTBigCode's c_attn: per head [q; k; v] with a query group
    per head, [all q; k; v] with one group; the same rows in the same order (checked against the shape)."""
    if d.groups not in (1, d.heads):
        raise MappingError(f"{src.name}: {d.groups} query groups for {d.heads} heads; GPTBigCode has multi-head or "
                           "multi-query attention only")  # fmt: skip
    rows_ = (d.heads + 2 * d.groups) * d.head_dim
    return [renamed(expect_shape(src, (rows_, d.hidden)[: len(src.shape) or 1], "heads and query groups"), names[0])]


def fc1_plain(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """A non-gated fc1 (GeLU): weight [ffn, hidden] or bias [ffn]."""
    return [renamed(expect_shape(src, (d.ffn, d.hidden)[: len(src.shape) or 1], "n_inner and n_embd"), names[0])]


def fc2_plain(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """A non-gated fc2: weight [hidden, ffn] or bias [hidden]."""
    return [renamed(expect_shape(src, (d.hidden, d.ffn)[: len(src.shape) or 1], "n_embd and n_inner"), names[0])]


def positions(src: TensorSource, names: tuple[str, ...], d: Dims) -> list[TensorSource]:
    """Learned absolute position embeddings [max positions, hidden]."""
    if len(src.shape) != 2 or src.shape[1] != d.hidden:
        raise MappingError(f"{src.name} is {list(src.shape)}: [positions, {d.hidden} (hidden size)] expected")
    return [renamed(src, names[0])]


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
    "decoder.final_layernorm.bias": (("model.norm.bias",), hidden_bias),  # LayerNorm's (StableLM)
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
    # --add-qkv-bias (Qwen2) or --add-bias-linear (all four: Llama's attention_bias and mlp_bias)
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), qkv),
    "self_attention.linear_proj.bias": (("self_attn.o_proj.bias",), hidden_bias),
    "mlp.linear_fc1.bias": (("mlp.gate_proj.bias", "mlp.up_proj.bias"), halves),
    "mlp.linear_fc2.bias": (("mlp.down_proj.bias",), hidden_bias),
    # LayerNorm's biases (StableLM): Transformer Engine's fused spelling and the local spec's own
    "self_attention.linear_qkv.layer_norm_bias": (("input_layernorm.bias",), hidden_bias),
    "input_layernorm.bias": (("input_layernorm.bias",), hidden_bias),
    "mlp.linear_fc1.layer_norm_bias": (("post_attention_layernorm.bias",), hidden_bias),
    "pre_mlp_layernorm.bias": (("post_attention_layernorm.bias",), hidden_bias),
}  # fmt: skip
STACKED = "decoder.layers."

# The classic Megatron GPT -> GPTBigCodeForCausalLM (layers under `transformer.h.<i>`).
BIGCODE_TOP: dict[str, tuple[tuple[str, ...], Op]] = {
    "embedding.word_embeddings.weight": (("transformer.wte.weight",), vocab),
    "embedding.position_embeddings.weight": (("transformer.wpe.weight",), positions),
    "decoder.final_layernorm.weight": (("transformer.ln_f.weight",), norm),
    "decoder.final_layernorm.bias": (("transformer.ln_f.bias",), hidden_bias),
    "output_layer.weight": (("lm_head.weight",), vocab),
}
BIGCODE_LAYER: dict[str, tuple[tuple[str, ...], Op]] = {
    "self_attention.linear_qkv.layer_norm_weight": (("ln_1.weight",), norm),
    "self_attention.linear_qkv.layer_norm_bias": (("ln_1.bias",), hidden_bias),
    "input_layernorm.weight": (("ln_1.weight",), norm),
    "input_layernorm.bias": (("ln_1.bias",), hidden_bias),
    "self_attention.linear_qkv.weight": (("attn.c_attn.weight",), fused_qkv),
    "self_attention.linear_qkv.bias": (("attn.c_attn.bias",), fused_qkv),
    "self_attention.linear_proj.weight": (("attn.c_proj.weight",), proj),
    "self_attention.linear_proj.bias": (("attn.c_proj.bias",), hidden_bias),
    "mlp.linear_fc1.layer_norm_weight": (("ln_2.weight",), norm),
    "mlp.linear_fc1.layer_norm_bias": (("ln_2.bias",), hidden_bias),
    "pre_mlp_layernorm.weight": (("ln_2.weight",), norm),
    "pre_mlp_layernorm.bias": (("ln_2.bias",), hidden_bias),
    "mlp.linear_fc1.weight": (("mlp.c_fc.weight",), fc1_plain),
    "mlp.linear_fc1.bias": (("mlp.c_fc.bias",), fc1_plain),
    "mlp.linear_fc2.weight": (("mlp.c_proj.weight",), fc2_plain),
    "mlp.linear_fc2.bias": (("mlp.c_proj.bias",), fc2_plain),
}  # fmt: skip


def tables(arch: str) -> tuple[dict[str, tuple[tuple[str, ...], Op]], dict[str, tuple[tuple[str, ...], Op]], str]:
    """(top-level rules, per-layer rules, the Hugging Face layer prefix) for the architecture."""
    if arch == BIGCODE:
        return BIGCODE_TOP, BIGCODE_LAYER, "transformer.h"
    return TOP, LAYER, "model.layers"


class MegatronGpt:
    convention = "megatron-core"
    architectures = ARCHITECTURES

    def claims(self, ckpt: Checkpoint) -> bool:
        return ckpt.layout.kind == "megatron"

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        return run_config(ckpt, given, ARCHITECTURES, "Megatron GPT checkpoints", config_from_args)

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        d = Dims.of(config)
        arch = config["architectures"][0]
        top, per_layer, prefix = tables(arch)
        sources = {s.name: s for s in ckpt.sources(ckpt.train_dtype)}
        out: dict[str, TensorSource] = {}
        used: set[str] = set()
        for name, (targets, op) in top.items():
            if name in sources:
                used.add(name)
                _put(out, op(sources[name], targets, d))
        for short_name, (targets, op) in per_layer.items():
            for i, src in _layers(sources, short_name, d, used):
                _put(out, op(src, tuple(f"{prefix}.{i}.{t}" for t in targets), d))
        unused = sorted(set(sources) - used)
        if unused:
            raise UnsupportedCheckpointError(
                f"{unused[0]} has no rule in the Megatron GPT -> {arch} mapping ({len(unused)} such tensors); "
                "nothing written"
            )
        order = bigcode_order(d) if arch == BIGCODE else _order(d)
        return in_class_order(out, order, d.tied), padded_vocab_notes(ckpt, config)


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
    extra = [n for n in out if n not in expected]
    if extra:  # from_pretrained would drop it (a bias the config's class lacks): the model would compute otherwise
        raise MappingError(f"{extra[0]} comes from the checkpoint, but the config's class has no such weight "
                           f"({len(extra)} such tensors: biases without attention_bias/mlp_bias?); is the config "
                           "the run's?")  # fmt: skip
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
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            biased = d.o_bias if m == "o_proj" else d.qkv_bias
            names += [f"{p}self_attn.{m}.weight", *([f"{p}self_attn.{m}.bias"] if biased else [])]
        if d.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        for m in ("gate_proj", "up_proj", "down_proj"):
            names += [f"{p}mlp.{m}.weight", *([f"{p}mlp.{m}.bias"] if d.mlp_bias else [])]
        for n in ("input_layernorm", "post_attention_layernorm"):
            names += [f"{p}{n}.weight", *([f"{p}{n}.bias"] if d.norm_bias else [])]
    return [*names, "model.norm.weight", *(["model.norm.bias"] if d.norm_bias else []), "lm_head.weight"]


def bigcode_order(d: Dims) -> list[str]:
    """GPTBigCodeForCausalLM's state-dict order (public: any classic Megatron GPT source maps onto the same)."""
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(d.layers):
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{m}.weight", f"transformer.h.{i}.{m}.bias"]
    return [*names, "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]


def padded_vocab_notes(ckpt: Checkpoint, config: dict[str, Any]) -> list[str]:
    """A note when the generated vocab_size is Megatron's padded one: Megatron-LM records `vocab_size` only for
    `--vocab-size` (a NullTokenizer); with a real tokenizer the args hold `padded_vocab_size` alone, so the rows
    past the tokenizer's last token (never trained, never produced by it) are kept."""
    args = ckpt.layout.details.get("args") or {}
    padded = args.get("padded_vocab_size")
    if args.get("vocab_size") or not padded or int(config.get("vocab_size") or 0) != int(padded):
        return []
    return [(f"vocab_size {padded} is the run's padded vocabulary (--make-vocab-size-divisible-by "
            f"{args.get('make_vocab_size_divisible_by', '?')}): its arguments record no tokenizer size, so the "
            "padding rows are kept; pass --config with the tokenizer's vocab_size to drop them")]  # fmt: skip


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
    """The Hugging Face config of the model the args describe, or a refusal naming what is not mapped yet: the
    classic GPT (LayerNorm, GeLU, learned absolute positions) as GPTBigCode, else the Llama family."""
    if _is_classic_gpt(args):
        return bigcode_config(args)
    if _is_stablelm(args):
        return stablelm_config(args)
    return llama_config(args)


def llama_config(args: dict[str, Any]) -> dict[str, Any]:
    """Llama (biases with --add-bias-linear, Llama 3.1's RoPE scaling), Mistral (--window-size), Qwen2
    (--add-qkv-bias alone) or Qwen3 (qk-norm); megatron_moe builds its MoE configs on this one."""
    _refuse_unmapped(args)
    window = _sliding_window(args)
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    qk_norm = bool(args.get("qk_layernorm"))
    linear_bias, qkv_bias = bool(args.get("add_bias_linear")), bool(args.get("add_qkv_bias"))
    arch, model_type = ("Qwen3ForCausalLM", "qwen3") if qk_norm else ("LlamaForCausalLM", "llama")
    if qkv_bias and not linear_bias and not qk_norm:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    theta = float(args.get("rotary_base") or 10000)
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(args.get("ffn_hidden_size") or 4 * hidden),
        "num_hidden_layers": int(args["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(args.get("kv_channels") or hidden // heads),
        "vocab_size": _vocab(args),
        "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        "rms_norm_eps": _epsilon(args),
        "rope_theta": theta,
        "rope_parameters": _rope(args, theta),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        "attention_bias": linear_bias,
        "mlp_bias": linear_bias,
        "attention_dropout": 0.0,
        "initializer_range": float(args.get("init_method_std") or 0.02),
    }
    if arch == "Qwen2ForCausalLM":  # q/k/v biases are Qwen2's own; it has no attention_bias or mlp_bias
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            config.pop(key)
        config.update(use_sliding_window=False, sliding_window=None)
    if window:
        if arch != "LlamaForCausalLM" or linear_bias:
            raise UnsupportedCheckpointError(f"the Megatron run uses sliding-window attention with "
                                             f"{'biases' if linear_bias else arch}, which no mapping here covers "
                                             "yet; nothing written")  # fmt: skip
        for key in ("attention_bias", "mlp_bias"):
            config.pop(key)
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    return config


def _sliding_window(args: dict[str, Any]) -> int | None:
    """Mistral's sliding_window for Megatron's --window-size (left, 0): Megatron's mask lets a token see the `left`
    tokens before it and itself (`get_sliding_window_causal_mask`), transformers' the `sliding_window - 1` before it
    (`kv_idx > q_idx - sliding_window`): sliding_window = left + 1. None without a window."""
    window = args.get("window_size")
    if not window:
        return None
    if not isinstance(window, (list, tuple)) or len(window) != 2 or int(window[1]) != 0:
        raise UnsupportedCheckpointError(f"the Megatron run's --window-size {window} looks ahead (or is not "
                                         "(left, 0)); no causal Hugging Face class does: nothing written")  # fmt: skip
    if args.get("window_attn_skip_freq"):
        raise UnsupportedCheckpointError("the Megatron run mixes sliding-window and full-attention layers "
                                         "(--window-attn-skip-freq), which no mapping here covers yet; nothing "
                                         "written")  # fmt: skip
    return int(window[0]) + 1


def _vocab(args: dict[str, Any]) -> int:
    vocab = args.get("vocab_size") or args.get("padded_vocab_size")
    if not vocab:
        raise ConfigNeededError("the run's arguments give no vocabulary size: pass --config")
    return int(vocab)


def _epsilon(args: dict[str, Any]) -> float:
    """`layernorm_epsilon` (Megatron-LM's args from TransformerConfig), `norm_epsilon` (its older --norm-epsilon)."""
    for key in ("layernorm_epsilon", "norm_epsilon"):
        if args.get(key) is not None:
            return float(args[key])
    return 1e-5


def _rope(args: dict[str, Any], theta: float) -> dict[str, Any]:
    """RoPE as transformers 5 reads it; `--use-rope-scaling` is Llama 3.1's (Megatron's `_apply_scaling`: the
    factor from --rope-scaling-factor, low 1, high 4 and 8192 original positions fixed in every release);
    `--rotary-seq-len-interpolation-factor` divides the positions, transformers' `linear` type the frequencies:
    the same angles."""
    interpolation = args.get("rotary_seq_len_interpolation_factor")
    if interpolation and args.get("use_rope_scaling"):
        raise UnsupportedCheckpointError(
            "the Megatron run uses both RoPE position interpolation and Llama 3.1's RoPE scaling, which no "
            "transformers RoPE type combines; nothing written"
        )
    if interpolation:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(interpolation)}
    if not args.get("use_rope_scaling"):
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": float(args.get("rope_scaling_factor") or 8.0),
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def _is_classic_gpt(args: dict[str, Any]) -> bool:
    """Megatron-LM's defaults: LayerNorm, GeLU (no --swiglu), learned absolute positions, no MoE, no qk-norm."""
    return (
        args.get("normalization", "LayerNorm") == "LayerNorm" and not args.get("swiglu")
        and args.get("position_embedding_type", "learned_absolute") == "learned_absolute"
        and not args.get("num_experts") and not args.get("qk_layernorm") and not args.get("multi_latent_attention")
    )  # fmt: skip


def _is_stablelm(args: dict[str, Any]) -> bool:
    """LayerNorm with SwiGLU and RoPE (StableLM's, whose partial rotary is Megatron's --rotary-percent)."""
    return (
        args.get("normalization", "LayerNorm") == "LayerNorm" and bool(args.get("swiglu"))
        and args.get("position_embedding_type", "learned_absolute") == "rope"
        and not args.get("num_experts") and not args.get("multi_latent_attention")
    )  # fmt: skip


def stablelm_config(args: dict[str, Any]) -> dict[str, Any]:
    """LayerNorm + SwiGLU + RoPE as StableLmForCausalLM: RoPE on the first rotary_percent of each head (both apply
    the non-interleaved rotation to `head[..., :rot]`), q/k/v biases with --add-qkv-bias; no other linear bias."""
    mapping = "the StableLM mapping"
    _refuse_common(args, mapping, partial_rotary=True)
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    checks = [
        (not args.get("add_bias_linear"), "biases on linear_proj and the MLP (--add-bias-linear) with LayerNorm"),
        (not args.get("qk_layernorm"), "qk-norm with LayerNorm"),
        (int(args.get("kv_channels") or hidden // heads) * heads == hidden, "kv_channels other than hidden/heads"),
        (not args.get("use_rope_scaling"), "Llama 3.1's RoPE scaling with LayerNorm"),
    ]  # fmt: skip
    _refuse(checks, mapping)
    theta, partial = float(args.get("rotary_base") or 10000), float(args.get("rotary_percent") or 1.0)
    return {
        "architectures": [STABLELM],
        "model_type": "stablelm",
        "hidden_size": hidden,
        "intermediate_size": int(args.get("ffn_hidden_size") or 4 * hidden),
        "num_hidden_layers": int(args["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "vocab_size": _vocab(args),
        "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        "layer_norm_eps": _epsilon(args),
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial},
        "use_qkv_bias": bool(args.get("add_qkv_bias")),
        "qk_layernorm": False,
        "use_parallel_residual": False,
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "initializer_range": float(args.get("init_method_std") or 0.02),
    }


def bigcode_config(args: dict[str, Any]) -> dict[str, Any]:
    """The classic Megatron GPT as GPTBigCodeForCausalLM: multi-head attention (query groups = heads), biases in
    every linear (or refused), exact or tanh GeLU."""
    _refuse_common(args, "the classic GPT (GPTBigCode) mapping")
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    checks = [
        (args.get("add_bias_linear", True), "linear layers without biases (--disable-bias-linear)"),
        (groups == heads, f"{groups} query groups for {heads} heads (mapped: multi-head attention)"),
        (int(args.get("kv_channels") or hidden // heads) * heads == hidden, "kv_channels other than hidden/heads"),
        (not args.get("squared_relu") and not args.get("quick_geglu"), "a squared-ReLU or quick-GeGLU MLP"),
    ]  # fmt: skip
    _refuse(checks, "the classic GPT (GPTBigCode) mapping")
    return {
        "architectures": [BIGCODE],
        "model_type": "gpt_bigcode",
        "n_embd": hidden,
        "n_layer": int(args["num_layers"]),
        "n_head": heads,
        "n_inner": int(args.get("ffn_hidden_size") or 4 * hidden),
        "n_positions": int(args.get("max_position_embeddings") or args.get("seq_length") or 1024),
        "vocab_size": _vocab(args),
        "layer_norm_epsilon": _epsilon(args),
        "activation_function": "gelu_pytorch_tanh" if args.get("openai_gelu") else "gelu",
        "multi_query": False,
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "scale_attn_weights": True,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "initializer_range": float(args.get("init_method_std") or 0.02),
        "bos_token_id": None,  # GPTBigCode's defaults are GPT-2's 50256; the run's tokenizer is not recorded
        "eos_token_id": None,
    }


def _refuse(checks: list[tuple[Any, str]], mapping: str) -> None:
    for ok, what in checks:
        if not ok:
            raise UnsupportedCheckpointError(
                f"the Megatron run uses {what}, which {mapping} does not cover yet; nothing written"
            )


def _refuse_common(
    args: dict[str, Any], mapping: str, *, partial_rotary: bool = False, window: bool = False, llama_rope: bool = False
) -> None:
    """What changes the computation in every mapping here and no target class has (each a Megatron-LM argument)."""
    softmax_scale = args.get("softmax_scale")
    checks = [
        (not args.get("rotary_interleaved"), "interleaved rotary embeddings (--rotary-interleaved)"),
        (not args.get("apply_residual_connection_post_layernorm"),
         "residual connections after the norm (--apply-residual-connection-post-layernorm)"),
        (not args.get("layernorm_zero_centered_gamma") and not args.get("apply_layernorm_1p"),
         "zero-centered norm weights (--apply-layernorm-1p)"),
        (window or not args.get("window_size"), f"sliding-window attention (--window-size {args.get('window_size')})"),
        (not args.get("no_rope_freq"), "RoPE skipped on some layers (--no-rope-freq)"),
        (args.get("softmax_type", "vanilla") == "vanilla", f"a {args.get('softmax_type')} softmax"),
        (not args.get("attention_output_gate"), "a gated attention output (--attention-output-gate)"),
        (not args.get("qk_l2_norm"), "L2-normalised queries and keys (--qk-l2-norm)"),
        (llama_rope or not args.get("rotary_seq_len_interpolation_factor"),
         "RoPE position interpolation (--rotary-seq-len-interpolation-factor)"),
        (not args.get("experimental_attention_variant"), f"{args.get('experimental_attention_variant')} attention"),
        (softmax_scale is None, f"an attention softmax scale of its own ({softmax_scale})"),
        (not args.get("heterogeneous_layers_config_path") and not args.get("heterogeneous_layers_config_encoded_json"),
         "heterogeneous layers"),
        (partial_rotary or float(args.get("rotary_percent") or 1.0) == 1.0,
         f"partial rotary embeddings ({args.get('rotary_percent')}) with RMSNorm"),
    ]  # fmt: skip
    _refuse(checks, mapping)


def _refuse_unmapped(args: dict[str, Any]) -> None:
    mapping = "the Llama/Qwen mapping"
    _refuse_common(args, mapping, window=True, llama_rope=True)  # Mistral's window, linear RoPE (llama_config)
    checks = [
        (args.get("normalization", "LayerNorm") == "RMSNorm",
         (f"{args.get('normalization', 'LayerNorm')} with {'SwiGLU' if args.get('swiglu') else 'this MLP'} "
         "(Llama and Qwen have RMSNorm; the classic GPT is LayerNorm, GeLU and learned positions; StableLM "
         "LayerNorm, SwiGLU and RoPE)")),
        (bool(args.get("swiglu")), "a non-SwiGLU MLP with RMSNorm"),
        (args.get("position_embedding_type", "learned_absolute") == "rope",
         f"position embeddings {args.get('position_embedding_type', 'learned_absolute')} with RMSNorm/SwiGLU"),
        (not args.get("num_experts"), "MoE experts (adapters.megatron_moe maps those it can)"),
        (not args.get("multi_latent_attention"), "multi-latent attention"),
        (not (args.get("qk_layernorm") and (args.get("add_bias_linear") or args.get("add_qkv_bias"))),
         "linear biases with qk-norm"),
    ]  # fmt: skip
    _refuse(checks, mapping)
    for key in ("hidden_size", "num_attention_heads", "num_layers"):
        if not args.get(key):
            raise ConfigNeededError(f"the run's arguments lack {key}: pass --config")


ADAPTER = MegatronGpt()

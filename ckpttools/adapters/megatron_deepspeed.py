"""Megatron-DeepSpeed 3D (`layer_XX-model_YY`, read by layouts.pipeline_tp / pipeline) -> LlamaForCausalLM (`--swiglu
--normalization rmsnorm --use-rotary-position-embeddings`) or GPTBigCodeForCausalLM (the classic GPT: LayerNorm, GeLU,
learned absolute positions, biases).

Megatron-DeepSpeed's `GPTModelPipe` is Megatron-LM's legacy GPT as a DeepSpeed PipelineModule: the layout merges the
TP shards and names every tensor by its pipeline layer (`<n>.self_attention.query_key_value.weight`, the tied
embedding as `tied_modules.embed.*`). Its tensors are those of Megatron-Core's local spec under older names, in the
same layout (checked against its code at 6acc370a and by the fixtures' logits):
- `query_key_value` rows per KV group [q of heads/groups heads, k, v] x groups (`[sq, b, nkv, nq/nkv + 2, hn]` in
  `ParallelAttention.forward`; multi-head: per head [q; k; v]), whatever the TP size;
- SwiGLU `dense_h_to_4h` = [gate; up] once the layout has merged the TP halves (`parameter_with_2_sub_params`);
- RoPE as Hugging Face's rotate_half (no row permutation); the vocabulary cut to `original_vocab_size` by the layout.
So this adapter is a rename table onto Megatron-Core's names (`LAYER_RENAMES`, `TOP_RENAMES`) plus the run's
arguments under Megatron-LM's names (`core_args`); adapters.megatron_gpt's table then maps both to Hugging Face's, as
it maps Megatron-Core's.

Megatron-DeepSpeed after #441 (FPDT, 2024-12; its args carry `ds_sequence_parallel_fpdt`) splits each TP rank's
`query_key_value` rows as [its q heads; its k heads; its v heads] (thirds of the rank's rows, so only multi-head
attention is consistent: GQA is refused, and so is RoPE, which its GPTModelPipe fails to build). Its rows are first
put back into the per-head order (`per_head_qkv`, a row permutation), whose TP size is the layout's.
"""

from __future__ import annotations

import re
from typing import Any

from ckpttools.adapters import megatron_gpt
from ckpttools.adapters.base import mapped_checkpoint
from ckpttools.adapters.segments import MappingError, permuted_rows, renamed
from ckpttools.errors import CkptError, UnsupportedCheckpointError
from ckpttools.io import dtypes
from ckpttools.model.checkpoint import Checkpoint, TensorSource

ARCHITECTURES = ("LlamaForCausalLM", "GPTBigCodeForCausalLM")
LAYOUTS = ("pipeline_tp", "pipeline")

# Megatron-DeepSpeed name (after the pipeline layer number) -> Megatron-Core's (after `decoder.layers.<i>.`).
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "post_attention_layernorm.bias": "pre_mlp_layernorm.bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
# The layers around the transformer layers: embedding (tied: `tied_modules.embed`), final norm, output layer.
TOP_RENAMES = {
    "word_embeddings.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
    "lm_head.weight": "output_layer.weight",
}
FINAL_NORM = {"weight": "decoder.final_layernorm.weight", "bias": "decoder.final_layernorm.bias"}
KEY_RE = re.compile(r"^(?P<layer>\d+|tied_modules\.embed)\.(?P<rest>.+)$")
QKV = "self_attention.query_key_value.weight"
QKV_RE = re.compile(r"^\d+\.self_attention\.query_key_value\.(weight|bias)$")


def after_fpdt(args: dict[str, Any]) -> bool:
    """Saved by Megatron-DeepSpeed after #441, which added the FPDT arguments (and the [q; k; v]-per-rank split)."""
    return "ds_sequence_parallel_fpdt" in args


def per_head_qkv(src: TensorSource, heads: int, tp: int) -> TensorSource:
    """Rows [q heads; k heads; v heads] of each TP rank in turn -> per head [q; k; v] (the order before #441)."""
    total = src.shape[0] if src.shape else 0
    if not heads or heads % tp or total % (3 * heads):
        raise MappingError(f"{src.name} is {list(src.shape)}: not 3 x {heads} heads over {tp} TP ranks")
    per_rank, local, dim = total // tp, heads // tp, total // (3 * heads)
    order = [t * per_rank + part * local * dim + h * dim + r
             for t in range(tp) for h in range(local) for part in range(3) for r in range(dim)]  # fmt: skip
    return permuted_rows(src, order, src.name)


class MegatronDeepSpeed:
    convention = "megatron-deepspeed"
    architectures = ARCHITECTURES

    def claims(self, ckpt: Checkpoint) -> bool:
        """Megatron-DeepSpeed's layer names (query_key_value and word embeddings) in a pipeline folder."""
        if ckpt.layout.kind not in LAYOUTS:
            return False
        names = set(ckpt.keys)
        return any(n.endswith("." + QKV) for n in names) and any(n.endswith(".word_embeddings.weight") for n in names)

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        what = "Megatron-DeepSpeed GPT checkpoints"
        return megatron_gpt.run_config(ckpt, given, ARCHITECTURES, what, lambda a: config_from_args(a, ckpt))

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        """Megatron-Core's names first (`core_names`), then Megatron-Core's table; a refusal names the tensor as this
        checkpoint names it."""
        # the fp32 masters (what zero_to_fp32 writes); a 16-bit output casts them as the engine does after each step
        sources = ckpt.sources(dtypes.FLOAT32)
        if after_fpdt(ckpt.layout.details.get("args") or {}):
            heads = int(config.get("n_head") or config.get("num_attention_heads") or 0)
            sources = [per_head_qkv(s, heads, ckpt.layout.tp) if QKV_RE.match(s.name) else s for s in sources]
        core = core_names(sources)
        try:
            return megatron_gpt.ADAPTER.tensors(mapped_checkpoint(ckpt, core), config)
        except CkptError as e:
            message = str(e)
            for ours, theirs in sorted(zip(core, sources, strict=True), key=lambda p: -len(p[0].name)):
                message = message.replace(ours.name, theirs.name)
            raise type(e)(message) from e


def core_names(sources: list[TensorSource]) -> list[TensorSource]:
    """Every tensor under Megatron-Core's name: transformer layer k (the k-th pipeline layer holding a
    query_key_value) -> `decoder.layers.k.*`; the layer after the last transformer layer holding only `weight`
    (and `bias`) is the final norm. A tensor with no rule is refused by name."""
    layers = sorted({int(m["layer"]) for s in sources if (m := KEY_RE.match(s.name)) and m["rest"] == QKV})
    if layers != list(range(layers[0] if layers else 0, (layers[0] if layers else 0) + len(layers))):
        raise MappingError(f"the transformer layers are pipeline layers {layers}: not consecutive (a layer's files "
                           "are missing or from another run)")  # fmt: skip
    index = {n: i for i, n in enumerate(layers)}
    out = []
    for src in sources:
        m = KEY_RE.match(src.name)
        target = None
        if m and m["layer"].isdigit() and int(m["layer"]) in index:
            rest = LAYER_RENAMES.get(m["rest"])
            target = rest and f"decoder.layers.{index[int(m['layer'])]}.{rest}"
        elif m and m["rest"] in TOP_RENAMES:
            target = TOP_RENAMES[m["rest"]]
        elif m and layers and m["layer"].isdigit() and int(m["layer"]) == layers[-1] + 1:
            target = FINAL_NORM.get(m["rest"])
        if target is None:
            raise UnsupportedCheckpointError(
                f"{src.name} has no rule in the Megatron-DeepSpeed GPT mapping (MoE, cross-attention and other "
                "layers are not mapped); nothing written"
            )
        out.append(renamed(src, target))
    return out


def config_from_args(args: dict[str, Any], ckpt: Checkpoint) -> dict[str, Any]:
    config = megatron_gpt.config_from_args(core_args(args, ckpt.layout.details.get("original_vocab_size")))
    arch = config["architectures"][0]
    if arch not in ARCHITECTURES:  # Megatron-Core's table maps it, but no Megatron-DeepSpeed run of it was checked
        raise UnsupportedCheckpointError(
            f"the run's arguments describe a {arch} model; Megatron-DeepSpeed runs are mapped to "
            f"{' or '.join(ARCHITECTURES)} so far (no such run was checked against its own forward)"
        )
    return config


def core_args(args: dict[str, Any], original_vocab: int | None) -> dict[str, Any]:
    """The run's Megatron-DeepSpeed arguments under Megatron-LM's names (what megatron_gpt builds configs from), or a
    refusal naming what only Megatron-DeepSpeed has."""
    experts = args.get("num_experts")
    moe = any(int(e) > 1 for e in experts) if isinstance(experts, list) else bool(experts and int(experts) > 1)
    heads = int(args.get("num_attention_heads") or 0)
    kv_heads = int(args.get("num_key_value_heads") or heads)
    checks = [
        (not after_fpdt(args) or kv_heads == heads,
         "GQA after #441 (FPDT), whose query_key_value split in thirds holds only for multi-head attention"),
        (not after_fpdt(args) or not args.get("use_rotary_position_embeddings"),
         "rotary embeddings after #441 (FPDT), whose GPTModelPipe fails to build them: no such save to check"),
        (not moe and args.get("mlp_type", "standard") == "standard", "MoE layers"),
        (not args.get("onnx_safe"), "--onnx-safe's erf GeLU (sqrt(2) rounded to 1.41421)"),
        (not args.get("use_alibi_position_embeddings"), "ALiBi position embeddings"),
        (args.get("normalization", "layernorm") in ("layernorm", "rmsnorm"), f"{args.get('normalization')} norms"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise UnsupportedCheckpointError(
                f"the Megatron-DeepSpeed run uses {what}, which the Llama/GPTBigCode mapping does not cover; "
                "nothing written"
            )
    rope = bool(args.get("use_rotary_position_embeddings"))
    gelu_tanh = args.get("openai_gelu") or (
        args.get("bias_gelu_fusion") and args.get("add_bias_linear", True) and not args.get("swiglu")
    )  # bias_gelu_impl is the tanh approximation, used whenever the fusion is on (Megatron-DeepSpeed's default)
    return {
        **{k: v for k, v in args.items() if k not in ("num_experts", "vocab_size")},
        "normalization": "RMSNorm" if args.get("normalization") == "rmsnorm" else "LayerNorm",
        "position_embedding_type": "rope" if rope else "learned_absolute" if args.get("add_position_embedding", True)
        else "none",
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "rotary_base": args.get("rope_theta") or 10000,
        "openai_gelu": bool(gelu_tanh),
        # the tokenizer's size (NullTokenizer adds one), which universal_checkpoint_info records; else padded
        "vocab_size": original_vocab or args.get("padded_vocab_size"),
    }  # fmt: skip


ADAPTER = MegatronDeepSpeed()

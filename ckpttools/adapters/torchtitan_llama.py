"""torchtitan Llama 3 and Qwen3 (`step-N` DCP folders) -> LlamaForCausalLM, Qwen3ForCausalLM.

torchtitan saves the model's own FQNs at the top level of the DCP, beside `optimizer`, `lr_scheduler`,
`dataloader` and `train_state`: `tok_embeddings`, `layers.<i>.attention.wq/wk/wv/wo` (since torchtitan #2878,
2026-04: `attention.qkv_linear.{wq,wk,wv}`), `feed_forward.w1/w3/w2` (gate, up, down), `attention_norm`,
`ffn_norm`, `norm`, and `output` (`lm_head` in torchtitan 0.3). Its Llama 3 applies rotary embeddings to adjacent
pairs of each head's dimensions (complex RoPE); Hugging Face's Llama rotates the first half against the second. So
wq and wk rows are permuted per head as torchtitan's own `Llama3StateDictAdapter.to_hf` does: Hugging Face row
`j * head_dim/2 + i` of a head is torchtitan's row `2 * i + j`. A permutation of rows is one segment per row: no byte
is read here. Qwen3 (`attention.q_norm` / `k_norm`) uses real (cos/sin) RoPE in torchtitan as in Hugging Face: its
rows are kept as they are. torchtitan records no model config in its checkpoints: `--config` is needed.
"""

from __future__ import annotations

import re
from typing import Any

from ckpttools.adapters.base import ConfigNeededError
from ckpttools.adapters.segments import MappingError, expect_shape, permuted_rows, renamed
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.model.checkpoint import Checkpoint, TensorSource

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
PERMUTED = ("LlamaForCausalLM",)  # complex (pairwise) RoPE in torchtitan, rotate-half in Hugging Face
LAYER_RE = re.compile(r"^layers\.(?P<i>\d+)\.(?P<rest>.+)$")

# torchtitan name (relative to layers.<i>) -> (Hugging Face name relative to model.layers.<i>, operation)
LAYER = {
    "attention.qkv_linear.wq.weight": ("self_attn.q_proj.weight", "q"),
    "attention.wq.weight": ("self_attn.q_proj.weight", "q"),
    "attention.qkv_linear.wk.weight": ("self_attn.k_proj.weight", "k"),
    "attention.wk.weight": ("self_attn.k_proj.weight", "k"),
    "attention.qkv_linear.wv.weight": ("self_attn.v_proj.weight", "v"),
    "attention.wv.weight": ("self_attn.v_proj.weight", "v"),
    "attention.wo.weight": ("self_attn.o_proj.weight", "o"),
    "attention.q_norm.weight": ("self_attn.q_norm.weight", "head_norm"),
    "attention.k_norm.weight": ("self_attn.k_norm.weight", "head_norm"),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", "ffn_in"),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", "ffn_in"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", "ffn_out"),
    "attention_norm.weight": ("input_layernorm.weight", "norm"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "norm"),
}
TOP = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", "vocab"),
    "norm.weight": ("model.norm.weight", "norm"),
    "output.weight": ("lm_head.weight", "vocab"),
    "lm_head.weight": ("lm_head.weight", "vocab"),
}


def rope_order(heads: int, head_dim: int) -> list[int]:
    """torchtitan's row for each Hugging Face row of a q/k projection (pairs -> halves, per head)."""
    half = head_dim // 2
    return [h * head_dim + 2 * (r % half) + r // half for h in range(heads) for r in range(head_dim)]


class TorchtitanLlama:
    convention = "torchtitan"
    architectures = ARCHITECTURES

    def claims(self, ckpt: Checkpoint) -> bool:
        keys = set(ckpt.keys)
        return ckpt.layout.kind == "dcp" and "tok_embeddings.weight" in keys and "norm.weight" in keys

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        if given is None:
            raise ConfigNeededError(
                f"{ckpt.location.tag_dir} is a torchtitan checkpoint (tok_embeddings, layers.N.attention, ...), which "
                "records no model config: pass --config with the Hugging Face config.json of the model "
                f"({' or '.join(ARCHITECTURES)}) to map its names"
            )
        arch = (given.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedCheckpointError(
                f"--config names {arch or 'no architecture'}; torchtitan checkpoints are mapped to "
                f"{', '.join(ARCHITECTURES)} so far"
            )
        return dict(given), False

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            kv = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            ffn, vocab, layers = int(config["intermediate_size"]), int(config["vocab_size"]), int(
                config["num_hidden_layers"])  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise MappingError(f"config.json lacks a usable {e} for a torchtitan Llama mapping") from e
        tied = bool(config.get("tie_word_embeddings", False))
        shapes = {
            "q": (heads * head_dim, hidden), "k": (kv * head_dim, hidden), "v": (kv * head_dim, hidden),
            "o": (hidden, heads * head_dim), "ffn_in": (ffn, hidden), "ffn_out": (hidden, ffn), "norm": (hidden,),
            "vocab": (vocab, hidden), "head_norm": (head_dim,),
        }  # fmt: skip
        arch = config["architectures"][0]
        order = {"q": rope_order(heads, head_dim), "k": rope_order(kv, head_dim)} if arch in PERMUTED else {}
        out: dict[str, TensorSource] = {}
        notes: list[str] = []
        for src in ckpt.sources(ckpt.train_dtype):
            target, op = self._rule(src.name, layers, arch)
            if target == "lm_head.weight" and tied:
                notes.append(f"{src.name} left out: config.json ties it to the embedding (as torchtitan's to_hf)")
                continue
            expect_shape(src, shapes[op], "config.json")
            mapped = permuted_rows(src, order[op], target) if op in order else renamed(src, target)
            if target in out:
                raise MappingError(f"{target} comes from two torchtitan tensors ({src.name}); the names are mixed")
            out[target] = mapped
        expected = _expected(layers, tied, qk_norm=arch == "Qwen3ForCausalLM")
        missing = [n for n in expected if n not in out]
        if missing:
            raise MappingError(f"{missing[0]} has no torchtitan tensor ({len(missing)} missing); is the config the "
                               "run's?")  # fmt: skip
        return [out[n] for n in expected], notes

    @staticmethod
    def _rule(name: str, layers: int, arch: str) -> tuple[str, str]:
        if name in TOP:
            return TOP[name]
        m = LAYER_RE.match(name)
        if m and m["rest"] in LAYER:
            if int(m["i"]) >= layers:
                raise MappingError(f"{name}: the checkpoint has more than {layers} layers (num_hidden_layers)")
            target, op = LAYER[m["rest"]]
            return f"model.layers.{m['i']}.{target}", op
        raise UnsupportedCheckpointError(f"{name} has no rule in the torchtitan -> {arch} mapping")


def _expected(layers: int, tied: bool, *, qk_norm: bool) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [f"{p}self_attn.{m}_norm.weight" for m in "qk"] if qk_norm else []
        names += [f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", *([] if tied else ["lm_head.weight"])]


ADAPTER = TorchtitanLlama()

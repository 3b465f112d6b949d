"""The run's model config from Megatron-Bridge's `run_config.yaml` or NeMo 2's `context/model.yaml`, under
Megatron-LM's argument names.

Megatron-Bridge saves, beside each `iter_NNNNNNN/` torch_dist folder, the run's whole `ConfigContainer` as YAML
(`ConfigContainer.to_yaml`: dataclasses as mappings with a `_target_` string naming their class, functions and
dtypes as `{_target_: torch.nn.functional.silu, _call_: false}`). Its `model:` section is the model provider, a
Megatron-Core `TransformerConfig`: the names differ from Megatron-LM's parsed arguments (what the architecture
adapters read) in a few places, translated here in one table, so the adapters see one vocabulary:

    share_embeddings_and_output_weights -> untie_embeddings_and_output_weights (negated)
    num_moe_experts -> num_experts          rope_scaling -> use_rope_scaling
    gated_linear_unit + activation_func -> swiglu / openai_gelu / squared_relu / quick_geglu
    num_query_groups -> group_query_attention (set when it differs from the heads)
    vocab_size (+ should_pad_vocab, make_vocab_size_divisible_by, TP) -> vocab_size, padded_vocab_size
    params_dtype {_target_: torch.float32} -> "float32"

Every other scalar field keeps its name (Megatron-LM's arguments are TransformerConfig's: hidden_size,
num_attention_heads, kv_channels, normalization, layernorm_epsilon, add_bias_linear, position_embedding_type,
rotary_base, qk_layernorm, moe_*, MLA's q_lora_rank/kv_lora_rank/..., window_size, softmax_type, ...), so the
adapters' refusals of what they do not map apply to Bridge runs as they do to Megatron-LM runs. An activation with
no Megatron-LM argument (a gated GeLU, an ungated SiLU, a function of the run's own) is refused here.

NeMo 2's `context/model.yaml` (fiddle's YAML of the LightningModule, written by `TrainerContext.io_dump`) holds
the same TransformerConfig fields under `config:`, written the same way (`_target_` strings, `_call_: false`).

The YAML is read with `yaml.safe_load`: `_target_` strings stay data, a `!!python/...` tag is refused, nothing is
imported or called.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError, short

RUN_CONFIG = "run_config.yaml"
MAX_RUN_CONFIG_BYTES = 16 << 20  # Bridge writes ~30 kB, NeMo 2 ~10 kB

# Bridge (TransformerConfig) name -> Megatron-LM argument name, where they differ.
RENAMED = {"num_moe_experts": "num_experts", "rope_scaling": "use_rope_scaling"}
# (activation function's last name, gated linear unit) -> the Megatron-LM flags that select it.
ACTIVATIONS: dict[tuple[str, bool], dict[str, bool]] = {
    ("silu", True): {"swiglu": True},
    ("gelu", False): {},  # Megatron-LM's default
    ("openai_gelu", False): {"openai_gelu": True},
    ("squared_relu", False): {"squared_relu": True},
    ("quick_gelu", True): {"quick_geglu": True},
}


def read_run_config(path: Path) -> dict[str, Any]:
    """The `model:` section of a Bridge run_config.yaml, translated to Megatron-LM's argument names."""
    data = _load_yaml(path, "Megatron-Bridge's run config")
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise CorruptCheckpointError(
            f"{path} has no `model:` mapping (Megatron-Bridge writes the model provider there)"
        )
    return megatron_lm_args(model, str(path))


def read_nemo_context(path: Path, embedding_rows: int | None) -> dict[str, Any]:
    """The `config:` section of a NeMo 2 checkpoint's `context/model.yaml` (its `io_dump` of the LightningModule:
    fiddle's YAML, the model's `config` a TransformerConfig subclass such as LlamaConfig), under Megatron-LM's
    argument names.

    NeMo's config leaves `vocab_size` null when the tokenizer sets it (GPTConfig.configure_model pads the
    tokenizer's size); the tokenizer's entry records no size, so the embedding's rows are the padded vocabulary
    and the tokenizer's size stays unknown, as in a Megatron-LM run with a real tokenizer."""
    data = _load_yaml(path, "NeMo 2's model context")
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{path} has no `config:` mapping (NeMo 2 writes the model's config there)")
    if config.get("vocab_size") is not None or not embedding_rows:
        return megatron_lm_args(config, str(path))
    args = megatron_lm_args({**config, "vocab_size": embedding_rows, "should_pad_vocab": False}, str(path))
    return {**args, "vocab_size": None, "padded_vocab_size": embedding_rows}


def _load_yaml(path: Path, what: str) -> Any:
    """yaml.safe_load of a config file ckpt only reads: a `!!python/...` tag is refused, nothing is built."""
    try:
        size = path.stat().st_size
        if size > MAX_RUN_CONFIG_BYTES:
            raise CorruptCheckpointError(f"{path} is {size} bytes: not {what}")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{path} is not UTF-8 text ({e.reason})") from e
    try:
        import yaml  # type: ignore[import-untyped]  # no stubs installed; PyYAML comes with huggingface_hub
    except ImportError as e:  # huggingface_hub requires it; a trimmed environment may not have it
        raise UnsupportedCheckpointError(f"reading {path} needs PyYAML (pip install pyyaml)") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = str(getattr(e, "problem", None) or e)
        tag = re.search(r"tag '(?:tag:yaml\.org,2002:)?([^']*)'", problem)
        why = f"the tag !!{short(tag[1], 60)}: ckpt builds no objects from it" if tag else short(problem, 80)
        raise CorruptCheckpointError(f"{path} is not plain YAML{at} ({why})") from e
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path} nests too deeply to be {what}") from e


def megatron_lm_args(model: dict[str, Any], where: str) -> dict[str, Any]:
    """A TransformerConfig-like mapping (Bridge's provider, NeMo's config) under Megatron-LM's argument names."""
    args: dict[str, Any] = {}
    for key, value in model.items():
        if not isinstance(key, str) or key.startswith("_"):
            continue
        scalar = _scalar(value)
        if scalar is not _NOT_SCALAR:
            args[RENAMED.get(key, key)] = scalar
    share = model.get("share_embeddings_and_output_weights")
    args["untie_embeddings_and_output_weights"] = not share if isinstance(share, bool) else False
    args.update(_activation(model, where))
    heads, groups = args.get("num_attention_heads"), args.get("num_query_groups")
    args["group_query_attention"] = bool(groups) and groups != heads
    args.update(_vocab(model, where))
    return args


_NOT_SCALAR = object()


def _scalar(value: Any) -> Any:
    """A plain value, a `{_target_: x, _call_: false}` reference (a dtype, a function) as the string x, else
    _NOT_SCALAR (a nested config or module spec: not an argument)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and all(isinstance(v, (bool, int, float, str)) or v is None for v in value):
        return value
    if isinstance(value, dict) and set(value) == {"_target_", "_call_"} and value["_call_"] is False:
        target = value["_target_"]
        return target.removeprefix("torch.") if target.startswith("torch.") and "." not in target[6:] else target
    return _NOT_SCALAR


def _activation(model: dict[str, Any], where: str) -> dict[str, bool]:
    func = _scalar(model.get("activation_func"))
    gated = bool(model.get("gated_linear_unit"))
    name = func.rsplit(".", 1)[-1] if isinstance(func, str) else None
    flags = ACTIVATIONS.get((name, gated)) if name else None
    if flags is None:
        raise UnsupportedCheckpointError(
            f"{where}: the model's activation {str(func)[:80]}{' with gated linear units' if gated else ''} has no "
            "Hugging Face counterpart ckpt maps"
        )
    return {"swiglu": False, "openai_gelu": False, "squared_relu": False, "quick_geglu": False, **flags}


def _vocab(model: dict[str, Any], where: str) -> dict[str, int]:
    """The unpadded vocabulary and the embedding's rows: Bridge pads `vocab_size` to a multiple of
    make_vocab_size_divisible_by x TP when `should_pad_vocab` (a tokenizer's size), else uses it as given."""
    vocab = model.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise CorruptCheckpointError(f"{where}: the model's vocab_size is {short(vocab, 20)}, not a size")
    if not model.get("should_pad_vocab"):
        return {"vocab_size": vocab, "padded_vocab_size": vocab}
    multiple = int(model.get("make_vocab_size_divisible_by") or 1) * int(model.get("tensor_model_parallel_size") or 1)
    return {"vocab_size": vocab, "padded_vocab_size": -(-vocab // multiple) * multiple}

"""Every architecture adapter, and the one place a checkpoint is mapped onto Hugging Face names.

An adapter is one module holding an `ADAPTER` (`base.Adapter`) plus its line in `ADAPTERS`: the first whose
`claims` accepts a checkpoint maps it. A checkpoint no adapter claims keeps its names (DeepSpeed or FSDP2 around a
transformers model already uses Hugging Face's; a custom `nn.Module` keeps its own).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ckpttools.adapters.base import Adapter, ConfigNeededError, Mapped, mapped_checkpoint
from ckpttools.errors import CkptError
from ckpttools.model.checkpoint import Checkpoint

ADAPTERS = (
    "ckpttools.adapters.megatron_moe",  # Megatron-Core GPT with MoE layers -> MixtralForCausalLM / Qwen3MoeForCausalLM
    "ckpttools.adapters.megatron_gpt",  # Megatron-Core GPT (torch_dist) -> LlamaForCausalLM / Qwen3ForCausalLM
    "ckpttools.adapters.megatron_deepspeed",  # Megatron-DeepSpeed 3D -> LlamaForCausalLM / GPTBigCodeForCausalLM
    "ckpttools.adapters.torchtitan_llama",  # torchtitan (step-N DCP) -> LlamaForCausalLM (RoPE rows permuted) / Qwen3
)


@functools.cache
def adapters() -> tuple[Adapter, ...]:
    return tuple(importlib.import_module(name).ADAPTER for name in ADAPTERS)


def adapter_for(ckpt: Checkpoint) -> Adapter | None:
    return next((a for a in adapters() if a.claims(ckpt)), None)


def adapt(ckpt: Checkpoint, given: dict[str, Any] | None) -> Mapped | None:
    """`ckpt` under Hugging Face names with its config.json (`given`, else generated from the run's arguments), or
    None when no adapter claims it.

    Raises:
        ConfigNeededError: an adapter claims it, but there is no config: neither given nor in the run's arguments.
        MappingError (CorruptCheckpointError): a tensor whose shape does not follow from the config.
        UnsupportedCheckpointError: the model is of a kind the adapter does not map (yet).
    """
    adapter = adapter_for(ckpt)
    if adapter is None:
        return None
    config, generated = adapter.config(ckpt, given)
    tensors, notes = adapter.tensors(ckpt, config)
    arch = (config.get("architectures") or ["?"])[0]
    if generated:
        notes.insert(0, f"config.json generated from the run's arguments ({arch}); pass --config to use your own")
    return Mapped(mapped_checkpoint(ckpt, tensors), config, generated, f"{adapter.convention} -> {arch}", notes)


def describe(ckpt: Checkpoint, given: dict[str, Any] | None) -> str | None:
    """What `consolidate` would map the checkpoint to, in one line for `inspect` (no byte read); None when no
    adapter claims it (its names are written as they are)."""
    adapter = adapter_for(ckpt)
    if adapter is None:
        return None
    try:
        mapped = adapt(ckpt, given)
    except ConfigNeededError:
        return f"{adapter.convention}: needs --config (the checkpoint records no model config to map its names with)"
    except CkptError as e:
        return f"{adapter.convention}: not mapped ({e})"
    assert mapped is not None  # the adapter claimed it
    origin = "config.json generated from the run's arguments" if mapped.generated else "with config.json"
    return f"{mapped.adapter} ({origin})"

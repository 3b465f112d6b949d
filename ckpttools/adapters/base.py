"""What an architecture adapter provides, and what applying one gives.

An adapter maps one trainer's names and fused tensors (Megatron-Core's `decoder.layers.*`, torchtitan's FQNs) onto
one Hugging Face architecture's, as a declarative table of zero-copy operations on tensor sources
(`adapters.segments`). It is pure: the neutral checkpoint (or its tensor sources) in, renamed, split, un-stacked,
trimmed sources out, never bytes. `registry.ADAPTERS` lists them; docs/adding-an-adapter.md is the checklist.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ckpttools.errors import CkptError
from ckpttools.model.checkpoint import Checkpoint, Param, TensorSource


class ConfigNeededError(CkptError):
    """The checkpoint keeps its trainer's names and records no model config to map them with: `--config` needed."""


class Adapter(Protocol):
    convention: str  # "megatron-core", "torchtitan", ...
    architectures: tuple[str, ...]  # the Hugging Face classes it produces

    def claims(self, ckpt: Checkpoint) -> bool:
        """Whether the checkpoint uses this adapter's naming convention (names and the run's facts; no I/O)."""
        ...

    def config(self, ckpt: Checkpoint, given: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        """config.json: `given` (checked to be an architecture of this adapter) or generated from the run's own
        arguments; and whether it was generated. ConfigNeededError when neither is there."""
        ...

    def tensors(self, ckpt: Checkpoint, config: dict[str, Any]) -> tuple[list[TensorSource], list[str]]:
        """The Hugging Face tensors in the class's order, every shape checked against `config`, and notes
        (what is left out). Every source tensor is used or named as left out: none is dropped silently."""
        ...


@dataclass
class Mapped:
    """A checkpoint under Hugging Face names, with the config.json it loads with."""

    checkpoint: Checkpoint
    config: dict[str, Any]
    generated: bool  # config.json made from the run's arguments (not given with --config)
    adapter: str  # "<convention> -> <architecture>"
    notes: list[str] = field(default_factory=list)


def mapped_checkpoint(ckpt: Checkpoint, tensors: list[TensorSource]) -> Checkpoint:
    """The same checkpoint holding `tensors` as its weights (trainable: the fp32 output casts them as needed)."""
    params = [Param(t.name, t.name, t.shape, 0, 0, t, {}) for t in tensors]
    return replace(ckpt, keys=[t.name for t in tensors], params=params, bit16={}, buffers={}, shared_params={},
                   slices=[], replicas=[])  # fmt: skip

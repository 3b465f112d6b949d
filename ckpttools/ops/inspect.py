"""A summary of a checkpoint without reading any tensor bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpttools import adapters
from ckpttools.errors import CkptError
from ckpttools.io import dtypes
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.model.checkpoint import Checkpoint
from ckpttools.ops import hf
from ckpttools.ops.consolidate import DTYPES, plan_tensors, source_summary


def _trainer_state(root: Path) -> dict[str, Any] | None:
    """What trainer_state.json says; None without one (or one that cannot be read)."""
    try:
        state = json.loads((root / "trainer_state.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict):
        return None
    history = state.get("log_history")
    entries = history if isinstance(history, list) else []
    losses = [e["loss"] for e in entries if isinstance(e, dict) and "loss" in e]
    return {
        "global_step": state.get("global_step"),
        "epoch": state.get("epoch"),
        "last_loss": losses[-1] if losses else None,
        "best_model_checkpoint": state.get("best_model_checkpoint"),
    }


def summarize(ckpt: Checkpoint) -> dict[str, Any]:
    """Everything `ckpt inspect` reports, as plain JSON-able values."""
    loc = ckpt.location
    config_path = loc.root / "config.json"
    config = hf.load_config(config_path) if config_path.is_file() else None
    trainable = list(ckpt.masters.values())
    frozen = [ckpt.bit16[n] for n in ckpt.frozen_names]
    sizes, elements = {}, 0
    written, written_config = _as_written(ckpt, config)
    for dtype in DTYPES.values():
        tensors, _ = plan_tensors(written, dtype, hf_folder=written_config is not None, config=written_config or {})
        sizes[dtype.name] = sum(t.nbytes for t in tensors)  # float32/bfloat16/float16, as every --json spells it
        elements = sum(t.source.numel() for t in tensors)  # what consolidate writes and verify counts
    tags = loc.tags if loc.tags is not None else _deepspeed_tags(loc.root)
    existing = hf.existing_weight_files(loc.root)
    return {
        **source_summary(ckpt),
        "optimizer": ckpt.optimizer_kind or None,  # DeepSpeed's optimizer wrapper; null for other writers
        "optimizer_saved": ckpt.optimizer.saved,
        "optimizer_states": ckpt.optimizer_state_keys,
        "optimizer_state_bytes": ckpt.optimizer_state_bytes,
        "optimizer_files": ckpt.optimizer.where or None,
        "format": ckpt.source_format,
        "adapter": adapters.describe(ckpt, config),  # the trainer's names -> Hugging Face's consolidate would apply
        "parallel": ckpt.layout.as_dict(),
        "tags": tags,
        "trainer_output_dir": str(loc.output_dir) if loc.output_dir else None,
        "num_parameters": elements,  # every element consolidate writes (buffers too, a tie once), as verify counts
        "trainable_parameters": sum(s.numel() for s in trainable),
        "frozen_parameters": sum(s.numel() for s in frozen),
        "num_trainable": len(trainable),
        "num_frozen": len(frozen),
        "num_buffers": len(ckpt.buffers),
        "tied": dict(ckpt.shared_params),
        "frozen_excluded": ckpt.frozen_excluded,
        "gathered_16bit_weights": [p.name for p in existing],
        "hf_files": loc.side_files,
        "trainer_state": _trainer_state(loc.root),
        "output_bytes": sizes,
        # fp32 masters as stored: DeepSpeed always keeps them; a 16-bit FSDP2 save holds none
        "fp32_master_bytes": sum(s.numel() for s in trainable if s.dtype is dtypes.FLOAT32) * dtypes.FLOAT32.itemsize,
    }


def _as_written(ckpt: Checkpoint, config: dict[str, Any] | None) -> tuple[Checkpoint, dict[str, Any] | None]:
    """The checkpoint as consolidate writes it, to count what it writes: under Hugging Face names when an
    architecture adapter maps it (padded vocabulary rows dropped), with the config it loads with; as it is when no
    adapter claims it, or when the mapping needs what inspect does not have (--config): the trainer's own counts."""
    try:
        mapped = adapters.adapt(ckpt, config)
    except CkptError:
        return ckpt, config
    return (mapped.checkpoint, mapped.config) if mapped is not None else (ckpt, config)


def _deepspeed_tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))


def inspect_checkpoint(path: Path | str, **kwargs: Any) -> dict[str, Any]:
    ckpt = open_checkpoint(path, **kwargs)
    check_module_copies(ckpt)  # cheap (a few thousand elements per rank's piece): a mixed-up checkpoint is refused
    return summarize(ckpt)

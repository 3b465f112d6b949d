"""Hugging Face Trainer integration: leave a loadable model behind every save, whatever the ZeRO-3 flag says.

With `stage3_gather_16bit_weights_on_model_save=false` a ZeRO-3 Trainer run writes no weight file at all
(`checkpoint-N/` holds only the partitioned `global_stepN/`). `ConsolidateCallback` fills that gap from the
live engine with `save_pretrained_from_engine`, gathering a bounded group of parameters at a time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ckpttools.live.engine_save import (
    DEFAULT_MAX_GATHER_BYTES,
    EngineSaveResult,
    _is_engine,
    rank0_decides,
    save_pretrained_from_engine,
)
from ckpttools.ops.hf import existing_weight_files

logger = logging.getLogger(__name__)

PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ConsolidateCallback(TrainerCallback):
    """Write the model's weights as safetensors on `on_save` and/or `on_train_end`.

    By default each `checkpoint-N/` that the Trainer left without weights (ZeRO-3 with the gather flag
    off) gets `model.safetensors` (or shards + index) and a config.json with the right `dtype`, so
    `from_pretrained("out/checkpoint-N")` works and resuming is unaffected (`global_stepN/` is untouched).
    Checkpoints that already hold weights (ZeRO-1/2, or the flag on) are left alone unless `force=True`.

    Every rank runs the callback (the Trainer calls callbacks on all processes), which the gather needs.
    The engine is `trainer.model_wrapped` when the trainer is given; otherwise the `model` the Trainer
    passes to callbacks (the unwrapped module, whose ZeRO-3 params carry `ds_id`) is gathered directly.
    Both give the same bytes; with the engine, DeepSpeed's checkpoint prologue/epilogue also runs.

    Args:
        trainer: the Trainer (optional; see above). Also settable later as `callback.trainer = trainer`.
        on_save: write at every checkpoint save.
        on_train_end: write once when training ends, into `final_dir`.
        output_dir: if set, checkpoint weights go to `<output_dir>/checkpoint-N/` (a folder of their own,
            replaced if present) instead of into the Trainer's `checkpoint-N/`. Trainer's checkpoint
            rotation does not clean these up.
        final_dir: where `on_train_end` writes; default `<args.output_dir>/hf-final` (not `args.output_dir`
            itself: a later `trainer.save_model()` with the flag off deletes `model.safetensors` there).
        force: also write when the checkpoint already holds weights (they are replaced).
        dtype, max_shard_size, max_gather_bytes: passed to `save_pretrained_from_engine`.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds)
        >>> trainer.add_callback(ConsolidateCallback(trainer))
        >>> trainer.train()  # every out/checkpoint-N/ now has model.safetensors
    """

    def __init__(
        self,
        trainer: Any = None,
        *,
        on_save: bool = True,
        on_train_end: bool = False,
        output_dir: str | Path | None = None,
        final_dir: str | Path | None = None,
        force: bool = False,
        dtype: Any = None,
        max_shard_size: int | str = "5GB",
        max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
    ) -> None:
        self.trainer = trainer
        self.save_checkpoints = on_save
        self.save_at_end = on_train_end
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.final_dir = Path(final_dir) if final_dir is not None else None
        self.force = force
        self.save_kwargs = {"dtype": dtype, "max_shard_size": max_shard_size, "max_gather_bytes": max_gather_bytes}
        self.results: list[EngineSaveResult] = []

    def engine(self, model: Any) -> Any:
        """The DeepSpeed engine if reachable, else the module itself (ZeRO-3 detected from `ds_id`)."""
        if self.trainer is not None:
            for attr in ("model_wrapped", "deepspeed"):
                candidate = getattr(self.trainer, attr, None)
                if _is_engine(candidate):
                    return candidate
            if model is None:
                model = getattr(self.trainer, "model", None)
        if model is None:
            raise ValueError("ConsolidateCallback got no model from the Trainer; pass the trainer to its constructor")
        return model

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.save_checkpoints:
            return
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.output_dir is not None:
            self._save(model, self.output_dir / checkpoint.name, "replace")
            return
        skip = rank0_decides(lambda: self._skip_reason(checkpoint))
        if skip:
            logger.info("ConsolidateCallback: not writing into %s: %s", checkpoint, skip)
            return
        self._save(model, checkpoint, "add")

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.save_at_end:
            self._save(model, self.final_dir or Path(args.output_dir) / "hf-final", "replace")

    def _skip_reason(self, checkpoint: Path) -> str | None:
        if not checkpoint.is_dir():
            return "the folder does not exist"
        present = existing_weight_files(checkpoint) or any((checkpoint / n).is_file() for n in WEIGHT_FILES)
        if present and not self.force:
            return "it already holds weights (pass force=True to replace them)"
        return None

    def _save(self, model: Any, folder: Path, if_exists: str) -> None:
        result = save_pretrained_from_engine(self.engine(model), folder, if_exists=if_exists, **self.save_kwargs)
        self.results.append(result)
        logger.info("ConsolidateCallback: wrote %s (%s) to %s", ", ".join(result.files), result.dtype, folder)

"""Drop-in for DeepSpeed 0.19.8's `zero_to_torch.py`: the same command line, function and files, on ckpttools' reader.

    python -m ckpttools.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype {bf16,bfloat16,float16,float32,fp16,fp32}
                                      [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                                      [--exclude_frozen_parameters] [-d]

writes what DeepSpeed's script (PR #8318, copied into every checkpoint folder beside zero_to_fp32.py) writes:
`pytorch_model.bin` (or `model.safetensors`), sharded past `--max_shard_size` with DeepSpeed's index, the keys of
zero_to_fp32 in its order (buffers, frozen params, trainable params from their fp32 masters, tied aliases), each
floating tensor cast to `--dtype` as torch's `.to(dtype)` casts it, integer buffers unchanged; the shard plan is
DeepSpeed's (huggingface_hub's planner over the sizes in the output dtype).

One deliberate difference: a floating buffer that a bf16/fp16 run stored in fp32 stays fp32. DeepSpeed 0.19.8
keeps such buffers in fp32 on purpose (`data_types.keep_in_fp32_modules`, by default the model's
`_keep_in_fp32_modules_strict`: DeepSeek-V3/GLM's `e_score_correction_bias`, whose bf16 values route tokens to
other experts), and so does the engine's own `save_16bit_model`; DeepSpeed's zero_to_torch casts them anyway.
Without `data_types.buffer_dtype` the engine casts no buffer, so every floating buffer of such a run stays fp32.
For fp32 training nothing is kept, and every floating tensor takes `--dtype`, as DeepSpeed's does.

As the zero_to_fp32 drop-in (`ckpttools.compat.zero_to_fp32`), this also works where DeepSpeed's script fails: tied
weights with `--safe_serialization` (stored as copies), BF16_Optimizer, universal, pipeline, AutoTP and MoE
checkpoints (the whole model, as `ckpt consolidate` writes it), a Trainer `output_dir` or a tag folder; every
record read is CRC-checked and the ZeRO-1/2 module copies are compared with the masters before anything is moved
into OUTPUT_DIR; both formats are streamed, without torch; other files in OUTPUT_DIR are left alone.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttools.compat.zero_to_fp32 import (
    DEFAULT_MAX_SHARD_SIZE,
    _dropped_frozen,
    _Entry,
    _open,
    _Parser,
    _Written,
    run_drop_in,
    write_entries,
)
from ckpttools.errors import UsageError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import ProgressFn
from ckpttools.model.checkpoint import Checkpoint, strip_prefixes

__all__ = ["OUTPUT_DTYPE_NAMES", "cli", "convert_zero_checkpoint_to_state_dict"]

# DeepSpeed's zero_to_fp32.OUTPUT_DTYPE_NAMES (its --dtype choices)
OUTPUT_DTYPE_NAMES: dict[str, DType] = {
    "float32": dtypes.FLOAT32,
    "fp32": dtypes.FLOAT32,
    "float16": dtypes.FLOAT16,
    "fp16": dtypes.FLOAT16,
    "bfloat16": dtypes.BFLOAT16,
    "bf16": dtypes.BFLOAT16,
}


def resolve_dtype(dtype: Any) -> DType:
    """`dtype` as DeepSpeed's `_resolve_output_dtype` accepts it: a name (`bf16`, `torch.bfloat16`, any case), a
    torch dtype or a ckpttools DType, one of float32 / float16 / bfloat16."""
    if isinstance(dtype, DType) and dtype in OUTPUT_DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str):
        found = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    else:
        found = next((d for d in OUTPUT_DTYPE_NAMES.values() if str(dtype) == f"torch.{d.name}"), None)
    if found is None:
        raise UsageError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return found


@dataclass(frozen=True, eq=False)
class _CastEntry(_Entry):
    """A zero_to_fp32 entry written in `out` instead of float32."""

    out: DType = dtypes.FLOAT32

    @property
    def file_dtype(self) -> DType:
        return self.out


def _cast_plan(
    ckpt: Checkpoint, entries: OrderedDict[str, _Entry], dtype: DType
) -> tuple[OrderedDict[str, _Entry], list[str]]:
    """zero_to_fp32's entries with their output dtype; tied names keep sharing one entry. Also the kept names."""
    kept = set(ckpt.kept_fp32)
    made: dict[int, _Entry] = {}
    out: OrderedDict[str, _Entry] = OrderedDict()
    kept_names = []
    for name, e in entries.items():
        if id(e) not in made:
            floating = e.source.dtype.is_floating_point
            keep = floating and e.source.kind == "buffer" and e.source.name in kept and dtype != dtypes.FLOAT32
            if keep:
                kept_names.append(name)
            target = dtypes.FLOAT32 if keep else (dtype if floating else e.source.dtype)
            made[id(e)] = _CastEntry(e.source, e.dtype, target)
        out[name] = made[id(e)]
    return out, kept_names


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: Any = "float32",
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the consolidated weights in `dtype` into `output_dir` as DeepSpeed's function of this name does,
    except that buffers a 16-bit run kept in fp32 stay fp32 (see the module doc)."""
    _convert(checkpoint_dir, output_dir, dtype, max_shard_size, safe_serialization, tag, exclude_frozen_parameters)


def _count(names: list[str], noun: str) -> str:
    return f"{len(names)} {noun}{'' if len(names) == 1 else 's'}"


def _notes(ckpt: Checkpoint, entries: OrderedDict[str, _Entry], kept: list[str], exclude: bool, st: bool) -> list[str]:
    notes = []
    if kept:
        notes.append(
            f"{_count(kept, 'buffer')} the run kept in fp32 ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}) "
            "stay fp32, as the engine's save_16bit_model writes them (DeepSpeed's zero_to_torch casts them)"
        )
    dropped = _dropped_frozen(ckpt, exclude) if ckpt.layout.kind == "dp" else []  # other layouts: the whole model
    if dropped:
        notes.append(
            f"{len(dropped)} frozen parameters ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}) are "
            "left out, as DeepSpeed's zero_to_torch leaves them out of this checkpoint (it records no "
            "frozen_param_shapes); `ckpt consolidate` includes them"
        )
    tied = [n for n, e in entries.items() if e.source.name != strip_prefixes(n)]
    if st and tied:
        notes.append(
            f"tied weights ({', '.join(tied[:3])}) are stored as their own copies: safetensors cannot alias tensors"
        )
    return notes


def _convert(
    checkpoint_dir: Any,
    output_dir: Any,
    dtype: Any,
    max_shard_size: int | str | None,
    safe_serialization: bool,
    tag: str | None,
    exclude_frozen_parameters: bool,
    *,
    debug: Callable[[str], None] | None = None,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> _Written:
    out_dtype = resolve_dtype(dtype)
    ckpt, fp32_entries = _open(checkpoint_dir, tag, exclude_frozen_parameters)
    entries, kept = _cast_plan(ckpt, fp32_entries, out_dtype)
    notes = _notes(ckpt, entries, kept, exclude_frozen_parameters, safe_serialization)
    return write_entries(
        ckpt, entries, Path(checkpoint_dir), Path(output_dir), max_shard_size, safe_serialization, notes,
        debug=debug, on_start=on_start, on_progress=on_progress,
    )  # fmt: skip


# --- The command line --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    """DeepSpeed's arguments, in its order."""
    parser = _Parser(
        prog="python -m ckpttools.zero_to_torch",
        description="Convert a DeepSpeed ZeRO checkpoint to float32, float16, or bfloat16 PyTorch weights (a "
        "drop-in for DeepSpeed's zero_to_torch.py: same options, same files). One difference: buffers a bf16/fp16 "
        "run kept in fp32 (DeepSpeed's keep_in_fp32, such as e_score_correction_bias) stay fp32, as the engine's "
        "save_16bit_model writes them; DeepSpeed's script casts them.",
    )
    parser.add_argument(
        "checkpoint_dir", type=str, help="path to the desired checkpoint folder, e.g., path/checkpoint-12"
    )
    parser.add_argument("output_dir", type=str, help="directory for the converted PyTorch state_dict files")
    parser.add_argument(
        "--dtype",
        type=str,
        choices=sorted(OUTPUT_DTYPE_NAMES),
        required=True,
        help="output tensor dtype (buffers a 16-bit run kept in fp32 stay fp32)",
    )
    parser.add_argument(
        "--max_shard_size",
        type=str,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="maximum size of each checkpoint shard, such as 5GB or 500MB",
    )
    parser.add_argument(
        "--safe_serialization",
        default=False,
        action="store_true",
        help="save with safetensors instead of PyTorch pickle serialization",
    )
    parser.add_argument(
        "-t", "--tag", type=str, default=None, help="checkpoint tag used as a unique identifier, e.g., global_step1"
    )
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="list every tensor; show tracebacks on errors")
    return parser


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m ckpttools.zero_to_torch ...`; returns the exit code."""
    args = _parser().parse_args(argv)
    return run_drop_in("zero_to_torch", args, functools.partial(
        _convert, args.checkpoint_dir, args.output_dir, args.dtype, args.max_shard_size, args.safe_serialization,
        args.tag, args.exclude_frozen_parameters,
    ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(cli())

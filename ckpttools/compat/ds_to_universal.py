"""Drop-in for DeepSpeed's `ds_to_universal.py`: its command line and its universal layout, from ckpttools' reader.

    python -m ckpttools.ds_to_universal --input_folder CKPT/global_step500 --output_folder CKPT/global_step500_universal

As with DeepSpeed 0.19.8, --input_folder is the tag folder holding the rank files (a save_dir or Trainer
`checkpoint-N/` holding `latest` works too), --output_folder becomes the universal tag folder itself
(`zero/<param>/fp32.pt`, `exp_avg.pt`, ... , `zero/optimizer_state.pt` and the model-state files), and
`latest_universal`, naming that folder, is written into the PARENT of --output_folder; so with the output beside
the input, `engine.load_checkpoint(CKPT)` with `"checkpoint": {"load_universal": true}` finds it.

The same files as DeepSpeed's, with the same values:
- ZeRO-1/2: per parameter `{"cat_dim": 0, "param": <full shape>}` for the fp32 master and every optimizer state,
  and `step.pt`; and, as DeepSpeed 0.19.8 does, `zero/<name>/fp32.pt` = `{"param": value.float()}` for every
  other module entry (buffers, frozen params, tied aliases: the module's values, which no DeepSpeed loader reads).
- AutoTP (tensor-parallel ZeRO-1/2): per parameter the FULL tensor (the TP shards merged as the run's
  `universal_checkpoint_info` says) as `{"param": ...}`, with `vocab_tensor: True` on vocabulary parameters and
  `cat_dim` only where the run saved no affine map (DeepSpeed's loader re-splits at any TP size from the loading
  engine's own map), `step.pt`, TP rank 0 / DP rank 0's shared optimizer state, every TP rank's model-states file
  unchanged, and the module fp32 files from TP rank 0's module.
- ZeRO-3: the per-parameter states (as `{"param": <full shape>, "cat_dim": 0}` where DeepSpeed writes bare flat
  tensors; DeepSpeed reads both), no `step.pt`; the step stays in `zero/optimizer_state.pt`, which here holds no
  copy of rank 0's shards.
The tensors are streamed (bounded memory, one pass, no temporary fragment files); every record read is checked
against its CRC-32 and the output is written into a temporary sibling renamed into place when complete.

It also converts what DeepSpeed's script refuses or crashes on: checkpoints without `universal_checkpoint_info`
(no --inject_missing_state needed), any optimizer (SGD's `momentum_buffer`, Adagrad's `sum`, ... under their own
keys; DeepSpeed: `KeyError: 'exp_avg'`) and ZeRO-3 checkpoints saved before the first step (`KeyError: 0`).
DeepSpeed's Muon optimizer (param groups with `use_muon`; DeepSpeed's script: `KeyError: 'exp_avg'`, #8608) is
refused, because no DeepSpeed 0.19.8 loader can resume Muon from the universal form (`layouts.universal.refuse_muon`
quotes its errors); `ckpt reshard --dp` keeps Muon's momentum.
--num_extract_workers, --num_merge_workers, --keep_temp_folder, --strict/--no_strict and --inject_missing_state
are accepted and have no effect (one note on stderr says so).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.compat.zero_to_fp32 import _Parser, open_deepspeed, run_cli
from ckpttools.errors import CorruptCheckpointError, OutputError, UnsupportedCheckpointError, UsageError
from ckpttools.io import dtypes
from ckpttools.io.staging import staged_folder, why_not_replaceable, write_text_atomically
from ckpttools.io.torchfile import RecordReader
from ckpttools.io.torchwriter import ProgressFn, whole_tensor, write_torch_files
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.locate import check_tag_name
from ckpttools.layouts.universal import LATEST, STEP
from ckpttools.model.checkpoint import MASTER, Checkpoint, TensorSource, strip_prefixes
from ckpttools.ops.reshard import files_bytes, universal_tag_files

NO_OP_OPTIONS = ("num_extract_workers", "num_merge_workers", "keep_temp_folder", "strict", "inject_missing_state")

__all__ = ["UniversalResult", "cli", "convert_to_universal", "main", "parse_arguments"]


@dataclass
class UniversalResult:
    output_folder: str
    latest_file: str
    files: list[str]
    notes: list[str] = field(default_factory=list)


def _output_folder(path: str | os.PathLike[str], tag_dir: Path) -> tuple[Path, bool]:
    """The absolute output tag folder, and whether an existing one is to be replaced.

    DeepSpeed writes into the folder whatever it holds; here an earlier conversion by ckpt (its content matches
    its manifest) or an empty folder is replaced as a whole, and anything else is refused rather than mixed with
    the new files or deleted. A symlink is followed once: the output goes beside its target.
    """
    out = Path(os.path.abspath(path))  # also drops a trailing slash (DeepSpeed then names the tag "")
    check_tag_name(out.name)
    tag, resolved = tag_dir.resolve(), out.resolve()
    if resolved == tag or tag in resolved.parents:
        raise OutputError(f"--output_folder {out} lies inside the input {tag}; choose a folder beside it")
    if resolved in tag.parents:
        raise OutputError(f"--output_folder {out} contains the input {tag}; writing there could destroy the input")
    if not os.path.lexists(out):
        return out, False
    if out.is_symlink() and not out.exists():
        raise OutputError(f"--output_folder {out} is a symlink to {out.resolve()}, which does not exist")
    if not out.is_dir():
        raise OutputError(f"--output_folder {out} exists and is not a folder")
    out = out.resolve() if out.is_symlink() else out  # the link stays; the output goes beside its target
    why = why_not_replaceable(out)
    if why is not None:  # only an earlier conversion by ckpt, or an empty folder
        raise OutputError(
            f"--output_folder {out} exists and is not a universal checkpoint folder ckpt wrote (it {why}); nothing "
            "was deleted: remove it or choose another"
        )
    return out, True


def _module_fp32_files(ckpt: Checkpoint, written: dict[str, Any]) -> list[tuple[str, TensorSource]]:
    """ZeRO-1/2: `zero/<name>/fp32.pt` for every module entry without one, as DeepSpeed 0.19.8 writes them."""
    out = []
    for raw in ckpt.model_state.get("module") or {}:
        rel = f"zero/{raw}/{MASTER}.pt"
        if rel in written:
            continue
        name = strip_prefixes(raw)
        owner = ckpt.shared_params.get(name, name)
        src = ckpt.buffers.get(name) or ckpt.bit16.get(owner)
        if src is None:
            raise CorruptCheckpointError(f"module entry {raw} is neither a parameter, a tied weight nor a buffer")
        check_tag_name(raw)
        out.append((rel, src))
    return out


def convert_to_universal(
    input_folder: str | os.PathLike[str],
    output_folder: str | os.PathLike[str],
    *,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> UniversalResult:
    """Write the universal checkpoint of `input_folder` at `output_folder`, `latest_universal` beside it."""
    ckpt = open_deepspeed(input_folder)
    if ckpt.source_format == "universal":
        raise UsageError(f"{input_folder} is already a universal checkpoint")
    if ckpt.optimizer.param_groups is None:
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} is an elastic ZeRO-1/2 checkpoint: it carries no param_groups, which the "
            "universal format needs; reshard it natively with `ckpt reshard --dp M` instead"
        )
    out, replace = _output_folder(output_folder, ckpt.location.tag_dir)
    files = universal_tag_files(ckpt)
    if ckpt.zero_stage == 3:  # DeepSpeed keeps the ZeRO-3 step in optimizer_state.pt only
        for p in ckpt.params:
            files.pop(f"zero/{p.file_name}/{STEP}.pt", None)
    if ckpt.layout.kind != "tensor":  # the AutoTP writer lists every TP rank's model-states file itself
        for rank, name in ckpt.location.files.model_files.items():
            files[name] = ckpt.model_files[rank]
    # DeepSpeed takes these from mp_rank_00's module first: for AutoTP, TP rank 0's (local) values
    module_owner = ckpt.slices[0] if ckpt.layout.kind == "tensor" else ckpt
    extra = _module_fp32_files(module_owner, files) if ckpt.zero_stage < 3 else []
    needed = files_bytes(files) + sum(src.numel() * 4 + 8192 for _, src in extra)  # 8192: one torch file's overhead
    notes: list[str] = []
    with RecordReader() as reader:
        check_module_copies(ckpt)  # before anything is written
        with staged_folder(out, overwrite=replace, needed_bytes=needed, notes=notes) as tmp:
            for rel in [*files, *(rel for rel, _ in extra)]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            # DeepSpeed saves {"param": value.float()} for these: the module's values cast to float32
            module_fp32 = [(rel, {"param": whole_tensor(src, src.shape, dtypes.FLOAT32)}) for rel, src in extra]
            write_torch_files([(tmp / rel, obj) for rel, obj in [*files.items(), *module_fp32]], reader,
                              on_start=on_start, on_progress=on_progress)  # fmt: skip
            reader.finish()  # CRC-32 of every record read, before the folder is renamed into place
    latest = out.parent / LATEST
    write_text_atomically(latest, out.name)
    notes.append(f'load it with engine.load_checkpoint("{out.parent}") and "checkpoint": {{"load_universal": true}}')
    return UniversalResult(str(out), str(latest), sorted([*files, *(rel for rel, _ in extra)]), notes)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m ckpttools.ds_to_universal",
        description="Convert a DeepSpeed ZeRO checkpoint into DeepSpeed's universal format (a drop-in for "
        "DeepSpeed's ds_to_universal.py: same options, same layout).",
    )
    parser.add_argument("--input_folder", type=str, required=True, help="Input DeepSpeed Checkpoint folder")
    parser.add_argument("--output_folder", type=str, required=True, help="Output DeepSpeed checkpoint folder")
    no_op = " (accepted for compatibility; no effect: the conversion is streamed in one pass)"
    parser.add_argument("--num_extract_workers", default=None, type=int, help="extract processes" + no_op)
    parser.add_argument("--num_merge_workers", default=None, type=int, help="merge processes" + no_op)
    parser.add_argument(
        "--keep_temp_folder", default=None, action="store_true", help="keep the fragment files" + no_op + "; none made"
    )
    parser.add_argument("--strict", dest="strict", default=None, action="store_true", help="validity checks" + no_op)
    parser.add_argument(
        "--no_strict",
        dest="strict",
        default=None,
        action="store_false",
        help="skip validity checks" + no_op + "; always checked",
    )
    parser.add_argument(
        "--inject_missing_state",
        default=None,
        action="store_true",
        help="inject universal_checkpoint_info" + no_op + "; it is not needed",
    )
    return parser


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's arguments (`parse_arguments` in ds_to_universal.py)."""
    return _parser().parse_args(argv)


def _ignored(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in NO_OP_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            flags.append("--no_strict" if name == "strict" and value is False else f"--{name}")
    return flags


def main(args: argparse.Namespace) -> UniversalResult:
    """Convert as DeepSpeed's `main(args)` does; raises CkptError subclasses on bad input."""
    return convert_to_universal(args.input_folder, args.output_folder)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m ckpttools.ds_to_universal ...`; returns the exit code."""
    args = parse_arguments(argv)

    def body() -> None:
        from ckpttools.cli._common import echo_notes, progress_callbacks

        ignored = _ignored(args)
        if ignored:
            echo_notes(
                [
                    (
                        f"{', '.join(ignored)}: no effect here (one streamed pass, no temporary fragment files, "
                        "every check always on, universal_checkpoint_info not needed)"
                    )
                ]
            )
        with progress_callbacks("ds_to_universal", quiet=False) as progress:
            result = convert_to_universal(args.input_folder, args.output_folder, **progress)
        echo_notes(result.notes)
        print(
            f"Wrote the universal checkpoint {result.output_folder} ({len(result.files)} files) "
            f"and {result.latest_file}"
        )

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(cli())

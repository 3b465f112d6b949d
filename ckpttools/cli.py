"""The `ckpt` command line: parse, call the library, print. Errors become one line and an exit code here.

Exit codes: 0 success, 1 bad checkpoint or failed check, 2 usage error, 3 remote/auth/network failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import CkptError

EPILOG = """\b
Examples:
  ckpt inspect out/checkpoint-500
  ckpt consolidate out/checkpoint-500 --to safetensors --dtype bf16 --out out/model
  ckpt consolidate out/ --step 500 --json
  ckpt reshard out/checkpoint-500 --dp 8
  ckpt reshard out/checkpoint-500 --universal
  ckpt verify out/model --against out/checkpoint-500
  ckpt push out/model --repo my-org/my-model

\b
Exit codes: 0 success, 1 bad checkpoint or failed check, 2 usage error
            (or HF_HUB_OFFLINE set for push), 3 remote/auth/network failure.
Set CKPT_DEBUG=1 to see tracebacks."""


class _Group(click.Group):
    """The one place where library errors become a message and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkptError as e:
            if os.environ.get("CKPT_DEBUG"):
                raise
            click.echo(f"Error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted; nothing was published.", err=True)
            ctx.exit(130)
        except OSError as e:  # disk full, permissions: the user's environment, not a bug
            if os.environ.get("CKPT_DEBUG"):
                raise
            click.echo(f"Error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", err=True)
            ctx.exit(1)


def progress_enabled(quiet: bool) -> bool:
    """Bars only for a person watching: stderr is a terminal and this is not CI."""
    if quiet or os.environ.get("CI") or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        return False
    return sys.stderr.isatty()


class _Progress:
    """Bytes done / total on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str) -> None:
        self.label, self.total, self.done, self.last = label, 0, 0, 0.0
        self.start = time.monotonic()

    def begin(self, total: int) -> None:
        self.total = total

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            pct = 100 * self.done / self.total if self.total else 100
            rate = self.done / max(now - self.start, 1e-6) / 1e6
            sys.stderr.write(
                f"\r{self.label}: {self.done / 1e6:,.0f}/{self.total / 1e6:,.0f} MB ({pct:3.0f}%) {rate:,.0f} MB/s"
            )
            sys.stderr.flush()

    def end(self) -> None:
        if self.last:  # a bar was drawn
            sys.stderr.write("\n")


@contextlib.contextmanager
def progress_callbacks(label: str, quiet: bool) -> Iterator[dict[str, Callable[[int], None] | None]]:
    """`on_start`/`on_progress` arguments that draw a bar on stderr, or None for both when no one watches."""
    if not progress_enabled(quiet):
        yield {"on_start": None, "on_progress": None}
        return
    bar = _Progress(label)
    try:
        yield {"on_start": bar.begin, "on_progress": bar.advance}
    finally:
        bar.end()


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _emit(data: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    click.echo(json.dumps(data, indent=None, default=str) if as_json else human(data))


def _notes(data: dict[str, Any]) -> None:
    for note in data.get("notes", []):
        click.echo(f"Note: {note}", err=True)


def _report(data: dict[str, Any], as_json: bool, quiet: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Notes on stderr (unless quiet), then the result on stdout."""
    if not quiet:
        _notes(data)
    _emit(data, as_json, human)


checkpoint_path = click.argument("path", type=click.Path(path_type=Path))
tag_option = click.option("--tag", help="Tag folder to read (default: the content of `latest`).")
step_option = click.option("--step", type=int, help="With a Trainer output_dir: use checkpoint-STEP (default: newest).")
best_option = click.option("--best", is_flag=True, help="With a Trainer output_dir: use best_model_checkpoint.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")


def checkpoint_selection(f: Callable[..., Any]) -> Callable[..., Any]:
    """--tag, --step and --best: which checkpoint and tag inside PATH to read."""
    return tag_option(step_option(best_option(f)))


quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")


@click.group(cls=_Group, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def main() -> None:
    """Inspect, consolidate and reshard DeepSpeed ZeRO checkpoints."""


@main.command("consolidate", epilog=EPILOG)
@checkpoint_path
@click.option(
    "--to",
    "to",
    type=click.Choice(["safetensors", "pt"]),
    default="safetensors",
    show_default=True,
    help="Output format.",
)
@click.option(
    "--out", "out", type=click.Path(path_type=Path), help="Output folder (default: hf-<checkpoint> beside it)."
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default="fp32",
    show_default=True,
    help="Output dtype for floating tensors.",
)
@click.option("--max-shard-size", "--max_shard_size", default="5GB", show_default=True, help="Largest output file.")
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@click.option(
    "--check-keys",
    is_flag=True,
    help="Also build the model from config.json (meta device) and fail on missing/unexpected keys.",
)
@checkpoint_selection
@json_option
@quiet_option
def consolidate_cmd(
    path: Path,
    to: str,
    out: Path | None,
    dtype: str,
    max_shard_size: str,
    overwrite: bool,
    check_keys: bool,
    tag: str | None,
    step: int | None,
    best: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write consolidated weights from a ZeRO checkpoint as a folder from_pretrained loads."""
    from .consolidate import consolidate

    with progress_callbacks("consolidate", quiet) as progress:
        result = consolidate(path, out, to=to, dtype=dtype, max_shard_size=max_shard_size, tag=tag, step=step,
                             best=best, overwrite=overwrite, check_keys=check_keys, **progress)  # fmt: skip
    _report(
        result.to_dict(),
        as_json,
        quiet,
        lambda d: (
            f"Wrote {d['num_tensors']} tensors ({d['num_parameters']:,} parameters, {human_size(d['total_size'])}, "
            f"{d['dtype']}) to {d['output_dir']}: {', '.join(d['files'])}"
        ),
    )


@main.command("reshard", epilog=EPILOG)
@checkpoint_path
@click.option("--dp", "dp", type=int, help="The new data-parallel size (number of ranks): native ZeRO files.")
@click.option("--universal", is_flag=True, help="Write DeepSpeed's universal checkpoint instead (any DP size).")
@click.option(
    "--out", "out", type=click.Path(path_type=Path), help="Output folder (default: dp<M>-<checkpoint> beside it)."
)
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@checkpoint_selection
@json_option
@quiet_option
def reshard_cmd(
    path: Path,
    dp: int | None,
    universal: bool,
    out: Path | None,
    overwrite: bool,
    tag: str | None,
    step: int | None,
    best: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Rewrite a ZeRO checkpoint for a different number of data-parallel ranks.

    With --dp M the result loads with DeepSpeed's plain load_checkpoint (and Trainer's
    resume_from_checkpoint) at M ranks, with the same DeepSpeed config. With --universal it is
    DeepSpeed's universal format (load with "checkpoint": {"load_universal": true}); a universal
    checkpoint given as PATH with --dp M becomes native shards again.
    """
    from .reshard import reshard

    with progress_callbacks("reshard", quiet) as progress:
        result = reshard(path, out, dp=dp, universal=universal, tag=tag, step=step, best=best, overwrite=overwrite,
                         **progress)  # fmt: skip
    _report(
        result.to_dict(),
        as_json,
        quiet,
        lambda d: (
            f"Resharded ZeRO-{d['zero_stage']} tag {d['tag']} from {_dp_name(d['dp_from'])} to {_dp_name(d['dp_to'])}: "
            f"{d['output_dir']}"
            if d["output_dir"]
            else "Nothing written."
        ),
    )


def _dp_name(dp: int | None) -> str:
    return f"DP {dp}" if dp else "universal"


@main.command("inspect", epilog=EPILOG)
@checkpoint_path
@checkpoint_selection
@json_option
def inspect_cmd(path: Path, tag: str | None, step: int | None, best: bool, as_json: bool) -> None:
    """Describe a ZeRO checkpoint: stage, DP size, dtype, sizes, ties, Trainer state."""
    from .inspect import inspect_checkpoint

    data = inspect_checkpoint(path, tag=tag, step=step, best=best)
    _emit(data, as_json, _human_inspect)


def _human_inspect(d: dict[str, Any]) -> str:
    ts = d["trainer_state"]
    lines = [
        f"checkpoint     {d['path']} (tag {d['tag']}; tags here: {', '.join(d['tags'])})",
        f"layout         ZeRO-{d['zero_stage']}, DP {d['dp_world_size']}, {d['train_dtype']} training, "
        f"{d['optimizer']} optimizer, DeepSpeed {d['ds_version']}",
        f"parameters     {d['num_parameters']:,} ({d['trainable_parameters']:,} trainable in {d['num_trainable']} tensors, "
        f"{d['frozen_parameters']:,} frozen in {d['num_frozen']})",
        f"buffers        {d['num_buffers']}",
        f"tied           {', '.join(f'{a} -> {o}' for a, o in d['tied'].items()) or 'none'}",
        f"16-bit weights {', '.join(d['gathered_16bit_weights']) or 'none saved beside the shards'}",
        "output size    " + ", ".join(f"{k} {human_size(v)}" for k, v in d["output_bytes"].items()),
    ]
    if ts:
        lines.append(
            f"trainer        step {ts.get('global_step')}, epoch {ts.get('epoch')}, last loss {ts.get('last_loss')}"
        )
    if d["frozen_excluded"]:
        lines.append("note           saved without frozen params: base-model weights are absent (LoRA/PEFT)")
    return "\n".join(lines)


def _register_optional_commands() -> None:
    """Commands living in their own modules (kept out of this file's import cost until used)."""
    from .cli_hub import push_cmd, verify_cmd

    main.add_command(verify_cmd)
    main.add_command(push_cmd)


_register_optional_commands()

if __name__ == "__main__":
    main()

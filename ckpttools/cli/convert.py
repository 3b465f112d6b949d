"""`ckpt consolidate`, `ckpt reshard` and `ckpt inspect`: parse, call the library, print.

The library is imported inside each command, so `ckpt --help` and each command load only what they use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckpttools.cli._common import (
    DTYPE,
    EPILOG,
    INPUTS,
    OUTPUT_PATH,
    SIZE,
    checkpoint_path,
    checkpoint_selection,
    config_option,
    distributed_option,
    emit,
    human_size,
    json_option,
    launch_for,
    needs_out,
    progress_callbacks,
    quiet_option,
    report,
    run_on_ranks,
    workers_option,
)

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import ProcessGroup


@click.command("consolidate", epilog=EPILOG)
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
    "--out", "out", type=OUTPUT_PATH, help="Output folder (default: hf-<checkpoint> beside it; a local folder)."
)
@click.option(
    "--dtype",
    type=DTYPE,
    default="fp32",
    show_default=True,
    help="Output dtype for floating tensors. bf16/fp16 output leaves in fp32 the buffers a 16-bit run kept in fp32 "
    "(DeepSpeed's keep_in_fp32, such as e_score_correction_bias), as the engine's save_16bit_model does.",
)
@click.option(
    "--max-shard-size", "--max_shard_size", type=SIZE, default="5GB", show_default=True, help="Largest output file."
)
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@config_option
@click.option(
    "--replace-config",
    is_flag=True,
    help="Write --config even though it differs from the checkpoint's own config.json (without it, that is refused).",
)
@click.option(
    "--check-keys",
    is_flag=True,
    help="Fail when the keys cannot be checked. The keys and shapes are always checked against the class config.json "
    "names, built on the meta device, whenever a config.json is written and transformers is installed; a mismatch "
    "fails with nothing written. A PEFT adapter folder is checked against PeftModel of the base model (--config).",
)
@click.option(
    "--merge",
    is_flag=True,
    help="PEFT/LoRA run: write the full model with the adapters merged (as merge_and_unload).",
)
@click.option(
    "--base",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="With --merge: the base model's folder (weights and config.json), for runs saved without frozen weights.",
)
@workers_option
@distributed_option
@checkpoint_selection
@json_option
@quiet_option
def consolidate_cmd(
    path: Path,
    to: str,
    out: Path | None,
    dtype: str,
    max_shard_size: int,
    overwrite: bool,
    config: Path | None,
    replace_config: bool,
    check_keys: bool,
    merge: bool,
    base: Path | None,
    workers: int | None,
    distributed: bool,
    tag: str | None,
    step: int | None,
    best: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a sharded training checkpoint's weights as a folder from_pretrained loads.

    {inputs}

    A PEFT (LoRA) run gives the adapter folder PEFT's save_pretrained writes; with --merge, the full
    model with the adapters merged into the base weights. With --distributed under torchrun the ranks
    share the shards, balanced by bytes, into one folder on a filesystem they all see; only rank 0 prints.

    PATH may be remote (s3://, gs://, az:// with the matching extra, hf:// repos and buckets): only the
    records the conversion needs are fetched, by byte range, with the same CRC-32 checks; give --out.

    Megatron's and torchtitan's names are mapped onto the Hugging Face class config.json names (from the
    run's own record, else --config). A Megatron save's integrity.json is checked first: every file it
    lists is hashed again (CKPT_SKIP_INTEGRITY=1 skips it).
    """
    from ckpttools.ops.consolidate import ConsolidateOptions, consolidate

    needs_out(path, out)
    options = ConsolidateOptions(to=to, dtype=dtype, max_shard_size=max_shard_size, tag=tag, step=step, best=best,
                                 overwrite=overwrite, check_keys=check_keys, config=config, merge=merge,
                                 base=base, replace_config=replace_config)  # fmt: skip

    def run(group: ProcessGroup | None = None) -> None:
        rank0 = group is None or group.rank == 0
        with progress_callbacks("consolidate", quiet or not rank0) as progress:
            result = consolidate(path, out, options=options, group=group, **progress)
        if rank0:
            report(result.to_dict(), as_json, quiet, _human_consolidate)

    with launch_for(distributed, quiet, workers) as launch:
        if launch is None:
            run()
        else:
            run_on_ranks(launch, run)


def _human_consolidate(d: dict[str, Any]) -> str:
    ranks = f" on {d['world_size']} ranks" if d.get("world_size") else ""
    return (
        f"Wrote {d['num_tensors']} tensors ({d['num_parameters']:,} parameters, {human_size(d['total_size'])}, "
        f"{d['dtype']}){ranks} to {d['output_dir']}: {', '.join(d['files'])}"
    )


@click.command("reshard", epilog=EPILOG)
@checkpoint_path
@click.option("--dp", "dp", type=int, help="The new data-parallel size (number of ranks): native ZeRO files.")
@click.option("--universal", is_flag=True, help="Write DeepSpeed's universal checkpoint instead (any DP size).")
@click.option(
    "--stage",
    "stage",
    type=click.IntRange(1, 3),
    help="Write the files DeepSpeed saves at this ZeRO stage (1, 2 or 3), to resume at that stage.",
)
@click.option(
    "--out", "out", type=OUTPUT_PATH, help="Output folder (default: dp<M>-<checkpoint> beside it; a local folder)."
)
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@config_option
@workers_option
@distributed_option
@checkpoint_selection
@json_option
@quiet_option
def reshard_cmd(
    path: Path,
    dp: int | None,
    universal: bool,
    stage: int | None,
    out: Path | None,
    overwrite: bool,
    config: Path | None,
    workers: int | None,
    distributed: bool,
    tag: str | None,
    step: int | None,
    best: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Rewrite a DeepSpeed ZeRO checkpoint for a different number of data-parallel ranks or another ZeRO stage.

    With --dp M the result loads with DeepSpeed's plain load_checkpoint (and Trainer's
    resume_from_checkpoint) at M ranks, with the same DeepSpeed config. With --stage S (and
    optionally --dp M) it holds what DeepSpeed saves at ZeRO stage S: resume with
    zero_optimization.stage S. With --universal it is DeepSpeed's universal format (load with
    "checkpoint": {"load_universal": true}); a universal checkpoint given as PATH with --dp M
    becomes native shards again. With --distributed under torchrun the ranks share the rank files (or
    universal parameter folders), balanced by bytes, into one folder they all see; only rank 0 prints.

    PATH is a DeepSpeed checkpoint (native or universal; a Trainer, accelerate or Lightning folder around
    one), local or remote (s3://, gs://, az://, hf://, read by byte range; give --out). FSDP2 / torch DCP
    checkpoints are refused (torch's dcp.load reshards them itself at the world size that loads them;
    consolidate gives a model folder).
    """
    from ckpttools.ops.reshard import reshard

    needs_out(path, out)

    def run(group: ProcessGroup | None = None) -> None:
        rank0 = group is None or group.rank == 0
        with progress_callbacks("reshard", quiet or not rank0) as progress:
            result = reshard(path, out, dp=dp, universal=universal, stage=stage, tag=tag, step=step, best=best,
                             overwrite=overwrite, config=config, group=group, **progress)  # fmt: skip
        if rank0:
            report(result.to_dict(), as_json, quiet, _human_reshard)

    with launch_for(distributed, quiet, workers) as launch:
        if launch is None:
            run()
        else:
            run_on_ranks(launch, run)


def _human_reshard(d: dict[str, Any]) -> str:
    if not d["output_dir"]:
        return "Nothing written."
    ranks = f" on {d['world_size']} ranks" if d.get("world_size") else ""
    if d.get("zero_stage_from"):
        return (
            f"Resharded tag {d['tag']} from ZeRO-{d['zero_stage_from']}, {_dp_name(d['dp_from'])} to "
            f"ZeRO-{d['zero_stage']}, {_dp_name(d['dp_to'])}{ranks}: {d['output_dir']}"
        )
    return (
        f"Resharded ZeRO-{d['zero_stage']} tag {d['tag']} from {_dp_name(d['dp_from'])} to {_dp_name(d['dp_to'])}"
        f"{ranks}: {d['output_dir']}"
    )


def _dp_name(dp: int | None) -> str:
    return f"DP {dp}" if dp else "universal"


@click.command("inspect", epilog=EPILOG)
@checkpoint_path
@checkpoint_selection
@json_option
def inspect_cmd(path: Path, tag: str | None, step: int | None, best: bool, as_json: bool) -> None:
    """Describe a sharded training checkpoint: layout, ranks, dtype, sizes, ties, optimizer, Trainer state.

    {inputs}

    A remote PATH's listing and small files are read, the rank files' pickles by byte range.
    """
    from ckpttools.ops.inspect import inspect_checkpoint

    data = inspect_checkpoint(path, tag=tag, step=step, best=best)
    emit(data, as_json, _human_inspect)


def _parallel(d: dict[str, Any]) -> str:
    """`DP 2`, `DP 2 x TP 2 (tensor-parallel (AutoTP))`: the degrees that are not 1."""
    from ckpttools.layouts.registry import layout_named
    from ckpttools.model.parallel import ParallelLayout

    p = d.get("parallel") or {"kind": "dp", "dp": d["dp_world_size"]}
    layout = ParallelLayout(p["kind"], p["dp"], p.get("tp", 1), p.get("pp", 1), p.get("ep", 1))
    return layout.describe() + ("" if layout.kind == "dp" else f" ({layout_named(layout.kind).title})")


def _layout_lines(p: dict[str, Any]) -> list[str]:
    """What the checkpoint's layout adds to `ckpt inspect` (pipeline stages, experts per layer, ...)."""
    from ckpttools.layouts.registry import layout_named

    return layout_named(p["kind"]).describe(p) if p.get("kind") else []


def _run_line(d: dict[str, Any]) -> str:
    """How the run saved it: ZeRO stage, layout, dtypes and DeepSpeed version (other writers: layout and dtype)."""
    if not d.get("ds_version"):  # not written by DeepSpeed (torch DCP): what its layout plug-in calls it
        return f"{_parallel(d)}, {d['train_dtype']} tensors"
    return (
        f"ZeRO-{d['zero_stage']}, {_parallel(d)}, {d['train_dtype']} training, {d['optimizer']} optimizer, "
        f"DeepSpeed {d['ds_version']}" + (" (universal format)" if d.get("format") == "universal" else "")
    )


def _optim_states(d: dict[str, Any]) -> str:
    """The optimizer state the checkpoint holds: its keys and size, none yet (before the first step), or none."""
    if d.get("optimizer_saved") is False:
        return "none saved (the checkpoint holds the model only)"
    where = f" in {d['optimizer_files']}" if d.get("optimizer_files") else ""
    keys = ", ".join(d.get("optimizer_states") or [])
    size = d.get("optimizer_state_bytes")
    if not keys:
        return f"present{where}, not described" if size is None else f"none yet (saved before the first step){where}"
    return f"{keys} ({human_size(size)}{where})" if size is not None else f"{keys}{where}"


def _rounded(value: Any, digits: int) -> Any:
    """A float as people read it (epoch 0.91, not 0.9090909090909091; the JSON keeps every digit)."""
    return round(value, digits) if isinstance(value, float) else value


def _human_inspect(d: dict[str, Any]) -> str:
    ts = d["trainer_state"]
    lines = [
        f"checkpoint     {d['path']} (tag {d['tag']}; tags here: {', '.join(d['tags'])})",
        f"layout         {_run_line(d)}",
        f"optim states   {_optim_states(d)}",
        (
            f"parameters     {d['trainable_parameters'] + d['frozen_parameters']:,} "
            f"({d['trainable_parameters']:,} trainable in {d['num_trainable']} tensors, "
            f"{d['frozen_parameters']:,} frozen in {d['num_frozen']})"
        ),
        f"buffers        {d['num_buffers']}",
        f"elements       {d['num_parameters']:,} written by consolidate (buffers included, ties once)",
        f"tied           {', '.join(f'{a} -> {o}' for a, o in d['tied'].items()) or 'none'}",
        f"16-bit weights {', '.join(d['gathered_16bit_weights']) or 'none saved beside the shards'}",
        "output size    " + ", ".join(f"{k} {human_size(v)}" for k, v in d["output_bytes"].items()),
    ]
    lines += _layout_lines(d.get("parallel") or {})
    if d.get("adapter"):
        lines.append(f"maps to        {d['adapter']}")
    if ts:
        lines.append(
            f"trainer        step {ts.get('global_step')}, epoch {_rounded(ts.get('epoch'), 2)}, "
            f"last loss {_rounded(ts.get('last_loss'), 4)}"
        )
    if d["frozen_excluded"]:
        lines.append("note           saved without frozen params: base-model weights are absent (LoRA/PEFT)")
    return "\n".join(lines)


for _command in (consolidate_cmd, inspect_cmd):  # the inputs read, in one place (cli._common.INPUTS)
    _command.help = (_command.help or "").replace("{inputs}", INPUTS)
del _command

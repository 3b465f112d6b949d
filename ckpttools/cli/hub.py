"""`ckpt verify` and `ckpt push`: parse, call ckpttools.ops.verify / ckpttools.ops.push, print.

huggingface_hub (and, for verify, transformers) are imported inside the commands, so `ckpt consolidate`
does not pay for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckpttools import signals
from ckpttools.cli._common import (
    CHECKPOINT_PATH,
    DTYPE,
    SIZE,
    STEP,
    echo_error,
    echo_json,
    echo_notes,
    emit,
    human_size,
    json_option,
    progress_callbacks,
    progress_enabled,
    quiet_option,
)

if TYPE_CHECKING:
    from ckpttools.ops.verify import VerifyReport

VERIFY_EPILOG = """\b
Examples:
  ckpt verify out/model
  ckpt verify out/model --against out/checkpoint-500 --json
  ckpt verify out/adapter --base meta-llama/Llama-3.2-1B

\b
A folder with adapter_config.json is checked as a PEFT adapter: the config,
the adapter weights' headers, PEFT's key layout; with --base, the keys and
shapes of the PeftModel built on the meta device.

\b
Exit codes: 0 the folder is sound, 1 problems found (each on its own stderr
            line, or under "problems" with --json), or a --against
            checkpoint missing or damaged, 2 usage error, 3 a remote
            --against (s3://, gs://, az://, hf://) could not be read: network
            or store failure (retrying may help), 4 its credentials missing
            or refused (retrying cannot help), 130 SIGINT, 143 SIGTERM,
            129 SIGHUP.
Set CKPT_DEBUG=1 to see tracebacks."""

PUSH_EPILOG = """\b
Examples:
  ckpt push out/model --repo my-org/my-model
  ckpt push out/checkpoint-500 --repo my-org/my-model --dtype bf16 --revision step-500
  ckpt push out/model --repo my-org/my-model --create-pr --json
  ckpt push out/model --repo my-org/my-model --dry-run --include "*.py"
  ckpt push out/hf-checkpoint-500 --repo my-org/my-lora   # a PEFT adapter folder

\b
Only the files a model repo holds are uploaded, at any depth: weights and their
index, config.json, generation_config.json, tokenizer and chat template files,
README.md, adapter files, processor configs. --include adds more (patterns as
for `hf upload`); training state, global_step*/, checkpoint-*/, zero/ and
other ckpt outputs are never uploaded. --dry-run lists the files and sizes,
and checks the token and the right to write as a push does (exit 4 as the
push would), creating and sending nothing; offline, a note says it did not.

\b
The token comes from --token, HF_TOKEN or `hf auth login` (never printed); it
and the right to write the repo are checked before anything is consolidated.
Repos are created private unless --public; an existing public repo needs --public.
Re-running after a failure resumes: files already on the Hub are not sent again.
A signal (Ctrl-C) once the commit request has left waits for the Hub's answer
(CKPT_PUSH_COMMIT_WAIT seconds, default 30; a second Ctrl-C stops waiting), then
reads the branch head: published (exit 0, with a note), not published (130/143),
or, when neither tells, a line saying whether it landed is unknown (130/143).
A commit whose answer is lost (connection dropped) is looked for on the Hub the
same way: when it landed, push says so and exits 0.

\b
Weights holding NaN or Inf are never published silently: counted as a
checkpoint's shards are written (a folder's weight files are read once more),
they are refused (exit 1) unless --allow-nonfinite.

\b
Exit codes: 0 pushed (or dry run done), 1 the folder failed verification, holds
            NaN/Inf weights, or the checkpoint is bad (nothing published),
            2 usage error or HF_HUB_OFFLINE set,
            3 Hub or network failure (retrying may help), 4 no token, token
            rejected or no write access (log in: retrying cannot help),
            130 SIGINT, 143 SIGTERM, 129 SIGHUP (not published, or unknown
            when the commit request had left: the line says which).
Set CKPT_DEBUG=1 to see tracebacks."""


@click.command("verify", epilog=VERIFY_EPILOG)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--against",
    type=CHECKPOINT_PATH,
    metavar="CKPT",
    help="The checkpoint the folder was consolidated from (anything consolidate reads: DeepSpeed, FSDP2 / torch "
    "DCP, Megatron-Core, torchtitan, Trainer/accelerate/Lightning folders, or s3://, gs://, az://, hf:// read by "
    "range): every tensor must be bit-identical to the one rebuilt from its shards.",
)
@click.option("--tag", help="With --against: tag folder to read (default: the content of `latest`).")
@click.option("--step", type=STEP, help="With --against and a run folder: its checkpoint-STEP or step-STEP folder.")
@click.option(
    "--base",
    metavar="PATH|ORG/NAME",
    help="For a PEFT adapter folder: the base model; the PeftModel is built on the meta device and its keys checked.",
)
@json_option
@quiet_option
@click.pass_context
def verify_cmd(
    ctx: click.Context,
    folder: Path,
    against: Path | None,
    tag: str | None,
    step: int | None,
    base: str | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Check a consolidated folder (or a PEFT adapter folder) the way from_pretrained / PEFT will read it."""
    from ckpttools.errors import UsageError
    from ckpttools.ops.verify import verify_folder

    if against is None and (tag is not None or step is not None):
        raise UsageError("--tag and --step choose the checkpoint for --against; pass --against too")
    with progress_callbacks("verify", quiet or against is None) as progress:
        result = verify_folder(folder, against=against, tag=tag, step=step, base=base, **progress)
    if as_json:
        echo_json(result.to_dict())
    else:
        for problem in result.problems:
            echo_error(problem)
        if not quiet:
            echo_notes(result.notes)
        click.echo(_human_verify(result))
    if not result.ok:
        ctx.exit(1)


def _human_verify(r: VerifyReport) -> str:
    files = ", ".join(r.files) or "no weight file"
    what = f"{r.num_tensors} tensors, {r.num_parameters:,} parameters, {r.dtype or 'no floating'} weights in {files}"
    if r.kind == "adapter":
        what = f"PEFT adapter for {r.base_model or 'an unnamed base model'}: {what}"
    if not r.ok:
        return f"{r.folder}: {len(r.problems)} problem(s) ({what})"
    return f"{r.folder}: sound ({what}); checked " + "; ".join(r.checks)


@click.command("push", epilog=PUSH_EPILOG)
@click.argument("path", default=".", type=CHECKPOINT_PATH)
@click.option(
    "--repo", "repo_id", required=True, metavar="ORG/NAME", help="Repository to push to (created if missing)."
)
@click.option("--private/--public", "private", default=None, help="Visibility of a new repo.  [default: private]")
@click.option("--revision", metavar="BRANCH", help="Branch to push to (created from main if missing), or refs/pr/N.")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main instead of committing to it.")
@click.option("--commit-message", "--commit_message", help="Commit title (default: names the model and step).")
@click.option("--endpoint", metavar="URL", help="Hub URL (default: HF_ENDPOINT, else https://huggingface.co).")
@click.option("--token", help="Hub token (default: HF_TOKEN or the stored `hf auth login`).")
@click.option("--dry-run", is_flag=True,
              help="Verify, check the token and the right to write the repo (read-only calls; skipped with a note "
              "when HF_HUB_OFFLINE is set), list the files and sizes that would be sent; send nothing.")  # fmt: skip
@click.option("--include", multiple=True, metavar="PATTERN",
              help="Also upload files matching PATTERN (as `hf upload --include`; repeatable).")  # fmt: skip
@click.option("--exclude", multiple=True, metavar="PATTERN",
              help="Do not upload files matching PATTERN (as `hf upload --exclude`; repeatable).")  # fmt: skip
@click.option("--base-model", metavar="ORG/NAME",
              help="Adapter folders: the base model for the card, when adapter_config.json names none.")  # fmt: skip
@click.option("--force", is_flag=True, help="Push even if verification finds problems.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Publish weights holding NaN or Inf (a note names them); without it, exit 1.")  # fmt: skip
@click.option("--source", type=click.Path(path_type=Path), metavar="CKPT",
              help="The checkpoint PATH was consolidated from, recorded in the model card.")  # fmt: skip
@click.option("--dtype", type=DTYPE, default="fp32", show_default=True,
              help="When PATH is a checkpoint: dtype of the consolidated weights.")  # fmt: skip
@click.option(
    "--max-shard-size",
    "--max_shard_size",
    type=SIZE,
    default="5GB",
    show_default=True,
    help="When PATH is a checkpoint: largest file. The shards are written one at a time into the temporary "
    "folder, each sent and deleted before the next: local scratch is one shard, not the model.",
)
@click.option("--config", type=click.Path(exists=True, path_type=Path), metavar="PATH",
              help="When PATH is a checkpoint without one: the model's config.json (or its folder).")  # fmt: skip
@click.option("--tag", help="When PATH is a checkpoint: tag folder to read (default: `latest`).")
@click.option("--step", type=STEP, help="When PATH is a run folder: its checkpoint-STEP or step-STEP folder.")
@click.option("--best", is_flag=True, help="When PATH is a Trainer output_dir: use best_model_checkpoint.")
@json_option
@quiet_option
def push_cmd(
    path: Path, repo_id: str, private: bool | None, revision: str | None, create_pr: bool,
    commit_message: str | None, endpoint: str | None, token: str | None, dry_run: bool,
    include: tuple[str, ...], exclude: tuple[str, ...], base_model: str | None, force: bool, allow_nonfinite: bool,
    source: Path | None, dtype: str, max_shard_size: int, config: Path | None, tag: str | None, step: int | None,
    best: bool,
    as_json: bool, quiet: bool,
) -> None:  # fmt: skip
    """Verify a model or adapter folder (or consolidate a sharded training checkpoint: DeepSpeed ZeRO, FSDP2 / torch
    DCP, Megatron-Core, torchtitan) and upload it to the Hugging Face Hub.

    PATH may be remote (s3://, gs://, az://, hf://): a checkpoint there is read by byte range, never copied
    whole. A checkpoint (remote or local) is streamed: its shards are written one at a time into a local
    temporary folder (TMPDIR), each verified (header; every tensor bit-identical to the checkpoint), uploaded
    and deleted before the next, so local scratch is bounded by --max-shard-size (plus the small files), not
    the model's size. Nothing is published until one commit at the end.
    """
    from ckpttools.ops.push import push

    _quiet_hub(quiet, bars=progress_enabled(quiet))
    landed: list[Any] = []
    try:
        result = push(
            path, repo_id, private=private, revision=revision, create_pr=create_pr, commit_message=commit_message,
            endpoint=endpoint, token=token, dry_run=dry_run, force=force, source=source, dtype=dtype,
            max_shard_size=max_shard_size, tag=tag, step=step, best=best, config=config, include=include,
            exclude=exclude, base_model=base_model, allow_nonfinite=allow_nonfinite,
            on_wait=None if quiet else _say, landed=landed,
        )  # fmt: skip
    except KeyboardInterrupt:
        if not landed:
            raise  # not sent, or the Hub's answer and head show it did not land: "nothing was published" is true
        result = landed[0]  # the signal came once the commit had landed: the push is complete
    with signals.disarmed():  # the commit landed: a signal now must not turn the report into "interrupted"
        if not quiet:
            echo_notes(result.problems, prefix="Warning: pushed despite: ")
            echo_notes(result.notes)
        emit(result.to_dict(), as_json, _human_push)
        if not result.dry_run and signals.received() is not None:
            signals.mark_reported()  # published, as the output says: exit 0, no "Interrupted ..." line


def _say(line: str) -> None:
    click.echo(line, err=True)


def _quiet_hub(quiet: bool, *, bars: bool) -> None:
    """Progress bars only for a person at a terminal (not in CI, not with -q); -q also drops hub warnings."""
    from huggingface_hub.utils import disable_progress_bars, logging

    if not bars:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        disable_progress_bars()
    if quiet:
        logging.set_verbosity_error()


def _human_push(d: dict[str, Any]) -> str:
    n, size = len(d["files"]), human_size(d["total_size"])
    if d["dry_run"]:
        head = (
            f"Dry run, nothing sent: would upload {n} files ({size}) to {d['repo_id']} at {d['revision']} "
            f"({d['visibility']} if created) on {d['endpoint']}"
        )
        if d["kind"] == "adapter":
            head += f"; a PEFT adapter for {d['base_model'] or 'a base model it does not name'}"
        lines = [head]
        width = max(len(f["path"]) for f in d["files"])
        lines += [
            f"  {f['path']:<{width}}  {human_size(f['size']):>9}"
            + ("  (generated model card)" if f.get("generated") else "")
            for f in d["files"]
        ]
        return "\n".join(lines)
    if d["pr_url"]:
        return f"Opened pull request {d['pr_url']} on {d['repo_id']} ({d['visibility']}): {n} files ({size})"
    return f"Pushed {n} files ({size}) to {d['repo_id']} ({d['visibility']}) at {d['revision']}: {d['commit_url']}"

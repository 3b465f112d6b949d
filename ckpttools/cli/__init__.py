"""The `ckpt` command line: parse, call the library, print.

Exit codes: 0 success, 1 bad checkpoint or failed check, 2 usage error, 3 remote or network failure, 4
authentication refused, 130 SIGINT, 143 SIGTERM, 129 SIGHUP.

The signal handler is installed first, before click loads (see `ckpttools.signals`). `_common` holds the one
error boundary (`CkptGroup`) and what the commands share; `convert` holds consolidate, reshard and inspect;
`hub` holds verify and push. The command modules import `_common` only, never this package, and import the
library inside each command, so `ckpt consolidate` does not load huggingface_hub, transformers or torch.
"""

# ruff: noqa: E402 - the signal handler goes in before the imports below, on purpose

from __future__ import annotations

import sys

# `ckpt` itself (the console script, or `python -m ckpttools.cli`, whose argv[0] is "-m" while this package
# loads): from here on a signal is one line and an exit code, never a traceback. A program importing the CLI
# (tests, scripts) keeps its own handlers; run_guarded installs them around each command's body.
_IS_CKPT = bool(sys.argv) and (sys.argv[0] == "-m" or sys.argv[0].rsplit("/", 1)[-1] in ("ckpt", "ckpt.exe"))
_early_signals: list[int] = []
if _IS_CKPT:
    # First, before anything is imported: `_signal` is built into the interpreter, while `signal` (and so
    # ckpttools.signals) imports enum, a few ms in which a signal would still land as a traceback. Signals that
    # come meanwhile are recorded here and handed to the real handler below.
    import _signal  # type: ignore[import-not-found]  # built into the interpreter; typeshed has no stub

    for _signum in (_signal.SIGINT, _signal.SIGTERM, getattr(_signal, "SIGHUP", None)):
        if _signum is not None:
            _signal.signal(_signum, lambda signum, frame: _early_signals.append(signum))

from ckpttools.signals import install as _install_signal_handler

if _IS_CKPT:
    _install_signal_handler(early=_early_signals)

import click  # after the signal handler

from ckpttools._version import __version__
from ckpttools.cli._common import EPILOG, CkptGroup
from ckpttools.cli.compare import diff_cmd, stats_cmd
from ckpttools.cli.convert import consolidate_cmd, inspect_cmd, reshard_cmd
from ckpttools.cli.hub import push_cmd, verify_cmd

__all__ = ["main"]


@click.group(cls=CkptGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def main() -> None:
    """Inspect, consolidate, reshard, verify and publish sharded training checkpoints.

    Reads DeepSpeed ZeRO 0-3 (NVMe offload, pipeline, AutoTP, MoE, Megatron-DeepSpeed 3D) and universal
    checkpoints, FSDP2 / torch DCP folders, Megatron-Core torch_dist (Megatron-LM, Megatron-Bridge, NeMo 2)
    and torchtitan step-N folders, and the Hugging Face Trainer, accelerate and Lightning folders around them,
    local or at s3://, gs://, az://, hf:// URLs. Megatron's and torchtitan's names are mapped onto Hugging
    Face's (Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3, ...) so that from_pretrained loads the output.
    """


for _command in (consolidate_cmd, reshard_cmd, inspect_cmd, verify_cmd, push_cmd, diff_cmd, stats_cmd):
    main.add_command(_command)
del _command

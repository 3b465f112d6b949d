"""The `ckpt` command line: parse, call the library, print.

Exit codes: 0 success, 1 bad checkpoint or failed check, 2 usage error, 3 remote/auth/network failure,
130 interrupted.

`_common` holds the one error boundary (`CkptGroup`) and what the commands share; `convert` holds
consolidate, reshard and inspect; `hub` holds verify and push. The command modules import `_common` only,
never this package, and import the library inside each command, so `ckpt consolidate` does not load
huggingface_hub, transformers or torch.
"""

from __future__ import annotations

import click

from .. import __version__
from ._common import EPILOG, CkptGroup
from .convert import consolidate_cmd, inspect_cmd, reshard_cmd
from .hub import push_cmd, verify_cmd

__all__ = ["main"]


@click.group(cls=CkptGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def main() -> None:
    """Inspect, consolidate and reshard DeepSpeed ZeRO checkpoints."""


for _command in (consolidate_cmd, reshard_cmd, inspect_cmd, verify_cmd, push_cmd):
    main.add_command(_command)
del _command

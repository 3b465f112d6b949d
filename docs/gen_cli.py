"""Write docs/cli.md from the commands' own help, so the reference cannot drift from the code.

.venv/bin/python docs/gen_cli.py          # rewrite docs/cli.md
.venv/bin/python docs/gen_cli.py --check  # exit 1 if docs/cli.md is out of date (tests/test_docs.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ckpttools.cli import main as ckpt

TARGET = Path(__file__).with_name("cli.md")
HEADER = """\
# CLI reference

Generated from the commands' own `--help` by `docs/gen_cli.py`; do not edit by hand.
"""


def _help(command: click.Command, name: str, parent: click.Context | None = None) -> str:
    # A fixed width, so the file does not depend on the terminal it was generated in.
    settings = {**command.context_settings, "terminal_width": 100, "max_content_width": 100}
    with click.Context(command, info_name=name, parent=parent, **settings) as ctx:
        return command.get_help(ctx)


def render() -> str:
    parts = [HEADER, "## ckpt\n", "```text", _help(ckpt, "ckpt"), "```\n"]
    root = click.Context(ckpt, info_name="ckpt")
    for name in sorted(ckpt.list_commands(root)):
        command = ckpt.get_command(root, name)
        if command is None or command.hidden:
            continue
        parts += [f"## ckpt {name}\n", "```text", _help(command, name, root), "```\n"]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.is_file() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run .venv/bin/python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

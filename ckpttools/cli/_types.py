"""Click parameter types shared by the commands: every option is checked at parse time (usage error, exit 2).

Imports click and the standard library only, so `ckpt --help` stays cheap.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # click 8.5 made ParamType generic; the click >= 8.1 users have may not subscript it
    _IntParam = click.ParamType[int]
    _StrParam = click.ParamType[str]
else:
    _IntParam = _StrParam = click.ParamType

# Decimal units as huggingface_hub's shard planning reads them, binary units as people write them.
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`5GB` -> 5_000_000_000, `5GiB` -> 5 * 2**30, `1048576` -> bytes; ValueError for anything else or <= 0."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size")
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()]
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


class SizeType(_IntParam):
    """A positive byte size: `5GB`, `500MB`, `5GiB` or a number of bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and value > 0:
            return value
        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size; use forms such as 5GB, 500MB, 5GiB or a number of bytes", param, ctx)


# Every spelling a user may type -> the short name the library takes.
DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}  # fmt: skip


class DTypeType(_StrParam):
    """fp32, bf16 or fp16, also spelled float32, bfloat16, float16 (as torch and config.json write them)."""

    name = "[fp32|bf16|fp16]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        short = DTYPE_ALIASES.get(str(value).strip().lower())
        if short is None:
            self.fail(f"{value!r} is not a dtype; use fp32, bf16 or fp16 (or float32, bfloat16, float16)", param, ctx)
        return short


SIZE = SizeType()
DTYPE = DTypeType()

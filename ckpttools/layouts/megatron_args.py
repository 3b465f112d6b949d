"""The saving run's arguments as Megatron pickles them (Megatron-Core's `common_state` / `common.pt`,
Megatron-DeepSpeed's model-states files): an `argparse.Namespace` holding Megatron enums, torch dtypes and
`signal.Signals`. Read through the allowlisting unpickler with inert stand-ins for those classes (nothing is imported
from Megatron), then turned into plain values (`plain`) for the adapters and `inspect --json`.
"""

from __future__ import annotations

from typing import Any

from ckpttools.errors import short
from ckpttools.io.dtypes import DType
from ckpttools.io.torchfile import PickledObject


class _Enum(PickledObject):
    """A Megatron enum member or `signal.Signals` as pickled: its value only."""

    def __repr__(self) -> str:
        return f"{self.qualname}({', '.join(map(repr, self.args))})"


def inert(module: str, name: str) -> type:
    base = _Enum if name != "Namespace" else PickledObject
    return type(name, (base,), {"qualname": f"{module}.{name}"})


FIXED_GLOBALS = (("argparse", "Namespace"), ("signal", "Signals"))


class ArgsGlobals(dict[tuple[str, str], Any]):
    """The names the common state may pickle: argparse.Namespace, Megatron's own (enums, config records) and
    signal.Signals, each as an inert stand-in built here; nothing is imported from those modules."""

    def __init__(self) -> None:
        super().__init__({key: inert(*key) for key in FIXED_GLOBALS})  # never empty: readers test it for truth

    def __missing__(self, key: tuple[str, str]) -> Any:
        module, name = key
        if module.split(".")[0] == "megatron":
            self[key] = inert(module, name)
            return self[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        return key in FIXED_GLOBALS or str(key[0]).split(".")[0] == "megatron"


def args_of(common: Any) -> dict[str, Any] | None:
    if isinstance(common, list) and len(common) == 1:
        common = common[0]  # ShardedObject data is saved as [data]
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, PickledObject):
        return None
    return {k: plain(v) for k, v in vars(args).items() if k != "args"}


def plain(value: Any) -> Any:
    """An args value as JSON: dtypes by name, enum members as `Enum(value)`, records as dicts."""
    if isinstance(value, DType):
        return value.name
    if isinstance(value, _Enum):
        return repr(value)
    if isinstance(value, PickledObject):
        return {k: plain(v) for k, v in vars(value).items() if k != "args"}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return short(value, 80)

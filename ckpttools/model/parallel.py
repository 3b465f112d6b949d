"""The parallel layout a checkpoint was saved with: data, tensor, pipeline and expert parallel degrees.

Pure: readers fill it from what the files say; `inspect`, `consolidate` and `reshard` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of the run that saved a checkpoint, and layout-specific facts in `details`."""

    kind: str = "dp"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        """Processes of the run: DP x TP x PP (experts are spread over the DP ranks, not extra ones)."""
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        """`DP 2 x TP 2`, `DP 1 x PP 2`, `DP 4 x EP 2` or `DP 2`: the degrees that are not 1, DP always."""
        parts = [f"DP {self.dp}"]
        parts += [f"{name} {n}" for name, n in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if n != 1]
        return " x ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, **self.details}

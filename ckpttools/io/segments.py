"""Tensor bytes as runs of stored elements: what every writer streams from, whatever model describes them.

A `Segment` is `count` elements from element `start` of one stored tensor; a logical tensor is its segments in
order. Writers (safetensors, torch files) need only `ElementSource`: the neutral model's `TensorSource` is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ckpttools.io.dtypes import DType
from ckpttools.io.torchfile import LazyTensor


@dataclass(frozen=True)
class Segment:
    """`count` elements from element `start` of a stored tensor (read flat)."""

    tensor: LazyTensor
    start: int
    count: int


class ElementSource(Protocol):
    """A logical tensor as the stored segments that make it up, in row-major order."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> DType: ...

    @property
    def kind(self) -> str: ...  # "trainable" | "frozen" | "buffer" | "state"

    @property
    def segments(self) -> tuple[Segment, ...]: ...

    def numel(self) -> int: ...

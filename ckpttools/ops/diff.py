"""`ckpt diff A B`: two checkpoints (or weight folders, or files) compared tensor by tensor, streamed.

Each side is what `ckpt` reads (`reduce.open_side`): a training checkpoint gives the tensors `consolidate` writes
(its fp32 masters, or its 16-bit weights with `dtype`), a Hugging Face folder or weights file its tensors as
stored. Tensors are matched by name; both sides are streamed at once, one reader thread each, so each byte is read
once and two remote sources are fetched in parallel; memory stays a few chunks whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.errors import UsageError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import OutputTensor
from ckpttools.io.threads import Workers, resolve_workers
from ckpttools.io.torchfile import RecordReader
from ckpttools.ops import reduce
from ckpttools.ops.reduce import Comparison, Side

# A tensor's verdict, in the order the summary counts them.
IDENTICAL, EQUAL, CHANGED, DTYPE, SHAPE, ONLY_A, ONLY_B = (
    "identical", "equal", "changed", "dtype", "shape", "only_in_a", "only_in_b",
)  # fmt: skip
DIFFERENT = (CHANGED, DTYPE, SHAPE, ONLY_A, ONLY_B)


@dataclass
class TensorDiff:
    """One tensor name's verdict. For tensors compared (identical, equal, changed, dtype): the numbers of
    `reduce.Comparison`; `first` is the multi-dimensional index of the first differing element."""

    name: str
    layer: str
    status: str
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    numel: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    first: list[int] | None = None
    first_values: list[float] | None = None
    what: str = "weight"  # or the optimizer state key (exp_avg, ...) with --optimizer-states

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for key in ("max_abs_diff", "rel_l2"):  # JSON has no Infinity: "inf" says it
            if isinstance(d[key], float) and math.isinf(d[key]):
                d[key] = "inf"
        if d["first_values"] is not None:
            d["first_values"] = [v if math.isfinite(v) else str(v) for v in d["first_values"]]
        return d


@dataclass
class DiffResult:
    a: dict[str, Any]
    b: dict[str, Any]
    atol: float
    rtol: float
    tensors: list[TensorDiff]
    notes: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not any(t.status in DIFFERENT for t in self.tensors)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((IDENTICAL, EQUAL, CHANGED, DTYPE, SHAPE, ONLY_A, ONLY_B), 0)
        for t in self.tensors:
            out[t.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """`same`, both sides, the counts by verdict, and every tensor that is not bit-identical."""
        return {
            "same": self.same,
            "a": self.a,
            "b": self.b,
            "atol": self.atol,
            "rtol": self.rtol,
            "counts": self.counts(),
            "tensors": [t.to_dict() for t in self.tensors if t.status != IDENTICAL],
            "notes": self.notes,
        }


def diff(
    a: Path | str,
    b: Path | str,
    *,
    dtype: str | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    optimizer_states: bool = False,
) -> DiffResult:
    """Compare two checkpoints tensor by tensor.

    Args:
        a, b: training checkpoints (DeepSpeed, universal, DCP, ...), Hugging Face folders or weights files.
        dtype: which weights of a training checkpoint: "fp32" (the fp32 masters, what `consolidate` writes by
            default) or "bf16"/"fp16" (the 16-bit weights `consolidate --dtype` writes). Default: the dtype of the
            other side's weights when it is a weights folder or file, else fp32.
        atol, rtol: an element is equal when |a - b| <= atol + rtol * |a|; 0 and 0 ask for equal values.
        on_start, on_progress: the bytes both sides will stream, then after each compared run of elements.
        workers: threads comparing each chunk (default: this process's share of the cores, at most 8).
        optimizer_states: also compare every optimizer state of two training checkpoints (exp_avg, exp_avg_sq,
            momentum_buffer, ...), matched by parameter name and state key: a resharded checkpoint against its
            source, say.

    Example:
        >>> result = diff("out/checkpoint-500", "hf://my-org/my-model")
        >>> result.same, result.counts()["changed"]
        (True, 0)
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise UsageError("--atol and --rtol must be zero or more")
    asked = _dtype(dtype)
    reduce.preload()
    with ThreadPoolExecutor(2, thread_name_prefix="ckpt-diff-open") as pool:  # two remote sides' pickles at once
        side_a, side_b = pool.map(lambda path: reduce.open_side(path, dtype=asked), (a, b))
    notes: list[str] = []
    if asked is None:
        side_a, side_b = _match_dtypes(side_a, side_b)
    elif side_a.checkpoint is None and side_b.checkpoint is None:
        notes.append(f"--dtype {dtype} picks a training checkpoint's weights; both sides are weight files, "
                     "compared as stored")  # fmt: skip
    notes += [f"A: {n}" for n in side_a.notes] + [f"B: {n}" for n in side_b.notes]
    verdicts, pairs = _match(side_a, side_b, notes)
    if optimizer_states:
        more_verdicts, more_pairs = _match_states(side_a, side_b, notes)
        verdicts, pairs = verdicts + more_verdicts, pairs + more_pairs
    _compare(pairs, atol, rtol, on_start, on_progress, workers)
    return DiffResult(_describe(side_a), _describe(side_b), atol, rtol, verdicts, notes)


def _dtype(text: str | None) -> DType | None:
    if text is None or text == "auto":
        return None
    if text not in dtypes.SHORT:
        raise UsageError(f"--dtype must be one of {', '.join(dtypes.SHORT)}, not {text!r}")
    return dtypes.SHORT[text]


def _match_dtypes(a: Side, b: Side) -> tuple[Side, Side]:
    """A training checkpoint against weight files: its weights in the files' dtype (the 16-bit weights for a bf16
    model on the Hub), as `consolidate --dtype` would write them."""
    if (a.checkpoint is None) == (b.checkpoint is None):
        return a, b
    ckpt_side, weights = (a, b) if a.checkpoint is not None else (b, a)
    wanted = weights.floating_dtype()
    if wanted is None or wanted not in dtypes.SHORT.values() or wanted is ckpt_side.dtype:
        return a, b
    assert ckpt_side.checkpoint is not None
    replanned = reduce.checkpoint_side(ckpt_side.checkpoint, wanted)
    return (replanned, b) if a.checkpoint is not None else (a, replanned)


@dataclass
class _Pair:
    verdict: TensorDiff
    a: OutputTensor
    b: OutputTensor


def _match(a: Side, b: Side, notes: list[str]) -> tuple[list[TensorDiff], list[_Pair]]:
    """Every name's verdict in A's order, then B's names A lacks; the pairs left to stream."""
    a_by, b_by = a.by_name(), b.by_name()
    verdicts: list[TensorDiff] = []
    pairs: list[_Pair] = []
    tied: list[str] = []
    for t in a.tensors:
        other = b_by.get(t.name)
        v = TensorDiff(t.name, reduce.layer_of(t.name), "", list(t.shape), None, t.dtype.name)
        owner = b_by.get(b.aliases.get(t.name, ""))
        if other is None and owner is not None:  # B ties it and stores its owner: A's copy must equal that
            tied.append(f"{t.name} (compared with {owner.name} in B)")
            other = owner
        if other is None:
            if a.aliases.get(t.name) in b_by:
                tied.append(f"{t.name} (tied to {a.aliases[t.name]}, stored once in B)")
                continue
            v.status = ONLY_A
        else:
            v.shape_b, v.dtype_b = list(other.shape), other.dtype.name
            if other.shape != t.shape:
                v.status = SHAPE
            else:
                v.numel = t.source.numel()
                pairs.append(_Pair(v, t, other))
        verdicts.append(v)
    for t in b.tensors:
        if t.name in a_by:
            continue
        owner = a_by.get(a.aliases.get(t.name, ""))
        if owner is not None:  # A ties it and stores its owner: B's copy must equal that
            tied.append(f"{t.name} (compared with {owner.name} in A)")
            v = TensorDiff(t.name, reduce.layer_of(t.name), "", list(owner.shape), list(t.shape), owner.dtype.name,
                           t.dtype.name)  # fmt: skip
            if owner.shape != t.shape:
                v.status = SHAPE
            else:
                v.numel = t.source.numel()
                pairs.append(_Pair(v, owner, t))
            verdicts.append(v)
            continue
        if b.aliases.get(t.name) in a_by:
            tied.append(f"{t.name} (tied to {b.aliases[t.name]}, stored once in A)")
            continue
        verdicts.append(TensorDiff(t.name, reduce.layer_of(t.name), ONLY_B, None, list(t.shape), None, t.dtype.name))
    if tied:
        notes.append(f"tied weights stored once on one side: {', '.join(tied)}")
    return verdicts, pairs


def _match_states(a: Side, b: Side, notes: list[str]) -> tuple[list[TensorDiff], list[_Pair]]:
    """Every optimizer state of both training checkpoints, matched by (state key, parameter name)."""
    if a.checkpoint is None or b.checkpoint is None:
        raise UsageError("--optimizer-states compares two training checkpoints; "
                         f"{'A' if a.checkpoint is None else 'B'} is a weights folder or file")  # fmt: skip
    states_a = {(key, t.name): t for key, t in reduce.state_tensors(a.checkpoint)}
    states_b = {(key, t.name): t for key, t in reduce.state_tensors(b.checkpoint)}
    for label, side, states in (("A", a, states_a), ("B", b, states_b)):
        if not states and side.checkpoint is not None:
            keys = side.checkpoint.optimizer_state_keys
            notes.append(f"{label} has no optimizer state read as tensors" + (
                f" (its metadata names {', '.join(keys)}, not read for this layout yet)" if keys else ""))  # fmt: skip
    verdicts: list[TensorDiff] = []
    pairs: list[_Pair] = []
    for (key, name), t in states_a.items():
        other = states_b.get((key, name))
        v = TensorDiff(name, reduce.layer_of(name), ONLY_A, list(t.shape), None, t.dtype.name, what=key)
        if other is not None:
            v.shape_b, v.dtype_b = list(other.shape), other.dtype.name
            v.status = SHAPE if other.shape != t.shape else ""
            if not v.status:
                v.numel = t.source.numel()
                pairs.append(_Pair(v, t, other))
        verdicts.append(v)
    verdicts += [TensorDiff(name, reduce.layer_of(name), ONLY_B, None, list(t.shape), None, t.dtype.name, what=key)
                 for (key, name), t in states_b.items() if (key, name) not in states_a]  # fmt: skip
    return verdicts, pairs


def _compare(pairs: list[_Pair], atol: float, rtol: float, on_start: Callable[[int], None] | None,
             on_progress: Callable[[int], None] | None, workers: int | None) -> None:  # fmt: skip
    comparisons = [Comparison(atol, rtol) for _ in pairs]
    if on_start:
        on_start(sum(p.a.nbytes + p.b.nbytes for p in pairs))
    with RecordReader() as reader_a, RecordReader() as reader_b, Workers(resolve_workers(workers)) as pool:
        reduce.compare_streams([p.a for p in pairs], [p.b for p in pairs], reader_a, reader_b, comparisons,
                               on_progress=on_progress, workers=pool)  # fmt: skip
        reader_a.finish()  # every record touched passes its CRC-32, or the comparison is worth nothing
        reader_b.finish()
    for pair, c in zip(pairs, comparisons, strict=True):
        v = pair.verdict
        v.differing = c.differing
        if not c.identical:
            v.max_abs_diff, v.rel_l2 = c.max_abs_diff, c.rel_l2
        if c.first is not None:
            v.first, v.first_values = _unravel(c.first, pair.a.shape), list(c.first_values or ())
        if pair.a.dtype is not pair.b.dtype:
            v.status = DTYPE
        else:
            v.status = IDENTICAL if c.identical else EQUAL if not c.differing else CHANGED


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size if size else 0)
        flat //= size or 1
    return out[::-1]


def _describe(side: Side) -> dict[str, Any]:
    return {
        "path": side.path,
        "kind": side.kind,
        "description": side.description,
        "dtype": side.dtype.name if side.dtype is not None else None,  # the weights taken from a checkpoint
        "num_tensors": len(side.tensors),
    }

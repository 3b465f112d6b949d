"""`ckpt stats PATH`: per-tensor statistics of the weights and, in a training checkpoint, of every optimizer state.

One streamed pass (`reduce.stream`): NaN and ±Inf counts, min, max, mean, RMS and L2 norm per tensor (NaN-aware,
float64, see `reduce.Moments`), then per layer (`reduce.layer_of`) for each kind of tensor (`weight`, `exp_avg`,
`exp_avg_sq`, `momentum_buffer`, ...), so a layer blowing up before the loss went NaN stands out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.errors import UsageError
from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import OutputTensor
from ckpttools.io.threads import Workers, resolve_workers
from ckpttools.io.torchfile import RecordReader
from ckpttools.ops import reduce
from ckpttools.ops.reduce import Moments

WEIGHT = "weight"  # what a model tensor is called beside the optimizer's state keys


@dataclass
class TensorStats:
    name: str
    what: str  # "weight", or the optimizer's state key: exp_avg, exp_avg_sq, momentum_buffer, sum, ...
    layer: str
    shape: list[int]
    dtype: str
    moments: Moments

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "what": self.what, "layer": self.layer, "shape": self.shape, "dtype": self.dtype,
                **_finite(self.moments.to_dict())}  # fmt: skip


@dataclass
class StatsResult:
    path: str
    kind: str
    description: str
    dtype: str | None  # the weights taken from a training checkpoint (None: a weights folder, as stored)
    tensors: list[TensorStats]
    notes: list[str] = field(default_factory=list)

    def layers(self) -> list[dict[str, Any]]:
        """Per layer (in model order) and kind of tensor (weight first, then the optimizer's states): elements,
        NaN / ±Inf, L2 norm, RMS, largest |value|."""
        merged: dict[tuple[str, str], Moments] = {}
        tensors: dict[tuple[str, str], int] = {}
        for t in self.tensors:
            key = (t.layer, t.what)
            merged.setdefault(key, Moments()).merge(t.moments)
            tensors[key] = tensors.get(key, 0) + 1
        layer_order = {layer: i for i, layer in enumerate(dict.fromkeys(t.layer for t in self.tensors))}
        what_order = {what: i for i, what in enumerate(dict.fromkeys(t.what for t in self.tensors))}
        out = []
        for (layer, what), m in sorted(merged.items(), key=lambda kv: (layer_order[kv[0][0]], what_order[kv[0][1]])):
            d = m.to_dict()
            max_abs = max(abs(d["min"]), abs(d["max"])) if d["min"] is not None else None
            out.append({"layer": layer, "what": what, "tensors": tensors[(layer, what)], "count": d["count"],
                        "nan": d["nan"], "posinf": d["posinf"], "neginf": d["neginf"], "l2": d["l2"],
                        "rms": d["rms"], "max_abs": max_abs})  # fmt: skip
        return out

    def nonfinite(self) -> list[dict[str, Any]]:
        """The tensors holding NaN or Inf: name, what (weight or state key), layer and the counts."""
        return [{"name": t.name, "what": t.what, "layer": t.layer, **t.moments.nonfinite.to_dict()}
                for t in self.tensors if t.moments.nonfinite]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "description": self.description,
            "dtype": self.dtype,
            "nonfinite": self.nonfinite(),
            "layers": [_finite(d) for d in self.layers()],
            "tensors": [t.to_dict() for t in self.tensors],
            "notes": self.notes,
        }


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no Infinity or NaN: such a float is written as a string ("inf")."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def stats(
    path: Path | str,
    *,
    dtype: str | None = None,
    weights: bool = True,
    optimizer: bool = True,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> StatsResult:
    """Statistics of every tensor of a checkpoint, streamed (memory O(chunk), each byte read once).

    Args:
        path: a training checkpoint (DeepSpeed, universal, DCP, ...), a Hugging Face folder or a weights file.
        dtype: which weights of a training checkpoint: "fp32" (the masters, default) or "bf16"/"fp16".
        weights, optimizer: include the weights; include every optimizer state of a training checkpoint.
        on_start, on_progress: the bytes to read, then the bytes of each chunk reduced.
        workers: threads reducing each chunk (default: this process's share of the cores, at most 8).

    Example:
        >>> result = stats("out/checkpoint-500")
        >>> [(t["name"], t["what"]) for t in result.nonfinite()]
        [('model.layers.7.mlp.down_proj.weight', 'exp_avg_sq')]
    """
    if dtype is not None and dtype not in dtypes.SHORT:
        raise UsageError(f"--dtype must be one of {', '.join(dtypes.SHORT)}, not {dtype!r}")
    side = reduce.open_side(path, dtype=dtypes.SHORT[dtype] if dtype else None, tag=tag, step=step, best=best)
    notes: list[str] = list(side.notes)
    todo: list[tuple[str, OutputTensor]] = []
    if weights:
        todo += [(WEIGHT, t) for t in side.tensors if t.name not in side.aliases]  # a tie once, under its owner
    if optimizer and side.checkpoint is not None:
        states = reduce.state_tensors(side.checkpoint)
        todo += states
        if not states:
            notes.append(_no_states(side.checkpoint))
    elif dtype is not None and side.checkpoint is None:
        notes.append(f"--dtype {dtype} picks a training checkpoint's weights; this is a weights folder, read as stored")
    result = StatsResult(side.path, side.kind, side.description, side.dtype.name if side.dtype else None,
                         [TensorStats(t.name, what, reduce.layer_of(t.name), list(t.shape), t.dtype.name, Moments())
                          for what, t in todo], notes)  # fmt: skip
    tensors = [t for _, t in todo]
    if on_start:
        on_start(sum(t.nbytes for t in tensors))
    with RecordReader() as reader, Workers(resolve_workers(workers)) as pool:

        def each(i: int, start: int, raw: Any) -> None:
            result.tensors[i].moments.add(raw, tensors[i].dtype, pool)
            if on_progress:
                on_progress(raw.nbytes)

        reduce.reduce_tensors(tensors, reader, each, workers=pool)
        reader.finish()  # every record touched passes its CRC-32
    return result


def _no_states(ckpt: Any) -> str:
    """The note for a training checkpoint none of whose optimizer states were read as tensors: none saved, or
    saved where this layout does not read them yet (the metadata still names them)."""
    if not ckpt.optimizer.saved:
        return "no optimizer state in this checkpoint (a model-only save)"
    keys = ckpt.optimizer_state_keys
    if keys:
        return f"the optimizer states ({', '.join(keys)}) are not read as tensors for this layout yet; weights only"
    return "no optimizer state found in this checkpoint (none saved with it, or saved before the first step)"


# --------------------------------------------------------------------------------------------------
# The picture: a self-contained HTML page, inline SVG, no script
# --------------------------------------------------------------------------------------------------

_PANEL_W, _PANEL_H, _MARGIN = 960, 220, 60


def plot_html(result: StatsResult) -> str:
    """One panel per kind of tensor (weights, exp_avg, exp_avg_sq, momentum_buffer, ...): the L2 norm of each layer
    as a bar on a log scale, in model order; a layer holding NaN or Inf is drawn red and says so. Hovering a bar
    shows its numbers (SVG <title>); the page needs no script and no network."""
    import html

    layers = result.layers()
    kinds = list(dict.fromkeys(r["what"] for r in layers))
    panels = [_panel([r for r in layers if r["what"] == what], what) for what in kinds]
    bad = result.nonfinite()
    summary = (f"<p class=bad>Non-finite values in {len(bad)} tensors: "
               + html.escape(", ".join(f"{t['name']} [{t['what']}]" for t in bad[:20]))
               + (" ..." if len(bad) > 20 else "") + "</p>") if bad else "<p>No NaN or Inf.</p>"  # fmt: skip
    title = html.escape(f"ckpt stats {result.path}")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>body{{font:14px sans-serif;margin:24px}}.bad{{color:#c00}}"
        "svg{display:block;margin:8px 0 24px}text{font:11px sans-serif}</style></head><body>"
        f"<h1>{title}</h1><p>{html.escape(result.description)}"
        + (f", {html.escape(result.dtype)} weights" if result.dtype else "")
        + f"; {len(result.tensors)} tensors. L2 norm per layer, log scale.</p>{summary}"
        + "".join(panels)
        + "</body></html>\n"
    )


def _panel(rows: list[dict[str, Any]], what: str) -> str:
    import html

    norms = [r["l2"] for r in rows if r["l2"] and math.isfinite(r["l2"])]
    lo = math.floor(math.log10(min(norms))) if norms else 0
    hi = math.ceil(math.log10(max(norms))) if norms else 1
    hi = max(hi, lo + 1)
    w, h, m = _PANEL_W, _PANEL_H, _MARGIN
    step = (w - m - 10) / max(1, len(rows))
    parts = [f"<h2>{html.escape(what)}</h2><svg width='{w}' height='{h + 40}' xmlns='http://www.w3.org/2000/svg'>"]
    for e in range(lo, hi + 1):  # decades on the y axis
        y = h - (e - lo) / (hi - lo) * (h - 10)
        parts.append(f"<line x1='{m}' x2='{w - 10}' y1='{y:.1f}' y2='{y:.1f}' stroke='#ddd'/>"
                     f"<text x='{m - 6}' y='{y + 4:.1f}' text-anchor='end'>1e{e}</text>")  # fmt: skip
    for i, r in enumerate(rows):
        bad = r["nan"] + r["posinf"] + r["neginf"]
        norm = r["l2"] if r["l2"] and math.isfinite(r["l2"]) else None
        top = h - ((math.log10(norm) - lo) / (hi - lo) * (h - 10)) if norm else h - 2
        x = m + i * step
        tip = html.escape(f"{r['layer']} {what}: L2 {r['l2']:.4g}, RMS {_g(r['rms'])}, max |x| {_g(r['max_abs'])}, "
                          f"{r['count']:,} elements" + (f", {bad:,} NaN/Inf" if bad else ""))  # fmt: skip
        color = "#c00" if bad else "#4a7bd0"
        parts.append(f"<rect x='{x + step * 0.1:.1f}' y='{top:.1f}' width='{max(step * 0.8, 1):.1f}' "
                     f"height='{max(h - top, 2):.1f}' fill='{color}'><title>{tip}</title></rect>")  # fmt: skip
        if bad:
            parts.append(f"<text x='{x + step / 2:.1f}' y='{max(top - 4, 10):.1f}' text-anchor='middle' "
                         "fill='#c00'>NaN/Inf</text>")  # fmt: skip
    every = max(1, math.ceil(len(rows) / 24))  # at most ~24 layer labels
    for i in range(0, len(rows), every):
        x = m + (i + 0.5) * step
        parts.append(f"<text x='{x:.1f}' y='{h + 14}' text-anchor='middle'>{html.escape(_short(rows[i]['layer']))}"
                     "</text>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _short(layer: str) -> str:
    """`model.layers.12` -> `12`, other layers by their last part: labels that fit under a bar."""
    last = layer.rpartition(".")[2]
    return last if last.isdigit() else last[:12]

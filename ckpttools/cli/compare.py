"""`ckpt diff` and `ckpt stats`: look inside checkpoints and compare them, streamed (ckpttools.ops.reduce).

`diff` exits as `diff` does: 0 same, 1 different, 2 could not compare (a usage error, an unreadable or damaged
checkpoint: the failures other commands exit 1 for), 3 network, 4 authentication, 128 + N on a signal. So a
script can tell "the checkpoints differ" from "the comparison did not happen".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ckpttools.cli._common import (
    CHECKPOINT_PATH,
    DTYPE,
    EPILOG,
    INTERNAL_ERROR,
    checkpoint_selection,
    human_size,
    json_option,
    progress_callbacks,
    quiet_option,
    report,
    workers_option,
)
from ckpttools.errors import CkptError

TROUBLE = 2  # diff's exit code when it could not compare (GNU diff's)
ROWS = 40  # rows of the terminal table; --json lists every tensor

DIFF_EXIT_CODES = """\b
Exit codes: 0 the same (every tensor equal, within --atol/--rtol when given),
            1 different, 2 could not compare (usage error, unreadable or damaged checkpoint),
            3 remote or network failure, 4 authentication refused,
            130 SIGINT, 143 SIGTERM, 129 SIGHUP.
Set CKPT_DEBUG=1 to see tracebacks."""

DIFF_EPILOG = f"""\b
Examples:
  ckpt diff out/checkpoint-500 out/model
  ckpt diff out/checkpoint-500 hf://my-org/my-model --dtype bf16
  ckpt diff base/ merged/ --json
  ckpt diff a/ b/ --atol 1e-6 --rtol 1e-5

{DIFF_EXIT_CODES}"""


class CouldNotCompare(CkptError):
    """diff's "could not compare" (exit 2): a failure other commands exit 1 for."""

    exit_code = TROUBLE


def _could_not_compare(e: Exception) -> Exception:
    """The failure as `diff` reports it: exit 2 where other commands exit 1 (a damaged or unreadable checkpoint, a
    missing optional module, the system's error, a bug); usage (2), network (3) and authentication (4) as they are.
    Raised, the error boundary prints it as it prints every error (its line, the JSON error object, the code)."""
    if isinstance(e, CkptError):
        if e.exit_code != 1:
            return e
        trouble = CouldNotCompare(str(e))
        trouble.problems = e.problems
        return trouble
    if isinstance(e, ModuleNotFoundError):
        from ckpttools.extras import describe_missing

        line = describe_missing(e, "diff")
        if line is not None:
            return CouldNotCompare(line)
    if isinstance(e, OSError):  # disk, permissions: the user's environment, not a bug
        return CouldNotCompare(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
    message = " ".join(str(e).split())
    return CouldNotCompare(
        INTERNAL_ERROR.format(what=f"{type(e).__name__}: {message}" if message else type(e).__name__)
    )


@click.command("diff", epilog=DIFF_EPILOG)
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option(
    "--dtype",
    type=DTYPE,
    default=None,
    help="Which weights of a training checkpoint to compare: fp32 (its fp32 masters) or bf16/fp16 (its 16-bit "
    "weights, as consolidate --dtype writes them). Default: the dtype of the other side when that is a weights "
    "folder or file, else fp32.",
)
@click.option(
    "--atol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Absolute tolerance per element."
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Relative tolerance per element: equal when |a - b| <= atol + rtol * |a|.",
)
@click.option(
    "--optimizer-states",
    is_flag=True,
    help="Also compare every optimizer state (exp_avg, exp_avg_sq, momentum_buffer, ...) of two training "
    "checkpoints, by parameter name and state key: a resharded checkpoint against its source, say.",
)
@workers_option
@json_option
@quiet_option
def diff_cmd(a: str, b: str, dtype: str | None, atol: float, rtol: float, optimizer_states: bool,
             workers: int | None, as_json: bool, quiet: bool) -> None:  # fmt: skip
    """Compare two checkpoints tensor by tensor: identical, changed, only in A, only in B.

    A and B are anything ckpt reads: DeepSpeed or universal checkpoints, FSDP2 / torch DCP, Megatron-Core
    and torchtitan folders, Hugging Face folders or single weights files, local or remote (s3://, gs://,
    az://, hf://). Tensors are matched by
    the names consolidate writes and streamed side by side: each byte is read once, two remote sources
    in parallel, and memory stays a few chunks whatever the model size.

    A changed tensor shows its largest absolute difference, the relative L2 change ||B - A|| / ||A|| and how
    many elements differ, with the first one located. NaN equals NaN in the same place.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ckpttools.ops.diff import diff

    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    try:
        if "://" in a or "://" in b:
            import ckpttools.io.remote  # noqa: F401 - here, not on two threads at once (see reduce.preload)
        with ThreadPoolExecutor(2) as pool:  # mounted here, not at parse: two remote checkpoints at once
            path_a, path_b = pool.map(lambda ap: CHECKPOINT_PATH.convert(ap[1], params[ap[0]], ctx),
                                      (("a", a), ("b", b)))  # fmt: skip
        with progress_callbacks("diff", quiet) as progress:
            result = diff(path_a, path_b, dtype=dtype, atol=atol, rtol=rtol, workers=workers,
                          optimizer_states=optimizer_states, **progress)  # fmt: skip
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except Exception as e:
        if os.environ.get("CKPT_DEBUG"):
            raise
        raise _could_not_compare(e) from e
    report(result.to_dict(), as_json, quiet, _human_diff)
    if not result.same:
        raise click.exceptions.Exit(1)


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # what JSON cannot hold: "inf", "-inf", "nan"
        return x
    return f"{x:.3g}" if x else "0"


def _human_diff(d: dict[str, Any]) -> str:
    def side(label: str, s: dict[str, Any]) -> str:
        taken = f", {s['dtype']} weights" if s["dtype"] else ""
        return f"{label}: {s['path']} ({s['description']}{taken}; {s['num_tensors']} tensors)"

    lines = [side("A", d["a"]), side("B", d["b"])]
    rows = d["tensors"]
    if rows:
        lines.append("")
        lines += _table(rows[:ROWS])
        if len(rows) > ROWS:
            lines.append(f"... and {len(rows) - ROWS} more (--json lists every one)")
    c = d["counts"]
    tol = f" within atol {d['atol']:g}, rtol {d['rtol']:g}" if d["atol"] or d["rtol"] else ""
    equal = f", {c['equal']} equal{tol} but not bit-identical" if c["equal"] else ""
    verdict = "Same" if d["same"] else "Different"
    differ = [f"{c[k]} {label}" for k, label in _LABELS if c[k]]
    lines += ["", f"{verdict}: {c['identical']} identical{equal}" + (f"; {', '.join(differ)}" if differ else "")]
    return "\n".join(lines)


_LABELS = (("changed", "changed"), ("dtype", "of another dtype"), ("shape", "of another shape"),
           ("only_in_a", "only in A"), ("only_in_b", "only in B"))  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows grouped by layer, in model order: layer, tensor (its name inside the layer), status and numbers."""
    order: dict[str, int] = {}
    for r in rows:
        order.setdefault(r["layer"], len(order))
    rows = sorted(rows, key=lambda r: order[r["layer"]])
    table = [("layer", "tensor", "status", "max |B-A|", "rel L2", "differing")]
    for r in rows:
        inner = r["name"][len(r["layer"]) + 1 :] if r["name"].startswith(r["layer"] + ".") else r["name"]
        inner += f" [{r['what']}]" if r.get("what", "weight") != "weight" else ""
        table.append((r["layer"], inner, _status(r), _num(r["max_abs_diff"]), _num(r["rel_l2"]), _differing(r)))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
            for row in table]  # fmt: skip


def _status(r: dict[str, Any]) -> str:
    s = str(r["status"])
    if s == "shape":
        return f"shape {r['shape_a']} -> {r['shape_b']}"
    if s == "dtype":
        return f"dtype {r['dtype_a']} -> {r['dtype_b']}"
    return {"only_in_a": "only in A", "only_in_b": "only in B"}.get(s, s)


def _differing(r: dict[str, Any]) -> str:
    if not r["numel"]:
        return ""
    text = f"{r['differing']:,}/{r['numel']:,}"
    if r["first"] is not None and r["first_values"]:
        a, b = (_num(v) if isinstance(v, str) else f"{v:.6g}" for v in r["first_values"])
        text += f" (first at {r['first']}: {a} -> {b})"
    return text


@click.command("stats", epilog=EPILOG)
@click.argument("path", type=CHECKPOINT_PATH)
@click.option(
    "--dtype",
    type=DTYPE,
    default=None,
    help="Which weights of a training checkpoint: fp32 (its fp32 masters, default) or bf16/fp16 (its 16-bit weights).",
)
@click.option("--weights-only", is_flag=True, help="Leave out the optimizer states of a training checkpoint.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.html",
    help="Also write a self-contained HTML page (inline SVG, no script) of the weight and optimizer-state norms "
    "by layer, with the layers holding NaN or Inf marked.",
)
@click.option("--all", "show_all", is_flag=True, help="List every tensor on the terminal, not only the layers.")
@workers_option
@checkpoint_selection
@json_option
@quiet_option
def stats_cmd(path: Path, dtype: str | None, weights_only: bool, plot: Path | None, show_all: bool,
              workers: int | None, tag: str | None, step: int | None, best: bool, as_json: bool,
              quiet: bool) -> None:  # fmt: skip
    """Statistics of every tensor: weights and, in a training checkpoint, every optimizer state.

    Per tensor, streamed (each byte read once, memory a few chunks): how many NaN, +Inf and -Inf, and the
    min, max, mean, RMS and L2 norm of the finite elements (in float64); then per layer for the weights
    and each optimizer state (Adam's exp_avg and exp_avg_sq, Muon's momentum_buffer, ...), so a layer
    blowing up stands out. PATH is anything ckpt reads, local or remote. Exits 0 whatever the values are.
    """
    from ckpttools.ops.stats import plot_html, stats

    if plot is not None and plot.suffix.lower() not in (".html", ".htm"):
        raise click.UsageError(f"--plot {plot}: give a .html file (a self-contained page)")
    with progress_callbacks("stats", quiet) as progress:
        result = stats(path, dtype=dtype, optimizer=not weights_only, tag=tag, step=step, best=best, workers=workers,
                       **progress)  # fmt: skip
    if plot is not None:
        _write_page(plot, plot_html(result))
        result.notes.append(f"wrote {plot}")
    data = result.to_dict()
    report(data, as_json, quiet, lambda d: _human_stats(d, show_all))


def _write_page(path: Path, text: str) -> None:
    """The page, written beside its final name and renamed into place (never half a page)."""
    import os

    tmp = path.with_name(f".{path.name}.ckpt-tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _human_stats(d: dict[str, Any], show_all: bool) -> str:
    taken = f", {d['dtype']} weights" if d["dtype"] else ""
    lines = [f"{d['path']} ({d['description']}{taken})", ""]
    table = [("layer", "what", "tensors", "elements", "L2", "RMS", "max |x|", "NaN/Inf")]
    for r in d["layers"]:
        bad = r["nan"] + r["posinf"] + r["neginf"]
        table.append((r["layer"], r["what"], str(r["tensors"]), f"{r['count']:,}", _num(r["l2"]), _num(r["rms"]),
                      _num(r["max_abs"]), f"{bad:,}" if bad else ""))  # fmt: skip
    lines += _columns(table)
    if show_all:
        lines.append("")
        rows = [("tensor", "what", "min", "max", "mean", "RMS", "L2", "NaN", "+Inf", "-Inf")]
        rows += [(t["name"], t["what"], *(_num(t[k]) for k in ("min", "max", "mean", "rms", "l2")),
                  *(str(t[k]) if t[k] else "" for k in ("nan", "posinf", "neginf"))) for t in d["tensors"]]  # fmt: skip
        lines += _columns(rows)
    bad_tensors = d["nonfinite"]
    total = sum(t["count"] for t in d["tensors"])
    nbytes = sum(t["count"] * _itemsize(t["dtype"]) for t in d["tensors"])
    lines.append("")
    lines.append(f"{len(d['tensors'])} tensors, {total:,} elements ({human_size(nbytes)})")
    if bad_tensors:
        where = ", ".join(f"{t['name']} [{t['what']}] ({_bad(t)})" for t in bad_tensors[:8])
        more = f" and {len(bad_tensors) - 8} more" if len(bad_tensors) > 8 else ""
        lines.append(f"Non-finite values in {len(bad_tensors)} tensors: {where}{more}")
    else:
        lines.append("No NaN or Inf.")
    return "\n".join(lines)


def _bad(t: dict[str, Any]) -> str:
    return ", ".join(f"{t[k]:,} {label}" for k, label in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"))
                     if t[k])  # fmt: skip


def _itemsize(name: str) -> int:
    from ckpttools.io import dtypes

    return int(dtypes.BY_NAME[name].itemsize) if name in dtypes.BY_NAME else 0


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]

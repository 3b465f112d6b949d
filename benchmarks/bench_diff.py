"""Benchmark `ckpt diff` and `ckpt stats` against the disk floor and the peer way (load whole, compare in torch).

    python -m benchmarks.bench_diff [--params 2.7e9] [--work /tmp/ckpt-bench-diff] [--runs 2] [--out DIR]
    python -m benchmarks.bench_diff --a CKPT --b FOLDER   # real checkpoints (any two things ckpt reads)

What it does:

1. Unless --a/--b are given, writes two Hugging Face folders of --params fp32 parameters (shards of at most 5 GB and
   their index, tensors of 4096 x 4096 named like a Llama's layers, values windows of a 128 MiB random block): A, and
   B, a copy of A with one element changed (its tensor and index are recorded, and must be what diff reports).
2. --runs rounds, each tool once per round in a rotating order, as subprocesses; the page cache dropped before each
   when permitted (root: /proc/sys/vm/drop_caches), else every run warm (said in the results):
     floor        A's and B's bytes read once, two threads (one per folder), 16 MiB reads, nothing computed
     ckpt-diff    python -m ckpttools.cli diff A B --json -q
     peer-diff    safetensors.torch.load_file of every shard of A and B, torch.equal per tensor, the changed one's
                  max |B - A| (both models whole in memory, as zero_to_fp32 + a notebook would hold them)
     ckpt-stats   python -m ckpttools.cli stats A --json -q
     peer-stats   load_file of A, then per tensor in float64: NaN/Inf counts, min, max, mean, RMS, L2 of the finite
   wall time and the exact peak RSS of each (os.wait4).
3. The non-finite check inside the writer: the largest shard of A rewritten by `write_safetensors` with and without
   a NonFiniteCounter, alternating, --runs times each (in this process).
4. Writes OUT/diff.json and OUT/diff.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARD_BYTES = 5 * 10**9
ROWS = COLS = 4096
NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The synthetic folders
# --------------------------------------------------------------------------------------------------


def _names(params: float) -> list[str]:
    count = max(1, round(params / (ROWS * COLS)))
    return [f"model.layers.{i // len(NAMES)}.{NAMES[i % len(NAMES)]}.weight" for i in range(count)]


def _write_shard(path: Path, names: list[str], block: Any, first: int) -> None:
    nbytes = ROWS * COLS * 4
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i, name in enumerate(names):
        header[name] = {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for i in range(len(names)):
            start = ((first + i) * 7919 * 4096) % (len(block) - ROWS * COLS)  # a different window per tensor
            fh.write(block[start : start + ROWS * COLS].tobytes())


def build(work: Path, params: float) -> dict[str, Any]:
    import numpy as np

    a, b = work / "A", work / "B"
    meta = work / "built.json"
    if meta.is_file() and json.loads(meta.read_text()).get("params") == params:
        return json.loads(meta.read_text())
    shutil.rmtree(work, ignore_errors=True)
    a.mkdir(parents=True)
    names = _names(params)
    per = max(1, SHARD_BYTES // (ROWS * COLS * 4))
    shards = [names[i : i + per] for i in range(0, len(names), per)]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    block = np.random.default_rng(0).standard_normal(2 * ROWS * COLS, dtype=np.float32)
    t = time.perf_counter()
    for i, (fname, group) in enumerate(zip(files, shards, strict=True)):
        _write_shard(a / fname, group, block, i * per)
    weight_map = {n: f for f, g in zip(files, shards, strict=True) for n in g}
    index: dict[str, Any] = {"metadata": {"total_size": len(names) * ROWS * COLS * 4}, "weight_map": weight_map}
    (a / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copytree(a, b)
    # one element changed in B: the middle tensor, row 1234, column 567
    changed = names[len(names) // 2]
    fname = weight_map[changed]
    with open(b / fname, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        entry = json.loads(fh.read(n))[changed]
        where = 8 + n + entry["data_offsets"][0] + (1234 * COLS + 567) * 4
        fh.seek(where)
        (value,) = struct.unpack("<f", fh.read(4))
        fh.seek(where)
        fh.write(struct.pack("<f", value + 1.0))
    built = {"params": params, "tensors": len(names), "bytes": len(names) * ROWS * COLS * 4, "shards": len(files),
             "changed": changed, "index": [1234, 567], "build_s": round(time.perf_counter() - t, 1)}  # fmt: skip
    meta.write_text(json.dumps(built))
    return built


# --------------------------------------------------------------------------------------------------
# The runs (each a subprocess: `python -m benchmarks.bench_diff --tool NAME A B`)
# --------------------------------------------------------------------------------------------------


def tool_floor(a: Path, b: Path) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    def read(folder: Path) -> int:
        buf, total = bytearray(16 << 20), 0
        for f in sorted(folder.iterdir()):
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while n := fh.readinto(buf):
                        total += n
        return total

    with ThreadPoolExecutor(2) as pool:
        return {"bytes": sum(pool.map(read, [a, b]))}


def _load(path: Path) -> dict[str, Any]:
    """Everything in memory, the peer way: safetensors files with load_file, a DeepSpeed checkpoint with
    zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint, a torch DCP folder with dcp_to_torch_save."""
    from safetensors.torch import load_file

    if path.is_file():
        return dict(load_file(path))
    if (path / "latest").is_file() or any(path.glob("global_step*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path)))
    if (path / ".metadata").is_file():
        import tempfile

        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path), f"{tmp}/full.pt")
            return dict(torch.load(f"{tmp}/full.pt", weights_only=False))
    out: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def tool_peer_diff(a: Path, b: Path) -> dict[str, Any]:
    import torch

    ta, tb = _load(a), _load(b)
    changed: dict[str, float | str] = {}
    for name, x in ta.items():
        y = tb.get(name)
        if y is None or not isinstance(x, torch.Tensor):
            continue
        if x.shape != y.shape:
            changed[name] = f"shape {list(x.shape)} vs {list(y.shape)}"
        elif x.dtype != y.dtype or not torch.equal(x, y):
            changed[name] = float((x.double() - y.double()).abs().max())
    return {"changed": changed}


def tool_peer_stats(a: Path, b: Path) -> dict[str, Any]:
    import torch

    out = {}
    for name, t in _load(a).items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        x = t.double().flatten()
        f = x[torch.isfinite(x)]
        if not f.numel():
            continue
        out[name] = {"nan": int(x.isnan().sum()), "posinf": int(x.isposinf().sum()), "neginf": int(x.isneginf().sum()),
                     "min": float(f.min()), "max": float(f.max()), "mean": float(f.mean()),
                     "rms": float(f.square().mean().sqrt()), "l2": float(f.norm())}  # fmt: skip
    return {"tensors": len(out), "first": next(iter(out.values()))}


TOOLS = {"floor": tool_floor, "peer-diff": tool_peer_diff, "peer-stats": tool_peer_stats}


def _command(tool: str, a: Path, b: Path) -> list[str]:
    if tool == "ckpt-diff":
        return [sys.executable, "-m", "ckpttools.cli", "diff", str(a), str(b), "--json", "-q"]
    if tool == "ckpt-stats":
        return [sys.executable, "-m", "ckpttools.cli", "stats", str(a), "--json", "-q"]
    return [sys.executable, "-m", "benchmarks.bench_diff", "--tool", tool, "--a", str(a), "--b", str(b)]


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_tool(tool: str, a: Path, b: Path, cold: bool) -> dict[str, Any]:
    dropped = drop_caches() if cold else False
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(_command(tool, a, b), stdout=out, stderr=err, cwd=REPO, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # the exact peak RSS of this child
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    return {"tool": tool, "wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024),
            "rc": proc.returncode, "cold": dropped, "stdout": stdout[-4000:], "stderr": stderr[-2000:]}  # fmt: skip


def writer_cost(a: Path, runs: int, scratch: Path) -> dict[str, Any]:
    """The largest shard of A rewritten with and without the non-finite count, alternating."""
    from ckpttools.io.torchfile import RecordReader
    from ckpttools.io.values import NonFiniteCounter
    from ckpttools.ops.reduce import open_side

    shard = max(a.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    tensors = open_side(shard).tensors
    times: dict[str, list[float]] = {"plain": [], "nonfinite": []}
    out = scratch / "writer-out.safetensors"
    from ckpttools.io.safetensors_writer import write_safetensors

    for i in range(runs * 2):
        kind = ("plain", "nonfinite")[(i + i // 2) % 2]
        counter = NonFiniteCounter() if kind == "nonfinite" else None
        t = time.perf_counter()
        with RecordReader() as reader:
            write_safetensors(out, tensors, reader, nonfinite=counter)
        times[kind].append(round(time.perf_counter() - t, 2))
        out.unlink()
    return {"shard_bytes": shard.stat().st_size, **times}


# --------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=2.7e9)
    p.add_argument("--work", type=Path, default=Path("/tmp/ckpt-bench-diff"))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--a", type=Path)
    p.add_argument("--b", type=Path)
    p.add_argument("--tool", choices=sorted(TOOLS))
    p.add_argument("--tools", default="floor,ckpt-diff,peer-diff,ckpt-stats,peer-stats")
    p.add_argument("--no-writer", action="store_true")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tool:
        print(json.dumps(TOOLS[args.tool](args.a, args.b)))
        return
    if args.build_only:
        print(json.dumps(build(args.work, args.params)))
        return
    built = None
    if args.a is None:  # built in a child: this process stays small, so a forked child's peak RSS is its own
        cmd = [sys.executable, "-m", "benchmarks.bench_diff", "--build-only", "--params", str(args.params),
               "--work", str(args.work)]  # fmt: skip
        built = json.loads(subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, text=True).stdout)
        args.a, args.b = args.work / "A", args.work / "B"
        print(f"built {built}", flush=True)
    tools = args.tools.split(",")
    results = []
    for r in range(args.runs):
        for tool in tools[r % len(tools) :] + tools[: r % len(tools)]:
            res = run_tool(tool, args.a, args.b, cold=True)
            results.append({"round": r, **res})
            print(f"round {r} {tool}: {res['wall_s']} s, {res['peak_rss_mb']} MB, rc {res['rc']}, cold {res['cold']}",
                  flush=True)  # fmt: skip
            _save(args, built, results, None)  # what is done so far survives a run cut short
    writer = None if args.no_writer or built is None else writer_cost(args.a, args.runs, args.work)
    if writer:
        print(f"writer {writer}", flush=True)
    print(_save(args, built, results, writer))


def _save(args: argparse.Namespace, built: Any, results: list[Any], writer: Any) -> str:
    report = {"host": platform.node(), "cpus": os.cpu_count(), "built": built, "runs": results, "writer": writer,
              "a": str(args.a), "b": str(args.b)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diff.json").write_text(json.dumps(report, indent=1))
    text = _markdown(report)
    (args.out / "diff.md").write_text(text)
    return text


def _markdown(report: dict[str, Any]) -> str:
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in report["runs"]:
        rows.setdefault(r["tool"], []).append(r)
    built = report["built"] or {}
    gb = built.get("bytes", 0) / 1e9
    lines = [f"# ckpt diff / stats benchmark ({report['host']}, {report['cpus']} CPUs)", "",
             (f"A and B: {built.get('tensors')} fp32 tensors, {gb:.1f} GB each, {built.get('shards')} shards; "
              f"B has one element changed in {built.get('changed')} at {built.get('index')}."), "",
             "| tool | wall s (each run) | best GB/s of A+B (diff, floor) or A (stats) | peak RSS MB | rc | cold |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for tool, runs in rows.items():
        best = min(r["wall_s"] for r in runs)
        size = gb * (2 if tool in ("floor", "ckpt-diff", "peer-diff") else 1)
        lines.append(f"| {tool} | {', '.join(str(r['wall_s']) for r in runs)} | {size / best:.2f} | "
                     f"{max(r['peak_rss_mb'] for r in runs)} | {runs[0]['rc']} | {runs[0]['cold']} |")  # fmt: skip
    w = report.get("writer")
    if w:
        lines += ["", (f"write_safetensors of a {w['shard_bytes'] / 1e9:.1f} GB shard: plain {w['plain']} s, with "
                       f"the non-finite count {w['nonfinite']} s")]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

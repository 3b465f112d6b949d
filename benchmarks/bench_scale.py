"""Plan time and memory of `ckpt inspect`, consolidate, reshard and --universal at 70B / 405B shapes, DP 512-1024.

The checkpoints are `fixtures/build/synth_checkpoint.py`'s: real DeepSpeed metadata, tensor records that are holes. Nothing
is written but the checkpoints: each phase is measured in a fresh process (peak RSS is a process's own), that
reads the checkpoint (`open_checkpoint`) and then builds one plan:

- inspect:     the CLI itself, `ckpt inspect ROOT --json`, under /usr/bin/time -v
- read:        `open_checkpoint` alone; counts the segments of the model
- check:       `check_module_copies` (ZeRO-1/2: reads both ends of every rank's piece of every param)
- consolidate: `plan_tensors` + `plan_shards` (5GB safetensors shards), and each shard's safetensors header
- reshard:     `layouts.zero.write.rank_files(ckpt, dp/2, stage)` and torchwriter's `_plan_file` for every file
               (data.pkl and the read/fill ops: everything `write_torch_files` holds before writing)
- universal:   `universal_files(ckpt)` and `_plan_file` for every file

    python -m benchmarks.bench_scale --root /tmp/ckpt-scale --cases llama-70b:3:512 llama-70b:3:1024 \
        --json benchmarks/results/scale-plans.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: benchmarks/bench_scale.py
MODULE = "benchmarks.bench_scale"  # this file, as its phase children run it (`python -m`)

PHASES = ("read", "check", "consolidate", "reshard", "universal")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _segments(ckpt: Any) -> int:
    n = sum(len(p.fp32.segments) + sum(len(s.segments) for s in p.states.values()) for p in ckpt.params)
    return n + sum(len(s.segments) for s in ckpt.bit16.values())


def _pieces(files: dict[str, Any]) -> int:
    """Slices and fills of every new tensor in the planned files."""
    from ckpttools.io.torchwriter import NewTensor

    count, stack, seen = 0, list(files.values()), set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, NewTensor):
            count += len(v.pieces)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return count


def _writer_plans(files: dict[str, Any]) -> tuple[int, int, int]:
    """What write_torch_files plans up front for these files: (data.pkl bytes, read/fill ops, tensor bytes)."""
    from ckpttools.io.torchwriter import CHUNK_BYTES, _op_out_bytes, _plan_file

    plans = [_plan_file(Path("/nonexistent") / name, obj, CHUNK_BYTES) for name, obj in files.items()]
    ops = [op for p in plans for _, _, storage_ops in p.storages for op in storage_ops]
    return sum(len(p.data_pkl) for p in plans), len(ops), sum(_op_out_bytes(op) for op in ops)


def run_phase(root: Path, phase: str) -> dict[str, Any]:
    """One phase in this process: the read, then the phase's plan; times in s, memory in bytes."""
    from ckpttools.layouts.registry import open_checkpoint

    base = _rss()
    t0 = time.perf_counter()
    ckpt = open_checkpoint(root)
    out: dict[str, Any] = {"phase": phase, "read_s": time.perf_counter() - t0, "base_rss": base}
    gc.collect()
    out["rss_after_read"], out["peak_after_read"] = _rss(), _peak()
    t0 = time.perf_counter()
    if phase == "read":
        out["segments"] = _segments(ckpt)
        out["tensors"] = len(ckpt.params)
        out["parameters"] = sum(p.numel for p in ckpt.params)
        out["dp"], out["stage"] = ckpt.dp_world_size, ckpt.zero_stage
    elif phase == "check":
        from ckpttools.layouts.crosscheck import _chunks, check_module_copies

        chunks = _chunks(ckpt, False)
        out["windows"] = len(chunks)
        out["bytes_read"] = sum(c.count * (c.master.dtype.itemsize + c.copy.dtype.itemsize) for c in chunks)
        check_module_copies(ckpt)
    elif phase == "consolidate":
        from ckpttools.io import dtypes
        from ckpttools.io.safetensors_writer import OutputTensor  # noqa: F401 - the plan's tensors
        from ckpttools.ops import hf
        from ckpttools.ops.consolidate import plan_shards, plan_tensors

        config = hf.load_config(root / "config.json")
        for name, dtype in (("fp32", dtypes.FLOAT32), ("bf16", dtypes.BFLOAT16)):
            tensors, _ = plan_tensors(ckpt, dtype, hf_folder=True, config=config)
            shards = plan_shards(tensors, "safetensors", "5GB")
            out[f"{name}_shards"] = len(shards)
            out[f"{name}_bytes"] = sum(t.nbytes for t in tensors)
    elif phase == "reshard":
        from ckpttools.layouts.zero.write import rank_files

        target = max(1, ckpt.dp_world_size // 2)
        files = rank_files(ckpt, target, ckpt.zero_stage)
        out["plan_s"] = time.perf_counter() - t0
        out["target_dp"], out["files"], out["pieces"] = target, len(files), _pieces(files)
        out["pickle_bytes"], out["ops"], out["tensor_bytes"] = _writer_plans(files)
    elif phase == "universal":
        from ckpttools.layouts.universal import universal_files

        files = universal_files(ckpt)
        out["plan_s"] = time.perf_counter() - t0
        out["files"], out["pieces"] = len(files), _pieces(files)
        out["pickle_bytes"], out["ops"], out["tensor_bytes"] = _writer_plans(files)
    out["phase_s"] = time.perf_counter() - t0
    out["rss_end"], out["peak"] = _rss(), _peak()
    return out


def _ckpt_cli() -> list[str]:
    script = Path(sys.executable).parent / "ckpt"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ckpttools.cli"]


def _start(phase: str, root: Path) -> subprocess.Popen[str]:
    """`ckpt inspect ROOT --json` under GNU time (wall seconds, peak RSS of the whole CLI), or one phase child."""
    if phase == "inspect":
        cmd = ["/usr/bin/time", "-f", "%e %M", *_ckpt_cli(), "inspect", str(root), "--json"]
    else:
        cmd = [sys.executable, "-m", MODULE, "--child", str(root), phase]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(phase: str, proc: subprocess.Popen[str], t0: float) -> dict[str, Any]:
    stdout, stderr = proc.communicate()
    if proc.returncode:
        return {"phase": phase, "error": stderr.strip().splitlines()[-3:]}
    if phase == "inspect":
        wall, kb = stderr.strip().splitlines()[-1].split()
        data = json.loads(stdout)
        return {"phase": phase, "wall_s": float(wall), "peak": int(kb) * 1024, "num_parameters": data["num_parameters"]}
    out: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def _synthesize(root: Path, model: str, stage: str, dp: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fixtures.build.synth_checkpoint", "--model", model, "--stage", stage, "--dp", dp,
           "--out", str(root)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def bench_case(case: str, root_dir: Path, phases: list[str], keep: bool, parallel: bool) -> dict[str, Any]:
    """Synthesize the checkpoint (unless present), then measure each phase in its own process."""
    model, stage, dp = case.split(":")
    root = root_dir / f"{model}-z{stage}-dp{dp}"
    result: dict[str, Any] = {"case": case, "model": model, "stage": int(stage), "dp": int(dp), "root": str(root)}
    if not (root / "latest").is_file():
        shutil.rmtree(root, ignore_errors=True)
        result["synth"] = _synthesize(root, model, stage, dp)
        print(json.dumps({"case": case, "synth": result["synth"]}), flush=True)
    result["phases"] = {}
    batches = [phases] if parallel else [[p] for p in phases]
    for batch in batches:
        t0 = time.perf_counter()
        procs = {phase: _start(phase, root) for phase in batch}
        for phase, proc in procs.items():
            result["phases"][phase] = _finish(phase, proc, t0)
            print(json.dumps({"case": case, **result["phases"][phase]}), flush=True)
    if not keep:
        shutil.rmtree(root)
    return result


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def table(results: list[dict[str, Any]]) -> str:
    """The markdown tables of scale-plans.md from the JSON results."""
    rows = sorted(results, key=lambda r: (r["stage"], r["model"] != "llama-70b", r["dp"]))
    lines = [
        (
            "| model | ZeRO | DP | files | logical | on disk | tensors | segments | read s | RSS after read MB | "
            "per rank x tensor | inspect s | inspect peak MB |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ph, syn = r["phases"], r.get("synth", {})
        rd, ins = ph["read"], ph["inspect"]
        net = rd["rss_after_read"] - rd["base_rss"]
        lines.append(
            f"| {r['model']} | {r['stage']} | {r['dp']} | {syn.get('files', '')} | "
            f"{syn.get('logical_bytes', 0) / 1e12:.2f} TB | {_mb(syn.get('allocated_bytes', 0))} MB | "
            f"{rd['tensors']} | {rd['segments']:,} | {rd['read_s']:.1f} | {_mb(rd['rss_after_read'])} | "
            f"{net / (r['dp'] * rd['tensors']):,.0f} B | {ins['wall_s']:.1f} | {_mb(ins['peak'])} |"
        )
    lines += [
        "",
        (
            "| model | ZeRO | DP | check: windows / MB read / s | consolidate plan s (fp32 shards) | "
            "reshard -> DP/2: trees s + writer plan s, pieces, peak MB | universal: trees s + writer plan s, "
            "files, peak MB |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ph = r["phases"]
        ck, co, rs, un = ph["check"], ph["consolidate"], ph["reshard"], ph["universal"]
        lines.append(
            f"| {r['model']} | {r['stage']} | {r['dp']} | {ck['windows']:,} / {_mb(ck['bytes_read'])} / "
            f"{ck['phase_s']:.2f} | {co['phase_s']:.2f} ({co['fp32_shards']}) | "
            f"{rs['plan_s']:.1f} + {rs['phase_s'] - rs['plan_s']:.1f}, {rs['pieces']:,}, {_mb(rs['peak'])} | "
            f"{un['plan_s']:.1f} + {un['phase_s'] - un['plan_s']:.1f}, {un['files']:,}, {_mb(un['peak'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("ROOT", "PHASE"), help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpt-scale"))
    ap.add_argument("--cases", nargs="+", default=[], help="model:stage:dp, e.g. llama-70b:3:1024")
    ap.add_argument("--phases", nargs="+", default=["inspect", *PHASES], choices=["inspect", *PHASES])
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    ap.add_argument("--json", type=Path, help="append the results to this JSON list")
    ap.add_argument("--jobs", type=int, default=1, help="cases measured at the same time")
    ap.add_argument("--parallel", action="store_true", help="run a case's phases at the same time (many cores)")
    ap.add_argument("--table", nargs="+", type=Path, help="print the markdown tables of these JSON results")
    args = ap.parse_args()
    if args.table:
        print(table([r for path in args.table for r in json.loads(path.read_text())]), end="")
        return
    if args.child:
        print(json.dumps(run_phase(Path(args.child[0]), args.child[1])))
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(bench_case, c, args.root, args.phases, args.keep, args.parallel) for c in args.cases]
        for future in futures:
            result = future.result()
            if args.json:
                old = json.loads(args.json.read_text()) if args.json.is_file() else []
                args.json.write_text(json.dumps([*old, result], indent=1) + "\n")


if __name__ == "__main__":
    main()

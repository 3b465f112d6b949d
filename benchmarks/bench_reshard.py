"""Benchmark `ckpt reshard` against DeepSpeed's `ds_to_universal` on the benchmark checkpoints.

    ./scripts/setup && .venv/bin/python -m benchmarks.bench_reshard [--sizes 355M] [--stages 2,3] [--runs 3]

Uses the GPT-2 checkpoints `benchmarks/bench_consolidate.py` builds and caches (DP 4, bf16; built on
demand). For each, `--runs` rounds with every tool once per round, the order rotating from round to
round; before every run, as in bench_consolidate: the previous output deleted, `sync`, a few seconds to
settle, the page cache dropped (where permitted) and the Python packages both tools import read back
in, so each run sees a cold checkpoint and a warm software install:

    ckpt --dp 2         ckpt reshard CKPT --dp 2 --out TMP            (native files for 2 ranks)
    ckpt --universal    ckpt reshard CKPT --universal --out TMP       (DeepSpeed's universal layout)
    ds_to_universal     python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG
                            --output_folder TMP/TAG --inject_missing_state   (its defaults: 4 extract
                            workers, 2 merge workers)

Reports median wall time, peak RSS of the process tree, bytes written, the number of files each tool
created (ds_to_universal's temporary fragment folder included, sampled while it runs), and the ratios
against ds_to_universal; checks that both universal outputs hold identical tensors. Then (unless
--no-load) it times what resuming at DP 2 costs on top: DeepSpeed's `engine.load_checkpoint` at 2 ranks
(torchrun, gloo, the build's config) of each output, plainly for the native one, with
`"load_universal": true` for the universal ones, cache dropped before each. Writes OUT/reshard.json
and OUT/reshard.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_consolidate as bc  # shared build and measurement helpers
from fixtures.build import ds_launch

MODULE = "benchmarks.bench_reshard"  # this file, as its torchrun workers run it (`python -m`)


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))  # folders removed meanwhile are skipped


def measured(cmd: list[str], out: Path, log: Path) -> dict[str, Any]:
    """run_measured plus the largest number of files under `out` seen while the command ran."""
    peak = {"files": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak["files"] = max(peak["files"], count_files(out))
            done.wait(0.25)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    with open(log, "a") as fh:
        result = bc.run_measured(cmd, bc.tool_env(), fh)
    done.set()
    th.join()
    result["peak_files"] = max(peak["files"], count_files(out))
    result["final_files"] = count_files(out)
    result["out_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    return result


def tools(ckpt: Path, tag: str, work: Path) -> dict[str, tuple[list[str], Path]]:
    ckpt_bin = str(bc.ckpt_bin())
    return {
        "ckpt --dp 2": ([ckpt_bin, "reshard", str(ckpt), "--dp", "2", "--out", str(work / "dp2"), "--overwrite", "-q"],
                        work / "dp2"),
        "ckpt --universal": ([ckpt_bin, "reshard", str(ckpt), "--universal", "--out", str(work / "ucp"), "--overwrite",
                              "-q"], work / "ucp"),
        "ds_to_universal": ([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                             str(ckpt / tag), "--output_folder", str(work / "dsu" / tag), "--inject_missing_state"],
                            work / "dsu"),
    }  # fmt: skip


def same_universal(ours: Path, theirs: Path, tag: str) -> dict[str, Any]:
    import torch

    bad, n = [], 0
    for pdir in sorted((ours / tag / "zero").iterdir()):
        if not pdir.is_dir():
            continue
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            a = torch.load(pdir / f"{state}.pt", weights_only=False)["param"]
            b = torch.load(theirs / tag / "zero" / pdir.name / f"{state}.pt", weights_only=False)
            b = b["param"] if isinstance(b, dict) else b
            n += 1
            if not torch.equal(a.flatten(), b.flatten()):
                bad.append(f"{pdir.name}/{state}")
    return {"compared": n, "differing": bad}


NEW_DP = 2


def load_worker(size: str, stage: int, ckpt: Path, tag: str, universal: bool) -> int:
    """Under torchrun: build the benchmark engine at NEW_DP ranks and time its load_checkpoint."""
    bc.quiet_worker()
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = bc.ds_config(stage)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _ = bc.build_engine(size, stage, cfg)
    dist.barrier()
    t0 = time.perf_counter()
    path, _ = engine.load_checkpoint(str(ckpt), tag=tag)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if path is None:
        raise SystemExit(f"load_checkpoint found no checkpoint in {ckpt}")
    if dist.get_rank() == 0:
        print("LOAD_RESULT " + json.dumps({"load_s": seconds, "steps": engine.global_steps}), flush=True)
    dist.destroy_process_group()
    return 0


def measure_load(size: str, stage: int, ckpt: Path, tag: str, universal: bool, log: Path) -> dict[str, Any]:
    """DeepSpeed's load_checkpoint time at NEW_DP ranks (page cache dropped first), and the launch's peak RSS."""
    cmd = ds_launch.torchrun_cmd(NEW_DP, MODULE, ["_load", "--size", size, "--stage", stage, "--ckpt", ckpt,
                                                  "--tag", tag])  # fmt: skip
    if universal:
        cmd.append("--universal")
    ds_launch.prebuild_ops(bc.build_env())  # once, before any timing
    bc.drop_caches()
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        r = bc.run_measured(cmd, bc.build_env(), fh)
    found = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("LOAD_RESULT ")]
    if r["returncode"] != 0 or not found:
        return {"error": f"load failed (rc {r['returncode']}); see {log}"}
    return {**json.loads(found[-1].split(" ", 1)[1]), "peak_rss_tree": r["peak_rss_tree"]}


def bench(size: str, stage: int, ckpt: Path, runs: int, work: Path, log: Path, load: bool) -> dict[str, Any]:
    name = f"{size} ZeRO-{stage}"
    tag = (ckpt / "latest").read_text().strip()
    entry: dict[str, Any] = {"checkpoint": name, "runs": {}, "loads": {}}
    commands = tools(ckpt, tag, work)
    names = list(commands)
    for rnd in range(runs):
        for tool in names[rnd % len(names) :] + names[: rnd % len(names)]:  # the order rotates round by round
            cmd, out = commands[tool]
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            time.sleep(bc.SETTLE_S)  # write-back and discards of the deleted output settle first
            dropped, _why = bc.drop_caches()
            warm_s = bc.prewarm_software() if dropped else None  # a cold checkpoint, a warm software install
            r = measured(cmd, out, log)
            r.update(cache_dropped=dropped, prewarm_s=warm_s)
            entry["runs"].setdefault(tool, []).append(r)
            print(
                f"  {name} {tool}: {r['wall_s']:.2f} s, rc {r['returncode']}, peak files {r['peak_files']}", flush=True
            )
    entry["identical"] = same_universal(work / "ucp", work / "dsu", tag)
    if load:
        for tool, folder, universal in (("ckpt --dp 2", work / "dp2", False), ("ckpt --universal", work / "ucp", True),
                                        ("ds_to_universal", work / "dsu", True)):  # fmt: skip
            entry["loads"][tool] = r = measure_load(size, stage, folder, tag, universal, log)
            print(f"  {name} load after {tool}: {r.get('load_s', r.get('error'))}", flush=True)
    return entry


def summary_md(results: list[dict[str, Any]]) -> str:
    lines = [("| checkpoint | tool | median time s | peak RSS MB | written MB | files created (peak) | time ratio vs "
              "ds_to_universal | memory ratio |"), "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for entry in results:
        med = {t: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "peak_rss_tree", "write_bytes", "peak_files")}
               for t, rs in entry["runs"].items()}  # fmt: skip
        ref = med["ds_to_universal"]
        for tool, m in med.items():
            lines.append(f"| {entry['checkpoint']} | {tool} | {m['wall_s']:.2f} | {m['peak_rss_tree'] / 1e6:,.0f} | "
                         f"{m['write_bytes'] / 1e6:,.0f} | {m['peak_files']:,.0f} | {m['wall_s'] / ref['wall_s']:.2f} | "
                         f"{m['peak_rss_tree'] / ref['peak_rss_tree']:.2f} |")  # fmt: skip
        ident = entry["identical"]
        lines.append(f"| {entry['checkpoint']} | universal outputs identical | {not ident['differing']} "
                     f"({ident['compared']} tensors) | | | | | |")  # fmt: skip
    return "\n".join(lines) + "\n" + resume_md(results)


def resume_md(results: list[dict[str, Any]]) -> str:
    """Convert + DeepSpeed load at NEW_DP: the time until training can continue."""
    rows = []
    for entry in results:
        med = {t: statistics.median(r["wall_s"] for r in rs) for t, rs in entry["runs"].items()}
        for tool, r in entry.get("loads", {}).items():
            if "load_s" not in r:
                rows.append(f"| {entry['checkpoint']} | {tool} | {med[tool]:.2f} | {r['error']} | | |")
                continue
            how = "load_checkpoint" if tool == "ckpt --dp 2" else "load_checkpoint, load_universal"
            total = med[tool] + r["load_s"]
            rows.append(f"| {entry['checkpoint']} | {tool}, then {how} | {med[tool]:.2f} | {r['load_s']:.2f} | "
                        f"{total:.2f} | {r['peak_rss_tree'] / 1e6:,.0f} |")  # fmt: skip
    if not rows:
        return ""
    head = (f"\nResuming at DP {NEW_DP}: conversion (median above) plus DeepSpeed's `load_checkpoint` at {NEW_DP} "
            "ranks (one cold-cache run):\n\n| checkpoint | path | convert s | load s | total s | peak RSS of the "
            "2-rank launch MB (model, engine and load) |\n|---|---|---|---|---|---|")  # fmt: skip
    return head + "\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_load":
        ap = argparse.ArgumentParser()
        ap.add_argument("_load")
        ap.add_argument("--size", required=True)
        ap.add_argument("--stage", type=int, required=True)
        ap.add_argument("--ckpt", type=Path, required=True)
        ap.add_argument("--tag", required=True)
        ap.add_argument("--universal", action="store_true")
        a = ap.parse_args(argv)
        return load_worker(a.size, a.stage, a.ckpt, a.tag, a.universal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="355M")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=bc.DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=bc.REPO / "benchmarks" / "results")
    ap.add_argument("--no-load", dest="load", action="store_false", help="skip timing DeepSpeed's load at DP 2")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.cache / "work-reshard"
    log = args.cache / "logs" / f"reshard-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            built = bc.build_checkpoint(size, stage, args.cache, log.parent, False)
            ckpt = Path(built.get("path") or args.cache / bc.ckpt_name(size, stage))
            if not (ckpt / "latest").is_file():
                print(f"skipping {size} ZeRO-{stage}: no checkpoint ({built})")
                continue
            work.mkdir(parents=True, exist_ok=True)
            results.append(bench(size, stage, ckpt, args.runs, work, log, args.load))
            shutil.rmtree(work, ignore_errors=True)
    (args.out / "reshard.json").write_text(json.dumps({"machine": bc.machine_info(args.cache, *bc.drop_caches()),
                                                       "results": results}, indent=1, default=str))  # fmt: skip
    md = (
        "# `ckpt reshard` vs DeepSpeed `ds_to_universal`\n\nCommand: `python -m benchmarks.bench_reshard "
        + " ".join(argv)
        + "`\n\n"
        + summary_md(results)
    )
    (args.out / "reshard.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`ckpt diff` / `ckpt stats` at 1-3 B against the disk floor and the peer way, and the cost of the non-finite check
inside consolidate's safetensors writer (issue 34), in one run on one machine (made for the lent H200 host).

    python -m benchmarks.bench_device_reduce --work /tmp/reduce --size 2.7B [--runs 2] [--out DIR] [--budget-s 520]
    python -m benchmarks.bench_device_reduce --work /tmp/reduce --size tiny      # a quick end-to-end try

1. Builds a Llama-shaped model of random weights (2.7B: hidden 2560, 32 layers, FFN 6912, 32 heads, vocab 32000,
   untied; 1.1B: TinyLlama's shape; on the GPU when there is one) and saves it twice:
     A/  a torch Distributed Checkpoint folder, `dcp.save({"model": state_dict})` from one process (what
         accelerate's SHARDED_STATE_DICT / torchtitan-style saves hold, minus the optimizer);
     B/  a Hugging Face folder (safetensors shards of at most 5 GB, the index, config.json), the same values with
         ONE element changed (recorded: diff must report exactly it).
2. Rounds of runs (the order rotates by one each round), each a subprocess measured by
   `bench_consolidate.run_measured` (wall, peak RSS of the process tree, bytes through read()); before each the
   previous output is deleted, `sync`, and the page cache dropped (root), else all runs are warm (recorded):
     floor-diff      A's and B's tensor bytes read once, 16 MiB reads on 8 threads, nothing computed
     ckpt-diff       ckpt diff A B --json -q
     peer-diff       dcp_to_torch_save(A) + torch.load, load_file of B's shards, torch.equal per tensor and the
                     changed tensor's max |B - A| (the issue's peer: both models whole in memory)
     peer-diff-mem   the same with A loaded straight into memory (torch's _load_state_dict_from_keys, no .pt file)
     floor-stats     A's tensor bytes read once (as floor-diff)
     ckpt-stats      ckpt stats A --json -q
     peer-stats      dcp_to_torch_save(A) + torch.load, then per tensor in float64: NaN/+Inf/-Inf counts, min, max,
                     mean, RMS, L2 of the finite elements (what ckpt stats reports)
     consolidate-on / consolidate-off
                     ckpt consolidate A --out OUT (fp32 safetensors) with the writer's non-finite count forced on
                     (write_safetensors(nonfinite=NonFiniteCounter)) or off (the counter's add a no-op), so the
                     pair measures exactly the check whatever consolidate's default is
     floor-consolidate  A's tensor bytes read and the same number of bytes written to one file, then fsync
3. Checks (recorded, not timed): what ckpt diff and the peers report as changed (the planted element only), and
   `ckpt diff` of the last consolidate-on output against B (the same one element).
4. Writes OUT/reduce-<size>.json (every run) and OUT/reduce-<size>.md after every run, so a run cut short keeps what
   it measured; `--budget-s` stops starting new runs that many seconds after the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MODULE = "benchmarks.bench_device_reduce"
REPO = Path(__file__).resolve().parent.parent
GB = 1e9
SHARD_BYTES = 5 * 10**9
SIZES = {
    "tiny": {"hidden": 256, "layers": 4, "ffn": 688, "heads": 8, "kv_heads": 8, "vocab": 1000},
    "1.1B": {"hidden": 2048, "layers": 22, "ffn": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000},
    "2.7B": {"hidden": 2560, "layers": 32, "ffn": 6912, "heads": 32, "kv_heads": 32, "vocab": 32000},
}
CHANGED_AT = (3, 5)  # row, column of the one element B changes


def shapes(size: str) -> dict[str, tuple[int, ...]]:
    s = SIZES[size]
    h, f, v, kv = s["hidden"], s["ffn"], s["vocab"], s["kv_heads"] * s["hidden"] // s["heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return out | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def hf_config(size: str) -> dict[str, Any]:
    s = SIZES[size]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["ffn"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}  # fmt: skip


# --- building (in a child process: the harness stays small) --------------------------------------------------------


def build(work: Path, size: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    meta_file = work / "built.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("size") == size:
        return dict(json.loads(meta_file.read_text()))
    shutil.rmtree(work, ignore_errors=True)
    (work / "B").mkdir(parents=True)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(1234)
    state = {}
    for name, shape in shapes(size).items():  # random on the device, then host memory (a 2.7B model: 10.8 GB)
        state[name] = (torch.randn(shape, generator=gen, device=device) * 0.02).cpu()
    t_gen = time.perf_counter() - t0
    dcp.save({"model": state}, checkpoint_id=str(work / "A"), no_dist=True)
    t_dcp = time.perf_counter() - t0 - t_gen
    names = list(state)
    changed = names[len(names) // 2]
    while state[changed].dim() != 2:  # a matrix, so the element has a row and a column
        changed = names[names.index(changed) + 1]
    b_value = state[changed].clone()
    b_value[CHANGED_AT] += 1.0
    shards: list[list[str]] = [[]]
    size_now = 0
    for name in names:
        nbytes = state[name].numel() * 4
        if shards[-1] and size_now + nbytes > SHARD_BYTES:
            shards.append([])
            size_now = 0
        shards[-1].append(name)
        size_now += nbytes
    weight_map: dict[str, str] = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: (b_value if n == changed else state[n]) for n in group}, str(work / "B" / fname),
                  metadata={"format": "pt"})  # fmt: skip
        weight_map |= dict.fromkeys(group, fname)
    total = sum(t.numel() * 4 for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (work / "B" / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (work / "B" / "config.json").write_text(json.dumps(hf_config(size), indent=1))
    built = {"size": size, "params": total // 4, "bytes": total, "tensors": len(names), "b_shards": len(shards),
             "changed": changed, "changed_at": list(CHANGED_AT), "device": device, "gen_s": round(t_gen, 1),
             "dcp_save_s": round(t_dcp, 1), "build_s": round(time.perf_counter() - t0, 1),
             "torch": torch.__version__}  # fmt: skip
    meta_file.write_text(json.dumps(built))
    return built


# --- the floors and the peers (each `python -m benchmarks.bench_device_reduce --tool NAME ...`) ----------------------


def _tensor_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".distcp", ".safetensors"))


def _read_all(files: list[Path], threads: int = 8) -> int:
    """Every byte of `files`, 16 MiB reads spread over `threads` threads (the files split into 256 MiB pieces)."""
    piece = 256 << 20
    jobs = [(f, off, min(piece, f.stat().st_size - off)) for f in files for off in range(0, f.stat().st_size, piece)]

    def read(job: tuple[Path, int, int]) -> int:
        f, off, left = job
        buf = bytearray(16 << 20)
        done = 0
        fd = os.open(f, os.O_RDONLY)
        try:
            while left:
                n = os.preadv(fd, [memoryview(buf)[: min(left, len(buf))]], off + done)
                if not n:
                    break
                done += n
                left -= n
        finally:
            os.close(fd)
        return done

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, jobs))


def tool_floor_diff(a: Path, b: Path, out: Path) -> dict[str, Any]:
    return {"bytes": _read_all(_tensor_files(a) + _tensor_files(b))}


def tool_floor_stats(a: Path, b: Path, out: Path) -> dict[str, Any]:
    return {"bytes": _read_all(_tensor_files(a))}


def tool_floor_consolidate(a: Path, b: Path, out: Path) -> dict[str, Any]:
    """A's bytes read (8 threads) while the same number of bytes is written to one file, then fsync."""
    files = _tensor_files(a)
    total = sum(f.stat().st_size for f in files)

    def write() -> int:
        buf = bytes(16 << 20)
        left = total
        with open(out, "wb") as fh:
            while left:
                left -= fh.write(memoryview(buf)[: min(left, len(buf))])
            fh.flush()
            os.fsync(fh.fileno())
        return total

    with ThreadPoolExecutor(2) as pool:
        r, w = pool.submit(_read_all, files), pool.submit(write)
        return {"read": r.result(), "written": w.result()}


def _load_dcp(path: Path, tmp: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp))
    state = torch.load(str(tmp), weights_only=True)
    tmp.unlink()
    return dict(state["model"])


def _load_dcp_mem(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return dict(_load_state_dict_from_keys(checkpoint_id=str(path))["model"])


def _load_hf(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in _tensor_files(folder):
        out |= load_file(str(f))
    return out


def _compare(ta: dict[str, Any], tb: dict[str, Any]) -> dict[str, Any]:
    import torch

    changed: dict[str, float | str] = {}
    for name, x in ta.items():
        y = tb.get(name)
        if y is None:
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            changed[name] = "shape or dtype"
        elif not torch.equal(x, y):
            changed[name] = float((x.double() - y.double()).abs().max())
    return {"changed": changed, "only_a": sorted(set(ta) - set(tb)), "only_b": sorted(set(tb) - set(ta))}


def tool_peer_diff(a: Path, b: Path, out: Path) -> dict[str, Any]:
    return _compare(_load_dcp(a, out), _load_hf(b))


def tool_peer_diff_mem(a: Path, b: Path, out: Path) -> dict[str, Any]:
    return _compare(_load_dcp_mem(a), _load_hf(b))


def tool_peer_stats(a: Path, b: Path, out: Path) -> dict[str, Any]:
    import torch

    stats = {}
    for name, t in _load_dcp(a, out).items():
        x = t.double().flatten()
        f = x[torch.isfinite(x)]
        stats[name] = {"nan": int(x.isnan().sum()), "posinf": int(x.isposinf().sum()),
                       "neginf": int(x.isneginf().sum()), "min": float(f.min()), "max": float(f.max()),
                       "mean": float(f.mean()), "rms": float(f.square().mean().sqrt()), "l2": float(f.norm())}  # fmt: skip
    first = next(iter(stats))
    return {"tensors": len(stats), "first": {first: stats[first]}}


TOOLS = {"floor-diff": tool_floor_diff, "floor-stats": tool_floor_stats, "floor-consolidate": tool_floor_consolidate,
         "peer-diff": tool_peer_diff, "peer-diff-mem": tool_peer_diff_mem, "peer-stats": tool_peer_stats}  # fmt: skip


def consolidate_with(check: str, argv: list[str]) -> None:
    """`ckpt consolidate ARGV` with the writer's non-finite count forced on or off, then exit as the CLI does."""
    from ckpttools.io import safetensors_writer, values

    if check == "off":
        values.NonFiniteCounter.add = lambda self, *a, **k: None  # type: ignore[method-assign]
    elif safetensors_writer.write_safetensors.__kwdefaults__ is not None:  # on even where consolidate passes none
        safetensors_writer.write_safetensors.__kwdefaults__["nonfinite"] = values.NonFiniteCounter()
    from ckpttools.cli import main

    sys.argv = ["ckpt", "consolidate", *argv]
    main()


# --- the harness ------------------------------------------------------------------------------------------------


def command(tool: str, work: Path) -> tuple[list[str], Path]:
    a, b, out = work / "A", work / "B", work / "out"
    me = [sys.executable, "-m", MODULE]
    if tool == "ckpt-diff":
        return [sys.executable, "-m", "ckpttools.cli", "diff", str(a), str(b), "--json", "-q"], out
    if tool == "ckpt-stats":
        return [sys.executable, "-m", "ckpttools.cli", "stats", str(a), "--json", "-q"], out
    if tool.startswith("consolidate-"):
        args = [str(a), "--out", str(out), "--overwrite", "--json", "-q"]
        return [*me, "--consolidate-with", tool.split("-")[1], "--", *args], out
    return [*me, "--tool", tool, "--a", str(a), "--b", str(b), "--scratch", str(out)], out


def clear(out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()


def run_one(tool: str, work: Path, log_dir: Path, keep: bool = False) -> dict[str, Any]:
    from benchmarks.bench_consolidate import drop_caches, run_measured

    cmd, out = command(tool, work)
    clear(out)
    dropped, why = drop_caches()  # syncs first: the previous run's writes are not this run's
    time.sleep(1)
    env = {
        **os.environ,
        "CI": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log = log_dir / f"{tool}.log"
    with open(log, "wb") as fh:
        r = run_measured(cmd, env, fh, cwd=REPO)
    text = log.read_text(errors="replace")
    if keep and out.exists():  # the output the check compares with B, out of the way of the next runs
        clear(work / "keep")
        out.rename(work / "keep")
    clear(out)
    return {"tool": tool, "rc": r["returncode"], "wall_s": round(r["wall_s"], 2), "peak_rss_gb": round(r["peak_rss_tree"] / GB, 3),
            "ru_maxrss_gb": round(r["ru_maxrss"] / GB, 3), "rchar_gb": round(r["rchar_polled"] / GB, 2),
            "read_gb": round(r["read_bytes"] / GB, 2), "written_gb": round(r["write_bytes"] / GB, 2),
            "user_s": round(r["user_s"], 1), "sys_s": round(r["sys_s"], 1), "cache_dropped": dropped, "load1": [round(r["loadavg1_before"], 1), round(r["loadavg1_after"], 1)],
            "why_warm": why, "output": text[-3000:]}  # fmt: skip


def checks(runs: list[dict[str, Any]], built: dict[str, Any]) -> dict[str, Any]:
    """The one changed tensor, as each diff reported it (from its output of its first successful run)."""
    out: dict[str, Any] = {"planted": built["changed"]}
    for r in runs:
        if r["tool"] in out or r["tool"] not in ("ckpt-diff", "peer-diff", "peer-diff-mem"):
            continue
        try:
            doc = json.loads(r["output"][r["output"].index("{") :])
        except ValueError:
            continue
        if r["tool"] == "ckpt-diff":
            changed = [t for t in doc.get("tensors", []) if t.get("status") not in (None, "identical")]
            out[r["tool"]] = {"rc": r["rc"], "counts": doc.get("counts"),
                              "not_identical": [(t.get("name"), t.get("status"), t.get("differing"),
                                                 t.get("max_abs_diff"), t.get("first")) for t in changed]}  # fmt: skip
        else:
            out[r["tool"]] = doc
    return out


def render(report: dict[str, Any]) -> str:
    built, runs = report["built"], report["runs"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["tool"], []).append(r)

    def med(tool: str) -> float | None:
        ok = [r["wall_s"] for r in by.get(tool, []) if r["rc"] in (0, 1)]
        return statistics.median(ok) if ok else None

    floors = {"diff": med("floor-diff"), "stats": med("floor-stats"), "consolidate": med("floor-consolidate")}
    lines = [f"# ckpt diff / stats / the non-finite check at {built['params'] / 1e9:.2f} B ({report['machine']})", "",
             (f"A: torch DCP folder (one process, `{{'model': state_dict}}`), B: Hugging Face folder ({built['b_shards']} "
              f"safetensors shards), each {built['bytes'] / GB:.1f} GB fp32, B = A with one element of "
              f"`{built['changed']}` changed at {built['changed_at']}. Page cache dropped before every run: "
              f"{all(r['cache_dropped'] for r in runs)}."), "",
             "| tool | runs | wall s (median) | each run | x floor | peak RSS GB | read() GB | rc |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tool, rs in by.items():
        group = "diff" if "diff" in tool else "stats" if "stats" in tool else "consolidate"
        m, f = med(tool), floors[group]
        ratio = f"{m / f:.2f}" if m and f else "-"
        lines.append(f"| {tool} | {len(rs)} | {m if m is not None else '-'} | {', '.join(str(r['wall_s']) for r in rs)} | "
                     f"{ratio} | {max(r['peak_rss_gb'] for r in rs):.2f} | {max(r['rchar_gb'] for r in rs):.2f} | "
                     f"{','.join(str(r['rc']) for r in rs)} |")  # fmt: skip
    on, off = by.get("consolidate-on", []), by.get("consolidate-off", [])
    if on and off:
        m_on, m_off = med("consolidate-on"), med("consolidate-off")
        spread = max(r["wall_s"] for r in off) - min(r["wall_s"] for r in off)
        if m_on and m_off:
            lines += ["", (f"Non-finite check in the writer: consolidate {m_on:.2f} s with it, {m_off:.2f} s without "
                           f"(medians; {100 * (m_on / m_off - 1):+.1f} %; spread of the runs without it {spread:.2f} s).")]  # fmt: skip
    lines += ["", f"checks: `{json.dumps(report.get('checks'))}`"]
    return "\n".join(lines) + "\n"


def save(report: dict[str, Any], out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = render(report)
    (out / f"{name}.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpt-bench-reduce"))
    ap.add_argument("--size", default="2.7B", choices=list(SIZES))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--consolidate-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: no limit)")
    ap.add_argument("--tools", default="floor-diff,ckpt-diff,peer-diff,peer-diff-mem,floor-stats,ckpt-stats,peer-stats")
    ap.add_argument("--tool", choices=sorted(TOOLS), help=argparse.SUPPRESS)
    ap.add_argument("--a", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--b", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--consolidate-with", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consolidate_with:
        return consolidate_with(args.consolidate_with, args.rest)
    if args.tool:
        print(json.dumps(TOOLS[args.tool](args.a, args.b, args.scratch)))
        return None
    if args.build_only:
        print(json.dumps(build(args.work, args.size)))
        return None
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", MODULE, "--build-only", "--work", str(args.work), "--size", args.size]
    built = json.loads(
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, text=True).stdout.splitlines()[-1]
    )
    print(f"built {built}", flush=True)
    log_dir = args.work / "logs"
    log_dir.mkdir(exist_ok=True)
    name = f"reduce-{args.size}"
    report: dict[str, Any] = {"machine": f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}",
                              "built": built, "runs": []}  # fmt: skip
    tools = args.tools.split(",")
    rounds = [tools[r % len(tools) :] + tools[: r % len(tools)] for r in range(args.runs)]
    pairs = [t for _ in range(args.consolidate_runs) for t in ("consolidate-on", "consolidate-off")]
    # one round of each group first, so a run cut short by --budget-s still has every number once
    plan = rounds[0] + pairs + ["floor-consolidate"] + [t for r in rounds[1:] for t in r] + ["floor-consolidate"]
    for i, tool in enumerate(plan):
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            print(f"budget reached: {len(plan) - i} runs not started", flush=True)
            report["not_started"] = plan[i:]
            break
        r = run_one(tool, args.work, log_dir, keep=tool == "consolidate-on")
        report["runs"].append(r)
        report["checks"] = checks(report["runs"], built)
        print(f"{tool:18} rc={r['rc']} {r['wall_s']:7.2f}s rss={r['peak_rss_gb']:.2f}GB read()={r['rchar_gb']:.2f}GB "
              f"cold={r['cache_dropped']}", flush=True)  # fmt: skip
        save(report, args.out, name)
    report["checks"]["consolidated-vs-B"] = check_output(args.work)
    print(save(report, args.out, name))
    return None


def check_output(work: Path) -> Any:
    """Not timed: the last consolidate-on output against B by `ckpt diff` (one changed element expected)."""
    out = work / "keep"
    if not out.is_dir():
        return None
    cmd = [sys.executable, "-m", "ckpttools.cli", "diff", str(out), str(work / "B"), "--json", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    clear(out)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        return {"rc": proc.returncode, "stderr": proc.stderr[-1000:]}
    changed = [(t["name"], t.get("differing"), t.get("first")) for t in doc["tensors"] if t["status"] != "identical"]
    return {"rc": proc.returncode, "counts": doc.get("counts"), "not_identical": changed}


if __name__ == "__main__":
    main()

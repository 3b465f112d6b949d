"""One node, one big checkpoint: `ckpt` with threads and processes against DeepSpeed's tools and the disk floor.

    python -m benchmarks.bench_node all --size 1.3B --cache /data/bench --out RESULTS [--runs 2] [--budget-s 1300]
    python -m benchmarks.bench_node build --size 30M --dp 2 --cache DIR      # just the checkpoint
    python -m benchmarks.bench_node render --out RESULTS                      # node.md from node.json

Builds a Llama-shaped checkpoint with real DeepSpeed on CPU ranks (torchrun + gloo, `deepspeed.zero.Init`,
ZeRO-3, bf16, torch AdamW, two param groups, one step, `engine.save_checkpoint` + config.json), then measures,
every run on a cold page cache (sync, settle, drop_caches, Python packages read back in), in rounds whose order
rotates (see benchmarks/README.md, "One node"):

  consolidate   ckpt consolidate --dtype bf16 --workers 1|4|8|16 (and the default), fp32; zero_to_fp32
  reshard       ckpt reshard --dp 4, --universal; ds_to_universal (8 extract / 4 merge workers, first round only)
  processes     torchrun --nproc-per-node P --no-python ckpt consolidate --distributed --dtype bf16 --max-shard-size ...
                (P=1,2,4,8); torchrun --nproc-per-node P --no-python ckpt reshard --distributed --dp 4 (P=1,4)
  floors        cold parallel read of exactly the bytes a tool needs; fsync'd write of its output's size;
                both at once (the overlapped floor)

Each tool's time is taken twice: until it exits, and until a `sync` after it returns ("durable"): the tools do
not fsync, the floors do, so ratios to the floor use the durable time. Results are rewritten after every run
(OUT/node.json, OUT/node.md), so a run cut short still leaves its numbers. `--budget-s` stops starting new runs
once that many seconds have passed since the start (the build included).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import bench_consolidate as bc  # measurement helpers: run_measured, drop_caches, floors' ranges
from fixtures.build import ds_launch

MODULE = "benchmarks.bench_node"  # this file, as its torchrun workers run it (`python -m`)

SEED = 1234
SEQ_LEN = 16
CHUNK = 16 << 20
READ_THREADS = 8
SETTLE_S = 2.0
SCALING_SHARD = "200MB"  # small enough that 8 ranks each get shards of a 1.3B bf16 model (~14 files)

# Llama shapes from a config (no download); everything else is LlamaConfig's defaults (untied head).
SIZES: dict[str, dict[str, Any]] = {
    "30M": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 32000},
    "1.3B": {"hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 5504, "num_attention_heads": 16,
             "num_key_value_heads": 16, "vocab_size": 32000},
    "2.7B": {"hidden_size": 2560, "num_hidden_layers": 32, "intermediate_size": 6912, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000},
}  # fmt: skip


# ======================================================================================
# building the checkpoint (the worker runs under torchrun)
# ======================================================================================


def ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                              "stage3_prefetch_bucket_size": 20_000_000, "stage3_max_live_parameters": 100_000_000},
    }  # fmt: skip


def build_worker(size: str, out: Path) -> int:
    bc.quiet_worker()
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    ds_comm_torch.build_shm_op = lambda: None  # no JIT-built shared-memory op: gloo alone (no compiler needed)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    cfg = ds_config()
    config = LlamaConfig(**SIZES[size], max_position_embeddings=256)
    t0 = time.time()
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    named = list(model.named_parameters())
    decay = [p for n, p in named if "norm" not in n]
    no_decay = [p for n, p in named if "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    n_params = sum(getattr(p, "ds_numel", p.numel()) for _, p in named)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    t_init = time.time()
    ids = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(SEED + rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    t_step = time.time()
    engine.save_checkpoint(str(out))
    t_save = time.time()
    if rank == 0:
        engine.module.config.architectures = [type(engine.module).__name__]
        engine.module.config.save_pretrained(str(out))
        meta = {"size": size, "model": "LlamaForCausalLM", "llama_config": SIZES[size], "zero_stage": 3,
                "dp": dist.get_world_size(), "dtype": "bf16", "optimizer": "torch AdamW (DS AdamW, torch_adam)",
                "num_parameters": n_params, "loss": float(loss.float().item()),
                "tag": f"global_step{engine.global_steps}", "ds_config": cfg,
                "seconds": {"init": round(t_init - t0, 1), "step": round(t_step - t_init, 1),
                            "save": round(t_save - t_step, 1)}}  # fmt: skip
        (out / "bench_build.partial.json").write_text(json.dumps(meta, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def build(size: str, dp: int, cache: Path, log: Path) -> dict[str, Any]:
    """Build (or reuse) CACHE/llama-SIZE_z3_dpDP; returns the build's facts."""
    final = cache / f"llama-{size}_z3_dp{dp}"
    if (final / "bench_build.json").is_file():
        return {**json.loads((final / "bench_build.json").read_text()), "path": str(final), "reused": True}
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    threads = max(1, (os.cpu_count() or 1) // dp)
    env = ds_launch.worker_env(base=bc.tool_env(), threads=threads, MALLOC_MMAP_THRESHOLD_="1048576")
    cmd = ds_launch.torchrun_cmd(dp, MODULE, ["_build", "--size", size, "--out", partial])
    print(f"[build] {final.name}: torchrun x{dp} ({threads} threads each), log {log}", flush=True)
    with open(log, "ab") as fh:
        m = bc.run_measured(cmd, env=env, stdout=fh, cwd=cache)
    if m["returncode"] != 0:
        raise SystemExit(f"building {final.name} failed (rc {m['returncode']}); see {log}")
    meta = json.loads((partial / "bench_build.partial.json").read_text())
    (partial / "bench_build.partial.json").unlink()
    files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
    meta.update(build_wall_s=round(m["wall_s"], 1), build_peak_rss_gib=round(m["peak_rss_tree"] / 2**30, 1),
                total_bytes=sum(files.values()), num_files=len(files))  # fmt: skip
    (partial / "bench_build.json").write_text(json.dumps(meta, indent=1) + "\n")
    partial.rename(final)
    print(
        f"[build] {m['wall_s']:.0f} s, {meta['total_bytes'] / 1e9:.2f} GB, peak {meta['build_peak_rss_gib']} GiB",
        flush=True,
    )
    return {**meta, "path": str(final), "reused": False}


# ======================================================================================
# floors: cold parallel reads, fsync'd writes, both at once
# ======================================================================================


def tag_files(ckpt: Path) -> list[tuple[Path, int, int]]:
    """Every file of the tag folder, whole: what a reshard reads."""
    tag = (ckpt / "latest").read_text().strip()
    return [(f, 0, f.stat().st_size) for f in sorted((ckpt / tag).iterdir()) if f.is_file()]


def read_parallel(ranges: list[tuple[Path, int, int]], threads: int) -> dict[str, float]:
    """Read the byte ranges in 16 MiB preads spread over `threads` threads (preadv releases the GIL)."""
    jobs = [(p, off + k, min(CHUNK, n - k)) for p, off, n in ranges for k in range(0, n, CHUNK)]
    local = threading.local()
    fds: dict[Path, int] = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in ranges}}

    def one(job: tuple[Path, int, int]) -> int:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(CHUNK))
        path, off, n = job
        got = os.preadv(fds[path], [local.buf[:n]], off)
        if got != n:
            raise OSError(f"short read in {path} at {off}")
        return got

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(one, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"read_s": time.perf_counter() - t0, "read_bytes": total}


def write_fsync(target: Path, nbytes: int, files: int = 1) -> dict[str, float]:
    """Write `nbytes` in 16 MiB writes over `files` files (one thread each), fsync each, close."""
    block = bytes(CHUNK)
    share = [nbytes // files + (1 if i < nbytes % files else 0) for i in range(files)]

    def one(i: int) -> int:
        with open(f"{target}.{i}", "wb") as fh:
            left = share[i]
            while left > 0:
                left -= fh.write(block if left >= CHUNK else block[:left])
            fh.flush()
            os.fsync(fh.fileno())
        return share[i]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        total = sum(pool.map(one, range(files)))
    seconds = time.perf_counter() - t0
    for i in range(files):
        os.unlink(f"{target}.{i}")
    return {"write_s": seconds, "write_bytes": total}


def floor_run(kind: str, ranges: list[tuple[Path, int, int]], out_bytes: int, work: Path,
              threads: int = READ_THREADS, files: int = 1) -> dict[str, Any]:  # fmt: skip
    """kind: read, write, or overlapped (read and write at once, timed until both are done)."""
    target = work / "floor.bin"
    t0 = time.perf_counter()
    r: dict[str, Any] = {}
    if kind == "read":
        r.update(read_parallel(ranges, threads))
    elif kind == "write":
        r.update(write_fsync(target, out_bytes, files))
    else:
        with ThreadPoolExecutor(2) as pool:
            fr = pool.submit(read_parallel, ranges, threads)
            fw = pool.submit(write_fsync, target, out_bytes, files)
            r.update(fr.result())
            r.update(fw.result())
    r.update(returncode=0, wall_s=time.perf_counter() - t0)
    r["durable_s"] = r["wall_s"]
    return r


def disk_counters(path: Path) -> dict[str, int] | None:
    """Bytes read and written so far by the block device holding `path` (/proc/diskstats), or None."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    text = _read("/proc/diskstats") or ""
    for line in text.splitlines():
        f = line.split()
        if len(f) > 9 and int(f[0]) == major and int(f[1]) == minor:
            return {"read": int(f[5]) * 512, "written": int(f[9]) * 512}
    return None


# ======================================================================================
# the cases
# ======================================================================================


def ckpt_shim(cache: Path) -> Path:
    """The `ckpt` executable: the one beside this Python, else a shim running `python -m ckpttools.cli`."""
    beside = bc.ckpt_bin()
    if beside.is_file():
        return beside
    shim = cache / "bin" / "ckpt"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckpttools.cli "$@"\n')
    shim.chmod(0o755)
    return shim


# Each rank's own I/O counters, written when it exits: the wrapping sh's /proc/self/io once it has reaped the rank
# counts the rank alone (the launcher's counters add every reaped rank once more). A builtin loop, so that "self"
# is the sh; no `$$`: torchrun's macro substitution (string.Template) turns it into `$`.
RANK_IO = 'io=$1; shift; "$@"; rc=$?; while read -r l; do echo "$l"; done < /proc/self/io > "$io.$RANK"; exit $rc'


def torchrun_no_python(nproc: int, argv: list[str], io: Path | None = None) -> list[str]:
    wrap = ["/bin/sh", "-c", RANK_IO, "sh", str(io)] if io is not None else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(ds_launch.free_port()),
            "--no-python", *wrap, *argv]  # fmt: skip


def rank_io(io: Path) -> dict[str, Any]:
    """Sum of the ranks' rchar / read_bytes (and each rank's rchar) from the files RANK_IO left."""
    ranks = {}
    for f in sorted(io.parent.glob(io.name + ".*")):
        fields = dict(line.split(": ") for line in f.read_text().splitlines() if ": " in line)
        ranks[f.suffix[1:]] = {k: int(v) for k, v in fields.items()}
        f.unlink()
    return {"ranks": len(ranks), "rchar": sum(r.get("rchar", 0) for r in ranks.values()),
            "rank_read_bytes": sum(r.get("read_bytes", 0) for r in ranks.values()),
            "rchar_by_rank": {k: r.get("rchar", 0) for k, r in ranks.items()}}  # fmt: skip


def cases(ckpt: Path, work: Path, ckpt_bin: str, cores: int) -> list[dict[str, Any]]:
    """Every measurement: id, group, and either cmd + out (a subprocess) or floor (kind, bytes, which reads)."""
    tag = (ckpt / "latest").read_text().strip()
    cons = [ckpt_bin, "consolidate", str(ckpt), "--overwrite", "-q", "--out"]
    c: list[dict[str, Any]] = []
    default = min(8, cores)  # ckpttools.io.threads: this process's share of the cores, at most 8
    for w in sorted({1, 4, 8, 16, default}):
        label = f"ckpt consolidate bf16 --workers {w}" + (" (default)" if w == default else "")
        c.append(
            {
                "id": label,
                "group": "consolidate",
                "out": work / f"bf16w{w}",
                "dtype": "bf16",
                "cmd": [*cons, str(work / f"bf16w{w}"), "--dtype", "bf16", "--workers", str(w)],
            }
        )
    c.append(
        {
            "id": "ckpt consolidate fp32",
            "group": "consolidate",
            "out": work / "fp32",
            "cmd": [*cons, str(work / "fp32")],
            "dtype": "fp32",
        }
    )
    c.append({"id": "zero_to_fp32 --safe_serialization", "group": "consolidate", "out": work / "z2f", "dtype": "fp32",
              "cmd": [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(work / "z2f"),
                      "--safe_serialization"]})  # fmt: skip
    c += [{"id": f"floor {kind}" + ("" if kind == "read" else f" {dtype}"), "group": "consolidate", "floor": kind,
           "reads": "masters", "dtype": dtype}
          for kind in ("read", "write", "overlapped")
          for dtype in (("any",) if kind == "read" else ("bf16", "fp32"))]  # fmt: skip
    c.append(
        {
            "id": "floor read, 1 thread",
            "group": "consolidate",
            "floor": "read",
            "reads": "masters",
            "threads": 1,
            "dtype": "any",
        }
    )
    c.append(
        {
            "id": "ckpt reshard --dp 4",
            "group": "reshard",
            "out": work / "dp4",
            "cmd": [ckpt_bin, "reshard", str(ckpt), "--dp", "4", "--out", str(work / "dp4"), "--overwrite", "-q"],
        }
    )
    c.append(
        {
            "id": "ckpt reshard --universal",
            "group": "reshard",
            "out": work / "ucp",
            "keep": "universal",
            "cmd": [ckpt_bin, "reshard", str(ckpt), "--universal", "--out", str(work / "ucp"), "--overwrite", "-q"],
        }
    )
    c.append({"id": "ds_to_universal (8 extract, 4 merge workers)", "group": "reshard", "out": work / "dsu",
              "keep": "universal", "once": True,
              "cmd": [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                      "--output_folder", str(work / "dsu" / tag), "--inject_missing_state",
                      "--num_extract_workers", "8", "--num_merge_workers", "4"]})  # fmt: skip
    c += [{"id": f"floor {kind} (reshard)", "group": "reshard", "floor": kind, "reads": "all", "dtype": "reshard"}
          for kind in ("read", "write", "overlapped")]  # fmt: skip
    io = work / "io" / "rank"
    for p in (1, 8):
        c.append({"id": f"torchrun P={p} --no-python true (start-up alone)", "group": "processes", "procs": p,
                  "out": work / "none", "cmd": torchrun_no_python(p, ["true"])})  # fmt: skip
    for p in (1, 2, 4, 8):
        out = work / f"procs{p}"
        c.append(
            {
                "id": f"torchrun P={p} ckpt consolidate bf16 --max-shard-size {SCALING_SHARD}",
                "group": "processes",
                "out": out,
                "procs": p,
                "io": io,
                "keep": "scaling" if p == 1 else None,
                "same_as": work / "procs1" if p > 1 else None,
                "dtype": "bf16",
                "cmd": torchrun_no_python(
                    p, [*cons, str(out), "--dtype", "bf16", "--max-shard-size", SCALING_SHARD, "--distributed"], io
                ),
            }
        )
    for p in (2, 4, 8):
        out = work / f"uprocs{p}"
        argv = [ckpt_bin, "reshard", str(ckpt), "--universal", "--out", str(out), "--overwrite", "-q", "--distributed"]
        c.append({"id": f"torchrun P={p} ckpt reshard --universal", "group": "processes", "out": out, "procs": p,
                  "io": io, "cmd": torchrun_no_python(p, argv, io)})  # fmt: skip
    out = work / "rprocs4"
    c.append({"id": "torchrun P=4 ckpt reshard --dp 4", "group": "processes", "out": out, "procs": 4, "io": io,
              "cmd": torchrun_no_python(4, [ckpt_bin, "reshard", str(ckpt), "--dp", "4", "--out", str(out),
                                            "--overwrite", "-q", "--distributed"], io)})  # fmt: skip
    return c


def durable_run(case: dict[str, Any], log: Path) -> dict[str, Any]:
    """The tool's measured run, then `sync`: time until it exits and until its output is on the disk."""
    out = case["out"]
    if case.get("io") is not None:
        case["io"].parent.mkdir(parents=True, exist_ok=True)
    disk0 = disk_counters(log.parent)
    with open(log, "ab") as fh:
        fh.write(("\n$ " + " ".join(map(str, case["cmd"])) + "\n").encode())
        fh.flush()
        r = bc.run_measured(list(map(str, case["cmd"])), bc.tool_env(), fh)
    t0 = time.perf_counter()
    os.sync()
    r["sync_after_s"] = time.perf_counter() - t0
    r["durable_s"] = r["wall_s"] + r["sync_after_s"]
    disk1 = disk_counters(log.parent)
    if disk0 and disk1:  # the device's own counters: what reached or left the disk, the sync included
        r["disk_read_bytes"] = disk1["read"] - disk0["read"]
        r["disk_written_bytes"] = disk1["written"] - disk0["written"]
    if case.get("io") is not None:
        r["rank_io"] = rank_io(case["io"])
    files = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    r["out_bytes"] = sum(p.stat().st_size for p in files)
    r["out_files"] = len(files)
    if r["returncode"] != 0:
        r["log_tail"] = log.read_text(errors="replace")[-3000:]
    for k in ("rusage_children_maxrss_before", "rusage_children_maxrss_after", "samples"):
        r.pop(k, None)
    return r


def same_files(a: Path, b: Path) -> dict[str, Any]:
    """Byte-for-byte comparison of two output folders (every file, by relative path)."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    differ = [f for f in fa if f in fb and not filecmp.cmp(a / f, b / f, shallow=False)]
    return {"identical": fa == fb and not differ, "files": len(fa), "differing": differ,
            "only_in_first": sorted(set(fa) - set(fb)), "only_in_second": sorted(set(fb) - set(fa))}  # fmt: skip


_DIGEST = """
import hashlib, json, sys, torch
root, names = sys.argv[1], json.loads(sys.argv[2])
out = {}
for n in names:
    for s in ("fp32", "exp_avg", "exp_avg_sq"):
        t = torch.load(f"{root}/{n}/{s}.pt", weights_only=False, map_location="cpu")
        t = t["param"] if isinstance(t, dict) else t
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        out[f"{n}/{s}"] = [str(t.dtype), t.numel(), hashlib.sha256(raw).hexdigest()]
print(json.dumps(out))
"""


def universal_digests(folder: Path) -> dict[str, Any]:
    """sha256 of every 8th parameter's fp32/exp_avg/exp_avg_sq tensor bytes (flattened) in a universal folder."""
    tag = next(p for p in folder.iterdir() if p.is_dir())
    names = sorted(p.name for p in (tag / "zero").iterdir() if p.is_dir())[::8]
    r = subprocess.run([sys.executable, "-c", _DIGEST, str(tag / "zero"), json.dumps(names)], check=False,
                       capture_output=True, text=True, env=bc.tool_env())  # fmt: skip
    if r.returncode != 0:
        return {"error": r.stderr[-1500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ======================================================================================
# the run
# ======================================================================================


def prepare_cold(prewarm: bool) -> bool:
    os.sync()
    time.sleep(SETTLE_S)
    dropped = bc.drop_caches()[0]
    if dropped and prewarm:
        bc.prewarm_software()
    return dropped


def measure(case: dict[str, Any], ckpt: Path, work: Path, log: Path, sizes: dict[str, int]) -> dict[str, Any]:
    if "floor" in case:
        ranges = bc.fp32_master_ranges(ckpt) if case["reads"] == "masters" else tag_files(ckpt)
        dropped = prepare_cold(prewarm=False)
        r = floor_run(case["floor"], ranges, sizes[case["dtype"]] if case["floor"] != "read" else 0, work,
                      case.get("threads", READ_THREADS))  # fmt: skip
    else:
        shutil.rmtree(case["out"], ignore_errors=True)
        if case["group"] != "consolidate":
            drop_kept(work)  # the disk holds the checkpoint and about two outputs
        dropped = prepare_cold(prewarm=True)
        r = durable_run(case, log)
    r["cache_dropped"] = dropped
    return r


def run_all(a: argparse.Namespace) -> int:
    t_start = time.time()
    cache = a.cache.resolve()
    out = a.out.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(cache)  # `python -m`/`-c` import from the cwd first: keep the repository's ckpttools out of the way
    log = cache / "bench_node.log"
    results: dict[str, Any] = {"command": f"python -m {MODULE} " + " ".join(sys.argv[1:]),
                               "machine": machine(cache), "runs": {}, "checks": {}, "notes": []}  # fmt: skip
    save = lambda: write_results(results, out)  # noqa: E731
    save()
    built = build(a.size, a.dp, cache, log)
    results["build"] = built
    ckpt = Path(built["path"])
    work = cache / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    masters = sum(n for _, _, n in bc.fp32_master_ranges(ckpt))
    all_bytes = sum(n for _, _, n in tag_files(ckpt))
    sizes = {"fp32": masters, "bf16": masters // 2, "reshard": all_bytes}
    results["bytes"] = {"fp32_masters": masters, "tag_folder": all_bytes, "bf16_output": masters // 2}
    save()
    cores = len(os.sched_getaffinity(0))
    groups = a.only.split(",") if a.only else ["consolidate", "reshard", "processes"]
    skip = [x for x in a.skip.split(",") if x]
    todo = [c for c in cases(ckpt, work, str(ckpt_shim(cache)), cores) if c["group"] in groups]
    todo = [c for c in todo if not any(x in c["id"] for x in skip)]
    todo.sort(key=lambda c: groups.index(c["group"]))  # the groups in the order --only names them
    for rnd in range(a.runs):
        k = rnd % len(todo)
        for case in todo[k:] + todo[:k]:
            if case.get("once") and rnd > 0:
                continue
            if time.time() - t_start > a.budget_s:
                results["notes"].append(f"budget of {a.budget_s} s reached in round {rnd}: stopped before "
                                        f"'{case['id']}' and the rest")  # fmt: skip
                save()
                return 0
            r = measure(case, ckpt, work, log, sizes)
            r["round"] = rnd
            r["disk_free_gb_after"] = round(shutil.disk_usage(cache).free / 1e9, 1)
            results["runs"].setdefault(case["id"], []).append(r)
            print(
                f"[{rnd}] {case['id']}: {r['wall_s']:.2f} s (durable {r['durable_s']:.2f} s) rc {r['returncode']}",
                flush=True,
            )
            if a.checks:
                after_run(case, r, rnd, a.runs, results, work)
            elif case.get("out") is not None:
                shutil.rmtree(case["out"], ignore_errors=True)
            save()
    results["total_wall_s"] = round(time.time() - t_start, 1)
    save()
    return 0


def after_run(case: dict[str, Any], r: dict[str, Any], rnd: int, runs: int, results: dict[str, Any],
              work: Path) -> None:  # fmt: skip
    """Checks on outputs, then deletes them (the disk holds the checkpoint and one or two outputs)."""
    checks = results["checks"]
    out = case.get("out")
    if out is None or r["returncode"] != 0:
        return
    if case.get("same_as") is not None and case["same_as"].exists():
        checks[f"{case['id']} vs P=1"] = same_files(out, case["same_as"])
    if case.get("keep") == "universal":
        checks[f"digests {case['id']}"] = universal_digests(out)
        ours = checks.get("digests ckpt reshard --universal")
        theirs = next((v for k, v in checks.items() if k.startswith("digests ds_to_universal")), None)
        if ours and theirs and "error" not in ours and "error" not in theirs:
            common = sorted(set(ours) & set(theirs))
            checks["universal: ckpt vs ds_to_universal"] = {
                "tensors_compared": len(common),
                "differing": [k for k in common if ours[k] != theirs[k]],
                "how": "sha256 of the flattened tensor bytes, every 8th parameter, fp32/exp_avg/exp_avg_sq",
            }
    if rnd == 0 and (case["id"] in KEPT or case["id"].startswith("ckpt consolidate bf16 --workers 8")):
        # round 0 keeps these three until they are compared
        out.rename(work / ("keep-" + out.name))
        kept = [work / ("keep-" + n) for n in ("fp32", "bf16w8", "z2f")]
        if all(k.exists() for k in kept):
            checks["consolidate fp32 vs zero_to_fp32"] = bc.compare_outputs(kept[0], kept[2], cast_bf16=False)
            checks["consolidate bf16 vs zero_to_fp32 cast"] = bc.compare_outputs(kept[1], kept[2], cast_bf16=True)
            drop_kept(work)
        return
    if case.get("keep") != "scaling":
        shutil.rmtree(out, ignore_errors=True)


KEPT = ("ckpt consolidate fp32", "zero_to_fp32 --safe_serialization")


def drop_kept(work: Path) -> None:
    for k in work.glob("keep-*"):
        shutil.rmtree(k, ignore_errors=True)


def machine(cache: Path) -> dict[str, Any]:
    import platform

    import psutil

    du = shutil.disk_usage(cache)
    mounts = subprocess.run(["df", "-hT", str(cache)], check=False, capture_output=True, text=True).stdout.strip()
    versions: dict[str, str | None] = {}
    from importlib import metadata

    for mod in ("torch", "deepspeed", "transformers", "safetensors", "numpy"):
        try:
            versions[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:  # noqa: PERF203 - five names, once
            versions[mod] = None
    cpuinfo = (_read("/proc/cpuinfo") or "").splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "cpu": cpu,
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "disk_free_gb": round(du.free / 1e9, 1),
            "disk_total_gb": round(du.total / 1e9, 1), "df": mounts, "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions,
            # a copied tree's .git (if any) may be stale: the copier says which commit it copied
            "ckpttools_git_head": os.environ.get("CKPTTOOLS_GIT_HEAD") or bc._git("rev-parse", "HEAD"),
            "dirty_ratio": _read("/proc/sys/vm/dirty_ratio"),
            "dirty_background_ratio": _read("/proc/sys/vm/dirty_background_ratio")}  # fmt: skip


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


# ======================================================================================
# reporting
# ======================================================================================


def med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("returncode") == 0 and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _floor(results: dict[str, Any], name: str) -> float | None:
    return med(results["runs"].get(name, []), "wall_s")


def table(results: dict[str, Any], ids: list[str], ref: str | None, floors: tuple[str, str, str]) -> list[str]:
    """One row per tool: medians, and ratios to DeepSpeed's tool and to the two floors.

    floors: the read floor, the write floor and the overlapped (read and write at once) floor's run ids; the
    max floor is the slower of the first two (a perfectly overlapped tool on a disk whose reads and writes
    do not share bandwidth), the concurrent floor what this disk does when both run at once.
    """
    runs = results["runs"]
    read_f, write_f, both_f = (_floor(results, f) for f in floors)
    max_f = max(read_f, write_f) if read_f and write_f else None
    ref_t = med(runs.get(ref, []), "durable_s") if ref else None
    lines = [("| tool | n | exits s | durable s | CPU s | peak RSS MB | disk read GB | disk written GB | ranks' read() GB "
              "| vs DeepSpeed | x max floor | x concurrent floor |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i in ids:
        rs = runs.get(i)
        if not rs:
            continue
        ok = [r for r in rs if r.get("returncode") == 0]
        if not ok:
            lines.append(f"| {i} | 0 | failed (rc {rs[0].get('returncode')}) | | | | | | | | | |")
            continue
        d = med(rs, "durable_s")
        rss = med(rs, "peak_rss_tree")
        vs = d / ref_t if d is not None and ref_t and i != ref else None
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in ok)
        rchar = [r["rank_io"]["rchar"] for r in ok if r.get("rank_io", {}).get("ranks")]
        lines.append(f"| {i} | {len(ok)} | {_f(med(rs, 'wall_s'))} | {_f(d)} | {_f(cpu, '{:.1f}')} "
                     f"| {_f(rss and rss / 1e6, '{:,.0f}')} "
                     f"| {_gb(med(rs, 'disk_read_bytes'))} | {_gb(med(rs, 'disk_written_bytes'))} "
                     f"| {_gb(statistics.median(rchar) if rchar else None)} "
                     f"| {_f(vs)} | {_f(d / max_f if max_f and d else None)} "
                     f"| {_f(d / both_f if both_f and d else None)} |")  # fmt: skip
    return lines


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def floor_table(results: dict[str, Any], ids: list[str]) -> list[str]:
    lines = ["| floor | n | seconds | GB | GB/s |", "|---|---|---|---|---|"]
    for i in ids:
        rs = results["runs"].get(i)
        if not rs:
            continue
        t = med(rs, "wall_s")
        gb = ((med(rs, "read_bytes") or 0) + (med(rs, "write_bytes") or 0)) / 1e9
        lines.append(f"| {i} | {len(rs)} | {_f(t)} | {_f(gb)} | {_f(gb / t if t else None)} |")
    return lines


def render(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    b = results.get("build", {})
    by = results.get("bytes", {})
    lines = ["# One node: `ckpt` threads and processes vs DeepSpeed vs the disk floor", "",
             f"Command: `{results.get('command')}`  ",
             (f"Machine: {m.get('cores')} cores ({m.get('cpu')}), {m.get('ram_gib')} GiB RAM, "
             f"{m.get('disk_total_gb')} GB disk ({m.get('disk_free_gb')} GB free at start), kernel {m.get('kernel')}, "
             f"Python {m.get('python')}; {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}; "
             f"ckpttools {str(m.get('ckpttools_git_head'))[:10]}; {m.get('date')}.  "),
             (f"Checkpoint: Llama {b.get('size')} ({(b.get('num_parameters') or 0) / 1e9:.2f} B params), ZeRO-3, "
             f"DP {b.get('dp')}, bf16, torch AdamW, one step, written by DeepSpeed "
             f"{m.get('versions', {}).get('deepspeed')} on {b.get('dp')} CPU ranks (gloo) "
             f"in {b.get('build_wall_s')} s; "
             f"{(b.get('total_bytes') or 0) / 1e9:.2f} GB "
             f"in {b.get('num_files')} files; fp32 masters {by.get('fp32_masters', 0) / 1e9:.2f} GB."), "",
             ("Every run on a cold page cache (sync, settle, drop_caches, software read back in). *exits* = wall time "
             "until the tool exits; *durable* = until a `sync` after it returns (ckpt flushes its output before it "
             "publishes it, DeepSpeed's tools do not; the floors fsync). Ratios use durable medians. Floors: cold read with 8 threads of exactly the bytes needed "
             "(fp32 masters for consolidate, the whole tag folder for reshard), fsync'd write of the output size, and "
             "both at once (*overlapped*). CPU s = user + system time of the process tree."), ""]  # fmt: skip
    ids = list(results["runs"])
    lines += ["## Floors (the disk)", "", *floor_table(results, [i for i in ids if i.startswith("floor")]), ""]
    cons = [i for i in ids if i.startswith(("ckpt consolidate", "zero_to_fp32"))]
    lines += ["## consolidate (floors: cold read of the fp32 masters; fsync'd write of the output size)", ""]
    z2f = "zero_to_fp32 --safe_serialization"
    bf16_floors = ("floor read", "floor write bf16", "floor overlapped bf16")
    lines += [*table(results, [i for i in cons if "bf16" in i], z2f, bf16_floors), ""]
    lines += [*table(results, [i for i in cons if "bf16" not in i], z2f,
                     ("floor read", "floor write fp32", "floor overlapped fp32")), ""]  # fmt: skip
    resh = [i for i in ids if i.startswith(("ckpt reshard", "ds_to_universal"))]
    dsu = next((i for i in ids if i.startswith("ds_to_universal")), None)
    lines += ["## reshard (floors: cold read of the tag folder; fsync'd write of its size)", ""]
    reshard_floors = ("floor read (reshard)", "floor write (reshard)", "floor overlapped (reshard)")
    lines += [*table(results, resh, dsu, reshard_floors), ""]
    procs = [i for i in ids if i.startswith("torchrun")]
    lines += ["## processes on one node (torchrun --no-python)", ""]
    lines += table(results, [i for i in procs if "reshard" not in i], None, bf16_floors)
    lines += ["", *table(results, [i for i in procs if "reshard" in i], None, reshard_floors), ""]
    lines += ["## Checks", ""]
    for k, v in results.get("checks", {}).items():
        if k.startswith("digests"):
            continue
        lines.append(f"- {k}: `{json.dumps(_brief(v))}`")
    lines += [f"- note: {n}" for n in results.get("notes", [])] + [""]
    return "\n".join(lines)


def _brief(v: dict[str, Any]) -> dict[str, Any]:
    keep = ("identical", "compared_keys", "num_differing", "only_in_ckpt", "only_in_zero_to_fp32", "files",
            "differing", "tensors_compared", "error", "against")  # fmt: skip
    return {k: v[k] for k in keep if k in v}


def write_results(results: dict[str, Any], out: Path) -> None:
    (out / "node.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "node.md").write_text(render(results))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("_build")
    w.add_argument("--size", required=True)
    w.add_argument("--out", type=Path, required=True)
    for name in ("all", "build"):
        p = sub.add_parser(name)
        p.add_argument("--size", default="1.3B", choices=list(SIZES))
        p.add_argument("--dp", type=int, default=8)
        p.add_argument("--cache", type=Path, default=bc.DEFAULT_CACHE)
        p.add_argument("--out", type=Path, default=bc.REPO / "benchmarks" / "results")
        p.add_argument("--runs", type=int, default=2)
        p.add_argument("--budget-s", type=float, default=float("inf"))
        p.add_argument("--only", default="", help="comma list of groups: consolidate, reshard, processes")
        p.add_argument("--skip", default="", help="comma list: leave out the cases whose name contains one of these")
        p.add_argument("--no-checks", dest="checks", action="store_false", help="no output comparisons")
    r = sub.add_parser("render")
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "_build":
        return build_worker(a.size, a.out)
    if a.cmd == "build":
        a.cache.mkdir(parents=True, exist_ok=True)
        print(json.dumps(build(a.size, a.dp, a.cache.resolve(), a.cache.resolve() / "bench_node.log"), indent=1))
        return 0
    if a.cmd == "render":
        res = json.loads((a.out / "node.json").read_text())
        (a.out / "node.md").write_text(render(res))
        print(render(res))
        return 0
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())

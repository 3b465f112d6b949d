"""Benchmark `ckpt consolidate` against DeepSpeed's `zero_to_fp32` on real GPT-2 ZeRO checkpoints.

    ./scripts/setup && .venv/bin/python -m benchmarks.bench_consolidate \
        [--sizes 124M,355M,774M] [--stages 2,3] [--runs 3] [--out benchmarks/results]

What it does (see benchmarks/README.md for the method and caveats):

1. Builds (or reuses) one checkpoint per size x stage with DeepSpeed on CPU: GPT-2 from a config
   (no download), bf16, ZeRO-2 or ZeRO-3, torch AdamW, 4 ranks via torchrun + gloo, ONE training
   step on a (1, 16) batch, `engine.save_checkpoint(dir)`, plus `config.json` (rank 0) so
   `ckpt consolidate` treats the folder as a Hugging Face one. Cached outside the repository in
   `~/.cache/ckpttools-bench/<size>_z<stage>_dp4/` (`--cache`), reused when complete.
2. For each checkpoint, `--runs` rounds, each tool once per round in an order that rotates
   between rounds, page cache dropped before every run when permitted, then the Python packages
   read back in (cold checkpoint, warm software; else: one unrecorded warm-up per tool, all warm):
     ckpt-fp32      .venv/bin/ckpt consolidate CKPT --to safetensors --out TMP --overwrite
     ckpt-bf16      ... --dtype bf16
     zero_to_fp32   python -m deepspeed.utils.zero_to_fp32 CKPT TMP --safe_serialization
                    (falls back to no --safe_serialization, i.e. pytorch_model.bin, when it
                    crashes on GPT-2's tied weights: "Some tensors share memory")
     floor          read the fp32 master partitions' bytes + write an fp32-sized file, in-process
     copy-floor     the same bytes copied chunk by chunk into one file, one thread, in-process
   each tool a subprocess with CI=1; wall time, sampled peak RSS of the process tree (psutil,
   every 20 ms), the exact ru_maxrss of the reaped process (os.wait4), bytes read / written at
   the storage layer (rusage inblock/oublock == /proc/<pid>/io read_bytes/write_bytes).
3. Checks the outputs are identical (torch.equal per common key; bf16 output against
   zero_to_fp32's fp32 values cast to bf16) and writes OUT/results.json (all raw runs; merged
   with an existing file by checkpoint), OUT/results.md and OUT/consolidate.png.

`--render-only` rebuilds results.md / consolidate.png from OUT/results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import pickle
import platform
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

from fixtures.build import ds_launch

REPO = ds_launch.ROOT
# this file, as its children run it (`python -m` from wherever the run is, the repository on their PYTHONPATH)
MODULE = "benchmarks.bench_consolidate"

DEFAULT_CACHE = Path(os.environ.get("CKPTTOOLS_BENCH_CACHE", Path.home() / ".cache" / "ckpttools-bench"))
DP = 4
SEQ_LEN = 16
SEED = 1234
MB = 1e6

# GPT-2 family; everything else is GPT2Config() defaults (vocab 50257, n_positions 1024, tied head).
SIZES: dict[str, dict[str, Any]] = {
    "124M": {},
    "355M": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "774M": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
}
TOOLS = ("ckpt-fp32", "ckpt-bf16", "zero_to_fp32", "floor", "copy-floor")
FLOORS = ("floor", "copy-floor")
POLL_S = 0.02
Z3_SUB_GROUP_SIZE = 50_000_000
SETTLE_S = 3.0


# ======================================================================================
# environment
# ======================================================================================


CODE_SNAPSHOT: Path | None = None  # set by snapshot_ckpttools(): the ckpttools every run imports


def tool_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CI": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    if CODE_SNAPSHOT is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(CODE_SNAPSHOT)] + [x for x in [env.get("PYTHONPATH")] if x])
    return env


def source_hash(pkg: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def snapshot_ckpttools(dest: Path) -> dict[str, Any]:
    """Copy ckpttools/ as it is now and make every `ckpt` run import that copy (PYTHONPATH goes
    before the editable install), so edits made to the working tree during a long benchmark do not
    mix versions within one run."""
    global CODE_SNAPSHOT  # noqa: PLW0603 - every later ckpt run of this process imports the snapshot
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO / "ckpttools", dest / "ckpttools", ignore=shutil.ignore_patterns("__pycache__"))
    CODE_SNAPSHOT = dest
    where = subprocess.run(
        [sys.executable, "-c", "import ckpttools; print(ckpttools.__file__)"],
        env=tool_env(),
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not where.startswith(str(dest)):
        raise SystemExit(f"the ckpttools snapshot in {dest} is not the one imported ({where})")
    return {"path": str(dest), "sha256_16": source_hash(dest / "ckpttools")}


def build_env() -> dict[str, str]:
    # hand freed tensors back to the OS at once: 4 ranks share 24 GiB
    return ds_launch.worker_env(base=tool_env(), MALLOC_MMAP_THRESHOLD_="1048576")


def drop_caches() -> tuple[bool, str]:
    """sync + drop the page cache. Returns (done, why-not)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True, ""
    except OSError as e:
        return False, f"{type(e).__name__}: {e}"


PREWARM = (
    "import torch, safetensors, safetensors.torch, numpy, deepspeed, deepspeed.utils.zero_to_fp32, "
    "transformers, ckpttools.cli, ckpttools.ops.consolidate, ckpttools.ops.hf; "
    "from transformers import AutoConfig, GPT2LMHeadModel"
)


def prewarm_software() -> float:
    """Re-read the Python packages both tools import (after a cache drop), so that the runs measure
    a cold CHECKPOINT, not a cold torch install. Returns seconds taken."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", PREWARM],
        env=tool_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return time.perf_counter() - t0


def startup_costs() -> dict[str, float]:
    """Warm wall time of bare imports: the part of every run that is Python start-up, not consolidation."""
    probes = {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import deepspeed.utils.zero_to_fp32'": [
            sys.executable,
            "-c",
            "import deepspeed.utils.zero_to_fp32",
        ],
        "python -c 'import ckpttools.ops.consolidate'": [sys.executable, "-c", "import ckpttools.ops.consolidate"],
        "python -c 'import transformers; GPT2LMHeadModel'": [
            sys.executable,
            "-c",
            "import transformers; transformers.GPT2LMHeadModel",
        ],
        "ckpt --version": [str(ckpt_bin()), "--version"],
    }
    out = {}
    for label, cmd in probes.items():
        subprocess.run(cmd, env=tool_env(), capture_output=True)  # warm
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(cmd, env=tool_env(), capture_output=True)
            ts.append(time.perf_counter() - t0)
        out[label] = round(statistics.median(ts), 2)
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(cache: Path, caches_droppable: bool, why: str) -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    du = shutil.disk_usage(cache)
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    diff = _git("diff", "HEAD", "--", "ckpttools")
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for mod in ("torch", "deepspeed", "transformers", "safetensors", "psutil"):
        try:
            versions[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:  # noqa: PERF203 - five look-ups, once per benchmark
            versions[mod] = None
    ckpt_version = subprocess.run([str(ckpt_bin()), "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "nproc": os.cpu_count(),
        "nproc_available": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "ram_total_gib": round(vm.total / 2**30, 2),
        "ram_available_gib_at_start": round(vm.available / 2**30, 2),
        "disk": {"path": str(cache), "total_gb": round(du.total / 1e9, 1), "free_gb_at_start": round(du.free / 1e9, 1)},
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
        "caches_dropped": caches_droppable,
        "caches_drop_error": why or None,
        "versions": versions,
        "ckpt_version": ckpt_version,
        "ckpttools_git_head": _git("rev-parse", "HEAD"),
        "ckpttools_uncommitted_changes": bool(diff),
        "ckpttools_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
        "note": "the machine may be shared with other work; see loadavg per run",
    }


def ckpt_bin() -> Path:
    return Path(sys.executable).parent / "ckpt"


# ======================================================================================
# building checkpoints (worker runs under torchrun)
# ======================================================================================


def ckpt_name(size: str, stage: int) -> str:
    return f"{size}_z{stage}_dp{DP}"


def ds_config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        # smaller buckets than the defaults keep 4 ranks' transient buffers small; the saved layout
        # (fp32 partitions, flat groups) does not depend on them
        "reduce_bucket_size": 50_000_000,
        "allgather_bucket_size": 50_000_000,
    }
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": 20_000_000,
                "stage3_max_live_parameters": 100_000_000,
                # the optimizer step's temporaries scale with the sub-group; 1e9 (one sub-group per rank)
                # needs ~1.2 GiB more per rank at 774M. Also means >1 fp32 flat group per rank from 355M on.
                "sub_group_size": Z3_SUB_GROUP_SIZE,
            }
        )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": zero,
    }


def quiet_worker() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_engine(size: str, stage: int, cfg: dict[str, Any]) -> tuple[Any, Any, int]:
    """The benchmark's GPT-2 model in a DeepSpeed engine: (engine, GPT2Config, parameter count)."""
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(**SIZES[size])
    # Build directly in bf16 (4 ranks each holding an fp32 model would be wasteful). ZeRO-3 builds
    # under deepspeed.zero.Init, as the HF Trainer does, so no rank ever holds the whole model.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
                model = GPT2LMHeadModel(config)
        else:
            model = GPT2LMHeadModel(config)
    finally:
        torch.set_default_dtype(prev)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or ".ln_" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or ".ln_" in n]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, config, n_params


def build_worker(size: str, stage: int, out: Path) -> int:
    quiet_worker()
    import deepspeed
    import torch
    import torch.distributed as dist

    t0 = time.time()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    phases: dict[str, dict[str, float]] = {}

    def mark(phase: str) -> None:  # this rank's current and peak RSS, GiB
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        phases[phase] = {"rss_gib": round(rss / 2**30, 2), "peak_gib": round(peak / 2**30, 2)}

    mark("imported")
    cfg = ds_config(stage)
    engine, config, n_params = build_engine(size, stage, cfg)
    t_init = time.time()
    mark("initialized")
    g = torch.Generator().manual_seed(SEED + rank)
    ids = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    mark("backward")
    engine.step()
    t_step = time.time()
    mark("step")
    engine.save_checkpoint(str(out))
    t_save = time.time()
    mark("saved")
    all_phases = [None] * dist.get_world_size()
    dist.all_gather_object(all_phases, phases)
    if rank == 0:
        # as model.save_pretrained would: config.json names the architecture
        engine.module.config.architectures = [type(engine.module).__name__]
        engine.module.config.save_pretrained(str(out))
        meta = {
            "size": size,
            "zero_stage": stage,
            "dp": dist.get_world_size(),
            "dtype": "bf16",
            "optimizer": "torch.optim.AdamW (DS config AdamW, torch_adam=true)",
            "gpt2_config": SIZES[size] or "GPT2Config() defaults",
            "num_parameters": n_params,
            "seq_len": SEQ_LEN,
            "batch_per_rank": 1,
            "steps": 1,
            "loss": float(loss.float().item()),
            "tag": f"global_step{engine.global_steps}",
            "ds_config": cfg,
            "built_under_zero_init": stage == 3,
            "rank_memory_by_phase": all_phases,
            "seconds": {
                "init": round(t_init - t0, 1),
                "step": round(t_step - t_init, 1),
                "save": round(t_save - t_step, 1),
                "total_in_worker": round(t_save - t0, 1),
            },
        }
        (out / "bench_build.partial.json").write_text(json.dumps(meta, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def estimate_build_gib(size: str, stage: int) -> float:
    """Rough peak resident memory of the DP build ranks together (GiB), for the skip decision.

    Calibrated on the 124M/355M builds here (rank_memory_by_phase in bench_build.json): ~0.4 GiB of
    torch + DeepSpeed per rank, then ZeRO-2 ~8.6 B per model parameter per rank (the whole bf16 model
    and its grads live on every rank); ZeRO-3 ~18.5 B per element of the rank's partition (bf16 +
    fp32 master + fp32 grad + exp_avg + exp_avg_sq) plus ~12 B per element of one sub-group for the
    optimizer step's temporaries."""
    n = {"124M": 124.4e6, "355M": 354.8e6, "774M": 774.0e6}[size]
    if stage <= 2:
        per_rank = n * 8.6
    else:
        part = n / DP
        per_rank = part * 18.5 + min(part, Z3_SUB_GROUP_SIZE) * 12
    return DP * (0.4 + per_rank / 2**30)


def fix_config(folder: Path) -> None:
    """Older cached builds wrote config.json without `architectures` (model.save_pretrained sets it)."""
    cfg = folder / "config.json"
    data = json.loads(cfg.read_text())
    if not data.get("architectures"):
        data["architectures"] = ["GPT2LMHeadModel"]
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_checkpoint(size: str, stage: int, cache: Path, log_dir: Path, force_build: bool) -> dict[str, Any]:
    """Build (or reuse) the checkpoint; returns {"path", "meta"} or {"skipped": reason}."""
    import psutil

    name = ckpt_name(size, stage)
    final = cache / name
    meta_file = final / "bench_build.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        meta["reused"] = True
        fix_config(final)
        return {"path": final, "meta": meta}
    need = estimate_build_gib(size, stage)
    avail = psutil.virtual_memory().available / 2**30
    if need > 0.9 * avail and not force_build:
        return {
            "skipped": f"building {name} needs about {need:.1f} GiB for {DP} ranks (estimate), "
            f"{avail:.1f} GiB available; skipped (pass --force-build to try anyway)"
        }
    partial = cache / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    partial.mkdir(parents=True)
    log = log_dir / f"build_{name}.log"
    print(f"[build] {name}: torchrun x{DP} (log {log}) ...", flush=True)
    cmd = ds_launch.torchrun_cmd(DP, MODULE, ["_build", "--size", size, "--stage", stage, "--out", partial])
    with open(log, "wb") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        ds_launch.prebuild_ops(build_env())  # not timed: a first run's JIT build would race between ranks
        m = run_measured(cmd, env=build_env(), stdout=fh, cwd=cache)
    if m["returncode"] != 0:
        tail = log.read_text(errors="replace")[-3000:]
        shutil.rmtree(partial, ignore_errors=True)
        oom = m["returncode"] in (-9, 137) or "Killed" in tail or "out of memory" in tail.lower()
        reason = (
            f"building {name} failed (rc={m['returncode']}{', looks like out of memory' if oom else ''}; "
            f"peak RSS of the 4 ranks {m['peak_rss_tree'] / 2**30:.1f} GiB); see {log}"
        )
        print("[build] " + reason, flush=True)
        return {"skipped": reason, "log_tail": tail}
    meta = json.loads((partial / "bench_build.partial.json").read_text())
    (partial / "bench_build.partial.json").unlink()
    meta.update(
        {
            "build_wall_s": round(m["wall_s"], 1),
            "build_peak_rss_tree_gib": round(m["peak_rss_tree"] / 2**30, 2),
            "build_peak_rss_anon_tree_gib": round(m["peak_rss_anon_tree"] / 2**30, 2),
            "build_estimate_gib": round(need, 1),
            "built": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "files": {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()},
        }
    )
    meta["total_bytes"] = sum(meta["files"].values())
    (partial / "bench_build.json").write_text(json.dumps(meta, indent=1) + "\n")
    partial.rename(final)
    meta["reused"] = False
    print(
        f"[build] {name}: {m['wall_s']:.0f} s, peak RSS {m['peak_rss_tree'] / 2**30:.1f} GiB, "
        f"{meta['total_bytes'] / 1e9:.2f} GB on disk",
        flush=True,
    )
    return {"path": final, "meta": meta}


# ======================================================================================
# measuring a subprocess
# ======================================================================================


def _read_proc(pid: int) -> tuple[int, int, dict[str, int]]:
    """(VmRSS bytes, RssAnon bytes, /proc/<pid>/io counters) or raises OSError."""
    rss = anon = 0
    with open(f"/proc/{pid}/status") as fh:
        for ln in fh:
            if ln.startswith("VmRSS:"):
                rss = int(ln.split()[1]) * 1024
            elif ln.startswith("RssAnon:"):
                anon = int(ln.split()[1]) * 1024
    io: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/io") as fh:
            for ln in fh:
                k, v = ln.split(":")
                io[k] = int(v)
    except OSError:
        pass
    return rss, anon, io


def run_measured(
    cmd: list[str], env: dict[str, str], stdout: Any, cwd: Path | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run `cmd`, sampling its process tree every POLL_S; reap it with wait4 for exact rusage."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, cwd=cwd)
    done = threading.Event()
    peak = {"rss_tree": 0, "anon_tree": 0, "nproc": 0, "samples": 0}
    last_io: dict[int, dict[str, int]] = {}

    def poll() -> None:
        try:
            root = psutil.Process(p.pid)
        except psutil.Error:
            return
        while not done.is_set():
            try:
                pids = [p.pid] + [c.pid for c in root.children(recursive=True)]
            except psutil.Error:
                pids = [p.pid]
            rss = anon = 0
            for pid in pids:
                try:
                    r, a, io = _read_proc(pid)
                except (OSError, ValueError):
                    continue
                rss += r
                anon += a
                if io:
                    last_io[pid] = io
            peak["rss_tree"] = max(peak["rss_tree"], rss)
            peak["anon_tree"] = max(peak["anon_tree"], anon)
            peak["nproc"] = max(peak["nproc"], len(pids))
            peak["samples"] += 1
            done.wait(POLL_S)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if deadline is not None and time.monotonic() > deadline:
            p.kill()
        time.sleep(0.005)
    t1 = time.perf_counter()
    done.set()
    th.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    polled_read = sum(io.get("read_bytes", 0) for io in last_io.values())
    polled_write = sum(io.get("write_bytes", 0) for io in last_io.values())
    return {
        "returncode": p.returncode,
        "wall_s": t1 - t0,
        "peak_rss_tree": peak["rss_tree"],  # sampled every 20 ms, summed over the process tree
        "peak_rss_anon_tree": peak["anon_tree"],  # the anonymous (non file-backed) part of it
        "max_procs": peak["nproc"],
        "samples": peak["samples"],
        # exact, from the kernel, for the reaped process itself (largest of its reaped children included)
        "ru_maxrss": ru.ru_maxrss * 1024,
        # getrusage(RUSAGE_CHILDREN) is a running MAX over all children ever reaped: the delta is
        # only non-zero when this run set a new record, so it is kept raw for reference
        "rusage_children_maxrss_before": before.ru_maxrss * 1024,
        "rusage_children_maxrss_after": after.ru_maxrss * 1024,
        "read_bytes": ru.ru_inblock * 512,  # == /proc/<pid>/io read_bytes at exit
        "write_bytes": ru.ru_oublock * 512,  # == /proc/<pid>/io write_bytes at exit
        "read_bytes_polled": polled_read,  # last sample (may miss the final 20 ms)
        "write_bytes_polled": polled_write,
        "rchar_polled": sum(io.get("rchar", 0) for io in last_io.values()),  # read() syscalls (not mmap)
        "user_s": after.ru_utime - before.ru_utime,
        "sys_s": after.ru_stime - before.ru_stime,
        "loadavg1_before": load0,
        "loadavg1_after": os.getloadavg()[0],
    }


def dir_bytes(p: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(p.rglob("*")) if f.is_file()} if p.exists() else {}


# ======================================================================================
# the floor: read the fp32 master partitions, write an fp32-sized file
# ======================================================================================


class _Opaque:
    """Stands in for every class of the pickle that the floor does not need (torch, DeepSpeed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()

    def __setstate__(self, state: Any) -> None:
        pass


_ITEMSIZE = {
    "DoubleStorage": 8,
    "FloatStorage": 4,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "UntypedStorage": 1,
}


class _ProbeUnpickler(pickle.Unpickler):
    """Unpickles a torch.save pickle without torch and without loading storages: each tensor becomes
    {key, offset, shape, itemsize}. (The harness never imports torch: a forked child's ru_maxrss
    starts at its parent's high-water mark, so the parent must stay small.)"""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *a: {
                "_t": True,
                "key": storage[0],
                "itemsize": storage[1],
                "offset": int(offset),
                "shape": tuple(size),
            }
        if module == "torch._utils" and name.startswith("_rebuild_parameter"):
            return lambda data, *a: data
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return lambda func, t, args, state: func(*args)
        if module == "torch" and name in _ITEMSIZE:
            return ("storage", _ITEMSIZE[name])
        if module.split(".", maxsplit=1)[0] in ("torch", "deepspeed", "numpy", "argparse"):
            return _Opaque
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage_type, key, location, numel)
        st = pid[1]
        return (str(pid[2]), st[1] if isinstance(st, tuple) else 1)


def fp32_master_ranges(ckpt_dir: Path) -> list[tuple[Path, int, int]]:
    """(file, byte offset, byte count) of every fp32 master partition in the optimizer files:
    `single_partition_of_fp32_groups` (ZeRO-1/2) or `fp32_flat_groups` (ZeRO-3)."""
    tag = (ckpt_dir / "latest").read_text().strip()
    ranges = []
    for f in sorted((ckpt_dir / tag).glob("*_optim_states.pt")):
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            pkl = next(i for i in infos if i.filename.endswith("/data.pkl"))
            prefix = pkl.filename[: -len("data.pkl")]
            obj = _ProbeUnpickler(__import__("io").BytesIO(zf.read(pkl))).load()
            offsets = {}
            with open(f, "rb") as fh:
                for i in infos:
                    if i.filename.startswith(prefix + "data/"):
                        fh.seek(i.header_offset)
                        h = struct.unpack("<4s5H3L2H", fh.read(30))
                        offsets[i.filename[len(prefix) + 5 :]] = i.header_offset + 30 + h[-2] + h[-1]
        osd = obj["optimizer_state_dict"]
        groups = osd.get("fp32_flat_groups") if "fp32_flat_groups" in osd else osd["single_partition_of_fp32_groups"]
        for t in groups:
            n = 1
            for s in t["shape"]:
                n *= s
            ranges.append((f, offsets[t["key"]] + t["offset"] * t["itemsize"], n * t["itemsize"]))
    return ranges


def _read_chunks(ranges: list[tuple[Path, int, int]], mv: memoryview) -> Any:
    """Read the byte ranges in order, 16 MiB `preadv`s into `mv`; yields each chunk's length."""
    for path, off, n in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                k = os.preadv(fd, [mv[: min(len(mv), n - done)]], off + done)
                if k <= 0:
                    raise OSError(f"short read in {path}")
                yield k
                done += k
        finally:
            os.close(fd)


def run_floor(ranges: list[tuple[Path, int, int]], out_bytes: int, work: Path) -> dict[str, Any]:
    chunk = 16 << 20
    mv = memoryview(bytearray(chunk))
    t0 = time.perf_counter()
    nread = sum(_read_chunks(ranges, mv))
    t1 = time.perf_counter()
    zeros = bytes(chunk)
    target = work / "floor.bin"
    with open(target, "wb") as fh:  # no fsync, like the tools
        left = out_bytes
        while left > 0:
            left -= fh.write(zeros if left >= chunk else zeros[:left])
    t2 = time.perf_counter()
    target.unlink()
    return {
        "returncode": 0,
        "wall_s": t2 - t0,
        "read_s": t1 - t0,
        "write_s": t2 - t1,
        "read_bytes": nread,
        "write_bytes": out_bytes,
        "output_bytes": out_bytes,
        "loadavg1_before": os.getloadavg()[0],
    }


def run_copy_floor(ranges: list[tuple[Path, int, int]], work: Path) -> dict[str, Any]:
    """The same bytes copied chunk by chunk (16 MiB pread, then write) into one file, one thread:
    what a consolidation that only moves fp32 bytes must at least do, reads and writes interleaved
    the way the kernel's page cache and dirty-page throttling see them in the tools."""
    mv = memoryview(bytearray(16 << 20))
    target = work / "copy-floor.bin"
    t0 = time.perf_counter()
    total = 0
    with open(target, "wb") as out:
        for k in _read_chunks(ranges, mv):
            out.write(mv[:k])
            total += k
    t1 = time.perf_counter()
    target.unlink()
    return {
        "returncode": 0,
        "wall_s": t1 - t0,
        "read_bytes": total,
        "write_bytes": total,
        "output_bytes": total,
        "loadavg1_before": os.getloadavg()[0],
    }


# ======================================================================================
# comparing outputs
# ======================================================================================


def load_output(folder: Path) -> tuple[dict[str, Any], Any]:
    """Lazy view of a consolidated folder: ({key: getter}, closer)."""
    import torch
    from safetensors import safe_open

    getters: dict[str, Any] = {}
    handles = []
    for f in sorted(folder.glob("*.safetensors")):
        h = safe_open(str(f), framework="pt")
        handles.append(h)
        for k in h.keys():  # noqa: SIM118 - a safetensors handle is not a dict: keys() is its API
            getters[k] = lambda h=h, k=k: h.get_tensor(k)
    for f in sorted(folder.glob("*.bin")):
        sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        for k, v in sd.items():
            getters[k] = lambda v=v: v
    return getters, handles


def compare_outputs(ckpt_out: Path, ref_out: Path, cast_bf16: bool) -> dict[str, Any]:
    """Runs _compare in a child process: torch stays out of the harness (see _ProbeUnpickler)."""
    cmd = [sys.executable, "-m", MODULE, "_compare", str(ckpt_out), str(ref_out)]
    env = ds_launch.repository_on_path(tool_env())
    r = subprocess.run(cmd + (["--bf16"] if cast_bf16 else []), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {
            "identical": False,
            "error": r.stderr[-2000:],
            "compared_keys": 0,
            "num_differing": None,
            "differing": [],
            "only_in_ckpt": [],
            "only_in_zero_to_fp32": [],
            "against": "?",
        }
    return json.loads(r.stdout.strip().splitlines()[-1])


def _compare(ckpt_out: Path, ref_out: Path, cast_bf16: bool) -> dict[str, Any]:
    import torch

    a, _ha = load_output(ckpt_out)
    b, _hb = load_output(ref_out)
    common = [k for k in a if k in b]
    differing, dtype_mismatch = [], []
    for k in common:
        x, y = a[k](), b[k]()
        if cast_bf16 and y.is_floating_point() and y.dtype != torch.bfloat16:
            y = y.to(torch.bfloat16)
        if x.dtype != y.dtype:
            dtype_mismatch.append(f"{k}: {x.dtype} vs {y.dtype}")
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            differing.append(k)
    return {
        "identical": bool(common) and not differing,
        "compared_keys": len(common),
        "differing": differing[:20],
        "num_differing": len(differing),
        "dtype_mismatch": dtype_mismatch[:20],
        "only_in_ckpt": sorted(set(a) - set(b)),
        "only_in_zero_to_fp32": sorted(set(b) - set(a)),
        "against": "zero_to_fp32 fp32 cast to bf16 (round-to-nearest-even)" if cast_bf16 else "zero_to_fp32 fp32",
    }


# ======================================================================================
# the benchmark
# ======================================================================================


def z2f_cmd(ckpt: Path, out: Path, safe: bool) -> list[str]:
    return [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out)] + (
        ["--safe_serialization"] if safe else []
    )


def ckpt_cmd(ckpt: Path, out: Path, dtype: str) -> list[str]:
    cmd = [str(ckpt_bin()), "consolidate", str(ckpt), "--to", "safetensors", "--out", str(out), "--overwrite"]
    return cmd + (["--dtype", dtype] if dtype != "fp32" else [])


def bench_checkpoint(
    size: str,
    stage: int,
    ckpt: Path,
    meta: dict[str, Any],
    runs: int,
    work: Path,
    log_dir: Path,
    can_drop: bool,
    prewarm: bool,
) -> dict[str, Any]:
    name = ckpt_name(size, stage)
    work.mkdir(parents=True, exist_ok=True)
    env = tool_env()
    entry: dict[str, Any] = {
        "name": name,
        "size": size,
        "zero_stage": stage,
        "checkpoint": str(ckpt),
        "num_parameters": meta.get("num_parameters"),
        "build": meta,
        "runs": {t: [] for t in TOOLS},
    }
    ranges = fp32_master_ranges(ckpt)
    fp32_bytes = sum(n for _, _, n in ranges)
    entry["fp32_master_bytes"] = fp32_bytes
    entry["optim_files_bytes"] = sum(v for k, v in meta.get("files", {}).items() if k.endswith("_optim_states.pt"))

    # Which zero_to_fp32 form runs: --safe_serialization first, as its docs suggest.
    probe_out = work / f"{name}.z2f-probe"
    log = log_dir / f"{name}.zero_to_fp32.probe.log"
    with open(log, "wb") as fh:
        pm = run_measured(z2f_cmd(ckpt, probe_out, True), env, fh)
    probe_text = log.read_text(errors="replace")
    shutil.rmtree(probe_out, ignore_errors=True)
    safe_ok = pm["returncode"] == 0
    err = next((ln.strip() for ln in reversed(probe_text.splitlines()) if "Error" in ln or "share memory" in ln), "")
    entry["zero_to_fp32_probe"] = {
        "form": "--safe_serialization",
        "returncode": pm["returncode"],
        "wall_s": pm["wall_s"],
        "error": None if safe_ok else err[:400],
    }
    entry["zero_to_fp32_form"] = (
        "python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization"
        if safe_ok
        else "python -m deepspeed.utils.zero_to_fp32 CKPT OUT  (pytorch_model.bin; --safe_serialization crashed)"
    )
    print(f"[{name}] zero_to_fp32 --safe_serialization: {'ok' if safe_ok else 'FAILED: ' + err[:160]}", flush=True)

    cmds = {
        "ckpt-fp32": lambda o: ckpt_cmd(ckpt, o, "fp32"),
        "ckpt-bf16": lambda o: ckpt_cmd(ckpt, o, "bf16"),
        "zero_to_fp32": lambda o: z2f_cmd(ckpt, o, safe_ok),
    }
    keep = {t: work / f"{name}.keep.{t}" for t in cmds}
    for d in keep.values():
        shutil.rmtree(d, ignore_errors=True)

    if not can_drop:  # one unrecorded warm-up per tool so every recorded run sees the same warm cache
        for tool, mk in cmds.items():
            o = work / f"{name}.warmup.{tool}"
            with open(log_dir / f"{name}.{tool}.warmup.log", "wb") as fh:
                run_measured(mk(o), env, fh)
            shutil.rmtree(o, ignore_errors=True)

    for r in range(runs):
        # rotate the order each round, so no tool always follows the same one (e.g. the deletion of
        # zero_to_fp32's output, whose ext4 discards land on whatever runs next)
        order = TOOLS[r % len(TOOLS) :] + TOOLS[: r % len(TOOLS)]
        for pos, tool in enumerate(order):
            os.sync()
            time.sleep(SETTLE_S)  # let write-back and discards of the previous run's deleted output finish
            dropped = drop_caches()[0] if can_drop else False
            warm_s = prewarm_software() if dropped and prewarm else None
            if tool == "floor":
                m = run_floor(ranges, fp32_bytes, work)
            elif tool == "copy-floor":
                m = run_copy_floor(ranges, work)
            else:
                o = work / f"{name}.{tool}" if r < runs - 1 else keep[tool]
                shutil.rmtree(o, ignore_errors=True)
                with open(log_dir / f"{name}.{tool}.run{r}.log", "wb") as fh:
                    m = run_measured(cmds[tool](o), env, fh)
                m["files"] = dir_bytes(o)
                m["output_bytes"] = sum(v for k, v in m["files"].items() if k.endswith((".safetensors", ".bin")))
                if m["returncode"] != 0:
                    m["log_tail"] = (log_dir / f"{name}.{tool}.run{r}.log").read_text(errors="replace")[-2000:]
                if r < runs - 1:
                    shutil.rmtree(o, ignore_errors=True)
            m["run"] = r
            m["position_in_round"] = pos
            m["cache_dropped"] = dropped
            m["software_prewarm_s"] = warm_s
            entry["runs"][tool].append(m)
            print(
                f"[{name}] run {r} {tool:13s} {m['wall_s']:7.2f} s"
                + (
                    f"  peak RSS {m['peak_rss_tree'] / MB:7.0f} MB  read {m['read_bytes'] / MB:7.0f} MB"
                    f"  written {m['write_bytes'] / MB:7.0f} MB  rc={m['returncode']}"
                    if tool not in FLOORS
                    else f"  (read {m['read_s']:.2f} s + write {m['write_s']:.2f} s)"
                    if tool == "floor"
                    else ""
                ),
                flush=True,
            )

    ident: dict[str, Any] = {}
    if keep["zero_to_fp32"].exists():
        if keep["ckpt-fp32"].exists():
            ident["ckpt-fp32"] = compare_outputs(keep["ckpt-fp32"], keep["zero_to_fp32"], cast_bf16=False)
        if keep["ckpt-bf16"].exists():
            ident["ckpt-bf16"] = compare_outputs(keep["ckpt-bf16"], keep["zero_to_fp32"], cast_bf16=True)
    entry["identical"] = ident
    for t, v in ident.items():
        print(
            f"[{name}] {t} identical to zero_to_fp32: {v['identical']} ({v['compared_keys']} keys; "
            f"only in ckpt {v['only_in_ckpt']}, only in zero_to_fp32 {v['only_in_zero_to_fp32']})",
            flush=True,
        )
    for d in keep.values():
        shutil.rmtree(d, ignore_errors=True)
    return entry


# ======================================================================================
# summarising
# ======================================================================================


def summarise(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool, runs in entry.get("runs", {}).items():
        ok = [r for r in runs if r.get("returncode") == 0]
        if not ok:
            continue

        def med(key: str) -> float | None:
            vals = [r[key] for r in ok if r.get(key) is not None]  # noqa: B023 - called in this iteration only
            return statistics.median(vals) if vals else None

        s = {
            "n": len(ok),
            "failed": len(runs) - len(ok),
            "time_s": med("wall_s"),
            "time_min_s": min(r["wall_s"] for r in ok),
            "time_max_s": max(r["wall_s"] for r in ok),
            "peak_rss": med("peak_rss_tree"),
            "peak_anon": med("peak_rss_anon_tree"),
            "ru_maxrss": med("ru_maxrss"),
            "read_bytes": med("read_bytes"),
            "write_bytes": med("write_bytes"),
            "output_bytes": med("output_bytes"),
            "user_s": med("user_s"),
            "sys_s": med("sys_s"),
        }
        s["throughput"] = s["output_bytes"] / s["time_s"] if s["output_bytes"] and s["time_s"] else None
        if tool == "floor":  # a tool that reads and writes at once can beat read + write
            s["overlapped_s"] = statistics.median(max(r["read_s"], r["write_s"]) for r in ok)
        out[tool] = s
    z, fl, cf = out.get("zero_to_fp32"), out.get("floor"), out.get("copy-floor")
    for tool, s in out.items():
        s["time_ratio"] = s["time_s"] / z["time_s"] if z and tool not in FLOORS else None
        s["mem_ratio"] = (s["peak_rss"] / z["peak_rss"]) if z and s.get("peak_rss") and tool not in FLOORS else None
        s["x_floor"] = s["time_s"] / fl["time_s"] if fl else None
        s["x_floor_overlapped"] = s["time_s"] / fl["overlapped_s"] if fl else None
        s["x_copy_floor"] = s["time_s"] / cf["time_s"] if cf else None
    return out


def _f(v: Any, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if v is None else fmt.format(v)


def render_markdown(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    lines = [
        "# `ckpt consolidate` vs DeepSpeed `zero_to_fp32`",
        "",
        f"Command: `{results.get('command', '')}`  ",
        (
            f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}), {m.get('ram_total_gib')} GiB RAM, "
            f"disk {m.get('disk', {}).get('free_gb_at_start')} GB free of {m.get('disk', {}).get('total_gb')} GB; "
            f"page cache dropped before every run: **{'yes' if m.get('caches_dropped') else 'no (warm cache, one warm-up run per tool)'}**; "
            f"shared machine (load average at start {_f((m.get('loadavg_at_start') or [None])[0])}).  "
        ),
        (
            f"Versions: {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}; {m.get('ckpt_version')} "
            f"(git {str(m.get('ckpttools_git_head'))[:10]}{', with uncommitted changes in ckpttools/' if m.get('ckpttools_uncommitted_changes') else ''}; "
            f"source sha256 {(m.get('ckpttools_snapshot') or {}).get('sha256_16')}, snapshotted at start)."
        ),
        (
            "After each cache drop the Python packages both tools import were read back in (`--no-prewarm` turns this off), "
            "so runs see a cold checkpoint and a warm software install. "
            if m.get("software_prewarmed_after_drop")
            else ""
        )
        + "Warm start-up alone (s): "
        + ", ".join(f"`{k}` {v}" for k, v in (m.get("startup_s_warm") or {}).items())
        + ".",
        "",
        (
            "Checkpoints: GPT-2 from config, bf16, torch AdamW, DP 4 (gloo, CPU), one step, `engine.save_checkpoint` + config.json. "
            "Median of the runs; peak RSS = largest sampled sum of RSS over the process tree (20 ms); "
            "read/written = storage-layer bytes of the process (`read_bytes`/`write_bytes`); throughput = output bytes / time; "
            "ratios are ckpt / zero_to_fp32 (< 1 is better); x floor = time / floor time, where floor = time to read the "
            "fp32 master partitions (cold), then to write an fp32-sized file, in-process (no Python start-up); x copy floor = time / time to copy those same bytes chunk by chunk (16 MiB pread, write) "
            "into one file in one thread, reads and writes interleaved as in the tools."
        ),
        "",
        (
            "| model | ZeRO | tool | median time s | min–max s | peak RSS MB | peak anon MB | ru_maxrss MB | read MB | written MB "
            "| throughput MB/s | time ratio vs zero_to_fp32 | memory ratio | x floor | x copy floor | identical |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results.get("checkpoints", []):
        if e.get("skipped"):
            lines.append(f"| {e['size']} | {e['zero_stage']} | *skipped* | see notes ||||||||||||| |")
            continue
        summ = summarise(e)
        for tool in TOOLS:
            s = summ.get(tool)
            if not s:
                continue
            if tool == "floor":
                label, ident = "floor (read fp32 masters, then write fp32 file)", "–"
            elif tool == "copy-floor":
                label, ident = "copy floor (fp32 masters copied chunk by chunk)", "–"
            elif tool == "zero_to_fp32":
                safe = e.get("zero_to_fp32_probe", {}).get("returncode") == 0
                label, ident = ("zero_to_fp32 " + ("--safe_serialization" if safe else "(.bin)")), "reference"
            else:
                label = tool.replace("ckpt-", "ckpt ")
                iv = e.get("identical", {}).get(tool)
                ident = "–" if iv is None else ("yes" if iv["identical"] else f"**no** ({iv['num_differing']} differ)")
            floor = tool in FLOORS
            rss = "–" if floor else _f(s["peak_rss"] / MB, "{:,.0f}")
            maxrss = "–" if floor else _f(s["ru_maxrss"] / MB, "{:,.0f}")
            anon = "–" if floor else _f(s["peak_anon"] / MB, "{:,.0f}")
            thr = _f(s["throughput"] and s["throughput"] / MB, "{:,.0f}")
            lines.append(
                f"| {e['size']} | {e['zero_stage']} | {label} | {_f(s['time_s'])} | {_f(s['time_min_s'])}–{_f(s['time_max_s'])} | {rss} | {anon} | {maxrss} "
                f"| {_f(s['read_bytes'] / MB, '{:,.0f}')} | {_f(s['write_bytes'] / MB, '{:,.0f}')} | {thr} "
                f"| {_f(s['time_ratio'])} | {_f(s['mem_ratio'])} | {_f(s['x_floor'])} | {_f(s['x_copy_floor'])} | {ident} |"
            )
    lines += ["", "## Notes", ""]
    for e in results.get("checkpoints", []):
        if e.get("skipped"):
            lines.append(f"- **{e['name']}**: {e['skipped']}")
            continue
        b = e.get("build", {})
        probe = e.get("zero_to_fp32_probe", {})
        lines.append(
            f"- **{e['name']}**: {e.get('num_parameters', 0) / 1e6:.1f} M params, checkpoint {b.get('total_bytes', 0) / 1e9:.2f} GB "
            f"(fp32 masters {e['fp32_master_bytes'] / 1e9:.2f} GB); built in {b.get('build_wall_s')} s "
            f"(peak {b.get('build_peak_rss_tree_gib')} GiB for 4 ranks){' (reused)' if b.get('reused') else ''}. "
            f"zero_to_fp32 --safe_serialization: {'ok' if probe.get('returncode') == 0 else 'crashed (' + str(probe.get('error')) + ')'}; "
            f"timed form: `{e.get('zero_to_fp32_form')}`."
        )
        for tool, iv in e.get("identical", {}).items():
            lines.append(
                f"  - {tool} vs {iv['against']}: {'identical' if iv['identical'] else 'DIFFERENT'} on {iv['compared_keys']} common keys; "
                f"only in ckpt: {iv['only_in_ckpt'] or 'none'}; only in zero_to_fp32: {iv['only_in_zero_to_fp32'] or 'none'}"
                + (f"; differing: {iv['differing']}" if iv["differing"] else "")
            )
    lines.append("")
    return "\n".join(lines)


def ensure_matplotlib() -> bool:
    try:
        import matplotlib

        return True
    except ImportError:
        pass
    print("[plot] installing matplotlib into the virtualenv ...", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"])
    if r.returncode != 0:
        return False
    import importlib

    importlib.invalidate_caches()
    try:
        import matplotlib  # noqa: F401

        return True
    except ImportError:
        return False


def render_plot(results: dict[str, Any], path: Path) -> bool:
    if not ensure_matplotlib():
        print("[plot] matplotlib unavailable; no plot", flush=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {
        "ckpt-fp32": ("tab:blue", "o"),
        "ckpt-bf16": ("tab:green", "s"),
        "zero_to_fp32": ("tab:red", "^"),
        "floor": ("gray", "x"),
        "copy-floor": ("black", "+"),
    }
    by_stage: dict[int, list[tuple[float, dict]]] = {}
    for e in results.get("checkpoints", []):
        if e.get("skipped") or not e.get("num_parameters"):
            continue
        by_stage.setdefault(e["zero_stage"], []).append((e["num_parameters"] / 1e6, summarise(e)))
    for stage, pts in sorted(by_stage.items()):
        pts.sort(key=lambda p: p[0])
        ls = "-" if stage == 3 else "--"
        for tool, (color, marker) in styles.items():
            xs = [x for x, s in pts if tool in s]
            if not xs:
                continue
            ts = [s[tool]["time_s"] for _, s in pts if tool in s]
            ax_t.plot(xs, ts, ls, color=color, marker=marker, label=f"{tool} ZeRO-{stage}")
            if tool not in FLOORS:
                ms = [s[tool]["peak_rss"] / MB for _, s in pts if tool in s]
                ax_m.plot(xs, ms, ls, color=color, marker=marker, label=f"{tool} ZeRO-{stage}")
    ax_m.set_yscale("log")
    for ax, title, yl in (
        (ax_t, "consolidation time (median, cold cache)", "seconds"),
        (ax_m, "peak resident memory (process tree, log scale)", "MB"),
    ):
        ax.set_title(title)
        ax.set_xlabel("model parameters (M)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    m = results.get("machine", {})
    fig.suptitle(
        f"ckpt consolidate vs zero_to_fp32 — GPT-2, DP 4, bf16; {m.get('nproc')} CPUs, "
        f"{m.get('ram_total_gib')} GiB RAM, caches {'dropped' if m.get('caches_dropped') else 'warm'}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_reports(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for e in results.get("checkpoints", []):
        if not e.get("skipped"):
            e["summary"] = summarise(e)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(render_markdown(results))
    # matplotlib in a child process too: the harness stays small (see _ProbeUnpickler)
    subprocess.run([sys.executable, "-m", MODULE, "_plot", str(out)], env=ds_launch.repository_on_path(os.environ),
                   check=False)  # fmt: skip


# ======================================================================================
# main
# ======================================================================================


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_plot":
        out = Path(argv[1])
        return 0 if render_plot(json.loads((out / "results.json").read_text()), out / "consolidate.png") else 1
    if argv and argv[0] == "_compare":
        print(json.dumps(_compare(Path(argv[1]), Path(argv[2]), "--bf16" in argv)))
        return 0
    if argv and argv[0] == "_build":
        ap = argparse.ArgumentParser()
        ap.add_argument("_build")
        ap.add_argument("--size", required=True)
        ap.add_argument("--stage", type=int, required=True)
        ap.add_argument("--out", required=True)
        a = ap.parse_args(argv)
        return build_worker(a.size, a.stage, Path(a.out))

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="124M,355M,774M", help=f"comma list of {','.join(SIZES)}")
    ap.add_argument("--stages", default="2,3", help="comma list of ZeRO stages (2, 3)")
    ap.add_argument("--only", default="", help="comma list of SIZE:STAGE to restrict to, e.g. 774M:3")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where checkpoints are built and reused")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoints, measure nothing")
    ap.add_argument("--force-build", action="store_true", help="build even when the memory estimate says it won't fit")
    ap.add_argument("--fresh", action="store_true", help="start a new results.json instead of merging into it")
    ap.add_argument(
        "--no-prewarm",
        action="store_true",
        help="after dropping the page cache, do NOT re-read the Python packages (fully cold runs)",
    )
    ap.add_argument(
        "--live-code", action="store_true", help="run the working tree's ckpttools instead of a snapshot taken at start"
    )
    ap.add_argument("--render-only", action="store_true", help="re-render results.md and the plot from results.json")
    a = ap.parse_args(argv)

    out = a.out.resolve()
    if a.render_only:
        write_reports(json.loads((out / "results.json").read_text()), out)
        print(f"wrote {out / 'results.md'} and {out / 'consolidate.png'}")
        return 0

    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown size(s) {bad}; known: {list(SIZES)}")
    stages = [int(s) for s in a.stages.split(",") if s.strip()]
    if any(s not in (2, 3) for s in stages):
        ap.error("--stages takes 2 and/or 3")
    only = {tuple(x.split(":")) for x in a.only.split(",") if x.strip()}
    configs = [
        (sz, st) for sz in sorted(sizes, key=list(SIZES).index) for st in stages if not only or (sz, str(st)) in only
    ]

    cache = a.cache.expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if cache == REPO or REPO in cache.parents:
        print(f"warning: cache {cache} is inside the repository", file=sys.stderr)
    # run everything from outside the repository: `python -c` / `-m` import from the cwd first,
    # which would shadow the ckpttools snapshot with the working tree's
    os.chdir(cache)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = cache / "logs" / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    work = cache / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    can_drop, why = drop_caches()
    print(
        f"page cache drop: {'permitted' if can_drop else 'NOT permitted (' + why + '); caches stay warm, one warm-up per tool'}",
        flush=True,
    )
    if not a.live_code and not a.build_only:
        snap = snapshot_ckpttools(cache / "code-snapshot")
    else:
        snap = {"path": None, "sha256_16": source_hash(REPO / "ckpttools"), "live": True}
    machine = machine_info(cache, can_drop, why)
    machine["ckpttools_snapshot"] = snap
    machine["software_prewarmed_after_drop"] = can_drop and not a.no_prewarm
    if not a.build_only:
        print("measuring warm start-up costs ...", flush=True)
        machine["startup_s_warm"] = startup_costs()
        print(json.dumps(machine["startup_s_warm"]), flush=True)
    command = f"python -m {MODULE} " + " ".join(argv)
    results: dict[str, Any] = {"command": command.strip(), "machine": machine, "checkpoints": []}
    if not a.fresh and (out / "results.json").is_file():
        old = json.loads((out / "results.json").read_text())
        keep = [e for e in old.get("checkpoints", []) if (e["size"], e["zero_stage"]) not in configs]
        if keep:
            results["checkpoints"] = keep
            results["merged_from_earlier_runs"] = sorted({e.get("run_command", old.get("command", "")) for e in keep})
            for e in keep:
                e.setdefault("run_command", old.get("command"))
                e.setdefault("machine_at_run", old.get("machine"))

    for size, stage in configs:
        t0 = time.time()
        b = build_checkpoint(size, stage, cache, log_dir, a.force_build)
        if "skipped" in b:
            print(f"[build] {ckpt_name(size, stage)}: {b['skipped']}", flush=True)
            if a.build_only:
                continue
            entry = {
                "name": ckpt_name(size, stage),
                "size": size,
                "zero_stage": stage,
                "skipped": b["skipped"],
                "run_command": command.strip(),
            }
        elif a.build_only:
            continue
        else:
            entry = bench_checkpoint(
                size, stage, b["path"], b["meta"], a.runs, work, log_dir, can_drop, not a.no_prewarm
            )
            entry["run_command"] = command.strip()
            entry["bench_wall_s"] = round(time.time() - t0, 1)
        results["checkpoints"] = [e for e in results["checkpoints"] if e["name"] != entry["name"]] + [entry]
        results["checkpoints"].sort(key=lambda e: (list(SIZES).index(e["size"]), e["zero_stage"]))
        machine["loadavg_at_end"] = os.getloadavg()
        machine["harness_ru_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        write_reports(results, out)  # after every checkpoint, so a long run leaves partial results
    shutil.rmtree(work, ignore_errors=True)
    if not a.build_only:
        write_reports(results, out)
        print((out / "results.md").read_text())
        print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'consolidate.png'}; logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build small REAL DeepSpeed ZeRO checkpoints on CUDA GPUs (fp16 with dynamic loss
scaling + DeepSpeed FusedAdam, and bf16 with the optimizer offloaded to CPU ->
DeepSpeedCPUAdam): things a CPU-only machine cannot produce.

Meant to run ON a machine with 2 (or 1) NVIDIA GPUs, DeepSpeed importable, nvcc and a
C++ compiler (DeepSpeed JIT-builds its ``fused_adam`` and ``cpu_adam`` ops)::

    python scripts/make_gpu_fixtures.py --out /tmp/gpu_fixtures [--jobs 4] [--only NAME ...]

Same toy model, data, param groups and reference layout as the CPU fixtures
(``scripts/fixture_worker.py``, imported, not copied), with these differences:
3 training steps (tag ``global_step3``), nccl backend, DS_ACCELERATOR=cuda, inputs moved
to the GPU, and meta.json gets ``device``, ``gpu_name``, ``skipped_steps``,
``loss_scale`` (the loss scaler's ``cur_scale`` at save time), ``loss_scaler`` (class and
attributes) and ``per_step`` (loss, overflow, scale after each step).

Fixtures (``<dp>`` = 2 with 2+ GPUs, else 1; ``--dp`` overrides):
``gpu_z{2,3}_dp<dp>_fp16`` (fp16 block ``FP16_BLOCK``: dynamic scaling from 2**8 with
``loss_scale_window`` 2, so the scale doubles to 512 after step 3; no overflow),
``gpu_z{2,3}_dp<dp>_fp16_overflow`` (``FP16_OVERFLOW_BLOCK``: 2**20 and hysteresis 1, so the
first steps overflow and are skipped; trained until 2 steps were really taken) and
``gpu_z{2,3}_dp<dp>_bf16_offload`` (``offload_optimizer: cpu`` -> DeepSpeedCPUAdam).

Modes: (default) driver; ``worker`` (under torchrun, one rank per GPU); ``prebuild``
(JIT-build one DeepSpeed op so the ranks find it cached).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ["DS_ACCELERATOR"] = os.environ.get("GPU_FIXTURES_ACCELERATOR", "cuda")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ds_launch  # noqa: E402
import fixture_worker as fw  # noqa: E402  (ToyModel, decay_groups, reference writers)

STEPS = 3
Z3_SUB_GROUP_SIZE = 64
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
FP16_BLOCK = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 8,
    # so that the dynamic scaler moves within 3 clean steps (256 -> 512 after step 3)
    "loss_scale_window": 2,
}
FP16_OVERFLOW_BLOCK = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "hysteresis": 1}
MAX_STEPS = 40


def specs(dp: int) -> dict[str, dict]:
    out = {}
    for stage in (2, 3):
        for dtype, offload in (("fp16", False), ("bf16", True)):
            name = f"gpu_z{stage}_dp{dp}_{dtype}" + ("_offload" if offload else "")
            s: dict[str, Any] = {
                "kind": "engine",
                "name": name,
                "zero_stage": stage,
                "dp": dp,
                "dtype": dtype,
                "torch_adam": False,
                "offload": offload,
            }
            if stage == 3:
                s["sub_group_size"] = Z3_SUB_GROUP_SIZE
            out[name] = s
    # fp16 with an initial scale that overflows: the first steps are skipped (skipped_steps > 0,
    # Adam step < global_steps); trained until 2 steps were really taken.
    for stage in (2, 3):
        name = f"gpu_z{stage}_dp{dp}_fp16_overflow"
        s = {
            "kind": "engine",
            "name": name,
            "zero_stage": stage,
            "dp": dp,
            "dtype": "fp16",
            "torch_adam": False,
            "offload": False,
            "fp16_block": dict(FP16_OVERFLOW_BLOCK),
            "min_good_steps": 2,
            "notes": "fp16 with initial_scale_power 20 and hysteresis 1: the first steps overflow and "
            "are skipped (scale halves each time) until 2 steps are taken; see per_step.",
        }
        if stage == 3:
            s["sub_group_size"] = Z3_SUB_GROUP_SIZE
        out[name] = s
    return out


def ds_config(spec: dict) -> dict:
    cfg = fw.ds_config_for(spec)  # identical to the CPU fixtures' config ...
    if spec["dtype"] == "fp16":  # ... except the fp16 block
        cfg["fp16"] = dict(spec.get("fp16_block") or FP16_BLOCK)
    if spec.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


# --------------------------------------------------------------------------------------
# worker (one rank)
# --------------------------------------------------------------------------------------


def scaler_info(opt) -> dict:
    ls = getattr(opt, "loss_scaler", None)
    info: dict[str, Any] = {"wrapper_cur_scale": float(opt.cur_scale) if hasattr(opt, "cur_scale") else None}
    if ls is not None:
        info["class"] = f"{type(ls).__module__}.{type(ls).__name__}"
        attrs = {}
        for k, v in vars(ls).items():
            if isinstance(v, (int, float, bool, str)) or v is None:
                attrs[k] = v
            else:
                attrs[k] = repr(v)
        info["attributes"] = attrs
    return info


def run_worker(spec: dict, out: Path) -> None:
    import deepspeed
    import torch

    fw.quiet_loggers()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        backend = "nccl"
    else:  # local smoke test only
        backend = "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    fw.quiet_loggers()
    r = fw.rank()
    torch.manual_seed(fw.SEED)
    model = fw.ToyModel()
    decay, no_decay = fw.decay_groups(model.named_parameters())
    groups = [
        {"params": [p for _, p in decay], "weight_decay": 0.01},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    groups_named = [[n for n, _ in decay], [n for n, _ in no_decay]]
    cfg = ds_config(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    fw.quiet_loggers()

    g = torch.Generator().manual_seed(fw.SEED + 1000 * (r + 1))
    per_step = []
    i = -1
    while True:
        i += 1
        good = engine.global_steps - engine.skipped_steps
        if i >= STEPS and good >= spec.get("min_good_steps", 0):
            break
        if i >= MAX_STEPS:
            raise RuntimeError(f"only {good} good steps after {MAX_STEPS}")
        ids = torch.randint(0, fw.VOCAB, (4, 6), generator=g).to(engine.device)
        targets = torch.randint(0, fw.VOCAB, (4, 6), generator=g).to(engine.device)
        loss = engine(ids, targets)
        engine.backward(loss)
        scale_before = float(getattr(engine.optimizer, "cur_scale", 1.0))
        engine.step()
        per_step.append(
            {
                "step": i + 1,
                "loss_rank0_unscaled": float(loss.item()),
                "scale_used": scale_before,
                "overflow": bool(getattr(engine.optimizer, "overflow", False)),
                "scale_after": float(getattr(engine.optimizer, "cur_scale", 1.0)),
                "skipped_steps_after": int(engine.skipped_steps),
            }
        )

    ckpt = out / "checkpoint"
    engine.save_checkpoint(str(ckpt))
    tag = f"global_step{engine.global_steps}"
    fw.write_engine_references(engine, out / "reference", spec["zero_stage"])

    if r == 0:
        import deepspeed.comm as dcomm

        meta = {
            "name": spec["name"],
            "kind": "engine",
            "zero_stage": spec["zero_stage"],
            "dp": spec["dp"],
            "dtype": spec["dtype"],
        }
        meta.update(fw.common_meta(engine))
        if spec["zero_stage"] == 3:
            meta["sub_group_size"] = spec["sub_group_size"]
        eg, sub = fw.engine_param_groups(engine)
        if [sorted(x) for x in eg] != [sorted(x) for x in groups_named]:
            raise RuntimeError(f"engine param groups {eg} differ from client groups {groups_named}")
        meta.update(fw.model_facts(engine.module, eg))
        if sub is not None:
            meta["sub_groups"] = sub
        meta["param_group_weight_decay"] = [x["weight_decay"] for x in engine.optimizer.optimizer.param_groups]
        meta["tag"] = tag
        meta["global_steps"] = engine.global_steps
        meta["elastic_checkpoint"] = False
        meta["bf16_optimizer"] = type(engine.optimizer).__name__ == "BF16_Optimizer"
        meta["offload_optimizer"] = bool(spec.get("offload"))
        meta["ds_config"] = cfg
        meta.update(fw.inspect_optim_file(ckpt / tag))
        meta["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        meta["gpu_name"] = torch.cuda.get_device_name(local) if torch.cuda.is_available() else None
        meta["gpu_count_visible"] = torch.cuda.device_count()
        meta["cuda_version"] = torch.version.cuda
        meta["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        meta["dist_backend"] = dcomm.get_backend() if hasattr(dcomm, "get_backend") else backend
        meta["steps"] = len(per_step)
        meta["skipped_steps"] = int(engine.skipped_steps)
        meta["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", 1.0))
        meta["loss_scaler"] = scaler_info(engine.optimizer)
        meta["per_step"] = per_step
        meta["notes"] = spec.get("notes", "")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


# --------------------------------------------------------------------------------------
# prebuild one op (JIT) so the ranks only load it
# --------------------------------------------------------------------------------------


def run_prebuild(op: str) -> None:
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

    b = {"fused_adam": FusedAdamBuilder, "cpu_adam": CPUAdamBuilder}[op]()
    t = time.time()
    b.load(verbose=True)
    print(f"prebuild {op}: ok in {time.time() - t:.1f}s", flush=True)


# --------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------


def _env() -> dict:
    # two BLAS threads per rank (one rank per GPU); never NVLink multicast on the lent machines
    return ds_launch.worker_env(os.environ["DS_ACCELERATOR"], threads=2, NCCL_NVLS_ENABLE="0",
                                TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")  # fmt: skip


def _run(cmd: list[str], log: Path, timeout: int = 420) -> None:
    with open(log, "ab") as fh:
        fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), timeout=timeout, cwd=str(HERE.parent))
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-5000:]
        raise RuntimeError(f"command failed (rc={r.returncode}): {' '.join(cmd)}\n--- log tail ---\n{tail}")


def make_one(spec: dict, out_dir: Path, log_dir: Path) -> Path:
    name = spec["name"]
    fdir = out_dir / name
    if fdir.exists():
        shutil.rmtree(fdir)
    (fdir / "reference").mkdir(parents=True)
    log = log_dir / f"{name}.log"
    tmp = Path(tempfile.mkdtemp(prefix=f"gpufix_{name}_"))
    try:
        _run(ds_launch.torchrun_cmd(spec["dp"], Path(__file__).resolve(), ["worker", "--spec", json.dumps(spec),
                                                                          "--out", str(fdir)]), log)  # fmt: skip
        meta = json.loads((fdir / "meta.partial.json").read_text())
        (fdir / "meta.partial.json").unlink()
        ckpt = fdir / "checkpoint"
        info_file = tmp / "zero2fp32.json"
        _run(
            [
                sys.executable,
                str(HERE / "fixture_worker.py"),
                "zero2fp32",
                "--ckpt",
                str(ckpt),
                "--out",
                str(fdir / "reference" / "zero_to_fp32.safetensors"),
                "--info",
                str(info_file),
            ],
            log,
        )
        info = json.loads(info_file.read_text())
        meta["zero_to_fp32"] = {
            "ok": info["ok"],
            "source": "checkpoint",
            **({"error": info["error"]} if not info["ok"] else {}),
            **(
                {"dtypes": info["dtypes"], "aliased_in_api_output": info["aliased_in_api_output"]} if info["ok"] else {}
            ),
        }
        removed = []
        for p in sorted(fdir.rglob("*")):
            if p.name in RECOVERY_SCRIPTS and p.is_file():
                removed.append(str(p.relative_to(fdir)))
                p.unlink()
        meta["removed_files"] = removed
        meta["references"] = sorted(p.name for p in (fdir / "reference").iterdir())
        meta["generator"] = "scripts/make_gpu_fixtures.py"
        ordered = {k: meta[k] for k in ("name", "zero_stage", "dp", "dtype", "optimizer") if k in meta}
        ordered.update(meta)
        (fdir / "meta.json").write_text(json.dumps(ordered, indent=1, default=str) + "\n")
    except BaseException:
        shutil.rmtree(fdir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return fdir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="driver", choices=["driver", "worker", "prebuild"])
    ap.add_argument("--out", default="gpu_fixtures")
    ap.add_argument("--spec")
    ap.add_argument("--op")
    ap.add_argument("--only", nargs="+")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--dp", type=int, help="default: min(2, visible GPUs)")
    ap.add_argument("--no-prebuild", action="store_true")
    a = ap.parse_args(argv)

    if a.mode == "worker":
        run_worker(json.loads(a.spec), Path(a.out).resolve())
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    if a.mode == "prebuild":
        run_prebuild(a.op)
        return 0

    import torch

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "_logs"
    log_dir.mkdir(exist_ok=True)
    ngpu = torch.cuda.device_count()
    dp = a.dp or max(1, min(2, ngpu))
    sp = specs(dp)
    names = a.only or list(sp)
    t0 = time.time()
    build = {}

    if not a.no_prebuild:

        def prebuild(op):
            t = time.time()
            try:
                _run(
                    [sys.executable, str(Path(__file__).resolve()), "prebuild", "--op", op],
                    log_dir / f"prebuild_{op}.log",
                    timeout=360,
                )
                build[op] = {"ok": True, "s": round(time.time() - t, 1)}
            except Exception as e:  # noqa: BLE001 - recorded: the fixtures that need the op are skipped
                build[op] = {"ok": False, "s": round(time.time() - t, 1), "error": str(e)[-3000:]}
            print(f"prebuild {op}: {build[op]['ok']} ({build[op]['s']} s)", flush=True)

        with ThreadPoolExecutor(2) as ex:
            list(ex.map(prebuild, ["fused_adam", "cpu_adam"]))

    results, timings = {}, {}

    def one(n):
        t = time.time()
        s = sp[n]
        if s["dtype"] == "fp16" and build.get("fused_adam", {}).get("ok") is False:
            results[n] = "skipped: fused_adam op did not build"
        elif s.get("offload") and build.get("cpu_adam", {}).get("ok") is False:
            results[n] = "skipped: cpu_adam op did not build"
        else:
            try:
                make_one(s, out, log_dir)
                results[n] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded; the other fixtures still build
                results[n] = f"FAILED: {str(e)[-3000:]}"
        timings[n] = round(time.time() - t, 1)
        print(f"{n}: {results[n][:2000]} ({timings[n]} s)", flush=True)

    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        list(ex.map(one, names))

    index = [n for n in names if results.get(n) == "ok"]
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    import deepspeed

    info = {
        "command": "python scripts/make_gpu_fixtures.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpus": [torch.cuda.get_device_name(i) for i in range(ngpu)],
        "dp": dp,
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ngpu else None,
        "python": sys.version.split()[0],
        "prebuild": build,
        "results": results,
        "timings_s": timings,
        "total_s": round(time.time() - t0, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "prebuild"}, indent=1), flush=True)
    return 0 if len(index) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())

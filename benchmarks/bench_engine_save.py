"""Rank 0's memory while saving a ZeRO-3 model: save_pretrained_from_engine vs DeepSpeed's own gather.

    python -m benchmarks.bench_engine_save [--layers 12 --hidden 1024 --vocab 8192] [--budgets 64MiB,16MiB,4MiB]
                                           [--md bench.md]

Builds a GPT-2-shaped model (>= 8 layers) under ZeRO-3 (bf16, DP=2, CPU/gloo, every parameter partitioned),
trains one step, then on every rank either

  ds    engine._zero3_consolidated_16bit_state_dict()   (what save_16bit_model / Trainer.save_model gather)
  ours  ckpttools.live.engine_save.save_pretrained_from_engine(engine, out, max_gather_bytes=B)  (and writes it)

Each case runs in fresh processes (torchrun), so one case's freed memory cannot hide another's. On rank 0 it
records: the bytes of full (gathered) tensors held at once - for `ours` the instrumented
`peak_gathered_bytes`, for `ds` the size of the state dict it returns, which rank 0 holds in full - and
the peak RSS growth during the call (Linux VmHWM, reset through /proc/self/clear_refs just before, and a
psutil sampler as a cross-check). On a GPU the gathered groups live in device memory; on this CPU run they
are host memory, so the RSS column is the upper bound for both.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

from fixtures.build import ds_launch

MODULE = "benchmarks.bench_engine_save"  # this file, as its torchrun workers run it (`python -m`)

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30, "KB": 1000, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


# --------------------------------------------------------------------------------------------------
# worker (one case, under torchrun)
# --------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Peak resident memory during a block: VmHWM after resetting it, plus a psutil sampler."""

    def __enter__(self) -> Self:
        import psutil

        self.proc = psutil.Process()
        self.start = self.proc.memory_info().rss
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.hwm_ok = True
        except OSError:
            self.hwm_ok = False
        self.sampled = self.start
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.sampled = max(self.sampled, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.sampled = max(self.sampled, self.proc.memory_info().rss)
        self.hwm = _status_kib("VmHWM") * 1024 if self.hwm_ok else self.sampled

    @property
    def delta(self) -> int:
        return max(self.hwm, self.sampled) - self.start


def trim_heap() -> None:
    """Hand free heap pages back to the OS, so later allocations show up as RSS growth instead of
    silently reusing memory the training step freed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def state_dict_bytes(sd: dict) -> int:
    seen, total = set(), 0
    for t in sd.values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run_case(case: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    for name in ("DeepSpeed", "deepspeed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=args.vocab, n_positions=128
    )
    model = GPT2LMHeadModel(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    ids = torch.randint(0, args.vocab, (1, 32))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    del model
    gc.collect()
    trim_heap()
    model_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
    largest = max(p.ds_numel * p.element_size() for p in engine.module.parameters())
    torch.distributed.barrier()

    modules_with_params = sum(1 for m in engine.module.modules() if next(m.parameters(recurse=False), None) is not None)
    row: dict = {
        "case": case,
        "modules_with_params": modules_with_params,
        "model_bytes": model_bytes,
        "largest_param_bytes": largest,
        "params": sum(p.ds_numel for p in engine.module.parameters()),
        "layers": args.layers,
    }
    t0 = time.perf_counter()
    with PeakRSS() as peak:
        if case == "ds":
            sd = engine._zero3_consolidated_16bit_state_dict()
            held = state_dict_bytes(sd) if rank == 0 else 0
        else:
            budget = parse_size(case.split(":", 1)[1])
            with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
                result = save_pretrained(engine, Path(tmp) / "model", budget)
            held = result.peak_gathered_bytes
            row.update(
                {
                    "budget": budget,
                    "gathers": result.gathers,
                    "written": result.total_size,
                    "peak_buffer_bytes": result.peak_buffer_bytes,
                }
            )
    row.update(
        {"seconds": time.perf_counter() - t0, "held_bytes": held, "rss_delta": peak.delta, "rss_hwm_ok": peak.hwm_ok}
    )
    if rank == 0:
        Path(args.json).write_text(json.dumps(row))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def save_pretrained(engine, out: Path, budget: int):
    from ckpttools.live.engine_save import save_pretrained_from_engine

    return save_pretrained_from_engine(engine, out, max_gather_bytes=budget)


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def launch(case: str, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{case.replace(':', '_')}.json"
    # a fixed mmap threshold: every large buffer is its own mapping, unmapped when freed, so RSS follows
    # live memory instead of glibc's heap slack (the same for every case)
    env = ds_launch.worker_env(MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    cmd = ds_launch.torchrun_cmd(2, MODULE, ["--worker", case, "--json", out, "--tmp", tmp, "--layers", args.layers,
                                             "--hidden", args.hidden, "--vocab", args.vocab])  # fmt: skip
    ds_launch.prebuild_ops(env)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ds_launch.ROOT)
    if r.returncode != 0:
        raise SystemExit(f"case {case} failed (rc={r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    m = rows[0]
    lines = [
        (
            f"GPT-2 shape: {m['layers']} layers, {m['params'] / 1e6:.1f} M params, "
            f"{m['model_bytes'] / MiB:.1f} MiB in bf16; "
            f"largest param {m['largest_param_bytes'] / MiB:.1f} MiB. ZeRO-3, DP=2, CPU/gloo; rank 0."
        ),
        "",
        "| method | gather budget | gathers | full tensors held at once | share of model | peak RSS growth | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["case"] == "ds":
            name = "DeepSpeed `_zero3_consolidated_16bit_state_dict` (gather only)"
            budget, gathers = "one module", str(r["modules_with_params"])
        else:
            name = "`save_pretrained_from_engine` (gather + write safetensors)"
            budget, gathers = f"{r['budget'] / MiB:g} MiB", str(r["gathers"])
        lines.append(
            f"| {name} | {budget} | {gathers} | {r['held_bytes'] / MiB:.1f} MiB "
            f"| {r['held_bytes'] / r['model_bytes']:.0%} "
            f"| {r['rss_delta'] / MiB:.1f} MiB | {r['seconds']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument(
        "--budgets", default="64MiB,16MiB,4MiB", help="max_gather_bytes values to try (64MiB is the library default)"
    )
    ap.add_argument("--md", type=Path, help="also write the Markdown table here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layers < 8:
        ap.error("use at least 8 layers")
    if args.worker:
        run_case(args.worker, args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_engine_save_") as tmp:
        rows = [launch("ds", args, Path(tmp))]
        rows += [launch(f"ours:{b}", args, Path(tmp)) for b in args.budgets.split(",")]
    text = table(rows)
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

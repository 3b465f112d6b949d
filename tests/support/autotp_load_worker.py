"""Worker for tests/test_tensor_parallel.py and test_tensor_universal.py: load an AutoTP checkpoint with plain
DeepSpeed, dump what the engine holds, and train on.  Run it under torchrun (DP x TP processes); not a test.

    torchrun --nproc_per_node 4 -m tests.support.autotp_load_worker \
        --fixture-meta fixtures/autotp_tp2_dp2_z1_bf16/meta.json \
        --load CKPT_ROOT [--universal] [--tp T] [--dump OUT.safetensors] [--steps K]

  * the model is the fixture's (fixtures/build/fixture_autotp.py: same Llama config, seed, AutoTP degree 2, ZeRO stage
    and DS config), *scrambled* before AutoTP shards it, so whatever `load_checkpoint` does not restore shows;
  * the AutoTP degree is --tp (default 2, the fixtures'; another one only makes sense with --universal), the DP
    size WORLD_SIZE / TP;
  * `engine.load_checkpoint(CKPT_ROOT, load_optimizer_states=True, load_lr_scheduler_states=True)`; a None load
    path is an error. --universal adds `"checkpoint": {"load_universal": true}` to the config;
  * --dump (rank 0 writes; every rank takes part): for TP rank r (DP rank 0) `tp{r}/fp32/<n>`, `tp{r}/exp_avg/<n>`,
    `tp{r}/exp_avg_sq/<n>` (safe_get_full_fp32_param / safe_get_full_optimizer_state: the LOCAL TP shard,
    gathered over DP) and `tp{r}/module/<n>` (the module's 16-bit shard); OUT.json beside it: global steps, the
    optimizer step, DP and TP size, `none` (the keys DeepSpeed returned None for: an empty TP shard, e.g. the
    attention of TP ranks holding no head at TP 4), the losses of the --steps more training steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from fixtures.build import fixture_autotp as FA  # noqa: E402  (built the fixtures: model, config, training batches)

SCRAMBLE_SEED = 4242


def scramble(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(SCRAMBLE_SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 0.7)


def dump(engine, out: Path, info: dict) -> None:
    import torch.distributed as dist

    dp_rank, tp_rank = FA.ranks()
    mine = {f"tp{tp_rank}/{k}": v for k, v in FA.live_state(engine).items()}
    mine.update({f"tp{tp_rank}/module/{k}": v for k, v in engine.module.state_dict().items()})
    everyone = FA.gather_to_rank0(mine if dp_rank == 0 else {})
    if dist.get_rank() == 0:
        tensors = {k: v for part in everyone for k, v in part.items()}
        info["none"] = sorted(k for k, v in tensors.items() if v is None)  # DeepSpeed gave no tensor for these
        FA.save_st({k: v for k, v in tensors.items() if v is not None}, out)
        out.with_suffix(".json").write_text(json.dumps(info, indent=1))


def main(argv=None) -> int:
    import deepspeed
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture-meta", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--universal", action="store_true")
    ap.add_argument("--dump")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--tp", type=int, default=FA.TP)
    a = ap.parse_args(argv)
    FA.TP = a.tp  # build_engine and ds_config read the module's TP degree
    meta = json.loads(Path(a.fixture_meta).read_text())
    FA.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=180))
    FA.quiet_loggers()
    extra = {"checkpoint": {"load_universal": True}} if a.universal else {}
    engine = FA.build_engine(meta["zero_stage"], config_extra=extra, prepare=scramble)
    path, _ = engine.load_checkpoint(a.load, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise SystemExit(f"load_checkpoint({a.load}) found nothing to load")
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = sorted({int(s["step"]) for s in [*base.state.values(), *base.param_groups] if "step" in s})
    info = {
        "global_steps": engine.global_steps,
        "optimizer_steps": steps,
        "dp": dist.get_world_size() // FA.TP,
        "tp": FA.TP,
    }
    if a.dump:
        dump(engine, Path(a.dump), info)  # before training on: what was loaded
    losses = FA.train(engine, a.steps, first=FA.STEPS)
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit(f"training after the load gave losses {losses}")
    if a.dump and dist.get_rank() == 0:
        info["losses_after_load"] = losses
        Path(a.dump).with_suffix(".json").write_text(json.dumps(info, indent=1))
    FA.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

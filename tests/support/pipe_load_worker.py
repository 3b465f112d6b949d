"""Worker for tests/test_pipeline.py: load a pipeline checkpoint with plain DeepSpeed, dump what the engines of
every stage hold, and train on.  Run it under torchrun with DP x stages processes; not a test.

    torchrun --nproc_per_node <dp*stages> -m tests.support.pipe_load_worker \
        --fixture-meta fixtures/pp2_dp1_z1_bf16/meta.json \
        --load CKPT_ROOT --dump OUT.safetensors [--universal] [--steps K] [--stages S] [--partition-method M]

  * the PipelineModule is built exactly as fixtures/build/fixture_pipe.py built it (same layers, seed, stages, partition
    method, the fixture's ds_config with the batch size for this DP size; --stages / --partition-method change the
    pipeline layout, DP = processes / stages), then every parameter and persistent
    buffer is overwritten, so anything `load_checkpoint` does not restore shows up in the dump;
  * `engine.load_checkpoint(CKPT_ROOT, load_optimizer_states=True, load_lr_scheduler_states=True)` (a None load
    path is an error); with --universal the config gets `"checkpoint": {"load_universal": true}`;
  * --dump (global rank 0 writes; every rank takes part): `fp32/<key>`, `exp_avg/<key>`, `exp_avg_sq/<key>` of
    every trainable param (safe_get_full_fp32_param / safe_get_full_optimizer_state on its stage) and
    `module/<key>` for every entry of every stage's module state_dict, whole-model keys, tied ones once (checked
    equal across stages); OUT.json beside it: global steps, optimizer steps, losses of the K steps after loading.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from fixtures.build import fixture_pipe as FP  # noqa: E402  (built the fixtures: layers, seed, stages, batches)

SCRAMBLE_SEED = 4242


def scramble(module: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(SCRAMBLE_SEED)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def build_engine(meta: dict, dp: int, universal: bool, stages: int, partition_method: str):
    spec = {"zero_stage": meta["zero_stage"], "dtype": meta["dtype"], "stages": stages,
            "partition_method": partition_method}  # fmt: skip
    extra = {"checkpoint": {"load_universal": True}} if universal else None
    engine, _cfg = FP.make_engine(spec, dp, extra)
    return engine


def main(argv=None) -> int:
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture-meta", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--universal", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--stages", type=int, help="pipeline stages of the loading engine (default: the fixture's)")
    ap.add_argument("--partition-method", help="PipelineModule partition_method (default: the fixture's)")
    a = ap.parse_args(argv)
    meta = json.loads(Path(a.fixture_meta).read_text())
    world = int(os.environ["WORLD_SIZE"])
    stages = a.stages or meta["stages"]
    dp = world // stages
    engine = build_engine(meta, dp, a.universal, stages, a.partition_method or meta["partition_method"])
    scramble(engine.module)
    load_path, _ = engine.load_checkpoint(a.load, load_optimizer_states=True, load_lr_scheduler_states=True)
    FP.quiet_loggers()
    if load_path is None:
        raise RuntimeError(f"load_checkpoint({a.load}) found nothing to load")
    grid = engine.grid
    stage, dp_rank = grid.get_stage_id(), grid.get_data_parallel_rank()
    full = FP.stage_full_state(engine)
    module = {f"module/{k}": v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    base = engine.optimizer.optimizer
    steps = sorted({int(st["step"]) for st in base.state.values() if "step" in st})
    global_steps = engine.global_steps
    it = FP.batches(dp_rank, seed_offset=77)
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(a.steps)]
    local = {"stage": stage, "dp_rank": dp_rank, "state": {**full, **module} if dp_rank == 0 else None,
             "optimizer_steps": steps, "load_path": load_path}  # fmt: skip
    everyone = FP.gather_to_rank0(local)
    if dist.get_rank() == 0:
        firsts = sorted((p for p in everyone if p["dp_rank"] == 0), key=lambda p: p["stage"])
        merged, _, copies = FP.merge_stages([p["state"] for p in firsts])
        FP.save_st(merged, Path(a.dump))
        FP.save_st(copies, Path(a.dump).with_suffix(".tied.safetensors"))
        facts = {
            "world_size": world,
            "dp": dp,
            "stages": stages,
            "parts": [int(x) for x in engine.module.parts],
            "global_steps_after_load": global_steps,
            "optimizer_steps_after_load": {
                f"stage{p['stage']}_dp{p['dp_rank']}": p["optimizer_steps"] for p in everyone
            },
            "losses_after_load": losses,
            "global_steps_after_training": engine.global_steps,
        }
        Path(a.dump).with_suffix(".json").write_text(json.dumps(facts, indent=1))
    FP.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

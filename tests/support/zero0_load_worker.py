"""Worker for tests/test_zero0.py: load stage-0 checkpoints with DeepSpeed's plain `load_checkpoint` at the current
world size, compare what the engine then holds with the saving engine's references, train one more step.
Run it under torchrun; not a test.

    torchrun --nproc_per_node M -m tests.support.zero0_load_worker --jobs '[{"meta": ..., "load": ..., "out": ...}]'

For each job: the engine of fixtures/build/fixture_zero0.py is rebuilt from the fixture's meta.json (same model, seed,
param groups, optimizer, ds_config), its module weights and fp32 masters are scrambled (so nothing passes by being
left at its init), `engine.load_checkpoint(load)` runs, and rank 0 writes `out`: the names of masters/states that
differ from reference/full_state.safetensors (bit for bit), whether the module equals reference/bit16.safetensors,
the steps, and the dp_world_size the loaded file records.
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

from fixtures.build import fixture_worker as FW  # noqa: E402  (the toy model, data and param groups)
from fixtures.build import fixture_zero0 as Z0  # noqa: E402  (the stage-0 engine the fixtures were built with)


def spec_of(meta: dict) -> dict:
    spec = {"name": meta["name"], "kind": meta["kind"], "zero_stage": 0, "dp": meta["dp"], "dtype": meta["dtype"]}
    client = meta.get("client_optimizer")
    if client:
        spec["client_optimizer"] = {k: client[k] for k in ("type", "params", "groups")}
    return spec


def scramble(engine) -> None:
    g = torch.Generator().manual_seed(4242)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
        for group in Z0.masters_by_name(engine):
            for _, master, *_ in group:
                master.copy_(torch.randn(master.shape, generator=g))


def run_job(job: dict) -> None:
    from safetensors.torch import load_file

    meta = json.loads(Path(job["meta"]).read_text())
    engine, _, _, _ = Z0.build_engine(FW, spec_of(meta))
    FW.quiet_loggers()
    scramble(engine)
    path, _ = engine.load_checkpoint(job["load"], load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise SystemExit(f"load_checkpoint({job['load']}) loaded nothing")
    full, _ = Z0.engine_full_state(engine)
    ref_dir = Path(job["meta"]).parent / "reference"
    ref = load_file(str(ref_dir / "full_state.safetensors"))
    mismatches = sorted(k for k in ref if k not in full or not torch.equal(full[k].detach().cpu(), ref[k]))
    mismatches += sorted(k for k in full if k not in ref)
    bit16 = load_file(str(ref_dir / "bit16.safetensors"))
    module = engine.module_state_dict()
    module_equal = set(module) == set(bit16) and all(torch.equal(module[k].cpu(), bit16[k]) for k in bit16)
    steps = engine.global_steps
    saved = torch.load(Path(path), map_location="cpu", weights_only=False)
    Z0.train(FW, engine, 1)
    if FW.rank() == 0:
        Path(job["out"]).write_text(json.dumps({
            "loaded_dp": int(os.environ.get("WORLD_SIZE", "1")), "checkpoint_dp_world_size": saved["dp_world_size"],
            "compared": len(ref), "mismatches": mismatches, "module_equal": module_equal, "global_steps": steps,
            "steps_after": engine.global_steps,
        }, indent=1))  # fmt: skip


def main() -> int:
    import deepspeed

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    a = ap.parse_args()
    FW.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    FW.quiet_loggers()
    for job in json.loads(a.jobs):
        run_job(job)
    FW.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

"""Worker for tests/test_moe.py (and the lead's MoE reshard proofs): load a DeepSpeed-MoE checkpoint with plain
DeepSpeed at the current world size, dump what the engine holds under GLOBAL expert keys, and train on.
Run it under torchrun; not a test.

    torchrun --nproc_per_node M -m tests.support.moe_load_worker --fixture-meta fixtures/moe_ep2_dp2_z2_bf16/meta.json \
        --load CKPT_ROOT --dump OUT.safetensors [--universal] [--steps K]

  * the model is fixtures/build/fixture_moe.py's `MoEToy` at the fixture's ep_size with the same seed, param groups
    (`split_params_into_different_moe_groups_for_optimizer`) and ds_config (meta.json `ds_config`), then
    *scrambled* (every parameter overwritten with other values before `deepspeed.initialize`), so anything
    `load_checkpoint` does not restore shows up in the dump;
  * `engine.load_checkpoint(CKPT_ROOT, load_optimizer_states=True)`; a None load path is an error; with
    --universal the config gets `"checkpoint": {"load_universal": true}`;
  * --dump (rank 0 writes; every rank takes part in the gathers): `fp32/<key>`, `exp_avg/<key>`, `exp_avg_sq/<key>`
    for every trainable param (safe_get_full_fp32_param / safe_get_full_optimizer_state) and `module/<key>` for
    every entry of the module's 16-bit state dict, experts under their global index gathered from every
    expert-parallel rank; OUT.json beside it: global steps, optimizer steps per param group, the losses of
    --steps K more training steps (default 1) after the dump, and each rank's expert-parallel coordinates.
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

SCRAMBLE_SEED = 4242


def _fixture_moe():
    """fixtures/build/fixture_moe.py, which built the fixtures (MoEToy, param groups, batches)."""
    from fixtures.build import fixture_moe

    return fixture_moe


def scramble(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(SCRAMBLE_SEED + int(os.environ.get("RANK", "0")))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _steps(optimizer: torch.optim.Optimizer, group: dict) -> list[int]:
    """The distinct `step` values of a param group's optimizer states."""
    return sorted({int(optimizer.state[p]["step"]) for p in group["params"] if "step" in optimizer.state.get(p, {})})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture-meta", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--universal", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    a = ap.parse_args(argv)
    fm = _fixture_moe()
    fw = fm.fw
    meta = json.loads(Path(a.fixture_meta).read_text())

    import deepspeed

    fw.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    fw.quiet_loggers()
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(fm.SEED)
    model = fm.MoEToy(ep_size=int(meta["ep_size"]))
    scramble(model)
    cfg = dict(meta["ds_config"])  # the fixture's own config (ZeRO stage, rank topology, batch size)
    if a.universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=fm.param_groups(model), config=cfg)
    fw.quiet_loggers()
    path, _ = engine.load_checkpoint(a.load, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"load_checkpoint({a.load}) loaded nothing")
    dump = {f"module/{k}": v for k, v in fm.bit16_state(engine).items()}
    dump.update(fm.full_state(engine))
    facts = {
        "global_steps": engine.global_steps,
        "optimizer_steps": [_steps(engine.optimizer.optimizer, g) for g in engine.optimizer.optimizer.param_groups],
        "topology": fm.rank_topology(engine),
    }
    facts["losses"] = fm.train(engine, rank, a.steps)
    if rank == 0:
        fw.save_st(dump, Path(a.dump))
        Path(a.dump).with_suffix(".json").write_text(json.dumps(facts, indent=1))
    fw.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

"""`reshard(..., stage=S)` against real DeepSpeed: a checkpoint saved at ZeRO stage A, rewritten for stage S
(and maybe another DP size), loads with a plain `engine.load_checkpoint` in an engine configured for stage S and
holds exactly the state the saving engine had (fp32 masters, Adam moments, the module's 16-bit weights, frozen
params and buffers, step counters), then trains on.

The engine is the fixture's own (tests/support/reshard_worker.py), built from a copy of its meta.json whose ds_config
says stage S; nothing else changes. Our own reader reads every written checkpoint back too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import UnsupportedCheckpointError, UsageError
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops.reshard import reshard
from fixtures.build import ds_launch

from .conftest import FIXTURES, tree_digest

ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.reshard_worker"

# (fixture, new stage, new DP)
CASES = [
    ("z1_dp2_bf16", 3, 2),
    ("z2_dp2_bf16", 1, 2),
    ("z3_dp2_bf16", 2, 2),
    ("z2_dp2_bf16", 3, 3),
    ("z3_dp2_bf16", 1, 3),
    ("z3_dp2_fp32", 2, 3),
]


def _case_id(case) -> str:
    return f"{case[0]}-to-zero{case[1]}-dp{case[2]}"


def _meta_at_stage(fixture: str, stage: int, out: Path) -> Path:
    meta = json.loads((FIXTURES / fixture / "meta.json").read_text())
    zero = dict(meta["ds_config"].get("zero_optimization") or {})
    zero["stage"] = stage
    meta["ds_config"]["zero_optimization"] = zero
    meta["zero_stage"] = stage
    path = out / f"{fixture}-zero{stage}-meta.json"
    path.write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """Every case resharded, then loaded at its world size (one torchrun per world size)."""
    work = tmp_path_factory.mktemp("stage")
    results: dict = {}
    jobs_by_world: dict[int, list[dict]] = {}
    for case in CASES:
        fixture, stage, dp = case
        before = tree_digest(FIXTURES / fixture)
        out = work / _case_id(case)
        res = reshard(FIXTURES / fixture / "checkpoint", out, dp=dp, stage=stage)
        assert tree_digest(FIXTURES / fixture) == before
        d = work / f"load-{_case_id(case)}"
        d.mkdir()
        job = {"fixture_meta": str(_meta_at_stage(fixture, stage, work)), "load": res.output_dir,
               "dump": str(d / "dump.safetensors"), "steps": 2, "losses": str(d / "losses.json"),
               "status": str(d / "status.json")}  # fmt: skip
        jobs_by_world.setdefault(dp, []).append(job)
        results[case] = (res, d)
    for world, jobs in jobs_by_world.items():
        jobs_file = work / f"jobs-{world}.json"
        jobs_file.write_text(json.dumps(jobs))
        run = ds_launch.torchrun(world, WORKER, ["--jobs", str(jobs_file)], cwd=ROOT, timeout=900)
        (work / f"jobs-{world}.log").write_text(run.output)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_deepspeed_loads_the_new_stage_with_the_same_state(case, loads):
    fixture, stage, dp = case
    _res, d = loads[case]
    status = json.loads((d / "status.json").read_text()) if (d / "status.json").exists() else {"ok": False}
    assert status["ok"], status.get("error", f"no result; see the jobs-{dp}.log beside {d}")
    dump = load_file(d / "dump.safetensors")
    info = json.loads((d / "dump.json").read_text())
    assert info["zero_stage"] == stage and info["dp_world_size"] == dp
    assert info["global_steps"] == 2 and info["optimizer_step"] == [2.0]
    full = load_file(FIXTURES / fixture / "reference" / "full_state.safetensors")
    bit16 = load_file(FIXTURES / fixture / "reference" / "bit16.safetensors")
    problems = [k for k, t in full.items() if not torch.equal(dump[k], t)]
    problems += [k for k, t in bit16.items() if not torch.equal(dump[f"module/{k}"], t)]
    assert not problems, f"differ after the load at ZeRO-{stage}: {problems}"
    losses = json.loads((d / "losses.json").read_text())["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_written_checkpoint_reads_back_at_the_new_stage(case, loads):
    _fixture, stage, dp = case
    res, _ = loads[case]
    ckpt = open_checkpoint(res.output_dir)
    assert (ckpt.zero_stage, ckpt.dp_world_size) == (stage, dp)
    assert ckpt.optimizer.file_meta["ds_config"]["zero_optimization"]["stage"] == stage
    assert any("ZeRO-" in n and f"stage {stage}" in n for n in res.notes)


def test_stage_options_are_checked():
    src = FIXTURES / "z2_dp2_bf16" / "checkpoint"
    with pytest.raises(UsageError, match="--stage must be 1, 2 or 3"):
        reshard(src, dp=2, stage=0)
    with pytest.raises(UsageError, match="without --dp/--stage"):
        reshard(src, universal=True, stage=3)
    with pytest.raises(UnsupportedCheckpointError, match="BF16_Optimizer"):
        reshard(FIXTURES / "z1_dp2_bf16_bf16opt" / "checkpoint", dp=2, stage=2)

"""DeepSpeed DualPipeV checkpoints (fixtures/dualpipev_*, fixtures/build/fixture_dualpipev.py, PR #8576).

DualPipeVModule cuts 8 layers into 4 stages for 2 pipe ranks; rank r builds stages r and 2P-1-r, so rank 0 holds
layers 0, 1, 6, 7 (the tied embedding/head one module there) and rank 1 layers 2-5. On disk it is a PipelineModule
save (`layer_XX-model_states.pt`, `mp_rank_{r}_model_states.pt` per pipe rank, ZeRO-1 optimizer files per pipe
rank and DP rank) whose stage files hold non-adjacent layer ranges: the pipeline reader tells it from swapped
stage files by the V-shaped owner order and reads it; `consolidate` writes exactly what the live engines held; the
slow tests prove `ckpt reshard --dp M` by a real DualPipeV engine loading the result and training one more step.
DeepSpeed's own zero_to_fp32 refuses these folders (recorded in meta.json).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.pipeline import LAYOUT, read_pipeline
from ckpttools.layouts.registry import locate, open_checkpoint
from ckpttools.model.checkpoint import Checkpoint

from .conftest import FIXTURES, fixture_meta, tree_digest

NAMES = ["dualpipev_pp2_dp1_z1_bf16", "dualpipev_pp2_dp2_z1_bf16"]
STATES = ("exp_avg", "exp_avg_sq")


def read(name: str) -> Checkpoint:
    return read_pipeline(locate(FIXTURES / name / "checkpoint"))


def reference(name: str, which: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference" / which)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_the_fixture_is_dualpipev_as_deepspeed_built_it(name: str) -> None:
    meta = fixture_meta(name)
    assert meta["engine"] == "DualPipeVEngine"
    assert meta["phase_bounds"] == {"0": [[0, 2], [6, 8]], "1": [[2, 4], [4, 6]]}
    assert meta["zero_to_fp32"] == {"ok": False, "error": "AttributeError: 'NoneType' object has no attribute 'items'"}
    assert "layer_07-model_states.pt" not in meta["tag_files"]  # the tied head (forward_fn) saves no file


@pytest.mark.parametrize("name", NAMES)
def test_reader_takes_each_pipe_rank_as_two_stages(name: str) -> None:
    meta = fixture_meta(name)
    ckpt = read(name)
    assert ckpt.keys == ["tied_modules.embed.weight", "1.weight", "1.bias", "3.weight", "3.bias", "4.weight",
                         "4.bias", "5.weight", "5.bias", "6.weight", "6.bias"]  # fmt: skip
    assert sorted(ckpt.keys) == sorted(meta["whole_model_keys"])
    assert ckpt.dp_world_size == meta["dp"]
    assert ckpt.global_steps == meta["global_steps"]
    layout = ckpt.layout
    assert (layout.kind, layout.pp, layout.dp) == ("pipeline", 2, meta["dp"])
    assert layout.details["schedule"] == "dualpipev"
    assert layout.details["stages"] == 4
    assert layout.details["layer_stage"] == {"0": 0, "1": 0, "3": 1, "4": 1, "5": 1, "6": 0}
    assert layout.details["layer_stage"] == {k: v for k, v in meta["layer_pipe_rank"].items()
                                             if k in layout.details["layer_stage"]}  # fmt: skip
    assert layout.details["stage_params"] == meta["rank_param_names"]
    assert layout.details["tied"] == {"embed": {"stages": [0], "layer_files": ["layer_00-model_states.pt"]}}


def test_inspect_says_dualpipev() -> None:
    ckpt = read(NAMES[1])
    lines = LAYOUT.describe(ckpt.layout.as_dict())
    assert lines == [
        "schedule       DualPipeV: 4 stages on 2 pipe ranks, rank r holding stages r and 2P-1-r",
        "stages         pipe rank 0: layers 0, 1, 6; pipe rank 1: layers 3, 4, 5",
        "tied modules   embed (pipe ranks 0)",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_masters_states_and_16bit_copies_equal_the_live_engines(name: str) -> None:
    ckpt = read(name)
    full, bit16 = reference(name, "full_state.safetensors"), reference(name, "bit16.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            assert same(read_tensor(p.fp32, reader), full[f"fp32/{p.name}"]), p.name
            for key in STATES:
                assert same(read_tensor(p.states[key], reader), full[f"{key}/{p.name}"]), (key, p.name)
        for src in ckpt.sources(dtypes.BFLOAT16):
            assert same(read_tensor(src, reader), bit16[src.name]), src.name
        reader.finish()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_consolidate_writes_the_engines_weights(name: str, dtype: str, tmp_path: Path) -> None:
    from ckpttools.ops.consolidate import consolidate

    meta = fixture_meta(name)
    before = tree_digest(FIXTURES / name / "checkpoint")
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", dtype=dtype)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == sorted(meta["whole_model_keys"])
    full, bit16 = reference(name, "full_state.safetensors"), reference(name, "bit16.safetensors")
    for key, t in written.items():
        assert same(t, full[f"fp32/{key}"] if dtype == "fp32" else bit16[key]), key
    assert tree_digest(FIXTURES / name / "checkpoint") == before


def test_open_checkpoint_dispatches_dualpipev_to_the_pipeline_reader() -> None:
    ckpt = open_checkpoint(FIXTURES / NAMES[0] / "checkpoint")
    assert ckpt.layout.details["schedule"] == "dualpipev"


def test_swapped_rank_files_are_not_taken_for_dualpipev(tmp_path: Path) -> None:
    """Swapped stage files of a DualPipeV save give owners `1 1 0 0 0 1` in layer order: not V-shaped from rank 0."""
    root = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / NAMES[0] / "checkpoint", root)
    tag = root / "global_step2"
    a, b = tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt"
    a.rename(tag / "x")
    b.rename(a)
    (tag / "x").rename(b)
    with pytest.raises(CorruptCheckpointError) as e:
        read_pipeline(locate(root))
    msg = str(e.value)
    assert "\n" not in msg
    assert "swapped" in msg


# --- real DeepSpeed: a resharded folder loads into DualPipeVEngine and trains on -----------------------------------


def _load(checkpoint: Path, nproc: int, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from fixtures.build import ds_launch

    dump = tmp_path / "dump.safetensors"
    args = ["load", "--load", str(checkpoint), "--out", str(dump)]
    run = ds_launch.torchrun(nproc, "fixtures.build.fixture_dualpipev", args, cwd=tmp_path, timeout=900)
    assert run.rc == 0, run.tail()
    return load_file(dump), json.loads(dump.with_suffix(".json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dp"), [("dualpipev_pp2_dp1_z1_bf16", 2), ("dualpipev_pp2_dp2_z1_bf16", 1)])
def test_deepspeed_loads_a_resharded_dualpipev_checkpoint(name: str, dp: int, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from ckpttools.ops.reshard import reshard

    meta = fixture_meta(name)
    out = tmp_path / "resharded"
    reshard(FIXTURES / name / "checkpoint", out, dp=dp)
    got, facts = _load(out, 2 * dp, tmp_path)
    want = {**reference(name, "full_state.safetensors"),
            **{f"module/{k}": v for k, v in reference(name, "bit16.safetensors").items()}}  # fmt: skip
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert same(got[key], t), key
    assert facts["dp"] == dp
    assert facts["global_steps_after_load"] == meta["global_steps"]
    assert all(s == [meta["global_steps"]] for s in facts["optimizer_steps_after_load"])
    assert facts["global_steps_after_training"] == meta["global_steps"] + 1
    assert all(math.isfinite(loss) for loss in facts["losses_after_load"])


@pytest.mark.slow
def test_deepspeed_resumes_a_universal_dualpipev_checkpoint_at_another_dp(tmp_path: Path) -> None:
    """`ckpt reshard --universal`: a DualPipeV engine at DP 2 loads it with load_universal (params found by name,
    whatever stage holds them) and holds the DP-1 engines' masters, moments and 16-bit weights bit for bit."""
    pytest.importorskip("deepspeed")
    from ckpttools.ops.reshard import reshard
    from fixtures.build import ds_launch

    name = NAMES[0]
    out = tmp_path / "universal"
    reshard(FIXTURES / name / "checkpoint", out, universal=True)
    dump = tmp_path / "dump.safetensors"
    args = ["load", "--universal", "--load", str(out), "--out", str(dump)]
    run = ds_launch.torchrun(4, "fixtures.build.fixture_dualpipev", args, cwd=tmp_path, timeout=900)
    assert run.rc == 0, run.tail()
    got = load_file(dump)
    want = {**reference(name, "full_state.safetensors"),
            **{f"module/{k}": v for k, v in reference(name, "bit16.safetensors").items()}}  # fmt: skip
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert same(got[key], t), key
    facts = json.loads(dump.with_suffix(".json").read_text())
    assert (facts["dp"], facts["global_steps_after_training"]) == (2, fixture_meta(name)["global_steps"] + 1)

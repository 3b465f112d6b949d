"""DeepSpeed's Muon optimizer (`"optimizer": {"type": "Muon"}`, MuonWithAuxAdam; issue 23) against real DeepSpeed.

The fixtures `muon_z{1,2,3}_dp2_bf16` (fixtures/build/fixture_muon.py) were written by DeepSpeed 0.19.8 at DP2, bf16:
param group 0 ("group0-muon-params": emb.weight, fc1.weight, fc2.weight) is stepped by Muon and holds only
`momentum_buffer`, group 1 ("group1-adam-params": LayerNorm, biases) by the auxiliary FusedAdam with `exp_avg`,
`exp_avg_sq` and `step`. At ZeRO-1/2 DeepSpeed keeps the momentum as the whole params of each rank's partition
(bf16), at ZeRO-3 per partition like any state (fp32).

  (i)   read: `ckpt inspect` names both groups' keys; every fp32 master and optimizer state read from the files equals
        the live engine's (reference/full_state.safetensors) bit for bit, dtype included;
  (ii)  consolidate: fp32 equals the live engine and zero_to_fp32, bf16 the engine's own 16-bit state dict;
  (iii) reshard --dp 1 / 3 (slow): a real DeepSpeed engine with the same config loads it at the new DP, every fp32
        master and optimizer state equals the reference, and one more step trains;
  (iv)  universal (slow): at ZeRO-1/2 DeepSpeed's loader reads every `<key>.pt` of a param folder, so the universal
        form carries `momentum_buffer.pt` and loads at DP 3 bit-identically and trains on; at ZeRO-3 DeepSpeed's
        loader reads `fp32`, `exp_avg`, `exp_avg_sq` only, and `reshard --universal` refuses with its error quoted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, reshard
from ckpttools.compat import ds_to_universal
from ckpttools.errors import CkptError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts import universal
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.universal import MUON_ZERO3_ERROR, MUON_ZERO12_ERROR
from fixtures.build import ds_launch

from .conftest import FIXTURES

NAMES = [f"muon_z{s}_dp2_bf16" for s in (1, 2, 3)] + ["muon_z3_dp2_bf16_inmem"]
WORKER = "fixtures.build.fixture_muon"
slow = pytest.mark.slow


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


def _ref(name: str, which: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "reference" / f"{which}.safetensors"))


def _ckpt(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def _differences(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> list[str]:
    out = [f"{what}: {k} missing" for k in sorted(set(ref) - set(ours))]
    return out + [
        f"{what}: {k} differs ({ours[k].dtype} vs {ref[k].dtype})"
        for k in sorted(set(ref) & set(ours))
        if ours[k].dtype != ref[k].dtype or not torch.equal(ours[k], ref[k])
    ]


def _read_states(path: Path) -> dict[str, torch.Tensor]:
    """fp32/<n> and <key>/<n> of every trainable param, as ckpttools reads them from the files."""
    ckpt = read_checkpoint(path)
    out = {}
    with RecordReader() as reader:
        for p in ckpt.params:
            out[f"fp32/{p.name}"] = read_tensor(p.fp32, reader)
            for key, src in p.states.items():
                out[f"{key}/{p.name}"] = read_tensor(src, reader)
        reader.finish()
    return out


def test_the_fixtures_hold_two_kinds_of_groups():
    for name in NAMES:
        meta = _meta(name)
        assert meta["optimizer"] == "MuonWithAuxAdam"
        assert meta["param_group_use_muon"] == [True, False]
        assert meta["muon_params"] == ["emb.weight", "fc1.weight", "fc2.weight"]
        assert meta["momentum_rank_copies_differ"] == []
        keys = {k.split("/")[0] for k in _ref(name, "full_state")}
        assert keys == {"fp32", "momentum_buffer", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("name", NAMES)
def test_every_master_and_state_of_both_groups_reads_bit_identically(name):
    ours = _read_states(_ckpt(name))
    ref = _ref(name, "full_state")
    assert set(ours) == set(ref)
    momenta = sorted(k for k in ours if k.startswith("momentum_buffer/"))
    assert {ours[k].dtype for k in momenta} == {torch.bfloat16}  # as stored: the gradient's dtype
    if _meta(name)["zero_stage"] == 3:
        # ZeRO-3's safe_get_full_optimizer_state all-gathers into an fp32 buffer (_fp32_state_allgather): the
        # reference is the stored bf16 momentum upcast, which is lossless
        assert {ref[k].dtype for k in momenta} == {torch.float32}
        ours.update({k: ours[k].float() for k in momenta})
    assert _differences(ours, ref, name) == []


@pytest.mark.parametrize("name", NAMES)
def test_inspect_names_both_groups_state_keys(name):
    ckpt = read_checkpoint(_ckpt(name))
    assert sorted(ckpt.state_keys) == ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    by_group = {p.group: sorted(p.states) for p in ckpt.params}
    assert by_group == {0: ["momentum_buffer"], 1: ["exp_avg", "exp_avg_sq"]}


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_fp32_and_bf16_equal_deepspeed(name, tmp_path):
    fp32 = {k.removeprefix("fp32/"): v for k, v in _ref(name, "full_state").items() if k.startswith("fp32/")}
    consolidate(_ckpt(name), tmp_path / "fp32", dtype="fp32")
    ours = {}
    for f in sorted((tmp_path / "fp32").glob("*.safetensors")):
        ours.update(load_file(f))
    problems = _differences(ours, fp32, "live engine fp32")
    z2f = {k: v.float() if v.is_floating_point() else v for k, v in _ref(name, "zero_to_fp32").items()}
    problems += _differences(ours, z2f, "zero_to_fp32")
    consolidate(_ckpt(name), tmp_path / "bf16", dtype="bf16")
    bf16 = {}
    for f in sorted((tmp_path / "bf16").glob("*.safetensors")):
        bf16.update(load_file(f))
    ref16 = _ref(name, "bit16")
    assert set(bf16) == set(ref16)
    problems += _differences(bf16, ref16, "engine 16-bit state dict")
    assert problems == []


# --- reshard, loaded by real DeepSpeed engines ------------------------------------------------------------------


def _resume(
    name: str, ckpt: Path, dp: int, tmp_path: Path, universal: bool = False, stage: int | None = None
) -> tuple[int, list[dict], str]:
    """Load `ckpt` into a Muon engine of the fixture's stage (or `stage`) at `dp` ranks (fixture_muon.py `resume`),
    compare every fp32 master and optimizer state with the fixture's reference, one more step; (rc, per-rank facts,
    output)."""
    stage = stage or _meta(name)["zero_stage"]
    info = tmp_path / "info"
    ref = FIXTURES / name / "reference" / "full_state.safetensors"
    args = ["resume", "--stage", stage, "--ckpt", ckpt, "--ref", ref, "--out", info,
            *(["--universal"] if universal else []),
            *(["--in-memory"] if _in_memory(name) and stage == 3 else [])]  # fmt: skip
    run = ds_launch.torchrun(dp, WORKER, args, timeout=600)
    facts = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("info.*.json"))]
    return run.rc, facts, run.tail()


# ZeRO-2 -> ZeRO-3 at DP 3, ZeRO-3 -> ZeRO-1 at DP 1
STAGE_CHANGES: list[tuple[str, int, int | None]] = [(NAMES[1], 3, 3), (NAMES[2], 1, 1)]


@slow
@pytest.mark.parametrize(("name", "dp", "stage"), [*((n, dp, None) for n in NAMES for dp in (1, 3)), *STAGE_CHANGES])
def test_reshard_dp_loads_in_deepspeed_bit_identically_and_trains_on(name, dp, stage, tmp_path):
    """At a new DP (and at another ZeRO stage: the Muon momentum changes between ZeRO-1/2's whole-param layout
    and ZeRO-3's per-partition one)."""
    out = tmp_path / f"dp{dp}"
    reshard(_ckpt(name), out, dp=dp, stage=stage)
    assert _read_states(out).keys() == _ref(name, "full_state").keys()
    rc, facts, tail = _resume(name, out, dp, tmp_path, stage=stage)
    assert rc == 0, tail
    assert len(facts) == dp
    for f in facts:
        assert f["loaded"] and f["global_steps_after_load"] == _meta(name)["global_steps"]
        assert [k for k, same in f["equal"].items() if not same] == [], f"rank {f['rank']}"
        assert f["global_steps_after_step"] == f["global_steps_after_load"] + 1
        assert f["fp32_finite_after_step"]


# --- the universal form ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reshard_universal_and_ds_to_universal_refuse_with_deepspeeds_errors(name, tmp_path):
    with pytest.raises(CkptError) as e:
        reshard(_ckpt(name), tmp_path / "u", universal=True)
    assert MUON_ZERO12_ERROR in str(e.value) and MUON_ZERO3_ERROR in str(e.value)
    assert not (tmp_path / "u").exists()
    tag = _meta(name)["tag"]
    args = ["--input_folder", str(_ckpt(name) / tag), "--output_folder", str(tmp_path / "dsu" / tag)]
    assert ds_to_universal.cli(args) != 0
    assert not (tmp_path / "dsu" / tag).exists()


def _in_memory(name: str) -> bool:
    return bool(_meta(name)["ds_config"]["zero_optimization"].get("save_muon_momentum_buffer_in_memory"))


@slow
@pytest.mark.parametrize("name", NAMES[:3])
def test_deepspeed_cannot_resume_muon_from_the_universal_form(name, tmp_path, monkeypatch):
    """The errors the refusal quotes, from DeepSpeed itself: the universal form written anyway (every state under
    its own key, as for any optimizer) and loaded with load_universal at DP 3."""
    monkeypatch.setattr(universal, "refuse_muon", lambda ckpt, groups: None)
    out = tmp_path / "u"
    reshard(_ckpt(name), out, universal=True)
    assert sorted(p.name for p in (out / _meta(name)["tag"] / "zero" / "fc1.weight").iterdir()) == [
        "fp32.pt",
        "momentum_buffer.pt",
    ]
    rc, facts, tail = _resume(name, out, 3, tmp_path, universal=True)
    assert rc != 0
    if _meta(name)["zero_stage"] == 3:
        assert {f.get("load_error") for f in facts} == {MUON_ZERO3_ERROR}, tail
    else:  # the load passes (the momentum put back per partition), the first Muon step fails
        assert facts and all(f["loaded"] for f in facts), tail
        assert MUON_ZERO12_ERROR in {f.get("step_error") for f in facts}, tail

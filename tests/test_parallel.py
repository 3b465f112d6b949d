"""model/parallel: the layout read from each kind of DeepSpeed folder has the degrees and process count of its run."""

import json

import pytest

from ckpttools.layouts.registry import read_checkpoint
from ckpttools.model.parallel import ParallelLayout

from .conftest import FIXTURES

# name -> (kind, dp, tp, pp, ep, describe)
CASES = {
    "z2_dp2_bf16": ("dp", 2, 1, 1, 1, "DP 2"),
    "z3_dp3_fp32": ("dp", 3, 1, 1, 1, "DP 3"),
    "autotp_tp2_dp2_z1_bf16": ("tensor", 2, 2, 1, 1, "DP 2 x TP 2"),
    "pp2_dp2_z1_bf16": ("pipeline", 2, 1, 2, 1, "DP 2 x PP 2"),
    "pp2_dp1_z1_bf16": ("pipeline", 1, 1, 2, 1, "DP 1 x PP 2"),
    "moe_ep2_dp4_z2_bf16": ("moe", 4, 1, 1, 2, "DP 4 x EP 2"),
    "moe_ep2_dp2_z1_bf16": ("moe", 2, 1, 1, 2, "DP 2 x EP 2"),
    "z0_dp2_bf16": ("zero0", 2, 1, 1, 1, "DP 2"),
}


def _read(name):
    return read_checkpoint(next((FIXTURES / name).rglob("latest")).parent)


@pytest.mark.parametrize("name", CASES)
def test_layout_of_each_fixture(name):
    kind, dp, tp, pp, ep, text = CASES[name]
    layout = _read(name).layout
    assert (layout.kind, layout.dp, layout.tp, layout.pp, layout.ep) == (kind, dp, tp, pp, ep)
    assert layout.describe() == text
    assert layout.as_dict() == {"kind": kind, "dp": dp, "tp": tp, "pp": pp, "ep": ep, **layout.details}


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("z0")])
def test_world_size_is_the_number_of_processes_that_saved(name):
    """Every process of a ZeRO run writes one optimizer file; experts live on the DP ranks, not extra ones."""
    files = list((FIXTURES / name).rglob("*optim_states.pt"))
    assert _read(name).layout.world_size == len(files)
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    if "world_size" in meta:
        assert meta["world_size"] == len(files)


def test_details_do_not_take_part_in_equality():
    assert ParallelLayout("tensor", 2, 2, details={"a": 1}) == ParallelLayout("tensor", 2, 2)
    assert ParallelLayout() == ParallelLayout("dp", 1, 1, 1, 1)
    assert ParallelLayout().describe() == "DP 1" and ParallelLayout().world_size == 1
    assert ParallelLayout("x", 3, 2, 4, 5).describe() == "DP 3 x TP 2 x PP 4 x EP 5"
    assert ParallelLayout("x", 3, 2, 4, 5).world_size == 24

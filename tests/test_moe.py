"""DeepSpeed-MoE (expert-parallel) ZeRO-1/2 checkpoints: read with every expert under its global index,
consolidated bit-identical to what the live engine held, and every kind of broken folder refused by name.

The slow test proves with DeepSpeed itself (tests/support/moe_load_worker.py under torchrun) that the original fixture
loads and dumps equal to its reference, the harness the reshard proofs reuse.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, read_checkpoint
from ckpttools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.moe import expert_dp_ranks, local_expert_name

from .conftest import FIXTURES, fixture_meta, fixture_names, tree_digest

MOE = fixture_names("moe")
DP2 = "moe_ep2_dp2_z2_bf16"
DP4 = "moe_ep2_dp4_z2_bf16"
DBE = "moe_ep2_dp4_z2_bf16_dbe"  # use_data_before_expert_parallelism: contiguous expert-DP groups
OPT = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
EXPERT = "layer_{}_expert_{}_mp_rank_00_model_states.pt"
ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.moe_load_worker"


def _reference(name: str, which: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference" / which)


def _copy(tmp_path: Path, name: str = DP2) -> tuple[Path, Path]:
    shutil.copytree(FIXTURES / name / "checkpoint", tmp_path / "ckpt")
    return tmp_path / "ckpt", tmp_path / "ckpt" / fixture_meta(name)["tag"]


def _edit(path: Path, change) -> None:
    """Rewrite a (trusted, copied) file with one semantic change, under its own name."""
    obj = torch.load(path, weights_only=False, map_location="cpu")
    obj = change(obj) or obj
    torch.save(obj, path)


def _refused(ckpt: Path, tmp_path: Path, error: type[CkptError], match: str) -> None:
    before = tree_digest(ckpt)
    with pytest.raises(error, match=match):
        consolidate(ckpt, tmp_path / "out")
    assert tree_digest(ckpt) == before
    assert not (tmp_path / "out").exists()


def test_the_fixtures_exist():
    assert {DP2, DP4, DBE} <= set(MOE)


@pytest.mark.parametrize("name", MOE)
def test_reader_gives_every_expert_under_its_global_index(name):
    meta = fixture_meta(name)
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    assert ckpt.keys == meta["state_dict_keys"]  # the full model's order, experts 0..3 after each gate
    assert sorted(ckpt.masters) == sorted(meta["trainable"])
    assert (ckpt.zero_stage, ckpt.dp_world_size, ckpt.optimizer_kind) == (meta["zero_stage"], meta["dp"], "zero")
    layout = ckpt.layout
    assert (layout.kind, layout.dp, layout.ep, layout.tp, layout.pp) == ("moe", meta["dp"], 2, 1, 1)
    assert layout.details["num_experts"] == [4, 4]
    assert layout.details["moe_layers"] == meta["moe_layers"]
    assert layout.details["expert_dp"] == {"2": meta["expert_dp_size"]}
    assert layout.details["topology"] == (
        "data_before_expert" if meta.get("data_before_expert", False) else "expert_before_data"
    )


@pytest.mark.parametrize("name", MOE)
def test_the_rank_topology_is_the_one_deepspeed_built(name):
    """Each rank's expert-parallel rank and expert-DP rank, as the live engine reported them (meta.json)."""
    meta = fixture_meta(name)
    dp, ep = meta["dp"], meta["ep_size"]
    for e in range(ep):
        ranks = expert_dp_ranks(e, ep, dp, meta.get("data_before_expert", False))
        live = [(t["ep_rank"], t["expert_dp_rank"]) for t in meta["topology"]["ranks"] if t["rank"] in ranks]
        assert sorted(live, key=lambda t: t[1]) == [(e, d) for d in range(dp // ep)]
        assert [meta["topology"]["ranks"][r]["expert_dp_rank"] for r in ranks] == list(range(dp // ep))


def test_local_expert_names():
    name = "moe1.deepspeed_moe.experts.deepspeed_experts.3.fc2.bias"
    assert local_expert_name(name, 2) == ("moe1.deepspeed_moe.experts.deepspeed_experts.1.fc2.bias", 1)
    assert local_expert_name("moe1.deepspeed_moe.gate.wg.weight", 2) == ("moe1.deepspeed_moe.gate.wg.weight", 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MOE)
def test_consolidate_is_bit_identical_to_the_engine(name, dtype, tmp_path):
    if dtype == "fp32":
        ref = {k[len("fp32/") :]: v for k, v in _reference(name, "full_state.safetensors").items() if k[:5] == "fp32/"}
    else:
        ref = _reference(name, "bit16.safetensors")
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", dtype=dtype)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(out) == sorted(ref)
    different = [k for k in ref if out[k].dtype != ref[k].dtype or not torch.equal(out[k], ref[k])]
    assert not different


@pytest.mark.parametrize("name", MOE)
def test_adam_states_are_the_engine_s(name):
    ref = _reference(name, "full_state.safetensors")
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    with RecordReader() as reader:
        for p in ckpt.params:
            assert sorted(p.states) == ["exp_avg", "exp_avg_sq"]
            for key, src in p.states.items():
                assert torch.equal(read_tensor(src, reader), ref[f"{key}/{p.name}"]), (key, p.name)
    assert ckpt.optimizer.group_scalars == [{"step": 2}] * 4


def test_deepspeed_s_own_zero_to_fp32_fails_on_it():
    for name in MOE:
        z = fixture_meta(name)["zero_to_fp32"]
        assert not z["ok"]
        assert z["error"].startswith("ValueError: ")
        assert "_expert_0_mp_rank_00_model_states.pt is not a model" in z["error"]


def test_a_missing_expert_file_is_named_by_layer_and_global_expert(tmp_path):
    ckpt, tag = _copy(tmp_path)
    (tag / EXPERT.format(1, 3)).unlink()
    _refused(ckpt, tmp_path, CheckpointNotFoundError, "MoE layer 1 expert 3 .*layer_1_expert_3_mp_rank_00")


def test_a_stray_expert_file_is_refused(tmp_path):
    ckpt, tag = _copy(tmp_path)
    shutil.copy(tag / EXPERT.format(1, 3), tag / EXPERT.format(1, 4))
    _refused(ckpt, tmp_path, CorruptCheckpointError, "layer_1_expert_4_mp_rank_00_model_states.pt is no expert")


@pytest.mark.parametrize("name", [DP2, DP4])
def test_a_missing_rank_file(tmp_path, name):
    ckpt, tag = _copy(tmp_path, name)
    last = fixture_meta(name)["dp"] - 1
    (tag / OPT.format(last)).unlink()
    _refused(ckpt, tmp_path, CheckpointNotFoundError, f"rank {last} missing")


@pytest.mark.parametrize("pattern", [EXPERT.format(0, "{}"), OPT])
def test_swapped_files(tmp_path, pattern):
    ckpt, tag = _copy(tmp_path)
    a, b = tag / pattern.format(0), tag / pattern.format(1)
    a.rename(tag / "swap")
    b.rename(a)
    (tag / "swap").rename(b)
    _refused(ckpt, tmp_path, CorruptCheckpointError, "holds the data of")


def test_an_expert_file_holding_another_expert_is_refused(tmp_path):
    """A copy under the right name (torch.save's own record name rewritten too): its keys still say expert 2."""
    ckpt, tag = _copy(tmp_path)
    obj = torch.load(tag / EXPERT.format(0, 2), weights_only=False)
    torch.save(obj, tag / EXPERT.format(0, 1))
    _refused(ckpt, tmp_path, CorruptCheckpointError, "holds the weights of expert 2 .*not of expert 1")


def test_an_expert_of_the_wrong_shape(tmp_path):
    ckpt, tag = _copy(tmp_path)
    key = "moe1.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight"
    _edit(tag / EXPERT.format(1, 3), lambda sd: sd.__setitem__(key, sd[key][:5].clone()))
    _refused(ckpt, tmp_path, CorruptCheckpointError, r"fc1.weight has shape \[5, 8\], param_shapes \[6, 8\]")


def test_expert_partition_counts_must_be_the_expert_dp_size(tmp_path):
    ckpt, tag = _copy(tmp_path, DP4)

    def count_experts_over_all_ranks(sd):
        sd["optimizer_state_dict"]["partition_count"] = [4, 4, 4, 4]

    for r in range(4):
        _edit(tag / OPT.format(r), count_experts_over_all_ranks)
    _refused(ckpt, tmp_path, CorruptCheckpointError, r"partition counts \[4, 4, 4, 4\].* give \[4, 4, 2, 2\]")


def test_a_moe_group_without_its_ep_name(tmp_path):
    ckpt, tag = _copy(tmp_path)

    def rename(sd):
        sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][2]["name"] = "experts"

    for r in range(2):
        _edit(tag / OPT.format(r), rename)
    _refused(ckpt, tmp_path, CorruptCheckpointError, "MoE param group 2 is named 'experts', not ep_size_K")


def test_an_expert_master_from_another_run_is_caught_by_the_module_check(tmp_path):
    """Structure intact, bytes wrong: the fp32 masters no longer cast to the expert files' bf16 weights."""
    ckpt, tag = _copy(tmp_path)

    def perturb(sd):
        sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][2].data.mul_(1.5)

    _edit(tag / OPT.format(1), perturb)
    _refused(ckpt, tmp_path, CorruptCheckpointError, "experts.2.fc1.weight does not match the module")


def test_autoep_layers_hand_the_folder_to_the_autoep_reader(tmp_path):
    ckpt, tag = _copy(tmp_path)
    _edit(tag / "mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("ds_autoep_layers", [{"moe_layer_id": 0}]))
    _refused(ckpt, tmp_path, CkptError, r"ds_autoep_layers\[0\] says module_path")


# --- DeepSpeed itself loads the fixture --------------------------------------------------------------------


def _torchrun(nproc: int, args: list[str], timeout: int = 600):
    from fixtures.build import ds_launch

    return ds_launch.torchrun(nproc, WORKER, args, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("name", [DP2, DP4, DBE])
def test_deepspeed_loads_the_original_fixture_equal_to_its_reference(name, tmp_path):
    meta = fixture_meta(name)
    dump = tmp_path / "dump.safetensors"
    args = ["--fixture-meta", FIXTURES / name / "meta.json", "--load", FIXTURES / name / "checkpoint", "--dump", dump]
    run = _torchrun(meta["dp"], [str(a) for a in args])
    assert run.rc == 0, run.tail()
    ours = load_file(dump)
    full = _reference(name, "full_state.safetensors")
    bit16 = _reference(name, "bit16.safetensors")
    assert sorted(k for k in ours if not k.startswith("module/")) == sorted(full)
    assert sorted(k[len("module/") :] for k in ours if k.startswith("module/")) == sorted(bit16)
    assert not [k for k in full if not torch.equal(ours[k], full[k])]
    assert not [k for k in bit16 if not torch.equal(ours[f"module/{k}"], bit16[k])]

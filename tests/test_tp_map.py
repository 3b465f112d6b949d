"""layouts/tp_map: the AutoTP map puts DeepSpeed's TP shards together into the full tensors ds_to_universal writes."""

import copy
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.layouts.rankfile import RankFile
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.tp_map import Run, _plans_of, full_shapes, tensor_plans

from .conftest import FIXTURES

AUTOTP = ["autotp_tp2_dp2_z1_bf16", "autotp_tp2_dp2_z2_bf16", "autotp_trainer_tp2_dp2_z1_bf16",
          "accelerate_autotp_tp2_dp2_z1_bf16"]  # fmt: skip
ROW = ("o_proj", "down_proj")
REPLICATED = ("embed_tokens", "layernorm", "model.norm")


def _tag_dir(name: str) -> Path:
    return next((FIXTURES / name).rglob("mp_rank_00_model_states.pt")).parent


def _models(name):
    paths = [_tag_dir(name) / f"mp_rank_{r:02d}_model_states.pt" for r in range(2)]
    return [RankFile(path, load_pickle(path), "model-states") for path in paths]


def _live_shards(name):
    """Every TP rank's fp32 shard of every param, as DeepSpeed's safe_get_full_fp32_param returned it."""
    live = [load_file(FIXTURES / name / "reference" / f"live_fp32_tp{r}.safetensors") for r in range(2)]
    names = [k.removeprefix("fp32/") for k in live[0]]
    return {n: [live[r][f"fp32/{n}"] for r in range(2)] for n in names}


def _universal(name):
    return load_file(FIXTURES / name / "reference" / "universal_full.safetensors")


def _local_shapes(shards):
    return {n: [tuple(t.shape) for t in ts] for n, ts in shards.items()}


def _assemble(plan, shards):
    """The full tensor the plan's runs make of the shards."""
    flat = [s.reshape(-1) for s in shards]
    full = torch.full((math.prod(plan.shape),), float("nan"), dtype=shards[0].dtype)  # a missed element stays NaN
    for run in plan.runs:
        full[run.full : run.full + run.count] = flat[run.rank][run.shard : run.shard + run.count]
    return full.view(plan.shape)


@pytest.mark.parametrize("name", AUTOTP)
def test_shards_put_together_by_the_map_are_ds_to_universals_full_tensors(name):
    shards = _live_shards(name)
    universal = _universal(name)
    plans = _plans_of(_models(name)[0], _local_shapes(shards))
    assert set(plans) == set(shards)
    for n, plan in plans.items():
        full = _assemble(plan, shards[n])
        assert torch.equal(full, universal[f"fp32/{n}"]), n
        assert plan.shard_shapes == tuple(tuple(s.shape) for s in shards[n])


@pytest.mark.parametrize("name", AUTOTP[:2])
def test_optimizer_states_put_together_are_ds_to_universals(name):
    ckpt = read_checkpoint(next((FIXTURES / name).rglob("latest")).parent)
    universal = _universal(name)
    plans = tensor_plans(_models(name), ckpt.slices)
    with RecordReader() as reader:
        for n, plan in plans.items():
            params = [next(p for p in s.params if p.name == n) for s in ckpt.slices]
            for key in ("exp_avg", "exp_avg_sq"):
                shards = [read_tensor(p.states[key], reader) for p in params]
                assert torch.equal(_assemble(plan, shards), universal[f"{key}/{n}"]), (n, key)


@pytest.mark.parametrize("name", AUTOTP)
def test_full_shapes_are_ds_to_universals(name):
    models = _models(name)
    names = [n for group in models[0].obj["param_shapes"] for n in group]
    universal = _universal(name)
    assert full_shapes(models, names) == {n: tuple(universal[f"fp32/{n}"].shape) for n in names}


def test_full_shapes_refuse_tp_ranks_that_list_other_params():
    models = _models("autotp_tp2_dp2_z1_bf16")
    names = [n for group in models[0].obj["param_shapes"] for n in group]
    other = RankFile(models[1].path, copy.copy(models[1].obj), "model-states")
    other.obj["param_shapes"] = [dict(list(models[1].obj["param_shapes"][0].items())[:-1])]
    with pytest.raises(CorruptCheckpointError, match="different runs"):
        full_shapes([models[0], other], names)


def test_column_row_and_replicated_params_are_cut_as_autotp_cuts_them():
    shards = _live_shards("autotp_tp2_dp2_z1_bf16")
    plans = _plans_of(_models("autotp_tp2_dp2_z1_bf16")[0], _local_shapes(shards))
    for n, plan in plans.items():
        rows, cols = plan.shape if len(plan.shape) == 2 else (1, plan.shape[0])
        ranks = [r.rank for r in plan.runs]
        if any(k in n for k in REPLICATED):  # whole on every rank: taken from rank 0, rank 1's copy a replica
            assert plan.runs == (Run(0, 0, 0, rows * cols),) and plan.replicas == (Run(0, 1, 0, rows * cols),)
        elif any(k in n for k in ROW):  # split on dim 1: each row alternates between the ranks
            width = plan.shard_shapes[0][1]
            assert ranks == [0, 1] * rows and all(r.count == width for r in plan.runs) and not plan.replicas
        else:  # column-parallel (and the vocabulary): rank 0's rows, then rank 1's
            assert [r.rank for r in plan.runs] == [0, 1] and not plan.replicas
            assert plan.runs[1].full == plan.shard_shapes[0][0] * cols
    assert plans["lm_head.weight"].shard_shapes == ((31, 16), (30, 16))  # 61 rows split unevenly, no padding


def _without_affine_map(f0):
    obj = copy.deepcopy(f0.obj)
    del obj["universal_checkpoint_info"]["affine_map"]
    return RankFile(f0.path, obj, "model-states")


@pytest.mark.parametrize("name", AUTOTP)
def test_the_pattern_lists_give_the_same_plans_as_the_affine_map(name):
    """Older DeepSpeed saves only the pattern lists; merged as ds_to_universal merges them, they agree."""
    f0 = _models(name)[0]
    local = _local_shapes(_live_shards(name))
    assert _plans_of(_without_affine_map(f0), local) == _plans_of(f0, local)


def _with_info(f0, **changes):
    obj = copy.deepcopy(f0.obj)
    obj["universal_checkpoint_info"].update(changes)
    return RankFile(f0.path, obj, "model-states")


def test_vocabulary_rows_past_the_original_size_are_cut():
    name = "autotp_tp2_dp2_z1_bf16"
    shards = _live_shards(name)
    f0 = _with_info(_models(name)[0], original_vocab_size=40)
    plan = _plans_of(f0, _local_shapes(shards))["lm_head.weight"]
    assert plan.logical_shape == (61, 16) and plan.shape == (40, 16)
    assert torch.equal(_assemble(plan, shards["lm_head.weight"]), _universal(name)["fp32/lm_head.weight"][:40])
    assert _plans_of(_with_info(f0, original_vocab_size=61), _local_shapes(shards))["lm_head.weight"].shape == (61, 16)


def _one(name="autotp_tp2_dp2_z1_bf16"):
    f0 = _models(name)[0]
    return f0, _local_shapes(_live_shards(name))


def _q_proj_pattern(f0):
    return next(p for p in f0.obj["universal_checkpoint_info"]["affine_map"]["params"] if "0\\.self_attn\\.q" in p)


def _edit_map(f0, edit):
    obj = copy.deepcopy(f0.obj)
    params = obj["universal_checkpoint_info"]["affine_map"]["params"]
    edit(obj["universal_checkpoint_info"], params[_q_proj_pattern(f0)])
    return RankFile(f0.path, obj, "model-states")


def test_maps_ckpttools_cannot_merge_are_refused_by_name():
    f0, local = _one()

    def version(info, _):
        info["affine_map"]["version"] = 2

    def scaled(_, entry):
        entry["ranks"][0]["pieces"][0]["scale"] = 0.5

    def unsupported(info, _):
        info["autotp_unsupported_parameter_patterns"] = {"^lm_head": "reason"}

    for edit, match in [(version, "version 2"), (scaled, "scaled by 0.5"), (unsupported, "not convertible")]:
        with pytest.raises(UnsupportedCheckpointError, match=match):
            _plans_of(_edit_map(f0, edit), local)


@pytest.mark.parametrize("key", ["parameter_to_average_patterns", "parameter_with_2_sub_params_cat_dim_0"])
def test_pattern_lists_of_merges_other_than_concatenation_are_refused(key):
    f0, local = _one()
    with pytest.raises(UnsupportedCheckpointError, match=key):
        _plans_of(_with_info(_without_affine_map(f0), **{key: ["^model\\.layers\\.0\\.mlp\\.up_proj"]}), local)
    fused = {"parameter_with_sub_params": [{"patterns": ["^model\\.layers\\.0\\.mlp\\.up_proj"], "shape": [24, 16]}]}
    with pytest.raises(UnsupportedCheckpointError, match="fused"):
        _plans_of(_with_info(_without_affine_map(f0), **fused), local)


def test_damaged_maps_are_refused():
    f0, local = _one()

    def shard_shape(_, entry):
        entry["ranks"][1]["shard_shape"] = [9, 16]

    def overlap(_, entry):
        entry["ranks"][1]["pieces"][0]["source"][0] = 64  # rank 1's rows start inside rank 0's

    def gap(_, entry):
        entry["ranks"][1]["pieces"][0]["dest"][0] = 16  # the piece leaves the shard's first row unused

    def ranks(_, entry):
        del entry["ranks"][1]

    def locations(_, entry):
        entry["ranks"][0]["pieces"][0]["locations"] = [1]

    cases = [(shard_shape, "different runs"), (overlap, "covered twice"), (gap, "leave a gap"),
             (ranks, "TP ranks 0-1"), (locations, "locations")]  # fmt: skip
    for edit, match in cases:
        with pytest.raises(CorruptCheckpointError, match=match):
            _plans_of(_edit_map(f0, edit), local)


def test_a_param_no_map_or_pattern_covers_is_refused():
    f0, local = _one()
    with pytest.raises(CorruptCheckpointError, match="covered neither"):
        _plans_of(f0, {**local, "model.extra.weight": [(4,), (4,)]})


def test_a_name_two_patterns_match_is_refused():
    f0, local = _one()

    def twice(info, entry):
        info["affine_map"]["params"]["^model\\.layers\\.0\\.self_attn\\.q_proj"] = entry

    with pytest.raises(CorruptCheckpointError, match="matches 2 patterns"):
        _plans_of(_edit_map(f0, twice), local)


def test_an_invalid_pattern_is_refused():
    f0, local = _one()
    with pytest.raises(CorruptCheckpointError, match="invalid pattern"):
        _plans_of(_with_info(_without_affine_map(f0), vocabulary_parameter_patterns=["(unclosed"]), local)


def test_shards_that_do_not_concatenate_are_refused():
    f0, local = _one()
    local = {**local, "model.layers.0.mlp.up_proj.weight": [(12, 16), (12, 15)]}
    with pytest.raises(CorruptCheckpointError, match="do not concatenate"):
        _plans_of(_without_affine_map(f0), local)


@pytest.mark.parametrize("size", [0, -3, True, 40.5])
def test_an_original_vocab_size_that_is_no_row_count_is_refused(size):
    f0, local = _one()
    with pytest.raises(CorruptCheckpointError, match="not a positive row count"):
        _plans_of(_with_info(f0, original_vocab_size=size), local)


@pytest.mark.parametrize("size", ["40", [40]])
def test_an_original_vocab_size_of_another_type_is_refused_as_damage(size):
    f0, local = _one()
    with pytest.raises(CorruptCheckpointError, match="not a positive row count"):
        _plans_of(_with_info(f0, original_vocab_size=size), local)

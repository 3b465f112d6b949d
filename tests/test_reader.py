"""The validated checkpoint model: each mix-up the issue tracker reported is refused by name, before any output.

(tests/test_mutations.py generates thousands of such cases; these are the reported ones, by name.)
"""

import shutil

import pytest
import torch

from ckpttools import consolidate, read_checkpoint, reshard
from ckpttools.errors import CkptError, CorruptCheckpointError

from .conftest import FIXTURES, tree_digest

Z2 = "z2_dp2_bf16"
Z3 = "z3_dp2_bf16"
OPT = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


def _copy(tmp_path, name):
    shutil.copytree(FIXTURES / name / "checkpoint", tmp_path / "ckpt")
    return tmp_path / "ckpt", next(p for p in (tmp_path / "ckpt").iterdir() if p.is_dir())


def _edit(path, change):
    """Rewrite a (trusted, copied) rank file with one semantic change, under its own name."""
    obj = torch.load(path, weights_only=False, map_location="cpu")
    change(obj)
    torch.save(obj, path)


def _refused(ckpt, tmp_path, match):
    before = tree_digest(ckpt)
    for run in (lambda: consolidate(ckpt, tmp_path / "out"), lambda: reshard(ckpt, tmp_path / "rs", dp=3)):
        with pytest.raises(CkptError, match=match):
            run()
    assert tree_digest(ckpt) == before
    assert not [p for p in tmp_path.iterdir() if p.name not in ("ckpt", "other")]  # no output, no temp folder


def _swap(a, b):
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("name,pattern", [(Z2, OPT), (Z3, OPT), (Z3, MODEL3)])
def test_swapped_rank_files(tmp_path, name, pattern):
    ckpt, tag = _copy(tmp_path, name)
    _swap(tag / pattern.format(0), tag / pattern.format(1))
    _refused(ckpt, tmp_path, "holds the data of")


def test_a_rank_file_copied_over_another(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    shutil.copy(tag / OPT.format(0), tag / OPT.format(1))
    _refused(ckpt, tmp_path, "holds the data of")


@pytest.mark.parametrize("name", [Z2, Z3])
def test_a_rank_file_from_another_step(tmp_path, name):
    ckpt, tag = _copy(tmp_path, name)
    _edit(tag / OPT.format(1), lambda o: _bump_step(o["optimizer_state_dict"]))
    _refused(ckpt, tmp_path, "disagrees with .* on the optimizer step")


def _bump_step(osd):
    state = (
        osd["base_optimizer_state"]["state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"]["state"]
    )
    for entry in state.values():
        entry["step"] = entry["step"] + 1


def test_a_master_partition_stored_as_int16_is_not_reinterpreted(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)

    def to_int16(o):
        parts = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        parts[0] = parts[0].view(torch.int16)[: parts[0].numel()].clone()

    _edit(tag / OPT.format(0), to_int16)
    _refused(ckpt, tmp_path, "stored as int16")


def test_a_removed_param_shapes_group(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    _edit(tag / "mp_rank_00_model_states.pt", lambda o: o["param_shapes"].pop())
    _refused(ckpt, tmp_path, "param groups")


def test_removed_shared_params_do_not_write_an_extra_tensor(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    _edit(tag / "mp_rank_00_model_states.pt", lambda o: o.update(shared_params={}))
    _refused(ckpt, tmp_path, "head.weight")


def test_an_adam_moment_deleted_from_one_rank(tmp_path):
    ckpt, tag = _copy(tmp_path, Z3)
    _edit(tag / OPT.format(0), lambda o: o["optimizer_state_dict"]["optimizer_state_dict"]["state"][0].pop("exp_avg"))
    _refused(ckpt, tmp_path, "optimizer state keys")


def test_masters_that_are_not_the_module_s_weights_are_refused(tmp_path):
    """An optimizer file whose fp32 masters are not those the module's 16-bit weights were cast from (here: every
    master of rank 1 moved by one ulp-breaking step, CRCs intact) is caught by the module check."""
    ckpt, tag = _copy(tmp_path, Z2)

    def shift(o):
        parts = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        parts[0] = parts[0] + 1.0

    _edit(tag / OPT.format(1), shift)
    _refused(ckpt, tmp_path, "does not match the module")


@pytest.mark.parametrize("text", ["", "../global_step2", "/etc", "\xff"])
def test_odd_latest(tmp_path, text):
    ckpt, _ = _copy(tmp_path, Z2)
    (ckpt / "latest").write_bytes(text.encode("latin-1"))
    _refused(ckpt, tmp_path, "tag|latest")


@pytest.mark.parametrize("text", ['\ufeff{"model_type": "gpt2"', "[1, 2]", "null", "1" * 5000, "{" * 100000])
def test_a_broken_config_json_is_one_line_before_anything_is_written(tmp_path, text):
    shutil.copytree(FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(text)
    before = tree_digest(tmp_path / "ckpt")
    with pytest.raises(CkptError, match=r"config\.json"):
        consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert tree_digest(tmp_path / "ckpt") == before and not (tmp_path / "out").exists()


def test_a_bom_in_config_json_is_tolerated_and_not_written_back(tmp_path):
    shutil.copytree(FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2", tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes()[:1] == b"{"


def test_same_size_reshard_checks_every_record(tmp_path):
    ckpt, tag = _copy(tmp_path, Z2)
    path = tag / OPT.format(1)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # inside the last tensor record, past the pickle
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        reshard(ckpt, tmp_path / "same", dp=2)
    assert not (tmp_path / "same").exists()


@pytest.mark.parametrize("name", ["z1_dp2_bf16_step0", "z2_dp2_bf16_step0", "z3_dp2_bf16_step0"])
def test_checkpoints_saved_before_the_first_step_reshard_both_ways(tmp_path, name):
    src = FIXTURES / name / "checkpoint"
    assert read_checkpoint(src).state_keys == []
    reshard(src, tmp_path / "dp3", dp=3)
    reshard(src, tmp_path / "u", universal=True)
    reshard(tmp_path / "u", tmp_path / "back", dp=2)
    assert read_checkpoint(tmp_path / "dp3").dp_world_size == 3 and read_checkpoint(tmp_path / "back").state_keys == []

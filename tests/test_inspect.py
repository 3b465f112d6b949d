"""ops/inspect: the summary's counts and sizes are those of the files DeepSpeed and the Trainer write for the run."""

import json
import math
import shutil

import pytest
from safetensors.torch import load_file

from ckpttools import inspect_checkpoint
from ckpttools.errors import CorruptCheckpointError

from .conftest import FIXTURES, fixture_meta

ENGINE = ["z1_dp2_bf16", "z2_dp2_bf16", "z3_dp3_bf16", "z2_dp2_fp32"]


def _numel(shape):
    return math.prod(shape)


@pytest.mark.parametrize("name", ENGINE)
def test_counts_are_the_runs(name):
    meta = fixture_meta(name)
    info = inspect_checkpoint(FIXTURES / name / "checkpoint")
    shapes = meta["param_shapes"]
    assert info["trainable_parameters"] == sum(_numel(shapes[n]) for n in meta["trainable"])
    assert info["frozen_parameters"] == sum(_numel(shapes[n]) for n in meta["frozen"])
    assert (info["num_trainable"], info["num_frozen"]) == (len(meta["trainable"]), len(meta["frozen"]))
    assert info["num_buffers"] == len(meta["buffers"])
    assert info["tied"] == meta["tied"]
    assert info["optimizer_states"] == ["exp_avg", "exp_avg_sq"]
    assert info["fp32_master_bytes"] == 4 * info["trainable_parameters"]
    assert info["parallel"]["dp"] == meta["dp"] and info["tags"] == ["global_step2"]
    assert info["trainer_state"] is None and info["gathered_16bit_weights"] == []
    assert info["optimizer_saved"] is True and info["optimizer_state_bytes"] > 0
    json.dumps(info)  # plain JSON values only


@pytest.mark.parametrize("name", ENGINE)
def test_output_sizes_are_those_of_deepspeeds_own_state_dicts(name):
    """Without a config the output holds every state-dict key: the engine's 16-bit state dict, and
    zero_to_fp32's tensors in fp32 (it keeps frozen 16-bit params as they are; the output upcasts them)."""
    info = inspect_checkpoint(FIXTURES / name / "checkpoint")
    bit16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    fp32 = load_file(FIXTURES / name / "reference" / "zero_to_fp32.safetensors")
    train = fixture_meta(name)["dtype"]
    if train == "bf16":
        assert info["output_bytes"]["bfloat16"] == sum(t.nbytes for t in bit16.values())
    floating = [t for t in fp32.values() if t.is_floating_point()]
    if len(fp32) == len(bit16):
        assert info["output_bytes"]["float32"] == sum(t.nbytes for t in fp32.values() if not t.is_floating_point()) + (
            4 * sum(t.numel() for t in floating)
        )
    assert info["num_parameters"] == sum(t.numel() for t in bit16.values())
    assert info["output_bytes"]["float16"] == info["output_bytes"]["bfloat16"]  # the same tensors, 2 bytes each


def test_a_trainer_folder_reports_its_state_and_saved_weights():
    folder = FIXTURES / "trainer_z3_gather_bf16" / "out"
    info = inspect_checkpoint(folder / "checkpoint-2")
    state = json.loads((folder / "checkpoint-2" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert info["trainer_state"] == {
        "global_step": state["global_step"],
        "epoch": state["epoch"],
        "last_loss": losses[-1] if losses else None,
        "best_model_checkpoint": state.get("best_model_checkpoint"),
    }
    assert info["gathered_16bit_weights"] == ["model.safetensors"]
    assert {"config.json", "tokenizer.json"} <= set(info["hf_files"])
    # with a config.json of tied embeddings the output leaves lm_head.weight out, as save_pretrained does
    saved = load_file(folder / "checkpoint-2" / "model.safetensors")
    assert info["output_bytes"]["bfloat16"] == sum(t.nbytes for t in saved.values())
    assert info["num_parameters"] == sum(t.numel() for t in saved.values())


def test_optimizer_files_of_another_run_are_refused(tmp_path):
    """Optimizer files of another run (another optimizer) beside the module file: the files disagree."""
    for name in ("z2_dp2_bf16", "z2_dp2_bf16_sgd"):
        shutil.copytree(FIXTURES / name / "checkpoint", tmp_path / name)
    tag = tmp_path / "z2_dp2_bf16" / "global_step2"
    for f in (tmp_path / "z2_dp2_bf16_sgd" / "global_step2").glob("*optim_states.pt"):
        shutil.copy(f, tag / f.name)
    with pytest.raises(CorruptCheckpointError, match="from another save or run"):
        inspect_checkpoint(tmp_path / "z2_dp2_bf16")


def test_a_damaged_trainer_state_does_not_stop_inspect(tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2", folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": 5}))
    assert inspect_checkpoint(folder)["trainer_state"]["last_loss"] is None


DCP = ["fsdp2_dcp_dp2_fp32", "fsdp2_dcp_dp3_bf16", "accelerate_fsdp2_sharded", "accelerate_fsdp2_rankfiles",
       "fsdp2_hf_safetensors"]  # fmt: skip
DOCS = (FIXTURES.parent / "docs" / "json.md").read_text()


@pytest.mark.parametrize("name", DCP + ENGINE)
def test_every_field_is_documented_and_empty_means_null(name):
    """issue 35: no undocumented field (checkpoint_kind, trainer_output_dir, parallel.kind dcp and its facts); what a
    writer does not record is null, not "" or {}; a 16-bit FSDP2 save holds no fp32 master."""
    info = inspect_checkpoint(FIXTURES / name / "checkpoint")
    inspect_rows = [line for line in DOCS.splitlines() if line.startswith(("| inspect |", "| `"))]
    for key in info:
        assert any(f"`{key}`" in row for row in inspect_rows), key
    parallel_row = next(row for row in inspect_rows if "`parallel`" in row)
    for key, value in info["parallel"].items():
        assert f"`{key}`" in parallel_row or key in ("stages", "experts"), key
        if key == "kind":
            assert f"`{value}`" in parallel_row
    assert info["trainer_state"] is None
    assert "" not in (info["ds_version"], info["optimizer"]) and info["tags"]
    if fixture_meta(name).get("kind") == "fsdp2":
        assert info["ds_version"] is None and info["optimizer"] is None and info["zero_stage"] is None
        stored_fp32 = fixture_meta(name).get("dtype") == "fp32"
        assert (info["fp32_master_bytes"] > 0) == stored_fp32, info["fp32_master_bytes"]

"""Pipeline x tensor parallelism (fixtures/pp2_tp2_*, fixtures/build/fixture_pipe_tp.py): DeepSpeed's PipelineModule
over a pipe 2 x model 2 topology with the builder's own Megatron-style TP layers (vocabulary-parallel embedding and
head, column-parallel up, row-parallel down, replicated LayerNorms and row-parallel bias).

Each TP rank reads as a pipeline checkpoint (`mp_rank_{s*2+t}`, `layer_XX-model_{t}`); the TP merge follows the
`universal_checkpoint_info` Megatron-DeepSpeed saves in every mp_rank file. `consolidate` writes exactly what the live
engines held (their shards gathered and merged by the layers' own split) and what DeepSpeed's ds_to_universal merged;
a folder without the rules is refused, as DeepSpeed's ds_to_universal refuses it. The slow tests prove
`ckpt reshard --dp 2` and `--universal` by a real engine at DP 2 x TP 2 x PP 2 (8 processes) loading the result and
training one more step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.layouts.pipeline_tp import LAYOUT, read_pipeline_tp, tp_rank_files
from ckpttools.layouts.registry import locate, open_checkpoint

from .conftest import FIXTURES, fixture_meta, tree_digest

MEGATRON = "pp2_tp2_dp1_z1_bf16_megatron"
PLAIN = "pp2_tp2_dp1_z1_bf16"


def reference(name: str, which: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference" / which)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def copy_checkpoint(name: str, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / name / "checkpoint", root)
    return root, root / (root / "latest").read_text().strip()


def test_the_fixtures_are_what_deepspeed_wrote() -> None:
    meta = fixture_meta(MEGATRON)
    assert meta["mp_rank_of"] == {"stage0_tp0": 0, "stage0_tp1": 1, "stage1_tp0": 2, "stage1_tp1": 3}
    assert meta["zero_to_fp32"]["error"] == "AttributeError: 'NoneType' object has no attribute 'items'"
    assert meta["ds_to_universal"]["ok"] is True
    plain = fixture_meta(PLAIN)
    assert plain["ds_to_universal"] == {
        "ok": False,
        "error": "AssertionError: Required universal_checkpoint_info state is missing in checkpoint. Verify that "
        "client creates this state.",
    }


def test_each_tp_rank_is_a_pipeline_of_its_own_files() -> None:
    names = fixture_meta(MEGATRON)["tag_files"]
    per_tp = tp_rank_files(names, "tag")
    assert [f.stages for f in per_tp] == [
        {0: "mp_rank_00_model_states.pt", 1: "mp_rank_02_model_states.pt"},
        {0: "mp_rank_01_model_states.pt", 1: "mp_rank_03_model_states.pt"},
    ]
    assert per_tp[1].layers[3] == "layer_03-model_01-model_states.pt"
    assert per_tp[1].optims[1] == {0: "bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt"}


def test_reader_merges_by_the_saved_rules() -> None:
    meta = fixture_meta(MEGATRON)
    ckpt = read_pipeline_tp(locate(FIXTURES / MEGATRON / "checkpoint"))
    assert ckpt.keys == meta["whole_model_keys"]
    layout = ckpt.layout
    assert (layout.kind, layout.pp, layout.tp, layout.dp) == ("pipeline_tp", 2, 2, 1)
    split = layout.details["tp_split"]
    assert split["dim 1"] == ["1.down.weight", "2.down.weight"]
    assert split["dim 0, vocabulary cut to 15 rows"] == ["0.word_embeddings.weight", "3.lm_head.weight"]
    assert sorted(split["replicated"]) == sorted(k for k, v in meta["tp_split"].items() if v == "replicated")
    assert sorted(split["dim 0"]) == sorted(k for k, v in meta["tp_split"].items() if v == "dim 0 (column-parallel)")
    assert [len(s.params) for s in ckpt.slices] == [7, 7, 9, 9]  # (stage, TP rank) in mp_rank order
    assert LAYOUT.describe(layout.as_dict())[0] == "stages         stage 0: layers 0, 1; stage 1: layers 2, 3"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidate_writes_the_engines_merged_weights(dtype: str, tmp_path: Path) -> None:
    from ckpttools.ops.consolidate import consolidate

    before = tree_digest(FIXTURES / MEGATRON / "checkpoint")
    consolidate(FIXTURES / MEGATRON / "checkpoint", tmp_path / "out", dtype=dtype)
    written = load_file(tmp_path / "out" / "model.safetensors")
    full, bit16 = reference(MEGATRON, "full_state.safetensors"), reference(MEGATRON, "bit16.safetensors")
    universal = reference(MEGATRON, "universal_full.safetensors")
    assert sorted(written) == sorted(fixture_meta(MEGATRON)["whole_model_keys"])
    for key, t in written.items():
        assert same(t, full[f"fp32/{key}"] if dtype == "fp32" else bit16[key]), key
        if dtype == "fp32":
            assert same(t, universal[f"fp32/{key}"]), key  # DeepSpeed's own merge agrees
    assert tree_digest(FIXTURES / MEGATRON / "checkpoint") == before


def test_masters_and_moments_equal_the_live_engines_and_ds_to_universal() -> None:
    from ckpttools.io.safetensors_writer import read_tensor
    from ckpttools.io.torchfile import RecordReader

    ckpt = open_checkpoint(FIXTURES / MEGATRON / "checkpoint")
    full, universal = reference(MEGATRON, "full_state.safetensors"), reference(MEGATRON, "universal_full.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            for key, src in [("fp32", p.fp32), *p.states.items()]:
                t = read_tensor(src, reader)
                assert same(t, full[f"{key}/{p.name}"]), (key, p.name)
                assert same(t, universal[f"{key}/{p.name}"]), (key, p.name)
        reader.finish()


def test_without_the_rules_it_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedCheckpointError) as e:
        open_checkpoint(FIXTURES / PLAIN / "checkpoint")
    msg = one_line(e)
    assert "do not say how each parameter is split over TP" in msg
    assert "no universal_checkpoint_info" in msg


def test_rules_given_for_a_folder_without_them_merge_it_as_the_layers_split() -> None:
    """The plain save (no client state) merged with the rules the builder's layers follow, told by the caller: the
    same full tensors as the live engines' shards merged by the layers' own split; the rules go into the model
    files' dicts, so a reshard carries them."""
    from ckpttools.io.safetensors_writer import read_tensor
    from ckpttools.io.torchfile import RecordReader
    from fixtures.build.fixture_pipe_tp import UC_INFO

    ckpt = read_pipeline_tp(locate(FIXTURES / PLAIN / "checkpoint"), rules=UC_INFO)
    full, bit16 = reference(PLAIN, "full_state.safetensors"), reference(PLAIN, "bit16.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            for key, src in [("fp32", p.fp32), *p.states.items()]:
                assert same(read_tensor(src, reader), full[f"{key}/{p.name}"]), (key, p.name)
        for name, src in ckpt.bit16.items():
            assert same(read_tensor(src, reader), bit16[name]), name
        reader.finish()
    assert all(m["universal_checkpoint_info"] == UC_INFO for m in ckpt.model_files)
    with pytest.raises(UnsupportedCheckpointError) as e:
        read_pipeline_tp(locate(FIXTURES / MEGATRON / "checkpoint"), rules={**UC_INFO, "original_vocab_size": 16})
    assert "differ from the universal_checkpoint_info saved" in one_line(e)


def test_a_replicated_param_that_differs_between_tp_ranks_is_refused(tmp_path: Path) -> None:
    """TP rank 1's copy of a replicated LayerNorm weight changed (saved back by torch under its own name):
    consolidate's cross-check compares every TP rank's copy of a replicated param, as ds_to_universal asserts."""
    from ckpttools.ops.consolidate import consolidate

    root, tag = copy_checkpoint(MEGATRON, tmp_path)
    path = tag / "layer_01-model_01-model_states.pt"
    sd = torch.load(path, weights_only=True)
    sd["ln.weight"] = sd["ln.weight"] + 1
    torch.save(sd, path)
    with pytest.raises(CorruptCheckpointError) as e:
        consolidate(root, tmp_path / "out", dtype="bf16")
    assert "1.ln.weight" in one_line(e)


def test_missing_and_swapped_files_are_named(tmp_path: Path) -> None:
    root, tag = copy_checkpoint(MEGATRON, tmp_path)
    (tag / "layer_01-model_01-model_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError) as e:
        open_checkpoint(root)
    assert "layer_01" in one_line(e)
    shutil.rmtree(root)
    root, tag = copy_checkpoint(MEGATRON, tmp_path)
    a, b = tag / "layer_01-model_00-model_states.pt", tag / "layer_01-model_01-model_states.pt"
    a.rename(tag / "x")
    b.rename(a)
    (tag / "x").rename(b)
    with pytest.raises(CorruptCheckpointError) as e2:
        open_checkpoint(root)
    assert "layer_01-model_0" in one_line(e2)


def test_universal_folder_holds_what_ds_to_universal_merged(tmp_path: Path) -> None:
    """reshard --universal: per param the full tensors DeepSpeed's ds_to_universal wrote (vocabulary padding cut),
    with its markers (cat_dim 0/1, none for replicated params, vocab_tensor), and all four mp_rank files."""
    from ckpttools.ops.reshard import reshard

    out = tmp_path / "u"
    reshard(FIXTURES / MEGATRON / "checkpoint", out, universal=True)
    tag = out / fixture_meta(MEGATRON)["tag"]
    assert sorted(p.name for p in tag.glob("mp_rank_*")) == [f"mp_rank_0{m}_model_states.pt" for m in range(4)]
    universal = reference(MEGATRON, "universal_full.safetensors")
    for key, want in universal.items():
        state, name = key.split("/", 1)
        got = torch.load(tag / "zero" / name / f"{state}.pt", weights_only=False)
        assert same(got["param"], want), key
    down = torch.load(tag / "zero" / "1.down.weight" / "fp32.pt", weights_only=False)
    embed = torch.load(tag / "zero" / "0.word_embeddings.weight" / "fp32.pt", weights_only=False)
    ln = torch.load(tag / "zero" / "1.ln.weight" / "fp32.pt", weights_only=False)
    assert (down["cat_dim"], embed["cat_dim"], embed["vocab_tensor"], "cat_dim" in ln) == (1, 0, True, False)


def _load(checkpoint: Path, tmp_path: Path, universal: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    from fixtures.build import ds_launch

    dump = tmp_path / "dump.safetensors"
    args = ["load", *(["--universal"] if universal else []), "--load", str(checkpoint), "--out", str(dump)]
    run = ds_launch.torchrun(8, "fixtures.build.fixture_pipe_tp", args, cwd=tmp_path, timeout=900)
    assert run.rc == 0, run.tail()
    return load_file(dump), json.loads(dump.with_suffix(".json").read_text())


def _assert_holds_the_reference(got: dict[str, torch.Tensor], facts: dict) -> None:
    meta = fixture_meta(MEGATRON)
    want = {**reference(MEGATRON, "full_state.safetensors"),
            **{f"module/{k}": v for k, v in reference(MEGATRON, "bit16.safetensors").items()}}  # fmt: skip
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert same(got[key], t), key
    assert facts["dp"] == 2
    assert facts["global_steps_after_load"] == meta["global_steps"]
    assert all(s == [meta["global_steps"]] for s in facts["optimizer_steps_after_load"])
    assert facts["global_steps_after_training"] == meta["global_steps"] + 1
    assert all(math.isfinite(loss) for loss in facts["losses_after_load"])


@pytest.mark.slow
def test_deepspeed_resumes_a_universal_reshard_at_dp2(tmp_path: Path) -> None:
    """The universal folder loads with load_universal at DP 2 x TP 2 x PP 2 (8 processes): every rank cuts its TP
    shard by the markers; the state equals the saving engines' (vocabulary rows past 15 are padding, which the
    universal format drops as ds_to_universal does: DeepSpeed pads them back with zeros)."""
    pytest.importorskip("deepspeed")
    from ckpttools.ops.reshard import reshard

    out = tmp_path / "universal"
    reshard(FIXTURES / MEGATRON / "checkpoint", out, universal=True)
    _assert_holds_the_reference(*_load(out, tmp_path, universal=True))


@pytest.mark.slow
def test_deepspeed_loads_a_dp2_reshard_and_trains_on(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from ckpttools.ops.reshard import reshard

    out = tmp_path / "resharded"
    reshard(FIXTURES / MEGATRON / "checkpoint", out, dp=2)
    _assert_holds_the_reference(*_load(out, tmp_path))

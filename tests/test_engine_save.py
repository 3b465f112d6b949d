"""save_pretrained_from_engine and ConsolidateCallback.

Fast tests run in this process on plain modules (ZeRO-0 path, no torch.distributed). The slow ones run
real DeepSpeed engines and a real Trainer on CPU with torchrun (2 ranks, gloo) through
tests/support/engine_save_worker.py, and compare bit for bit with DeepSpeed's own 16-bit weights, with
`ckpt consolidate --dtype bf16` of the checkpoint saved at the same step, and with from_pretrained.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.errors import OutputError, UsageError
from ckpttools.io import dtypes
from ckpttools.io.staging import MANIFEST
from ckpttools.live.engine_save import (
    _Entry,
    plan_gathers,
    plan_tensors,
    save_pretrained_from_engine,
    tied_target_matcher,
)
from ckpttools.ops.verify import verify_folder
from fixtures.build import ds_launch
from fixtures.build import fixture_worker as fw  # the toy model with tied/frozen/int/non-persistent buffers

ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.engine_save_worker"

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def tiny_gpt2(dtype=torch.bfloat16, tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=56,
        n_positions=32,
        bos_token_id=2,
        eos_token_id=2,
        tie_word_embeddings=tie,
    )
    return GPT2LMHeadModel(config).to(dtype)


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder (single file or index)."""
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(folder / f))
    return out


def header_metadata(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]).get("__metadata__")


def assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for k, tensor in ours.items():
        assert tensor.dtype == ref[k].dtype, k
        assert torch.equal(tensor, ref[k]), k


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)  # (model, loading info)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


# --------------------------------------------------------------------------------------------------
# fast: plain modules in this process
# --------------------------------------------------------------------------------------------------


def test_plain_hf_model_matches_save_pretrained(tmp_path):
    model = tiny_gpt2()
    result = save_pretrained_from_engine(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "hf")
    names = [MANIFEST, "config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path / "ours")) == names
    assert result.files == ["model.safetensors", "config.json", "generation_config.json"]
    assert_same(read_folder(tmp_path / "ours"), read_folder(tmp_path / "hf"))
    assert result.omitted_aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert header_metadata(tmp_path / "ours" / "model.safetensors") == {"format": "pt"}
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["GPT2LMHeadModel"]
    loaded = load_hf(tmp_path / "ours")
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert result.gathers == 0 and result.peak_gathered_bytes == 0 and result.peak_buffer_bytes == 0  # zero-copy


def test_untied_config_keeps_both_weights(tmp_path):
    """tie_word_embeddings=False: lm_head is its own tensor, so both are written and both load."""
    model = tiny_gpt2(tie=False)
    result = save_pretrained_from_engine(model, tmp_path / "out")
    assert "lm_head.weight" in read_folder(tmp_path / "out") and not result.omitted_aliases
    load_hf(tmp_path / "out")


def test_cast_to_fp32_sharded_with_index(tmp_path):
    model = tiny_gpt2()
    result = save_pretrained_from_engine(model, tmp_path / "out", dtype="fp32", max_shard_size="6KB", chunk_bytes=40)
    shards = [f for f in result.files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in result.files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"] == {
        "total_size": sum(v.numel() * 4 for v in state.values()),
        "total_parameters": sum(v.numel() for v in state.values()),
    }
    for shard in shards:
        assert header_metadata(tmp_path / "out" / shard) == {"format": "pt"}
    assert_same(read_folder(tmp_path / "out"), {k: v.float() for k, v in state.items()})
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert load_hf(tmp_path / "out").dtype == torch.float32
    assert 0 < result.peak_buffer_bytes <= 40


def test_plain_module_keeps_alias_copies_buffers_and_frozen(tmp_path):
    torch.manual_seed(0)
    model = fw.ToyModel().to(torch.bfloat16)  # .to() casts the float buffer too; counts stays int64
    model.counts[1] = 5
    result = save_pretrained_from_engine(model, tmp_path / "out")
    ours = read_folder(tmp_path / "out")
    state = model.state_dict()
    assert list(ours) == list(state)  # order too; no `mask` (non-persistent); head.weight as a copy
    assert "mask" not in ours and "frozen.weight" in ours and "head.weight" in ours
    assert_same(ours, dict(state))
    assert ours["counts"].dtype == torch.int64 and ours["counts"].tolist() == [7, 5, -3]
    assert result.copied_aliases == {"head.weight": "emb.weight"} and not result.omitted_aliases
    assert not (tmp_path / "out" / "config.json").exists()  # a plain module has no config
    model2 = fw.ToyModel().to(torch.bfloat16)
    model2.load_state_dict(ours, strict=True)
    result = save_pretrained_from_engine(model, tmp_path / "trainable", exclude_frozen_parameters=True)
    assert set(read_folder(tmp_path / "trainable")) == set(ours) - {"frozen.weight", "frozen.bias"}
    with pytest.raises(UsageError, match="meta device"):
        save_pretrained_from_engine(model.to("meta"), tmp_path / "meta")


def test_fp32_output_upcasts_float_buffers_keeps_int(tmp_path):
    torch.manual_seed(0)
    model = fw.ToyModel()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)  # a bf16 engine: params bf16, buffers as registered (fp32 / int64)
    save_pretrained_from_engine(model, tmp_path / "bf16", dtype="bf16")
    save_pretrained_from_engine(model, tmp_path / "fp32", dtype="fp32")
    b16, f32 = read_folder(tmp_path / "bf16"), read_folder(tmp_path / "fp32")
    assert b16["scale"].dtype == torch.float32 and b16["counts"].dtype == torch.int64  # as `ckpt consolidate`
    assert b16["emb.weight"].dtype == torch.bfloat16 and f32["emb.weight"].dtype == torch.float32
    assert torch.equal(f32["emb.weight"], b16["emb.weight"].float()) and f32["counts"].dtype == torch.int64


def test_plan_is_made_before_writing(tmp_path):
    """Names, shapes and dtypes come from the module alone; ZeRO-3 params contribute their ds_shape."""
    model = fw.ToyModel()
    fake = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    fake.ds_id, fake.ds_shape = 7, torch.Size([24, 8])
    model.emb.weight = fake
    model.head.weight = fake
    entries, omitted, copied = plan_tensors(model, dtypes.BFLOAT16)
    by_name = {e.name: e for e in entries}
    assert by_name["emb.weight"].partitioned and by_name["emb.weight"].shape == (24, 8)
    assert by_name["head.weight"].ident == ("ds", 7) and copied == {"head.weight": "emb.weight"} and not omitted
    assert by_name["counts"].dtype is dtypes.INT64 and by_name["scale"].dtype is dtypes.FLOAT32


def _entry(name, nbytes, partitioned=True, ident=None):
    return _Entry(name, "param", None, (nbytes // 2,), dtypes.BFLOAT16, dtypes.BFLOAT16, partitioned, ident or (name,))


def test_gather_groups_respect_the_budget():
    shards = {
        "a": [_entry("x", 400), _entry("y", 400), _entry("b", 8, partitioned=False), _entry("z", 300)],
        "b": [_entry("big", 5000), _entry("w", 100), _entry("x2", 400, ident=("x",))],
    }
    groups = plan_gathers(shards, 1000)
    names = [[e.name for _, e in g] for g in groups]
    assert names == [["x", "y", "b"], ["z"], ["big"], ["w", "x2"]]
    assert [f for f, _ in groups[0]] == ["a", "a", "a"]  # (file, entry) in write order
    assert len(plan_gathers(shards, 10**9)) == 1


def test_tied_targets_v4_style_patterns():
    module = torch.nn.Module()
    module._tied_weights_keys = [r"lm_head\.weight"]
    is_target = tied_target_matcher(module)
    assert is_target("lm_head.weight") and not is_target("wte.weight")
    assert not tied_target_matcher(torch.nn.Linear(2, 2))("weight")


def test_existing_output_folder(tmp_path):
    model = tiny_gpt2()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        save_pretrained_from_engine(model, out)
    assert os.listdir(out) == ["keep.txt"]
    # add: stale safetensors weights go (they would shadow or mix with the new ones), other files stay
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    (out / "model.safetensors.index.json").write_text("{}")
    save_pretrained_from_engine(model, out, if_exists="add")
    names = [MANIFEST, "config.json", "generation_config.json", "keep.txt", "model.safetensors"]
    assert sorted(os.listdir(out)) == names
    load_hf(out)
    with pytest.raises(OutputError, match=r"keep\.txt, which ckpt did not write"):  # replace: only what ckpt wrote
        save_pretrained_from_engine(model, out, if_exists="replace")
    (out / "keep.txt").unlink()
    save_pretrained_from_engine(model, out, if_exists="replace", max_shard_size="10KB")
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    with pytest.raises(UsageError):
        save_pretrained_from_engine(model, out, if_exists="merge")
    with pytest.raises(UsageError):
        save_pretrained_from_engine(model, out, dtype="int8")


def test_failure_while_writing_publishes_nothing(tmp_path, monkeypatch):
    from ckpttools.live import engine_save

    def boom(self, entry):
        raise OSError("disk full")

    monkeypatch.setattr(engine_save._ShardWriter, "_write_tensor", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained_from_engine(tiny_gpt2(), tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_config_argument(tmp_path):
    model = fw.ToyModel()
    save_pretrained_from_engine(model, tmp_path / "a", config={"model_type": "toy", "dtype": "float16"}, dtype="bf16")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "bfloat16"
    tiny_gpt2().config.save_pretrained(tmp_path / "cfg")
    save_pretrained_from_engine(model, tmp_path / "b", config=tmp_path / "cfg")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model_type"] == "gpt2"


def test_v5_weight_conversion_is_noted(tmp_path):
    """Mixtral's experts are fused in memory in transformers v5: written as such (v5 loads them), with a note."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model = MixtralForCausalLM(config)
    result = save_pretrained_from_engine(model, tmp_path / "out")
    assert any("converts weights on load" in n for n in result.notes)
    loaded = load_hf(tmp_path / "out")
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=False):
        assert torch.equal(a, b), k


def test_callback_skips_checkpoints_that_hold_weights(tmp_path):
    from ckpttools.live.integrations import ConsolidateCallback

    model = tiny_gpt2()
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(global_step=3)
    callback = ConsolidateCallback(on_train_end=True)
    callback.on_save(args, state, None, model=model)  # no checkpoint-3 folder: nothing to do
    assert callback.results == []
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    callback.on_save(args, state, None, model=model)
    assert callback.results[-1].files[0] == "model.safetensors"
    callback.on_save(args, state, None, model=model)  # now it holds weights: left alone
    assert len(callback.results) == 1
    callback.on_train_end(args, state, None, model=model)
    load_hf(tmp_path / "hf-final")
    trainer = SimpleNamespace(model_wrapped=model, model=model)  # no DeepSpeed: falls back to the module
    assert ConsolidateCallback(trainer).engine(None) is model


# --------------------------------------------------------------------------------------------------
# slow: real DeepSpeed (ZeRO-2 / ZeRO-3, DP=2) and a real Trainer
# --------------------------------------------------------------------------------------------------


def run_worker(args: list[str], log: Path) -> None:
    """torchrun the worker with 2 ranks, each attempt from an empty output folder."""
    pytest.importorskip("deepspeed")

    def empty_output_folder() -> None:
        for leftover in log.parent.iterdir():
            if leftover != log:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()

    run = ds_launch.torchrun(2, WORKER, args, cwd=ROOT, timeout=600, log=log, before_attempt=empty_output_folder)
    if run.rc != 0:
        pytest.fail(f"worker failed (rc={run.rc}):\n{run.tail(5000)}")


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def engine_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"engine_z{request.param}")
    run_worker(["engine", "--stage", str(request.param), "--out", str(out)], out / "log.txt")
    return request.param, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["toy", "gpt2"])
def test_engine_save_matches_deepspeed(engine_run, kind, tmp_path):
    stage, root = engine_run
    out = root / kind
    result = json.loads((out / "result.json").read_text())
    reference = load_file(out / "reference.safetensors")  # _zero3_consolidated_16bit_state_dict / module_state_dict
    ours = read_folder(out / "hf")
    tied = {"lm_head.weight"} if kind == "gpt2" else set()
    assert set(ours) == set(result["state_dict_keys"]) - tied
    assert_same(ours, {k: v for k, v in reference.items() if k not in tied})
    assert result["hf"]["zero_stage"] == stage
    assert result["hf"]["omitted_aliases"] == ({"lm_head.weight": "transformer.wte.weight"} if kind == "gpt2" else {})
    assert result["finite_loss"]

    # the same bytes whatever the sharding and the gather budget
    sharded = result["hf_sharded"]
    assert len([f for f in sharded["files"] if f.startswith("model-")]) > 2
    assert_same(read_folder(out / "hf_sharded"), ours)
    for f in sharded["files"]:
        if f.endswith(".safetensors"):
            assert header_metadata(out / "hf_sharded" / f) == {"format": "pt"}
    if stage == 3:
        assert result["released_after_save"]
        budget = {"toy": 200, "gpt2": 2048}[kind]
        largest = max(v.numel() * v.element_size() for v in ours.values())
        assert sharded["gathers"] > 3
        assert sharded["peak_gathered_bytes"] <= max(budget, largest)
        assert result["hf"]["peak_gathered_bytes"] <= result["hf"]["total_size"]
        if kind == "gpt2":
            assert sharded["peak_gathered_bytes"] < sharded["total_size"] / 4
    else:
        assert result["hf"]["gathers"] == 0 and result["hf"]["peak_gathered_bytes"] == 0

    # fp32: exact upcast of the 16-bit weights, int buffers untouched
    fp32 = read_folder(out / "hf_fp32")
    for k, v in ours.items():
        assert torch.equal(fp32[k], v.float() if v.is_floating_point() else v), k
        if not v.is_floating_point():
            assert fp32[k].dtype == v.dtype

    # `ckpt consolidate --dtype bf16` of the ZeRO checkpoint saved at the same step
    consolidate(out / "checkpoint", tmp_path / "cons", dtype="bf16")
    assert_same(ours, read_folder(tmp_path / "cons"))
    for folder in ("hf", "hf_sharded"):  # `ckpt verify --against`: headers, index, keys, dtype, every tensor
        report = verify_folder(out / folder, against=out / "checkpoint")
        assert report.ok, report.problems

    # errors on rank 0 reach every rank (no hang), nothing half-written is left, and training goes on
    errors = [json.loads((out / f"errors_rank{r}.json").read_text()) for r in (0, 1)]
    assert [e["exists"] for e in errors] == ["OutputError", "OutputError"]
    assert errors[0]["write_error"] == "OSError: simulated disk error"
    assert errors[1]["write_error"] == "CkptError: rank 0 failed: OSError: simulated disk error"
    assert errors[0]["partial_left"] == [] and not (out / "hf_fail").exists()

    if kind == "gpt2":
        for folder in ("hf", "hf_sharded", "hf_fp32"):
            model = load_hf(out / folder)
            assert model.dtype == (torch.float32 if folder == "hf_fp32" else torch.bfloat16)
        assert json.loads((out / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    else:
        model = fw.ToyModel().to(torch.bfloat16)
        model.load_state_dict(ours, strict=True)  # head.weight stored as a copy: strict loading works
        assert ours["counts"].dtype == torch.int64 and ours["counts"].tolist() == [7, 2, -3]
        assert "frozen.weight" in ours and "mask" not in ours


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_z3_nogather")
    run_worker(["trainer", "--out", str(out)], out / "log.txt")
    return out


@pytest.mark.slow
def test_trainer_callback_zero3_without_gather_flag(trainer_run, tmp_path):
    result = json.loads((trainer_run / "result.json").read_text())
    assert result["gather_flag"] is False and result["engine_type"] == "DeepSpeedEngine"
    assert len(result["on_save"]) == 2 and len(result["at_end"]) == 1
    assert all(r["zero_stage"] == 3 and r["gathers"] >= 1 for r in result["on_save"])
    reference = load_file(trainer_run / "reference.safetensors")
    reference.pop("lm_head.weight")
    run = trainer_run / "out"
    for step in (1, 2):
        ckpt = run / f"checkpoint-{step}"
        names = os.listdir(ckpt)
        assert f"global_step{step}" in names and "trainer_state.json" in names  # the Trainer's files stay
        model = load_hf(ckpt)
        assert model.dtype == torch.bfloat16
        ours = read_folder(ckpt)
        cons = consolidate(ckpt, tmp_path / f"cons{step}", dtype="bf16")
        assert_same(ours, read_folder(tmp_path / f"cons{step}"))
        # consolidate also compares the weights it finds beside the shards with the shards
        assert any("match the shards exactly" in n for n in cons.notes), cons.notes
        report = verify_folder(ckpt, against=ckpt)
        assert report.ok, report.problems
    assert_same(read_folder(run / "checkpoint-2"), reference)
    assert_same(read_folder(trainer_run / "final"), reference)
    load_hf(trainer_run / "final")

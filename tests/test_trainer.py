"""Trainer checkpoint folders: from_pretrained loads the result, logits match, companions come along."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttools import consolidate, inspect_checkpoint

from .conftest import FIXTURES, fixture_meta, fixture_names

TRAINER = fixture_names("trainer")


def _newest(name):
    return FIXTURES / name / "out" / fixture_meta(name)["checkpoint"]


def _load(folder, dtype):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    return model, info


@pytest.mark.parametrize("name", TRAINER)
def test_from_pretrained_loads_fp32_with_no_key_problems_and_equal_logits(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    result = consolidate(FIXTURES / name / "out", tmp_path / "hf")
    model, info = _load(tmp_path / "hf", torch.float32)
    assert all(not v for v in info.values()), info
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")  # tied: stored once

    ref_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_newest(name)), dtype=torch.float32)
    ref = load_file(FIXTURES / name / "reference" / "zero_to_fp32.safetensors")
    ref_model.load_state_dict({k: v.float() for k, v in ref.items()}, strict=True)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, ref_model.eval()(ids).logits)
    assert result.source["global_steps"] == 2


@pytest.mark.parametrize("name", TRAINER)
def test_bf16_output_equals_the_engines_16bit_weights_and_loads_as_bf16(name, tmp_path):
    consolidate(FIXTURES / name / "out", tmp_path / "hf", dtype="bf16")
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    ref = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    for key, value in ours.items():
        assert torch.equal(value, ref[key]), key
    model, info = _load(tmp_path / "hf", "auto")
    assert model.dtype == torch.bfloat16 and all(not v for v in info.values())


@pytest.mark.parametrize("name", TRAINER)
def test_companion_files_are_copied(name, tmp_path):
    result = consolidate(FIXTURES / name / "out", tmp_path / "hf")
    src = _newest(name)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / f).read_bytes() == (src / f).read_bytes()
        assert f in result.files
    for f in ("trainer_state.json", "training_args.bin", "latest", "rng_state_0.pth"):
        assert not (tmp_path / "hf" / f).exists()


def test_gathered_16bit_weights_are_checked_against_the_shards(tmp_path):
    names = [n for n in TRAINER if (_newest(n) / "model.safetensors").exists()]
    assert names, "a Trainer fixture with gathered weights is needed"
    result = consolidate(FIXTURES / names[0] / "out", tmp_path / "hf")
    assert any("match the shards exactly" in n for n in result.notes)

    tampered = tmp_path / "tampered"
    shutil.copytree(_newest(names[0]), tampered)
    weights = load_file(tampered / "model.safetensors")
    key = min(weights)
    weights[key] = weights[key] + 1
    save_file(weights, tampered / "model.safetensors", metadata={"format": "pt"})
    result = consolidate(tampered, tmp_path / "hf2")
    assert any("differ from the shards" in n and key in n for n in result.notes)


def test_zero3_without_gathered_weights_is_reconstructed(tmp_path):
    names = [n for n in TRAINER if n.startswith("trainer_z3") and not (_newest(n) / "model.safetensors").exists()]
    assert names
    result = consolidate(FIXTURES / names[0] / "out", tmp_path / "hf", dtype="bf16")
    assert "model.safetensors" in result.files and not any("beside the shards" in n for n in result.notes)


def test_step_selects_an_older_checkpoint_and_inspect_reports_trainer_state():
    name = TRAINER[0]
    info = inspect_checkpoint(FIXTURES / name / "out", step=1)
    assert info["tag"] == "global_step1" and info["path"].endswith("checkpoint-1")
    info = inspect_checkpoint(FIXTURES / name / "out")
    assert info["trainer_state"]["global_step"] == 2 and info["trainer_state"]["last_loss"] is not None
    assert info["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert info["output_bytes"]["float32"] == 2 * info["output_bytes"]["bfloat16"]


def test_check_keys_builds_the_model_and_refuses_a_foreign_config(tmp_path):
    from ckpttools.errors import CkptError

    result = consolidate(FIXTURES / TRAINER[0] / "out", tmp_path / "ok", check_keys=True)
    assert not any("not checked" in n for n in result.notes)

    foreign = tmp_path / "foreign"
    shutil.copytree(_newest(TRAINER[0]), foreign)
    config = json.loads((foreign / "config.json").read_text())
    config["n_layer"] = 3  # a config from another model: layer 2 would load with random weights
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(CkptError, match=r"lacks .*transformer\.h\.2"):
        consolidate(foreign, tmp_path / "bad", check_keys=True)
    assert not (tmp_path / "bad").exists()


def test_untied_config_keeps_the_alias_as_its_own_tensor(tmp_path):
    untied = tmp_path / "untied"
    shutil.copytree(_newest(TRAINER[0]), untied)
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config))
    consolidate(untied, tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])

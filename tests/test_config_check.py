"""Whenever `ckpt consolidate` writes a config.json, the output's keys and shapes are checked against the class it
names (built on the meta device) before anything is published; a check the user asks for (`--check-keys`) that
cannot run fails with the reason; `--config` never silently replaces a checkpoint's own config.json; a tensor
larger than `--max-shard-size` gets its own shard and a note. `from_pretrained` is the oracle: what the check
refuses is what it would fill with random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.errors import UsageError, VerificationError

from .conftest import FIXTURES, fixture_meta
from .test_extras import base_python, ckpt_base  # noqa: F401 - base_python is a fixture

TRAINER = FIXTURES / "trainer_z2_bf16" / "out"  # GPT-2, config.json with architectures, tied embeddings
TRAINER_CONFIG = TRAINER / fixture_meta("trainer_z2_bf16")["checkpoint"] / "config.json"
FSDP2 = "fsdp2_dcp_dp2_fp32"  # Llama, a config.json naming no architecture
PEFT = "peft_trainer_z2_bf16"  # adapters only (exclude_frozen_parameters), base model beside

# A Llama config: on GPT-2 weights, from_pretrained would build every weight at random.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
         "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _fsdp2_copy(tmp_path: Path, **changes: object) -> Path:
    """The FSDP2 run folder with its config.json changed; the checkpoint PATH inside it."""
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / FSDP2 / "checkpoint", run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config.update(changes)
    (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir / Path(fixture_meta(FSDP2)["checkpoint"]).name


# --- issue 32 item 6: a written config.json is always checked -------------------------------------------------


def test_a_foreign_config_is_refused_by_default_naming_the_first_missing_key(tmp_path):
    config = tmp_path / "llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(LLAMA))
    res = run("consolidate", TRAINER, "--out", tmp_path / "out", "--config", config, "--replace-config")
    assert res.exit_code == 1, res.output
    assert not (tmp_path / "out").exists()  # nothing published

    # the oracle: the same weights under that config load in from_pretrained with these keys random, those ignored
    from transformers import AutoModelForCausalLM

    consolidate(TRAINER, tmp_path / "good")
    (tmp_path / "good" / "config.json").write_text(json.dumps(LLAMA))
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "good", output_loading_info=True)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    line = res.output.strip().splitlines()[-1]
    assert (
        line.startswith("Error: ") and f"LlamaForCausalLM expects keys the folder lacks ({len(missing)} missing" in line
    )
    assert f"({len(unexpected)} unexpected" in line and missing[0] in line and unexpected[0] in line


def test_a_config_naming_its_class_fails_by_default_when_the_shapes_do_not_follow(tmp_path):
    path = _fsdp2_copy(tmp_path, architectures=["LlamaForCausalLM"], num_hidden_layers=3)
    with pytest.raises(VerificationError, match=r"lacks \(\d+ missing.*model\.layers\.2\."):
        consolidate(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_good_outputs_pass_and_say_nothing_about_keys(tmp_path):
    for path, out in ((TRAINER, "gpt2"), (FIXTURES / FSDP2 / fixture_meta(FSDP2)["checkpoint"], "llama")):
        result = consolidate(path, tmp_path / out)
        assert not [n for n in result.notes if "keys" in n or "architecture" in n], result.notes


# --- issue 35 item 4: a check asked for that cannot run fails -------------------------------------------------


def test_check_keys_on_a_config_naming_no_architecture_checks_the_auto_classes_or_fails(tmp_path):
    path = _fsdp2_copy(tmp_path, num_hidden_layers=3)  # no architectures, and a layer the weights lack
    result = consolidate(path, tmp_path / "noted")  # not asked: the class is not named, so a note
    assert any("names no architecture" in n and "LlamaForCausalLM nor LlamaModel" in n for n in result.notes)
    res = run("consolidate", path, "--out", tmp_path / "asked", "--check-keys")
    assert res.exit_code == 1 and "--check-keys: config.json names no architecture" in res.output, res.output
    assert not (tmp_path / "asked").exists()


def test_check_keys_without_any_config_fails_before_writing(tmp_path):
    state = FIXTURES / "accelerate_z2_bf16" / "checkpoint"  # save_state: no config.json
    res = run("consolidate", state, "--out", tmp_path / "out", "--check-keys")
    assert res.exit_code == 1 and "--check-keys needs a config.json" in res.output and "--config" in res.output
    assert not (tmp_path / "out").exists()


def test_check_keys_on_a_lora_run_checks_the_adapter_against_peftmodel(tmp_path):
    pytest.importorskip("peft")
    ckpt = FIXTURES / PEFT / fixture_meta(PEFT)["checkpoint"]
    res = run("consolidate", ckpt, "--out", tmp_path / "nobase", "--check-keys")
    assert res.exit_code == 1 and "pass --config (the base model's" in res.output, res.output
    assert not (tmp_path / "nobase").exists()

    res = run("consolidate", ckpt, "--out", tmp_path / "ok", "--check-keys", "--config", FIXTURES / PEFT / "base")
    assert res.exit_code == 0, res.output

    other = tmp_path / "other"
    shutil.copytree(FIXTURES / PEFT / "base", other)
    config = json.loads((other / "config.json").read_text())
    config["n_embd"] *= 2  # another base model: PEFT would refuse the adapter's shapes
    (other / "config.json").write_text(json.dumps(config))
    res = run("consolidate", ckpt, "--out", tmp_path / "bad", "--check-keys", "--config", other)
    assert res.exit_code == 1 and "of the wrong shape" in res.output, res.output
    assert not (tmp_path / "bad").exists()


# --- issue 35: --config beside the checkpoint's own config.json -----------------------------------------------


def test_config_that_differs_from_the_checkpoints_own_is_a_usage_error(tmp_path):
    changed = json.loads(TRAINER_CONFIG.read_text()) | {"use_cache": True}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(changed))
    res = run("consolidate", TRAINER, "--out", tmp_path / "out", "--config", tmp_path / "c")
    assert res.exit_code == 2 and "differs from the checkpoint's own" in res.output and "'use_cache'" in res.output
    assert not (tmp_path / "out").exists()

    result = consolidate(TRAINER, tmp_path / "replaced", config=tmp_path / "c", replace_config=True)
    assert any("replacing the checkpoint's own" in n for n in result.notes)
    assert json.loads((tmp_path / "replaced" / "config.json").read_text())["use_cache"] is True

    same = consolidate(TRAINER, tmp_path / "same", config=TRAINER_CONFIG)  # identical: no conflict, no note
    assert not [n for n in same.notes if "config" in n]
    saver = json.loads(TRAINER_CONFIG.read_text()) | {"transformers_version": "4.0.0", "dtype": "float16"}
    (tmp_path / "saver").mkdir()
    (tmp_path / "saver" / "config.json").write_text(json.dumps(saver))  # only who saved it differs: the same model
    assert not [n for n in consolidate(TRAINER, tmp_path / "o2", config=tmp_path / "saver").notes if "config" in n]
    with pytest.raises(UsageError, match="pass --config too"):
        consolidate(TRAINER, tmp_path / "x", replace_config=True)


# --- issue 35: --max-shard-size smaller than a tensor ---------------------------------------------------------


def test_a_tensor_larger_than_the_shard_size_gets_its_own_shard_and_a_note(tmp_path):
    result = consolidate(TRAINER, tmp_path / "out", max_shard_size=3000)
    note = next(n for n in result.notes if "larger than --max-shard-size" in n)
    assert note.startswith("7 tensors") and "transformer.wte.weight (3,584 bytes" in note
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["transformer.wte.weight"]
    with safe_open(tmp_path / "out" / shard, framework="pt") as f:
        assert list(f.keys()) == ["transformer.wte.weight"]  # alone, as save_pretrained puts it


# --- issue 35: the base install says once what it did not check ----------------------------------------------


def test_base_install_says_once_which_checks_need_the_verify_extra(base_python, tmp_path):  # noqa: F811
    proc = ckpt_base(base_python, "consolidate", TRAINER, "--out", tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["notes"]
    assert not any("ModuleNotFoundError" in n for n in notes), notes
    skipped = [n for n in notes if "ckpttools[verify]" in n]
    assert len(skipped) == 1, notes
    assert "keys and shapes" in skipped[0] and "model.safetensors" in skipped[0]


def test_the_check_runs_in_a_child_when_this_process_has_not_imported_transformers(tmp_path):
    import subprocess
    import sys

    code = "import sys; from ckpttools.cli import main; sys.argv[0] = 'ckpt'; sys.exit(main())"
    path = _fsdp2_copy(tmp_path, architectures=["LlamaForCausalLM"], num_hidden_layers=3)
    proc = subprocess.run([sys.executable, "-c", code, "consolidate", path, "--out", tmp_path / "out"],
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 1 and "model.layers.2." in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()

"""`ckpt verify ADAPTER_DIR`: a PEFT adapter folder (what `ckpt consolidate` writes for a LoRA run, and what PEFT's
save_pretrained writes) is checked as PEFT will read it, and each way it can fail to load is named."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.ops.verify import verify_folder

from .conftest import FIXTURES, fixture_meta

pytest.importorskip("peft")

TRAINER = "peft_trainer_z2_bf16"  # one adapter, modules_to_save (ln_f)
ENGINE = "peft_engine_z2_bf16"  # two adapters: `default` at the top, `second/` in a sub-folder


def _base(name):
    return FIXTURES / name / "base"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    results = {}
    for name in (TRAINER, ENGINE):
        results[name] = consolidate(FIXTURES / name / fixture_meta(name)["checkpoint"], root / name)
    return root, results


@pytest.fixture
def adapter(adapters, tmp_path):
    """A private copy of a consolidated adapter folder, to break."""

    def copy(name):
        shutil.copytree(adapters[0] / name, tmp_path / name)
        return tmp_path / name

    return copy


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _problems(report, *needles):
    assert not report.ok
    text = "\n".join(report.problems)
    for needle in needles:
        assert needle in text, report.problems


@pytest.mark.parametrize("name", [TRAINER, ENGINE])
def test_consolidated_adapter_folder_is_sound(adapters, name):
    root, results = adapters
    report = verify_folder(root / name, base=_base(name))
    assert report.ok, report.problems
    assert report.kind == "adapter" and report.dtype == "float32"
    assert report.num_parameters == results[name].num_parameters > 0  # the same count as consolidate's
    assert any("PeftModel" in c and "meta device" in c for c in report.checks)
    expected = ["adapter_model.safetensors"] + (["second/adapter_model.safetensors"] if name == ENGINE else [])
    assert report.files == expected


@pytest.mark.parametrize("name", [TRAINER, ENGINE])
def test_peft_own_save_is_sound(name):
    report = verify_folder(FIXTURES / name / "reference" / "adapter", base=_base(name))
    assert report.ok, report.problems


def test_cli_verifies_an_adapter_folder(adapters):
    root, _ = adapters
    res = run("verify", root / TRAINER, "--base", _base(TRAINER), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] and data["kind"] == "adapter" and data["num_tensors"] == 6 and data["dtype"] == "float32"
    res = run("verify", root / TRAINER)
    assert res.exit_code == 0, res.output
    assert "PEFT adapter" in res.stdout and "sound" in res.stdout and "no weight file" not in res.stdout


def test_config_must_be_a_peft_config(adapter):
    folder = adapter(TRAINER)
    (folder / "adapter_config.json").write_text("{not json")
    _problems(verify_folder(folder), "adapter_config.json is not valid JSON")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    _problems(verify_folder(folder), "no peft_type")
    (folder / "adapter_config.json").write_text("[]")
    _problems(verify_folder(folder), "no peft_type")


def test_weights_must_be_there_and_well_formed(adapter):
    folder = adapter(TRAINER)
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[:-7])
    _problems(verify_folder(folder), "adapter_model.safetensors", "truncated")
    (folder / "adapter_model.safetensors").unlink()
    _problems(verify_folder(folder), "no adapter weights")
    res = run("verify", folder)
    assert res.exit_code == 1 and "no adapter weights" in res.stderr


def test_keys_must_follow_peft_layout(adapter):
    folder = adapter(TRAINER)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({k.replace(".lora_A.", ".lora_A.default."): v for k, v in tensors.items()}, path, {"format": "pt"})
    _problems(verify_folder(folder), "carry an adapter name", "lora_A.default.weight")
    save_file({k.removeprefix("base_model.model."): v for k, v in tensors.items()}, path, {"format": "pt"})
    _problems(verify_folder(folder), "outside PEFT's layout")
    save_file({k: v for k, v in tensors.items() if ".lora_" not in k}, path, {"format": "pt"})
    _problems(verify_folder(folder), "without any lora_A / lora_B")


def test_base_model_decides_keys_and_shapes(adapter, tmp_path):
    folder = adapter(TRAINER)
    other = tmp_path / "other-base"
    other.mkdir()
    config = json.loads((_base(TRAINER) / "config.json").read_text())
    config["n_embd"] *= 2
    (other / "config.json").write_text(json.dumps(config))
    _problems(verify_folder(folder, base=other), "of the wrong shape", "lora_A.weight")

    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn", "c_fc"]  # the PeftModel would hold c_fc adapters the file lacks
    (folder / "adapter_config.json").write_text(json.dumps(config))
    _problems(verify_folder(folder, base=_base(TRAINER)), "adapter keys missing", "c_fc.lora_A.weight")
    res = run("verify", folder, "--base", _base(TRAINER))
    assert res.exit_code == 1 and "adapter keys missing" in res.stderr


def test_unbuildable_base_is_a_note_not_a_pass(adapter, tmp_path):
    folder = adapter(TRAINER)
    report = verify_folder(folder, base=tmp_path / "missing-base")
    assert report.ok and any("not checked against the base model" in n for n in report.notes)


def test_against_compares_the_adapter_with_the_runs_adapter_tensors_bit_for_bit(adapters, tmp_path):
    root, _ = adapters
    ckpt = FIXTURES / ENGINE / fixture_meta(ENGINE)["checkpoint"]
    report = verify_folder(root / ENGINE, against=ckpt)
    assert report.ok, report.problems
    assert report.against is not None and any("bit-identical" in c for c in report.checks), report.checks
    res = run("verify", root / ENGINE, "--against", ckpt, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["against"], res.output

    tampered = tmp_path / "tampered"
    shutil.copytree(root / ENGINE, tampered)
    weights = load_file(tampered / "second" / "adapter_model.safetensors")
    key = min(weights)
    weights[key] = weights[key] + 1
    save_file(weights, tampered / "second" / "adapter_model.safetensors", metadata={"format": "pt"})
    _problems(verify_folder(tampered, against=ckpt), "tensors that differ", f"second/{key}")

    res = run("verify", root / ENGINE, "--against", FIXTURES / "trainer_z2_bf16" / "out")  # not a PEFT run
    assert res.exit_code == 1 and "not a PEFT (LoRA) run" in res.output, res.output

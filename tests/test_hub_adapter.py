"""`ckpt push` of a PEFT adapter folder (what `ckpt consolidate` writes for a LoRA run): verified as an adapter,
published with a card that names the base model (`library_name: peft`), and loadable by PEFT from what arrived."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttools import consolidate
from ckpttools.cli import main
from tests.support.hub_server import LocalHub

from .conftest import FIXTURES, fixture_meta

pytest.importorskip("peft")

TOKEN = "hf_LocalToken_never_printed_16180"
TRAINER = "peft_trainer_z2_bf16"
ENGINE = "peft_engine_z2_bf16"


@pytest.fixture(autouse=True)
def _restore_progress_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with LocalHub(token=TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name in (TRAINER, ENGINE):
        consolidate(FIXTURES / name / fixture_meta(name)["checkpoint"], root / name)
    return root


@pytest.fixture
def adapter(made, tmp_path):
    def copy(name, base_model=None):
        folder = tmp_path / name
        shutil.copytree(made / name, folder)
        if base_model is not None:
            config = json.loads((folder / "adapter_config.json").read_text())
            config["base_model_name_or_path"] = base_model
            (folder / "adapter_config.json").write_text(json.dumps(config))
        return folder

    return copy


def push(hub, *args):
    args = ["push", *map(str, args)] + (["--endpoint", hub.url, "--token", TOKEN] if hub else [])
    return CliRunner().invoke(main, args)


def test_adapter_is_pushed_with_a_card_naming_its_base_and_loads_back(hub, adapter, tmp_path):
    from huggingface_hub import snapshot_download
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = adapter(TRAINER, base_model="tiny-org/tiny-gpt2")
    res = push(hub, folder, "--repo", "org/lora", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["kind"] == "adapter" and data["base_model"] == "tiny-org/tiny-gpt2" and data["verified"]
    assert data["dtype"] == "float32" and data["num_parameters"] > 0
    remote = hub.files("org/lora")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= set(remote)
    assert not [p for p in remote if p.endswith((".pt", ".pth", ".bin")) or p.startswith(".ckpt")]
    card = remote["README.md"].decode()
    assert "library_name: peft" in card and "base_model: tiny-org/tiny-gpt2" in card
    assert "pipeline_tag: text-generation" in card and "LORA adapter for `tiny-org/tiny-gpt2`" in card
    assert any("PEFT's template README.md names no base model" in n for n in data["notes"])

    fetched = Path(snapshot_download("org/lora", endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "cache"))
    base = FIXTURES / TRAINER / "base"
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), fetched).eval()
        ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder).eval()
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


def test_base_model_option_when_the_config_names_none(adapter):
    folder = adapter(TRAINER)  # the fixture's run saved base_model_name_or_path: null
    res = push(None, folder, "--repo", "org/lora", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert any("--base-model" in n for n in json.loads(res.stdout)["notes"])
    res = push(None, folder, "--repo", "org/lora", "--dry-run", "--json", "--base-model", "tiny-org/tiny-gpt2")
    assert res.exit_code == 0 and json.loads(res.stdout)["base_model"] == "tiny-org/tiny-gpt2"
    res = push(None, folder, "--repo", "org/lora", "--dry-run", "--base-model", "not a repo")
    assert res.exit_code == 2 and "--base-model" in res.stderr


def test_every_adapter_of_a_multi_adapter_folder_is_pushed(adapter):
    folder = adapter(ENGINE, base_model="tiny-org/tiny-gpt2")
    res = push(None, folder, "--repo", "org/two", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    files = [f["path"] for f in json.loads(res.stdout)["files"]]
    assert {"adapter_model.safetensors", "adapter_config.json", "second/adapter_model.safetensors",
            "second/adapter_config.json", "README.md"} <= set(files)  # fmt: skip


def test_a_broken_adapter_is_not_pushed(hub, adapter):
    folder = adapter(TRAINER, base_model="tiny-org/tiny-gpt2")
    (folder / "adapter_model.safetensors").unlink()
    res = push(hub, folder, "--repo", "org/broken")
    assert res.exit_code == 1 and "no adapter weights" in res.stderr and "failed verification" in res.stderr
    assert hub.requests("POST") == []

"""FSDP2 / torch DCP fixtures (fixtures/build/fixture_fsdp2.py): rebuilt fresh under torchrun, and the committed ones.

The builder checks its own references as it writes them (it fails otherwise); these tests rebuild two fixtures in
tmp_path and check those invariants again from the files alone: torch's dcp_to_torch_save of the DCP gives exactly
the live model's full state dict gathered with get_model_state_dict(full_state_dict=True) (fsdp2_dcp_dp3_bf16: bf16,
uneven dim-0 shards, empty shards on the last rank), and PEFT's adapter folder written from the gathered state holds
exactly the adapter-only DCP's tensors (fsdp2_peft_dcp). The fresh DCP must describe the same tensors and chunks as
the committed fixture, so the committed files still show what this torch writes; the run folder's config.json loads
with from_pretrained.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fixtures.build import fixture_fsdp2

from .conftest import FIXTURES

REBUILT = ["fsdp2_dcp_dp3_bf16", "fsdp2_peft_dcp"]


def chunk_layout(dcp_dir: Path) -> dict[str, Any]:
    """Every DCP entry's kind, size, dtype and chunks (offsets, sizes) from `.metadata` (torch's own files only:
    the fixtures built here or committed, never a downloaded checkpoint)."""
    with open(dcp_dir / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # torch's own .metadata, written here or by the builder
    layout: dict[str, Any] = {}
    for key, entry in meta.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            layout[key] = (type(entry).__name__, tuple(entry.size), str(entry.properties.dtype), chunks)
        else:
            layout[key] = (type(entry).__name__,)
    return layout


def assert_equal_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    unequal = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not unequal, f"not bit-identical: {unequal}"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp2")
    return {name: fixture_fsdp2.build(name, root) for name in REBUILT}


def test_dcp_to_torch_save_equals_live_full_state(rebuilt):
    out = rebuilt["fsdp2_dcp_dp3_bf16"]
    live = load_file(str(out / "reference" / "live_full_state.safetensors"))
    dcp_model = load_file(str(out / "reference" / "model.safetensors"))
    assert_equal_tensors({f"model.{k}": v for k, v in live.items()}, dcp_model)
    assert {v.dtype for v in dcp_model.values()} == {torch.bfloat16}
    optim = load_file(str(out / "reference" / "optim.safetensors"))
    live_optim = load_file(str(out / "reference" / "live_full_optim.safetensors"))
    assert_equal_tensors({f"optim.{k}": v for k, v in live_optim.items()}, optim)
    # 3 ranks: k_proj has 2 rows, so the last rank saved an empty chunk
    chunks = chunk_layout(out / "checkpoint" / "step-2")["model.model.layers.0.self_attn.k_proj.weight"][3]
    assert chunks == [((0, 0), (1, 16)), ((1, 0), (1, 16)), ((2, 0), (0, 16))]


def test_peft_adapter_folder_equals_adapter_dcp(rebuilt):
    out = rebuilt["fsdp2_peft_dcp"]
    adapter = load_file(str(out / "reference" / "adapter" / "adapter_model.safetensors"))
    dcp_model = load_file(str(out / "reference" / "model.safetensors"))
    assert_equal_tensors({f"model.{k}": v for k, v in adapter.items()}, dcp_model)
    assert all(".lora_" in k and ".default." not in k for k in adapter)
    config = json.loads((out / "checkpoint" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], sorted(config["target_modules"])) == ("LORA", 4, ["q_proj", "v_proj"])


@pytest.mark.parametrize("name", REBUILT)
def test_rebuilt_layout_matches_committed(rebuilt, name):
    committed = FIXTURES / name
    if not (committed / "meta.json").is_file():
        pytest.skip(f"{name} is not built")
    meta = json.loads((committed / "meta.json").read_text())
    if meta["versions"]["torch"] != torch.__version__:
        pytest.skip(f"{name} was built with torch {meta['versions']['torch']}")
    ckpt = meta["checkpoint"]
    assert chunk_layout(rebuilt[name] / ckpt) == chunk_layout(committed / ckpt)
    fresh = {p.relative_to(rebuilt[name]).as_posix() for p in rebuilt[name].rglob("*") if p.is_file()}
    kept = {p.relative_to(committed).as_posix() for p in committed.rglob("*") if p.is_file()}
    assert fresh == kept


def test_run_folder_config_loads_with_from_pretrained(rebuilt, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    out = rebuilt["fsdp2_dcp_dp3_bf16"]
    live = load_file(str(out / "reference" / "live_full_state.safetensors"))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes((out / "checkpoint" / "config.json").read_bytes())
    save_file(live, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    assert_equal_tensors(live, dict(model.state_dict()))


@pytest.mark.parametrize("name", list(fixture_fsdp2.BY_NAME))
def test_committed_fixture_checks(name):
    folder = FIXTURES / name
    if not (folder / "meta.json").is_file():
        pytest.skip(f"{name} is not built")
    meta = json.loads((folder / "meta.json").read_text())
    assert all(check["ok"] for check in meta.get("checks", {}).values())
    assert all((folder / "reference" / ref.rstrip("/")).exists() for ref in meta["references"])
    assert (folder / meta["checkpoint"]).is_dir()

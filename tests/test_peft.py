"""PEFT/LoRA runs: adapter folders PEFT loads, and merged models equal to PEFT's own merge_and_unload().

Every fixture is a real DeepSpeed run of a PeftModel (fixtures/build/fixture_peft.py): the references are what PEFT
itself wrote from the live model (reference/adapter/) and merge_and_unload() of the same model in fp32 and bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttools.errors import CkptError
from ckpttools.ops import peft as ckpt_peft
from ckpttools.ops.consolidate import consolidate

from .conftest import FIXTURES, fixture_meta, fixture_names

peft = pytest.importorskip("peft")

NAMES = [n for n in fixture_names() if n.startswith("peft_")]  # reads no other fixture's meta.json
ENGINE = [n for n in NAMES if fixture_meta(n)["mode"] == "engine"]
TRAINER = [n for n in NAMES if fixture_meta(n)["mode"] == "trainer"]


def _ckpt(name: str) -> Path:
    return FIXTURES / name / fixture_meta(name)["checkpoint"]


def _adapter_dirs(name: str) -> list[str]:
    return ["" if a == "default" else a for a in fixture_meta(name)["adapters"]]


def _untied(ref: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The merged state dict as save_pretrained stores it: tied aliases (lm_head -> wte) once."""
    tied = {k.removeprefix("base_model.model.") for k in fixture_meta(name)["tied"]}
    return {k: v for k, v in ref.items() if k not in tied}


@pytest.mark.parametrize("name", NAMES)
def test_adapter_folder_is_what_peft_saves_with_the_fp32_masters(name, tmp_path):
    result = consolidate(_ckpt(name), tmp_path / "out")
    ref = FIXTURES / name / "reference" / "adapter"
    for sub in _adapter_dirs(name):
        ours = load_file(tmp_path / "out" / sub / "adapter_model.safetensors")
        theirs = load_file(ref / sub / "adapter_model.safetensors")
        assert sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert ours[key].dtype == torch.float32, key
            assert torch.equal(ours[key], value), key
        assert (tmp_path / "out" / sub / "adapter_config.json").is_file()
    assert "config.json" not in result.files  # an adapter folder, not a model folder
    if fixture_meta(name)["mode"] == "trainer":
        assert {"README.md", "tokenizer.json"} <= set(result.files)


@pytest.mark.parametrize("name", NAMES)
def test_peft_loads_every_adapter_tensor_with_nothing_missing_or_unexpected(name, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    consolidate(_ckpt(name), tmp_path / "out")
    base = AutoModelForCausalLM.from_pretrained(FIXTURES / name / "base", dtype=torch.float32)
    adapters = list(fixture_meta(name)["adapters"])
    model = PeftModel.from_pretrained(base, tmp_path / "out", adapter_name=adapters[0])
    for adapter in adapters[1:]:
        result = model.load_adapter(tmp_path / "out" / adapter, adapter_name=adapter)
        assert not result.unexpected_keys
    full = load_file(FIXTURES / name / "reference" / "full_state.safetensors")
    masters = {k.removeprefix("fp32/"): v for k, v in full.items() if k.startswith("fp32/")}
    params = dict(model.named_parameters())
    for key, value in masters.items():
        assert torch.equal(params[key].detach(), value), key


@pytest.mark.parametrize("name", NAMES[:1])
def test_bf16_adapter_folder_holds_the_engines_16bit_weights(name, tmp_path):
    consolidate(_ckpt(name), tmp_path / "out", dtype="bf16")
    bit16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    ours = load_file(tmp_path / "out" / "adapter_model.safetensors")
    saved = {ckpt_peft.saved_name(k, "default"): v for k, v in bit16.items() if ".default." in k}
    assert sorted(ours) == sorted(saved)
    for key, value in saved.items():
        assert ours[key].dtype == torch.bfloat16, key
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_merge_with_base_is_bit_identical_to_merge_and_unload(name, dtype, tmp_path):
    result = consolidate(_ckpt(name), tmp_path / "out", merge=True, base=FIXTURES / name / "base", dtype=dtype)
    ref = _untied(load_file(FIXTURES / name / "reference" / f"merged_{dtype}.safetensors"), name)
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(ours[key], value), key
    assert "adapter_config.json" not in result.files  # from_pretrained would load the folder as an adapter
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == str(value.dtype).split(".")[1]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ENGINE)
def test_merge_from_the_checkpoints_frozen_base_weights(name, dtype, tmp_path):
    """Without --base, the frozen base weights the run saved (bf16 here) are the base: fp32 output upcasts them."""
    consolidate(_ckpt(name), tmp_path / "out", merge=True, config=FIXTURES / name / "base", dtype=dtype)
    ref_name = "merged_fp32_ckptbase" if dtype == "fp32" else "merged_bf16"
    ref = _untied(load_file(FIXTURES / name / "reference" / f"{ref_name}.safetensors"), name)
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_merged_folder_loads_with_from_pretrained_with_no_key_problems(name, tmp_path):
    from transformers import AutoModelForCausalLM

    consolidate(_ckpt(name), tmp_path / "out", merge=True, base=FIXTURES / name / "base", max_shard_size="20KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref = load_file(FIXTURES / name / "reference" / "merged_fp32.safetensors")
    state = model.state_dict()
    for key, value in ref.items():
        assert torch.equal(state[key], value), key


def test_merge_reads_a_sharded_base_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    name = NAMES[-1]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name / "base", dtype=torch.float32)
    model.save_pretrained(tmp_path / "base", max_shard_size="10KB")
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()
    consolidate(_ckpt(name), tmp_path / "out", merge=True, base=tmp_path / "base")
    ref = _untied(load_file(FIXTURES / name / "reference" / "merged_fp32.safetensors"), name)
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert all(torch.equal(ours[k], v) for k, v in ref.items())


def test_saved_names_are_pefts():
    from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key as theirs

    keys = (
        "base_model.model.h.0.attn.c_attn.lora_A.default.weight",
        "base_model.model.x.lora_B.default.bias",
        "base_model.model.emb.lora_embedding_A.default",
        "base_model.model.default.lora_A.default.weight",
    )
    for key in keys:
        assert ckpt_peft.saved_name(key, "default") == theirs(key, "default")
    assert ckpt_peft.saved_name("base_model.model.lm_head.modules_to_save.a1.weight", "a1") == (
        "base_model.model.lm_head.weight"
    )


def test_lora_scaling_follows_rslora_and_the_patterns():
    cfg = {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"layers.1.v_proj": 3}}
    assert ckpt_peft.lora_scaling(cfg, "model.layers.0.k_proj", 4) == 2.0
    assert ckpt_peft.lora_scaling(cfg, "model.layers.0.q_proj", 2) == 4.0
    assert ckpt_peft.lora_scaling(cfg, "model.layers.1.v_proj", 4) == 0.75
    assert ckpt_peft.lora_scaling({**cfg, "use_rslora": True}, "model.layers.0.k_proj", 4) == 4.0
    with pytest.raises(CkptError, match="rank 4, but its lora_A has 2 rows"):
        ckpt_peft.lora_scaling(cfg, "model.layers.0.k_proj", 2)


# --- Bad input: one line each, nothing written ------------------------------------------------------------


def _refused(tmp_path: Path, match: str, path: Path, **kwargs) -> None:
    with pytest.raises(CkptError, match=match) as e:
        consolidate(path, tmp_path / "out", **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("name", TRAINER[-1:])
def test_merge_without_base_weights_says_to_pass_base(name, tmp_path):
    _refused(tmp_path, "saved without its frozen base weights.*pass --base", _ckpt(name), merge=True,
             config=FIXTURES / name / "base")  # fmt: skip


@pytest.mark.parametrize("name", ENGINE[:1])
def test_merge_without_a_config_says_to_pass_base(name, tmp_path):
    _refused(tmp_path, "no config.json of the base model; pass --base", _ckpt(name), merge=True)


@pytest.mark.parametrize("name", NAMES[-1:])
def test_merge_with_a_base_of_other_shapes_is_refused(name, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / name / "base", base)
    weights = load_file(base / "model.safetensors")
    target = next(k for k in weights if any(t in k for t in ("q_proj.weight", "c_attn.weight")))
    weights[target] = torch.zeros(weights[target].shape[0] + 1, weights[target].shape[1])
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, f"base weight {target} is .*is --base the model", _ckpt(name), merge=True, base=base)


@pytest.mark.parametrize("name", ENGINE[-1:])
def test_an_unknown_adapter_type_is_refused_by_name(name, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(name), ckpt)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    _refused(tmp_path, "adapter type IA3 is not supported", ckpt)
    _refused(tmp_path, "adapter type IA3 is not supported", ckpt, merge=True, base=FIXTURES / name / "base")


@pytest.mark.parametrize("name", ENGINE[-1:])
def test_dora_is_refused_by_name(name, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(name), ckpt)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    _refused(tmp_path, "DoRA", ckpt, merge=True, base=FIXTURES / name / "base")


def test_missing_base_folder_is_refused(tmp_path):
    _refused(tmp_path, "--base .*no such folder", _ckpt(ENGINE[0]), merge=True, base=tmp_path / "nowhere")


def test_cli_merge(tmp_path):
    from click.testing import CliRunner

    from ckpttools.cli import main

    name = ENGINE[0]
    args = ["consolidate", str(_ckpt(name)), "--merge", "--base", str(FIXTURES / name / "base"), "--dtype", "bf16",
            "--out", str(tmp_path / "out"), "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dtype"] == "bfloat16"
    assert "model.safetensors" in data["files"]
    bad = CliRunner().invoke(main, ["consolidate", str(_ckpt(name)), "--base", str(FIXTURES / name / "base"),
                                    "--out", str(tmp_path / "o2")])  # fmt: skip
    assert bad.exit_code != 0
    assert "--merge" in bad.output


def _as_peft_reads(path: Path) -> dict:
    config = json.loads(path.read_text())
    for key in ("target_modules", "exclude_modules"):
        if isinstance(config.get(key), list):
            config[key] = set(config[key])
    return config


def test_save_pretrained_from_engine_adapter_mode_writes_what_peft_saves(tmp_path):
    """A live ZeRO-3 engine of a PeftModel: adapter=True against PEFT's save_pretrained of the gathered model."""
    from fixtures.build import ds_launch
    from fixtures.build.fixture_peft import specs

    spec = next(s for s in specs() if s["name"] == "peft_engine_z3_bf16")
    run = ds_launch.torchrun(2, "fixtures.build.fixture_peft", ["save", "--spec", json.dumps(spec), "--out", tmp_path],
                             cwd=tmp_path, timeout=600)  # fmt: skip
    assert run.rc == 0, run.tail()
    ours, theirs = tmp_path / "ours", tmp_path / "peft"
    # PEFT's two files, and the manifest that lets a later --overwrite know ckpt wrote them
    assert {p.name for p in ours.iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
        ".ckpt-manifest.json",
    }
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for key, value in b.items():
        assert torch.equal(a[key], value), key
    # PEFT holds target_modules (and exclude_modules) as sets and writes them in iteration order, and two sets of
    # the same names can iterate differently (CI saw ours and PEFT's differ): compared as sets, as PEFT reads them
    assert _as_peft_reads(ours / "adapter_config.json") == _as_peft_reads(theirs / "adapter_config.json")


@pytest.mark.parametrize("name", ENGINE[:1])
def test_a_resharded_peft_run_gives_the_same_adapter_folder_and_merge(name, tmp_path):
    from ckpttools.ops.reshard import reshard

    reshard(_ckpt(name), tmp_path / "dp1", dp=1)
    for sub in _adapter_dirs(name):  # the adapter configs beside the checkpoint come along
        assert (tmp_path / "dp1" / sub / "adapter_config.json").is_file()
    consolidate(tmp_path / "dp1", tmp_path / "out")
    ref = load_file(FIXTURES / name / "reference" / "adapter" / "adapter_model.safetensors")
    ours = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert all(torch.equal(ours[k], v) for k, v in ref.items())
    consolidate(tmp_path / "dp1", tmp_path / "merged", merge=True, config=FIXTURES / name / "base", dtype="bf16")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    want = _untied(load_file(FIXTURES / name / "reference" / "merged_bf16.safetensors"), name)
    assert sorted(merged) == sorted(want)
    assert all(torch.equal(merged[k], v) for k, v in want.items())


def test_a_frozen_tie_whose_record_was_lost_is_refused(tmp_path):
    """The base's tied embedding and head are both frozen: with shared_params gone they would be written twice,
    as two params, from one storage. Refused as damage instead."""
    from ckpttools.errors import CorruptCheckpointError
    from ckpttools.layouts.registry import open_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "peft_engine_z1_bf16" / "checkpoint", ckpt)
    path = ckpt / (ckpt / "latest").read_text().strip() / "mp_rank_00_model_states.pt"
    obj = torch.load(path, weights_only=False)
    assert obj["shared_params"]
    obj["shared_params"] = {}
    torch.save(obj, path)
    with pytest.raises(CorruptCheckpointError, match=r"shares its storage with .*shared_params does not list it"):
        open_checkpoint(ckpt)

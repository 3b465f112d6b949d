"""AutoTP checkpoints written in DeepSpeed's universal format (`ckpt reshard --universal`, `python -m
ckpttools.ds_to_universal`): the same files, tensors and markers as DeepSpeed's own ds_to_universal of the real
fixtures (with and without the affine map); the slow tests load our output with DeepSpeed's `load_universal` in
fresh AutoTP engines at DP 2 x TP 2, DP 1 x TP 2 and TP 1 (another TP size) and train on."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from ckpttools.compat.ds_to_universal import cli
from ckpttools.errors import CkptError
from ckpttools.io.staging import MANIFEST
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops.reshard import reshard

from .conftest import tree_digest
from .test_tensor_parallel import (
    NAMES,
    TAG,
    _ckpt,
    _engine_merge,
    _load_in_deepspeed,
    _ref,
    _rewrite_map,
    _universal_shards,
)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
dsu = pytest.importorskip("deepspeed.checkpoint.ds_to_universal")

NAME_KEY = "param_name"  # ckpttools' own addition to every state file (DeepSpeed ignores extra keys)


def _deepspeed(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal in this process (one worker each: what its command line runs)."""
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)  # fmt: skip
    dsu.main(args)


def _files(folder: Path) -> list[str]:
    """Every file but the manifest ckpt writes into its outputs (.ckpt-manifest.json: what --overwrite may replace)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _same(a: Any, b: Any) -> bool:
    """Equal values all the way down: tensors by dtype, shape and torch.equal; other objects by value or repr
    (DeepSpeed's LossScaler has no __eq__)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or repr(a) == repr(b)


def _assert_same_tag(ours: Path, ds: Path) -> dict[str, dict[str, Any]]:
    """Every file of DeepSpeed's tag folder, and no other, with equal contents; returns the markers (non-tensor
    keys) of each zero/<param>/<state>.pt."""
    assert _files(ours) == _files(ds)
    markers = {}
    for rel in _files(ds):
        a = torch.load(ours / rel, weights_only=False)
        b = torch.load(ds / rel, weights_only=False)
        if rel.startswith("zero/") and isinstance(b, dict) and "param" in b:
            assert a.pop(NAME_KEY) == rel.split("/")[1], rel
            markers[rel] = {k: v for k, v in b.items() if k != "param"}
        assert _same(a, b), rel
    return markers


@pytest.mark.parametrize("name", NAMES)
def test_same_files_tensors_and_markers_as_ds_to_universal(name, tmp_path, capsys):
    tag = _ckpt(name) / TAG
    before = tree_digest(_ckpt(name))
    _deepspeed(tag, tmp_path / "ds" / "universal_tag")
    capsys.readouterr()
    assert cli(["--input_folder", str(tag), "--output_folder", str(tmp_path / "ours" / "universal_tag")]) == 0
    assert (tmp_path / "ours" / "latest_universal").read_text() == "universal_tag"
    assert _files(tmp_path / "ours") == _files(tmp_path / "ds")
    markers = _assert_same_tag(tmp_path / "ours" / "universal_tag", tmp_path / "ds" / "universal_tag")
    # the affine map covers every parameter: no cat_dim anywhere, the vocabulary parameter marked as such
    assert {rel: m for rel, m in markers.items() if m} == {
        f"zero/lm_head.weight/{s}.pt": {"vocab_tensor": True} for s in ("fp32", "exp_avg", "exp_avg_sq")
    }
    full = _ref(name, "universal_full.safetensors")  # shapes: the full (logical) ones
    assert all(torch.load(tmp_path / "ours" / "universal_tag" / f"zero/{k.split('/', 1)[1]}/{k.split('/')[0]}.pt",
                          weights_only=False)["param"].shape == v.shape for k, v in full.items())  # fmt: skip
    assert tree_digest(_ckpt(name)) == before


def test_reshard_universal_writes_ds_to_universal_tag_folder(tmp_path):
    """`ckpt reshard --universal`: the tag folder DeepSpeed's converter writes, latest_universal naming it."""
    name = NAMES[1]  # ZeRO-2
    _deepspeed(_ckpt(name) / TAG, tmp_path / "ds" / TAG)
    res = reshard(_ckpt(name), tmp_path / "ours", universal=True)
    out = Path(res.output_dir)
    assert (out / "latest_universal").read_text() == TAG
    assert {"config.json", "generation_config.json"} <= set(os.listdir(out))
    _assert_same_tag(out / TAG, tmp_path / "ds" / TAG)


def test_without_an_affine_map_the_markers_are_ds_to_universal_s(tmp_path):
    """Older DeepSpeed saves only the pattern lists: ds_to_universal then records cat_dim 0 (column-parallel) or 1
    (row-parallel), nothing for replicated parameters, vocab_tensor for the vocabulary; so does ckpttools."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(NAMES[0]), ckpt)
    _rewrite_map(ckpt, lambda info: info.pop("affine_map"))
    _deepspeed(ckpt / TAG, tmp_path / "ds" / "u")
    assert cli(["--input_folder", str(ckpt / TAG), "--output_folder", str(tmp_path / "ours" / "u")]) == 0
    markers = _assert_same_tag(tmp_path / "ours" / "u", tmp_path / "ds" / "u")
    fp32 = {rel.split("/")[1]: m for rel, m in markers.items() if rel.endswith("/fp32.pt")}
    assert fp32["lm_head.weight"] == {"cat_dim": 0, "vocab_tensor": True}
    assert (
        fp32["model.layers.0.self_attn.o_proj.weight"] == fp32["model.layers.1.mlp.down_proj.weight"] == {"cat_dim": 1}
    )
    assert fp32["model.layers.0.mlp.up_proj.weight"] == {"cat_dim": 0}
    assert fp32["model.norm.weight"] == fp32["model.embed_tokens.weight"] == {}


def test_an_averaged_parameter_is_refused_not_concatenated(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(NAMES[0]), ckpt)

    def average_norms(info):
        info.pop("affine_map")
        info["parameter_to_average_patterns"] = [r"model\.norm\.weight$"]
        info["tp_replicated_parameter_patterns"] = [
            p for p in info["tp_replicated_parameter_patterns"] if p != r"^model\.norm\.weight$"
        ]

    _rewrite_map(ckpt, average_norms)
    with pytest.raises(CkptError, match=r"model\.norm\.weight matches parameter_to_average_patterns"):
        reshard(ckpt, tmp_path / "out", universal=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_tensor_parallel_universal_folder_consolidates_as_its_native_checkpoint(name, dtype, tmp_path, capsys):
    """DeepSpeed's own ds_to_universal output and ours hold the merged fp32 masters: consolidated, they give the
    bytes the native TP checkpoint gives."""
    from ckpttools.ops.consolidate import consolidate

    _deepspeed(_ckpt(name) / TAG, tmp_path / "ds" / "universal_tag")
    (tmp_path / "ds" / "latest_universal").write_text("universal_tag")
    assert cli(["--input_folder", str(_ckpt(name) / TAG), "--output_folder", str(tmp_path / "ours" / "u")]) == 0
    capsys.readouterr()
    consolidate(_ckpt(name), tmp_path / "native", dtype=dtype, check_existing=False)
    for universal in (tmp_path / "ds", tmp_path / "ours"):
        ckpt = open_checkpoint(universal)
        assert (ckpt.layout.kind, ckpt.layout.tp, ckpt.source_format) == ("tensor", 2, "universal")
        out = tmp_path / f"from-{universal.name}"
        result = consolidate(universal, out, dtype=dtype, check_existing=False)
        assert "model.safetensors" in result.files
        assert (out / "model.safetensors").read_bytes() == (tmp_path / "native" / "model.safetensors").read_bytes()


def test_a_tensor_parallel_universal_folder_is_not_resharded_back(tmp_path, capsys):
    """Native TP shards from a universal folder are not written: refused in one line, nothing written."""
    from ckpttools.ops.reshard import reshard

    out = tmp_path / "u" / "universal_tag"
    assert cli(["--input_folder", str(_ckpt(NAMES[0]) / TAG), "--output_folder", str(out)]) == 0
    capsys.readouterr()
    with pytest.raises(CkptError) as e:
        reshard(out.parent, tmp_path / "back", dp=2)
    assert "\n" not in str(e.value) and "universal format" in str(e.value) and str(out) in str(e.value)
    assert not (tmp_path / "back").exists()


# --- DeepSpeed's load_universal resumes from our output -------------------------------------------------------


def _check_tp2(dump: dict[str, torch.Tensor], name: str) -> None:
    """Each TP rank holds the saved state: ds_to_universal's full tensors cut by DeepSpeed's map, the module's
    16-bit shards as the engine saved them."""
    for r, want in enumerate(_universal_shards(name)):
        for key, t in want.items():
            assert torch.equal(dump[f"tp{r}/{key}"], t), (r, key)
        for key, t in _ref(name, f"bit16_tp{r}.safetensors").items():
            assert torch.equal(dump[f"tp{r}/module/{key}"], t), (r, key)


def _convert(name: str, tmp_path: Path) -> Path:
    res = reshard(_ckpt(name), tmp_path / "universal", universal=True)
    return Path(cast(str, res.output_dir))  # set once it returns


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "dp"), [(4, 2), (2, 1)])
def test_deepspeed_load_universal_of_our_output_at_tp2(nproc, dp, tmp_path):
    name = NAMES[0]
    dump = _load_in_deepspeed(name, _convert(name, tmp_path), tmp_path / "load", universal=True, nproc=nproc)
    _check_tp2(dump, name)
    info = json.loads((tmp_path / "load" / "dump.json").read_text())
    assert (info["dp"], info["global_steps"], 2 in info["optimizer_steps"], info["none"]) == (dp, 2, True, [])
    assert len(info["losses_after_load"]) == 1  # one more training step ran (finite, checked by the worker)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[:2])
def test_deepspeed_load_universal_of_our_output_at_tp1(name, tmp_path):
    """Another TP size: TP 1 x DP 2 holds the full tensors, equal to ds_to_universal's and the engine's merge."""
    dump = _load_in_deepspeed(name, _convert(name, tmp_path), tmp_path / "load", universal=True, nproc=2, tp=1)
    for key, t in _ref(name, "universal_full.safetensors").items():
        assert torch.equal(dump[f"tp0/{key}"], t), key
    for key, t in _engine_merge(name).items():
        assert torch.equal(dump[f"tp0/module/{key}"], t), key
    assert not any(k.startswith("tp1/") for k in dump)


def _split_dim(name: str) -> int | None:
    """How AutoTP cuts the fixture's Llama: row-parallel o/down_proj on dim 1, norms and the (unsharded) embedding
    replicated, every other weight on dim 0 (fixtures/README.md, AutoTP fact 2)."""
    if "norm" in name or "embed_tokens" in name:
        return None
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0


@pytest.mark.slow
def test_deepspeed_load_universal_of_our_output_at_tp4(tmp_path):
    """TP 4 x DP 1 (2 heads over 4 ranks: TP ranks 2 and 3 hold no attention rows, DeepSpeed's safe_get_* gives
    None for those empty shards): every rank's shards, put side by side along AutoTP's split dim, are exactly
    the full tensors of ds_to_universal; replicated ones are the full tensor on every rank."""
    name = NAMES[0]
    dump = _load_in_deepspeed(name, _convert(name, tmp_path), tmp_path / "load", universal=True, nproc=4, tp=4)
    info = json.loads((tmp_path / "load" / "dump.json").read_text())
    assert (info["tp"], info["dp"], len(info["losses_after_load"])) == (4, 1, 1)
    assert all("self_attn" in k and k.startswith(("tp2/", "tp3/")) for k in info["none"])
    full = _ref(name, "universal_full.safetensors")
    merged = _engine_merge(name)
    for key, want in [*full.items(), *((f"module/{k}", v) for k, v in merged.items())]:
        dim = _split_dim(key.split("/", 1)[1])
        shards = [dump[f"tp{r}/{key}"] for r in range(4) if f"tp{r}/{key}" in dump]
        if dim is None:
            assert len(shards) == 4, key
            assert all(torch.equal(s, want) for s in shards), key
        else:
            assert torch.equal(torch.cat(shards, dim=dim), want), key

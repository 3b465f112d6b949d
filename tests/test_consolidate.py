"""Consolidated output against DeepSpeed's own references, on the real fixture matrix."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.errors import OutputError
from ckpttools.layouts.registry import read_checkpoint

from .conftest import FIXTURES, fixture_meta, fixture_names, tree_digest

ENGINE = fixture_names("engine")


def _load_folder(folder):
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out = {}
    for f in files:
        out.update(load_file(folder / f))
    return out


def _reference(name, which):
    return load_file(FIXTURES / name / "reference" / f"{which}.safetensors")


def _has(name, which):
    return (FIXTURES / name / "reference" / f"{which}.safetensors").exists()


@pytest.mark.parametrize("name", ENGINE)
def test_fp32_masters_equal_the_live_engines_full_params(name, tmp_path):
    """safe_get_full_fp32_param on the live engine is the ground truth for every layout."""
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out")
    ours = _load_folder(tmp_path / "out")
    full = _reference(name, "full_state")
    fp32 = {k.removeprefix("fp32/"): v for k, v in full.items() if k.startswith("fp32/")}
    assert fp32 and set(fp32) == set(fixture_meta(name)["trainable"])
    for key, expected in fp32.items():
        assert torch.equal(ours[key], expected), key


@pytest.mark.parametrize("name", [n for n in ENGINE if _has(n, "zero_to_fp32")])
def test_fp32_is_bit_identical_to_zero_to_fp32(name, tmp_path):
    result = consolidate(FIXTURES / name / "checkpoint", tmp_path / "out")
    ours = _load_folder(tmp_path / "out")
    ref = _reference(name, "zero_to_fp32")
    meta = fixture_meta(name)
    missing_upstream = set(ours) - set(ref)
    if meta["zero_stage"] == 1:
        # zero_to_fp32 drops ZeRO-1 frozen params (frozen_param_shapes is None); ckpt takes them from `module`.
        assert missing_upstream == set(meta["frozen"])
        bit16 = _reference(name, "bit16")
        for key in missing_upstream:
            assert torch.equal(ours[key], bit16[key].float()), key
    else:
        assert not missing_upstream
    assert set(ref) <= set(ours)
    for key, tensor in ref.items():
        # zero_to_fp32's API returns frozen params 16-bit; its CLI and ckpt write them upcast (lossless).
        expected = tensor.float() if tensor.is_floating_point() else tensor
        assert ours[key].dtype == expected.dtype, key
        assert torch.equal(ours[key], expected), key
    # every element stored in the folder (buffers too; a tie stored once), as `ckpt verify` counts them
    assert result.num_parameters == sum(t.numel() for t in ours.values())


@pytest.mark.parametrize("name", ENGINE)
def test_16bit_is_bit_identical_to_the_engines_own_state_dict(name, tmp_path):
    meta = fixture_meta(name)
    dtype = meta["dtype"]
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", dtype=dtype)
    ours = _load_folder(tmp_path / "out")
    ref = _reference(name, "bit16")
    assert set(ours) == set(ref)
    for key, expected in ref.items():
        assert ours[key].dtype == expected.dtype, key
        assert torch.equal(ours[key], expected), key


@pytest.mark.parametrize("name", [n for n in ENGINE if n.startswith(("z3_dp3", "z2_dp2"))][:2])
def test_16bit_cast_of_masters_matches_engine_even_when_not_stored(name, tmp_path):
    """ZeRO-1/2 16-bit output comes from the module copy; the fp32->16-bit cast must agree with it."""
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    from ckpttools.io.safetensors_writer import read_tensor
    from ckpttools.io.torchfile import RecordReader

    with RecordReader() as reader:
        for key, master in ckpt.masters.items():
            if key in ckpt.bit16:
                assert torch.equal(read_tensor(master, reader, ckpt.train_dtype), read_tensor(ckpt.bit16[key], reader))


def test_sharded_output_has_index_and_format_metadata(tmp_path):
    name = ENGINE[0]
    result = consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", max_shard_size=600)
    out = tmp_path / "out"
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == result.total_size
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    single = tmp_path / "single"
    consolidate(FIXTURES / name / "checkpoint", single)
    a, b = _load_folder(out), load_file(single / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_pt_output_matches_safetensors_output(tmp_path):
    name = ENGINE[-1]
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "pt", to="pt")
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "st")
    pt = torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(pt) == set(st) and all(torch.equal(pt[k], st[k]) for k in st)


def test_int_buffers_stay_int_and_bare_checkpoints_keep_tied_aliases(tmp_path):
    name = ENGINE[0]
    meta = fixture_meta(name)
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out", dtype="bf16")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    for buf, dtype in meta["buffers"].items():
        if not dtype.startswith("float") and not dtype.startswith("bfloat"):
            assert ours[buf].dtype == getattr(torch, dtype)
    for alias, owner in meta["tied"].items():
        assert torch.equal(ours[alias], ours[owner])


def test_existing_output_is_refused_then_replaced_with_overwrite(tmp_path):
    ckpt = FIXTURES / ENGINE[0] / "checkpoint"
    out = tmp_path / "out"
    consolidate(ckpt, out, dtype="bf16")
    before = tree_digest(out)
    with pytest.raises(OutputError, match="already exists"):
        consolidate(ckpt, out)
    assert tree_digest(out) == before  # untouched
    consolidate(ckpt, out, overwrite=True)  # an earlier ckpt output is replaced
    assert {t.dtype for t in _load_folder(out).values() if t.is_floating_point()} == {torch.float32}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folders left behind


def test_overwrite_refuses_a_folder_holding_files_ckpt_did_not_write(tmp_path):
    ckpt = FIXTURES / ENGINE[0] / "checkpoint"
    out = tmp_path / "out"
    consolidate(ckpt, out)
    (out / "notes.txt").write_text("mine")
    before = tree_digest(out)
    with pytest.raises(OutputError, match=r"notes\.txt"):
        consolidate(ckpt, out, overwrite=True)
    assert tree_digest(out) == before


def test_output_inside_or_around_the_input_is_refused(tmp_path):
    import shutil

    src = tmp_path / "run" / "ckpt"
    shutil.copytree(FIXTURES / ENGINE[0] / "checkpoint", src)
    before = tree_digest(tmp_path / "run")
    with pytest.raises(OutputError, match="inside the checkpoint"):
        consolidate(src, src / "hf")
    with pytest.raises(OutputError, match="contains the checkpoint"):
        consolidate(src, tmp_path / "run", overwrite=True)
    assert tree_digest(tmp_path / "run") == before


def test_default_output_is_beside_the_checkpoint(tmp_path):
    import shutil

    src = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / ENGINE[0] / "checkpoint", src)
    result = consolidate(src)
    assert result.output_dir == str(tmp_path / "hf-checkpoint-2")


def test_input_is_never_modified(tmp_path):
    src = FIXTURES / ENGINE[0] / "checkpoint"
    before = tree_digest(src)
    consolidate(src, tmp_path / "out", dtype="bf16")
    assert tree_digest(src) == before

"""`python -m ckpttools.zero_to_fp32` and its functions against DeepSpeed's own zero_to_fp32 on the real fixtures.

DeepSpeed's functions run in this process (its command line only parses arguments and calls
`convert_zero_checkpoint_to_fp32_state_dict`); one test runs both command lines as subprocesses.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttools.compat import zero_to_fp32 as ours
from ckpttools.compat.zero_to_fp32 import GatheredTensor, cli
from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.io.staging import MANIFEST

from .conftest import FIXTURES, tree_digest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds = pytest.importorskip("deepspeed.utils.zero_to_fp32")

STAGES = ["z1_dp2_bf16", "z1_dp3_fp32", "z2_dp2_bf16", "z2_dp3_fp32", "z3_dp1_bf16", "z3_dp3_bf16", "z3_dp4_fp32",
          "z2_dp2_bf16_elastic", "trainer_z2_bf16", "trainer_z3_nogather_bf16", "gpu/gpu_z2_dp1_fp16",
          "gpu/gpu_z3_dp1_fp16"]  # fmt: skip
CLI_CASES = ["z1_dp2_bf16", "z2_dp2_bf16", "z3_dp3_bf16", "trainer_z3_gather_bf16"]


def _src(name: str) -> Path:
    out = FIXTURES / name / "out"
    return max(out.glob("checkpoint-*")) if out.exists() else FIXTURES / name / "checkpoint"


def _assert_same_state(got: dict, want: dict) -> None:
    """Same keys in the same order, same dtypes and shapes, torch.equal values, the same names aliased."""
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key
    for a, want_a in want.items():
        for b, want_b in want.items():
            assert (got[a] is got[b]) == (want_a is want_b), (a, b)


@pytest.mark.parametrize("exclude", [False, True], ids=["all", "exclude_frozen"])
@pytest.mark.parametrize("name", STAGES)
def test_state_dict_equals_deepspeeds(name, exclude, capsys):
    theirs = ds.get_fp32_state_dict_from_zero_checkpoint(str(_src(name)), exclude_frozen_parameters=exclude)
    capsys.readouterr()
    got = ours.get_fp32_state_dict_from_zero_checkpoint(_src(name), exclude_frozen_parameters=exclude)
    assert capsys.readouterr() == ("", "")  # a library function: silent
    _assert_same_state(got, theirs)


def test_tag_argument_and_frozen_dtype(capsys):
    src = _src("z2_dp2_bf16")
    got = ours.get_fp32_state_dict_from_zero_checkpoint(str(src), tag="global_step2")
    _assert_same_state(got, ds.get_fp32_state_dict_from_zero_checkpoint(str(src), tag="global_step2"))
    # as in DeepSpeed: frozen params in the training dtype, masters fp32, the int buffer int64
    assert got["frozen.weight"].dtype == torch.bfloat16 and got["emb.weight"].dtype == torch.float32
    assert got["counts"].dtype == torch.int64 and got["head.weight"] is got["emb.weight"]


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp3_bf16", "trainer_z2_bf16"])
def test_lazy_mode_follows_gathered_tensors_contract(name, capsys):
    lazy = ours.get_fp32_state_dict_from_zero_checkpoint(_src(name), lazy_mode=True)
    theirs = ds.get_fp32_state_dict_from_zero_checkpoint(str(_src(name)))
    assert list(lazy) == list(theirs)
    assert all(isinstance(v, GatheredTensor) for v in lazy.values())
    reads = next(iter(lazy.values()))._reads
    assert reads.reader.bytes_read == 0  # nothing read before .contiguous()
    for key, value in lazy.items():
        assert value.shape == theirs[key].shape and value.dtype == theirs[key].dtype, key
        assert value.numel() == theirs[key].numel() and value.dim() == theirs[key].dim()
    materialised = {k: v.contiguous() for k, v in lazy.items()}
    for key in theirs:
        assert torch.equal(materialised[key], theirs[key]), key
    # DeepSpeed's own helpers accept the lazy dict: its converter plans on `to_torch_tensor(..., empty)`
    _assert_same_state(ds.to_torch_tensor(lazy), theirs)
    empty = ds.to_torch_tensor(lazy, return_empty_tensor=True)
    assert {k: (v.shape, v.dtype) for k, v in empty.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}


def _shard_size(name: str, shard: str | None) -> str | None:
    """A few shards: 1KB for the toy model, more for the tiny GPT-2 of the Trainer fixtures."""
    return None if shard is None else "10KB" if name.startswith("trainer") else shard


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".bin":
            state.update(torch.load(path, weights_only=True))
        elif path.suffix == ".safetensors":
            state.update(load_file(path))
    return state


@pytest.mark.parametrize("shard", [None, "1KB"], ids=["single", "sharded"])
@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_writes_deepspeeds_files(name, shard, tmp_path, capsys):
    shard = _shard_size(name, shard)
    args = ["--max_shard_size", shard] if shard else []
    ds.convert_zero_checkpoint_to_fp32_state_dict(str(_src(name)), str(tmp_path / "ds"), max_shard_size=shard or "5GB")
    capsys.readouterr()
    assert cli([str(_src(name)), str(tmp_path / "ours"), *args]) == 0
    out = capsys.readouterr()
    assert out.err.count("\n") == (1 if name.startswith("z1") else 0)  # ZeRO-1: the note on the dropped frozen params
    names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if p.name != MANIFEST) == names
    assert (len(names) > 2) == bool(shard)
    if shard:  # the index byte for byte
        index = "pytorch_model.bin.index.json"
        assert (tmp_path / "ours" / index).read_bytes() == (tmp_path / "ds" / index).read_bytes()
    for fname in names:
        if fname.endswith(".bin"):
            a = torch.load(tmp_path / "ours" / fname, weights_only=True)
            b = torch.load(tmp_path / "ds" / fname, weights_only=True)
            assert list(a) == list(b), fname
            for key in b:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (fname, key)
                same_storage = [
                    k
                    for k in b
                    if b[k].untyped_storage().data_ptr() == b[key].untyped_storage().data_ptr()
                    and b[k].storage_offset() == b[key].storage_offset()
                    and b[k].shape == b[key].shape
                ]
                for k in same_storage:  # a tie is one storage in DeepSpeed's file, and in ours
                    assert a[k].untyped_storage().data_ptr() == a[key].untyped_storage().data_ptr(), (k, key)


@pytest.mark.parametrize("shard", [None, "1KB"], ids=["single", "sharded"])
@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp3_bf16", "trainer_z3_nogather_bf16"])
def test_safe_serialization_works_where_deepspeed_raises(name, shard, tmp_path, capsys):
    """DeepSpeed's `save_file` refuses the tied (shared) tensors; we store each tied name as its own copy."""
    shard = _shard_size(name, shard)
    with pytest.raises(RuntimeError, match="share memory"):
        ds.convert_zero_checkpoint_to_fp32_state_dict(str(_src(name)), str(tmp_path / "dsst"), safe_serialization=True,
                                                      max_shard_size=shard or "5GB")  # fmt: skip
    ds.convert_zero_checkpoint_to_fp32_state_dict(str(_src(name)), str(tmp_path / "ds"), max_shard_size=shard or "5GB")
    capsys.readouterr()
    args = ["--max_shard_size", shard] if shard else []
    assert cli([str(_src(name)), str(tmp_path / "ours"), "--safe_serialization", *args]) == 0
    assert "stored as their own copies" in capsys.readouterr().err
    ds_names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    rename = {n: n.replace("pytorch_model", "model").replace(".bin", ".safetensors") for n in ds_names}
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if p.name != MANIFEST) == sorted(rename.values())
    if shard:
        want = json.loads((tmp_path / "ds" / "pytorch_model.bin.index.json").read_text())
        want["weight_map"] = {k: rename[v] for k, v in want["weight_map"].items()}
        assert json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text()) == want
    got, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "ds")
    assert set(got) == set(theirs)
    assert all(got[k].dtype == theirs[k].dtype and torch.equal(got[k], theirs[k]) for k in theirs)
    for path in (tmp_path / "ours").glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_output_dir_keeps_other_files_and_replaces_ours(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "pytorch_model.bin").write_text("not ours")
    assert cli([str(_src("z3_dp2_fp32")), str(out)]) == 1  # a file ckpt did not write is never replaced
    assert "pytorch_model.bin, which ckpt did not write" in _one_error_line(capsys.readouterr().err)
    (out / "pytorch_model.bin").unlink()
    assert cli([str(_src("z2_dp2_fp32")), str(out)]) == 0
    assert cli([str(_src("z3_dp2_fp32")), str(out)]) == 0  # its own file from the run before: replaced
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "keep.txt", "pytorch_model.bin"]  # no staging left
    assert (out / "keep.txt").read_text() == "mine"
    assert "emb.weight" in torch.load(out / "pytorch_model.bin", weights_only=True)


def test_bf16_optimizer_checkpoint_converts_where_deepspeed_refuses(tmp_path, capsys):
    src = _src("z1_dp2_bf16_bf16opt")
    with pytest.raises(ValueError, match="is not a zero checkpoint"):
        ds.get_fp32_state_dict_from_zero_checkpoint(str(src))
    got = ours.get_fp32_state_dict_from_zero_checkpoint(src)
    ref = load_file(FIXTURES / "z1_dp2_bf16_bf16opt" / "reference" / "full_state.safetensors")
    masters = {k.removeprefix("fp32/"): v for k, v in ref.items() if k.startswith("fp32/")}
    assert masters and all(torch.equal(got[k], v) for k, v in masters.items())
    keys = list(got)  # ZeRO-1: buffers, masters, the tie; no frozen params, as DeepSpeed
    assert keys[:2] == ["scale", "counts"] and set(keys[2:-1]) == set(masters) and keys[-1] == "head.weight"
    assert cli([str(src), str(tmp_path / "out"), "--safe_serialization"]) == 0


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert cli([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "does not exist" in _one_error_line(capsys.readouterr().err)
    assert cli([str(_src("z2_dp2_bf16")), str(tmp_path / "o"), "--max_shard_size", "12"]) == 2
    assert "--max_shard_size" in _one_error_line(capsys.readouterr().err)
    assert cli([str(_src("z2_dp2_bf16")), str(tmp_path / "o"), "--tag", "global_step9"]) == 2  # a usage error
    assert "global_step9" in _one_error_line(capsys.readouterr().err)
    (tmp_path / "afile").write_text("x")
    assert cli([str(_src("z2_dp2_bf16")), str(tmp_path / "afile")]) == 1
    _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        cli([str(_src("z2_dp2_bf16"))])
    assert e.value.code == 2
    assert "output_dir" in _one_error_line(capsys.readouterr().err)


def _damage(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint with one byte flipped inside every tensor record of rank 1's optimizer file."""
    shutil.copytree(src, dst)
    path = next((dst / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt"))
    with zipfile.ZipFile(path) as zf:
        infos = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size > 4]
    data = bytearray(path.read_bytes())
    for info in infos:
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + info.file_size // 2] ^= 0x40
    path.write_bytes(data)
    return dst


def test_damaged_checkpoint_fails_and_writes_nothing(tmp_path, capsys):
    src = _damage(_src("z3_dp2_fp32"), tmp_path / "ckpt")
    out = tmp_path / "out"
    assert cli([str(src), str(out)]) == 1
    assert "CRC-32" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()  # the folder the run created is removed again
    lazy = ours.get_fp32_state_dict_from_zero_checkpoint(src, lazy_mode=True)
    with pytest.raises(ValueError, match="CRC-32"):  # no damaged byte is handed out, lazily either
        for value in lazy.values():
            value.contiguous()


@pytest.mark.slow
def test_command_lines_side_by_side(tmp_path):
    """Both scripts as real subprocesses: the same files; on bad input ours says one line, DeepSpeed a traceback."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CI": "1"}
    src = str(_src("z2_dp2_bf16"))
    for module, out in (("deepspeed.utils.zero_to_fp32", "ds"), ("ckpttools.zero_to_fp32", "ours")):
        subprocess.run([sys.executable, "-m", module, src, str(tmp_path / out), "--max_shard_size", "1KB"],
                       check=True, capture_output=True, env=env)  # fmt: skip
    assert sorted(set(os.listdir(tmp_path / "ours")) - {MANIFEST}) == sorted(os.listdir(tmp_path / "ds"))
    bad = subprocess.run([sys.executable, "-m", "ckpttools.zero_to_fp32", str(tmp_path / "nope"), str(tmp_path / "x")],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert bad.returncode == 1 and bad.stdout == ""
    _one_error_line(bad.stderr)


def _toy_model():
    from fixtures.build.fixture_worker import ToyModel

    torch.manual_seed(0)
    return ToyModel()


@pytest.mark.parametrize("budget", [None, 1], ids=["default", "one-module-per-call"])
@pytest.mark.parametrize("name", ["z1_dp2_bf16", "z2_dp3_fp32", "z3_dp3_bf16", "z3_dp4_fp32"])
def test_load_state_dict_from_zero_checkpoint_gives_deepspeeds_model(name, budget, monkeypatch, capsys):
    if budget is not None:
        monkeypatch.setattr(ours, "LOAD_CHUNK_BYTES", budget)
    theirs = _toy_model()
    mine = copy.deepcopy(theirs)
    assert ds.load_state_dict_from_zero_checkpoint(theirs, str(_src(name))) is theirs
    assert ours.load_state_dict_from_zero_checkpoint(mine, _src(name)) is mine
    a, b = mine.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
    assert mine.head.weight is mine.emb.weight  # the tie survives


def test_load_state_dict_size_mismatch_raises_like_torch(capsys):
    model = _toy_model()
    model.fc2 = torch.nn.Linear(12, 9)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ds.load_state_dict_from_zero_checkpoint(copy.deepcopy(model), str(_src("z2_dp2_bf16")))
    with pytest.raises(RuntimeError, match="size mismatch"):
        ours.load_state_dict_from_zero_checkpoint(model, _src("z2_dp2_bf16"))
    assert torch.equal(
        model.fc1.weight, ds.get_fp32_state_dict_from_zero_checkpoint(str(_src("z2_dp2_bf16")))["fc1.weight"]
    )


@pytest.mark.parametrize("name", ["pp2_dp1_z1_bf16", "autotp_tp2_dp2_z1_bf16", "z0_dp2_bf16", "moe_ep2_dp2_z2_bf16"])
def test_layouts_deepspeeds_script_refuses_convert_to_the_full_fp32_masters(name, tmp_path):
    """DeepSpeed's zero_to_fp32 fails on pipeline, AutoTP, ZeRO-0 and MoE folders (its errors are in each fixture's
    meta.json); ours writes the full fp32 state dict, the same tensors `ckpt consolidate` writes."""
    from ckpttools.ops.consolidate import consolidate

    assert not json.loads((FIXTURES / name / "meta.json").read_text())["zero_to_fp32"]["ok"]
    assert cli([str(FIXTURES / name / "checkpoint"), str(tmp_path / "ours"), "--safe_serialization"]) == 0
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "ckpt")
    got, want = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.dtype == torch.float32 for k, t in got.items() if t.is_floating_point())


# FSDP2 saves in every form ckpt reads them: torch DCP (run folder, step folder), HF safetensors shards, accelerate's
# DCP folders and per-rank files, a PEFT run, a TP x DP run
FSDP2_INPUTS = ["fsdp2_dcp_dp2_fp32/checkpoint", "fsdp2_dcp_dp2_fp32/checkpoint/step-2",
                "fsdp2_hf_safetensors/checkpoint", "accelerate_fsdp2_sharded/checkpoint",
                "accelerate_fsdp2_rankfiles/checkpoint", "fsdp2_peft_dcp/checkpoint",
                "fsdp2_tp2_dp2/checkpoint"]  # fmt: skip


@pytest.mark.parametrize("name", FSDP2_INPUTS)
def test_the_three_drop_ins_refuse_fsdp2_input_alike(name, tmp_path, capsys):
    """Not an IndexError, not a quiet conversion, not "elastic ZeRO-1/2": the same line from all three."""
    from ckpttools.compat import ds_to_universal, zero_to_torch

    src = str(FIXTURES / name)
    runs = {
        "zero_to_fp32": lambda: cli([src, str(tmp_path / "a")]),
        "zero_to_torch": lambda: zero_to_torch.cli([src, str(tmp_path / "b"), "--dtype", "bf16"]),
        "ds_to_universal": lambda: ds_to_universal.cli(["--input_folder", src, "--output_folder", str(tmp_path / "c")]),
    }
    lines = set()
    for script, run in runs.items():
        assert run() == 1, script
        line = _one_error_line(capsys.readouterr().err)
        assert "not a DeepSpeed checkpoint" in line and f"run `ckpt consolidate {src}` instead" in line, line
        lines.add(line)
    assert len(lines) == 1, lines
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UnsupportedCheckpointError, match="not a DeepSpeed checkpoint"):  # the functions too
        ours.get_fp32_state_dict_from_zero_checkpoint(src)


def test_the_checkpoint_itself_is_never_the_output(tmp_path, capsys):
    """DeepSpeed's script writes pytorch_model.bin into the checkpoint it is given as output_dir; this refuses."""
    src = shutil.copytree(_src("trainer_z2_bf16"), tmp_path / "checkpoint-4")
    before = tree_digest(src)
    tag = next(p for p in src.iterdir() if p.name.startswith("global_step"))
    for out in (src, tag, tag / "fp32", src.parent / "checkpoint-4" / "." / ""):
        assert cli([str(src), str(out)]) == 1, out
        assert "the checkpoint's own folder" in _one_error_line(capsys.readouterr().err)
    assert cli([str(src.parent), str(src)]) == 1  # a Trainer output_dir given, its checkpoint-N as output
    _one_error_line(capsys.readouterr().err)
    assert tree_digest(src) == before
    # DeepSpeed's own example, `python zero_to_fp32.py . output_dir/`: a new folder beside the checkpoint's files
    assert cli([str(src), str(src / "output_dir")]) == 0
    assert (src / "output_dir" / "pytorch_model.bin").is_file()


def test_bin_is_what_torch_save_writes(tmp_path, capsys):
    """The .bin shards come from ckpt's own writer (no torch needed): torch.save of what torch.load reads back from
    them gives the same data.pkl and storages, byte for byte, ties included."""
    for name, args in (("z2_dp2_bf16", []), ("z3_dp3_bf16", ["--max_shard_size", "1KB"])):
        assert cli([str(_src(name)), str(tmp_path / name), *args]) == 0
        for path in (tmp_path / name).glob("*.bin"):
            torch.save(torch.load(path, weights_only=True), tmp_path / "again.bin")
            ours_zip, torch_zip = zipfile.ZipFile(path), zipfile.ZipFile(tmp_path / "again.bin")
            names = [n.removeprefix(Path(n).parts[0]) for n in ours_zip.namelist()]
            assert names == [n.removeprefix(Path(n).parts[0]) for n in torch_zip.namelist()], path
            for a, b in zip(ours_zip.namelist(), torch_zip.namelist(), strict=True):
                if not a.endswith("serialization_id"):  # random in every file
                    assert ours_zip.read(a) == torch_zip.read(b), (path, a)
    capsys.readouterr()

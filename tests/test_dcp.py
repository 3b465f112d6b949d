"""FSDP2 / torch Distributed Checkpoint input against torch's `dcp_to_torch_save`, accelerate's `merge-weights` and
the live models, on the real fixtures of fixtures/build/fixture_fsdp2.py; damaged and planted inputs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from ckpttools.layouts.registry import open_checkpoint

from .conftest import FIXTURES


def _mode(name: str) -> str:
    return str(json.loads((FIXTURES / name / "meta.json").read_text()).get("mode"))


DCP_FIXTURES = sorted(p.name for p in FIXTURES.glob("*fsdp2*") if (p / "meta.json").is_file())
PLAIN = [n for n in DCP_FIXTURES if _mode(n) in ("dcp", "tp")]  # dcp.save of get_state_dict: model + optim
ACCELERATE = [n for n in DCP_FIXTURES if _mode(n) == "accelerate"]  # SHARDED_STATE_DICT: pytorch_model_fsdp_0/
HF_SHARDS = [n for n in DCP_FIXTURES if _mode(n) == "hf"]  # HuggingFaceStorageWriter: safetensors + saved_offsets
PEFT = [n for n in DCP_FIXTURES if _mode(n) == "peft"]  # adapter-only state dict through dcp.save
RANK_FILES = [n for n in DCP_FIXTURES if _mode(n) == "accelerate_rankfiles"]  # use_dcp=False: DTensor torch.save
WEIGHTS = PLAIN + ACCELERATE + HF_SHARDS


def _checkpoint(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def _config(name: str) -> Path | None:
    extra = FIXTURES / name / "model_config"
    return extra if extra.is_dir() else None


def _reference(name: str) -> dict[str, torch.Tensor]:
    """The model entries of the reference by the names in the model: dcp_to_torch_save nests them under `model`
    (flattened here to model.<name>); accelerate's merge-weights drops that root itself, and torch's
    consolidate_safetensors_files has none."""
    ref = load_file(FIXTURES / name / "reference" / "model.safetensors")
    if _mode(name) in ("accelerate", "hf"):
        return ref
    return {k.removeprefix("model."): v for k, v in ref.items()}


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _consolidate(name: str, out: Path, **kwargs: object) -> dict[str, torch.Tensor]:
    consolidate(_checkpoint(name), out, config=_config(name), **kwargs)  # type: ignore[arg-type]
    return _load_folder(out)


@pytest.mark.parametrize("name", WEIGHTS)
def test_stored_dtype_output_is_bit_identical_to_the_reference(name, tmp_path):
    ref = _reference(name)
    stored = next(iter(ref.values())).dtype
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[stored]
    ours = _consolidate(name, tmp_path / "out", dtype=dtype)
    tied = _tied(name)
    assert set(ours) == set(ref) - set(tied)  # a tied weight once, under its owner's name (save_pretrained's way)
    for key, expected in ref.items():
        stored = ours[tied.get(key, key)]
        assert stored.dtype == expected.dtype, key
        assert torch.equal(stored, expected), key


def _tied(name: str) -> dict[str, str]:
    """The fixture's tied weights (alias -> owner): those of a model built with tie_word_embeddings."""
    config = json.loads((_checkpoint(name) / "config.json").read_text()) if _config(name) is None else {}
    return {"lm_head.weight": "model.embed_tokens.weight"} if config.get("tie_word_embeddings") else {}


@pytest.mark.parametrize("name", WEIGHTS)
def test_fp32_and_16bit_outputs_are_the_stored_weights_cast(name, tmp_path):
    ref = _reference(name)
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours = _consolidate(name, tmp_path / dtype, dtype=dtype)
        ours.update({alias: ours[owner] for alias, owner in _tied(name).items()})
        for key, expected in ref.items():
            kept = expected.dtype == torch.float32 and torch_dtype != torch.float32 and _mixed(ref)
            want = expected if kept else expected.to(torch_dtype)
            assert torch.equal(ours[key], want), (dtype, key)


def _mixed(ref: dict[str, torch.Tensor]) -> bool:
    """A 16-bit model with some tensors kept fp32 (those stay fp32 in 16-bit output)."""
    return any(t.dtype != torch.float32 for t in ref.values())


@pytest.mark.parametrize("name", PLAIN)
def test_the_reference_is_the_live_model(name):
    """The fixture's own invariant: dcp_to_torch_save's model entries are the live model's gathered state."""
    live = load_file(FIXTURES / name / "reference" / "live_full_state.safetensors")
    ref = _reference(name)
    assert set(ref) <= {k.removeprefix("model.") for k in live} | set(live)


def test_from_pretrained_loads_the_output(tmp_path):
    from transformers import AutoModelForCausalLM

    name = PLAIN[0]
    _consolidate(name, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    state = model.state_dict()
    for key, expected in _reference(name).items():
        assert torch.equal(state[key], expected.float()), key


@pytest.mark.parametrize("name", PLAIN[:1] + ACCELERATE[:1])
def test_optimizer_chunks_are_never_read(name, tmp_path, monkeypatch):
    from ckpttools.io.torchfile import RecordReader

    read: list[int] = []
    original = RecordReader._pread

    def counting(self, record, start, buf):
        read.append(len(buf))
        return original(self, record, start, buf)

    monkeypatch.setattr(RecordReader, "_pread", counting)
    out = _consolidate(name, tmp_path / "out")
    model_bytes = sum(t.numel() * t.element_size() for t in _reference(name).values())
    assert sum(t.numel() for t in out.values()) * 0 == 0
    assert sum(read) <= model_bytes * 1.05 + 4096, (sum(read), model_bytes)


def test_inspect_reports_world_size_tensors_and_optimizer_keys():
    name = PLAIN[0]
    from ckpttools.ops.inspect import inspect_checkpoint

    info = inspect_checkpoint(_checkpoint(name))
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    assert info["parallel"]["kind"] == "dcp"
    assert info["parallel"]["world_size"] == meta.get("world_size", info["parallel"]["world_size"])
    keys = json.loads((FIXTURES / name / "reference" / "optim_keys.json").read_text())
    flat = json.dumps(keys)
    for state in info["optimizer_states"]:
        assert state in flat
    assert "exp_avg" in info["optimizer_states"]
    tied = _tied(name)
    assert info["num_parameters"] == sum(t.numel() for k, t in _reference(name).items() if k not in tied)


@pytest.mark.parametrize("name", PLAIN)
def test_inspect_tells_the_2d_mesh_from_the_chunk_grid(name):
    """FSDP2 x TP (a row-wise `o_proj` cut along dim 1 too) is DP x TP, not DP over every rank."""
    from ckpttools.ops.inspect import inspect_checkpoint

    parallel = inspect_checkpoint(_checkpoint(name))["parallel"]
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    tp = meta.get("tp", 1)
    assert (parallel["dp"], parallel["tp"]) == (meta["world_size"] // tp, tp)
    assert parallel["world_size"] == meta["world_size"]


def test_cli_inspect_and_verify(tmp_path):
    name = PLAIN[0]
    ckpt = [sys.executable, "-m", "ckpttools.cli"]
    r = subprocess.run([*ckpt, "inspect", str(_checkpoint(name))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "torch Distributed Checkpoint" in r.stdout and "exp_avg" in r.stdout
    r = subprocess.run(
        [*ckpt, "consolidate", str(_checkpoint(name)), "--out", str(tmp_path / "o")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [*ckpt, "verify", str(tmp_path / "o"), "--against", str(_checkpoint(name))], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "bit-identical" in r.stdout


def test_run_folder_step_and_model_folder_are_found():
    name = PLAIN[0]
    step_dir = next(p for p in _checkpoint(name).iterdir() if p.is_dir())
    by_run = open_checkpoint(_checkpoint(name))
    by_folder = open_checkpoint(step_dir)
    assert by_run.location.tag_dir == by_folder.location.tag_dir == step_dir
    assert by_run.location.root == _checkpoint(name)  # config.json lies there
    with pytest.raises(CheckpointNotFoundError, match="no step 99"):
        open_checkpoint(_checkpoint(name), step=99)
    if ACCELERATE:
        acc = open_checkpoint(_checkpoint(ACCELERATE[0]))
        assert acc.location.tag == "pytorch_model_fsdp_0"


@pytest.mark.parametrize("name", PEFT)
def test_an_adapter_only_save_gives_the_adapter_folder_peft_writes(name, tmp_path):
    consolidate(_checkpoint(name), tmp_path / "out")
    ref = FIXTURES / name / "reference" / "adapter"
    ours, theirs = (
        load_file(tmp_path / "out" / "adapter_model.safetensors"),
        load_file(ref / "adapter_model.safetensors"),
    )
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert torch.equal(ours[key], expected), key
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == json.loads((ref / "adapter_config.json").read_text())["r"]


@pytest.mark.parametrize("name", HF_SHARDS)
def test_hf_shards_match_torchs_own_consolidation(name, tmp_path):
    ours = _consolidate(name, tmp_path / "out", dtype="bf16")
    theirs = _load_folder(FIXTURES / name / "reference" / "consolidated")
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert ours[key].dtype == expected.dtype and torch.equal(ours[key], expected), key


@pytest.mark.parametrize("name", RANK_FILES)
def test_per_rank_dtensor_files_give_the_live_models_weights(name, tmp_path):
    """accelerate's use_dcp=False files, which its own merge-weights refuses (no .metadata)."""
    ours = _consolidate(name, tmp_path / "out")
    live = load_file(FIXTURES / name / "reference" / "live_full_state.safetensors")
    assert set(ours) == set(live)
    for key, expected in live.items():
        assert torch.equal(ours[key], expected), key


@pytest.mark.parametrize("name", RANK_FILES)
def test_a_missing_or_foreign_rank_file_is_named(name, tmp_path):
    root = _copy(name, tmp_path)
    (root / "pytorch_model_fsdp_0_rank1.bin").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"saved by rank 0 of 2, but this is rank file 0 of 1"):
        open_checkpoint(root)
    shutil.copy(root / "pytorch_model_fsdp_0_rank0.bin", root / "pytorch_model_fsdp_0_rank1.bin")
    with pytest.raises(CorruptCheckpointError, match=r"saved by rank 0 of 2, but this is rank file 1 of 2"):
        open_checkpoint(root)


@pytest.mark.parametrize("name", PLAIN[:1])
def test_torchrun_ranks_write_what_one_process_writes(name, tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    ckpt = [sys.executable, "-m", "ckpttools.cli", "consolidate", str(_checkpoint(name)), "--max-shard-size", "2KB"]
    assert subprocess.run([*ckpt, "--out", str(one)], capture_output=True).returncode == 0
    from fixtures.build.ds_launch import free_port

    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "ckpttools.cli", "consolidate", str(_checkpoint(name)), "--max-shard-size", "2KB",
           "--out", str(many), "--distributed"]  # fmt: skip
    r = subprocess.run(run, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in many.iterdir()) and len(names) > 3
    for n in names:
        assert (one / n).read_bytes() == (many / n).read_bytes(), n


# --- damaged and planted inputs ---------------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(_checkpoint(name), dst)
    return dst


def _dcp_folder(root: Path) -> Path:
    return next(p.parent for p in root.rglob(".metadata") if "optimizer" not in p.parent.name)


def test_a_missing_rank_file_is_named(tmp_path):
    root = _copy(PLAIN[0], tmp_path)
    folder = _dcp_folder(root)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp is missing"):
        open_checkpoint(root)


def test_a_truncated_rank_file_is_named(tmp_path):
    root = _copy(PLAIN[0], tmp_path)
    path = _dcp_folder(root) / "__1_0.distcp"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp is truncated"):
        open_checkpoint(root)


def test_a_flipped_byte_fails_the_crc_check(tmp_path):
    root = _copy(PLAIN[0], tmp_path)
    ckpt = open_checkpoint(root)
    seg = ckpt.sources(ckpt.train_dtype)[0].segments[0]
    record = seg.tensor.record
    data = bytearray(record.path.read_bytes())
    data[record.offset] ^= 0xFF
    record.path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        consolidate(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_foreign_metadata_is_refused(tmp_path):
    root = _copy(PLAIN[0], tmp_path)
    (_dcp_folder(root) / ".metadata").write_bytes(pickle.dumps({"not": "dcp"}))
    with pytest.raises(CorruptCheckpointError, match="does not hold torch Distributed Checkpoint metadata"):
        open_checkpoint(root)


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch PLANTED",))


def test_a_planted_pickle_never_runs(tmp_path, monkeypatch):
    root = _copy(PLAIN[0], tmp_path)
    monkeypatch.chdir(tmp_path)
    (_dcp_folder(root) / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to unpickle 'posix\.system'"):
        open_checkpoint(root)
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "inspect", str(root)], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "PLANTED").exists()


def test_a_storage_path_outside_the_folder_is_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    root = _copy(PLAIN[0], tmp_path)
    folder = _dcp_folder(root)
    meta = FileSystemReader(str(folder)).read_metadata()  # our own fixture: trusted, read with torch to alter it
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = "../../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match="not a file of the checkpoint folder"):
        open_checkpoint(root)


def test_chunks_that_leave_a_hole_are_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    root = _copy(PLAIN[0], tmp_path)
    folder = _dcp_folder(root)
    meta = FileSystemReader(str(folder)).read_metadata()
    _, entry = next(
        (k, v) for k, v in meta.state_dict_metadata.items() if getattr(v, "chunks", None) and len(v.chunks) > 1
    )
    entry.chunks.pop()
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CorruptCheckpointError, match=r"uncovered|hold"):
        open_checkpoint(root)


def test_push_publishes_the_consolidated_model_and_no_training_state(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from huggingface_hub import constants

    from ckpttools.cli import main
    from tests.support.hub_server import LocalHub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    name = PLAIN[0]
    token = "hf_LocalToken_dcp_27182"
    with LocalHub(token=token) as hub:
        args = ["push", str(_checkpoint(name)), "--repo", "org/fsdp2", "--endpoint", hub.url, "--token", token]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, res.output
        files = hub.files("org/fsdp2")
    assert {"model.safetensors", "config.json", "README.md"} <= set(files)
    assert not any(p.endswith((".distcp", ".metadata")) for p in files)
    card = files["README.md"].decode()
    assert "torch Distributed Checkpoint (FSDP2) checkpoint" in card and "ZeRO stage" not in card
    from safetensors.torch import load

    ours = load(files["model.safetensors"])
    tied = _tied(name)
    assert not set(tied) & set(ours)  # a tied weight published once, as save_pretrained does
    for key, expected in _reference(name).items():
        assert torch.equal(ours[tied.get(key, key)], expected), key


TIED = [n for n in PLAIN if _tied(n)]


@pytest.mark.parametrize("name", TIED)
def test_a_tied_embedding_is_reported_stored_once_and_counted_as_from_pretrained_counts(name, tmp_path):
    """issue 35 item 3: FSDP2 stores a tied embedding under both names; one Parameter, one count everywhere."""
    from transformers import AutoModelForCausalLM

    from ckpttools.ops.inspect import inspect_checkpoint
    from ckpttools.ops.verify import verify_folder

    info = inspect_checkpoint(_checkpoint(name))
    assert info["tied"] == _tied(name)
    assert (info["num_frozen"], info["frozen_parameters"]) == (0, 0)  # the alias is no frozen weight
    result = consolidate(_checkpoint(name), tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    report = verify_folder(tmp_path / "out", against=_checkpoint(name))
    assert report.ok, report.problems
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    counts = {info["num_parameters"], info["trainable_parameters"], result.num_parameters, report.num_parameters}
    assert counts == {model.num_parameters()}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # re-tied on load
    live = load_file(FIXTURES / name / "reference" / "live_full_state.safetensors")
    assert torch.equal(model.lm_head.weight, live["lm_head.weight"])


@pytest.mark.parametrize("name", [n for n in WEIGHTS + RANK_FILES if not _tied(n)])
def test_an_untied_model_keeps_every_tensor(name, tmp_path):
    """A tie is recorded only where the tensors are one Parameter: untied lm_head and embeddings stay two tensors."""
    ckpt = open_checkpoint(_checkpoint(name))
    assert ckpt.shared_params == {}
    result = consolidate(_checkpoint(name), tmp_path / "out", config=_config(name))
    assert "lm_head.weight" in _load_folder(tmp_path / "out")
    assert result.num_parameters == sum(t.numel() for t in _load_folder(tmp_path / "out").values())


def test_a_tie_needs_equal_bytes(monkeypatch):
    """Names and optimizer state alone do not make a tie: tensors whose bytes differ are never tied."""
    from ckpttools.layouts.dcp import ties

    monkeypatch.setattr(ties, "same_bytes", lambda a, b: False)
    ckpt = open_checkpoint(_checkpoint(TIED[0]))
    assert ckpt.shared_params == {} and "lm_head.weight" in ckpt.bit16


@pytest.mark.parametrize("name", ACCELERATE + RANK_FILES)
def test_accelerate_saves_hint_config_and_report_the_optimizer_beside_the_model(name, tmp_path):
    """issue 35 item 8: no config.json -> the --config hint; the optimizer state in optimizer_0/ (or its rank files)
    is reported with its keys and the bytes of the live optimizer's state, from metadata alone."""
    from ckpttools.ops.inspect import inspect_checkpoint

    result = consolidate(_checkpoint(name), tmp_path / "out")
    assert any("pass --config" in n for n in result.notes), result.notes
    info = inspect_checkpoint(_checkpoint(name))
    live = load_file(FIXTURES / name / "reference" / "live_full_optim.safetensors")
    assert info["optimizer_saved"] is True
    assert set(info["optimizer_states"]) == {k.rsplit(".", 1)[1] for k in live}
    assert info["optimizer_state_bytes"] == sum(t.numel() * t.element_size() for t in live.values())
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "inspect", str(_checkpoint(name))],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("optim states"))
    assert "exp_avg" in line and "none" not in line and "optimizer_0" in line


@pytest.mark.parametrize("name", HF_SHARDS)
def test_a_save_without_optimizer_state_says_so(name):
    from ckpttools.ops.inspect import inspect_checkpoint

    info = inspect_checkpoint(_checkpoint(name))
    assert (info["optimizer_saved"], info["optimizer_states"], info["optimizer_state_bytes"]) == (False, [], 0)
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "inspect", str(_checkpoint(name))],
                       capture_output=True, text=True)  # fmt: skip
    assert "optim states   none saved" in r.stdout, r.stdout

"""One dtype spelling and one parameter count in every --json output, progress for `verify --against`, and errors
that advise --step where --step is what helps."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from ckpttools.cli import main

from .conftest import FIXTURES, fixture_meta

TRAINER = FIXTURES / "trainer_z3_nogather_bf16" / "out"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _json(res):
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _stored_elements(folder) -> int:
    total = 0
    for path in folder.rglob("*.safetensors"):
        with safe_open(path, "np") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def _checkpoint(name):
    return FIXTURES / name / fixture_meta(name).get("checkpoint", "checkpoint")


@pytest.mark.parametrize(
    ("name", "dtype", "spelled"),
    [
        ("z2_dp2_bf16", "fp32", "float32"),  # bare engine save: buffers and a tied alias stored as they are
        ("z2_dp2_bf16", "bf16", "bfloat16"),
        ("pp2_dp1_z1_bf16", "fp32", "float32"),  # a pipeline model with a buffer
        ("trainer_z3_nogather_bf16", "float16", "float16"),  # an HF folder: lm_head tied, stored once
        ("peft_trainer_z2_bf16", "fp32", "float32"),  # a PEFT run: the adapter folder
    ],
)
def test_consolidate_and_verify_report_the_same_count_and_dtype(tmp_path, name, dtype, spelled):
    ckpt = TRAINER if name.startswith("trainer") else _checkpoint(name)
    out = tmp_path / "out"
    made = _json(run("consolidate", ckpt, "--out", out, "--dtype", dtype, "--json"))
    checked = _json(run("verify", out, "--json"))
    assert made["dtype"] == spelled and spelled in checked["dtype"]  # a bare folder's fp32 buffer makes it "mixed"
    assert not {"fp32", "bf16", "fp16"} & set(checked["dtype"].replace("(", " ").replace(",", " ").split())
    assert made["num_parameters"] == checked["num_parameters"] == _stored_elements(out)


def test_the_452_vs_655_folder(tmp_path):
    """The bare z2_dp2 folder from the report: 452 trainable+frozen elements, plus 11 buffer elements and the tied
    head.weight (192) that a bare folder stores as its own tensor for load_state_dict(strict=True): 655 stored."""
    out = tmp_path / "out"
    made = _json(run("consolidate", _checkpoint("z2_dp2_bf16"), "--out", out, "--json"))
    assert made["num_parameters"] == _json(run("verify", out, "--json"))["num_parameters"] == 655


def test_trainers_own_folder_counts_a_stored_tie_once():
    """Trainer's ZeRO-2 save stores lm_head.weight beside transformer.wte.weight (a clone); the model ties them."""
    folder = FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2"
    data = _json(run("verify", folder, "--json"))
    assert data["num_parameters"] == _stored_elements(folder) - _tied_elements(folder)


def _tied_elements(folder) -> int:
    with safe_open(folder / "model.safetensors", "np") as f:
        shape = f.get_slice("lm_head.weight").get_shape()
    return shape[0] * shape[1]


def test_verify_against_draws_progress_for_a_person_watching(monkeypatch, tmp_path):
    out = tmp_path / "out"
    _json(run("consolidate", TRAINER, "--out", out, "--json"))
    quiet = run("verify", out, "--against", TRAINER)
    assert quiet.exit_code == 0 and "verify:" not in quiet.stderr  # not a terminal: no bar

    common = importlib.import_module("ckpttools.cli._common")
    monkeypatch.setattr(common, "progress_enabled", lambda q: not q)  # as if stderr were a terminal, CI unset
    res = run("verify", out, "--against", TRAINER)
    assert res.exit_code == 0, res.output
    assert "verify:" in res.stderr and "(100%)" in res.stderr
    assert "verify:" not in run("verify", out, "--against", TRAINER, "-q").stderr


def test_a_trainer_output_dir_with_an_unusable_newest_checkpoint_advises_step(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(FIXTURES / "trainer_z2_bf16" / "out", out)
    (out / "checkpoint-2" / "latest").unlink()  # saved with save_only_model: no DeepSpeed state
    shutil.rmtree(out / "checkpoint-2" / "global_step2")
    res = run("consolidate", out, "--out", tmp_path / "o")
    assert res.exit_code == 1
    assert "--step" in res.stderr and "steps 1" in res.stderr, res.stderr
    assert _json(run("consolidate", out, "--step", "1", "--out", tmp_path / "o", "--json"))["files"]
    res = run("verify", tmp_path / "o", "--against", out)
    assert res.exit_code == 1 and "--step" in res.stderr, res.stderr


@pytest.mark.parametrize("name", ["fsdp2_dcp_dp2_fp32", "accelerate_fsdp2_sharded", "z2_dp2_bf16"])
def test_verify_on_a_training_checkpoint_says_to_consolidate_first(name):
    """issue 35: not "no floating weights in no weight file", but what the folder is and what to run."""
    res = run("verify", FIXTURES / name / "checkpoint")
    assert res.exit_code == 2, res.output
    assert "training checkpoint" in res.stderr and "ckpt consolidate" in res.stderr
    assert "no weight file" not in res.output and "Traceback" not in res.output


def test_total_size_is_the_tensor_bytes_the_index_records(tmp_path):
    """docs/json.md: total_size counts the tensors' bytes, as an HF index's metadata.total_size does."""
    out = tmp_path / "out"
    made = _json(run("consolidate", FIXTURES / "z2_dp2_bf16" / "checkpoint", "--out", out, "--max-shard-size", "2KB",
                     "--json"))  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    checked = _json(run("verify", out, "--json"))
    stored = 0
    for f in out.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            stored += sum(st.get_tensor(k).nbytes for k in st.keys())  # noqa: SIM118
    assert made["total_size"] == checked["total_size"] == index["metadata"]["total_size"] == stored
    docs = (FIXTURES.parent / "docs" / "json.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `total_size`"))
    assert "bytes of the tensors stored" in row  # not "of the weight files", which are a header larger

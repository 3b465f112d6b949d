"""`--json` on failure: one JSON object on stdout, `{"error": {"message", "exit_code", "problems"}}`, for every
command and every kind of failure (issue 35 item 5), printed by the one error boundary (cli/_common.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ckpttools.cli import main

from .conftest import FIXTURES

TRAINER = FIXTURES / "trainer_z2_bf16" / "out"
DCP = FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint"


def run(*args, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def _error_object(res, code: int) -> dict:
    """The one JSON object on stdout, an error with `code`, whose message is the last `Error:` line of stderr."""
    assert res.exit_code == code, res.output
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, res.stdout
    error = json.loads(lines[0])["error"]
    assert error["exit_code"] == code and isinstance(error["problems"], list), error
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert errors and errors[-1] == f"Error: {error['message']}", res.stderr
    return error


def test_a_bad_checkpoint_is_an_error_object_exit_1(tmp_path):
    error = _error_object(run("consolidate", tmp_path, "--out", tmp_path / "o", "--json"), 1)
    assert "is not a checkpoint ckpt reads" in error["message"] and "torch DCP" in error["message"]


def test_a_missing_path_is_an_error_object_exit_2(tmp_path):
    """`consolidate nonexistent --json` printed nothing on stdout: click's usage errors reach the JSON too."""
    error = _error_object(run("consolidate", tmp_path / "nonexistent", "--json"), 2)
    assert "does not exist" in error["message"]


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", TRAINER, "--json", "--no-such-option"],  # click: no such option
        ["reshard", TRAINER, "--json", "--stage", "7"],  # click: out of range
        ["no-such-command", "--json"],  # click: no such command, found by the group
        ["inspect", TRAINER, "--best", "--step", "1", "--json"],  # ours: a UsageError
    ],
)
def test_usage_errors_are_error_objects_exit_2(args):
    _error_object(run(*args), 2)


def test_without_json_a_failure_prints_nothing_on_stdout(tmp_path):
    res = run("consolidate", tmp_path, "--out", tmp_path / "o")
    assert res.exit_code == 1 and res.stdout == "" and res.stderr.startswith("Error: ")


def test_reshard_onto_an_existing_output_is_an_error_object(tmp_path):
    (tmp_path / "o").mkdir()
    error = _error_object(run("reshard", TRAINER, "--dp", "2", "--out", tmp_path / "o", "--json"), 1)
    assert "already exists" in error["message"]


def test_an_fsdp2_reshard_is_an_error_object(tmp_path):
    error = _error_object(run("reshard", DCP, "--dp", "3", "--out", tmp_path / "o", "--json"), 1)
    assert "torch Distributed Checkpoint" in error["message"] and not (tmp_path / "o").exists()


def test_verify_against_a_missing_checkpoint_is_an_error_object(tmp_path):
    made = tmp_path / "m"
    assert run("consolidate", TRAINER, "--out", made, "-q").exit_code == 0
    _error_object(run("verify", made, "--against", tmp_path / "nope", "--json"), 2)


def test_a_push_refused_by_verification_lists_its_problems_in_the_json(tmp_path):
    """`push --dry-run --json` when verification fails: the problems behind the refusal reach the JSON."""
    made = tmp_path / "m"
    assert run("consolidate", TRAINER, "--out", made, "-q").exit_code == 0
    weights = made / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated: verify finds it
    env = {"HF_HUB_OFFLINE": "1", "HF_TOKEN": None}  # a dry run offline checks the folder only
    error = _error_object(run("push", made, "--repo", "org/x", "--dry-run", "--json", env=env), 1)
    assert "failed verification" in error["message"] and "nothing was pushed" in error["message"]
    assert len(error["problems"]) == 1 and "truncated" in error["problems"][0], error


def test_a_failure_after_the_result_was_printed_prints_no_second_object(tmp_path):
    """verify with problems prints its report (ok: false) and exits 1: still one object."""
    made = tmp_path / "m"
    assert run("consolidate", TRAINER, "--out", made, "-q").exit_code == 0
    (made / "model.safetensors").write_bytes((made / "model.safetensors").read_bytes()[:-100])
    res = run("verify", made, "--json")
    assert res.exit_code == 1 and len(res.stdout.splitlines()) == 1, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is False and "error" not in data


def test_run_guarded_takes_json_for_the_drop_ins(capsys):
    """The argparse entry points reach the same boundary: `as_json=True` makes their failure the JSON object."""
    from ckpttools.cli._common import run_guarded
    from ckpttools.errors import VerificationError

    def body():
        error = VerificationError("2 problems")
        error.problems = ["a.safetensors: truncated", "b.safetensors: bad header"]
        raise error

    assert run_guarded(body, as_json=True) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "error": {"message": "2 problems", "exit_code": 1,
                  "problems": ["a.safetensors: truncated", "b.safetensors: bad header"]}
    }  # fmt: skip
    assert err.splitlines()[-1] == "Error: 2 problems"
    assert run_guarded(body) == 1  # without: stderr only
    assert capsys.readouterr().out == ""


def test_the_ckpt_process_prints_the_error_object(tmp_path):
    """The console script (signal handling installed, its own main) keeps the promise as CliRunner does."""
    env = {**os.environ, "CI": "true"}
    ckpt = Path(sys.executable).parent / "ckpt"
    command = [str(ckpt)] if ckpt.exists() else [sys.executable, "-m", "ckpttools.cli"]
    for args, code in (([str(tmp_path / "none"), "--json"], 2), ([str(tmp_path), "--json"], 1)):
        proc = subprocess.run([*command, "inspect", *args], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == code, proc.stderr
        assert json.loads(proc.stdout)["error"]["exit_code"] == code and "Traceback" not in proc.stderr


def test_a_step_that_cannot_apply_is_an_error_object_and_nothing_is_written(tmp_path):
    res = run("consolidate", TRAINER / "checkpoint-2", "--step", "1", "--out", tmp_path / "o", "--json")
    error = _error_object(res, 2)
    assert "--step 1 cannot apply" in error["message"] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_on_many_ranks_only_rank_0_prints_the_error_object(rank, monkeypatch, capsys):
    """Every rank says why it could not join (stderr); the run's one JSON object comes from rank 0 alone."""
    import click

    from ckpttools.cli import _common
    from ckpttools.errors import RemoteError

    def refuse(launch):
        raise RemoteError("rank 0 did not come within CKPT_RENDEZVOUS_TIMEOUT (300 s)")

    monkeypatch.setattr("ckpttools.ranks.distributed.join_group", refuse)
    monkeypatch.setattr(_common._JSON, "wanted", True)
    monkeypatch.setattr(_common._JSON, "printed", False)
    with pytest.raises(click.exceptions.Exit) as e:
        _common.run_on_ranks(SimpleNamespace(rank=rank), lambda group: None)
    out, err = capsys.readouterr()
    assert e.value.exit_code == 3 and err.startswith("Error: rank 0 did not come"), err
    if rank == 0:
        assert json.loads(out)["error"]["exit_code"] == 3
    else:
        assert out == ""

"""A signal while `ckpt push`'s commit request is with the Hub (issue 34 item 4): the local Hub holds the commit
and SIGINT or SIGTERM comes at seeded random moments across the hold. push waits for the Hub's answer (bounded,
CKPT_PUSH_COMMIT_WAIT; a second signal ends the wait), then reads the branch head, and says "published" (exit 0),
"nothing was published" (130/143) only when the Hub refused it or its head shows no commit, or that whether it
landed is unknown. Never "nothing was published" for a commit that landed.

CKPT_PUSH_SIGNAL_TRIALS (default 4) moments per case, from CKPT_PUSH_SIGNAL_SEED (default 34).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpttools import consolidate
from ckpttools.ops.push import IN_DOUBT
from tests.support.hub_server import LocalHub

from .conftest import FIXTURES

TOKEN = "hf_LocalToken_interrupt_16180"
CHECKPOINT = FIXTURES / "trainer_z3_nogather_bf16" / "out" / "checkpoint-2"
CKPT = Path(sys.executable).parent / "ckpt"
TRIALS = int(os.environ.get("CKPT_PUSH_SIGNAL_TRIALS") or 4)
SEED = int(os.environ.get("CKPT_PUSH_SIGNAL_SEED") or 34)
HOLD = 1.5  # seconds the Hub holds the commit request, as in the fault campaign that found the bug
COMMIT = r"/commit/main$"


def _moments(case: str) -> list[tuple[float, signal.Signals]]:
    """TRIALS moments across the hold (seconds after the request arrived), each with SIGINT or SIGTERM."""
    rng = random.Random(f"{SEED}-{case}")
    return [(rng.uniform(0.02, HOLD - 0.05), rng.choice([signal.SIGINT, signal.SIGTERM])) for _ in range(TRIALS)]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model"
    consolidate(CHECKPOINT, out)
    return out


def _push(hub: LocalHub, folder: Path, repo: str, tmp_path: Path, *, wait: float,
          signals_at: list[tuple[float, signal.Signals]]) -> tuple[int, str, str]:  # fmt: skip
    """Run `ckpt push --json` as a process; send each signal at its moment after the commit request arrived."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env |= {"HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf"), "CI": "true",
            "CKPT_PUSH_COMMIT_WAIT": str(wait)}  # fmt: skip
    proc = subprocess.Popen(
        [str(CKPT), "push", str(folder), "--repo", repo, "--endpoint", hub.url, "--token", TOKEN, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert hub.arrived.wait(180), "the commit request never arrived"
        for moment, signum in signals_at:
            time.sleep(max(0.0, hub.arrived_at + moment - time.monotonic()))
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    return proc.returncode, out, err


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_commit_that_lands_after_the_signal_is_reported_published(model_folder, tmp_path, trial):
    moment, signum = _moments("lands")[trial]
    with LocalHub(token=TOKEN) as hub:
        hub.hold("POST", COMMIT, HOLD)  # the Hub is busy HOLD s, then commits and answers
        code, out, err = _push(hub, model_folder, "org/lands", tmp_path, wait=30, signals_at=[(moment, signum)])
        head = hub.repos["org/lands"].refs["main"]
        pushed = hub.files("org/lands")
    assert code == 0, err  # published: the signal came while the request was with the Hub, which committed it
    assert f"the commit request was interrupted ({signum.name}), but the Hub had committed it" in err
    assert "nothing was published" not in err
    data = json.loads(out)
    assert data["commit_recovered"] and data["oid"] == head and head in data["commit_url"]
    assert pushed["model.safetensors"] == (model_folder / "model.safetensors").read_bytes()


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_commit_the_hub_refuses_after_the_signal_says_nothing_was_published(model_folder, tmp_path, trial):
    moment, signum = _moments("refused")[trial]
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", COMMIT, 500, hold=HOLD, message="commit failed")  # held, then refused: it never commits
        code, out, err = _push(hub, model_folder, "org/refused", tmp_path, wait=30, signals_at=[(moment, signum)])
        assert set(hub.files("org/refused")) == {".gitattributes"}
    assert code == 128 + signum, err  # the Hub answered, and its head shows no commit: true, and the usual line
    assert err.endswith(f"Interrupted ({signum.name}); nothing was published.\n"), err
    assert out == "" or set(json.loads(out)) == {"error"}


def test_no_answer_within_the_wait_is_unknown_and_the_rerun_finishes(model_folder, tmp_path):
    with LocalHub(token=TOKEN) as hub:
        hub.hold("POST", COMMIT, 4)  # longer than the wait: the commit lands after push has given up waiting
        code, _, err = _push(hub, model_folder, "org/late", tmp_path, wait=0.5, signals_at=[(0.3, signal.SIGINT)])
        landed_when_push_ended = bool(hub.commits)
        assert code == 130, err
        assert f"Error: interrupted (SIGINT): {IN_DOUBT}" in err and "nothing was published" not in err
        assert not landed_when_push_ended  # it was unknown indeed: the Hub was still holding the request
        deadline = time.monotonic() + 30
        while not hub.commits and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "model.safetensors" in hub.files("org/late")  # it landed after all: "nothing was published" was false
        puts = list(hub.lfs_puts)
        hub.arrived.clear()
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env |= {"HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf")}
        rerun = subprocess.run([str(CKPT), "push", str(model_folder), "--repo", "org/late", "--endpoint", hub.url,
                                "--token", TOKEN], capture_output=True, text=True, env=env, timeout=180)  # fmt: skip
        assert rerun.returncode == 0, rerun.stderr
        assert "nothing changed" in rerun.stderr and hub.lfs_puts == puts and len(hub.commits) == 1


def test_a_second_signal_ends_the_wait(model_folder, tmp_path):
    with LocalHub(token=TOKEN) as hub:
        hub.hold("POST", COMMIT, 30)
        code, _, err = _push(hub, model_folder, "org/again", tmp_path, wait=60,
                             signals_at=[(0.2, signal.SIGTERM), (0.8, signal.SIGTERM)])  # fmt: skip
        assert not hub.commits  # push ended while the Hub still held the request, well before the wait's bound
    assert code == 143, err
    assert "waiting up to 60 s for its answer" in err
    assert f"Error: interrupted (SIGTERM): {IN_DOUBT}" in err and "nothing was published" not in err

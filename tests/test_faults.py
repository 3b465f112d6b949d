"""Fault injection: `ckpt` under signals, kills, full disks, racing runs, symlinks, changing inputs and a parent
job's launcher environment leaves the earlier output or the new one, complete, and nothing else (issue 27).

Each test is one seeded trial (see tests/support/faults.py for the harness and the rules every outcome is held to):

    signal-<command>[-overwrite]  SIGINT, SIGTERM, SIGHUP, SIGKILL or two SIGINTs 20-200 ms apart, at a random
                                  moment from start-up (0-300 ms) to 1.2x an undisturbed run; after SIGKILL the
                                  next run in the same place must clean up (with a note) and succeed
    signal-after-publishing       the same 0-15 ms after the output folder appeared (command by seed): exit 0
                                  and the output complete (or -9 after SIGKILL), never a failure
    concurrent                    2-3 `consolidate --overwrite` runs at one --out, started together
    symlink-out                   --out is a symlink to an earlier output elsewhere (--overwrite; odd seeds: + a signal)
    dangling-symlink              --out is a symlink to nothing: refused before any work
    out-of-space                  --out on a small tmpfs (bytes, inodes, or a filler racing the write); root only
    input-changes                 a shard truncated or scribbled over while ckpt reads it
    launcher-env                  started with a training rank's RANK=0 WORLD_SIZE=2 MASTER_*: one process, finishes
    torchrun-rank-kill (slow)     SIGKILL/SIGTERM to one rank of `torchrun ... ckpt ... --distributed`: the others
                                  stop within seconds, the exit status agrees with the disk, staging only after
                                  rank 0 itself was SIGKILLed (and the next run cleans it up)

Run: `./scripts/test tests/test_faults.py -m "not slow" -q` (the fast tier: 3 trials per category, about 40 s on
2 cores); `CKPT_FAULT_TRIALS=200 ./scripts/test tests/test_faults.py -q -s` for the full campaign.

Settings (environment):

    CKPT_FAULT_TRIALS=N                 trials per category (default 3; CI's full tier: hundreds)
    CKPT_FAULT_CASE=category:seed[,...] run only these trials (a failing trial prints its line)
    CKPT_FAULT_SUMMARY=path.json        also write the campaign summary there
    CKPT_FAULT_DELAY_MS=ms              pin the fault's delay (reproducing a failure: its report prints the line)
    CKPT_FAULT_LAUNCHER_TIMEOUT=s       launcher-env: how long before a run counts as hung (default 120)
    CKPT_FAULT_TORCHRUN_TIMEOUT=s       torchrun-rank-kill: the same for a torchrun run (default 90)

At the end of the session the counts per category and outcome go to <pytest basetemp>/fault-summary.json and are
printed (visible with -s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support import faults


def _cases(categories: list[str]) -> list:
    return [pytest.param(c, s, id=f"{c}:{s}") for c in categories for s in faults.seeds_for(c)]


@pytest.fixture(scope="session")
def campaign(tmp_path_factory: pytest.TempPathFactory):
    camp = faults.Campaign(tmp_path_factory.mktemp("faults"))
    yield camp
    if camp.ledger.trials:
        _write_summary(camp, tmp_path_factory.getbasetemp() / "fault-summary.json")


def _write_summary(camp: faults.Campaign, path: Path) -> None:
    text = faults.to_json(camp.ledger.summary())
    path.write_text(text)
    extra = os.environ.get("CKPT_FAULT_SUMMARY")
    if extra:
        Path(extra).write_text(text)
    sys.stdout.write(f"\nFault-injection summary ({path}):\n{text}\n")


def _judge(trial: faults.Trial) -> None:
    if not trial.ok:
        pytest.fail(trial.report(), pytrace=False)


@pytest.mark.parametrize(("category", "seed"), _cases([*faults.signal_categories(), faults.LATE]))
def test_signal_at_a_random_moment(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.signal_trial(campaign, category, seed))


@pytest.mark.parametrize(("category", "seed"), _cases(["concurrent"]))
def test_concurrent_publishers(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.concurrent_trial(campaign, category, seed))


@pytest.mark.parametrize(("category", "seed"), _cases(["symlink-out"]))
def test_symlinked_out(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.symlink_trial(campaign, category, seed))


@pytest.mark.parametrize(("category", "seed"), _cases(["dangling-symlink"]))
def test_dangling_symlink_out(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.dangling_symlink_trial(campaign, category, seed))


@pytest.mark.parametrize(("category", "seed"), _cases(["out-of-space"]))
def test_out_of_space(campaign: faults.Campaign, category: str, seed: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        trial = faults.enospc_trial(campaign, category, seed)
    except faults.MountFailed as e:
        pytest.skip(str(e))
    _judge(trial)


@pytest.mark.parametrize(("category", "seed"), _cases(["input-changes"]))
def test_input_changes_underneath(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.input_change_trial(campaign, category, seed))


@pytest.mark.parametrize(("category", "seed"), _cases(["launcher-env"]))
def test_started_from_a_training_rank(campaign: faults.Campaign, category: str, seed: int) -> None:
    _judge(faults.launcher_env_trial(campaign, category, seed))


@pytest.mark.slow
@pytest.mark.parametrize(("category", "seed"), _cases(["torchrun-rank-kill"]))
def test_torchrun_rank_killed(campaign: faults.Campaign, category: str, seed: int) -> None:
    if not faults.TORCHRUN.exists():
        pytest.skip(f"no torchrun beside {sys.executable}")
    _judge(faults.torchrun_trial(campaign, category, seed))

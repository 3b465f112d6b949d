"""`ckpt consolidate` and `ckpt reshard` on many processes: the byte-balanced planner, then real multi-process
runs on this machine.

Each run starts every rank as its own `ckpt` process with the variables a launcher sets (WORLD_SIZE, RANK,
MASTER_ADDR, MASTER_PORT) and CKPT_DISTRIBUTED=1 (the multi-process mode is asked for, never guessed), so every
rank's exit code and output can be checked; one run goes through torchrun itself (`--no-python ckpt ...
--distributed`). Outputs are compared file by file (sha256) with a one-process run.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpttools.errors import CorruptCheckpointError, UsageError
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops.consolidate import DTYPES, _plan_output, _tensor_records
from ckpttools.ranks.distributed import (
    Launch,
    RankFailedError,
    describe_failure,
    ignored_launcher_note,
    launch_from_env,
    plan_by_bytes,
    records_to_verify,
)
from ckpttools.signals import Interrupted
from tests.support.ranks import (
    CKPT,
    TRAINER,
    Z2,
    Z3,
    _env,
    _on_ranks,
    _one_process,
    _tree_sha256,
    ds_launch,
    file_bytes,
)

# --------------------------------------------------------------------------------------------------
# The pure parts
# --------------------------------------------------------------------------------------------------


def test_plan_by_bytes_gives_the_largest_first_to_the_least_loaded_rank():
    assert plan_by_bytes([10, 3, 7, 4], 2) == [0, 0, 1, 1]  # 10 -> 0, 7 -> 1, 4 -> 1, 3 -> 0: loads 13 and 11
    assert plan_by_bytes([5, 5, 5, 5, 5, 5], 3) == [0, 1, 2, 0, 1, 2]
    assert plan_by_bytes([1, 100, 1, 1], 2) == [1, 0, 1, 1]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sizes", [[7], [3, 9, 1, 12, 5, 5, 8, 2, 11], [1 << 30] * 5 + [1 << 20] * 7, list(range(40))])
def test_plan_by_bytes_is_balanced_complete_and_deterministic(sizes, world):
    owners = plan_by_bytes(sizes, world)
    assert len(owners) == len(sizes)
    assert all(0 <= r < world for r in owners)
    loads = [sum(s for s, r in zip(sizes, owners, strict=True) if r == rank) for rank in range(world)]
    # LPT: no rank carries more than an even share plus the largest item, and idle ranks only when items run out
    assert max(loads) <= sum(sizes) / world + max(sizes)
    assert sum(1 for load in loads if load) == min(world, sum(1 for s in sizes if s))
    assert plan_by_bytes(list(sizes), world) == owners


def test_plan_by_bytes_with_more_ranks_than_items_and_no_items():
    assert plan_by_bytes([4, 9], 4) == [1, 0]
    assert plan_by_bytes([], 3) == []
    with pytest.raises(ValueError, match="at least 1"):
        plan_by_bytes([1], 0)


def test_launch_from_env_reads_the_launchers_variables():
    assert launch_from_env({}) is None
    assert launch_from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert launch_from_env(env) == Launch(rank=3, world_size=4, master_addr="node0", master_port=29500)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"RANK=2 is outside 0\.\.1"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_launch_from_env_refuses_incomplete_settings(env, match):
    with pytest.raises(UsageError, match=match):
        launch_from_env(env)


def test_a_failure_is_described_as_the_cli_would_print_it():
    assert describe_failure(CorruptCheckpointError("bad\nrecord")) == (1, "bad record")
    assert describe_failure(UsageError("no")) == (2, "no")
    assert describe_failure(KeyboardInterrupt()) == (130, "interrupted")
    assert describe_failure(FileNotFoundError(2, "No such file or directory", "/x")) == (
        1,
        "No such file or directory: /x",
    )
    assert describe_failure(RankFailedError(1, 2, "bad record", 3)) == (3, "rank 1 of 2 failed: bad record")
    assert describe_failure(RankFailedError(None, 2, "bad record", 1)) == (1, "bad record")
    assert describe_failure(KeyError("k")) == (1, "internal error (KeyError: 'k')")
    assert describe_failure(Interrupted(signal.SIGTERM)) == (143, "interrupted (SIGTERM)")
    assert describe_failure(Interrupted(signal.SIGHUP)) == (129, "interrupted (SIGHUP)")


def test_launcher_variables_without_distributed_are_named_in_one_note():
    assert ignored_launcher_note({}) is None
    assert ignored_launcher_note({"PATH": "/bin"}) is None
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert ignored_launcher_note(env) == (
        "launcher variables found (WORLD_SIZE=2); running as one process, pass --distributed to share the work"
    )
    assert "(TORCHELASTIC_RUN_ID)" in ignored_launcher_note({"TORCHELASTIC_RUN_ID": "x"})


@pytest.mark.parametrize("world", [None, "1", "2"])
def test_a_one_process_run_never_imports_torch_distributed(tmp_path, world):
    """Also with a launcher's variables but without --distributed (a `ckpt` a training rank started)."""
    code = (
        "import sys\n"
        "from ckpttools.cli import main\n"
        f"main(['consolidate', {str(Z3)!r}, '--out', {str(tmp_path / 'o')!r}, '--json'], standalone_mode=False)\n"
        "assert 'torch.distributed' not in sys.modules, 'imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ds_launch.RENDEZVOUS_VARS}
    env.update({"WORLD_SIZE": world} if world else {})
    if world == "2":
        env.update({"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "world_size" not in json.loads(proc.stdout)
    assert ("launcher variables found (WORLD_SIZE=2)" in proc.stderr) == (world == "2"), proc.stderr


# --------------------------------------------------------------------------------------------------
# Real runs on several processes
# --------------------------------------------------------------------------------------------------


def _digest(folder):
    return {p.name: hashlib.sha256(file_bytes(p)).hexdigest() for p in sorted(folder.iterdir())}


def test_three_ranks_write_the_shards_byte_identical_to_one_process(tmp_path):
    args = ["consolidate", Z3, "--max-shard-size", "1KB", "--json"]
    single = _one_process(*args, "--out", tmp_path / "one")
    runs = _on_ranks(3, *args, "--out", tmp_path / "three")
    assert [rc for rc, _, _ in runs] == [0, 0, 0], runs
    assert all(out == err == "" for _, out, err in runs[1:]), runs  # only rank 0 prints
    assert runs[0][2] == ""
    data = json.loads(runs[0][1])
    shards = [f for f in single["files"] if f.endswith(".safetensors")]
    assert len(shards) == 3
    assert data["world_size"] == 3
    assert _digest(tmp_path / "three") == _digest(tmp_path / "one")
    assert data["files"] == single["files"]
    assert set(data["ranks"]) == set(data["files"])
    assert sorted(data["ranks"][f] for f in shards) == [0, 1, 2]  # three shards of similar size: one per rank
    assert data["ranks"]["model.safetensors.index.json"] == 0
    without = {k: v for k, v in data.items() if k not in ("world_size", "ranks", "output_dir")}
    assert without == {k: v for k, v in single.items() if k != "output_dir"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "three"]  # no staging folder left


def test_torchrun_no_python_ckpt_writes_a_trainer_folder_byte_identical_to_one_process(tmp_path):
    """.bin shards of the 16-bit weights, the index, config and tokenizer files, through torchrun itself."""
    args = ["consolidate", TRAINER, "--to", "pt", "--dtype", "bf16", "--max-shard-size", "8KB", "--json"]
    single = _one_process(*args, "--out", tmp_path / "one")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--master_addr",
           "127.0.0.1", "--master_port", str(ds_launch.free_port()), "--no-python", "ckpt", *map(str, args),
           "--out", str(tmp_path / "two"), "--distributed"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # one JSON object: rank 1 printed nothing
    assert {"config.json", "tokenizer.json", "pytorch_model.bin.index.json"} <= set(single["files"])
    assert sum(f.endswith(".bin") for f in single["files"]) == 3
    assert _digest(tmp_path / "two") == _digest(tmp_path / "one")
    assert data["world_size"] == 2
    assert sorted(set(data["ranks"].values())) == [0, 1]
    assert all(data["ranks"][f] == 0 for f in data["files"] if not f.endswith(".bin"))
    assert data["notes"] == single["notes"]
    assert "match the shards exactly" in data["notes"][0]


def _damage_a_record_checked_by(rank, world, ckpt_dir, max_shard_size):
    """Flip one byte of a tensor record whose CRC-32 check the planner gives to `rank`."""
    ckpt = open_checkpoint(ckpt_dir)
    plan = _plan_output(ckpt, DTYPES["fp32"], "safetensors", max_shard_size, None)
    record = max(records_to_verify(_tensor_records(plan.tensors), rank, world), key=lambda r: r.nbytes)
    with open(record.path, "r+b") as fh:
        fh.seek(record.offset + record.nbytes // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return record


def test_one_rank_failing_fails_every_rank_and_leaves_nothing_behind(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(Z3, ckpt)
    record = _damage_a_record_checked_by(1, 3, ckpt, "1KB")
    runs = _on_ranks(3, "consolidate", ckpt, "--out", tmp_path / "out", "--max-shard-size", "1KB")
    assert [rc for rc, _, _ in runs] == [1, 1, 1], runs
    assert all(out == err == "" for _, out, err in runs[1:]), runs
    lines = runs[0][2].splitlines()
    assert runs[0][1] == "", runs[0]
    assert len(lines) == 1, runs[0]
    assert lines[0].startswith("Error: rank 1 of 3 failed: ")
    assert "fails its CRC-32 check" in lines[0]
    assert f"record {record.name}" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no staging folder


def test_a_refusal_every_rank_meets_is_the_one_process_line_from_rank_0(tmp_path):
    (tmp_path / "out").mkdir()
    runs = _on_ranks(2, "consolidate", Z3, "--out", tmp_path / "out")
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert runs[1][1:] == ("", "")
    message = (
        f"output folder {tmp_path / 'out'} already exists; pass --overwrite to replace it, or choose another --out"
    )
    assert runs[0][2].splitlines() == [f"Error: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not any((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------------------
# ckpt reshard on several processes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ckpt_dir", "world", "target"),
    [(Z2, 3, ["--dp", "3"]), (Z3, 2, ["--universal"]), (TRAINER, 2, ["--dp", "3"]), (Z2, 2, ["--stage", "3"])],
    ids=["z2_dp2_to_dp3_on_3_ranks", "z3_dp2_to_universal_on_2_ranks", "trainer_z3_to_dp3_on_2_ranks", "z2_to_z3"],
)
def test_reshard_on_ranks_is_byte_identical_to_one_process(tmp_path, ckpt_dir, world, target):
    args = ["reshard", ckpt_dir, *target, "--json"]
    single = _one_process(*args, "--out", tmp_path / "one")
    runs = _on_ranks(world, *args, "--out", tmp_path / "many")
    assert [rc for rc, _, _ in runs] == [0] * world, runs
    assert all(out == err == "" for _, out, err in runs[1:]), runs  # only rank 0 prints
    data = json.loads(runs[0][1])
    assert runs[0][2].splitlines() == [f"Note: {note}" for note in data["notes"]]
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    assert data["world_size"] == world
    assert set(data["ranks"]) == set(data["files"])
    assert sorted(set(data["ranks"].values())) == list(range(world))  # every rank wrote some of the files
    without = {k: v for k, v in data.items() if k not in ("world_size", "ranks", "output_dir")}
    assert without == {k: v for k, v in single.items() if k != "output_dir"}
    assert "world_size" not in single
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "one"]  # no staging folder left
    if "--universal" in target:
        assert data["ranks"][f"{data['tag']}/zero/optimizer_state.pt"] == 0
        folders = {}
        for name, rank in data["ranks"].items():
            parts = name.split("/")  # the tag's files; `latest_universal` beside the tag is rank 0's
            if len(parts) > 3 and parts[1] == "zero":
                folders.setdefault(parts[2], set()).add(rank)
        assert folders
        assert all(len(ranks) == 1 for ranks in folders.values())  # a parameter folder: one rank


def test_one_rank_failing_a_reshard_fails_every_rank_and_leaves_nothing_behind(tmp_path):
    from ckpttools.ops.reshard import _records_read, _tag_files

    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(Z2, ckpt_dir)
    ckpt = open_checkpoint(ckpt_dir)
    files = _tag_files(ckpt, 3, ckpt.zero_stage)
    record = max(records_to_verify(_records_read(files), 1, 3), key=lambda r: r.nbytes)
    with open(record.path, "r+b") as fh:
        fh.seek(record.offset + record.nbytes // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    runs = _on_ranks(3, "reshard", ckpt_dir, "--dp", "3", "--out", tmp_path / "out")
    assert [rc for rc, _, _ in runs] == [1, 1, 1], runs
    assert all(out == err == "" for _, out, err in runs[1:]), runs
    lines = runs[0][2].splitlines()
    assert runs[0][1] == "", runs[0]
    assert len(lines) == 1, runs[0]
    assert lines[0].startswith("Error: rank 1 of 3 failed: ")
    assert "fails its CRC-32 check" in lines[0]
    assert f"record {record.name}" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no staging folder


def test_a_reshard_refusal_every_rank_meets_is_the_one_process_line_from_rank_0(tmp_path):
    (tmp_path / "out").mkdir()
    runs = _on_ranks(2, "reshard", Z2, "--dp", "3", "--out", tmp_path / "out")
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert runs[1][1:] == ("", "")
    message = (
        f"output folder {tmp_path / 'out'} already exists; pass --overwrite to replace it, or choose another --out"
    )
    assert runs[0][2].splitlines() == [f"Error: {message}"]
    assert not any((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------------------
# A rank lost: before publishing (nothing published, every rank stops) and after (the output stands)
# --------------------------------------------------------------------------------------------------


def _rank_pid(port, rank):
    """The pid of the `ckpt` process that is rank `rank` of the group at MASTER_PORT=`port`."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ours = f"MASTER_PORT={port}".encode() in env and f"RANK={rank}".encode() in env
        if ours and b"ckpt" in cmd and b"torch.distributed.run" not in cmd:
            return int(proc.name)
    return None


def _wait(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_rank_killed_before_publishing_stops_the_others_and_publishes_nothing(tmp_path):
    """torchrun: rank 1 killed (SIGKILL) mid-write; the agent stops rank 0 (SIGTERM), which removes the staging."""
    port = ds_launch.free_port()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--master_addr",
           "127.0.0.1", "--master_port", str(port), "--no-python", "ckpt", "consolidate", str(Z3), "--out", str(out),
           "--max-shard-size", "1KB", "--distributed"]  # fmt: skip
    env = {**_env(), "CKPT_TEST_SLOW_WRITE_MS": "300"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: any(".ckpt-staging." in p.name for p in tmp_path.iterdir()) or proc.poll() is not None)
        pid = _rank_pid(port, 1)
        assert pid is not None, proc.communicate()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err
    assert stopped < 30, stopped  # the agent's SIGTERM, then rank 0's cleanup
    ours = [line for line in err.splitlines() if line.startswith(("Error: ", "Interrupted"))]  # torchrun logs too
    assert len(ours) == 1, err[-3000:]
    assert ours[0] == "Interrupted (SIGTERM); nothing was published." or ours[0].startswith(
        "Error: rank 0 of 2 lost contact with the other ranks ("
    ), ours
    assert "ckpttools" not in err, err[-3000:]  # no traceback of ours (torchrun prints its own ChildFailedError)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing published, no staging left


def test_a_rank_lost_after_publishing_leaves_exit_0_and_the_output(tmp_path):
    """Rank 1 killed while rank 0, after publishing, is about to print (CKPT_TEST_SLOW_WRITE_MS holds it there)."""
    out = tmp_path / "out"
    port = ds_launch.free_port()
    procs: list[subprocess.Popen[str]] = []
    for rank in range(2):
        env = {**_env(), "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "CKPT_DISTRIBUTED": "1", "CKPT_TEST_SLOW_WRITE_MS": "500"}  # fmt: skip
        procs.append(subprocess.Popen([str(CKPT), "consolidate", str(Z3), "--out", str(out), "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))  # fmt: skip
    _wait(lambda: out.exists() or procs[0].poll() is not None, timeout=240)
    procs[1].kill()
    rc = procs[0].wait(timeout=120)
    stdout, err = procs[0].communicate(timeout=120)
    procs[1].communicate()
    assert rc == 0, err
    if stdout:  # rank 1 went while rank 0 was about to print the result
        assert json.loads(stdout)["world_size"] == 2
    else:  # rank 1 went while rank 0 still met it (the commit's agreement, the files' ranks): a note says so
        notes = [line for line in err.splitlines() if "lost after" in line]
        assert len(notes) == 1, err
        assert notes[0].startswith(f"Note: published {out}; the output is complete; a rank was lost after ("), err
    assert "Traceback" not in err
    manifest = json.loads((out / ".ckpt-manifest.json").read_text())
    assert {p.name: p.stat().st_size for p in out.iterdir() if p.name != ".ckpt-manifest.json"} == manifest["files"]

"""`ckpt` inside a distributed job: the multi-process mode only when asked for (--distributed), and a bounded,
interruptible rendezvous when it is.

A training rank that runs `ckpt` as a subprocess (as DeepSpeed's universal-checkpoint tests call their converter)
hands it RANK, WORLD_SIZE, MASTER_* and TORCHELASTIC_*: ckpt must run as one process and finish.
"""

import json
import signal
import socket
import subprocess
import sys
import time

from tests.support.ranks import CKPT, Z3, _env, ds_launch

# A training job's worker under torchrun: rank 0 converts a checkpoint through a `ckpt` subprocess while rank 1
# waits at a barrier, as DeepSpeed's universal-checkpoint tests do with their converter.
TRAINING_WORKER = """
import json, os, subprocess, sys
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=240)
    with open(os.environ["RESULT"], "w") as fh:
        json.dump({"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                   "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}}, fh)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_ckpt_started_by_a_training_rank_runs_as_one_process(tmp_path):
    worker = tmp_path / "train.py"
    worker.write_text(TRAINING_WORKER)
    result = tmp_path / "result.json"
    out = tmp_path / "universal"
    cmd = ds_launch.torchrun_cmd(2, worker, [CKPT, "reshard", Z3, "--universal", "--out", out, "--json"])
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**_env(), "RESULT": str(result)}, timeout=280, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 240
    run = json.loads(result.read_text())
    assert run["env"]["WORLD_SIZE"] == "2"
    assert run["env"]["RANK"] == "0"
    assert run["rc"] == 0, run["stderr"]
    data = json.loads(run["stdout"])
    assert "world_size" not in data  # one process
    assert run["stderr"].splitlines() == [
        "Note: launcher variables found (WORLD_SIZE=2); running as one process, pass --distributed to share the work",
        *(f"Note: {note}" for note in data["notes"]),
    ]
    assert (out / "latest_universal").is_file()


def _alone(rank, port, *extra, timeout="3"):
    env = {**_env(), "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "CKPT_RENDEZVOUS_TIMEOUT": timeout}  # fmt: skip
    return subprocess.Popen([str(CKPT), "consolidate", str(Z3), *map(str, extra), "--distributed"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def test_a_rank_that_never_comes_ends_the_rendezvous_with_one_line(tmp_path):
    port = ds_launch.free_port()
    t0 = time.monotonic()
    proc = _alone(0, port, "--out", tmp_path / "o")
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1
    assert out == ""
    expected = (
        f"Error: rank 0 waited 3 s for 1 of 2 ranks to join at 127.0.0.1:{port} (missing: rank 1); "
        "start every rank with --distributed"
    )
    assert err.splitlines() == [expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_rank_whose_rank_0_never_comes_says_so(tmp_path):
    port = ds_launch.free_port()
    proc = _alone(1, port, "--out", tmp_path / "o")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"Error: rank 1 waited 3 s for rank 0's rendezvous at 127.0.0.1:{port} (")
    assert lines[0].endswith("); start every rank with --distributed")


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_during_the_rendezvous_ends_it_at_once(tmp_path):
    port = ds_launch.free_port()
    proc = _alone(0, port, "--out", tmp_path / "o", timeout="300")
    deadline = time.monotonic() + 120
    while not _listening(port):  # rank 0 opened the store: it waits for rank 1 now
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 3
    assert proc.returncode == 143
    assert err.splitlines() == ["Interrupted (SIGTERM); nothing was published."]


def test_distributed_without_a_launcher_is_one_process(tmp_path):
    proc = subprocess.run([str(CKPT), "consolidate", str(Z3), "--out", str(tmp_path / "o"), "--json", "--distributed"],
                          capture_output=True, text=True, env=_env(), timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "world_size" not in json.loads(proc.stdout)


def test_rendezvous_timeout_must_be_a_number(tmp_path):
    proc = _alone(0, ds_launch.free_port(), "--out", tmp_path / "o", timeout="soon")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.splitlines() == ["Error: CKPT_RENDEZVOUS_TIMEOUT='soon' is not a number of seconds"]


def test_help_states_the_rendezvous_timeout():
    out = subprocess.run([str(CKPT), "reshard", "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "--distributed" in flat
    assert "CKPT_RENDEZVOUS_TIMEOUT seconds (default 300)" in flat
    assert "CKPT_DISTRIBUTED" in flat


# A rank that joins the rendezvous and then never builds its part of the group (it died between the two, or
# hangs): rank 0 waits inside gloo's connect, in C++, where no signal handler runs.
HALF_JOINED = """
import sys, time
from datetime import timedelta
import torch.distributed as dist

port = int(sys.argv[1])
while True:
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=2))
        break
    except Exception:
        time.sleep(0.1)
dist.PrefixStore("ckpt/0", store).set("joined/1", "0")
print("joined", flush=True)
time.sleep(600)
"""


def test_sigterm_while_a_joined_rank_never_connects_ends_at_once(tmp_path):
    port = ds_launch.free_port()
    rank0 = _alone(0, port, "--out", tmp_path / "o", timeout="300")
    half = subprocess.Popen([sys.executable, "-c", HALF_JOINED, str(port)], stdout=subprocess.PIPE, text=True,
                            env=_env())  # fmt: skip
    try:
        assert half.stdout.readline().strip() == "joined"
        time.sleep(1.0)  # rank 0 sees every key and waits in gloo's connect to rank 1
        assert rank0.poll() is None
        t0 = time.monotonic()
        rank0.send_signal(signal.SIGTERM)
        _out, err = rank0.communicate(timeout=30)
        assert time.monotonic() - t0 < 3
    finally:
        half.kill()
        half.communicate()
    assert rank0.returncode == 143
    assert err.splitlines() == ["Interrupted (SIGTERM); nothing was published."]

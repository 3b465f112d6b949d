"""SIGINT, SIGTERM and SIGHUP at any moment of a `ckpt` run: exit 130 / 143 / 129 and one line, no traceback, no
staging debris, the output absent or complete; 0 and a line saying so when the output was already published.

Every test runs the real `ckpt` as a process and signals it. A mid-run signal needs a run long enough to hit:
CKPT_TEST_SLOW_WRITE_MS (test only, read in cli._common.slow_down_for_tests) sleeps after each chunk written and once
after the command's work, before its result is printed.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .conftest import FIXTURES

CKPT = Path(sys.executable).with_name("ckpt")
Z3 = FIXTURES / "z3_dp2_bf16" / "checkpoint"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
SIGNALS = list(CODES)


def _env(slow_ms=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CI": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    if slow_ms is not None:
        env["CKPT_TEST_SLOW_WRITE_MS"] = str(slow_ms)
    return env


def _start(args, slow_ms=None, env=None):
    return subprocess.Popen([str(CKPT), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env(slow_ms))  # fmt: skip


def _wait_for(predicate, proc, timeout=60.0, step=0.005):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"ckpt ended before the moment to signal it: {proc.communicate()}"
        assert time.monotonic() < deadline, "the moment to signal never came"
        time.sleep(step)


def _handler_installed(pid):
    """ckpt's handler is in: SIGHUP is caught (Python itself catches only SIGINT)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGHUP - 1)))


def _finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _lines(err):
    return [line for line in err.splitlines() if line.strip()]


def _assert_interrupted(rc, err, sig):
    assert rc == CODES[sig], (rc, err)
    assert _lines(err) == [f"Interrupted ({sig.name}); nothing was published."], err
    assert "Traceback" not in err
    assert "Exception ignored" not in err


def _staging(folder):
    return [p.name for p in folder.iterdir() if ".ckpt-staging." in p.name or ".partial-" in p.name]


def _complete(out):
    """The output folder holds exactly what its manifest lists, at the listed sizes."""
    manifest = json.loads((out / ".ckpt-manifest.json").read_text())
    on_disk = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    on_disk.pop(".ckpt-manifest.json")
    return on_disk == manifest["files"]


# --------------------------------------------------------------------------------------------------
# Start-up: while click, the CLI and the library load
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_as_soon_as_the_handler_is_in_is_one_line(tmp_path, sig):
    """The moment ckpt's handler is in (it is the CLI's first statement), click and the commands are still loading."""
    proc = _start(["consolidate", Z3, "--out", tmp_path / "o"])
    _wait_for(lambda: _handler_installed(proc.pid), proc, step=0.0005)
    proc.send_signal(sig)
    rc, out, err = _finish(proc)
    _assert_interrupted(rc, err, sig)
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_the_imports_is_held_until_the_command_begins(tmp_path, sig):
    """Deterministic: the signal arrives right after the handler went in, before click is imported."""
    code = (
        "import os, signal, sys\n"
        f"sys.argv = ['ckpt', 'consolidate', {str(Z3)!r}, '--out', {str(tmp_path / 'o')!r}]\n"
        "from ckpttools import signals\n"
        "signals.install()\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "assert 'click' not in sys.modules\n"
        "from ckpttools.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60, check=False
    )
    _assert_interrupted(proc.returncode, proc.stderr, sig)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("delay_ms", [0, 15, 30, 60, 120])
def test_sigterm_at_any_moment_of_start_up_ends_without_a_traceback(tmp_path, delay_ms):
    """Before the handler is in (the interpreter's own start-up, ~20 ms here) SIGTERM kills the process as it
    would any program (-15, no output); from then on it is exit 143 and one line. Never a traceback."""
    proc = _start(["consolidate", Z3, "--out", tmp_path / "o"], slow_ms=50)
    time.sleep(delay_ms / 1000)
    proc.send_signal(signal.SIGTERM)
    rc, _out, err = _finish(proc)
    assert rc in (-signal.SIGTERM, 143), (rc, err)
    assert _lines(err) == ([] if rc < 0 else ["Interrupted (SIGTERM); nothing was published."]), err
    assert not (tmp_path / "o").exists()
    assert _staging(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# Mid-run, during cleanup, after publishing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_mid_run_removes_the_staging_folder(tmp_path, sig):
    proc = _start(["consolidate", Z3, "--out", tmp_path / "o", "--max-shard-size", "1KB"], slow_ms=100)
    _wait_for(lambda: _staging(tmp_path), proc)
    time.sleep(0.15)  # a chunk or two written
    proc.send_signal(sig)
    rc, _out, err = _finish(proc)
    _assert_interrupted(rc, err, sig)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", range(4))
def test_a_second_ctrl_c_during_cleanup_changes_nothing(tmp_path, seed):
    gap = random.Random(seed).uniform(0.0, 0.2)
    proc = _start(["reshard", Z3, "--dp", "3", "--out", tmp_path / "o"], slow_ms=100)
    _wait_for(lambda: _staging(tmp_path), proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(gap)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    rc, _out, err = _finish(proc)
    if rc == 0:  # on a loaded machine the first Ctrl-C can land after the output was published: then it says so
        assert _lines(err) == [f"Interrupted after publishing {tmp_path / 'o'}; the output is complete."], err
        assert _complete(tmp_path / "o")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
        return
    _assert_interrupted(rc, err, signal.SIGINT)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_after_publishing_leaves_the_output_and_says_so(tmp_path, sig):
    out_dir = tmp_path / "o"
    proc = _start(["consolidate", Z3, "--out", out_dir, "--json"], slow_ms=600)
    _wait_for(out_dir.exists, proc, step=0.002)
    proc.send_signal(sig)
    rc, _out, err = _finish(proc)
    assert rc == 0, (rc, err)
    assert _lines(err) == [f"Interrupted after publishing {out_dir}; the output is complete."], err
    assert _complete(out_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


# --------------------------------------------------------------------------------------------------
# Where Python itself would lose the signal
# --------------------------------------------------------------------------------------------------


def test_a_signal_inside_a_finalizer_still_ends_the_run():
    """Python drops an exception raised in __del__ ("Exception ignored in ..."): the signal is delivered again
    and ends the body; nothing about the finalizer is printed."""
    code = (
        "import os, signal, time\n"
        "from ckpttools.cli._common import run_guarded\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer\n"
        "def body():\n"
        "    Finalized()\n"
        "    time.sleep(20)\n"
        "    print('not interrupted')\n"
        "print(run_guarded(body))\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60, check=False
    )
    assert time.monotonic() - t0 < 15, "the re-delivered signal did not stop the sleep"
    assert proc.returncode == 0, proc
    assert proc.stdout.split() == ["143"], proc
    assert _lines(proc.stderr) == ["Interrupted (SIGTERM); nothing was published."], proc.stderr


class _StallingServer:
    """Accepts HTTP connections and never answers: a Hub that hangs."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def close(self):
        for c in [*self.conns, self.sock]:
            c.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_while_waiting_on_the_network_ends_the_run(tmp_path, sig):
    model = tmp_path / "model"
    made = subprocess.run([str(CKPT), "consolidate", str(Z3), "--out", str(model)], capture_output=True, text=True,
                          env=_env(), timeout=120, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    server = _StallingServer()
    env = {**_env(), "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "600", "HF_HUB_DOWNLOAD_TIMEOUT": "600"}
    env.pop("HF_HUB_OFFLINE", None)
    try:
        proc = _start(["push", model, "--repo", "me/model", "--endpoint", f"http://127.0.0.1:{server.port}",
                       "--token", "hf_test"], env=env)  # fmt: skip
        assert server.accepted.wait(60), proc.communicate()
        time.sleep(0.3)  # blocked in the socket read
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc, _out, err = _finish(proc, timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        server.close()
    assert rc == CODES[sig], (rc, err)
    lines = _lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("Interrupted"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("seed", range(4))
def test_a_signal_while_torch_loads_is_one_line_never_an_abort(tmp_path, seed):
    """A --distributed rank imports torch (about 2 s): a signal inside that import once gave SIGABRT and a stack
    dump from native teardown. ckpt leaves through os._exit, so the run ends with its line."""
    rng = random.Random(seed)
    sig = rng.choice(SIGNALS)
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "CKPT_DISTRIBUTED": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    proc = _start(["consolidate", Z3, "--out", tmp_path / "o"], env=env)
    _wait_for(lambda: _handler_installed(proc.pid), proc)
    time.sleep(rng.uniform(0.05, 2.0))
    proc.send_signal(sig)
    rc, _out, err = _finish(proc)
    _assert_interrupted(rc, err, sig)
    assert sorted(p.name for p in tmp_path.iterdir()) == []

"""Launching DeepSpeed workers on this machine: torchrun on a free port with a clean, quiet environment.

One place for what the fixture builders, the benchmarks and the multi-process tests all need
(`import ds_launch` with scripts/ on sys.path).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

# A parent's rendezvous settings would make torchrun join the wrong group.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# Failures of the machine's plumbing, worth another attempt: a port taken between free_port() and the
# bind, two processes JIT-building the same DeepSpeed op in a shared extensions folder, or a rank aborting
# in native teardown (seen in CI once the rank's work was done and the group destroyed; exit_worker avoids the
# interpreter-exit case).
RETRYABLE = ("eaddrinuse", "address already in use", "error building extension", "ninja: build stopped",
             "terminate called without an active exception")  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(accelerator: str = "cpu", threads: int = 1, base: Mapping[str, str] | None = None,
               **extra: str) -> dict[str, str]:  # fmt: skip
    """`base` (default: this process's environment) for DeepSpeed workers: quiet, offline, `threads` BLAS
    threads per rank (ranks share the cores), no inherited rendezvous, plus `extra`."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in RENDEZVOUS_VARS}
    env.update({
        "DS_ACCELERATOR": accelerator, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "TORCH_CPP_LOG_LEVEL": "ERROR",
        "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true", **extra,
    })  # fmt: skip
    return env


def torchrun_cmd(nproc: int, script: Path | str, args: Sequence[object], port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(port or free_port()), str(script), *map(str, args)]  # fmt: skip


# DeepSpeed JIT-builds this op in every rank's init_distributed on CPU; ranks building it at the same time
# in an empty extensions folder can abort ("terminate called without an active exception").
_PREBUILD = ("from deepspeed.accelerator import get_accelerator\n"
             "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
             "builder is not None and builder.load()\n")  # fmt: skip
_prebuilt: set[str] = set()


def prebuild_ops(env: Mapping[str, str]) -> None:
    """Build DeepSpeed's JIT ops for `env` once, in one process, before ranks start (best effort)."""
    key = env.get("DS_ACCELERATOR", "") + "|" + env.get("TORCH_EXTENSIONS_DIR", "")
    if key in _prebuilt:
        return
    _prebuilt.add(key)
    subprocess.run([sys.executable, "-c", _PREBUILD], env=dict(env), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=900, check=False)  # fmt: skip


def exit_worker(main: Callable[[], int | None]) -> NoReturn:
    """A torchrun worker's `if __name__ == "__main__"`: run `main`, then end the process without C++ teardown.

    Once its work is done and the process group destroyed, a rank can still abort in interpreter shutdown
    ("terminate called without an active exception", SIGABRT: a native thread torn down by a static destructor),
    which torchrun reports as that rank's failure. Nothing is left to run by then, so the worker flushes its
    output and leaves through os._exit with main's code (1, after the traceback, if it raised)."""
    try:
        code = main()
    except SystemExit as e:  # sys.exit(message) prints it and exits 1, as the interpreter does
        code = e.code if e.code is None or isinstance(e.code, int) else 1
        if code != e.code:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code says it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


@dataclass
class Run:
    rc: int
    output: str
    seconds: float

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]


def torchrun(nproc: int, script: Path | str, args: Sequence[object], *, env: Mapping[str, str] | None = None,
             cwd: Path | str | None = None, timeout: float | None = None, log: Path | None = None,
             before_attempt: Callable[[], None] | None = None, attempts: int = 3) -> Run:  # fmt: skip
    """Run `script` on `nproc` ranks and return its exit code and output (also appended to `log`).

    Never raises for a failing worker; retried only for RETRYABLE plumbing failures, each attempt
    preceded by `before_attempt` (e.g. emptying an output folder).
    """
    env = dict(env) if env is not None else worker_env()
    prebuild_ops(env)
    run = Run(-1, "", 0.0)
    for _ in range(attempts):
        if before_attempt:
            before_attempt()
        cmd = torchrun_cmd(nproc, script, args)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", timeout=timeout)  # fmt: skip
            run = Run(p.returncode, p.stdout, time.time() - t0)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            run = Run(-9, out + f"\n[timed out after {timeout}s]", time.time() - t0)
        if log is not None:
            with open(log, "a") as fh:
                fh.write(f"\n$ {' '.join(cmd)}\n{run.output}")
        if run.rc == 0 or not any(sig in run.output.lower() for sig in RETRYABLE):
            return run
    return run

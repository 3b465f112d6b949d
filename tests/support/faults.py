"""Fault-injection harness for tests/test_faults.py: real `ckpt` processes hit by signals, kills, full disks,
racing runs, symlinks, inputs changing underneath and a parent job's launcher environment.

Every trial runs `ckpt` as a subprocess (the venv's console script, CI=1, no launcher variables) on copies of two
real Trainer checkpoints (ZeRO-2 and ZeRO-3), injects one fault at a delay drawn from `random.Random` seeded by
the trial's category and seed, and judges what is left:

- the exit code: 0, or the signal's documented code (130 SIGINT, 143 SIGTERM, 129 SIGHUP; -9 for SIGKILL);
- stderr: no traceback, no "Exception ignored", at most one line besides `Note: ` lines, and that line says what
  happened ("Interrupted ...", "Error: ...");
- the disk: the output folder is absent, or (with --overwrite) the earlier output intact, or the new output
  complete (tensors equal to an undisturbed run's, other files byte-equal); never mixed or missing;
- exit code, message and disk agree: exit 0 => complete; "nothing was published" => absent / earlier output;
  "the output is complete" => complete;
- no debris beside the output (`.*.partial-*`, `.*.old-*`, parent folders a failed run created); staging
  folders (`.*.ckpt-staging.*`) only after SIGKILL, and the next run in the same place removes them with a note;
- the inputs: every file's path, size and sha256 as before.

A trial returns a `Trial` whose `problems` are empty when every rule held; `Ledger` counts outcomes per category.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CKPT = Path(sys.executable).parent / "ckpt"
FIXTURES = Path(os.environ.get("CKPT_FIXTURES") or Path(__file__).resolve().parents[2] / "fixtures")

# The two inputs: a ZeRO-2 and a ZeRO-3 Trainer checkpoint (HF Trainer's checkpoint-N folder, with config/tokenizer).
INPUTS = {"z2": "trainer_z2_bf16", "z3": "trainer_z3_gather_bf16"}
CHECKPOINT = "out/checkpoint-2"

# Variables a launcher (torchrun, a training job's rank, a batch script) sets; none must reach a plain `ckpt`.
LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "CKPT_DISTRIBUTED", "CKPT_DEBUG",
)  # fmt: skip

EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
MANIFEST = ".ckpt-manifest.json"
STAGING = re.compile(r"^\..+\.ckpt-staging\.")
DEBRIS = {"partial": re.compile(r"\.partial-"), "old": re.compile(r"\.old-"), "staging": STAGING}


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


def trials_per_category() -> int:
    """CKPT_FAULT_TRIALS: trials per category (default 3, the fast tier; CI's full tier sets hundreds)."""
    return int(os.environ.get("CKPT_FAULT_TRIALS") or 3)


def selected_cases() -> dict[str, list[int]]:
    """CKPT_FAULT_CASE=category:seed[,category:seed...]: run only these trials (empty: all)."""
    chosen: dict[str, list[int]] = defaultdict(list)
    for text in filter(None, (t.strip() for t in os.environ.get("CKPT_FAULT_CASE", "").split(","))):
        category, _, seed = text.rpartition(":")
        chosen[category].append(int(seed))
    return chosen


def seeds_for(category: str) -> list[int]:
    chosen = selected_cases()
    if chosen:
        return chosen.get(category, [])
    return list(range(trials_per_category()))


def reproduce_line(category: str, seed: int) -> str:
    return f"CKPT_FAULT_CASE={category}:{seed} ./scripts/test tests/test_faults.py -q -s"


# --------------------------------------------------------------------------------------------------
# Commands under test
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    name: str
    verb: str  # consolidate | reshard
    input: str  # a key of INPUTS
    options: tuple[str, ...]

    def argv(self, source: Path, out: Path, *, overwrite: bool = False) -> list[str]:
        return [str(CKPT), self.verb, str(source), *self.options, "--out", str(out), *(["--overwrite"] * overwrite)]


COMMANDS = {
    c.name: c
    for c in (
        Command("consolidate-fp32", "consolidate", "z3", ()),
        Command("consolidate-bf16", "consolidate", "z2", ("--dtype", "bf16")),
        Command("reshard-dp2", "reshard", "z3", ("--dp", "2")),
        Command("reshard-universal", "reshard", "z2", ("--universal",)),
    )
}
# With --overwrite, the earlier output is another command's (so "old" and "new" can be told apart).
EARLIER_OUTPUT = {
    "consolidate-fp32": "consolidate-bf16",
    "consolidate-bf16": "consolidate-fp32",
    "reshard-dp2": "reshard-universal",
    "reshard-universal": "reshard-dp2",
}


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without launcher variables, CI=1 (no progress bars), offline Hub."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update({"CI": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    env.pop("PYTHONFAULTHANDLER", None)
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------------
# What a folder holds
# --------------------------------------------------------------------------------------------------


def fingerprint(folder: Path) -> dict[str, str]:
    """Every entry under `folder` -> what it holds, so that two folders compare equal exactly when a reader
    would find the same thing: safetensors by tensor (name, dtype, shape, bytes; loaded with safetensors),
    torch zip files by member (name, CRC; torch's random per-save serialization_id left out), the rest by
    bytes; folders and symlinks as such."""
    out: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = _file_fingerprint(path)
    return out


def _file_fingerprint(path: Path) -> str:
    try:
        if path.name == MANIFEST:  # its "created" time differs from run to run; what it lists must not
            data = json.loads(path.read_text())
            data.pop("created", None)
            return "manifest:" + hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        if path.suffix == ".safetensors":
            return "tensors:" + _tensors_digest(path)
        if path.suffix in (".pt", ".bin", ".pth") and zipfile.is_zipfile(path):
            return "zip:" + _zip_digest(path)
        return "bytes:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except Exception as e:  # noqa: BLE001 - a torn file reads as itself, never as a match
        return f"unreadable:{type(e).__name__}:{path.stat().st_size}"


def _tensors_digest(path: Path) -> str:
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(path).items()):
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode() + hashlib.sha256(raw).digest())
    return h.hexdigest()


def _zip_digest(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        z.testzip()
        members = sorted(
            (i.filename.split("/", 1)[-1], i.CRC, i.file_size)
            for i in z.infolist()
            if not i.filename.endswith(".data/serialization_id")
        )
    return hashlib.sha256(repr(members).encode()).hexdigest()


def describe_difference(got: dict[str, str], want: dict[str, str]) -> str:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    parts = [f"{label} {names[:3]}{'...' if len(names) > 3 else ''}" for label, names in
             (("missing", missing), ("extra", extra), ("different", differ)) if names]  # fmt: skip
    return "; ".join(parts)


def input_digest(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under the inputs: (size, sha256); folders and links listed too, so nothing new goes unseen."""
    out: dict[str, tuple[int, str]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = (-1, "link:" + os.readlink(path))
        elif path.is_dir():
            out[rel] = (-1, "dir")
        else:
            out[rel] = (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def entries_under(root: Path, skip: Iterable[Path] = ()) -> set[str]:
    """Relative paths of everything under `root`, not descending into the `skip` folders."""
    skip = {p.absolute() for p in skip}
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in dirnames + filenames:
            found.add((here / name).relative_to(root).as_posix())
        dirnames[:] = [d for d in dirnames if (here / d).absolute() not in skip]
    return found


# --------------------------------------------------------------------------------------------------
# Running ckpt with a fault
# --------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    """What to do to the running process (or its world) after `delay` seconds."""

    kind: str  # SIGINT, SIGTERM, SIGHUP, SIGKILL, SIGINT2 (two Ctrl-C), or a named action
    delay: float
    gap: float = 0.0  # SIGINT2: seconds between the two signals
    action: Callable[[], None] | None = None  # for non-signal faults
    after: Path | None = None  # count the delay from when this path appears (the published output)

    def describe(self) -> str:
        gap = f" + {self.gap * 1000:.0f} ms" if self.kind == "SIGINT2" else ""
        since = f" after {self.after.name} appeared" if self.after is not None else ""
        return f"{self.kind} at {self.delay * 1000:.0f} ms{since}{gap}"

    @property
    def signum(self) -> int | None:
        name = "SIGINT" if self.kind == "SIGINT2" else self.kind
        return int(getattr(signal, name)) if name.startswith("SIG") else None


@dataclass
class Run:
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    fault_sent: bool = False  # the fault reached a live process
    handler_ready: bool | None = None  # the signal's handler was installed when it was sent (/proc SigCgt)
    stopped_by_sigterm: bool | None = None  # after a timeout
    seen: set[str] = field(default_factory=set)  # names seen in watched folders while it ran

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def message_lines(self) -> list[str]:
        """stderr lines other than notes."""
        return [line for line in self.lines if not line.startswith("Note: ")]

    @property
    def notes(self) -> list[str]:
        return [line for line in self.lines if line.startswith("Note: ")]


@contextlib.contextmanager
def watching(folders: Iterable[Path]) -> Iterator[set[str]]:
    """Poll folders while a run is going, collecting every name that appears in them (a staging folder that comes
    and goes within the run is seen too, unless it lives less than the 5 ms poll interval)."""
    folders = list(folders)
    seen: set[str] = set()
    stop = threading.Event()

    def scan() -> None:
        for folder in folders:
            with contextlib.suppress(OSError):
                seen.update(f"{folder}/{name}" for name in os.listdir(folder))

    def poll() -> None:
        while not stop.wait(0.005):
            scan()

    thread = threading.Thread(target=poll, daemon=True)
    if folders:
        thread.start()
    try:
        yield seen
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        scan()


def _handler_installed(pid: int, signum: int) -> bool | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE)
    return bool(int(m.group(1), 16) >> (signum - 1) & 1) if m else None


def run_ckpt(
    argv: list[str],
    *,
    logs: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    fault: Fault | None = None,
    timeout: float = 120.0,
    watch: Iterable[Path] = (),
) -> Run:
    """Run `argv` in its own session (as a terminal job would be), apply `fault`, wait at most `timeout`."""
    logs.mkdir(parents=True, exist_ok=True)
    out_log, err_log = logs / "stdout", logs / "stderr"
    with open(out_log, "wb") as out_fh, open(err_log, "wb") as err_fh, watching(watch) as seen:
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env or clean_env(), stdout=out_fh, stderr=err_fh, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        run = Run(argv, None, "", "", 0.0)
        if fault is not None:
            _apply(proc, fault, start, run)
        try:
            proc.wait(timeout=max(0.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            run.timed_out = True
            run.stopped_by_sigterm = _stop(proc)
        run.seconds = time.monotonic() - start
        run.returncode = proc.returncode
    run.seen = seen
    run.stdout = out_log.read_text(errors="replace")
    run.stderr = without_interpreter_startup(err_log.read_text(errors="replace"))
    return run


# CPython's own start-up (pymain_run_python) catches a KeyboardInterrupt raised while it looks argv[0] up as an
# import path entry, prints this and the traceback, and goes on running the script: the SIGINT was spent before
# any code of ckpttools ran, and the run that follows is an ordinary uninterrupted one.
_STARTUP_INTERRUPT = re.compile(
    r"\AFailed checking if argv\[0\] is an import path entry\nTraceback \(most recent call last\):\n"
    r"(?:  .*\n)*KeyboardInterrupt\n"
)


def without_interpreter_startup(stderr: str) -> str:
    """stderr without the report of a SIGINT that the interpreter's start-up caught and moved past."""
    match = _STARTUP_INTERRUPT.match(stderr)
    if match is None or "/ckpttools/" in match.group(0):
        return stderr
    return stderr[match.end() :]


def _apply(proc: subprocess.Popen[bytes], fault: Fault, start: float, run: Run) -> None:
    while fault.after is not None and not os.path.lexists(fault.after) and proc.poll() is None:
        time.sleep(0.001)
    if fault.after is not None:
        start = time.monotonic()
    if not _wait_until(proc, start + fault.delay):
        return  # it finished first
    run.fault_sent = True
    if fault.action is not None:
        fault.action()
        return
    signum = fault.signum
    assert signum is not None
    run.handler_ready = _handler_installed(proc.pid, signum)
    _signal_group(proc, signum)
    if fault.kind == "SIGINT2" and _wait_until(proc, time.monotonic() + fault.gap):
        _signal_group(proc, signum)


def _wait_until(proc: subprocess.Popen[bytes], when: float) -> bool:
    """Sleep until `when`; False when the process ended first."""
    try:
        proc.wait(timeout=max(0.0, when - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        return True


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)  # the whole job, as a terminal's Ctrl-C does


def _stop(proc: subprocess.Popen[bytes]) -> bool:
    """After a timeout: SIGTERM, 5 s, then SIGKILL. True when SIGTERM was enough."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
        return True
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        return False


# --------------------------------------------------------------------------------------------------
# One trial's verdict
# --------------------------------------------------------------------------------------------------


@dataclass
class Trial:
    category: str
    seed: int
    what: str  # command line and fault, for the reproduction line
    outcome: str = "?"  # e.g. "130/absent", "0/new", "-9/absent+staging"
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def bad(self, tag: str, detail: str = "") -> None:
        """A broken guarantee; `tag` is what the summary counts."""
        self.problems.append(f"{tag}: {detail}" if detail else tag)

    def report(self) -> str:
        lines = [f"{self.category} seed {self.seed}: {self.outcome}", f"  {self.what}"]
        lines += [f"  - {p}" for p in self.problems]
        for key, value in self.details.items():
            text = str(value).rstrip()
            lines.append(
                f"  {key}: {text[-1500:]}"
                if "\n" not in text
                else f"  {key}:\n    " + text[-1500:].replace("\n", "\n    ")
            )
        delay = f"CKPT_FAULT_DELAY_MS={self.details['delay_ms']} " if "delay_ms" in self.details else ""
        lines.append(f"  reproduce: {delay}{reproduce_line(self.category, self.seed)}")
        return "\n".join(lines)


def check_stderr(trial: Trial, run: Run, *, max_messages: int = 1) -> None:
    """No traceback, nothing swallowed, at most `max_messages` lines besides notes."""
    if "Traceback (most recent call last)" in run.stderr:
        trial.bad("traceback", _last_line_of_traceback(run.stderr))
    if "Exception ignored" in run.stderr:
        trial.bad("exception-ignored", run.stderr.split("Exception ignored", 1)[1].splitlines()[0][:160])
    if re.search(r"Fatal Python error|Aborted|core dumped", run.stderr):
        trial.bad("abort", run.stderr.strip().splitlines()[-1][:160])
    if len(run.message_lines) > max_messages:
        trial.bad("extra-lines", f"{len(run.message_lines)} lines besides notes: {run.message_lines[:3]}")


def _last_line_of_traceback(text: str) -> str:
    tail = text.rsplit("Traceback (most recent call last)", maxsplit=1)[-1].strip().splitlines()
    return tail[-1][:200] if tail else ""


def check_agreement(trial: Trial, run: Run, state: str, prior: str) -> None:
    """Exit code, message and disk agree."""
    said_nothing = "nothing was published" in run.stderr
    said_complete = "output is complete" in run.stderr
    if run.returncode == 0 and state != "new":
        trial.bad("exit0-not-complete", f"exit 0 but the output is {state}")
    if said_nothing and state != prior:
        trial.bad("says-nothing-published", f"'nothing was published' but the output is {state}")
    if said_complete and state != "new":
        trial.bad("says-complete", f"'the output is complete' but the output is {state}")
    if run.returncode not in (0, None, -signal.SIGKILL) and state != prior:
        trial.bad(
            "failed-but-published" if state == "new" else "failed-left-output", f"exit {run.returncode}, output {state}"
        )


def classify_debris(names: Iterable[str]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = defaultdict(list)
    for name in names:
        base = name.rsplit("/", 1)[-1]
        kind = next((k for k, pattern in DEBRIS.items() if pattern.search(base)), "other")
        kinds[kind].append(name)
    return dict(kinds)


# --------------------------------------------------------------------------------------------------
# The campaign: inputs, undisturbed runs, trials
# --------------------------------------------------------------------------------------------------


@dataclass
class Baseline:
    command: Command
    output: Path
    fingerprint: dict[str, str]
    seconds: float
    entries: int  # files and folders in the output (an inode count)


class Ledger:
    """Counts per category: trials, outcomes, problem tags; written as JSON at the end of the session."""

    def __init__(self) -> None:
        self.trials: list[Trial] = []

    def add(self, trial: Trial) -> None:
        self.trials.append(trial)

    def summary(self) -> dict[str, Any]:
        per: dict[str, dict[str, Any]] = {}
        for t in self.trials:
            entry = per.setdefault(
                t.category, {"trials": 0, "bad": 0, "outcomes": Counter(), "problems": Counter(), "bad_seeds": []}
            )
            entry["trials"] += 1
            entry["outcomes"][t.outcome] += 1
            if t.problems:
                entry["bad"] += 1
                entry["bad_seeds"].append(t.seed)
                entry["problems"].update({p.split(":", 1)[0] for p in t.problems})
                entry.setdefault("failures", []).append(
                    {"seed": t.seed, "outcome": t.outcome, "what": t.what, "problems": t.problems[:4]}
                )
        for entry in per.values():
            entry["outcomes"] = dict(entry["outcomes"].most_common())
            entry["problems"] = dict(entry["problems"].most_common())
        total = {"trials": len(self.trials), "bad": sum(1 for t in self.trials if t.problems)}
        return {"total": total, "categories": per}


class Campaign:
    """Inputs copied once, their digests, and one undisturbed run per command (the reference outputs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inputs_root = root / "inputs"
        self.inputs = {key: self._copy_input(key, name) for key, name in INPUTS.items()}
        self.digest = input_digest(self.inputs_root)
        self.boot_window = self._measure_interpreter_start()
        self.baselines: dict[str, Baseline] = {}
        self.ledger = Ledger()
        self.extra: dict[str, Any] = {}  # other per-session references (torchrun runs)
        self._counter = 0

    def _copy_input(self, key: str, name: str) -> Path:
        dest = self.inputs_root / key
        shutil.copytree(FIXTURES / name / CHECKPOINT, dest)
        return dest

    @staticmethod
    def _measure_interpreter_start() -> float:
        """Seconds a bare interpreter needs to start (site included) and exit: before any of ckpt's code runs,
        nothing can catch a signal, so a signal's default action there is not ckpt's fault. 3x the median of
        five runs, at least 30 ms (the machine is shared)."""
        times = []
        for _ in range(5):
            start = time.monotonic()
            subprocess.run([sys.executable, "-c", "pass"], check=True, env=clean_env())
            times.append(time.monotonic() - start)
        return max(0.03, 3 * sorted(times)[2])

    def baseline(self, name: str) -> Baseline:
        if name not in self.baselines:
            command = COMMANDS[name]
            out = self.root / "baselines" / name
            run = run_ckpt(
                command.argv(self.inputs[command.input], out), logs=self.logs(f"baseline-{name}"), timeout=600
            )
            if run.returncode != 0 or not out.is_dir():
                raise RuntimeError(
                    f"the undisturbed run failed ({run.returncode}): {shlex.join(run.argv)}\n{run.stderr}"
                )
            fp = fingerprint(out)
            self.baselines[name] = Baseline(command, out, fp, run.seconds, len(fp))
        return self.baselines[name]

    def trial_dir(self, category: str, seed: int) -> Path:
        self._counter += 1
        path = self.root / "trials" / f"{category}-{seed}-{self._counter}"
        path.mkdir(parents=True)
        return path

    def logs(self, label: str) -> Path:
        self._counter += 1
        return self.root / "logs" / f"{label}-{self._counter}"

    def state(self, out: Path, new: Baseline, old: Baseline | None = None) -> str:
        """absent | new | old | mixed (what differs from the new output)."""
        if not os.path.lexists(out):
            return "absent"
        if not out.is_dir():
            return "not-a-folder"
        got = fingerprint(out)
        if got == new.fingerprint:
            return "new"
        if old is not None and got == old.fingerprint:
            return "old"
        return "mixed(" + describe_difference(got, new.fingerprint) + ")"

    def check_inputs(self, trial: Trial) -> None:
        now = input_digest(self.inputs_root)
        if now != self.digest:
            changed = sorted(k for k in set(now) | set(self.digest) if now.get(k) != self.digest.get(k))
            trial.bad("input-changed", str(changed[:5]))
            self.digest = now  # report each change once

    def record(self, trial: Trial) -> Trial:
        self.ledger.add(trial)
        return trial


# --------------------------------------------------------------------------------------------------
# Category: signals at seeded random moments
# --------------------------------------------------------------------------------------------------

SIGNAL_KINDS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGKILL", "SIGINT2")


def signal_categories() -> list[str]:
    return [f"signal-{name}{suffix}" for name in COMMANDS for suffix in ("", "-overwrite")]


LATE = "signal-after-publishing"  # the category whose signal comes 0-15 ms after the output folder appeared


def _draw_delay(rng: random.Random, duration: float) -> float:
    """Start-up (0-300 ms, while imports run) a third of the time, else anywhere up to 1.2x an undisturbed run.

    The draw scales with this session's undisturbed run, so a seed's delay varies a little from machine to
    machine; CKPT_FAULT_DELAY_MS pins it (the failure report prints the one that was used)."""
    start_up, fraction = rng.random() < 0.3, rng.random()
    return pinned_delay(0.3 * fraction if start_up else 1.2 * duration * fraction)


def pinned_delay(drawn: float) -> float:
    """CKPT_FAULT_DELAY_MS, when set, instead of the drawn delay (seconds)."""
    pinned = os.environ.get("CKPT_FAULT_DELAY_MS")
    return float(pinned) / 1000 if pinned else drawn


def signal_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """One signal (or two Ctrl-C) at a random moment, or (LATE) just after the output was published."""
    late = category == LATE
    name = sorted(COMMANDS)[seed % len(COMMANDS)] if late else category.removeprefix("signal-")
    overwrite = name.endswith("-overwrite")
    name = name.removesuffix("-overwrite")
    new = campaign.baseline(name)
    old = campaign.baseline(EARLIER_OUTPUT[name]) if overwrite else None
    rng = random.Random(f"{category}:{seed}")
    kind = SIGNAL_KINDS[(seed + [*signal_categories(), LATE].index(category)) % len(SIGNAL_KINDS)]
    delay = pinned_delay(rng.uniform(0, 0.015)) if late else _draw_delay(rng, new.seconds)  # exit follows in 0-40 ms
    here = campaign.trial_dir(category, seed)
    nested = not overwrite and rng.random() < 0.25  # --out under folders that do not exist yet
    out = here / "a" / "b" / "model" if nested else here / "model"
    fault = Fault(kind, delay, gap=rng.uniform(0.02, 0.2), after=out if late else None)
    if old is not None:
        shutil.copytree(old.output, out, symlinks=True)
    before = entries_under(here, skip=[out])
    argv = new.command.argv(campaign.inputs[new.command.input], out, overwrite=overwrite)
    trial = Trial(category, seed, f"{shlex.join(argv)}  # {fault.describe()}")
    run = run_ckpt(argv, logs=campaign.logs(category), fault=fault, timeout=60 + 10 * new.seconds)
    judge_signal_run(campaign, trial, run, fault, out, new, old)
    leftovers = judge_leftovers(trial, here, out, before, allow_staging=run.returncode == -signal.SIGKILL)
    if leftovers:
        trial.outcome += " left " + "+".join(sorted(leftovers))
        follow_up(campaign, trial, here, out, new, before, leftovers)
    campaign.check_inputs(trial)
    return campaign.record(trial)


def judge_signal_run(
    campaign: Campaign, trial: Trial, run: Run, fault: Fault, out: Path, new: Baseline, old: Baseline | None
) -> None:
    prior = "old" if old is not None else "absent"
    state = campaign.state(out, new, old)
    rc = run.returncode
    trial.outcome = f"{rc}/{state}" + ("" if run.fault_sent else " (finished first)")
    trial.details.update(stderr=run.stderr, delay_ms=round(fault.delay * 1000), seconds=round(run.seconds, 2))
    check_stderr(trial, run)
    if run.timed_out:
        trial.bad("hang", f"still running after {run.seconds:.0f} s; SIGTERM stopped it: {run.stopped_by_sigterm}")
        return
    signum = fault.signum
    assert signum is not None
    if _before_ckpt_code(campaign, run, fault, state == prior):
        # The interpreter itself was still starting (site, .pth files): no code of ckpt's can catch anything yet.
        trial.outcome = f"{rc}/{state} (before ckpt's code)"
        trial.problems = [p for p in trial.problems if not p.startswith(("traceback", "extra-lines", "abort"))]
    elif rc == -signum and signum != signal.SIGKILL:
        trial.bad(
            "killed-by-signal",
            f"{fault.kind} killed it (exit {rc}; its handler installed when sent: {run.handler_ready})",
        )
    elif rc not in (0, EXIT_FOR_SIGNAL.get(signal.Signals(signum)), -signal.SIGKILL if signum == signal.SIGKILL else 0):
        trial.bad("exit-code", f"exit {rc} after {fault.kind}")
    if rc in EXIT_FOR_SIGNAL.values():
        if not run.message_lines:
            trial.bad("no-message", f"exit {rc} with nothing said")
        elif not any("Interrupted" in line for line in run.message_lines):
            trial.bad("unclear-message", run.message_lines[0][:160])
    if state not in ("absent", "new", "old") or (state == "absent" and old is not None):
        trial.bad("mixed-output" if state != "absent" else "earlier-output-lost", state)
    check_agreement(trial, run, state, prior)


def _before_ckpt_code(campaign: Campaign, run: Run, fault: Fault, untouched: bool) -> bool:
    """The signal ended the interpreter's own start-up: nothing of ckpt's package in the traceback, nothing on
    the disk changed, and the run died of the signal or of site's failed import; a silent kill only when no
    handler but Python's own was in place when it was sent.

    Judged by where the run was, not by the delay: on a loaded machine the interpreter's start-up (site, the
    editable install's finder, the console script's own imports) stretches far past its idle length
    (`campaign.boot_window`), and a traceback there shows only frames outside the package.
    """
    signum = fault.signum
    traceback = "Traceback" in run.stderr or "init_import_site" in run.stderr
    silent_kill = run.returncode == -(signum or 0) and not run.stderr.strip()
    python_only = signum == signal.SIGINT or run.handler_ready is False  # Python's own SIGINT handler, or none
    ended_by_it = (traceback and signum == signal.SIGINT) or (silent_kill and python_only)
    return (
        signum != signal.SIGKILL
        and (fault.delay <= campaign.boot_window or "Traceback" in run.stderr or run.handler_ready is False)
        and "/ckpttools/" not in run.stderr
        and untouched
        and ended_by_it
    )


def judge_leftovers(
    trial: Trial, here: Path, out: Path, before: set[str], *, allow_staging: bool
) -> dict[str, list[str]]:
    """Everything new in the trial folder other than the output (and, when it exists, the folders above it)."""
    allowed = before | (_out_and_parents(here, out) if out.exists() else set())
    new_names = entries_under(here, skip=[out]) - allowed - {out.relative_to(here).as_posix()}
    # After SIGKILL the staging folder (and its contents), and the parent folders it sits in, may stay.
    kinds = classify_debris(_top_level(new_names))
    for kind, names in kinds.items():
        if kind == "staging" and allow_staging:
            continue
        if (
            kind == "other"
            and allow_staging
            and all((here / n).is_dir() and _holds_only_staging(here / n) for n in names)
        ):
            continue
        trial.bad(f"debris-{kind}", str(sorted(names)[:3]))
    return kinds


def _top_level(names: set[str]) -> list[str]:
    """The outermost new entries (a new folder, not each file in it)."""
    return sorted(n for n in names if not any(n.startswith(other + "/") for other in names if other != n))


def _holds_only_staging(folder: Path) -> bool:
    return all(STAGING.search(p.name) or (p.is_dir() and _holds_only_staging(p)) for p in folder.iterdir())


def follow_up(
    campaign: Campaign,
    trial: Trial,
    here: Path,
    out: Path,
    new: Baseline,
    before: set[str],
    leftovers: dict[str, list[str]],
) -> None:
    """The next run in the same place (after a kill left something): it removes the leftovers, says so in a note
    and succeeds."""
    argv = new.command.argv(campaign.inputs[new.command.input], out, overwrite=out.exists())
    run = run_ckpt(argv, logs=campaign.logs("follow-up"), timeout=60 + 10 * new.seconds)
    state = campaign.state(out, new)
    trial.details["follow-up"] = f"{shlex.join(argv)} -> exit {run.returncode}, output {state}\n{run.stderr}"
    if run.returncode != 0 or state != "new":
        trial.bad("follow-up-failed", f"exit {run.returncode}, output {state}: {run.message_lines[:1]}")
    check_stderr(trial, run)
    still = classify_debris(_top_level(entries_under(here, skip=[out]) - before - _out_and_parents(here, out)))
    if still:
        trial.bad("leftovers-not-cleaned", str({k: v[:2] for k, v in still.items()}))
    elif "staging" in leftovers and not any(
        re.search(r"stale|staging|left|remov", n, re.IGNORECASE) for n in run.notes
    ):
        trial.bad("cleanup-without-note", f"notes: {run.notes}")


def _out_and_parents(here: Path, out: Path) -> set[str]:
    return {p.relative_to(here).as_posix() for p in [out, *out.parents] if here in p.parents}


# --------------------------------------------------------------------------------------------------
# Category: concurrent publishers
# --------------------------------------------------------------------------------------------------


def concurrent_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """Two or three `--overwrite` runs at one --out, started together: one complete output, every loser one
    clear line, no debris."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(["consolidate-fp32", "consolidate-bf16"])
    new, old = campaign.baseline(name), campaign.baseline(EARLIER_OUTPUT[name])
    count = 2 + seed % 2
    earlier = rng.random() < 0.5
    here = campaign.trial_dir(category, seed)
    out = here / "model"
    if earlier:
        shutil.copytree(old.output, out, symlinks=True)
    argv = new.command.argv(campaign.inputs[new.command.input], out, overwrite=True)
    trial = Trial(
        category, seed, f"{count}x {shlex.join(argv)}  # {'over an earlier output' if earlier else 'no earlier output'}"
    )
    results: list[Run] = []

    def one(i: int) -> None:
        results.append(run_ckpt(argv, logs=campaign.logs(f"{category}-{i}"), timeout=120 + 20 * new.seconds))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = campaign.state(out, new, old)
    codes = sorted(r.returncode for r in results)  # type: ignore[type-var]
    trial.outcome = f"exits {codes}/{state}"
    trial.details["stderr"] = "\n---\n".join(r.stderr for r in results)
    for r in results:
        check_stderr(trial, r)
        if r.timed_out:
            trial.bad("hang", shlex.join(r.argv))
        elif r.returncode not in (0, 1):
            trial.bad("exit-code", f"exit {r.returncode}")
        elif r.returncode == 1 and not (len(r.message_lines) == 1 and r.message_lines[0].startswith("Error: ")):
            trial.bad("unclear-loser", str(r.message_lines[:2]))
    if 0 not in codes:
        trial.bad("no-winner", f"exits {codes}")
    if state != "new":
        trial.bad("not-complete", state)
    for kind, names in classify_debris(_top_level(entries_under(here, skip=[out]) - {"model"})).items():
        trial.bad(f"debris-{kind}", str(names[:3]))
    campaign.check_inputs(trial)
    return campaign.record(trial)


# --------------------------------------------------------------------------------------------------
# Category: symlinked --out
# --------------------------------------------------------------------------------------------------


def symlink_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """--out is a symlink to an earlier output elsewhere, with --overwrite: the link stays, its target gets the
    new output, nothing is left beside either. Odd seeds also send SIGINT, SIGTERM or SIGHUP at a random moment:
    then the target holds the earlier output or the new one, as the exit code says."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(sorted(COMMANDS))
    new, old = campaign.baseline(name), campaign.baseline(EARLIER_OUTPUT[name])
    here = campaign.trial_dir(category, seed)
    (here / "work").mkdir()
    (here / "elsewhere").mkdir()
    target = here / "elsewhere" / "target"
    shutil.copytree(old.output, target, symlinks=True)
    link = here / "work" / "model"
    link_text = "../elsewhere/target" if rng.random() < 0.5 else str(target)
    link.symlink_to(link_text)
    argv = new.command.argv(campaign.inputs[new.command.input], link, overwrite=True)
    fault = Fault(rng.choice(["SIGINT", "SIGTERM", "SIGHUP"]), _draw_delay(rng, new.seconds)) if seed % 2 else None
    trial = Trial(
        category, seed, f"{shlex.join(argv)}  # model -> {link_text}" + (f", {fault.describe()}" if fault else "")
    )
    run = run_ckpt(argv, logs=campaign.logs(category), fault=fault, timeout=60 + 10 * new.seconds)
    if fault is not None:
        judge_signal_run(campaign, trial, run, fault, target, new, old)
    else:
        state = campaign.state(target, new, old)
        trial.outcome = f"{run.returncode}/{state}"
        trial.details["stderr"] = run.stderr
        check_stderr(trial, run)
        if run.returncode != 0:
            trial.bad("exit-code", f"exit {run.returncode}: {run.message_lines[:1]}")
        if state != "new":
            trial.bad("target-not-new", state)
    if not link.is_symlink() or os.readlink(link) != link_text:
        trial.outcome += "/link replaced"
        trial.bad("link-replaced", f"{link} is now {'a folder' if link.is_dir() else 'gone'}")
    for folder, keep in ((here / "work", {"model"}), (here / "elsewhere", {"target"})):
        for kind, names in classify_debris(
            _top_level(entries_under(folder, skip=[folder / n for n in keep]) - keep)
        ).items():
            trial.bad(f"debris-{kind}", f"{folder.name}/: {names[:3]}")
    campaign.check_inputs(trial)
    return campaign.record(trial)


def dangling_symlink_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """--out is a symlink to nothing: refused before any work (exit 1 fast, one line, no staging created,
    the link and the place it points to untouched)."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(sorted(COMMANDS))
    new = campaign.baseline(name)
    here = campaign.trial_dir(category, seed)
    (here / "work").mkdir()
    (here / "elsewhere").mkdir()
    missing_parent = rng.random() < 0.5
    target = here / "elsewhere" / ("gone" if missing_parent else "") / "target"
    link = here / "work" / "model"
    link.symlink_to(target)
    overwrite = rng.random() < 0.5
    argv = new.command.argv(campaign.inputs[new.command.input], link, overwrite=overwrite)
    trial = Trial(category, seed, f"{shlex.join(argv)}  # model -> {target} (missing)")
    before = entries_under(here)
    run = run_ckpt(
        argv, logs=campaign.logs(category), timeout=60 + 10 * new.seconds, watch=[here / "work", here / "elsewhere"]
    )
    limit = max(2.0, 0.8 * new.seconds)
    trial.outcome = f"{run.returncode}/{run.seconds:.1f}s"
    trial.details["stderr"] = run.stderr
    check_stderr(trial, run)
    if run.returncode != 1:
        trial.bad("exit-code", f"exit {run.returncode}")
    elif len(run.message_lines) != 1:
        trial.bad("no-message", str(run.message_lines))
    if run.returncode == 1 and run.seconds > limit:
        trial.bad(
            "refused-late",
            f"refused after {run.seconds:.1f} s (limit {limit:.1f} s; an undisturbed run takes {new.seconds:.1f} s)",
        )
    if "finished output" in run.stderr:
        trial.bad("refused-after-work", run.message_lines[0][:160] if run.message_lines else "")
    created = sorted(n for n in run.seen if Path(n).name != "model")
    if created:
        trial.bad("staging-created", str(created[:3]))
    if not link.is_symlink() or Path(os.readlink(link)) != target:
        trial.bad("link-changed", str(link))
    after = entries_under(here)
    if after != before:
        trial.bad("debris", str(sorted(after ^ before)[:3]))
    campaign.check_inputs(trial)
    return campaign.record(trial)


# --------------------------------------------------------------------------------------------------
# Category: out of space (a small tmpfs)
# --------------------------------------------------------------------------------------------------


class MountFailed(Exception):
    pass


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise MountFailed(f"mount -t tmpfs -o {options} failed: {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


_SIZE = r"([\d.,]+)\s*(B|KB|MB|GB|KiB|MiB|GiB)"
_UNIT = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def _bytes(number: str, unit: str) -> float:
    return float(number.replace(",", "")) * _UNIT[unit.upper()]


def _space_claims(line: str) -> tuple[float | None, float | None]:
    """A free-space refusal's claims: (bytes it says it needs, margin included; bytes it says are free)."""
    free = re.search(_SIZE + r"\s+(?:is\s+|are\s+)?(?:free|available)", line)
    need_at = re.search(r"\bneeds?\b", line)
    if not need_at:
        return None, _bytes(*free.groups()) if free else None
    stop = free.start() if free and free.start() > need_at.end() else len(line)
    needed = sum(_bytes(*m.groups()) for m in re.finditer(_SIZE, line[need_at.end() : stop]))
    return needed, _bytes(*free.groups()) if free else None


def enospc_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """--out on a small tmpfs: too few bytes for the pre-check, too few inodes for the files, or a filler that
    takes the space while ckpt writes. A success is complete; a failure is one line naming --out (or its folder)
    that says nothing was published, agrees with itself, and leaves nothing on the file system."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(sorted(COMMANDS))
    new = campaign.baseline(name)
    variant = ("bytes", "inodes", "filler")[seed % 3]
    here = campaign.trial_dir(category, seed)
    mnt = here / "disk"
    if variant == "bytes":
        options, fault = f"size={rng.choice([64, 256, 1024, 4096, 16384])}k", None
    elif variant == "inodes":
        options, fault = f"size=256m,nr_inodes={rng.randint(2, new.entries + 3)}", None
    else:
        options = "size=72m"
        fault = Fault("filler", _draw_delay(rng, new.seconds), action=lambda: _fill(mnt / "filler"))
    out = mnt / "model"
    argv = new.command.argv(campaign.inputs[new.command.input], out)
    trial = Trial(category, seed, f"{shlex.join(argv)}  # tmpfs {options}" + (f", {fault.describe()}" if fault else ""))
    with tmpfs(mnt, options):
        run = run_ckpt(argv, logs=campaign.logs(category), fault=fault, timeout=60 + 10 * new.seconds)
        state = campaign.state(out, new)
        left = sorted(set(os.listdir(mnt)) - {"filler", "model"})
        trial.outcome = f"{variant}/{run.returncode}/{state}"
        trial.details["stderr"] = run.stderr
        if fault is not None:
            trial.details["delay_ms"] = round(fault.delay * 1000)
        judge_enospc(trial, run, state, out, left)
    campaign.check_inputs(trial)
    return campaign.record(trial)


def _fill(path: Path) -> None:
    """Take every free byte of the file system (kept until the trial ends)."""
    with contextlib.suppress(OSError), open(path, "wb") as fh:
        block = b"\0" * (1 << 20)
        while True:
            fh.write(block)
            fh.flush()


def judge_enospc(trial: Trial, run: Run, state: str, out: Path, left: list[str]) -> None:
    check_stderr(trial, run)
    if run.returncode == 0:
        if state != "new":
            trial.bad("exit0-not-complete", state)
    elif run.returncode != 1:
        trial.bad("exit-code", f"exit {run.returncode}")
    else:
        line = run.message_lines[0] if run.message_lines else ""
        if state != "absent":
            trial.bad("failed-left-output", state)
        if str(out) not in line and str(out.parent) not in line:
            trial.bad("message-without-out-path", line[:200])
        if re.search(r"ckpt-staging|\.partial-", line):
            trial.bad("message-names-staging", line[:200])
        need, free = _space_claims(line)
        up_front = "not enough free" in line  # the pre-check: nothing was written, nothing to publish
        if not up_front and "nothing was published" not in line:
            trial.bad("message-without-nothing-published", line[:200])
        if need is not None and free is not None and need <= free:
            trial.bad("precheck-contradiction", line[:200])
    if left:
        trial.bad("debris", str(left[:3]))


# --------------------------------------------------------------------------------------------------
# Category: an input shard truncated or rewritten while ckpt reads it
# --------------------------------------------------------------------------------------------------


def input_change_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """A shard of a copied checkpoint is truncated or scribbled over (in place), or (every fourth seed) replaced
    by the same file of the run's previous save (checkpoint-1, as a training job saving again would), at a random
    moment: exit 0 only with the output an undisturbed run writes; anything else is a clean refusal that
    publishes nothing."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(sorted(COMMANDS))
    new = campaign.baseline(name)
    here = campaign.trial_dir(category, seed)
    source = here / "checkpoint"
    shutil.copytree(campaign.inputs[new.command.input], source)
    shards = sorted(p for p in source.glob("global_step*/*.pt"))
    victim = rng.choice(shards)
    how = rng.choice(["truncate", "scribble"])
    size = victim.stat().st_size
    cut = rng.randint(0, size - 1)
    length = min(rng.randint(1, 4096), size - cut)
    noise = rng.randbytes(length)
    if seed % 4 == 3:
        how = "replace"
        earlier = next(
            (FIXTURES / INPUTS[new.command.input] / "out" / "checkpoint-1").glob(f"global_step*/{victim.name}")
        )
        shutil.copyfile(earlier, here / "earlier.pt")  # beside the copy, so the replace is one rename

    def change() -> None:
        if how == "replace":
            os.replace(here / "earlier.pt", victim)
        elif how == "truncate":
            os.truncate(victim, cut)
        else:
            with open(victim, "r+b") as fh:
                fh.seek(cut)
                fh.write(noise)

    fault = Fault(how, _draw_delay(rng, new.seconds), action=change)
    out = here / "model"
    argv = new.command.argv(source, out)
    what = f"{how} {victim.relative_to(source)}" + {
        "truncate": f" at byte {cut}", "scribble": f" at byte {cut} ({length} bytes)", "replace": " by checkpoint-1's"
    }[how]  # fmt: skip
    trial = Trial(category, seed, f"{shlex.join(argv)}  # {what}, {fault.describe()}")
    run = run_ckpt(argv, logs=campaign.logs(category), fault=fault, timeout=60 + 10 * new.seconds)
    state = campaign.state(out, new)
    trial.outcome = f"{run.returncode}/{state}" + ("" if run.fault_sent else " (finished first)")
    trial.details.update(stderr=run.stderr, delay_ms=round(fault.delay * 1000))
    check_stderr(trial, run)
    if run.returncode == 0 and state != "new":
        # replace: one shard from the previous save, read whole: a checkpoint of mixed steps taken as one
        trial.bad("mixed-steps-accepted" if how == "replace" else "wrong-output", f"exit 0 with the output {state}")
    elif run.returncode not in (0, 1):
        trial.bad("exit-code", f"exit {run.returncode}")
    elif run.returncode == 1 and (state != "absent" or len(run.message_lines) != 1):
        trial.bad("unclean-refusal", f"output {state}, {len(run.message_lines)} lines")
    for kind, names in classify_debris(
        _top_level(entries_under(here, skip=[out, source]) - {"model", "checkpoint", "earlier.pt"})
    ).items():
        trial.bad(f"debris-{kind}", str(names[:3]))
    campaign.check_inputs(trial)
    return campaign.record(trial)


# --------------------------------------------------------------------------------------------------
# Category: started from a training job's rank (launcher variables inherited)
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port where something accepts connections and never answers (a training job's own store)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


LAUNCHER_TIMEOUT = float(os.environ.get("CKPT_FAULT_LAUNCHER_TIMEOUT") or 120)


def launcher_env_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """`ckpt` started by rank 0 of a 2-rank job inherits RANK=0 WORLD_SIZE=2 MASTER_*: it runs as one process,
    finishes, and says in one note that the variables were ignored."""
    rng = random.Random(f"{category}:{seed}")
    name = rng.choice(["consolidate-fp32", "reshard-universal", "consolidate-bf16", "reshard-dp2"])
    new = campaign.baseline(name)
    listening = rng.random() < 0.5
    here = campaign.trial_dir(category, seed)
    out = here / "model"
    argv = new.command.argv(campaign.inputs[new.command.input], out)
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(silent_listener()) if listening else free_port()
        job = {
            "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"training-{seed}",
        }  # fmt: skip
        shown = " ".join(f"{k}={v}" for k, v in job.items() if k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        trial = Trial(
            category, seed, f"{shown} {shlex.join(argv)}  # port {'held by a silent listener' if listening else 'free'}"
        )
        run = run_ckpt(argv, env=clean_env(job), logs=campaign.logs(category), timeout=LAUNCHER_TIMEOUT)
    state = campaign.state(out, new)
    trial.outcome = f"{'hang' if run.timed_out else run.returncode}/{state}"
    trial.details.update(stderr=run.stderr, seconds=round(run.seconds, 1))
    check_stderr(trial, run)
    if run.timed_out:
        trial.bad("hang", f"no result after {run.seconds:.0f} s; SIGTERM stopped it: {run.stopped_by_sigterm}")
    elif run.returncode != 0 or state != "new":
        trial.bad("not-one-process", f"exit {run.returncode}, output {state}: {run.message_lines[:1]}")
    said = [n for n in run.notes if re.search(r"launcher|WORLD_SIZE|--distributed", n)]
    if not run.timed_out and len(said) != 1:
        trial.bad("launcher-note", f"{len(said)} notes about the ignored launcher variables (one expected): {said}")
    for kind, names in classify_debris(_top_level(entries_under(here, skip=[out]) - {"model"})).items():
        trial.bad(f"debris-{kind}", str(names[:3]))
    campaign.check_inputs(trial)
    return campaign.record(trial)


def to_json(data: Any) -> str:
    return json.dumps(
        data,
        indent=1,
        default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) and not isinstance(o, type) else str(o),
    )


# --------------------------------------------------------------------------------------------------
# Category: one rank of a torchrun --distributed run killed
# --------------------------------------------------------------------------------------------------

TORCHRUN = Path(sys.executable).parent / "torchrun"
TORCHRUN_COMMANDS = ("consolidate-fp32", "reshard-universal")
TORCHRUN_TIMEOUT = float(os.environ.get("CKPT_FAULT_TORCHRUN_TIMEOUT") or 90)


@dataclass
class TorchrunBaseline:
    seconds: float  # from the ranks' start to torchrun's exit


def torchrun_argv(argv: list[str], log_dir: Path) -> list[str]:
    """`ckpt ARGS --distributed` as two ranks of a standalone torchrun, each rank's output in its own files."""
    return [
        str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--log-dir", str(log_dir), "--redirects", "3",
        "--no-python", *argv, "--distributed",
    ]  # fmt: skip


def _ranks_of(agent: int) -> dict[int, int]:
    """RANK -> pid of the agent's worker processes (read from their environment)."""
    ranks: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{agent}/task").iterdir():
            for pid in (task / "children").read_text().split():
                with contextlib.suppress(OSError, ValueError):
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
                    if rank is not None:  # the agent's other children (if any) carry no RANK
                        ranks[rank] = int(pid)
    return ranks


def _rank_logs(log_dir: Path, stream: str = "stderr") -> dict[int, str]:
    """Each rank's stderr or stdout (torchrun --redirects 3 writes <log-dir>/<run>/attempt_0/<rank>/stderr.log)."""
    out: dict[int, str] = {}
    for path in log_dir.glob(f"*/attempt_*/*/{stream}.log"):
        with contextlib.suppress(ValueError, OSError):
            out[int(path.parent.name)] = path.read_text(errors="replace")
    return out


@dataclass
class TorchrunRun:
    returncode: int | None
    seconds: float
    ranks_seconds: float  # from the ranks' start
    killed: int | None  # the rank killed, None when the run ended first
    stop_seconds: float | None  # from the kill to torchrun's exit
    timed_out: bool
    agent_stderr: str
    rank_stderr: dict[int, str]
    stuck: str = ""  # after a timeout: the ranks' states
    signum: int = 0
    rank0_stdout: str = ""  # the result line, when rank 0 finished its command

    @property
    def rank0_gone(self) -> bool:
        """Rank 0 itself was SIGKILLed: nobody is left to clean up or to say what happened."""
        return self.killed == 0 and self.signum == signal.SIGKILL


def run_torchrun(
    argv: list[str], logs: Path, *, victim: int | None, signum: int, delay: float, after: Path | None = None
) -> TorchrunRun:
    """torchrun `argv`; `delay` seconds after both ranks started (or after `after` appeared: the published
    output), `signum` to rank `victim`."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "agent.stderr", "wb") as err_fh:
        start = time.monotonic()
        proc = subprocess.Popen(
            torchrun_argv(argv, logs / "ranks"), env=clean_env(), stdout=subprocess.DEVNULL, stderr=err_fh,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        ranks: dict[int, int] = {}
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() - start < 120:
            time.sleep(0.01)
            ranks = _ranks_of(proc.pid)
        ranks_start = time.monotonic()
        while after is not None and not os.path.lexists(after) and proc.poll() is None:
            time.sleep(0.002)
        killed = kill_time = None
        if victim is not None and ranks and _wait_until(proc, time.monotonic() + delay):
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[victim], signum)
                killed, kill_time = victim, time.monotonic()
        timed_out, stuck = False, ""
        try:
            proc.wait(timeout=max(1.0, TORCHRUN_TIMEOUT - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out, stuck = True, _describe_processes(ranks)
            _stop(proc)
        end = time.monotonic()
    return TorchrunRun(
        proc.returncode, end - start, end - ranks_start, killed, end - kill_time if kill_time else None, timed_out,
        (logs / "agent.stderr").read_text(errors="replace"), _rank_logs(logs / "ranks"), stuck, signum,
        _rank_logs(logs / "ranks", "stdout").get(0, ""),
    )  # fmt: skip


def _describe_processes(ranks: dict[int, int]) -> str:
    """For a hang: each rank still there, its state and where the kernel has it waiting."""
    return "; ".join(f"rank {rank} pid {pid}: {_process_state(pid)}" for rank, pid in sorted(ranks.items()))


def _process_state(pid: int) -> str:
    try:
        state = re.search(r"^State:\s*(.*)$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return "gone"
    return f"{state.group(1) if state else '?'}, wchan {wchan}, {threads} threads"


def torchrun_baseline(campaign: Campaign, name: str) -> TorchrunBaseline:
    key = f"torchrun:{name}"
    cached = campaign.extra.get(key)
    if cached is None:
        new = campaign.baseline(name)
        out = campaign.root / "baselines" / f"torchrun-{name}"
        run = run_torchrun(new.command.argv(campaign.inputs[new.command.input], out), campaign.logs(key),
                           victim=None, signum=0, delay=0)  # fmt: skip
        got = fingerprint(out) if out.is_dir() else {}
        if run.returncode != 0 or got != new.fingerprint:
            raise RuntimeError(
                f"the undisturbed torchrun run failed or differs from one process's output (exit {run.returncode}): "
                f"{describe_difference(got, new.fingerprint)}\n{run.agent_stderr[-2000:]}\n{run.rank_stderr}"
            )
        cached = campaign.extra[key] = TorchrunBaseline(run.ranks_seconds)
    return cached


def torchrun_trial(campaign: Campaign, category: str, seed: int) -> Trial:
    """SIGKILL or SIGTERM to one rank of a two-rank `--distributed` run at a random moment: the others stop soon,
    the exit status agrees with the disk (absent and non-zero, or complete; a loss after publishing is reported
    as such by a surviving rank 0), no traceback from any rank, staging left only when rank 0 itself was
    SIGKILLed (and the next run cleans it up)."""
    rng = random.Random(f"{category}:{seed}")
    name = TORCHRUN_COMMANDS[seed % 2]
    new = campaign.baseline(name)
    victim = rng.choice([0, 1])
    signum = signal.SIGKILL if rng.random() < 0.5 else signal.SIGTERM
    after_publishing = seed % 3 == 2  # the window a rank's end meets the others' teardown
    span = 0.05 if after_publishing else 1.2 * torchrun_baseline(campaign, name).seconds
    delay = pinned_delay(rng.uniform(0, span))
    here = campaign.trial_dir(category, seed)
    out = here / "model"
    argv = new.command.argv(campaign.inputs[new.command.input], out)
    trial = Trial(
        category, seed, f"{shlex.join(torchrun_argv(argv, Path('LOGS')))}  # {signum.name} to rank {victim} "
        f"{delay * 1000:.0f} ms after {'the output appeared' if after_publishing else 'the ranks started'}",
    )  # fmt: skip
    run = run_torchrun(argv, campaign.logs(category), victim=victim, signum=signum, delay=delay,
                       after=out if after_publishing else None)  # fmt: skip
    state = campaign.state(out, new)
    stop = f", stopped {run.stop_seconds:.1f} s after" if run.stop_seconds is not None else " (finished first)"
    trial.outcome = f"{run.returncode}/{state}{stop}"
    trial.details.update(ranks=run.rank_stderr, agent=run.agent_stderr[-800:], delay_ms=round(delay * 1000))
    judge_torchrun(trial, run, state)
    before: set[str] = set()
    leftovers = judge_leftovers(trial, here, out, before, allow_staging=run.rank0_gone)
    if leftovers:
        trial.outcome += " left " + "+".join(sorted(leftovers))
        follow_up(campaign, trial, here, out, new, before, leftovers)
    campaign.check_inputs(trial)
    return campaign.record(trial)


# torchrun's agent polls its ranks every few seconds and then waits for the others' clean exit; on a loaded 2-core
# machine that took 5.9 s (seen). A rank that hung would run into the trial's timeout instead.
SLOW_STOP_SECONDS = 20


def judge_torchrun(trial: Trial, run: TorchrunRun, state: str) -> None:
    if run.timed_out:
        trial.bad("hang", f"torchrun still running after {run.seconds:.0f} s ({run.stuck})")
        return
    if run.stop_seconds is not None and run.stop_seconds > SLOW_STOP_SECONDS:
        trial.bad("slow-stop", f"torchrun ended {run.stop_seconds:.1f} s after rank {run.killed} was killed")
    said = {rank: Run([], run.returncode, "", text, 0.0) for rank, text in run.rank_stderr.items()}
    for rank, shown in said.items():
        check_stderr(trial, shown)
        # One event, one line: besides rank 0 only the rank the signal was sent to may speak, and another rank
        # only when rank 0 said nothing (it was killed).
        if rank not in (0, run.killed) and shown.message_lines and said.get(0) and said[0].message_lines:
            trial.bad("rank-not-silent", f"rank {rank}: {shown.message_lines[:1]}")
        if "nothing was published" in shown.stderr and state != "absent":
            trial.bad("says-nothing-published", f"rank {rank} says so, the output is {state}")
    if state not in ("absent", "new"):
        trial.bad("mixed-output", state)
    rank0 = run.rank_stderr.get(0, "")
    if run.returncode == 0 and state != "new":
        trial.bad("exit0-not-complete", state)
    # A rank lost after publishing: rank 0 says the output is complete, or had finished (its result printed).
    reported = "complete" in rank0 or run.rank0_stdout.strip()
    if run.returncode != 0 and state == "new" and not run.rank0_gone and not reported:
        trial.bad(
            "published-but-failure", f"exit {run.returncode} with the output complete; rank 0 said: {rank0[-200:]}"
        )

"""Generated, seeded mutations of the real fixtures, run through the CLI in-process.

Every mutated checkpoint goes through `inspect --json`, `consolidate`, `reshard --dp M` (and for some seeds
`consolidate --dtype <16-bit>` and `reshard --universal`). Each outcome must be one of:

(a) a clean rejection: exit 1 or 2, at most 3 lines on stderr, no traceback, no output or temporary folder left
    beside the output or inside the input, the input byte-identical, no pickled code run (sentinel, decoy); or
(b) a success whose output equals what the same command writes for the unmutated fixture (tensors compared bit
    for bit), with the input unchanged.

A success with another output is a silent wrong output. A rejection through the CLI's catch-all for unexpected
exceptions ("internal error ...; please report it") is a bug too: it is re-run with CKPT_DEBUG=1 to name the exception
and where it was raised. All failures of a family are collected into one assertion that lists their case ids. Options:

    --mutations N / CKPT_MUTATIONS=N     mutated checkpoints per family and weight (default 12)
    CKPT_MUTATION_CASE=id[,id...]        run only these cases: `family:fixture:seed` or `family:fixture:seed:command`
    CKPT_MUTATION_REPORT=path.jsonl      append one JSON line per command outcome (for triage)
    CKPT_MUTATION_TIMEOUT=seconds        per command (default 30)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickletools
import re
import shutil
import signal
import stat
import struct
import time
import traceback
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner

from tests.support import mutations as mut

from .conftest import FIXTURES, fixture_names, tree_digest

pytest.importorskip("deepspeed")  # the pickle-level edits load the trusted fixture copies with DeepSpeed's classes

DEFAULT_COUNT = 12
TIMEOUT = float(os.environ.get("CKPT_MUTATION_TIMEOUT", "30"))
MAX_STDERR_LINES = 3


def _main():
    from ckpttools.cli import main

    return main


# --- Settings and fixtures ------------------------------------------------------------------------------------


def _count(config: pytest.Config) -> int:
    opt = config.getoption("--mutations", default=None)
    env = os.environ.get("CKPT_MUTATIONS")
    return int(opt if opt is not None else env or DEFAULT_COUNT)


def _selected() -> dict[str, list[tuple[mut.Case, str | None]]]:
    """CKPT_MUTATION_CASE: the chosen cases, by family (empty: run the generated ones)."""
    chosen: dict[str, list[tuple[mut.Case, str | None]]] = defaultdict(list)
    for text in filter(None, (t.strip() for t in os.environ.get("CKPT_MUTATION_CASE", "").split(","))):
        case, command = mut.Case.parse(text)
        chosen[case.family].append((case, command))
    return chosen


_INFOS: dict[str, mut.FixtureInfo] = {}


def infos() -> dict[str, mut.FixtureInfo]:
    if not _INFOS:
        for name in fixture_names():
            _INFOS[name] = mut.load_fixture_info(FIXTURES, name)
    return _INFOS


# --- Running the CLI ------------------------------------------------------------------------------------------


class CommandTimeout(BaseException):
    """Raised in the main thread when a command runs past TIMEOUT (a hang counts as a failure)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    def fire(signum: int, frame: Any) -> None:
        raise CommandTimeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Run:
    exit_code: int | None
    stdout: str
    stderr: str
    exception: BaseException | None  # anything but SystemExit: a traceback
    exc_info: Any
    seconds: float
    timed_out: bool = False


def invoke(args: list[str]) -> Run:
    runner = CliRunner(env={"CKPT_DEBUG": None})
    start = time.perf_counter()
    try:
        with _deadline(TIMEOUT):
            res = runner.invoke(_main(), args, catch_exceptions=True)
    except CommandTimeout:
        return Run(None, "", "", None, None, time.perf_counter() - start, timed_out=True)
    exc = res.exception if res.exception is not None and not isinstance(res.exception, SystemExit) else None
    return Run(res.exit_code, res.stdout, res.stderr, exc, res.exc_info, time.perf_counter() - start)


def cli_args(command: str, path: Path, out: Path) -> list[str]:
    click_cmd, extra = mut.command_args(command)
    args = [click_cmd, str(path), *extra]
    if click_cmd != "inspect":
        args += ["--out", str(out)]
    return args


def traceback_summary(run: Run) -> str:
    exc = run.exception
    frames = traceback.extract_tb(run.exc_info[2]) if run.exc_info and run.exc_info[2] else []
    ours = [f for f in frames if "/ckpttools/" in f.filename]
    where = ours[-1] if ours else (frames[-1] if frames else None)
    loc = f"{where.filename.split('/ckpttools/')[-1] if where else '?'}:{where.lineno if where else '?'}"
    loc = f"ckpttools/{loc} in {where.name}" if where and "/ckpttools/" in where.filename else loc
    inner = frames[-1] if frames else None
    deeper = f" (raised in {Path(inner.filename).name}:{inner.lineno})" if inner and inner is not where else ""
    return f"{type(exc).__name__} at {loc}{deeper}: {str(exc)[:160]}"


# --- Snapshots and comparisons ----------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """conftest.tree_digest (sha256 of every file, links followed) plus every entry under root without following
    links (type, mode, size, link target), so folders, links and unreadable files are covered too."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = f"dir:{st.st_mode:o}"
            elif stat.S_ISREG(st.st_mode):
                out[rel] = f"file:{st.st_mode:o}:{st.st_size}"
            else:
                out[rel] = f"other:{st.st_mode:o}"
    try:
        for rel, digest in tree_digest(root).items():
            out["digest:" + rel] = digest
    except OSError as e:
        out["digest"] = f"error {e.errno}"
    return out


def _input_state(work: Path) -> dict[str, str]:
    """The case's input (in/) and what the mutation placed outside it (outside/, decoy/): all must stay as they are."""
    state = {}
    for name in ("in", "outside", "decoy"):
        if (work / name).exists():
            state.update({f"{name}/{k}": v for k, v in snapshot(work / name).items()})
    return state


def _regular_files(root: Path) -> dict[str, Path]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if p.is_symlink():
                files[str(p.relative_to(root))] = p  # reported as a difference below
            elif p.is_file():
                files[str(p.relative_to(root))] = p
    return files


def _safetensors_parts(data: bytes) -> tuple[dict, dict[str, tuple[str, list[int], bytes]]]:
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    body = data[8 + n :]
    tensors = {k: (v["dtype"], v["shape"], body[slice(*v["data_offsets"])]) for k, v in header.items()}
    return meta, tensors


def _zip_entries(path: Path) -> dict[str, bytes] | None:
    try:
        with zipfile.ZipFile(path) as zf:
            return {i.filename: zf.read(i) for i in zf.infolist() if not i.filename.endswith(mut.SERIALIZATION_ID)}
    except (zipfile.BadZipFile, OSError):
        return None


OUTPUT_GLOBALS = re.compile(
    r"^(torch(\.[\w.]+)? \w+|collections OrderedDict|deepspeed\.[\w.]+ \w+|"
    r"(__builtin__|builtins) (slice|set|frozenset|complex)|_codecs encode|argparse Namespace)$"
)


class UnsafeOutput(Exception):
    """An output pickle names a global outside what a checkpoint may hold (it is never loaded)."""


def _load_pt(path: Path) -> Any:
    """An output .pt, loaded only after checking every global its pickle names (so nothing in it can run code);
    weights_only=True is not used because its unpickler lacks opcodes a faithful copy may need (LONG4)."""
    import torch

    with zipfile.ZipFile(path) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    names = {str(arg) for op, arg, _ in pickletools.genops(pkl) if op.name in ("GLOBAL", "INST")}
    if any(op.name in ("STACK_GLOBAL", "EXT1", "EXT2", "EXT4") for op, _, _ in pickletools.genops(pkl)):
        names.add("<stack_global/ext>")
    unsafe = sorted(n for n in names if not OUTPUT_GLOBALS.match(n))
    if unsafe:
        raise UnsafeOutput(f"the output pickle names {unsafe[:4]}")
    return torch.load(path, map_location="cpu", weights_only=False)


def deep_diff(a: Any, b: Any, where: str = "", ignore: frozenset = frozenset()) -> str | None:
    """First difference between two loaded objects; tensors compared bit for bit (NaN padding included).
    `ignore`: top-level keys left out (keys a mutation added, which the tool may carry along)."""
    import torch

    if ignore and isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if k not in ignore} for d in (a, b))

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if a.numel() and not torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                          b.contiguous().reshape(-1).view(torch.uint8)):  # fmt: skip
            return f"{where}: tensor values differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)[:8]} vs {list(b)[:8]}"
        for k in a:
            if d := deep_diff(a[k], b[k], f"{where}[{k!r}]"):
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if d := deep_diff(x, y, f"{where}[{i}]"):
                return d
        return None
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return deep_diff(vars(a), vars(b), where)
    if a != b and not (math.isnan(a) and math.isnan(b) if isinstance(a, float) and isinstance(b, float) else False):
        return f"{where}: {a!r:.60} vs {b!r:.60}"
    return None


def file_diff(expected: bytes | Path, got: Path, rel: str, ignore: frozenset = frozenset()) -> str | None:
    exp_bytes = expected if isinstance(expected, bytes) else expected.read_bytes()
    got_bytes = got.read_bytes()
    if exp_bytes == got_bytes:
        return None
    if rel.endswith(".safetensors"):
        try:
            (m1, t1), (m2, t2) = _safetensors_parts(exp_bytes), _safetensors_parts(got_bytes)
        except (ValueError, struct.error) as e:
            return f"{rel}: unreadable safetensors ({e})"
        if m1 != m2:
            return f"{rel}: metadata {m1} vs {m2}"
        if list(t1) != list(t2) and set(t1) != set(t2):
            return f"{rel}: tensors {sorted(set(t1) ^ set(t2))[:6]} differ between expected and written"
        for k in t1:
            if t1[k][:2] != t2[k][:2]:
                return f"{rel}: {k} {t1[k][0]}{t1[k][1]} vs {t2[k][0]}{t2[k][1]}"
            if t1[k][2] != t2[k][2]:
                return f"{rel}: tensor {k} values differ"
        return None
    if isinstance(expected, Path) and zipfile.is_zipfile(expected):
        e1, e2 = _zip_entries(expected), _zip_entries(got)
        if e1 is not None and e2 is not None and {k.split("/", 1)[-1]: v for k, v in e1.items()} == \
                {k.split("/", 1)[-1]: v for k, v in e2.items()} and e1.keys() == e2.keys():  # fmt: skip
            return None
        try:
            a, b = _load_pt(expected), _load_pt(got)
        except Exception as e:  # noqa: BLE001 - an output that does not load is a wrong output
            return f"{rel}: the output does not load with weights_only=True ({type(e).__name__}: {str(e)[:100]})"
        d = deep_diff(a, b, ignore=ignore)
        return f"{rel}{d}" if d else None
    return f"{rel}: bytes differ ({len(exp_bytes)} vs {len(got_bytes)} bytes)"


# --- Reference outputs of the unmutated fixtures (computed once per session) -----------------------------------


VERBATIM_EXCLUDED = {"latest", "latest_universal"}


@dataclass
class Reference:
    ok: bool
    detail: str
    out: Path | None = None
    inspect: dict | None = None
    verbatim: dict[str, str] = field(default_factory=dict)  # output rel path -> root rel path copied unchanged


def _layout(info: mut.FixtureInfo, base: Path, entry: str) -> tuple[Path, Path]:
    """Copy a pristine fixture into base/in (a Trainer output_dir whole only when it is the entry, else just the
    newest checkpoint-N); return (checkpoint root, output_dir)."""
    if info.root_rel == ".":
        shutil.copytree(info.copy_src, base / "in", symlinks=True)
        root = (base / "in").resolve()
    elif entry == "output_dir":
        shutil.copytree(info.copy_src, base / "in", symlinks=True)
        root = (base / "in" / info.root_rel).resolve()
    else:
        root = (base / "in" / info.root_rel).resolve()
        shutil.copytree(info.src_root, root, symlinks=True)
    return root, root.parent


def _layout_paths(info: mut.FixtureInfo, base: Path) -> tuple[Path, Path]:
    root = (base / "in" / info.root_rel).resolve() if info.root_rel != "." else (base / "in").resolve()
    return root, root.parent


def _normalize_paths(text: str, root: Path) -> str:
    return text.replace(str(root), "<ROOT>").replace(str(root.parent), "<PARENT>")


class References:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.cache: dict[tuple[str, str, str], Reference] = {}

    def get(self, info: mut.FixtureInfo, entry: str, command: str) -> Reference:
        key = (info.name, entry, command)
        if key not in self.cache:
            self.cache[key] = self._compute(info, entry, command)
        return self.cache[key]

    def _compute(self, info: mut.FixtureInfo, entry: str, command: str) -> Reference:
        base = self.base / info.name.replace("/", "__") / entry
        if not (base / "in").exists():
            _layout(info, base, entry)
        root, output_dir = _layout_paths(info, base)
        out = base / f"out-{command}"
        run = invoke(cli_args(command, root if entry == "root" else output_dir, out))
        if run.exception is not None or run.timed_out or run.exit_code != 0:
            detail = traceback_summary(run) if run.exception else f"exit {run.exit_code}: {run.stderr.strip()[:200]}"
            return Reference(False, detail)
        if command == "inspect":
            return Reference(True, "", inspect=json.loads(_normalize_paths(run.stdout, root)))
        root_files = {rel: p.read_bytes() for rel, p in _regular_files(root).items()}
        verbatim = {}
        for rel, p in _regular_files(out).items():
            if Path(rel).name in VERBATIM_EXCLUDED or (command.startswith("consolidate") and rel == "config.json"):
                continue
            data = p.read_bytes()
            same = [r for r, d in root_files.items() if d == data]
            if same:
                verbatim[rel] = rel if rel in same else same[0]
        return Reference(True, "", out=out, verbatim=verbatim)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("mutation-references"))


# --- One case ----------------------------------------------------------------------------------------------------


@dataclass
class Failure:
    case_id: str  # family:fixture:seed:command
    kind: str
    detail: str
    mutation: str

    def line(self) -> str:
        return f"{self.case_id}  [{self.kind}] {self.detail}  <- {self.mutation}"


@dataclass
class Stats:
    cases: int = 0
    commands: int = 0
    rejected: int = 0
    succeeded: int = 0
    not_applicable: int = 0
    seconds: float = 0.0


def _report(record: dict) -> None:
    path = os.environ.get("CKPT_MUTATION_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")


def _make_writable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.chmod(0o755 if p.is_dir() else 0o644)


def run_case(case: mut.Case, only: str | None, refs: References, scratch: Path, stats: Stats) -> list[Failure]:
    fam = mut.FAMILIES[case.family]
    info = infos()[case.fixture]
    if fam.needs_non_root and os.geteuid() == 0:
        stats.not_applicable += 1  # chmod 000 does not stop root from reading
        return []
    work = scratch / f"case-{stats.cases}"
    work.mkdir()
    root, output_dir = _layout(info, work, fam.entry)
    (work / "outs").mkdir()
    ctx = mut.Ctx(info, root, work, case.rng(), infos(), entry=fam.entry)
    ctx.decoy.mkdir()
    (ctx.decoy / "keep").write_text("must survive")
    try:
        description = mut.apply_mutation(case, ctx)
    except mut.NotApplicable:
        stats.not_applicable += 1
        shutil.rmtree(work, ignore_errors=True)
        return []
    except Exception as e:  # noqa: BLE001 - a broken generator is reported, not hidden
        shutil.rmtree(work, ignore_errors=True)
        return [Failure(case.id, "harness error", f"the mutation itself failed: {type(e).__name__}: {e}", "-")]
    stats.cases += 1
    entry = root if fam.entry == "root" else output_dir
    commands = [c for c, _ in mut.commands_for(case, info)] if only is None else [only]
    failures = []
    try:
        state = _input_state(work)
        for command in commands:
            ref = refs.get(info, fam.entry, command)
            if not ref.ok:
                if only is not None:
                    failures.append(Failure(f"{case.id}:{command}", "no reference", ref.detail, description))
                continue
            stats.commands += 1
            found, state = _check_command(case, command, ref, ctx, entry, description, stats, state)
            failures += found
            if any(f.kind == "timeout" for f in found):
                break  # the other commands read the same files: one hang per case is enough to report
    finally:
        _make_writable(work)
        shutil.rmtree(work, ignore_errors=True)
    return failures


def _check_command(case: mut.Case, command: str, ref: Reference, ctx: mut.Ctx, entry: Path, description: str,
                   stats: Stats, before: dict[str, str]) -> tuple[list[Failure], dict[str, str]]:  # fmt: skip
    work, outs = ctx.work, ctx.work / "outs"
    out = outs / command
    run = invoke(cli_args(command, entry, out))
    after = _input_state(work)
    cid = f"{case.id}:{command}"
    problems: list[tuple[str, str]] = []

    if ctx.sentinel.exists() or not (ctx.decoy / "keep").is_file():
        problems.append(("code executed", "the hostile pickle's payload ran (sentinel created or decoy deleted)"))
    if run.timed_out:
        problems.append(("timeout", f"no result after {TIMEOUT:.0f} s"))
    elif run.exception is not None:
        problems.append(("traceback", traceback_summary(run)))
    elif run.exit_code not in (0, 1, 2):
        problems.append(("bad exit code", f"exit {run.exit_code}: {run.stderr.strip()[:160]}"))
    changed = sorted(set(before) ^ set(after) | {k for k in before if k in after and before[k] != after[k]})
    if changed:
        problems.append(("input modified", f"{changed[:5]}"))
    leftovers = sorted(p.name for p in outs.iterdir() if p.name != command or run.exit_code != 0)
    extra_top = sorted(set(os.listdir(work)) - {"in", "outs", "outside", "decoy"})
    if leftovers or extra_top:
        problems.append(("leftover", f"left beside the output: {leftovers + extra_top}"))

    outcome = "timeout" if run.timed_out else ("traceback" if run.exception else f"exit {run.exit_code}")
    if not run.timed_out and run.exception is None and run.exit_code in (1, 2):
        stats.rejected += 1
        lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
        if len(lines) > MAX_STDERR_LINES or "Traceback" in run.stderr or "Traceback" in run.stdout or not lines:
            problems.append(("messy rejection", f"{len(lines)} stderr lines: {run.stderr.strip()[:200]!r}"))
        if INTERNAL_ERROR.search(run.stderr):  # the CLI's catch-all for unexpected exceptions: a bug, said in one line
            problems.append(("internal error", _debug_rerun(command, entry, out) or run.stderr.strip()[:200]))
        if mut.FAMILIES[case.family].expect == "success":
            problems.append(("unexpected rejection", f"a control case was refused: {run.stderr.strip()[:200]}"))
    elif not run.timed_out and run.exception is None and run.exit_code == 0:
        stats.succeeded += 1
        diff = _output_diff(command, ref, run, ctx, out)
        if diff:
            data = "values differ" in diff or "tensors" in diff or (" vs " in diff and "tensor" in diff)
            problems.append(("silent wrong output", f"[{'data' if data else 'metadata'}] {diff}"))
    _report({"case": cid, "outcome": outcome, "seconds": round(run.seconds, 4), "mutation": description,
             "problems": problems, "stderr": run.stderr[-300:]})  # fmt: skip
    with contextlib.suppress(OSError):
        for p in outs.iterdir():
            _make_writable(p) if p.is_dir() else None
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return [Failure(cid, kind, detail, description) for kind, detail in problems], after


INTERNAL_ERROR = re.compile(r"\binternal error\b|please report it", re.IGNORECASE)


def _debug_rerun(command: str, entry: Path, out: Path) -> str | None:
    """The same command with CKPT_DEBUG=1, only to name the exception and where it was raised."""
    runner = CliRunner(env={"CKPT_DEBUG": "1"})
    try:
        with _deadline(TIMEOUT):
            res = runner.invoke(_main(), cli_args(command, entry, out), catch_exceptions=True)
    except CommandTimeout:
        return None
    finally:
        for p in out.parent.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()
    if res.exception is None or isinstance(res.exception, SystemExit):
        return None
    return traceback_summary(Run(res.exit_code, "", "", res.exception, res.exc_info, 0.0))


INSPECT_FROM_FILE = {"trainer_state.json": {"trainer_state"}}


def _output_diff(command: str, ref: Reference, run: Run, ctx: mut.Ctx, out: Path) -> str | None:
    if command == "inspect":
        try:
            got = json.loads(_normalize_paths(run.stdout, ctx.root))
        except ValueError as e:
            return f"inspect --json printed no JSON ({e}): {run.stdout[:100]!r}"
        ignored = set().union(*(INSPECT_FROM_FILE.get(t, set()) for t in ctx.touched))
        exp = {k: v for k, v in cast(dict, ref.inspect).items() if k not in ignored}  # set when ref.ok
        got = {k: v for k, v in got.items() if k not in ignored}
        if exp != got:
            keys = sorted(k for k in set(exp) | set(got) if exp.get(k) != got.get(k))
            return "inspect: " + "; ".join(f"{k}: {exp.get(k)!r:.60} vs {got.get(k)!r:.60}" for k in keys[:3])
        return None
    if not out.is_dir():
        return f"exit 0 but no output folder {out.name}"
    expected: dict[str, bytes | Path | None] = dict(_regular_files(cast(Path, ref.out)))  # set when ref.ok
    for rel, root_rel in ref.verbatim.items():
        if root_rel in ctx.touched:
            src = ctx.root / root_rel
            expected[rel] = src.read_bytes() if src.is_file() and os.access(src, os.R_OK) else None
    present: dict[str, bytes | Path] = {k: v for k, v in expected.items() if v is not None}
    got = _regular_files(out)
    if set(present) != set(got):
        return f"files {sorted(set(present) - set(got))[:4]} missing, {sorted(set(got) - set(present))[:4]} extra"
    for rel in sorted(got):
        if got[rel].is_symlink():
            return f"{rel} is a symlink in the output"
        if rel == "config.json" and command.startswith("consolidate") and "config.json" in ctx.touched:
            d = _config_diff(ref, ctx, got[rel])
        elif rel == ".ckpt-manifest.json":  # derived from the other files, which may differ (an edited config)
            d = _manifest_diff(got)
        else:
            d = file_diff(present[rel], got[rel], rel, frozenset(ctx.extra_keys))
        if d:
            return d
    return None


def _manifest_diff(got: dict[str, Path]) -> str | None:
    """The manifest lists exactly the other files of the output, with their real sizes."""
    listed = json.loads(got[".ckpt-manifest.json"].read_text())["files"]
    actual = {rel: p.stat().st_size for rel, p in got.items() if rel != ".ckpt-manifest.json"}
    return None if listed == actual else f".ckpt-manifest.json lists {listed} but the folder holds {actual}"


def _config_diff(ref: Reference, ctx: mut.Ctx, got: Path) -> str | None:
    """consolidate rewrites config.json (the dtype written): with an edited config.json, the expected file is the
    edited config as Python's json reads it, with the keys the tool rewrote in the reference run."""
    pristine = json.loads((ctx.info.src_root / "config.json").read_text())
    ref_out = json.loads((cast(Path, ref.out) / "config.json").read_text())  # set when ref.ok
    try:
        expected = json.loads((ctx.root / "config.json").read_bytes())
    except (ValueError, RecursionError, OSError) as e:
        return f"config.json: written although the input's does not parse ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(expected, dict):
        return f"config.json: written although the input's is a JSON {type(expected).__name__}"
    expected.update({k: v for k, v in ref_out.items() if pristine.get(k) != v})
    try:
        written = json.loads(got.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"config.json: the written file does not parse ({e})"
    a, b = json.dumps(expected, sort_keys=True), json.dumps(written, sort_keys=True)
    return None if a == b else f"config.json: {a[:120]} expected, {b[:120]} written"


# --- The tests -------------------------------------------------------------------------------------------------------


def _format(family: str, failures: list[Failure], stats: Stats) -> str:
    by_kind: dict[str, list[Failure]] = defaultdict(list)
    for f in failures:
        by_kind[f.kind].append(f)
    head = f"{len(failures)} failing commands in family {family!r} ({stats.cases} mutated checkpoints, "
    lines = [head + f"{stats.commands} commands run):"]
    for kind in sorted(by_kind, key=lambda k: -len(by_kind[k])):
        lines.append(f"== {kind} ({len(by_kind[kind])})")
        lines += ["  " + f.line() for f in by_kind[kind][:25]]
        if len(by_kind[kind]) > 25:
            lines.append(f"  ... {len(by_kind[kind]) - 25} more")
    first = failures[0].case_id
    lines.append(f"Reproduce one: CKPT_MUTATION_CASE={first} .venv/bin/python -m pytest tests/test_mutations.py -q")
    return "\n".join(lines)


@pytest.mark.parametrize("family", sorted(mut.FAMILIES))
def test_mutated_checkpoints_are_refused_cleanly_or_give_the_same_output(family, request, references, tmp_path):
    chosen = _selected()
    if chosen:
        if family not in chosen:
            pytest.skip("not selected by CKPT_MUTATION_CASE")
        cases = chosen[family]
    else:
        cases = [(c, None) for c in mut.generate_cases(list(infos().values()), _count(request.config), family)]
    if not cases:
        pytest.skip(f"no fixture for {family}")
    if mut.FAMILIES[family].needs_non_root and os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root from reading")
    stats, failures = Stats(), []
    start = time.perf_counter()
    for case, command in cases:
        if case.fixture not in infos():
            failures.append(Failure(case.id, "no such fixture", case.fixture, "-"))
            continue
        failures += run_case(case, command, references, tmp_path, stats)
    stats.seconds = time.perf_counter() - start
    _report({"family": family, "stats": vars(stats)})
    assert not failures, _format(family, failures, stats)

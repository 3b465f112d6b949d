"""`ckpttools.ops.reshard` against real DeepSpeed: a checkpoint written at N data-parallel ranks, resharded to M,
must load with a plain `engine.load_checkpoint` at M ranks and hold exactly the state the N-rank engine had.

For each case (source fixture written at N ranks, target M):
  * state:    fp32 masters, exp_avg, exp_avg_sq read back from the live M-rank engine
              (safe_get_full_fp32_param / safe_get_full_optimizer_state) equal the fixture's
              reference/full_state.safetensors bit for bit (that reference was taken from the live N-rank
              engine right after it saved);
  * module:   the module's weights, frozen params and buffers after the load equal reference/bit16.safetensors
              (the N-rank engine's module at save time); the model was scrambled before the load, so nothing
              passes by being left at its init;
  * step:     optimizer step, global steps/samples and loss scale equal what the N-rank engine loads;
  * training: 3 more steps at M ranks give the same global losses as 3 more steps of the ORIGINAL checkpoint at
              N ranks (same global batch of 12 rows; rel. 1e-5 fp32, 1e-2 bf16);
  * consolidate: ckpttools.ops.consolidate of the resharded checkpoint equals that of the original, tensor for
              tensor, in fp32 and in the training dtype.
Plus HF Trainer resumes at M ranks from resharded checkpoint-2 folders, the harness itself (the original loaded
at its own N equals the reference bit for bit), and a negative control (the original N-rank checkpoint at M
ranks is refused by DeepSpeed, so a no-op reshard cannot pass).

DeepSpeed runs on CPU (gloo) under torchrun, via tests/support/reshard_worker.py.  To keep the time down, every load is
done once per (checkpoint, M): the module gathers the loads the selected tests need and runs them in one
torchrun per world size (the worker's --jobs mode); a load that has no result after that is re-run on its own,
and a failure is always reported from such a single run.  A timing summary is printed at the end.

Run:  pytest -m slow tests/test_reshard_deepspeed.py   (3.5-4.5 minutes on 2 busy CPU cores; the first run on a
      machine also JIT-builds DeepSpeed's CPU ops into a per-venv cache, see tests/support/reshard_worker.py)
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import FIXTURES, tree_digest

pytestmark = pytest.mark.slow

pytest.importorskip("deepspeed")
_reshard_module = pytest.importorskip("ckpttools.ops.reshard", reason="ckpttools.ops.reshard is not there yet")
reshard: Any = getattr(_reshard_module, "reshard", None)
if reshard is None:
    pytest.skip("ckpttools.ops.reshard has no reshard()", allow_module_level=True)

from ckpttools import consolidate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.reshard_worker"
from fixtures.build import ds_launch  # noqa: E402
from fixtures.build.ds_launch import Run  # noqa: E402

STEPS = 3
BATCH_TIMEOUT = 1200
SINGLE_TIMEOUT = 420

# (source fixture, M)
STAGES = (1, 2, 3)
PAIRS = ((2, 1), (2, 3), (3, 2), (1, 4), (4, 2))
CASES = (
    [(f"z{s}_dp{n}_fp32", m) for s in STAGES for n, m in PAIRS]
    + [(f"z{s}_dp2_bf16", 3) for s in STAGES]
    + [("z1_dp2_bf16_bf16opt", 3), ("z2_dp2_bf16_elastic", 1)]
)
TRAINER_CASES = (("trainer_z2_bf16", 1), ("trainer_z3_nogather_bf16", 3))
ORIGINALS = sorted({f for f, _ in CASES})


def _case_id(case) -> str:
    return f"{case[0]}-to{case[1]}"


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


# --------------------------------------------------------------------------------------------------------
# running the worker
# --------------------------------------------------------------------------------------------------------


def torchrun(nproc: int, args: list[object], timeout: int = SINGLE_TIMEOUT) -> Run:
    """The worker under torchrun; never raises for a failing command (the caller looks at rc/output)."""
    return ds_launch.torchrun(nproc, WORKER, args, cwd=ROOT, timeout=timeout)


_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def _short_error(text: str) -> str:
    """The exception lines of a worker log (each once), or its last lines if there are none."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    seen, out = set(), []
    for ln in lines:
        m = _EXC_LINE.match(ln.strip())
        if m and "Warning" not in m.group(1):
            msg = m.group(1)
            short = msg.split(": ", 1)[-1]
            if short not in seen:
                seen.add(short)
                out.append(msg)
    return "\n".join(out[-8:]) or "\n".join(lines[-15:])


# --------------------------------------------------------------------------------------------------------
# the shared work: reshards and loads, each done once
# --------------------------------------------------------------------------------------------------------


@dataclass
class Load:
    """One load of a checkpoint at `world` ranks (+ dump + STEPS training steps)."""

    key: str
    meta: Path
    load: Path | None
    world: int
    dir: Path
    error: str | None = None  # set when the load could not be done or failed
    run: Run | None = None
    batched: bool = False

    @property
    def dump(self) -> Path:
        return self.dir / "dump.safetensors"

    @property
    def info_file(self) -> Path:
        return self.dir / "dump.json"

    @property
    def losses_file(self) -> Path:
        return self.dir / "losses.json"

    @property
    def status(self) -> Path:
        return self.dir / "status.json"

    def job(self) -> dict:
        return {
            "fixture_meta": str(self.meta),
            "load": str(self.load),
            "dump": str(self.dump),
            "steps": STEPS,
            "losses": str(self.losses_file),
            "status": str(self.status),
        }

    def ok(self) -> bool:
        if not self.status.exists():
            return False
        return json.loads(self.status.read_text()).get("ok", False) and self.dump.exists() and self.losses_file.exists()

    # results ------------------------------------------------------------------------------------------
    def require(self) -> None:
        if self.error:
            pytest.fail(self.error, pytrace=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        self.require()
        return load_file(self.dump)

    def info(self) -> dict:
        self.require()
        return json.loads(self.info_file.read_text())

    def losses(self) -> list[float]:
        return self.after_training()["losses"]

    def after_training(self) -> dict:
        self.require()
        return json.loads(self.losses_file.read_text())


@dataclass
class Lab:
    work: Path
    cases: list
    wanted_originals: list
    originals: dict = field(default_factory=dict)  # fixture -> Load at N
    resharded: dict = field(default_factory=dict)  # (fixture, M) -> Load at M
    reshard_results: dict = field(default_factory=dict)  # (fixture, M) -> ReshardResult | str (error)
    digests: dict = field(default_factory=dict)  # fixture -> (before, after)
    consolidated: dict = field(default_factory=dict)
    timings: list = field(default_factory=list)
    done: bool = False

    def time(self, what: str, seconds: float) -> None:
        self.timings.append((what, seconds))

    def prepare(self) -> None:
        if self.done:
            return
        self.done = True
        for fixture in self.wanted_originals:
            self._original(fixture)
        for fixture, m in self.cases:
            self._reshard(fixture, m)
        loads = list(self.originals.values()) + [ld for ld in self.resharded.values() if not ld.error]
        by_world: dict[int, list[Load]] = {}
        for ld in loads:
            by_world.setdefault(ld.world, []).append(ld)
        for world in sorted(by_world):
            # ZeRO-3 last: DeepSpeed's ZeRO-3 patches process-wide functions (F.linear); the worker undoes that
            # after every job, and this order makes sure no ZeRO-1/2 load could ever see it
            self._run_batch(world, sorted(by_world[world], key=lambda ld: _meta(ld.meta.parent.name)["zero_stage"]))
        for ld in loads:  # whatever the batch did not get to (it stopped early): on its own
            if not ld.batched:
                self._run_single(ld)

    def _original(self, fixture: str) -> None:
        if fixture not in self.originals:
            n = _meta(fixture)["dp"]
            self.originals[fixture] = Load(
                f"{fixture} (original) at {n}",
                FIXTURES / fixture / "meta.json",
                FIXTURES / fixture / "checkpoint",
                n,
                self.work / "loads" / f"{fixture}-original",
            )

    def _reshard(self, fixture: str, m: int) -> None:
        src = FIXTURES / fixture / "checkpoint"
        self._original(fixture)
        out = self.work / "resharded" / f"{fixture}-to{m}"
        out.parent.mkdir(parents=True, exist_ok=True)
        before = tree_digest(FIXTURES / fixture)
        t0 = time.time()
        try:
            res = reshard(src, out, dp=m)
            load_dir = Path(res.output_dir)
            err = None
        except Exception as e:  # noqa: BLE001 - reported by every test of this case
            res, load_dir = None, None
            err = f"reshard({src}, dp={m}) raised {type(e).__name__}: {e}"
        self.time(f"reshard {fixture} -> {m}", time.time() - t0)
        self.reshard_results[(fixture, m)] = res if err is None else err
        self.digests.setdefault(fixture, [before, None])[1] = tree_digest(FIXTURES / fixture)
        ld = Load(
            f"{fixture} resharded to {m}",
            FIXTURES / fixture / "meta.json",
            load_dir,
            m,
            self.work / "loads" / f"{fixture}-to{m}",
            error=err,
        )
        self.resharded[(fixture, m)] = ld

    def _run_batch(self, world: int, loads: list[Load]) -> None:
        jobs = []
        for ld in loads:
            ld.dir.mkdir(parents=True, exist_ok=True)
            jobs.append(ld.job())
        jobs_file = self.work / f"jobs-{world}.json"
        jobs_file.write_text(json.dumps(jobs, indent=1))
        run = torchrun(world, ["--jobs", jobs_file], timeout=BATCH_TIMEOUT)
        self.time(f"batch of {len(loads)} loads at {world} ranks (rc {run.rc})", run.seconds)
        (self.work / f"jobs-{world}.log").write_text(run.output)
        for ld in loads:
            ld.run = run
            if ld.status.exists():  # done in the batch (ok or not: a job that failed on every rank is recorded)
                ld.batched = True
                st = json.loads(ld.status.read_text())
                if not ld.ok():
                    ld.error = (
                        f"plain DeepSpeed load of {ld.key} at {ld.world} ranks failed"
                        f"{' on ranks ' + str(st.get('failed_ranks')) if st.get('failed_ranks') else ''} "
                        f"(in the --jobs batch, log {self.work / f'jobs-{world}.log'}; alone: "
                        f"{self.single_command(ld)})\n{_short_error(st.get('error', ''))}"
                    )

    @staticmethod
    def single_args(ld: Load) -> list:
        return [
            "--fixture-meta",
            ld.meta,
            "--load",
            ld.load,
            "--dump",
            ld.dump,
            "--steps",
            STEPS,
            "--losses",
            ld.losses_file,
        ]

    def single_command(self, ld: Load) -> str:
        return f"torchrun --nproc_per_node {ld.world} -m {WORKER} " + " ".join(map(str, self.single_args(ld)))

    def _run_single(self, ld: Load) -> None:
        for p in (ld.status, ld.dump, ld.info_file, ld.losses_file):
            p.unlink(missing_ok=True)
        run = torchrun(ld.world, self.single_args(ld))
        self.time(f"single load {ld.key} (rc {run.rc})", run.seconds)
        ld.run = run
        (ld.dir / "worker.log").write_text(run.output)
        if run.rc != 0 or not ld.dump.exists() or not ld.losses_file.exists():
            ld.error = (
                f"plain DeepSpeed load of {ld.key} at {ld.world} ranks failed (rc {run.rc}); "
                f"log {ld.dir / 'worker.log'}\n{_short_error(run.output)}"
            )

    def consolidated_dir(self, which: str, fixture: str, m: int | None, dtype: str) -> Path:
        """consolidate() output for the original (m None) or the resharded checkpoint; once each."""
        key = (which, fixture, m, dtype)
        if key not in self.consolidated:
            if which == "original":
                src = FIXTURES / fixture / "checkpoint"
            else:
                res = self.reshard_results[(fixture, m)]
                if isinstance(res, str):
                    pytest.fail(res, pytrace=False)
                src = Path(res.output_dir)
            out = self.work / "consolidated" / f"{fixture}-{which}{'' if m is None else m}-{dtype}"
            t0 = time.time()
            try:
                consolidate(src, out, dtype=dtype)
                self.consolidated[key] = out
            except Exception as e:  # noqa: BLE001
                self.consolidated[key] = f"consolidate({src}, dtype={dtype}) raised {type(e).__name__}: {e}"
            self.time(f"consolidate {which} {fixture} {m or ''} {dtype}", time.time() - t0)
        got = self.consolidated[key]
        if isinstance(got, str):
            pytest.fail(got, pytrace=False)
        return got


def _selected(session, module_name: str) -> tuple[list, list]:
    """The (fixture, M) cases and the original fixtures the selected tests of this module need."""
    cases, originals = [], []
    for item in session.items:
        if getattr(item, "module", None) is None or item.module.__name__ != module_name:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        case, fixture = params.get("case"), params.get("fixture")
        if case in CASES and case not in cases:
            cases.append(case)
        if fixture in ORIGINALS and fixture not in originals:
            originals.append(fixture)
    return cases, originals


@pytest.fixture(scope="module")
def lab(request, tmp_path_factory):
    t0 = time.time()
    cases, originals = _selected(request.session, __name__)
    lab = Lab(tmp_path_factory.mktemp("reshard"), cases, originals)
    yield lab
    lines = [f"reshard DeepSpeed suite: {time.time() - t0:.1f}s in the module (work dir {lab.work})"]
    lines += [f"  {s:7.1f}s  {what}" for what, s in lab.timings]
    capman = request.config.pluginmanager.getplugin("capturemanager")
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if capman is not None and tr is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line("")
            for line in lines:
                tr.write_line(line)
    else:
        print("\n".join(lines))


@pytest.fixture(scope="module")
def prepared(lab):
    lab.prepare()
    return lab


# --------------------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------------------


def _compare(ours: dict, ref: dict, keys, what: str) -> list[str]:
    problems = []
    for k in keys:
        if k not in ours:
            problems.append(f"{k}: missing after the load")
            continue
        a, b = ours[k], ref[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} vs {what} {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            problems.append(
                f"{k}: {int((d > 0).sum())}/{a.numel()} elements differ from {what}, max |diff| {d.max().item():.3g}"
            )
    return problems


def _full_state_problems(ld: Load, fixture: str) -> list[str]:
    ref = load_file(FIXTURES / fixture / "reference" / "full_state.safetensors")
    ours = ld.tensors()
    return _compare(ours, ref, sorted(ref), "reference/full_state")


def _module_problems(ld: Load, fixture: str) -> list[str]:
    meta = _meta(fixture)
    ref = load_file(FIXTURES / fixture / "reference" / "bit16.safetensors")
    ours = {k[len("module/") :]: v for k, v in ld.tensors().items() if k.startswith("module/")}
    problems = _compare(ours, ref, sorted(ref), "reference/bit16")
    for n in meta.get("nonpersistent_buffers", []):  # not in any checkpoint: must still hold the model's value
        if n in ours and not torch.equal(ours[n], torch.ones_like(ours[n])):
            problems.append(f"{n} (non-persistent buffer) changed")
    return problems


def _check_losses(ours: list[float], ref: list[float], fp32: bool, what: str) -> None:
    tol = 1e-5 if fp32 else 1e-2
    assert len(ours) == len(ref) == STEPS, (ours, ref)
    bad = [
        (i + 1, a, b)
        for i, (a, b) in enumerate(zip(ours, ref, strict=True))
        if not math.isfinite(a) or abs(a - b) > tol * abs(b)
    ]
    assert not bad, (
        f"{what}: losses differ beyond rel. {tol}: "
        + ", ".join(f"step +{i}: {a!r} vs {b!r} (rel {abs(a - b) / abs(b):.2e})" for i, a, b in bad)
        + f"\n  resharded: {ours}\n  original:  {ref}"
    )


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _train_dtype(fixture: str) -> str:
    return _meta(fixture)["dtype"]


# --------------------------------------------------------------------------------------------------------
# the harness itself (no reshard involved)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ORIGINALS)
def test_harness_original_at_its_own_dp_equals_the_reference(fixture, prepared):
    """Loading the untouched checkpoint at its own N gives the live engine's state bit for bit: the yardstick
    the resharded loads are held to."""
    ld = prepared.originals[fixture]
    problems = _full_state_problems(ld, fixture) + _module_problems(ld, fixture)
    assert not problems, "\n".join(problems)
    info = ld.info()
    assert info["global_steps"] == _meta(fixture)["global_steps"] == 2
    assert info["optimizer_step"] == [2.0]


def test_harness_is_deterministic_and_batch_independent(prepared):
    """The same load run again on its own (fresh processes, not in the --jobs batch) gives the very same dump
    and losses: a ZeRO-3 bf16 load, which ran after other loads in its batch."""
    fixture = "z3_dp2_bf16"
    if fixture not in prepared.originals:
        pytest.skip(f"{fixture} was not loaded in this session")
    batched = prepared.originals[fixture]
    again = Load(f"{fixture} (original, again) at 2", batched.meta, batched.load, 2, prepared.work / "loads" / "again")
    again.dir.mkdir(parents=True, exist_ok=True)
    prepared._run_single(again)
    assert again.losses() == batched.losses()
    a, b = again.tensors(), batched.tensors()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_negative_control_original_checkpoint_is_refused_at_another_dp(lab):
    """An N-rank checkpoint at M != N ranks is refused by DeepSpeed: a reshard that does nothing fails."""
    fixture, m = "z2_dp2_fp32", 3
    out = lab.work / "negative"
    out.mkdir(exist_ok=True)
    run = torchrun(
        m,
        [
            "--fixture-meta",
            FIXTURES / fixture / "meta.json",
            "--load",
            FIXTURES / fixture / "checkpoint",
            "--dump",
            out / "dump.safetensors",
        ],
    )
    lab.time(f"negative control {fixture} at {m} ranks (rc {run.rc})", run.seconds)
    assert run.rc != 0, "DeepSpeed loaded a 2-rank checkpoint at 3 ranks?\n" + run.tail()
    assert "DP world size of 2 but the current world size is 3" in run.output, run.tail()


# --------------------------------------------------------------------------------------------------------
# resharded checkpoints
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reshard_leaves_the_input_untouched(case, prepared):
    fixture, _m = case
    res = prepared.reshard_results[case]
    if isinstance(res, str):
        pytest.fail(res, pytrace=False)
    before, after = prepared.digests[fixture]
    assert before == after, "reshard modified its input"
    assert Path(res.output_dir).is_dir()
    assert (Path(res.output_dir) / "latest").is_file()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp32_and_adam_moments_are_bit_identical_after_loading_at_m(case, prepared):
    fixture, m = case
    ld = prepared.resharded[case]
    problems = _full_state_problems(ld, fixture)
    assert not problems, f"{fixture} resharded to {m}, loaded at {m} ranks:\n" + "\n".join(problems)
    assert ld.info()["dp_world_size"] == m


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_module_weights_frozen_params_and_buffers_after_loading_at_m(case, prepared):
    fixture, m = case
    problems = _module_problems(prepared.resharded[case], fixture)
    assert not problems, f"{fixture} resharded to {m}, loaded at {m} ranks:\n" + "\n".join(problems)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_counters_and_loss_scale_survive(case, prepared):
    fixture, _m = case
    ours, ref = prepared.resharded[case].info(), prepared.originals[fixture].info()
    for key in ("global_steps", "global_samples", "skipped_steps", "optimizer_step", "cur_scale"):
        assert ours[key] == ref[key], f"{key}: {ours[key]!r} after the resharded load, {ref[key]!r} from the original"
    per_rank = [r.get("state_steps") for r in ours["ranks"]]
    assert all(s == ref["optimizer_step"] for s in per_rank), f"optimizer steps per rank: {per_rank}"
    for key in ("group_lrs", "group_weight_decay", "group_steps", "clip_grad", "loss_scaler", "wrapper", "base"):
        got = {json.dumps(r.get(key)) for r in ours["ranks"]}
        want = json.dumps(ref["ranks"][0].get(key))
        assert got == {want}, f"{key}: {sorted(got)} after the resharded load, {want} from the original"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_counters_advance_like_the_original_while_training(case, prepared):
    """After 3 more steps every optimizer state must be at step 2 + 3, as in the original run (a `step` tensor
    shared by several states after the load would advance once per state)."""
    fixture, _m = case
    ours, ref = prepared.resharded[case].after_training(), prepared.originals[fixture].after_training()
    assert ref["optimizer_step_after"] == [2.0 + STEPS] and ref["global_steps_after"] == 2 + STEPS, ref
    per_rank = [r.get("state_steps") for r in ours["ranks_after"]]
    assert ours["global_steps_after"] == ref["global_steps_after"]
    assert all(s == ref["optimizer_step_after"] for s in per_rank), (
        f"optimizer steps per rank after {STEPS} more steps: {per_rank}, the original has {ref['optimizer_step_after']}"
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_training_continues_like_the_original_at_n(case, prepared):
    fixture, m = case
    ours = prepared.resharded[case].losses()
    ref = prepared.originals[fixture].losses()
    _check_losses(
        ours,
        ref,
        _train_dtype(fixture) == "fp32",
        f"{fixture} resharded to {m} (at {m} ranks) vs the original (at {_meta(fixture)['dp']} ranks)",
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_consolidate_gives_the_same_tensors(case, prepared):
    fixture, m = case
    for dtype in sorted({"fp32", _train_dtype(fixture)}):
        ours = _folder_tensors(prepared.consolidated_dir("resharded", fixture, m, dtype))
        ref = _folder_tensors(prepared.consolidated_dir("original", fixture, None, dtype))
        assert sorted(ours) == sorted(ref), f"{dtype}: keys differ"
        problems = _compare(ours, ref, sorted(ref), f"consolidate(original, dtype={dtype})")
        assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------------------
# HF Trainer resume at M ranks
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TRAINER_CASES, ids=_case_id)
def test_trainer_resumes_from_a_resharded_checkpoint(case, lab):
    fixture, m = case
    meta = _meta(fixture)
    src = FIXTURES / fixture / "out" / "checkpoint-2"
    work = lab.work / "trainer" / f"{fixture}-to{m}"
    out = work / "checkpoint-2"
    work.mkdir(parents=True, exist_ok=True)
    before = tree_digest(src)
    t0 = time.time()
    res = reshard(src, out, dp=m)
    lab.time(f"reshard {fixture}/checkpoint-2 -> {m}", time.time() - t0)
    assert tree_digest(src) == before, "reshard modified its input"
    ckpt = Path(res.output_dir)
    for name in sorted(p.name for p in src.iterdir() if p.is_file() and not p.name.startswith("rng_state")):
        assert (ckpt / name).is_file(), f"{name} of the Trainer checkpoint folder is missing after reshard"
    result = work / "result.json"
    run = torchrun(
        m,
        [
            "--trainer",
            "--fixture-meta",
            FIXTURES / fixture / "meta.json",
            "--resume",
            ckpt,
            "--max-steps",
            3,
            "--result",
            result,
        ],
    )
    lab.time(f"trainer resume {fixture} at {m} ranks (rc {run.rc})", run.seconds)
    (work / "worker.log").write_text(run.output)
    assert run.rc == 0, f"Trainer resume at {m} ranks failed (rc {run.rc}):\n{_short_error(run.output)}"
    got = json.loads(result.read_text())
    assert got["global_step"] == 3 and got["engine_global_steps"] == 3 and got["dp_world_size"] == m, got
    state = json.loads((work / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), state["log_history"]
    # the first two come from the checkpoint, the third was trained at M ranks
    ref = json.loads((src / "trainer_state.json").read_text())
    assert losses[:2] == [h["loss"] for h in ref["log_history"] if "loss" in h]
    assert meta["global_steps"] == 2


# --------------------------------------------------------------------------------------------------------
# universal checkpoints written by ckpt, loaded by DeepSpeed with load_universal at another size
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture,m", [("z2_dp2_fp32", 3), ("z3_dp2_fp32", 3), ("z1_dp3_fp32", 2)])
def test_universal_checkpoint_loads_in_deepspeed_at_another_size(fixture, m, tmp_path, monkeypatch):
    """fp32 masters and Adam moments after a `load_universal` load equal the engine's own at save time.

    (DeepSpeed's universal load restores only optimizer-owned params: frozen params and buffers keep the
    fresh model's values there, a DeepSpeed limitation the native reshard does not have.)
    """
    src = FIXTURES / fixture / "checkpoint"
    reshard(src, tmp_path / "ucp", universal=True)
    monkeypatch.setenv("RESHARD_WORKER_LOAD_UNIVERSAL", "1")
    dump = tmp_path / "dump.safetensors"
    run = torchrun(m, ["--fixture-meta", FIXTURES / fixture / "meta.json", "--load", tmp_path / "ucp", "--dump", dump])
    assert run.rc == 0, _short_error(run.output)
    ours = load_file(dump)
    ref = load_file(FIXTURES / fixture / "reference" / "full_state.safetensors")
    problems = [
        k for k in ref if k.split("/")[0] in ("fp32", "exp_avg", "exp_avg_sq") and not torch.equal(ours[k], ref[k])
    ]
    assert not problems, problems

"""The CI examples run: examples/post-train.yml's steps and examples/post-train.sh, against the local Hub server.

The workflow is read with PyYAML and its `run:` steps are executed the way GitHub's runner does with
`shell: bash` (`bash --noprofile --norc -eo pipefail FILE`): the job's `env:` with `${{ inputs.* }}`,
`${{ secrets.* }}` and `${{ vars.* || 'default' }}` filled in, GITHUB_ENV / GITHUB_PATH written by one step read
into the next, and the job stopping at the first failing step. `uses:` steps (setup-python, upload-artifact) and
the install step (pip from PyPI) are not run; the install step's text is checked instead. `ckpt` and `python` are
this checkout's, as `pip install "ckpttools[hub]"` would provide them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.hub_server import LocalHub

from .conftest import FIXTURES

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW_FILE = ROOT / "examples" / "post-train.yml"
RECIPE = ROOT / "examples" / "post-train.sh"
TRAINER = FIXTURES / "trainer_z3_nogather_bf16" / "out"
TOKEN = "hf_CiToken_never_printed_27182"
REPO = "org/ci-model"
GITHUB_BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail"]  # GitHub's `shell: bash`
COMMIT = r"/api/models/org/ci-model/commit/"
VENV_BIN = str(Path(sys.executable).parent)


def load_workflow() -> dict:
    return yaml.safe_load(WORKFLOW_FILE.read_text())


@dataclass
class Step:
    name: str
    rc: int
    stdout: str
    stderr: str


@pytest.fixture
def hub():
    with LocalHub(token=TOKEN) as server:
        yield server


@pytest.fixture
def base_env(hub, tmp_path):
    """The runner's environment: this checkout's `ckpt` and `python` on PATH, the local Hub as the endpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env |= {
        "PATH": os.pathsep.join([VENV_BIN, env.get("PATH", "")]),
        "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf_home"), "CI": "true",
    }  # fmt: skip
    return env


def expand(value: str, context: dict[str, dict[str, str]]) -> str:
    """`${{ inputs.x }}`, `${{ secrets.X }}`, `${{ vars.X || 'default' }}`: what the workflow's env uses."""

    def one(m: re.Match[str]) -> str:
        found = context[m["scope"]].get(m["name"])
        if found is None and m["default"] is None:
            raise AssertionError(f"{m[0]} has no value in the test's context")
        return found if found is not None else m["default"]

    pattern = r"\$\{\{\s*(?P<scope>inputs|secrets|vars)\.(?P<name>\w+)\s*(?:\|\|\s*'(?P<default>[^']*)'\s*)?\}\}"
    expanded = re.sub(pattern, one, str(value))
    assert "${{" not in expanded, expanded
    return expanded


def run_workflow(
    base_env: dict[str, str],
    tmp_path: Path,
    *,
    token: str = TOKEN,
    overrides: dict[str, str] | None = None,
    run_id: int = 1,
) -> list[Step]:
    """Run the publish job's `run:` steps in order, as GitHub would; stops at the first failing step."""
    job = load_workflow()["jobs"]["publish"]
    assert job["defaults"]["run"]["shell"] == "bash"  # hence GITHUB_BASH: -e and pipefail in every step
    context = {
        "inputs": {"checkpoint": str(TRAINER), "repo": REPO, "dtype": "bf16", "revision": "main"},
        "secrets": {"HF_TOKEN": token},
        "vars": {"CKPT_WORK": str(tmp_path / "runner-work")},  # persists across the runs of one test
    }
    run_dir = tmp_path / f"run-{run_id}"
    (run_dir / "temp").mkdir(parents=True)
    (run_dir / "workspace").mkdir()
    files = {
        name: run_dir / name.lower() for name in ("GITHUB_ENV", "GITHUB_PATH", "GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY")
    }
    for f in files.values():
        f.touch()
    env = {**base_env, **{k: expand(v, context) for k, v in job["env"].items()}, **(overrides or {})}
    env |= {"RUNNER_TEMP": str(run_dir / "temp"), **{k: str(v) for k, v in files.items()}}
    results = []
    for i, step in enumerate(job["steps"]):
        if "run" not in step or step.get("name", "").startswith("Install"):
            continue
        script = run_dir / f"step-{i}.sh"
        script.write_text(step["run"])
        step_env = {**env, **dict(line.split("=", 1) for line in files["GITHUB_ENV"].read_text().splitlines() if line)}
        step_env["PATH"] = os.pathsep.join([*reversed(files["GITHUB_PATH"].read_text().split()), step_env["PATH"]])
        proc = subprocess.run(
            [*GITHUB_BASH, str(script)], env=step_env, cwd=run_dir / "workspace",
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        results.append(Step(step["name"], proc.returncode, proc.stdout, proc.stderr))
        assert token not in proc.stdout + proc.stderr
        if proc.returncode:
            break
    return results


def model_dir(tmp_path: Path) -> Path:
    (folder,) = (tmp_path / "runner-work").iterdir()
    return folder / "model"


def weights_identity(tmp_path: Path) -> tuple[int, int]:
    st = (model_dir(tmp_path) / "model.safetensors").stat()
    return st.st_ino, st.st_mtime_ns


def consolidations(steps: list[Step]) -> int:
    """How many runs of the consolidate step converted (the others said an earlier run had)."""
    found = [s for s in steps if s.name.startswith("Consolidate")]
    return sum("not converting again" not in s.stdout for s in found)


# --- the workflow ---


def test_the_workflow_is_self_contained_and_installs_cpu_torch():
    workflow = load_workflow()
    steps = workflow["jobs"]["publish"]["steps"]
    install = next(s for s in steps if s.get("name", "").startswith("Install"))["run"]
    assert '"ckpttools[hub]"' in install
    assert re.search(r"torch==[\d.]+ --index-url https://download.pytorch.org/whl/cpu", install)
    assert install.index("torch==") < install.index("ckpttools[hub]")  # so pip does not fetch the CUDA build
    assert not re.search(r"pip install[^\n]*\s\.(\s|$)", install)  # never the user's repository
    assert not any(s.get("uses", "").startswith("actions/checkout") for s in steps)
    for step in steps:  # inputs reach the shell through env, never pasted into the script
        assert "${{" not in step.get("run", ""), step.get("name")
        assert "scripts/" not in step.get("run", ""), step.get("name")


def test_a_clean_run_pushes(hub, base_env, tmp_path):
    steps = run_workflow(base_env, tmp_path)
    assert [s.rc for s in steps] == [0] * 5, steps[-1]
    files = hub.files(REPO)
    assert "model.safetensors" in files
    assert "README.md" in files
    assert not [p for p in files if p.startswith("global_step") or "ckpt-manifest" in p or p.endswith(".pth")]
    outputs = (tmp_path / "run-1" / "github_output").read_text()
    assert re.fullmatch(r"commit=\S+/org/ci-model/commit/[0-9a-f]+\n", outputs)
    record = json.loads((tmp_path / "run-1" / "temp" / "push.json").read_text())
    assert record["repo_id"] == REPO
    assert record["dtype"] == "bfloat16"
    assert consolidations(steps) == 1
    assert "bit-identical" in next(s for s in steps if s.name.startswith("Verify")).stdout


def test_a_failed_commit_is_retried_without_converting_again(hub, base_env, tmp_path):
    hub.fail("POST", COMMIT, 500, message="the Hub had a bad moment")
    steps = run_workflow(base_env, tmp_path, overrides={"CKPT_RETRY_DELAY": "0"})
    assert [s.rc for s in steps] == [0] * 5, steps[-1]
    push = steps[-1]
    assert "::warning::the Hub or the network failed (exit 3), attempt 1 of 4" in push.stdout
    assert len(hub.requests("POST", COMMIT)) == 2
    assert consolidations(steps) == 1
    assert "model.safetensors" in hub.files(REPO)


def test_a_rerun_after_the_last_attempt_resumes_without_converting(hub, base_env, tmp_path):
    hub.fail("POST", COMMIT, 500, times=2)
    first = run_workflow(base_env, tmp_path, overrides={"CKPT_RETRY_DELAY": "0", "CKPT_PUSH_ATTEMPTS": "2"})
    assert [s.rc for s in first] == [0, 0, 0, 0, 3]
    assert "still fails after 2 attempts" in first[-1].stdout
    weights = weights_identity(tmp_path)
    puts = len(hub.lfs_puts)
    assert puts >= 1  # the weights arrived before the commit failed

    second = run_workflow(base_env, tmp_path, overrides={"CKPT_RETRY_DELAY": "0"}, run_id=2)
    assert [s.rc for s in second] == [0] * 5, second[-1]
    assert consolidations(first) == 1
    assert consolidations(second) == 0
    assert "by an earlier run" in next(s for s in second if s.name.startswith("Verify")).stdout
    assert weights_identity(tmp_path) == weights  # the same file: not converted again
    assert len(hub.lfs_puts) == puts  # nothing sent twice
    assert "model.safetensors" in hub.files(REPO)


def test_a_rejected_token_fails_before_any_conversion_and_is_not_retried(hub, base_env, tmp_path):
    steps = run_workflow(base_env, tmp_path, token="hf_wrong")
    assert [s.rc for s in steps] == [4]
    assert "::error::the Hub rejected HF_TOKEN (HTTP 401)" in steps[0].stdout
    assert not (tmp_path / "runner-work").exists()
    assert len(hub.requests("GET", "/api/whoami")) == 1  # no retry
    assert not hub.requests("POST")


def test_no_write_right_at_push_time_is_not_retried(hub, base_env, tmp_path):
    hub.writable = ("someone-else",)  # the token is valid, but may not create repos under org/
    steps = run_workflow(base_env, tmp_path, overrides={"CKPT_RETRY_DELAY": "0"})
    assert steps[-1].name.startswith("Push")
    assert steps[-1].rc == 4, steps[-1].stderr
    assert "not retried" in steps[-1].stdout
    assert len(hub.requests("POST", "/api/repos/create")) == 1


# --- the retry loop alone: every exit code, with a stand-in `ckpt` ---


STUB = """\
import json, os, sys
from pathlib import Path
log = Path(os.environ["STUB_LOG"])
with log.open("a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
cmd = sys.argv[1]
if cmd == "push":
    codes = os.environ["STUB_PUSH_CODES"].split()
    n = sum(line.startswith("push") for line in log.read_text().splitlines())
    code = int(codes[min(n, len(codes)) - 1])
    if code == 0:
        print(json.dumps({"commit_url": "http://hub/org/ci-model/commit/abc"}))
    else:
        print(f"Error: stand-in failure {code}", file=sys.stderr)
    sys.exit(code)
if cmd == "verify":
    sys.exit(int(os.environ.get("STUB_VERIFY_CODE", "0")))
if cmd == "inspect":
    print(json.dumps({"path": os.environ["STUB_CKPT"], "tag": "global_step1"}))
if cmd == "consolidate":
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    out.mkdir(parents=True)
    (out / ".ckpt-manifest.json").write_text("{}")
"""


@pytest.fixture
def stub_env(base_env, tmp_path):
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    (bin_dir / "ckpt").write_text(f"#!{sys.executable}\n{STUB}")
    (bin_dir / "ckpt").chmod(0o755)
    ckpt = tmp_path / "ckpt-stub" / "checkpoint"
    (ckpt / "global_step1").mkdir(parents=True)
    (ckpt / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    return base_env | {
        "PATH": os.pathsep.join([str(bin_dir), base_env["PATH"]]),
        "STUB_LOG": str(tmp_path / "stub.log"), "STUB_CKPT": str(ckpt),
        "CKPT_RETRY_DELAY": "0", "CKPT_PUSH_ATTEMPTS": "3", "HF_TOKEN": TOKEN,
    }  # fmt: skip


def _run_recipe(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**env, "CKPT_WORK": str(tmp_path / "recipe-work")}
    return subprocess.run(
        [*GITHUB_BASH, str(RECIPE), str(TRAINER), REPO, *args],
        env=env, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("codes", "rc", "pushes"),
    [("3 3 0", 0, 3), ("4", 4, 1), ("1", 1, 1), ("2", 2, 1), ("3 4", 4, 2), ("3 3 3 3", 3, 3)],
)
@pytest.mark.parametrize("where", ["workflow", "recipe"])
def test_only_exit_3_is_retried(stub_env, tmp_path, where, codes, rc, pushes):
    env = stub_env | {"STUB_PUSH_CODES": codes}
    if where == "workflow":
        steps = run_workflow(env, tmp_path, overrides={k: env[k] for k in ("CKPT_RETRY_DELAY", "CKPT_PUSH_ATTEMPTS")})
        assert steps[-1].name.startswith("Push")
        assert steps[-1].rc == rc
    else:
        assert _run_recipe(env, tmp_path).returncode == rc
    calls = (tmp_path / "stub.log").read_text().splitlines()
    assert sum(c.startswith("push") for c in calls) == pushes
    assert sum(c.startswith("consolidate") for c in calls) == 1


@pytest.mark.parametrize("where", ["workflow", "recipe"])
def test_a_failed_verification_stops_before_pushing_and_names_the_work_folder(stub_env, tmp_path, where):
    env = stub_env | {"STUB_PUSH_CODES": "0", "STUB_VERIFY_CODE": "1"}
    if where == "workflow":
        steps = run_workflow(env, tmp_path)
        assert steps[-1].name.startswith("Verify")
        rc, said = steps[-1].rc, steps[-1].stdout
    else:
        proc = _run_recipe(env, tmp_path)
        rc, said = proc.returncode, proc.stderr
    assert rc == 1
    assert "verification failed (exit 1); if the model is at fault, delete " in said
    calls = (tmp_path / "stub.log").read_text().splitlines()
    assert not [c for c in calls if c.startswith("push")]


# --- the shell recipe, end to end ---


def test_the_recipe_pushes_retries_and_resumes(hub, base_env, tmp_path):
    env = base_env | {"HF_TOKEN": TOKEN, "CKPT_DTYPE": "bf16", "CKPT_RETRY_DELAY": "0", "CKPT_PUSH_ATTEMPTS": "2"}
    hub.fail("POST", COMMIT, 500, times=3)  # attempts 1 and 2 of the first run, attempt 1 of the second
    first = _run_recipe(env, tmp_path, "--revision", "run-1")
    assert first.returncode == 3, first.stderr
    assert first.stdout == ""
    assert "still fails after 2 attempts" in first.stderr
    (work,) = (tmp_path / "recipe-work").iterdir()
    weights = (work / "model" / "model.safetensors").stat()

    second = _run_recipe(env, tmp_path, "--revision", "run-1")
    assert second.returncode == 0, second.stderr
    assert "consolidated by an earlier run; not converting again" in second.stderr
    assert "verified bit for bit by an earlier run" in second.stderr
    after = (work / "model" / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)
    data = json.loads(second.stdout)  # stdout holds the push result only
    assert data["revision"] == "run-1"
    assert data["source"]["global_steps"] == 2
    assert "model.safetensors" in hub.files(REPO, "run-1")
    assert TOKEN not in first.stderr + second.stderr + second.stdout


def test_the_recipe_stops_at_a_rejected_token_before_converting(hub, base_env, tmp_path):
    proc = _run_recipe(base_env | {"HF_TOKEN": "hf_wrong"}, tmp_path)
    assert proc.returncode == 4
    assert "the Hub rejected the token (HTTP 401)" in proc.stderr
    assert not (tmp_path / "recipe-work").exists()
    proc = _run_recipe({k: v for k, v in base_env.items() if k != "HF_TOKEN"}, tmp_path)
    assert proc.returncode == 4
    assert "no Hub token" in proc.stderr


def test_the_recipe_usage(base_env, tmp_path):
    proc = subprocess.run([*GITHUB_BASH, str(RECIPE)], env=base_env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr

"""The release path, tested without publishing (issue 34 item 5): scripts/release-check builds the sdist and the
wheel, runs `twine check --strict`, installs the wheel alone in a clean virtual environment, runs `ckpt --version`
there and the unit tier against the installed package; .github/workflows/release.yml runs that script and
publishes only for a version tag, after it passed."""

from __future__ import annotations

import os
import runpy
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no types; the test extra installs it

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "release-check"
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
VERSION = runpy.run_path(str(ROOT / "ckpttools" / "_version.py"))["__version__"]


def test_the_workflow_checks_with_the_script_and_publishes_only_a_tag_after_it():
    flow = yaml.safe_load(WORKFLOW.read_text())
    check, publish = flow["jobs"]["check"], flow["jobs"]["publish"]
    assert any("scripts/release-check" in step.get("run", "") for step in check["steps"])
    assert not any("pypi-publish" in str(step.get("uses")) or "twine upload" in step.get("run", "")
                   for step in check["steps"])  # fmt: skip
    assert publish["needs"] == "check" and "refs/tags/v" in publish["if"] and "push" in publish["if"]
    assert "twine upload" not in SCRIPT.read_text() and "pypi-publish" not in SCRIPT.read_text()


@pytest.mark.slow  # builds in an isolated environment, then installs torch and transformers into a fresh venv
def test_release_check_builds_checks_installs_and_runs_the_unit_tier(tmp_path):
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CKPT_"))}
    proc = subprocess.run([str(SCRIPT), "--out", str(dist)], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=1500, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ckpt, version {VERSION}" in proc.stderr  # printed by the wheel's own entry point
    assert " passed" in proc.stdout and "release-check: passed" in proc.stderr
    wheel, sdist = dist / f"ckpttools-{VERSION}-py3-none-any.whl", dist / f"ckpttools-{VERSION}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckpttools/cli/__init__.py" in names and "ckpttools/py.typed" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    with tarfile.open(sdist) as tar:
        assert f"ckpttools-{VERSION}/README.md" in tar.getnames()

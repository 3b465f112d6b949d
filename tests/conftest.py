"""Shared test helpers: the real DeepSpeed fixtures under fixtures/ and a hermetic environment."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

FIXTURES = Path(os.environ.get("CKPT_FIXTURES") or Path(__file__).resolve().parent.parent / "fixtures")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mutations",
        type=int,
        default=None,
        help="tests/test_mutations.py: mutated checkpoints per family and weight (default 12; env CKPT_MUTATIONS)",
    )


# Modules whose tests time signals and kills against a run's progress: scripts/test runs them in a pass of their
# own, one at a time, so a neighbour's load cannot move a signal past the moment it was aimed at.
TIMING_MODULES = {"test_signals.py", "test_faults.py", "test_launch.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in TIMING_MODULES:
            item.add_marker(pytest.mark.timing)


def fixture_names(kind: str | None = None) -> list[str]:
    """Fixture folders relative to fixtures/: the CPU matrix, then those written on a GPU (gpu/...)."""
    names = json.loads((FIXTURES / "index.json").read_text())
    gpu_index = FIXTURES / "gpu" / "index.json"
    if gpu_index.exists():
        names += [f"gpu/{n}" for n in json.loads(gpu_index.read_text())]
    if kind is None:
        return names
    return [n for n in names if json.loads((FIXTURES / n / "meta.json").read_text()).get("kind", "engine") == kind]


def fixture_meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`, to prove an input was not modified."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    monkeypatch.setenv("CI", os.environ.get("CI", "1"))

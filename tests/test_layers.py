"""The package's layers hold: import-linter's contracts (pyproject.toml [tool.importlinter]) are all kept.

The same check as CI's `lint-imports` gate (.ci/run), here so that `./scripts/test` catches an upward import too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("importlinter") is None, reason="import-linter is not installed")
def test_import_contracts_are_kept() -> None:
    # A process of its own: import-linter reads pyproject.toml from the working directory and builds the import
    # graph from the source files, whatever this process has imported. --no-cache: no cache folder in the checkout.
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]

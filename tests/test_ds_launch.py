"""fixtures/build/ds_launch.py, the launcher every multi-process test goes through: a worker's exit code is main's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_worker(body: str) -> subprocess.CompletedProcess:
    code = f"import sys\nfrom fixtures.build import ds_launch\n{body}\nds_launch.exit_worker(main)\n"
    # from the repository root: `python -c` imports from the cwd first
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "rc", "stdout", "stderr"),
    [
        ("def main():\n    print('done', end='')\n    return 0", 0, "done", ""),
        ("def main():\n    print('partial', end='')\n    return 3", 3, "partial", ""),
        ("def main():\n    return None", 0, "", ""),
        ("def main():\n    raise KeyError(1)", 1, "", "KeyError: 1"),
        ("def main():\n    sys.exit(4)", 4, "", ""),
        ("def main():\n    sys.exit('bad spec')", 1, "", "bad spec"),
    ],
)
def test_exit_worker_ends_with_mains_code_and_flushed_output(body: str, rc: int, stdout: str, stderr: str) -> None:
    p = _run_worker(body)
    assert p.returncode == rc, p.stderr
    assert p.stdout == stdout
    assert stderr in p.stderr

"""The CLI's one error boundary: every exception leaving a command is one line and an exit code.

And the package's shape: the command modules never import the package that registers them, and
`import ckpttools.cli` loads neither torch nor huggingface_hub nor transformers.
"""

import ast
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckpttools.cli
from ckpttools.cli import main
from ckpttools.errors import CkptError, RemoteError, UsageError

from .conftest import FIXTURES, fixture_names

Z2 = next(n for n in fixture_names("engine") if n.startswith("z2_dp2"))
CLI_DIR = Path(ckpttools.cli.__file__).parent


def _inspect_raising(monkeypatch, exc):
    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr("ckpttools.ops.inspect.inspect_checkpoint", boom)
    return CliRunner().invoke(main, ["inspect", str(FIXTURES / Z2 / "checkpoint")])


def _stderr_lines(res):
    return [line for line in res.stderr.splitlines() if line.strip()]


def test_an_unexpected_exception_is_one_line_naming_it_exit_1(monkeypatch):
    res = _inspect_raising(monkeypatch, KeyError("param_shapes"))
    assert res.exit_code == 1 and res.stdout == ""
    assert _stderr_lines(res) == [
        "Error: internal error (KeyError: 'param_shapes'); please report it, rerun with CKPT_DEBUG=1 for the traceback"
    ]
    assert "Traceback" not in res.output


def test_an_internal_error_message_spanning_lines_stays_on_one(monkeypatch):
    res = _inspect_raising(monkeypatch, RuntimeError("first\n  second"))
    assert res.exit_code == 1
    assert _stderr_lines(res) == [
        (
            "Error: internal error (RuntimeError: first second); please report it, "
            "rerun with CKPT_DEBUG=1 for the traceback"
        )
    ]
    res = _inspect_raising(monkeypatch, AssertionError())
    assert _stderr_lines(res)[0].startswith("Error: internal error (AssertionError); please report it")


def test_ckpt_debug_lets_every_exception_through(monkeypatch):
    monkeypatch.setenv("CKPT_DEBUG", "1")
    for exc in (ZeroDivisionError("x"), CkptError("bad"), OSError(errno.ENOSPC, "No space left on device")):
        res = _inspect_raising(monkeypatch, exc)
        assert res.exception is exc and "internal error" not in res.stderr


def test_library_errors_keep_their_message_and_exit_code(monkeypatch):
    for exc, code in ((CkptError("the shards disagree"), 1), (UsageError("pass --dp"), 2), (RemoteError("503"), 3)):
        res = _inspect_raising(monkeypatch, exc)
        assert res.exit_code == code and _stderr_lines(res) == [f"Error: {exc}"]


def test_problems_behind_an_error_come_first_one_per_line(monkeypatch):
    exc = CkptError("folder failed verification (2 problem(s))")
    exc.problems = ["a.safetensors: truncated", "no config.json"]
    res = _inspect_raising(monkeypatch, exc)
    assert res.exit_code == 1
    assert _stderr_lines(res) == [
        "Error: a.safetensors: truncated",
        "Error: no config.json",
        "Error: folder failed verification (2 problem(s))",
    ]


def test_os_errors_and_interrupts(monkeypatch):
    res = _inspect_raising(monkeypatch, OSError(errno.ENOSPC, "No space left on device", "/out/x"))
    assert res.exit_code == 1 and _stderr_lines(res) == ["Error: No space left on device: /out/x"]
    res = _inspect_raising(monkeypatch, KeyboardInterrupt())
    assert res.exit_code == 130 and _stderr_lines(res) == ["Interrupted; nothing was published."]


def test_click_usage_errors_and_help_are_not_internal_errors():
    res = CliRunner().invoke(main, ["inspect"])
    assert res.exit_code == 2 and "Missing argument 'PATH'" in res.stderr and "internal error" not in res.stderr
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0 and "consolidate" in res.stdout and "push" in res.stdout


def _imports(path: Path) -> set[str]:
    """Modules a file imports, relative ones resolved against ckpttools.cli."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = {0: "", 1: "ckpttools.cli", 2: "ckpttools"}[node.level]
            if node.module:
                names.add(f"{base}.{node.module}" if base else node.module)
            else:
                names.update(f"{base}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("module", ["_common.py", "convert.py", "hub.py"])
def test_command_modules_never_import_the_package_that_registers_them(module):
    imported = _imports(CLI_DIR / module)
    assert "ckpttools.cli._common" in imported or module == "_common.py"
    assert [n for n in imported if n == "ckpttools.cli" or n.startswith("ckpttools.cli.")] == (
        [] if module == "_common.py" else ["ckpttools.cli._common"]
    )


def test_importing_the_cli_loads_no_heavy_library():
    code = (
        "import sys, ckpttools.cli; "
        "print(sorted(m for m in ('torch', 'huggingface_hub', 'transformers', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "[]"


def test_python_dash_m_runs_the_same_cli():
    out = subprocess.run([sys.executable, "-m", "ckpttools.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ckpt, version ")

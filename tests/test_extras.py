"""The light install: `consolidate`, `inspect` and `reshard` run with the base dependencies only, and the commands
that need an extra say which one in one line (ckpttools/extras.py).

The base environment is built from pyproject.toml itself: a virtual environment holding links to exactly the
distributions that `pip install ckpttools` brings (the [project] dependencies and what they require, markers
evaluated), so torch, transformers, safetensors, peft and deepspeed are absent the way they are in a user's base
install, not hidden by an import hook.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ckpttools import consolidate, open_checkpoint
from ckpttools.extras import EXTRA_FOR_COMMAND, EXTRA_FOR_MODULE, describe_missing, missing_module

from .conftest import FIXTURES, tree_digest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the suite's venv has it

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TRAINER = FIXTURES / "trainer_z3_nogather_bf16" / "out"
ZERO2 = FIXTURES / "z2_dp2_bf16" / "checkpoint"
MANIFEST = ".ckpt-manifest.json"  # records when and by whom: differs between runs
EXTRA_ONLY = ("torch", "transformers", "safetensors", "peft", "deepspeed", "accelerate")


# --- describe_missing ---


@pytest.mark.parametrize(
    ("module", "extra"),
    [("torch", "verify"), ("transformers", "verify"), ("safetensors", "verify"), ("peft", "peft"),
     ("deepspeed", "engine")],
)  # fmt: skip
def test_a_missing_module_names_its_extra(module, extra):
    line = describe_missing(ModuleNotFoundError(f"No module named '{module}'", name=module))
    assert line == f"this command needs {module}, which is not installed: pip install 'ckpttools[{extra}]'"


def test_push_names_the_hub_extra_whatever_it_missed_first():
    line = describe_missing(ModuleNotFoundError("No module named 'torch'", name="torch"), command="push")
    assert line == "this command needs torch, which is not installed: pip install 'ckpttools[hub]'"
    assert EXTRA_FOR_COMMAND["push"] == "hub"


def test_the_name_is_read_from_the_message_when_the_error_carries_none():
    error = ModuleNotFoundError("No module named 'transformers'")
    assert missing_module(error) == "transformers"
    assert "pip install 'ckpttools[verify]'" in describe_missing(error)


def test_a_submodule_of_a_missing_package_names_the_package(monkeypatch):
    monkeypatch.setattr("ckpttools.extras._installed", lambda name: False)
    line = describe_missing(ModuleNotFoundError("No module named 'torch.distributed'", name="torch.distributed"))
    assert line == "this command needs torch, which is not installed: pip install 'ckpttools[verify]'"


def test_no_extra_line_for_what_an_extra_cannot_fix():
    # a submodule missing from an installed package is a version problem; unknown modules are bugs
    assert describe_missing(ModuleNotFoundError("", name="transformers.no_such_module")) is None
    assert describe_missing(ModuleNotFoundError("", name="ckpttools.no_such_module")) is None
    assert describe_missing(ModuleNotFoundError("", name="some_plugin")) is None
    assert describe_missing(ModuleNotFoundError("something else went wrong")) is None


def test_a_missing_base_dependency_is_a_broken_install():
    line = describe_missing(ModuleNotFoundError("No module named 'numpy'", name="numpy"))
    assert line is not None
    assert "ckpttools needs numpy" in line
    assert "pip install --force-reinstall ckpttools" in line


def test_every_extra_named_is_declared_and_installs_the_module():
    extras = PYPROJECT["optional-dependencies"]
    for module, extra in [*EXTRA_FOR_MODULE.items(), ("torch", EXTRA_FOR_COMMAND["push"])]:
        assert module in _extra_closure(extras, extra), (module, extra)
    for extra in ("verify", "hub", "engine", "peft", "distributed", "all"):
        assert extra in extras
    assert set(EXTRA_FOR_MODULE) <= _extra_closure(extras, "all")


def test_the_base_install_has_no_torch_nor_transformers():
    base = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
    assert base == {"click", "numpy", "huggingface-hub"}


def _extra_closure(extras: dict[str, list[str]], extra: str) -> set[str]:
    """Distribution names an extra installs directly or through `ckpttools[...]` self-references."""
    names: set[str] = set()
    for spec in extras[extra]:
        req = Requirement(spec)
        if req.name == "ckpttools":
            for inner in req.extras:
                names |= _extra_closure(extras, inner)
        else:
            names.add(req.name)
    return names


# --- the commands in a base-only environment ---


@pytest.fixture(scope="module")
def base_python(tmp_path_factory) -> Path:
    """The interpreter of a virtual environment holding what `pip install ckpttools` installs, and nothing else.

    The distributions are linked from the suite's own environment (no download); ckpttools comes from this
    checkout through a .pth file. Child processes that ckpttools starts (`--check-keys`) run in it too.
    """
    env_dir = tmp_path_factory.mktemp("base-env")
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True)
        .strip()
    )  # fmt: skip
    (site / "ckpttools-checkout.pth").write_text(f"{ROOT}\n")
    seen: set[str] = set()
    todo = [Requirement(r) for r in PYPROJECT["dependencies"]]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}:
            if not (site / top).exists():
                (site / top).symlink_to(str(dist.locate_file(top)))
        todo += [Requirement(r) for r in dist.requires or ()]
    assert not {canonicalize_name(n) for n in EXTRA_ONLY} & seen, seen
    return python


def ckpt_base(python: Path, *args: object) -> subprocess.CompletedProcess[str]:
    """Run `ckpt ARGS` in the base environment."""
    code = "import sys; from ckpttools.cli import main; sys.argv[0] = 'ckpt'; sys.exit(main())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    return subprocess.run(
        [python, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_the_base_environment_really_lacks_the_extras(base_python):
    proc = ckpt_base(base_python, "--version")
    assert proc.returncode == 0, proc.stderr
    for module in EXTRA_ONLY:
        probe = subprocess.run([base_python, "-c", f"import {module}"], capture_output=True, check=False)
        assert probe.returncode == 1, module
        assert b"ModuleNotFoundError" in probe.stderr, module


def test_consolidate_and_inspect_run_without_torch(base_python, tmp_path):
    proc = ckpt_base(base_python, "inspect", TRAINER)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO-3" in proc.stdout

    out = tmp_path / "base"
    proc = ckpt_base(base_python, "consolidate", TRAINER, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "Error" not in proc.stderr
    consolidate(TRAINER, tmp_path / "full")  # the same job with torch importable: the same bytes
    ours, theirs = tree_digest(out), tree_digest(tmp_path / "full")
    assert "model.safetensors" in ours
    assert ours.keys() == theirs.keys()
    assert {k: v for k, v in ours.items() if k != MANIFEST} == {k: v for k, v in theirs.items() if k != MANIFEST}


def test_zero2_consolidate_and_reshard_run_without_torch(base_python, tmp_path):
    proc = ckpt_base(base_python, "consolidate", ZERO2, "--out", tmp_path / "bf16", "--dtype", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bf16" / "model.safetensors").is_file()
    for args in (["--dp", "1"], ["--universal"]):
        proc = ckpt_base(base_python, "reshard", ZERO2, "--out", tmp_path / args[0].strip("-"), *args)
        assert proc.returncode == 0, proc.stderr


def _one_line_naming(proc: subprocess.CompletedProcess[str], extra: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        rf"Error: this command needs \w+, which is not installed: pip install 'ckpttools\[{extra}\]'", lines[0]
    ), lines[0]


def test_verify_without_torch_names_the_extra_in_one_line(base_python, tmp_path):
    consolidate(TRAINER, tmp_path / "model")
    _one_line_naming(ckpt_base(base_python, "verify", tmp_path / "model"), "verify")


def test_to_pt_without_torch_names_the_extra_in_one_line(base_python, tmp_path):
    _one_line_naming(ckpt_base(base_python, "consolidate", TRAINER, "--out", tmp_path / "pt", "--to", "pt"), "verify")
    assert not (tmp_path / "pt").exists()


def test_check_keys_without_torch_names_the_extra_in_one_line(base_python, tmp_path):
    proc = ckpt_base(base_python, "consolidate", TRAINER, "--out", tmp_path / "k", "--check-keys")
    _one_line_naming(proc, "verify")
    assert not (tmp_path / "k").exists()


def module_base(python: Path, module: str, *args: object) -> subprocess.CompletedProcess[str]:
    """Run `python -m MODULE ARGS` in the base environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    return subprocess.run(
        [python, "-m", module, *map(str, args)], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_the_drop_ins_run_without_torch(base_python, tmp_path):
    """zero_to_fp32 (its default .bin), zero_to_torch and ds_to_universal on the base install, as the README says:
    their torch files come from ckpt's own writer, and torch.load reads back what DeepSpeed's functions give."""
    import torch

    from ckpttools.compat.ds_to_universal import convert_to_universal
    from ckpttools.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    want = get_fp32_state_dict_from_zero_checkpoint(ZERO2)  # torch.equal to DeepSpeed's (test_zero_to_fp32.py)
    kept = set(open_checkpoint(ZERO2).kept_fp32)  # buffers the bf16 run kept in fp32: zero_to_torch keeps them
    for module, args, dtype in (("ckpttools.zero_to_fp32", [], torch.float32),
                                ("ckpttools.zero_to_torch", ["--dtype", "bf16"], torch.bfloat16)):  # fmt: skip
        out = tmp_path / module.rpartition(".")[2]
        proc = module_base(base_python, module, ZERO2, out, *args)
        assert proc.returncode == 0, proc.stderr
        got = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert list(got) == list(want)
        for key, value in want.items():
            cast = value.to(dtype) if value.is_floating_point() and key not in kept else value
            assert got[key].dtype == cast.dtype and torch.equal(got[key], cast), (module, key)
        assert got["head.weight"].untyped_storage().data_ptr() == got["emb.weight"].untyped_storage().data_ptr()

    tag = next(ZERO2.glob("global_step*"))
    proc = module_base(base_python, "ckpttools.ds_to_universal", "--input_folder", tag, "--output_folder",
                       tmp_path / "u" / "universal")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    convert_to_universal(tag, tmp_path / "full" / "universal")  # with torch importable: the same tensors
    base, full = tmp_path / "u" / "universal", tmp_path / "full" / "universal"
    files = sorted(p.relative_to(full) for p in full.rglob("*.pt"))
    assert files and files == sorted(p.relative_to(base) for p in base.rglob("*.pt"))
    for rel in files:
        a, b = torch.load(base / rel, weights_only=False), torch.load(full / rel, weights_only=False)
        if isinstance(b, dict) and "param" in b:
            assert torch.equal(a["param"], b["param"]), rel

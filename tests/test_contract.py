"""The promises every command and drop-in keeps on every kind of input (issue 35), checked family by family.

One representative checkpoint per fixture family (DeepSpeed layouts, the DCP forms, universal, PEFT, a remote
stand-in) goes through `inspect`, `consolidate`, `verify --against`, `push --dry-run` and the three drop-ins, and
each run is held to the shared promises of README.md and docs/json.md:

- success or a documented exit code (0-4), never a traceback; a failure is one `Error:` line on stderr;
- with `--json`, exactly one JSON object on stdout, for a failure too (`error.message`, `error.exit_code`);
- one parameter count: `inspect`, `consolidate`, `verify` and `from_pretrained` agree;
- a selection option that cannot apply to PATH is a usage error, never ignored;
- the help of `ckpt` and of each command names the inputs that work.

The families come from fixtures/ (real runs); the universal checkpoint is written here by `ckpt reshard`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ckpttools.cli import main

from .conftest import FIXTURES, tree_digest

DOCUMENTED_EXIT_CODES = {0, 1, 2, 3, 4}

# family -> the PATH a user would give (a fixture's checkpoint folder, a Trainer output_dir, ...)
FAMILIES: dict[str, str] = {
    "zero3": "z3_dp2_bf16/checkpoint",
    "zero2 fp32": "z2_dp2_fp32/checkpoint",
    "zero1 dp3": "z1_dp3_bf16/checkpoint",
    "zero0": "z0_dp2_bf16/checkpoint",
    "trainer output_dir": "trainer_z2_bf16/out",
    "trainer zero3 gather": "trainer_z3_gather_bf16/out",
    "accelerate save_state": "accelerate_z2_bf16/checkpoint",
    "lightning": "lightning_z2_bf16/checkpoint",
    "pipeline": "pp2_dp2_z1_bf16/checkpoint",
    "deepspeed-moe": "moe_ep2_dp2_z2_bf16/checkpoint",
    "autotp": "autotp_tp2_dp2_z1_bf16/checkpoint",
    "autoep": "autoep_ep2_dp2_z2_bf16/checkpoint",
    "muon": "muon_z2_dp2_bf16/checkpoint",
    "legacy serialization": "legacy_z2_dp2_bf16/checkpoint",
    "keep_in_fp32": "keep_fp32_z2_bf16/checkpoint",
    "dualpipev": "dualpipev_pp2_dp2_z1_bf16/checkpoint",
    "pipeline x tp": "pp2_tp2_dp1_z1_bf16_megatron/checkpoint",
    "peft trainer": "peft_trainer_z2_bf16/out",
    "dcp fp32 tied": "fsdp2_dcp_dp2_fp32/checkpoint",
    "dcp bf16": "fsdp2_dcp_dp3_bf16/checkpoint",
    "dcp tp x fsdp": "fsdp2_tp2_dp2/checkpoint",
    "dcp hf shards": "fsdp2_hf_safetensors/checkpoint",
    "dcp peft": "fsdp2_peft_dcp/checkpoint",
    "accelerate fsdp2": "accelerate_fsdp2_sharded/checkpoint",
    "accelerate fsdp2 rank files": "accelerate_fsdp2_rankfiles/checkpoint",
    "nvme zero3": "nvme_z3_dp2_bf16/checkpoint",
    "nvme zero3 unswapped": "nvme_z3_dp2_bf16_unswapped/checkpoint",
    "nvme zero2": "nvme_z2_dp2_bf16/checkpoint",
    "megatron llama": "megatron_tp2_llama/checkpoint",
    "megatron pp x tp": "megatron_tp2_pp2_llama/checkpoint",
    "megatron moe": "megatron_moe_tp2_ep2_qwen3/checkpoint",
    "megatron deepseek-v3": "megatron_moe_ep2_deepseek_v3/checkpoint",
    "torchtitan (needs --config)": "torchtitan_llama3_step2/checkpoint",
}
DCP_FAMILIES = {
    name
    for name, path in FAMILIES.items()
    if path.startswith(("fsdp2", "accelerate_fsdp2", "megatron_", "torchtitan_"))
}


def family_path(name: str) -> Path:
    path = FIXTURES / FAMILIES[name]
    if not path.exists():
        pytest.skip(f"fixture {FAMILIES[name]} is not here")
    return path


def run(*args: Any) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_kept_promises(res: Result, *, as_json: bool) -> dict[str, Any] | None:
    """The promises of any run: a documented code, no traceback, one error line on failure, one JSON object on
    stdout with --json (for a failure: its `error`). Returns the JSON object when there is one."""
    assert res.exit_code in DOCUMENTED_EXIT_CODES, (res.exit_code, res.output)
    assert "Traceback" not in res.output and "internal error" not in res.stderr, res.output
    if res.exit_code != 0:
        errors = [line for line in lines(res.stderr) if line.startswith("Error: ")]
        assert errors, res.stderr
        assert errors[-1] == lines(res.stderr)[-1], f"the error line is not the last: {res.stderr}"
    if not as_json:
        return None
    out = lines(res.stdout)
    assert len(out) == 1, f"--json printed {len(out)} lines on stdout: {res.stdout!r}"
    data = json.loads(out[0])
    assert isinstance(data, dict)
    if res.exit_code != 0:
        error = data.get("error")
        assert isinstance(error, dict) and error.get("exit_code") == res.exit_code, data
        assert error.get("message") and "\n" not in error["message"], data
    return data


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("universal") / "u"
    res = run("reshard", FIXTURES / "z2_dp2_bf16" / "checkpoint", "--universal", "--out", out, "-q")
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inspect_consolidate_and_verify_keep_their_promises_and_agree_on_the_count(family: str, tmp_path: Path):
    path = family_path(family)
    _check_family(path, tmp_path)


def test_a_universal_checkpoint_keeps_the_same_promises(universal: Path, tmp_path: Path):
    _check_family(universal, tmp_path)


def _check_family(path: Path, tmp_path: Path) -> None:
    before = tree_digest(path)
    inspected = assert_kept_promises(run("inspect", path, "--json"), as_json=True)
    assert inspected is not None and "error" not in inspected, inspected

    out = tmp_path / "out"
    res = run("consolidate", path, "--out", out, "--json")
    made = assert_kept_promises(res, as_json=True)
    assert made is not None
    if res.exit_code != 0:  # refused in one line: nothing may be left behind
        assert not out.exists() and tree_digest(path) == before
        return
    assert made["num_parameters"] == inspected["num_parameters"], (made["num_parameters"], inspected)

    verified = assert_kept_promises(run("verify", out, "--against", path, "--json"), as_json=True)
    assert verified is not None
    if verified.get("error") is None:
        assert verified["ok"], verified
        assert verified["against"] is not None, verified
        assert verified["num_parameters"] == made["num_parameters"], (verified, made)
    assert tree_digest(path) == before, "the input changed"

    if (out / "config.json").exists() and verified.get("kind") == "model":
        assert _from_pretrained_count(out) == made["num_parameters"]


def _from_pretrained_count(folder: Path) -> int:
    """Elements `from_pretrained` holds: parameters and persistent buffers, a tie counted once."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + [b for n, b in model.named_buffers() if _persistent(model, n)]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel()
    return total


def _persistent(model: Any, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in getattr(module, "_non_persistent_buffers_set", set())


# --------------------------------------------------------------------------------------------------
# --json on failure, for every command
# --------------------------------------------------------------------------------------------------

FAILING_RUNS: dict[str, list[str]] = {
    "inspect a missing path": ["inspect", "{missing}", "--json"],
    "consolidate a missing path": ["consolidate", "{missing}", "--json"],
    "reshard onto an existing output": ["reshard", "{zero2}", "--dp", "1", "--out", "{existing}", "--json"],
    "verify a missing path": ["verify", "{missing}", "--json"],
    "verify against a missing path": ["verify", "{model}", "--against", "{missing}", "--json"],
    "push a missing path": ["push", "{missing}", "--repo", "a/b", "--dry-run", "--json"],
    "consolidate with a bad dtype": ["consolidate", "{zero2}", "--dtype", "int3", "--json"],
    "consolidate a DCP folder at a step it lacks": ["consolidate", "{dcp}", "--step", "9", "--json"],
}


@pytest.mark.parametrize("case", list(FAILING_RUNS))
def test_a_failing_command_prints_one_json_error_object(case: str, tmp_path: Path):
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "mine.txt").write_text("not ckpt's")
    model = tmp_path / "model"
    assert run("consolidate", FIXTURES / "z2_dp2_bf16" / "checkpoint", "--out", model, "-q").exit_code == 0
    names = {
        "missing": tmp_path / "nope",
        "zero2": FIXTURES / "z2_dp2_bf16" / "checkpoint",
        "existing": tmp_path / "existing",
        "model": model,
        "dcp": FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint",
    }
    args = [a.format(**{k: str(v) for k, v in names.items()}) for a in FAILING_RUNS[case]]
    res = run(*args)
    assert res.exit_code != 0, res.output
    assert_kept_promises(res, as_json=True)
    assert (tmp_path / "existing" / "mine.txt").read_text() == "not ckpt's"


# --------------------------------------------------------------------------------------------------
# Options honoured or refused
# --------------------------------------------------------------------------------------------------

IGNORED_SELECTIONS: dict[str, list[str]] = {
    "--step on one Trainer checkpoint": ["consolidate", "{trainer}/checkpoint-2", "--step", "1"],
    "--step on one DCP step folder": ["consolidate", "{dcp}/step-2", "--step", "9"],
    "--best without a trainer state": ["inspect", "{dcp}", "--best"],
    "--best with --step": ["inspect", "{trainer}", "--best", "--step", "1"],
    "a negative --step": ["inspect", "{trainer}", "--step", "-1"],
}


@pytest.mark.parametrize("case", list(IGNORED_SELECTIONS))
def test_a_selection_that_cannot_apply_is_a_usage_error(case: str, tmp_path: Path):
    names = {
        "trainer": str(FIXTURES / "trainer_z2_bf16" / "out"),
        "dcp": str(FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint"),
    }
    args = [a.format(**names) for a in IGNORED_SELECTIONS[case]]
    res = run(*args, "--out", tmp_path / "o") if args[0] == "consolidate" else run(*args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------
# The drop-ins
# --------------------------------------------------------------------------------------------------

DROP_INS = ("zero_to_fp32", "zero_to_torch", "ds_to_universal")


def _drop_in(name: str, path: Path, out: Path) -> tuple[int, str]:
    """Run a drop-in's command line in a subprocess-free way; returns (exit code, stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if name == "zero_to_fp32":
            from ckpttools.compat.zero_to_fp32 import cli as fp32_cli

            code = fp32_cli([str(path), str(out), "--safe_serialization"])
        elif name == "zero_to_torch":
            from ckpttools.compat.zero_to_torch import cli as torch_cli

            code = torch_cli([str(path), str(out), "--dtype", "bf16", "--safe_serialization"])
        else:
            from ckpttools.compat.ds_to_universal import cli as uni_cli

            code = uni_cli(["--input_folder", str(path), "--output_folder", str(out)])
    return code, err.getvalue()


@pytest.mark.parametrize("family", sorted(DCP_FAMILIES))
@pytest.mark.parametrize("drop_in", DROP_INS)
def test_the_drop_ins_agree_that_fsdp2_is_not_a_deepspeed_checkpoint(drop_in: str, family: str, tmp_path: Path):
    code, err = _drop_in(drop_in, family_path(family), tmp_path / "out")
    assert code == 1, err
    errors = [line for line in lines(err) if line.startswith("Error: ")]
    assert len(errors) == 1 and "not a DeepSpeed checkpoint" in errors[0], err
    assert "ckpt consolidate" in errors[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


DEEPSPEED_FAMILIES = sorted(set(FAMILIES) - DCP_FAMILIES)


@pytest.mark.parametrize("family", DEEPSPEED_FAMILIES)
@pytest.mark.parametrize("drop_in", DROP_INS)
def test_the_drop_ins_convert_or_refuse_in_one_line_on_every_deepspeed_family(
    drop_in: str, family: str, tmp_path: Path
):
    path = family_path(family)
    before = tree_digest(path)
    code, err = _drop_in(drop_in, path, tmp_path / "out")
    assert code in (0, 1, 2), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code:
        errors = [line for line in lines(err) if line.startswith("Error: ")]
        assert len(errors) == 1 and errors[0] == lines(err)[-1], err
    assert tree_digest(path) == before


# --------------------------------------------------------------------------------------------------
# Help names what is read
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["inspect"], ["consolidate"], ["push"]])
def test_help_names_every_kind_of_checkpoint_read(command: list[str]):
    text = run(*command, "--help").output
    for kind in ("DeepSpeed", "FSDP2"):
        assert kind in text, f"`ckpt {' '.join(command)} --help` does not name {kind}"


def test_reshard_help_says_fsdp2_is_refused():
    text = " ".join(run("reshard", "--help").output.split())
    assert "FSDP2" in text and "DeepSpeed" in text


def test_every_documented_exit_code_of_verify_is_in_its_help():
    text = run("verify", "--help").output
    for code in ("0", "1", "2", "3"):
        assert f"{code} " in text or f"{code}," in text, text


@pytest.fixture(scope="module")
def s3_bucket() -> Any:
    """A local S3 (moto behind tests/support/s3_server.py) holding a DeepSpeed and an FSDP2 family."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.support.s3_server import LocalS3

    with LocalS3() as server:
        for family in ("zero3", "dcp fp32 tied"):
            server.put_folder(FIXTURES / FAMILIES[family], "bucket", family.replace(" ", "-"))
        yield server


@pytest.fixture
def s3_env(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from ckpttools.io import remote

    for key, value in s3_bucket.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
    yield s3_bucket
    remote.cleanup()


@pytest.mark.parametrize("family", ["zero3", "dcp fp32 tied"])
def test_a_remote_stand_in_keeps_the_same_promises(family: str, s3_env: Any, tmp_path: Path):
    url = f"s3://bucket/{family.replace(' ', '-')}"
    inspected = assert_kept_promises(run("inspect", url, "--json"), as_json=True)
    assert inspected is not None and "error" not in inspected
    made = assert_kept_promises(run("consolidate", url, "--out", tmp_path / "out", "--json"), as_json=True)
    assert made is not None and made["num_parameters"] == inspected["num_parameters"]
    verified = assert_kept_promises(run("verify", tmp_path / "out", "--against", url, "--json"), as_json=True)
    assert verified is not None and verified["ok"] and verified["num_parameters"] == made["num_parameters"]


@pytest.mark.parametrize(
    ("case", "code"), [("a missing object", 1), ("no credentials", 4), ("an unreachable store", 3)]
)
def test_a_failing_remote_is_one_json_error_with_its_documented_code(
    case: str, code: int, s3_env: Any, monkeypatch: pytest.MonkeyPatch
):
    url = "s3://bucket/zero3"
    if case == "a missing object":
        url = "s3://bucket/no-such-checkpoint"
    elif case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "3")
    res = run("inspect", url, "--json")
    data = assert_kept_promises(res, as_json=True)
    assert res.exit_code == code, (case, res.exit_code, res.stderr)
    assert data is not None and data["error"]["exit_code"] == code

"""`verify_folder` / `ckpt verify`: sound folders pass, and each way a folder can mislead a loader is named."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.ops.verify import read_safetensors_header, verify_folder

from .conftest import FIXTURES, fixture_names

TRAINER = FIXTURES / "trainer_z3_nogather_bf16" / "out"
ENGINE = FIXTURES / next(n for n in fixture_names("engine") if n.startswith("z3_dp3_bf16")) / "checkpoint"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Consolidated folders, written once: GPT-2 (fp32, bf16, sharded), a bare engine checkpoint, and .bin."""
    root = tmp_path_factory.mktemp("verify")
    consolidate(TRAINER, root / "fp32")
    consolidate(TRAINER, root / "bf16", dtype="bf16")
    consolidate(TRAINER, root / "sharded", max_shard_size="12KB")
    consolidate(ENGINE, root / "engine")
    consolidate(TRAINER, root / "pt", to="pt")
    return root


@pytest.fixture
def folder(made, tmp_path):
    """A private copy of a made folder, to break."""

    def copy(name):
        shutil.copytree(made / name, tmp_path / name)
        return tmp_path / name

    return copy


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _one_problem(report, *needles):
    assert not report.ok
    text = "\n".join(report.problems)
    for needle in needles:
        assert needle in text, report.problems


@pytest.mark.parametrize("name", ["fp32", "bf16", "sharded", "pt"])
def test_consolidated_trainer_folders_are_sound_and_bit_identical(made, name):
    report = verify_folder(made / name, against=TRAINER)
    assert report.ok, report.problems
    assert report.architecture == "GPT2LMHeadModel" and report.num_parameters == 8000 and report.num_tensors == 28
    assert report.dtype == ("bfloat16" if name == "bf16" else "float32")
    assert any("bit-identical" in c for c in report.checks) and any("meta device" in c for c in report.checks)
    if name == "sharded":
        assert len(report.files) > 1


def test_bare_engine_folder_is_checked_without_a_model(made):
    report = verify_folder(made / "engine", against=ENGINE)
    assert report.ok, report.problems
    assert report.architecture is None and any("no readable config.json" in n for n in report.notes)


def test_trainers_own_zero2_weights_match_the_shards():
    folder = FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2"
    report = verify_folder(folder, against=folder)
    assert report.ok, report.problems  # lm_head stored beside wte (ZeRO-2 clone) is fine: equal, tied on load


def test_a_changed_value_is_caught_against_the_checkpoint(folder):
    out = folder("bf16")
    tensors = load_file(out / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.bias"][3] += 1
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert verify_folder(out).ok  # structure alone cannot see it
    _one_problem(verify_folder(out, against=TRAINER), "differ from", "transformer.h.1.mlp.c_fc.bias")


@pytest.mark.parametrize("name", ["bf16", "sharded", "pt"])
def test_a_nan_or_inf_weight_fails_verify_without_against(folder, name):
    out = folder(name)
    files = sorted(out.glob("*.safetensors")) or sorted(out.glob("*.bin"))
    if name == "pt":
        tensors = torch.load(files[0], weights_only=True)
        key = next(k for k, t in tensors.items() if t.is_floating_point() and t.numel() > 4)
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[2], tensors[key].view(-1)[3] = float("nan"), float("-inf")
        torch.save(tensors, files[0])
    else:
        tensors = load_file(files[-1])
        key = next(k for k, t in tensors.items() if t.is_floating_point() and t.numel() > 4)
        tensors[key].view(-1)[2], tensors[key].view(-1)[3] = float("nan"), float("-inf")
        save_file(tensors, files[-1], metadata={"format": "pt"})
    report = verify_folder(out)
    _one_problem(report, "NaN or Inf", f"{key} (1 NaN, 1 -Inf)")
    res = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert res.exit_code == 1 and not json.loads(res.stdout)["ok"]
    assert verify_folder(out, check_finite=False).ok  # the caller with its own check (push --allow-nonfinite)


def test_a_sound_folder_is_read_once_for_non_finite_values(made):
    report = verify_folder(made / "bf16")
    assert report.ok and "every weight finite (no NaN or Inf)" in report.checks


def test_another_step_differs(made):
    report = verify_folder(made / "fp32", against=TRAINER, step=1)
    _one_problem(report, "differ from")


def test_truncated_file(folder):
    out = folder("fp32")
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _one_problem(verify_folder(out), "model.safetensors: tensors cover", "truncated")


def test_garbage_header(folder):
    out = folder("fp32")
    (out / "model.safetensors").write_bytes(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 16)
    _one_problem(verify_folder(out), "not valid JSON")
    (out / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    _one_problem(verify_folder(out), "header length")


def test_unknown_dtype_overlap_and_wrong_size(folder):
    out = folder("fp32")
    path = out / "model.safetensors"
    header, data = _header(path)
    header["transformer.wpe.weight"]["dtype"] = "Q7"
    header["transformer.ln_f.bias"]["data_offsets"][0] -= 4
    _write_header(path, header, data)
    _one_problem(verify_folder(out), "unknown dtype code 'Q7'", "transformer.ln_f.bias spans")


def test_metadata_format_must_be_pt(folder):
    out = folder("fp32")
    header, data = _header(out / "model.safetensors")
    header["__metadata__"] = {"format": "tf"}
    _write_header(out / "model.safetensors", header, data)
    _one_problem(verify_folder(out), "metadata format is 'tf'")


def test_zero_size_placeholders_are_refused(folder):
    out = folder("fp32")
    tensors = load_file(out / "model.safetensors")
    tensors["transformer.h.0.attn.c_attn.weight"] = torch.empty(0)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _one_problem(verify_folder(out), "empty placeholder tensors", "transformer.h.0.attn.c_attn.weight [0]")
    shutil.copy(out / "model.safetensors", folder("engine") / "model.safetensors")
    _one_problem(verify_folder(out.parent / "engine"), "empty (0-element) tensors")  # no model: any 0-element tensor


def test_config_dtype_must_match_the_weights(folder):
    out = folder("bf16")
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    _one_problem(verify_folder(out), "config.json says dtype float32, but 28 floating tensors are bfloat16")


def test_wrong_prefix_is_missing_and_unexpected(folder):
    out = folder("fp32")
    tensors = load_file(out / "model.safetensors")
    save_file({f"module.{k}": v for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    _one_problem(
        verify_folder(out),
        "expects keys the folder lacks",
        "does not have",
        "module.transformer.h.0.attn.c_attn.weight",
    )


def test_shape_mismatch(folder):
    out = folder("fp32")
    tensors = load_file(out / "model.safetensors")
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:16].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _one_problem(
        verify_folder(out), "shape mismatch", "transformer.wpe.weight is [16, 16], GPT2LMHeadModel expects [32, 16]"
    )


def test_index_problems(folder):
    out = folder("sharded")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    moved = next(k for k, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][moved] = shards[1]
    del index["metadata"]
    index_path.write_text(json.dumps(index))
    shutil.copy(out / shards[0], out / "model-00009-of-00009.safetensors")
    (out / shards[-1]).unlink()
    _one_problem(
        verify_folder(out),
        f"{shards[-1]} is listed in the index but missing",
        'no "metadata" object',
        f"{moved} -> {shards[1]}",
        "stray shard files",
        "model-00009-of-00009.safetensors",
    )


def test_stale_single_file_shadows_the_index(made, folder):
    out = folder("sharded")
    shutil.copy(made / "fp32" / "model.safetensors", out / "model.safetensors")
    _one_problem(verify_folder(out), "from_pretrained loads model.safetensors and ignores the shards")


def test_no_weights(tmp_path):
    _one_problem(verify_folder(tmp_path), "no weight file")


def test_header_reader_accepts_what_safetensors_writes(made):
    tensors, metadata, problems = read_safetensors_header(made / "bf16" / "model.safetensors")
    assert problems == [] and metadata == {"format": "pt"} and len(tensors) == 28
    assert {t.dtype for t in tensors} == {"bfloat16"}


# --- the command ---


def test_cli_sound_folder_exits_0(made):
    res = run("verify", made / "bf16", "--against", TRAINER)
    assert res.exit_code == 0, res.output
    assert "sound" in res.stdout and "bit-identical" in res.stdout and res.stderr == ""
    data = json.loads(run("verify", made / "bf16", "--json").stdout)
    assert data["ok"] is True and data["problems"] == [] and data["dtype"] == "bfloat16"


def test_cli_problems_one_per_stderr_line_exit_1(folder):
    out = folder("fp32")
    tensors = load_file(out / "model.safetensors")
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"].bfloat16()
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    res = run("verify", out)
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("Error: ") for line in lines), res.stderr
    assert "2 problem(s)" in res.stdout and "Traceback" not in res.output
    res = run("verify", out, "--json")
    data = json.loads(res.stdout)
    assert res.exit_code == 1 and data["ok"] is False and len(data["problems"]) == 2 and res.stderr == ""


def test_cli_usage_and_missing_paths(made, tmp_path):
    res = run("verify", made / "bf16", "--tag", "global_step2")
    assert res.exit_code == 2 and "pass --against" in res.stderr
    res = run("verify", tmp_path / "nope")
    assert res.exit_code == 1 and res.stderr.startswith("Error: ") and "is not a folder" in res.stderr
    res = run("verify", made / "bf16", "--against", tmp_path)
    assert res.exit_code == 1 and "Error: " in res.stderr and "Traceback" not in res.output


def test_base_on_a_model_folder_is_a_usage_error_not_a_note(made):
    res = run("verify", made, "--base", made)
    assert res.exit_code == 2 and "has no adapter_config.json; drop --base" in res.output, res.output

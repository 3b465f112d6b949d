"""The command line: results, JSON, exit codes, and one clear line for every bad input."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttools.cli import main
from ckpttools.io.torchfile import load_pickle
from tests.support.ranks import file_bytes

from .conftest import FIXTURES, fixture_names, tree_digest

ENGINE = fixture_names("engine")
Z3 = next(n for n in ENGINE if n.startswith("z3_dp3"))
Z2 = next(n for n in ENGINE if n.startswith("z2_dp2"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def z3(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / Z3 / "checkpoint", dst)
    return dst


def _tag_dir(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def test_consolidate_json_reports_the_result(tmp_path):
    res = run("consolidate", FIXTURES / Z3 / "checkpoint", "--out", tmp_path / "o", "--json", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (
        data["output_dir"] == str(tmp_path / "o")
        and data["dtype"] == "bfloat16"
        and data["files"] == ["model.safetensors"]
    )
    assert data["source"]["zero_stage"] == 3 and data["source"]["dp_world_size"] == 3


def test_inspect_json_and_text():
    res = run("inspect", FIXTURES / Z2 / "checkpoint", "--json")
    data = json.loads(res.stdout)
    assert res.exit_code == 0 and data["zero_stage"] == 2 and data["num_frozen"] == 2 and data["num_buffers"] == 2
    text = run("inspect", FIXTURES / Z2 / "checkpoint").stdout
    assert "ZeRO-2, DP 2" in text and "head.weight -> emb.weight" in text


def _assert_one_line_error(res, match, code=1):
    assert res.exit_code == code, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    assert match in lines[0], lines[0]
    assert "Traceback" not in res.output


def _break_missing_rank(ckpt):
    (_tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()


def _break_extra_rank(ckpt):
    tag = _tag_dir(ckpt)
    shutil.copy(
        tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"
    )


def _break_world_size(ckpt):
    other = next(n for n in ENGINE if n.startswith("z3_dp2_bf16"))
    src = _tag_dir(FIXTURES / other / "checkpoint") / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(src, _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _break_stage(ckpt):
    other = next(n for n in ENGINE if n.startswith("z2_dp3_bf16"))
    src = _tag_dir(FIXTURES / other / "checkpoint") / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(src, _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _break_truncate(ckpt):
    f = _tag_dir(ckpt) / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _break_tensor_bytes(ckpt):
    f = _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    record = load_pickle(f)["optimizer_state_dict"]["fp32_flat_groups"][0].record
    data = bytearray(f.read_bytes())
    data[record.offset + 5] ^= 0x40
    f.write_bytes(bytes(data))


def _break_pipeline(ckpt):
    """A pipeline layer file among ZeRO-3 rank files: refused as a mix, not read as either."""
    (_tag_dir(ckpt) / "layer_01-model_states.pt").write_bytes(b"")


def _break_moe(ckpt):
    (_tag_dir(ckpt) / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"")


def _break_latest(ckpt):
    (ckpt / "latest").unlink()


def _break_unknown_tag(ckpt):
    (ckpt / "latest").write_text("global_step99")


def _break_escaping_tag(ckpt):
    (ckpt / "latest").write_text("../../etc")


def _break_unsafe_pickle(ckpt):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"optimizer_state_dict": Evil()}, _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


BAD = {
    "missing rank": (_break_missing_rank, "rank 1 missing"),
    "extra rank": (_break_extra_rank, "rank 3 do not belong"),
    "world size disagrees": (_break_world_size, "files from different runs are mixed"),
    "stage disagrees": (_break_stage, "disagree on the ZeRO stage"),
    "truncated file": (_break_truncate, "damaged"),
    "damaged tensor bytes": (_break_tensor_bytes, "fails its CRC-32 check"),
    "pipeline": (_break_pipeline, "into a pipeline checkpoint"),
    "moe": (_break_moe, "MoE"),
    "no latest": (
        _break_latest,
        "no `latest` file naming the tag to read; pass --tag with one of its tags (global_step",
    ),
    "unknown tag": (_break_unknown_tag, "names tag 'global_step99', which has no folder"),
    "escaping tag": (_break_escaping_tag, "not a plain folder name"),
    "unsafe pickle": (_break_unsafe_pickle, "refusing to unpickle"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_gets_one_line_exit_1_and_nothing_written(case, z3, tmp_path):
    breaker, match = BAD[case]
    breaker(z3)
    before = tree_digest(z3)
    out = tmp_path / "out"
    res = run("consolidate", z3, "--out", out)
    _assert_one_line_error(res, match)
    assert tree_digest(z3) == before
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_missing_path_is_a_usage_error_as_a_missing_config_is(tmp_path):
    """Issue 35: a missing PATH exited 1 where a missing --config exits 2; both are click's usage error now."""
    for args in (["consolidate", tmp_path / "nope"], ["inspect", tmp_path / "nope"],
                 ["consolidate", FIXTURES / Z2 / "checkpoint", "--config", tmp_path / "nope"]):  # fmt: skip
        res = run(*args)
        assert res.exit_code == 2 and "does not exist" in res.stderr and "Traceback" not in res.output, res.output


def test_an_out_under_a_file_is_refused_before_any_work_naming_it(z3, tmp_path):
    (tmp_path / "a-file").write_text("mine")
    res = run("consolidate", z3, "--out", tmp_path / "a-file" / "sub" / "model")
    _assert_one_line_error(res, f"{tmp_path / 'a-file'} is not a folder")
    assert "ckpt-staging" not in res.stderr and (tmp_path / "a-file").read_text() == "mine"


def test_existing_output_and_output_inside_input(z3, tmp_path):
    (tmp_path / "out").mkdir()
    _assert_one_line_error(run("consolidate", z3, "--out", tmp_path / "out"), "already exists; pass --overwrite")
    _assert_one_line_error(run("consolidate", z3, "--out", z3 / "hf"), "inside the checkpoint")


def test_too_little_disk_space_is_refused_before_writing(z3, tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")  # noqa: PYI024 - shutil.disk_usage's own type is one
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    _assert_one_line_error(run("consolidate", z3, "--out", tmp_path / "out"), "not enough free disk space")
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(z3):
    res = run("consolidate", z3, "--dtype", "int3")
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_real_process_prints_no_traceback_and_no_progress_in_ci(z3, tmp_path):
    _break_tensor_bytes(z3)
    env = {**os.environ, "CI": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpttools.cli", "consolidate", str(z3), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "CRC-32" in proc.stderr


def test_reshard_cli_json_and_bad_sizes(tmp_path):
    pytest.importorskip("deepspeed")
    res = run("reshard", FIXTURES / Z2 / "checkpoint", "--dp", "3", "--out", tmp_path / "rs", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dp_from"] == 2 and data["dp_to"] == 3 and data["files"][-1] == "latest"
    assert len([f for f in data["files"] if f.startswith(f"{data['tag']}/")]) == 4
    _assert_one_line_error(run("reshard", FIXTURES / Z2 / "checkpoint", "--dp", "0"), "at least 1", code=2)
    same = run("reshard", FIXTURES / Z2 / "checkpoint", "--dp", "2")
    assert same.exit_code == 0 and "already at DP 2" in same.stderr and "Nothing written" in same.stdout


@pytest.mark.parametrize("command", [["consolidate"], ["reshard", "--dp", "3"]])
def test_a_person_at_a_terminal_sees_a_progress_bar_that_ends_at_100_percent(command, tmp_path, monkeypatch):
    monkeypatch.setattr("ckpttools.cli._common.progress_enabled", lambda quiet: not quiet)  # as on a TTY outside CI
    res = run(command[0], FIXTURES / Z2 / "checkpoint", *command[1:], "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    last = res.stderr.split("\r")[-1]
    assert last.startswith(f"{command[0]}: ") and "(100%)" in last and last.endswith("MB/s\n")
    assert (
        "(100%)"
        not in run(command[0], FIXTURES / Z2 / "checkpoint", *command[1:], "--out", tmp_path / "q", "-q").stderr
    )


def test_workers_change_nothing_in_the_output(tmp_path):
    outs = []
    for w in ("1", "3"):
        res = run("consolidate", FIXTURES / Z3 / "checkpoint", "--out", tmp_path / w, "--dtype", "bf16", "--workers", w)
        assert res.exit_code == 0, res.output
        outs.append({p.name: file_bytes(p) for p in sorted((tmp_path / w).iterdir())})
    assert outs[0] == outs[1]
    res = run("consolidate", FIXTURES / Z3 / "checkpoint", "--workers", "0")
    assert res.exit_code == 2 and "--workers" in res.output and "Traceback" not in res.output
    run("inspect", FIXTURES / Z3 / "checkpoint")


@pytest.mark.parametrize("size", ["banana", "0", "-5GB", "5XB"])
def test_a_bad_max_shard_size_is_a_usage_error_naming_the_accepted_forms(size, tmp_path):
    from click.testing import CliRunner

    from ckpttools.cli import main

    result = CliRunner().invoke(
        main, ["consolidate", str(tmp_path), "--max-shard-size", size, "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "5GB, 500MB, 5GiB or a number of bytes" in result.output
    assert not (tmp_path / "o").exists()


def test_sizes_and_dtype_aliases_parse():
    from ckpttools.cli._common import DTYPE, parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("5GiB") == 5 * 2**30 and parse_size("1048576") == 1048576
    assert [DTYPE.convert(d, None, None) for d in ("bfloat16", "float16", "float32", "BF16")] == [
        "bf16",
        "fp16",
        "fp32",
        "bf16",
    ]


# --------------------------------------------------------------------------------------------------
# The boundary: exit codes listed, a missing optional module, a rank lost after publishing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["consolidate", "reshard", "inspect", "verify", "push"])
def test_every_epilog_lists_the_signal_exit_codes(command):
    text = " ".join(run(command, "--help").stdout.split())
    assert "130 SIGINT, 143 SIGTERM, 129 SIGHUP" in text


def test_a_missing_optional_module_names_its_extra(capsys):
    from ckpttools.cli._common import run_guarded

    def body():
        raise ModuleNotFoundError("No module named 'peft'", name="peft")

    code = run_guarded(body, command=lambda: "consolidate")
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("Error: this command needs peft, which is not installed: pip install 'ckpttools[")
    assert len(err.splitlines()) == 1


def test_a_rank_lost_after_publishing_is_a_note_and_exit_0(tmp_path, monkeypatch, capsys):
    from ckpttools.cli._common import _published_despite_lost_rank, run_guarded
    from ckpttools.io import staging
    from ckpttools.ranks.distributed import RankFailedError

    published = []
    monkeypatch.setattr(staging, "published_outputs", lambda: list(published))

    def body(group):
        (tmp_path / "out").mkdir()
        published.append(tmp_path / "out")
        raise RankFailedError(1, 2, "interrupted (SIGKILL)")

    assert run_guarded(lambda: _published_despite_lost_rank(None, body, [])) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"Note: published {tmp_path / 'out'}; the output is complete; rank 1 was lost after (interrupted (SIGKILL))"
    ]

    def before(group):
        raise RankFailedError(1, 2, "bad record")

    assert run_guarded(lambda: _published_despite_lost_rank(None, before, [])) == 1  # nothing new published: a failure
    assert capsys.readouterr().err.splitlines() == ["Error: rank 1 of 2 failed: bad record"]


def test_a_signal_python_wrapped_in_another_error_is_still_an_interrupt(capsys):
    """A signal inside a class body's __set_name__ reaches the boundary as RuntimeError caused by it (seen at
    SIGTERM 112 ms into `ckpt reshard`); a CkptError caused by one keeps its own message (push's commit state)."""
    from ckpttools.cli._common import run_guarded
    from ckpttools.errors import CkptError
    from ckpttools.signals import Interrupted

    def wrapped():
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'attrs' in 'LazyTensor'") from Interrupted(
            15
        )

    assert run_guarded(wrapped) == 143
    assert capsys.readouterr().err.splitlines() == ["Interrupted (SIGTERM); nothing was published."]

    def chosen():
        raise CkptError("interrupted while the Hub committed; the commit may have landed") from Interrupted(15)

    assert run_guarded(chosen) == 1
    assert capsys.readouterr().err.splitlines() == [
        "Error: interrupted while the Hub committed; the commit may have landed"
    ]


# --------------------------------------------------------------------------------------------------
# Issue 35: selections honoured or refused, help naming every input, reshard's files, small wording
# --------------------------------------------------------------------------------------------------

TRAINER = FIXTURES / "trainer_z2_bf16" / "out"
DCP_RUN = FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint"


def _help(*command):
    res = run(*command, "--help")
    assert res.exit_code == 0, res.output
    return " ".join(re.sub(r"-\n\s*", "-", res.stdout).split())  # click wraps lines after a hyphen


def test_help_names_every_input_read_not_only_deepspeed():
    root = _help()
    assert "DeepSpeed ZeRO checkpoints." not in root
    for kind in ("DeepSpeed ZeRO", "universal", "FSDP2 / torch DCP", "Trainer", "accelerate", "Lightning", "s3://",
                 "hf://"):  # fmt: skip
        assert kind in root, kind
    for command in ("consolidate", "inspect"):
        text = _help(command)
        assert "ZeRO checkpoint" not in text.replace("DeepSpeed ZeRO checkpoint", ""), text
        for kind in ("FSDP2 / torch DCP folder", "step-N/", "Trainer checkpoint-N/", "Lightning", "s3://"):
            assert kind in text, (command, kind)
        assert "checkpoint-STEP or step-STEP" in text and "pytorch_model_fsdp_N" in text
        assert "the content of `latest`" not in text
    assert "FSDP2 / torch DCP checkpoints are refused" in _help("reshard")


def test_help_names_the_trainers_whose_names_are_mapped():
    root = _help()
    for kind in ("Megatron-Core torch_dist", "Megatron-DeepSpeed", "torchtitan", "NVMe", "from_pretrained"):
        assert kind in root, kind
    for command in ("consolidate", "inspect"):
        assert "Megatron-Core torch_dist" in _help(command) and "torchtitan" in _help(command), command
    for command in (("verify",), ("push",), ("diff",)):
        text = _help(*command)
        assert "Megatron-Core" in text and "torchtitan" in text, command


def test_errors_an_fsdp2_user_meets_name_what_was_looked_for(tmp_path):
    res = run("inspect", DCP_RUN / "config.json")
    assert res.exit_code == 1 and "the one holding `latest`" not in res.stderr
    assert "torch DCP/FSDP2 folder (`.metadata`" in res.stderr and "DeepSpeed save_dir" in res.stderr, res.stderr
    res = run("inspect", tmp_path)
    assert "is not a DeepSpeed checkpoint" not in res.stderr and "torch DCP/FSDP2" in res.stderr, res.stderr
    plain = FIXTURES / "fsdp2_hf_safetensors" / "reference" / "consolidated"
    res = run("consolidate", plain, "--out", tmp_path / "o")
    assert res.exit_code == 1 and "no sharded checkpoint (no DeepSpeed" in res.stderr, res.stderr
    assert "no torch DCP `.metadata`" in res.stderr and "no DeepSpeed shards" not in res.stderr


def test_a_negative_step_is_a_usage_error_while_parsing():
    """--step -1 said "has no checkpoint--1"."""
    res = run("inspect", TRAINER, "--step", "-1")
    assert res.exit_code == 2 and "checkpoint--1" not in res.output
    assert "Invalid value for '--step'" in res.stderr and "-1 is not in the range x>=0" in res.stderr, res.stderr


def test_a_bad_tag_names_the_tags_there_and_a_step_path_does_not_hold_is_exit_2(tmp_path):
    res = run("inspect", FIXTURES / Z2 / "checkpoint", "--tag", "nope")
    _assert_one_line_error(res, "has no tag folder 'nope'; its tags: global_step2", code=2)
    assert "pass --tag" not in res.stderr
    res = run("consolidate", DCP_RUN / "step-2", "--step", "9", "--out", tmp_path / "o")
    _assert_one_line_error(res, f"pass {DCP_RUN} --step 9, or leave --step out", code=2)
    _assert_one_line_error(run("inspect", DCP_RUN, "--best"), "no trainer_state.json naming a best checkpoint", code=2)
    res = run("inspect", TRAINER, "--best", "--step", "1")
    _assert_one_line_error(res, "--best and --step 1 both choose the checkpoint to read; give one of them", code=2)
    assert not (tmp_path / "o").exists()


def test_verify_against_refuses_a_step_its_checkpoint_is_not(tmp_path):
    made = tmp_path / "m"
    assert run("consolidate", TRAINER / "checkpoint-2", "--out", made, "-q").exit_code == 0
    res = run("verify", made, "--against", TRAINER / "checkpoint-2", "--step", "1")
    _assert_one_line_error(res, "--step 1 cannot apply", code=2)
    assert run("verify", made, "--against", TRAINER, "--step", "2", "-q").exit_code == 0


@pytest.mark.parametrize("target", [["--universal"], ["--dp", "3"], ["--dp", "1"]])
def test_reshard_json_lists_every_file_it_wrote(target, tmp_path):
    """`files` listed the 3 rank files of the 13 written; latest_universal, trainer_state.json, RNG files were left
    out."""
    out = tmp_path / "o"
    res = run("reshard", TRAINER / "checkpoint-2", *target, "--out", out, "--json", "-q")
    assert res.exit_code == 0, res.output
    files = json.loads(res.stdout)["files"]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(files) == [f for f in on_disk if f != ".ckpt-manifest.json"] and len(files) == len(set(files))
    assert {"trainer_state.json", "scheduler.pt", "config.json"} <= set(files)
    assert ("latest_universal" if target == ["--universal"] else "latest") in files
    assert any(f.startswith("rng_state") for f in files)


def test_inspect_prints_the_epoch_rounded_and_keeps_it_whole_in_json(tmp_path):
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(TRAINER / "checkpoint-1", ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["epoch"] = 10 / 11  # what a Trainer records 10 steps into an 11-step epoch
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    text = run("inspect", ckpt).stdout
    assert "epoch 0.91," in text and "0.9090909090909091" not in text, text
    assert json.loads(run("inspect", ckpt, "--json").stdout)["trainer_state"]["epoch"] == 10 / 11

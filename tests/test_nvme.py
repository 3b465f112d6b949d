"""ZeRO-Infinity NVMe-offloaded checkpoints (issue 33) against real DeepSpeed 0.19.8 runs.

The fixtures (fixtures/build/fixture_nvme.py, DP2, bf16, DeepSpeed's CPU Adam through its libaio swapper):
`nvme_z3_dp2_bf16` swapped sub-group 0 (emb + 8 block weights, 265,332 fp32 per rank) to
`offloaded_tensors/rank{00,01}/`; `nvme_z3_dp2_bf16_unswapped` (every sub-group below the 1 MiB threshold) and
`nvme_z2_dp2_bf16` (ZeRO-2: no NVMe swapper, plain CPU offload) keep every byte in the .pt files;
`nvme_z3_dp2_bf16_param` adds offload_param nvme. Their references are the live engine's, right after the save:
`bit16.safetensors` and digests (`full_state.json`) of safe_get_full_fp32_param / safe_get_full_optimizer_state,
and the uninterrupted run's state after one more step (`after_step.json`).

  (i)   read: every fp32 master and optimizer state equals the live engine's bit for bit; `inspect` says what was
        swapped; the false refusals are gone;
  (ii)  consolidate fp32 and bf16, and the drop-ins, equal the engine;
  (iii) a missing or short swap file, or a sub-group split that does not match, is one line naming it;
  (iv)  reshard writes placeholders back as tensors and records CPU offload (slow: DeepSpeed loads it, at DP 2 and
        DP 1, and after one step masters, moments and step equal the uninterrupted NVMe run's);
  (v)   DeepSpeed's own tools on the same checkpoint: zero_to_fp32 and ds_to_universal fail, and its own
        load_checkpoint (slow) returns normally with the state wrong.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpttools import consolidate, reshard
from ckpttools.cli import main
from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.swapfile import aligned_numel
from ckpttools.io.torchfile import RecordReader, load_pickle
from ckpttools.layouts.registry import open_checkpoint, read_checkpoint
from fixtures.build import ds_launch
from fixtures.build.fixture_nvme import digest

from .conftest import FIXTURES

SWAPPED = "nvme_z3_dp2_bf16"
UNSWAPPED = "nvme_z3_dp2_bf16_unswapped"
ZERO2 = "nvme_z2_dp2_bf16"
PARAM = "nvme_z3_dp2_bf16_param"
NAMES = [SWAPPED, UNSWAPPED, ZERO2, PARAM]
WORKER = "fixtures.build.fixture_nvme"
slow = pytest.mark.slow


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


_WRITTEN: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _as_written(tmp_path_factory: pytest.TempPathFactory):
    """The checkpoints as DeepSpeed wrote them: git keeps no empty folder, so the empty ones meta.json lists
    (`offloaded_tensors/rank*/` where nothing was swapped) are recreated in a copy."""
    for name in NAMES:
        tag_dir = FIXTURES / name / "checkpoint" / _meta(name)["tag"]
        missing = [f for f in _meta(name).get("empty_folders", []) if not (tag_dir / f).is_dir()]
        if missing:
            dst = tmp_path_factory.mktemp(name) / "checkpoint"
            shutil.copytree(FIXTURES / name / "checkpoint", dst)
            for folder in missing:
                (dst / _meta(name)["tag"] / folder).mkdir(parents=True)
            _WRITTEN[name] = dst
    yield
    _WRITTEN.clear()


def _ckpt(name: str) -> Path:
    return _WRITTEN.get(name, FIXTURES / name / "checkpoint")


def _tag_dir(name: str) -> Path:
    return _ckpt(name) / _meta(name)["tag"]


def _full_state(name: str) -> dict[str, dict]:
    return json.loads((FIXTURES / name / "reference" / "full_state.json").read_text())


def _read_states(path: Path) -> dict[str, torch.Tensor]:
    """fp32/<n> and <key>/<n> of every trainable param, as ckpttools reads them from the files."""
    ckpt = open_checkpoint(path)
    out = {}
    with RecordReader() as reader:
        for p in ckpt.params:
            out[f"fp32/{p.name}"] = read_tensor(p.fp32, reader)
            for key, src in p.states.items():
                out[f"{key}/{p.name}"] = read_tensor(src, reader)
        reader.finish()
    return out


def _differences(ours: dict[str, torch.Tensor], ref: dict[str, dict]) -> list[str]:
    out = [f"{k} missing" for k in sorted(set(ref) - set(ours))]
    return out + [f"{k} differs" for k in sorted(set(ref) & set(ours)) if digest(ours[k]) != ref[k]]


def _load_output(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    for f in sorted(folder.glob("*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


def _run_cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(res, match: str, code: int = 1) -> str:
    assert res.exit_code == code, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    assert match in lines[0], lines[0]
    assert "Traceback" not in res.output
    return lines[0]


# --- the fixtures are what the issue describes ------------------------------------------------------------------


def test_deepspeed_swapped_exactly_the_big_sub_group():
    swap = _meta(SWAPPED)["swap"]
    assert swap["swap_optimizer"] and swap["sub_group_swapped"] == [True, False, False]
    assert swap["sub_group_numels"][0] * 4 >= 1 << 20 > swap["sub_group_numels"][1] * 4
    ds_id = swap["sub_group_ds_ids"][0]
    for r in (0, 1):
        names = sorted(p.name for p in (_tag_dir(SWAPPED) / "offloaded_tensors" / f"rank{r:02d}").iterdir())
        assert names == sorted(f"{k}{ds_id}.tensor.swp" for k in ("", "exp_avg-", "exp_avg_sq-"))
    assert not _meta(UNSWAPPED)["swap"]["sub_group_swapped"][0]
    assert [list(p.iterdir()) for p in (_tag_dir(UNSWAPPED) / "offloaded_tensors").iterdir()] == [[], []]
    assert not (_tag_dir(ZERO2) / "offloaded_tensors").exists()
    assert _meta(ZERO2)["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"


def test_the_optimizer_files_hold_size_0_placeholders_naming_the_swap_files():
    osd = load_pickle(next(_tag_dir(SWAPPED).glob("*zero_pp_rank_0_*optim_states.pt")))["optimizer_state_dict"]
    ds_id = _meta(SWAPPED)["swap"]["sub_group_ds_ids"][0]
    placeholder = osd["fp32_flat_groups"][0]
    assert placeholder.numel() == 0 and placeholder.attrs["ds_id"] == ds_id
    state = osd["optimizer_state_dict"]["state"][0]
    assert state["exp_avg"].numel() == 0 and state["step"] == _meta(SWAPPED)["global_steps"]


def test_swap_files_are_padded_with_junk_that_is_not_read():
    numel = _meta(SWAPPED)["swap"]["sub_group_numels"][0]
    ds_id = _meta(SWAPPED)["swap"]["sub_group_ds_ids"][0]
    path = _tag_dir(SWAPPED) / "offloaded_tensors" / "rank01" / f"{ds_id}.tensor.swp"
    assert path.stat().st_size == aligned_numel(numel, 4) * 4 > numel * 4
    padding = torch.frombuffer(bytearray(path.read_bytes()[numel * 4 :]), dtype=torch.float32)
    assert len(padding) == aligned_numel(numel, 4) - numel


# --- (i) read ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_master_and_state_reads_bit_identically_to_the_live_engine(name):
    ours = _read_states(_ckpt(name))
    ref = _full_state(name)
    assert set(ours) == set(ref)
    assert _differences(ours, ref) == []


def test_inspect_says_what_was_swapped():
    res = _run_cli("inspect", _ckpt(SWAPPED), "--json")
    assert res.exit_code == 0, res.output
    facts = json.loads(res.stdout)["parallel"]["nvme_offload"]
    swap = _meta(SWAPPED)["swap"]
    ds_id = swap["sub_group_ds_ids"][0]
    assert facts["sub_groups"] == 3 and facts["swap_threshold_bytes"] == 1 << 20
    assert facts["swapped"] == [{
        "sub_group": 0, "ds_id": ds_id, "numel_per_rank": swap["sub_group_numels"][0],
        "bytes_per_rank": swap["sub_group_numels"][0] * 4,
        "files": [f"{ds_id}.tensor.swp", f"exp_avg-{ds_id}.tensor.swp", f"exp_avg_sq-{ds_id}.tensor.swp"],
    }]  # fmt: skip
    text = _run_cli("inspect", _ckpt(SWAPPED)).output
    assert "NVMe offload: 1 of 3 sub-groups swapped" in text and f"{swap['sub_group_numels'][0]:,} fp32" in text


@pytest.mark.parametrize(("name", "says"), [(UNSWAPPED, "no sub-group reached"), (ZERO2, "no NVMe swapper")])
def test_inspect_says_where_nothing_was_swapped(name, says):
    res = _run_cli("inspect", _ckpt(name))
    assert res.exit_code == 0, res.output
    assert says in res.output


# --- (ii) consolidate and the drop-ins ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_fp32_and_bf16_equal_the_live_engine(name, tmp_path):
    fp32_ref = {k.removeprefix("fp32/"): v for k, v in _full_state(name).items() if k.startswith("fp32/")}
    consolidate(_ckpt(name), tmp_path / "fp32", dtype="fp32")
    ours = _load_output(tmp_path / "fp32")
    assert set(ours) == set(fp32_ref)
    assert [k for k in fp32_ref if digest(ours[k]) != fp32_ref[k]] == []
    consolidate(_ckpt(name), tmp_path / "bf16", dtype="bf16")
    bf16 = _load_output(tmp_path / "bf16")
    ref16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    assert set(bf16) == set(ref16)
    assert [k for k in ref16 if bf16[k].dtype != ref16[k].dtype or not torch.equal(bf16[k], ref16[k])] == []


DROP_INS = [("zero_to_fp32", ["--safe_serialization"]), ("zero_to_fp32", []), ("zero_to_torch", ["--dtype", "fp32"]),
            ("zero_to_torch", ["--dtype", "bf16", "--safe_serialization"])]  # fmt: skip


@pytest.mark.parametrize(("module", "args"), DROP_INS)
def test_the_drop_ins_read_what_deepspeeds_scripts_cannot(module, args, tmp_path):
    """DeepSpeed's zero_to_fp32 and zero_to_torch stop with `consumed ... numels`; ours write the whole model."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", f"ckpttools.{module}", str(_ckpt(SWAPPED)), str(out), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ours = _load_output(out)
    if "bf16" in args:
        ref16 = load_file(FIXTURES / SWAPPED / "reference" / "bit16.safetensors")
        assert set(ours) == set(ref16)
        assert [k for k in ref16 if ours[k].dtype != ref16[k].dtype or not torch.equal(ours[k], ref16[k])] == []
        return
    fp32_ref = {k.removeprefix("fp32/"): v for k, v in _full_state(SWAPPED).items() if k.startswith("fp32/")}
    assert set(ours) == set(fp32_ref)
    assert [k for k in fp32_ref if digest(ours[k]) != fp32_ref[k]] == []


# --- (iii) damage is one line naming it ----------------------------------------------------------------------------


@pytest.fixture
def swapped_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(_ckpt(SWAPPED), dst)
    return dst


def _swap_file(ckpt: Path, rank: int, prefix: str = "") -> Path:
    ds_id = _meta(SWAPPED)["swap"]["sub_group_ds_ids"][0]
    return ckpt / _meta(SWAPPED)["tag"] / "offloaded_tensors" / f"rank{rank:02d}" / f"{prefix}{ds_id}.tensor.swp"


def test_a_missing_swap_file_is_one_line_naming_it_and_nothing_is_written(swapped_copy, tmp_path):
    gone = _swap_file(swapped_copy, 1, "exp_avg_sq-")
    gone.unlink()
    line = _one_line_error(_run_cli("consolidate", swapped_copy, "--out", tmp_path / "out"), "is missing")
    assert str(gone) in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointNotFoundError, match="is missing"):
        read_checkpoint(swapped_copy)


def test_a_short_swap_file_is_one_line_naming_it(swapped_copy, tmp_path):
    short_file = _swap_file(swapped_copy, 0)
    numel = _meta(SWAPPED)["swap"]["sub_group_numels"][0]
    with open(short_file, "r+b") as fh:
        fh.truncate(numel * 4 - 4)
    line = _one_line_error(_run_cli("reshard", swapped_copy, "--dp", 1, "--out", tmp_path / "out"), "is short")
    assert str(short_file) in line
    assert not (tmp_path / "out").exists()


def test_a_swap_file_of_another_size_is_refused(swapped_copy):
    """A longer file is not this sub-group's (another run's, another DP's): its size is checked exactly."""
    f = _swap_file(swapped_copy, 0, "exp_avg-")
    with open(f, "ab") as fh:
        fh.write(b"\0" * 1024)
    with pytest.raises(CorruptCheckpointError, match="is not the size of this tensor"):
        read_checkpoint(swapped_copy)


def test_a_sub_group_split_that_sub_group_size_does_not_make_is_refused(swapped_copy):
    """param_shapes' sub-groups must be the split sub_group_size makes, or the swap files' members are unknown."""
    from ckpttools.io.torchwriter import write_torch_files

    edited = []
    for f in sorted(_tag_dir(SWAPPED).glob("*.pt")):  # read from the fixture, written over the copy
        obj = load_pickle(f)
        obj["ds_config"]["zero_optimization"]["sub_group_size"] = 100_000
        edited.append((swapped_copy / _meta(SWAPPED)["tag"] / f.name, obj))
    with RecordReader() as reader:
        write_torch_files(edited, reader)
    with pytest.raises(CorruptCheckpointError, match="sub_group_size 100000 splits them"):
        read_checkpoint(swapped_copy)


# --- (iv) reshard ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dp", "stage"), [(1, None), (2, None), (3, None), (1, 2)])
def test_reshard_writes_every_byte_into_the_rank_files_and_records_cpu_offload(dp, stage, tmp_path):
    out = tmp_path / f"dp{dp}"
    result = reshard(_ckpt(SWAPPED), out, dp=dp, stage=stage)
    tag_dir = out / _meta(SWAPPED)["tag"]
    assert not (tag_dir / "offloaded_tensors").exists()
    for f in tag_dir.glob("*.pt"):
        offload = load_pickle(f)["ds_config"]["zero_optimization"]["offload_optimizer"]
        assert offload == {"device": "cpu", "pin_memory": False}
    assert _differences(_read_states(out), _full_state(SWAPPED)) == []
    assert any('offload_optimizer {"device": "cpu"}' in n for n in result.notes), result.notes


def test_an_empty_offloaded_tensors_folder_beside_complete_files_is_read(tmp_path):
    """The false refusal of ckpttools 0.x: such a folder (a run where nothing reached the threshold) is read."""
    res = _run_cli("consolidate", _ckpt(UNSWAPPED), "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert (_ckpt(UNSWAPPED) / _meta(UNSWAPPED)["tag"] / "offloaded_tensors" / "rank00").is_dir()


def test_reshard_universal_holds_every_state(tmp_path):
    out = tmp_path / "u"
    reshard(_ckpt(SWAPPED), out, universal=True)
    assert _differences(_read_states(out), _full_state(SWAPPED)) == []


# --- (v) DeepSpeed's own tools --------------------------------------------------------------------------------


def test_deepspeeds_converters_fail_where_sub_groups_were_swapped(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(ValueError, match=r"consumed \d+ numels out of \d+ - something is wrong"):
        get_fp32_state_dict_from_zero_checkpoint(str(_ckpt(SWAPPED)))
    assert "consumed" in _meta(SWAPPED)["zero_to_fp32"]["error"]
    assert _meta(UNSWAPPED)["zero_to_fp32"]["ok"] and _meta(ZERO2)["zero_to_fp32"]["ok"]


def test_deepspeeds_ds_to_universal_fails_and_ours_writes_every_state(tmp_path):
    tag = _meta(SWAPPED)["tag"]
    theirs = tmp_path / "theirs" / tag
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(_tag_dir(SWAPPED)),
           "--output_folder", str(theirs), "--inject_missing_state"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ds_launch.worker_env())
    assert run.returncode != 0 and "exceeds dimension size (0)" in run.stderr, run.stderr[-2000:]
    ours = tmp_path / "ours" / tag
    cmd = [sys.executable, "-m", "ckpttools.ds_to_universal", "--input_folder", str(_tag_dir(SWAPPED)),
           "--output_folder", str(ours)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert _differences(_read_states(ours.parent), _full_state(SWAPPED)) == []


def _resume(name: str, ckpt: Path, dp: int, tmp_path: Path, offload: str = "cpu", universal: bool = False):
    """Load `ckpt` in the fixture's engine at `dp` ranks with offload_optimizer `offload` (fixture_nvme `resume`),
    compare with the references before and after one more step: (rc, per-rank facts, output tail)."""
    info = tmp_path / "info"
    args = ["resume", "--fixture", name, "--fixtures", FIXTURES, "--ckpt", ckpt, "--out", info, "--offload", offload,
            *(["--universal"] if universal else [])]  # fmt: skip
    run = ds_launch.torchrun(dp, WORKER, args, cwd=tmp_path, timeout=900)
    facts = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("info.*.json"))]
    return run.rc, facts, run.tail()


def _wrong(facts: dict, key: str) -> list[str]:
    return sorted(k for k, same in facts[key].items() if not same)


@slow
@pytest.mark.parametrize(("dp", "offload", "universal"), [(2, "cpu", False), (2, "none", False), (1, "cpu", False),
                                                          (2, "cpu", True), (1, "cpu", True)])  # fmt: skip
def test_deepspeed_resumes_the_resharded_checkpoint_exactly(dp, offload, universal, tmp_path):
    """Masters, both moments and the step equal the engine's at the save; at the same DP, after one more step they
    equal the uninterrupted NVMe run's bit for bit (at another DP the step's reductions are summed in another
    order, so only the loaded state is compared). Loaded as universal, the step is exact except for the no-decay
    group's masters: DeepSpeed's `load_hp_checkpoint_state_from_checkpoint_dir_stage3` copies param_groups[0]'s
    hyper-parameters into every group ("Generally, the hyperparameters of each parameter should be the same"), so
    weight_decay 0.01 hits the biases and norms; DeepSpeed's own ds_to_universal output does the same."""
    out = tmp_path / "out"
    reshard(_ckpt(SWAPPED), out, **({"universal": True} if universal else {"dp": dp}))
    rc, facts, tail = _resume(SWAPPED, out, dp, tmp_path, offload, universal)
    assert rc == 0, tail
    oracle = json.loads((FIXTURES / SWAPPED / "reference" / "after_step.json").read_text())
    assert len(facts) == dp
    for f in facts:
        assert f["loaded"] and f["global_steps_after_load"] == _meta(SWAPPED)["global_steps"], tail
        assert f["optimizer_steps_after_load"] == _meta(SWAPPED)["optimizer_steps_at_save"]
        assert _wrong(f, "equal_after_load") == [], f"rank {f['rank']}"
        assert f["global_steps_after_step"] == oracle["global_steps"]
        assert f["optimizer_steps_after_step"] == oracle["optimizer_steps"]
        if dp != _meta(SWAPPED)["dp"]:
            continue
        assert f["rank"] != 0 or f["loss"] == oracle["loss"]  # the oracle's loss is rank 0's
        if universal:  # DeepSpeed's ZeRO-3 universal load gives every param group group 0's hyper-parameters
            no_decay = sorted(f"fp32/{n}" for n in _meta(SWAPPED)["param_groups"][1])
            assert _wrong(f, "equal_after_step") == no_decay, f"rank {f['rank']}"
        else:
            assert _wrong(f, "equal_after_step") == [], f"rank {f['rank']}"


# NVMe runs no committed fixture holds (7.8 MB each), built by the slow test: spec changes, and the sub-groups read
# from swap files / saved whole in the .pt files
VARIANTS = {
    # sub-groups cut at DP 1: emb + 4 weights swapped (0_7); the next 4 weights hold 1,040,400 bytes, just under
    # the 1 MiB threshold, and stay in the .pt files
    "dp1": ({"world_size": 1, "dp": 1}, [0], []),
    "intra_op2": ({"aio": {"intra_op_parallelism": 2}}, [0], []),  # swap files padded to 2048 bytes
    # the pipelined swapper holds the sub-group at the save: the .pt files hold it whole (the swap files equal it)
    "pipelined": ({"swapper": {"pipeline_read": True, "pipeline_write": True}}, [], [0]),
}


@slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nvme_runs_no_fixture_holds_read_bit_identically(variant, tmp_path, monkeypatch):
    if not _libaio():
        pytest.skip("DeepSpeed's async_io op needs libaio (apt-get install -y libaio-dev) to run an NVMe engine")
    from fixtures.build import fixture_nvme, make_fixtures

    name = f"nvme_{variant}"
    changes, swapped, saved_whole = VARIANTS[variant]
    spec = {**fixture_nvme.spec_of(SWAPPED), **changes, "name": name, "worker": WORKER}
    monkeypatch.setitem(make_fixtures.SPECS, name, spec)
    folder = make_fixtures.make_fixture(name, tmp_path)
    ref = json.loads((folder / "reference" / "full_state.json").read_text())
    assert _differences(_read_states(folder / "checkpoint"), ref) == []
    facts = read_checkpoint(folder / "checkpoint").layout.details["nvme_offload"]
    assert [e["sub_group"] for e in facts["swapped"]] == swapped and facts["saved_whole"] == saved_whole
    consolidate(folder / "checkpoint", tmp_path / "bf16", dtype="bf16")
    ours, ref16 = _load_output(tmp_path / "bf16"), load_file(folder / "reference" / "bit16.safetensors")
    assert set(ours) == set(ref16) and all(torch.equal(ours[k], ref16[k]) for k in ref16)


def _libaio() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


@slow
@pytest.mark.parametrize("dp", [2, 1])
def test_deepspeeds_own_resume_of_the_nvme_checkpoint_is_silently_wrong(dp, tmp_path):
    """What docs/resharding.md quotes: DeepSpeed's load_checkpoint with the run's own NVMe config returns normally,
    never reads the optimizer files (`_load_zero_checkpoint` is skipped when the optimizer swaps), only copies
    offloaded_tensors/rank{NN}/ back into its swap folder, and restores no Adam state and no step."""
    if not _libaio():
        pytest.skip("DeepSpeed's async_io op needs libaio (apt-get install -y libaio-dev) to run an NVMe engine")
    rc, facts, tail = _resume(SWAPPED, _ckpt(SWAPPED), dp, tmp_path, offload="nvme")
    assert rc == 0, tail
    # at the same DP only the swapped sub-group's masters come back (from the copied swap files); at DP 1 the
    # sub-groups are cut differently and none does
    swapped = sorted(f"fp32/{n}" for n in _meta(SWAPPED)["sub_groups"][0]) if dp == 2 else []
    for f in facts:
        assert f["loaded"] and f["global_steps_after_load"] == 3
        assert all(keys == [] for keys in f["held_state_keys_after_load"])  # no Adam state, no step, anywhere
        assert sorted(k for k, same in f["equal_after_load"].items() if same) == swapped
        assert f["optimizer_steps_after_step"] == [1] and f["global_steps_after_step"] == 4
        assert not any(f["equal_after_step"].values())

"""Stage-0 (no ZeRO) DeepSpeed checkpoints: `ckpttools.layouts.zero0` against the real fixtures z0_*.

The optimizer lives in `mp_rank_00_model_states.pt["optimizer"]`; the reader must find every trained param's fp32
master and Adam states there (bit-identical to what the live engine held: reference/full_state.safetensors), and
consolidation must give the engine's fp32 masters and 16-bit module (reference/bit16.safetensors). The `slow` test
rewrites each checkpoint for other DP sizes and loads it with DeepSpeed's own `load_checkpoint`
(tests/support/zero0_load_worker.py).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError, UsageError
from ckpttools.io.torchfile import LazyTensor, RecordReader, load_pickle
from ckpttools.io.torchwriter import write_torch_file, write_torch_files
from ckpttools.layouts.registry import locate, read_checkpoint
from ckpttools.layouts.zero0 import (
    MODEL_FILE,
    _Ambiguous,
    _assign,
    _NoFit,
    check_zero0_reshard,
    read_zero0,
    zero0_rank_files,
)
from ckpttools.model.origin import CheckpointLocation
from ckpttools.ops.consolidate import consolidate

from .conftest import FIXTURES, fixture_meta, tree_digest

ZERO0 = ["z0_dp2_bf16", "z0_dp2_bf16_client", "z0_dp2_fp32", "z0_dp2_fp32_client"]
KINDS = {
    "z0_dp2_bf16": "fp16_optimizer",
    "z0_dp2_bf16_client": "fp16_unfused_optimizer",
    "z0_dp2_fp32": "torch",
    "z0_dp2_fp32_client": "torch",
}
consolidate_module = importlib.import_module("ckpttools.ops.consolidate")
ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.zero0_load_worker"


def present(names: list[str]) -> list[Any]:
    return [n if (FIXTURES / n / "meta.json").is_file() else pytest.param(n, marks=pytest.mark.skip("not built"))
            for n in names]  # fmt: skip


def location(root: Path) -> CheckpointLocation:
    loc = locate(root)
    assert loc.files.layout == "zero0"
    return loc


def checkpoint_root(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


@pytest.fixture
def open_zero0() -> None:
    """consolidate() opens stage-0 folders through sources.open_checkpoint, like every other layout."""


# --- reading --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", present(ZERO0))
def test_reader_finds_every_param_where_the_engine_had_it(name: str) -> None:
    meta = fixture_meta(name)
    ckpt = read_zero0(location(checkpoint_root(name)))
    assert (ckpt.zero_stage, ckpt.dp_world_size, ckpt.global_steps) == (0, 2, 2)
    assert ckpt.optimizer_kind == KINDS[name]
    assert ckpt.train_dtype.name == ("bfloat16" if meta["dtype"] == "bf16" else "float32")
    assert [[p.name for p in ckpt.params if p.group == g] for g in range(2)] == meta["param_groups"]
    assert ckpt.frozen_names == meta["frozen"]
    assert ckpt.shared_params == meta["tied"]
    assert sorted(ckpt.buffers) == sorted(meta["buffers"])
    assert ckpt.state_keys == meta["reference_state_keys"]
    ref = load_file(str(FIXTURES / name / "reference" / "full_state.safetensors"))
    with RecordReader() as reader:
        for p in ckpt.params:
            for key, src in {"fp32": p.fp32, **p.states}.items():
                assert torch.equal(read_source(src, reader), ref[f"{key}/{p.name}"]), f"{key}/{p.name}"
        reader.finish()


def test_fused_adam_counts_its_step_in_the_last_param_of_each_group() -> None:
    """DeepSpeed's FusedAdam without a wrapper (fp32) bumps state['step'] of each group's last param only."""
    name = "z0_dp2_fp32"
    if not (FIXTURES / name).is_dir():
        pytest.skip("not built")
    assert fixture_meta(name)["inner_state_steps"] == {"0": "0", "1": "0", "2": "2", "3": "0", "4": "0", "5": "0",
                                                       "6": "2"}  # fmt: skip
    ckpt = read_zero0(location(checkpoint_root(name)))
    assert ckpt.optimizer.group_scalars == [{"step": 2}, {"step": 2}]


def read_source(src: Any, reader: RecordReader) -> torch.Tensor:
    parts = [seg.tensor.load(reader).reshape(-1)[seg.start : seg.start + seg.count] for seg in src.segments]
    return torch.cat(parts).view(src.shape)


# --- consolidating --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", present(ZERO0))
def test_consolidate_fp32_is_the_engines_fp32_masters(name: str, tmp_path: Path, open_zero0: None) -> None:
    before = tree_digest(checkpoint_root(name))
    out = tmp_path / "fp32"
    consolidate(checkpoint_root(name), out, dtype="fp32")
    got = load_file(str(out / "model.safetensors"))
    full = load_file(str(FIXTURES / name / "reference" / "full_state.safetensors"))
    bit16 = load_file(str(FIXTURES / name / "reference" / "bit16.safetensors"))
    meta = fixture_meta(name)
    assert set(got) == set(meta["state_dict_keys"])  # no config.json: a tied alias stays a tensor of its own
    for key in meta["state_dict_keys"]:
        want = full.get(f"fp32/{meta['tied'].get(key, key)}")
        if want is None:  # frozen params and buffers: the module's, floating ones as fp32
            want = bit16[key].float() if bit16[key].is_floating_point() else bit16[key]
        assert torch.equal(got[key], want), key
    assert tree_digest(checkpoint_root(name)) == before


@pytest.mark.parametrize("name", present(["z0_dp2_bf16", "z0_dp2_bf16_client"]))
def test_consolidate_bf16_is_the_engines_module(name: str, tmp_path: Path, open_zero0: None) -> None:
    out = tmp_path / "bf16"
    consolidate(checkpoint_root(name), out, dtype="bf16")
    got = load_file(str(out / "model.safetensors"))
    bit16 = load_file(str(FIXTURES / name / "reference" / "bit16.safetensors"))
    assert set(got) == set(bit16)
    for key, value in got.items():
        assert torch.equal(value, bit16[key]), key


# --- damaged inputs -------------------------------------------------------------------------------------------


def damaged(name: str, tmp_path: Path, change: Any) -> CheckpointLocation:
    """A copy of the fixture's checkpoint whose model-states pickle went through `change` (written by torchwriter)."""
    src = checkpoint_root(name)
    root = tmp_path / "ckpt"
    tag = (src / "latest").read_text().strip()
    (root / tag).mkdir(parents=True)
    (root / "latest").write_text(tag)
    obj = load_pickle(src / tag / MODEL_FILE)
    change(obj)
    with RecordReader() as reader:
        write_torch_file(root / tag / MODEL_FILE, obj, reader)
    return location(root)


def shorter(t: LazyTensor, by: int = 1) -> LazyTensor:
    n = t.numel() - by
    return dataclasses.replace(t, shape=(n,), stride=(1,))


def _no_optimizer_key(o: dict) -> None:
    del o["optimizer"]


def _no_optimizer(o: dict) -> None:
    o["optimizer"] = None


def _short_master(o: dict) -> None:
    o["optimizer"]["fp32_groups_flat"][1] = shorter(o["optimizer"]["fp32_groups_flat"][1])


def _short_moment(o: dict) -> None:
    st = o["optimizer"]["optimizer_state_dict"]["state"][0]
    st["exp_avg"] = shorter(st["exp_avg"])


def _step_differs(o: dict) -> None:
    o["optimizer"]["state"][1]["step"] = 7


def _reshaped_moment(o: dict) -> None:
    st = o["optimizer"]["state"][3]
    st["exp_avg"] = dataclasses.replace(st["exp_avg"], shape=(2, 4), stride=(4, 1))


def _zero_stage_1(o: dict) -> None:
    o["ds_config"]["zero_optimization"]["stage"] = 1


def _unknown_wrapper(o: dict) -> None:
    o["optimizer"] = {"something": 1}


@pytest.mark.parametrize(
    ("name", "change", "error", "words"),
    [
        ("z0_dp2_bf16", _no_optimizer_key, CorruptCheckpointError, "lacks 'optimizer'"),
        ("z0_dp2_bf16", _no_optimizer, UnsupportedCheckpointError, "holds no optimizer state"),
        ("z0_dp2_bf16", _short_master, UnsupportedCheckpointError, "do not fit the module's params"),
        ("z0_dp2_bf16", _short_moment, CorruptCheckpointError, "'exp_avg' of param group 0 holds 371 elements"),
        ("z0_dp2_fp32_client", _step_differs, CorruptCheckpointError, "optimizer param 1 is at step"),
        ("z0_dp2_fp32", _reshaped_moment, UnsupportedCheckpointError, "do not fit the module's params"),
        ("z0_dp2_fp32", _zero_stage_1, CorruptCheckpointError, "ZeRO stage 1"),
        ("z0_dp2_fp32", _unknown_wrapper, UnsupportedCheckpointError, "no optimizer wrapper"),
    ],
)
def test_damaged_checkpoint_gives_one_clear_error(
    name: str, change: Any, error: type, words: str, tmp_path: Path
) -> None:
    if not (FIXTURES / name).is_dir():
        pytest.skip("not built")
    loc = damaged(name, tmp_path, change)
    with pytest.raises(error) as e:
        read_zero0(loc)
    message = str(e.value)
    assert words in message
    assert MODEL_FILE in message
    assert "\n" not in message


def test_an_unchanged_copy_reads_the_same(tmp_path: Path) -> None:
    """The damage tests' copying itself changes nothing (so their errors come from the change alone)."""
    if not (FIXTURES / "z0_dp2_bf16").is_dir():
        pytest.skip("not built")
    ckpt = read_zero0(damaged("z0_dp2_bf16", tmp_path, lambda o: None))
    assert [p.name for p in ckpt.params] == [n for g in fixture_meta("z0_dp2_bf16")["param_groups"] for n in g]


# --- matching module params to optimizer entries ----------------------------------------------------------------


def test_assign_finds_the_one_way_the_groups_fit() -> None:
    sizes = {"a": 3, "b": 2, "c": 2, "d": 5}

    def fit(name: str, g: int, pos: int) -> int | None:  # flat groups of 5 and 4 elements
        end = pos + sizes[name]
        return end if end <= (5, 4)[g] else None

    assert _assign(["a", "b", "c", "d"], [5, 4], fit) == [None, 1, 1, 0]  # a must stay out: frozen


def test_assign_refuses_two_ways_and_no_way() -> None:
    def any_slot(name: str, g: int, pos: int) -> int | None:
        return pos + 1 if pos < 1 else None

    with pytest.raises(_Ambiguous):
        _assign(["x", "y", "z"], [1, 1], any_slot)  # two of three params, either two
    with pytest.raises(_NoFit):
        _assign(["x"], [1, 1], any_slot)


def test_reshard_refuses_universal_and_stage_changes_of_stage0() -> None:
    if not (FIXTURES / "z0_dp2_bf16").is_dir():
        pytest.skip("not built")
    ckpt = read_zero0(location(checkpoint_root("z0_dp2_bf16")))
    with pytest.raises(UsageError, match="cannot load as a universal checkpoint"):
        check_zero0_reshard(ckpt, universal=True, stage=None)
    with pytest.raises(UnsupportedCheckpointError, match="changing it to ZeRO-2"):
        check_zero0_reshard(ckpt, universal=False, stage=2)
    check_zero0_reshard(ckpt, universal=False, stage=None)


# --- resharding: DeepSpeed's own load_checkpoint at other DP sizes ---------------------------------------------


def write_resharded(name: str, dp: int, out: Path) -> Path:
    ckpt = read_zero0(location(checkpoint_root(name)))
    tag_dir = out / ckpt.location.tag
    tag_dir.mkdir(parents=True)
    files = zero0_rank_files(ckpt, dp)
    with RecordReader() as reader:
        write_torch_files([(tag_dir / n, obj) for n, obj in files.items()], reader)
        reader.finish()
    (out / "latest").write_text(ckpt.location.tag)
    return out


def test_resharded_file_differs_only_in_dp_world_size(tmp_path: Path) -> None:
    if not (FIXTURES / "z0_dp2_bf16").is_dir():
        pytest.skip("not built")
    out = write_resharded("z0_dp2_bf16", 3, tmp_path / "dp3")
    tag = (out / "latest").read_text()
    new = torch.load(out / tag / MODEL_FILE, weights_only=False)
    old = torch.load(checkpoint_root("z0_dp2_bf16") / tag / MODEL_FILE, weights_only=False)
    assert new.pop("dp_world_size") == 3
    assert old.pop("dp_world_size") == 2
    assert_same(new, old)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 3])
def test_deepspeed_loads_the_resharded_checkpoint(dp: int, tmp_path: Path) -> None:
    """One torchrun per DP size loads every resharded fixture with engine.load_checkpoint (stage 0), dumps the
    masters and optimizer states it holds (bit-identical to the saving engine's) and trains one more step."""
    from fixtures.build import ds_launch

    names = [n for n in ZERO0 if (FIXTURES / n).is_dir()]
    jobs = []
    for name in names:
        ckpt = write_resharded(name, dp, tmp_path / name)
        jobs.append(
            {"meta": str(FIXTURES / name / "meta.json"), "load": str(ckpt), "out": str(tmp_path / f"{name}.json")}
        )
    run = ds_launch.torchrun(dp, WORKER, ["--jobs", json.dumps(jobs)], cwd=tmp_path, timeout=900)
    assert run.rc == 0, run.tail()
    for name, job in zip(names, jobs, strict=True):
        result = json.loads(Path(job["out"]).read_text())
        assert (result["loaded_dp"], result["checkpoint_dp_world_size"]) == (dp, dp), name
        assert result["mismatches"] == [], name
        assert result["compared"] > 0, name
        assert result["module_equal"], name
        assert (result["global_steps"], result["steps_after"]) == (2, 3), name


# --- Lightning DeepSpeedStrategy folders (built on a GPU: Lightning refuses DeepSpeed on CPU) -----------------

LIGHTNING = ["lightning_z2_bf16", "lightning_z3_bf16"]


@pytest.mark.parametrize("name", present(LIGHTNING))
def test_lightning_folder_consolidates_to_lightnings_own_converter_output(name: str, tmp_path: Path) -> None:
    """`epoch=0-step=2.ckpt/` holds `latest` ("checkpoint") and the tag folder `checkpoint/`; keys are the
    LightningModule's (`model.`), without `_forward_module.` (Lightning >= 2.1 saves none)."""
    meta = fixture_meta(name)
    folder = FIXTURES / name / meta["checkpoint"]
    assert (folder / "latest").read_text() == "checkpoint"
    out = tmp_path / "fp32"
    consolidate(folder, out, dtype="fp32")
    got = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(FIXTURES / name / "reference" / "lightning_converter.safetensors"))
    full = load_file(str(FIXTURES / name / "reference" / "full_state.safetensors"))
    assert set(got) == set(theirs)
    for key, value in theirs.items():
        # Lightning keeps what DeepSpeed's get_fp32_state_dict_from_zero_checkpoint returns: frozen params in bf16
        assert torch.equal(got[key], value.to(got[key].dtype)), key
        if f"fp32/{key}" in full:
            assert torch.equal(got[key], full[f"fp32/{key}"]), key
    assert {k for k, v in theirs.items() if v.is_floating_point() and v.dtype != torch.float32} == set(meta["frozen"])


@pytest.mark.parametrize("name", present(LIGHTNING))
def test_lightning_folder_bf16_is_the_engines_module(name: str, tmp_path: Path) -> None:
    folder = FIXTURES / name / fixture_meta(name)["checkpoint"]
    consolidate(folder, tmp_path / "bf16", dtype="bf16")
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    bit16 = load_file(str(FIXTURES / name / "reference" / "bit16.safetensors"))
    assert set(got) == set(bit16)
    for key, value in bit16.items():
        assert torch.equal(got[key], value), key


def test_lightning_extras_holding_objects_are_refused_by_name(tmp_path: Path) -> None:
    """Lightning merges its own state (hyper_parameters, callbacks, loops) into the model-states pickle; plain
    values read fine, anything else (here a collections.Counter among the hyper-parameters) is refused unloaded."""
    name = "lightning_z2_bf16"
    if not (FIXTURES / name).is_dir():
        pytest.skip("not built")
    folder = tmp_path / "epoch=0-step=2.ckpt"
    shutil.copytree(FIXTURES / name / fixture_meta(name)["checkpoint"], folder)
    path = folder / "checkpoint" / MODEL_FILE
    obj = torch.load(path, weights_only=False, map_location="cpu")  # saved on the GPU
    obj["hyper_parameters"]["counter"] = collections.Counter(a=1)
    torch.save(obj, path)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to unpickle 'collections\.Counter'"):
        read_checkpoint(folder)


def test_cli_consolidates_and_reshards_stage0(tmp_path: Path) -> None:
    """Through the one entry every command uses (no reader picked by hand)."""
    from click.testing import CliRunner

    from ckpttools.cli import main
    from ckpttools.layouts.registry import open_checkpoint

    src = checkpoint_root("z0_dp2_bf16")
    runner = CliRunner()
    res = runner.invoke(main, ["consolidate", str(src), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    res = runner.invoke(main, ["reshard", str(src), "--dp", "3", "--out", str(tmp_path / "dp3")])
    assert res.exit_code == 0, res.output
    assert open_checkpoint(tmp_path / "dp3").dp_world_size == 3
    res = runner.invoke(main, ["reshard", str(src), "--universal", "--out", str(tmp_path / "u")])
    assert res.exit_code != 0 and "without ZeRO" in res.output and not (tmp_path / "u").exists()

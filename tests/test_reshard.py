"""Resharding without DeepSpeed processes: layout equal to DeepSpeed's own at the new size, values carried exactly.

tests/test_reshard_deepspeed.py loads the results in real multi-process DeepSpeed.
"""

import pickletools
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.errors import OutputError, UsageError
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.zero.write import split_subgroups
from ckpttools.ops.reshard import reshard

from .conftest import FIXTURES, fixture_names, tree_digest

pytest.importorskip("deepspeed")
CASES = [("z1_dp2_fp32", 3), ("z2_dp2_bf16", 1), ("z3_dp3_fp32", 2), ("z3_dp1_bf16", 4), ("z2_dp4_fp32", 2),
         ("z1_dp2_bf16_bf16opt", 3), ("z2_dp2_bf16_elastic", 1), ("gpu/gpu_z3_dp1_fp16_overflow", 3),
         ("gpu/gpu_z2_dp1_fp16", 2)]  # fmt: skip


def _src(name):
    out = FIXTURES / name / "out"
    return max(out.glob("checkpoint-*")) if out.exists() else FIXTURES / name / "checkpoint"


@pytest.mark.parametrize("name,dp", CASES)
def test_consolidating_the_resharded_checkpoint_gives_identical_weights(name, dp, tmp_path):
    before = tree_digest(_src(name))
    result = reshard(_src(name), tmp_path / "rs", dp=dp)
    assert tree_digest(_src(name)) == before
    assert read_checkpoint(tmp_path / "rs").dp_world_size == dp and result.dp_to == dp
    train_dtype = read_checkpoint(_src(name)).train_dtype.name
    for dtype in {"fp32", {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[train_dtype]}:
        consolidate(_src(name), tmp_path / f"a{dtype}", dtype=dtype)
        consolidate(tmp_path / "rs", tmp_path / f"b{dtype}", dtype=dtype)
        a, b = (
            load_file(tmp_path / f"a{dtype}" / "model.safetensors"),
            load_file(tmp_path / f"b{dtype}" / "model.safetensors"),
        )
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _globals(path):
    with zipfile.ZipFile(path) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    return {arg for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"}


@pytest.mark.parametrize("name,dp", [("z2_dp2_bf16", 3), ("gpu/gpu_z3_dp1_fp16_overflow", 2)])
def test_files_carry_deepspeeds_own_classes_and_load_with_torch(name, dp, tmp_path):
    reshard(_src(name), tmp_path / "rs", dp=dp)
    for path in (tmp_path / "rs").rglob("*.pt"):
        assert all(g.split(" ")[0].split(".")[0] in {"torch", "collections", "deepspeed"} for g in _globals(path)), path
        obj = torch.load(path, weights_only=False, mmap=True)
        if "optimizer_state_dict" in obj:
            scaler = obj["optimizer_state_dict"].get("loss_scaler")
            assert scaler is None or type(scaler).__module__ == "deepspeed.runtime.fp16.loss_scaler"


def _layout(obj):
    """Everything about a rank file that depends on the DP size, not on the trained values."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {
            k: _layout(v)
            for k, v in obj.items()
            if k not in ("ds_config", "step", "lr_scheduler", "global_steps", "global_samples", "ds_version", "module")
        }
    if isinstance(obj, (list, tuple)):
        return [_layout(v) for v in obj]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed.utils"):
        return dict(vars(obj))
    return obj if isinstance(obj, (int, str, type(None))) else type(obj).__name__


@pytest.mark.parametrize(
    "src,dst",
    [
        ("z1_dp2_bf16", "z1_dp4_bf16"),
        ("z2_dp4_fp32", "z2_dp2_fp32"),
        ("z3_dp2_bf16", "z3_dp4_bf16"),
        ("z3_dp4_fp32", "z3_dp1_fp32"),
    ],
)
def test_layout_equals_what_deepspeed_itself_writes_at_the_new_size(src, dst, tmp_path):
    """Same model and config saved by DeepSpeed at DP=M: padding, partitions, sub-groups, mappings all match."""
    m = read_checkpoint(_src(dst)).dp_world_size
    reshard(_src(src), tmp_path / "rs", dp=m)
    ours_dir, ref_dir = tmp_path / "rs" / "global_step2", _src(dst) / "global_step2"
    assert sorted(p.name for p in ours_dir.iterdir()) == sorted(p.name for p in ref_dir.iterdir())
    for ref_path in ref_dir.iterdir():
        ours = torch.load(ours_dir / ref_path.name, weights_only=False)
        ref = torch.load(ref_path, weights_only=False)
        assert _layout(ours) == _layout(ref), ref_path.name


def test_round_trip_returns_the_original_bytes(tmp_path):
    """N -> M -> N gives back the original partitions and moments bit for bit (ZeRO-2, no uninitialised padding)."""
    src = _src("z2_dp3_fp32")
    reshard(src, tmp_path / "m", dp=2)
    reshard(tmp_path / "m", tmp_path / "n", dp=3)
    for path in (src / "global_step2").glob("*optim_states.pt"):
        a = torch.load(path, weights_only=False)["optimizer_state_dict"]
        b = torch.load(tmp_path / "n" / "global_step2" / path.name, weights_only=False)["optimizer_state_dict"]
        for x, y in zip(a["single_partition_of_fp32_groups"], b["single_partition_of_fp32_groups"], strict=False):
            assert torch.equal(x, y)
        for g, state in a["base_optimizer_state"]["state"].items():
            for k, v in state.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["base_optimizer_state"]["state"][g][k])), k


def test_subgroup_split_follows_deepspeed():
    assert split_subgroups([30, 30, 30], 1_000_000_000) == [[0, 1, 2]]
    assert split_subgroups([30, 40, 10, 5], 64) == [[0, 1], [2, 3]]
    assert split_subgroups([100, 1], 64) == [[0], [1]]


def test_same_size_writes_nothing_or_copies(tmp_path):
    src = _src("z2_dp2_bf16")
    assert reshard(src, dp=2).output_dir is None
    result = reshard(src, tmp_path / "copy", dp=2)
    assert (tmp_path / "copy" / "latest").read_text() == "global_step2" and result.output_dir


def test_bad_sizes_and_outputs(tmp_path):
    src = _src("z2_dp2_bf16")
    with pytest.raises(UsageError, match="at least 1"):
        reshard(src, tmp_path / "x", dp=0)
    (tmp_path / "x").mkdir()
    with pytest.raises(OutputError, match="already exists"):
        reshard(src, tmp_path / "x", dp=3)


def test_trainer_folder_files_and_rng_states_follow(tmp_path):
    src = _src("trainer_z2_bf16")
    result = reshard(src, tmp_path / "rs", dp=3)
    names = {p.name for p in (tmp_path / "rs").iterdir()}
    assert {
        "config.json",
        "trainer_state.json",
        "tokenizer.json",
        "latest",
        "rng_state_0.pth",
        "rng_state_1.pth",
    } <= names
    assert "rng_state_2.pth" not in names and any("RNG" in n for n in result.notes)
    reshard(src, tmp_path / "one", dp=1)
    assert (tmp_path / "one" / "rng_state.pth").exists()


def test_engine_fixture_list_is_complete():
    assert {"z3_dp4_fp32", "z1_dp1_bf16"} <= set(fixture_names("engine"))


def _ds_to_universal(src, out):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / "global_step2"),
           "--output_folder", str(out / "global_step2"), "--inject_missing_state", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]  # fmt: skip
    subprocess.run(cmd, capture_output=True, check=True, env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("name,dp", [("z2_dp2_fp32", 3), ("z3_dp3_bf16", 2)])
def test_universal_matches_ds_to_universal_and_converts_back(name, dp, tmp_path):
    src = _src(name)
    result = reshard(src, tmp_path / "ours", universal=True)
    assert result.dp_to is None and (tmp_path / "ours" / "latest_universal").read_text() == "global_step2"
    _ds_to_universal(src, tmp_path / "ds")
    params = [p for p in (tmp_path / "ours" / "global_step2" / "zero").iterdir() if p.is_dir()]
    assert {p.name for p in params} == set(read_checkpoint(src).masters)
    for pdir in params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            ours = torch.load(pdir / f"{state}.pt", weights_only=False)
            theirs = torch.load(
                tmp_path / "ds" / "global_step2" / "zero" / pdir.name / f"{state}.pt", weights_only=False
            )
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            assert ours["param"].shape == read_checkpoint(src).masters[pdir.name].shape
            assert torch.equal(ours["param"].flatten(), theirs.flatten()), (pdir.name, state)
    consolidate(src, tmp_path / "a")
    expected = load_file(tmp_path / "a" / "model.safetensors")
    for universal in ("ours", "ds"):
        reshard(tmp_path / universal, tmp_path / f"native-{universal}", dp=dp)
        assert read_checkpoint(tmp_path / f"native-{universal}").dp_world_size == dp
        consolidate(tmp_path / f"native-{universal}", tmp_path / f"c-{universal}")
        got = load_file(tmp_path / f"c-{universal}" / "model.safetensors")
        assert all(torch.equal(got[k], expected[k]) for k in expected), universal


def test_universal_options_are_exclusive(tmp_path):
    with pytest.raises(UsageError, match="without --dp/--stage"):
        reshard(_src("z2_dp2_fp32"), tmp_path / "x", dp=2, universal=True)
    with pytest.raises(UsageError, match="pass --dp M, --stage S or --universal"):
        reshard(_src("z2_dp2_fp32"), tmp_path / "x")


def test_zero3_subgroups_get_their_own_step_tensor(tmp_path):
    """torch AdamW keeps `step` as a tensor; shared between sub-groups it would advance once per sub-group."""
    reshard(_src("z3_dp3_fp32"), tmp_path / "rs", dp=2)
    state = torch.load(
        tmp_path / "rs" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    steps = [s["step"] for s in state.values()]
    assert len(steps) > 1 and all(torch.is_tensor(s) and s.item() == 2 for s in steps)
    assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)


def test_progress_reports_every_tensor_byte_once(tmp_path):
    seen = {"total": None, "done": 0}
    reshard(_src("z2_dp2_bf16"), tmp_path / "rs", dp=3, on_start=lambda n: seen.update(total=n),
            on_progress=lambda n: seen.update(done=seen["done"] + n))  # fmt: skip
    tensor_bytes = 0
    for path in (tmp_path / "rs").rglob("*.pt"):
        with zipfile.ZipFile(path) as zf:
            tensor_bytes += sum(i.file_size for i in zf.infolist() if "/data/" in i.filename)
    assert seen["total"] == seen["done"] == tensor_bytes

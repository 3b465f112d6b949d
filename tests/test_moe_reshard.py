"""Resharding DeepSpeed-MoE (expert-parallel) ZeRO-1/2 checkpoints to another DP size.

Fast tests: the output reads back through our own reader (partition counts, experts, every state unchanged), has
exactly the structure DeepSpeed itself saves at that size, round-trips to the original files tensor for tensor,
consolidates to the same tensors, and what is not supported is refused in one line with nothing written.
Slow tests (`pytest -m slow tests/test_moe_reshard.py`): DeepSpeed's own `load_checkpoint` at the new world size
(tests/support/moe_load_worker.py under torchrun) restores fp32 masters, Adam moments and module weights
bit-identical to the fixture's reference, and one more training step runs.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate, read_checkpoint
from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.moe import expert_dp_ranks
from ckpttools.ops.reshard import reshard

from .conftest import FIXTURES, fixture_meta, tree_digest

DP2 = "moe_ep2_dp2_z2_bf16"
DP4 = "moe_ep2_dp4_z2_bf16"
Z1 = "moe_ep2_dp2_z1_bf16"
DBE = "moe_ep2_dp4_z2_bf16_dbe"
TAG = "global_step2"
OPT = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
EXPERTS = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)]
CASES = [(DP2, 4), (DP4, 2), (DBE, 2), (Z1, 4)]
ROOT = Path(__file__).resolve().parent.parent
WORKER = "tests.support.moe_load_worker"


def _case_id(case: tuple[str, int]) -> str:
    return f"{case[0]}-to-dp{case[1]}"


def _src(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def _resharded(name: str, m: int, out: Path) -> Path:
    before = tree_digest(_src(name))
    reshard(_src(name), out, dp=m)
    assert tree_digest(_src(name)) == before  # the input is never modified
    return out


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False, map_location="cpu")  # fixtures and our own output: trusted


def _items(value: dict, convert: Any) -> list:
    """A dict's items; in order for OrderedDicts (param_slice_mappings, param_shapes: DeepSpeed reads them in
    order), sorted by key for plain dicts (whose key order DeepSpeed never reads)."""
    items = [(k, convert(v)) for k, v in value.items()]
    return items if isinstance(value, OrderedDict) else sorted(items, key=lambda kv: str(kv[0]))


def _plain(value: Any) -> Any:
    """A torch.load result as comparable plain values: tensors (dtype, shape, values), objects by their fields."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.float().flatten().tolist())
    if isinstance(value, dict):
        return _items(value, _plain)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return (type(value).__name__, _plain(vars(value)))
    return value


def _structure(value: Any) -> Any:
    """Like `_plain` without the tensor values: what DeepSpeed's layout at a DP size fixes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.requires_grad)
    if isinstance(value, dict):
        return _items(value, _structure)
    if isinstance(value, (list, tuple)):
        return [_structure(v) for v in value]
    if hasattr(value, "__dict__"):
        return (type(value).__name__, _structure(vars(value)))
    return value


def _optim(root: Path, rank: int) -> dict:
    return _load(root / TAG / OPT.format(rank))


def _model(root: Path) -> dict:
    return _load(root / TAG / "mp_rank_00_model_states.pt")


# --- Rank topology -----------------------------------------------------------------------------------------


def _expert_coords(rank: int, ep: int, dp: int, dbe: bool) -> tuple[int, int]:
    """(expert-parallel rank, expert-DP rank) of a DP rank, from `expert_dp_ranks`."""
    return next((e, d) for e in range(ep) for d, r in enumerate(expert_dp_ranks(e, ep, dp, dbe)) if r == rank)


# --- What the output holds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_our_reader_reads_the_resharded_checkpoint_back(case, tmp_path):
    name, m = case
    meta = fixture_meta(name)
    out = _resharded(name, m, tmp_path / "out")
    assert sorted(p.name for p in (out / TAG).iterdir()) == sorted(
        [OPT.format(r) for r in range(m)] + EXPERTS + ["mp_rank_00_model_states.pt"]
    )
    ckpt = read_checkpoint(out)
    assert (ckpt.dp_world_size, ckpt.zero_stage, ckpt.layout.ep) == (m, meta["zero_stage"], 2)
    assert ckpt.layout.details["expert_dp"] == {"2": m // 2}
    assert ckpt.layout.details["topology"] == ("data_before_expert" if name == DBE else "expert_before_data")
    assert ckpt.keys == meta["state_dict_keys"]
    for r in range(m):
        assert _optim(out, r)["optimizer_state_dict"]["partition_count"] == [m, m, m // 2, m // 2]
    ref = load_file(FIXTURES / name / "reference" / "full_state.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            assert torch.equal(read_tensor(p.fp32, reader), ref[f"fp32/{p.name}"]), p.name
            for key, src in p.states.items():
                assert torch.equal(read_tensor(src, reader), ref[f"{key}/{p.name}"]), (key, p.name)
    assert ckpt.optimizer.group_scalars == [{"step": 2}] * 4


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_expert_files_and_the_module_file_come_along(case, tmp_path):
    name, m = case
    out = _resharded(name, m, tmp_path / "out")
    for f in EXPERTS:
        assert _plain(_load(out / TAG / f)) == _plain(_load(_src(name) / TAG / f)), f
    ours, theirs = (
        _load(out / TAG / "mp_rank_00_model_states.pt"),
        _load(_src(name) / TAG / "mp_rank_00_model_states.pt"),
    )
    assert ours["dp_world_size"] == m
    assert _plain({**ours, "dp_world_size": None}) == _plain({**theirs, "dp_world_size": None})


def test_the_layout_is_the_one_deepspeed_saves_at_dp4(tmp_path):
    """moe_ep2_dp2 resharded to DP 4 has, file for file, the structure DeepSpeed wrote for moe_ep2_dp4 (the same
    model and config trained at 4 processes): keys, shapes, dtypes, partition counts, paddings, slice mappings."""
    out = _resharded(DP2, 4, tmp_path / "out")
    for r in range(4):
        ours, theirs = _optim(out, r), _optim(_src(DP4), r)
        assert _structure(ours) == _structure(theirs), r


@pytest.mark.parametrize(("name", "m"), [(DP4, 2), (DBE, 2), (DP2, 4), (Z1, 4)])
def test_resharding_there_and_back_gives_deepspeed_s_files(name, m, tmp_path):
    """N -> M -> N: every optimizer file equal, tensor for tensor, to the one DeepSpeed saved."""
    dp = fixture_meta(name)["dp"]
    there = _resharded(name, m, tmp_path / "there")
    back = tmp_path / "back"
    reshard(there, back, dp=dp)
    for r in range(dp):
        assert _plain(_optim(back, r)) == _plain(_optim(_src(name), r)), r
    ours, theirs = (
        _load(back / TAG / "mp_rank_00_model_states.pt"),
        _load(_src(name) / TAG / "mp_rank_00_model_states.pt"),
    )
    assert _plain(ours) == _plain(theirs)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_consolidate_gives_the_same_tensors(case, tmp_path):
    name, m = case
    out = _resharded(name, m, tmp_path / "out")
    for dtype in ("fp32", "bf16"):
        consolidate(_src(name), tmp_path / f"a-{dtype}", dtype=dtype)
        consolidate(out, tmp_path / f"b-{dtype}", dtype=dtype)
        a = load_file(tmp_path / f"a-{dtype}" / "model.safetensors")
        b = load_file(tmp_path / f"b-{dtype}" / "model.safetensors")
        assert list(a) == list(b)
        assert not [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


# --- Refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 3}, r"DP 3 is not a multiple of the expert-parallel size 2: .*pick a multiple of 2$"),
        ({"dp": 1}, r"DP 1 is not a multiple of the expert-parallel size 2"),
        ({"universal": True}, r"--universal is refused: DeepSpeed's universal loader looks experts up by their local"),
        ({"dp": 4, "stage": 1}, r"--stage is refused"),
        ({"stage": 3}, r"--stage is refused"),
    ],
)
def test_what_is_not_supported_is_refused_in_one_line_with_nothing_written(kwargs, match, tmp_path):
    before = tree_digest(_src(DP2))
    with pytest.raises(UnsupportedCheckpointError, match=match) as info:
        reshard(_src(DP2), tmp_path / "out", **kwargs)
    assert "\n" not in str(info.value)
    assert "is a DeepSpeed-MoE checkpoint (DP 2 x EP 2)" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staged folder left behind either
    assert tree_digest(_src(DP2)) == before


def _first_tensor_byte(path: Path) -> int:
    """Offset of the first byte of the file's first tensor record (past its zip local header)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    with path.open("rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def test_a_damaged_expert_file_is_refused_before_anything_is_written(tmp_path):
    """One flipped byte in an expert's weights: the 16-bit copy no longer matches its fp32 master."""
    src = tmp_path / "ckpt"
    shutil.copytree(_src(DP2), src)
    path = src / TAG / EXPERTS[5]
    data = bytearray(path.read_bytes())
    data[_first_tensor_byte(path)] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"experts\.1\.fc1\.weight does not match the module"):
        reshard(src, tmp_path / "out", dp=4)
    assert not (tmp_path / "out").exists()


# --- DeepSpeed itself loads the resharded checkpoint ---------------------------------------------------------


def _torchrun(nproc: int, args: list[str], timeout: int = 600):
    from fixtures.build import ds_launch

    return ds_launch.torchrun(nproc, WORKER, args, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_deepspeed_loads_the_resharded_checkpoint_at_the_new_size(case, tmp_path):
    name, m = case
    out = _resharded(name, m, tmp_path / "out")
    dump = tmp_path / "dump.safetensors"
    args = ["--fixture-meta", FIXTURES / name / "meta.json", "--load", out, "--dump", dump]
    run = _torchrun(m, [str(a) for a in args])
    assert run.rc == 0, run.tail()
    ours = load_file(dump)
    full = load_file(FIXTURES / name / "reference" / "full_state.safetensors")
    bit16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    assert sorted(k for k in ours if not k.startswith("module/")) == sorted(full)
    assert sorted(k[len("module/") :] for k in ours if k.startswith("module/")) == sorted(bit16)
    assert not [k for k in full if not torch.equal(ours[k], full[k])]
    assert not [k for k in bit16 if not torch.equal(ours[f"module/{k}"], bit16[k])]
    facts = json.loads(dump.with_suffix(".json").read_text())
    assert facts["global_steps"] == 2
    assert facts["optimizer_steps"] == [[2]] * 4
    live = facts["topology"]["ranks"]
    assert [t["expert_dp_world_size"] for t in live] == [m // 2] * m
    dbe = name == DBE
    assert [(t["ep_rank"], t["expert_dp_rank"]) for t in live] == [_expert_coords(r, 2, m, dbe) for r in range(m)]
    assert len(facts["losses"]) == 1
    assert math.isfinite(facts["losses"][0])  # one more training step runs on the loaded state

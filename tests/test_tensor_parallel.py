"""DeepSpeed AutoTP (tensor-parallel) checkpoints: the real fixtures of fixtures/build/fixture_autotp.py (DP 2 x TP 2,
ZeRO-1 and 2, a tiny Llama) read into full tensors, consolidated bit-identical to DeepSpeed's own merges, loaded by
from_pretrained; broken folders refused by name. The slow tests prove the fixtures (and DeepSpeed's
ds_to_universal output of them) load in DeepSpeed itself, through tests/support/autotp_load_worker.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.crosscheck import check_replicas, replica_mismatch
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.ops.consolidate import consolidate
from fixtures.build import ds_launch

from .conftest import FIXTURES, fixture_meta, tree_digest

ENGINE = ["autotp_tp2_dp2_z1_bf16", "autotp_tp2_dp2_z2_bf16"]
NAMES = [*ENGINE, "autotp_trainer_tp2_dp2_z1_bf16"]
ACCELERATE = "accelerate_autotp_tp2_dp2_z1_bf16"  # save_state folder: tag pytorch_model, no config.json
WORKER = "tests.support.autotp_load_worker"
TAG = "global_step2"


def _ckpt(name: str) -> Path:
    return FIXTURES / name / fixture_meta(name)["checkpoint"]


def _ref(name: str, file: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "reference" / file))


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(_ckpt(name), dst)
    return dst


def _model_states(name: str) -> dict:
    return torch.load(_ckpt(name) / fixture_meta(name)["tag"] / "mp_rank_00_model_states.pt", weights_only=False)


def _engine_merge(name: str) -> dict[str, torch.Tensor]:
    """The engine's 16-bit TP shards merged by DeepSpeed's own ParamAffineMap.rebuild (the map of mp_rank_00)."""
    import re

    from deepspeed.checkpoint.affine import ParamAffineMap

    info = _model_states(name)["universal_checkpoint_info"]
    maps = info["affine_map"]["params"]
    shards = [_ref(name, f"bit16_tp{r}.safetensors") for r in range(2)]
    merged = {}
    for key in shards[0]:
        (pattern,) = [p for p in maps if re.match(p, key)]
        merged[key] = ParamAffineMap.from_dict(maps[pattern]).rebuild(dict(enumerate(s[key] for s in shards)))
    return merged


@pytest.mark.parametrize("name", NAMES)
def test_reader_sees_the_full_model_of_both_tp_ranks(name):
    meta = fixture_meta(name)
    ckpt = read_checkpoint(_ckpt(name))
    assert (ckpt.layout.kind, ckpt.layout.tp, ckpt.layout.dp) == ("tensor", 2, 2)
    assert ckpt.layout.details["model_files"] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert (ckpt.zero_stage, ckpt.dp_world_size, ckpt.global_steps) == (meta["zero_stage"], 2, 2)
    assert ckpt.state_keys == ["exp_avg", "exp_avg_sq"]
    full = _ref(name, "universal_full.safetensors")
    assert {p.name: p.shape for p in ckpt.params} == {
        k[5:]: tuple(v.shape) for k, v in full.items() if k[:5] == "fp32/"
    }
    vocab = json.loads((_ckpt(name) / "config.json").read_text())["vocab_size"]
    assert ckpt.masters["lm_head.weight"].shape[0] == vocab
    assert meta["local_shapes_tp0"]["lm_head.weight"][0] == (vocab + 1) // 2  # split unevenly for an odd vocab
    assert all(src.shape == ckpt.masters[n].shape for n, src in ckpt.bit16.items())


@pytest.mark.parametrize("name", [*NAMES, ACCELERATE])
def test_every_state_equals_what_ds_to_universal_merges(name):
    """fp32 masters and both Adam moments, bit for bit (torch.equal), against DeepSpeed's ds_to_universal."""
    ckpt = read_checkpoint(_ckpt(name))
    full = _ref(name, "universal_full.safetensors")
    with RecordReader() as reader:
        for p in ckpt.params:
            assert torch.equal(read_tensor(p.fp32, reader), full[f"fp32/{p.name}"]), p.name
            for key, src in p.states.items():
                assert torch.equal(read_tensor(src, reader), full[f"{key}/{p.name}"]), (key, p.name)
        reader.finish()


def _assert_equal_to_deepspeed(name: str, fp32_dir: Path, bf16_dir: Path) -> tuple[dict, dict]:
    """fp32 output `torch.equal` to ds_to_universal's merge, bf16 to the engine's shards merged by DeepSpeed's map,
    and the fp32 folder loading in from_pretrained with nothing missing or unexpected."""
    from transformers import AutoModelForCausalLM

    full = _ref(name, "universal_full.safetensors")
    fp32 = load_file(str(fp32_dir / "model.safetensors"))
    assert fp32.keys() == {k[5:] for k in full if k.startswith("fp32/")}
    assert all(t.dtype == torch.float32 and torch.equal(t, full[f"fp32/{k}"]) for k, t in fp32.items())
    bf16 = load_file(str(bf16_dir / "model.safetensors"))
    engine = _engine_merge(name)
    assert bf16.keys() == engine.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, engine[k]) for k, t in bf16.items())
    loaded: Any = AutoModelForCausalLM.from_pretrained(fp32_dir, output_loading_info=True)  # (model, loading info)
    model, info = loaded
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert all(torch.equal(v, fp32[k]) for k, v in model.state_dict().items())
    return fp32, bf16


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_fp32_and_bf16_are_bit_identical_and_load_in_transformers(name, tmp_path):
    before = tree_digest(_ckpt(name))
    out32 = consolidate(_ckpt(name), tmp_path / "fp32", check_keys=True)
    out16 = consolidate(_ckpt(name), tmp_path / "bf16", dtype="bf16")
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(out32.files)
    assert not any("differ" in note for note in out32.notes + out16.notes)
    fp32, bf16 = _assert_equal_to_deepspeed(name, tmp_path / "fp32", tmp_path / "bf16")
    assert tree_digest(_ckpt(name)) == before  # the input is never modified
    assert (out32.num_parameters, out16.num_tensors) == (sum(t.numel() for t in fp32.values()), len(bf16))


@pytest.mark.parametrize("name", [*NAMES, ACCELERATE])
def test_replicated_parameters_agree_on_every_tp_rank(name):
    ckpt = read_checkpoint(_ckpt(name))
    assert replica_mismatch(ckpt) is None
    assert replica_mismatch(ckpt, full=True) is None
    check_replicas(ckpt)


def test_a_replicated_parameter_that_differs_between_tp_ranks_is_named(tmp_path):
    """Nothing else about the files disagrees, so only reading the replicas' bytes can tell."""
    ckpt = _copy(ENGINE[0], tmp_path)
    path = ckpt / TAG / "mp_rank_01_model_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["module"]["model.norm.weight"][3] += 1
    torch.save(sd, path)
    opened = read_checkpoint(ckpt)
    with pytest.raises(CorruptCheckpointError) as e:
        check_replicas(opened)
    assert "model.norm.weight (module) on TP rank 1 differs from TP rank 0's copy" in str(e.value)
    from ckpttools.ops.consolidate import consolidate

    with pytest.raises(CorruptCheckpointError, match="differs from TP rank 0's copy"):
        consolidate(ckpt, tmp_path / "out")  # every command runs the (sampled) replica check before writing
    assert not (tmp_path / "out").exists()


def test_bf16_cast_of_the_masters_equals_the_module_shards():
    """The 16-bit module copies the reader merges are the cast fp32 masters (what the engine keeps in step)."""
    ckpt = read_checkpoint(_ckpt(ENGINE[0]))
    with RecordReader() as reader:
        for p in ckpt.params:
            cast = read_tensor(p.fp32, reader, dtypes.BFLOAT16)
            assert torch.equal(cast, read_tensor(ckpt.bit16[p.name], reader)), p.name


@pytest.mark.parametrize(
    ("missing", "says"),
    [
        ("mp_rank_01_model_states.pt", "TP rank 1's model-states file mp_rank_01_model_states.pt is missing"),
        ("mp_rank_00_model_states.pt", "TP rank 0's model-states file mp_rank_00_model_states.pt is missing"),
        ("bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt", "TP rank 1, DP rank 1: its optimizer file"),
        ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "TP rank 0, DP rank 0: its optimizer file"),
    ],
)
def test_a_missing_rank_file_is_named(missing, says, tmp_path):
    ckpt = _copy(ENGINE[0], tmp_path)
    (ckpt / TAG / missing).unlink()
    with pytest.raises(CheckpointNotFoundError) as e:
        read_checkpoint(ckpt)
    assert says in str(e.value)
    assert "\n" not in str(e.value)
    assert "remove the stray" not in str(e.value)


def test_a_tp_rank_file_from_another_run_is_refused(tmp_path):
    """mp_rank_01 of the ZeRO-2 run beside mp_rank_00 of the ZeRO-1 run: the TP ranks disagree."""
    ckpt = _copy(ENGINE[0], tmp_path)
    shutil.copy(_ckpt(ENGINE[1]) / TAG / "mp_rank_01_model_states.pt", ckpt / TAG / "mp_rank_01_model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01_model_states\.pt disagrees with"):
        read_checkpoint(ckpt)


def _rewrite_map(ckpt: Path, edit) -> None:
    """Change the affine map in every TP rank's model-states file (a damaged or foreign map, for refusals)."""
    for r in range(2):
        path = ckpt / TAG / f"mp_rank_{r:02d}_model_states.pt"
        sd = torch.load(path, weights_only=False)
        edit(sd["universal_checkpoint_info"])
        torch.save(sd, path)


def test_pieces_that_do_not_tile_the_tensor_are_refused(tmp_path):
    ckpt = _copy(ENGINE[0], tmp_path)

    def overlap(info):  # TP rank 1's lm_head rows start one row early: row 30 twice, row 60 nowhere
        piece = info["affine_map"]["params"][r"^lm_head\.weight$"]["ranks"][1]["pieces"][0]
        piece["source"][0] -= piece["source"][1][0]

    _rewrite_map(ckpt, overlap)
    with pytest.raises(CorruptCheckpointError, match=r"element \d+ of lm_head.weight .* is covered twice"):
        read_checkpoint(ckpt)


def test_a_parameter_the_map_does_not_cover_and_a_scaled_piece_are_refused(tmp_path):
    ckpt = _copy(ENGINE[0], tmp_path)

    def scaled(info):
        info["affine_map"]["params"][r"^model\.norm\.weight$"]["ranks"][0]["pieces"][0]["scale"] = 0.5

    _rewrite_map(ckpt, scaled)
    with pytest.raises(UnsupportedCheckpointError, match=r"scaled by 0\.5"):
        read_checkpoint(ckpt)

    def newer(info):
        info["affine_map"]["version"] = 2

    _rewrite_map(ckpt, newer)
    with pytest.raises(UnsupportedCheckpointError, match="version 2"):
        read_checkpoint(ckpt)


def test_vocabulary_rows_past_original_vocab_size_are_cut(tmp_path):
    """DeepSpeed's AutoTP splits an odd vocabulary unevenly instead of padding it, so the real fixtures have
    nothing to cut; an original_vocab_size of 59 makes the vocabulary parameter (lm_head) lose its last two rows,
    as ds_to_universal's `param[:original_vocab_size]` does, and nothing else changes."""
    ckpt = _copy(ENGINE[0], tmp_path)
    _rewrite_map(ckpt, lambda info: info.update(original_vocab_size=59))
    got = read_checkpoint(ckpt)
    full = _ref(ENGINE[0], "universal_full.safetensors")
    with RecordReader() as reader:
        for p in got.params:
            want = full[f"fp32/{p.name}"][:59] if p.name == "lm_head.weight" else full[f"fp32/{p.name}"]
            assert torch.equal(read_tensor(p.fp32, reader), want), p.name
            assert torch.equal(read_tensor(p.states["exp_avg"], reader), full[f"exp_avg/{p.name}"][: want.shape[0]])
        assert read_tensor(got.bit16["lm_head.weight"], reader).shape == (59, 16)


def test_a_parameter_without_a_map_entry_or_a_category_is_refused(tmp_path):
    ckpt = _copy(ENGINE[0], tmp_path)
    _rewrite_map(ckpt, lambda info: info["affine_map"]["params"].pop(r"^model\.layers\.1\.mlp\.up_proj\.weight$"))
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is covered neither"):
        read_checkpoint(ckpt)


def test_without_an_affine_map_the_pattern_categories_merge_the_same(tmp_path):
    """Older DeepSpeed saves only the pattern lists; merged as ds_to_universal merges them, the result is the same."""
    ckpt = _copy(ENGINE[0], tmp_path)
    _rewrite_map(ckpt, lambda info: info.pop("affine_map"))
    got = read_checkpoint(ckpt)
    full = _ref(ENGINE[0], "universal_full.safetensors")
    assert got.layout.details["affine_map"] is False
    with RecordReader() as reader:
        assert all(torch.equal(read_tensor(p.fp32, reader), full[f"fp32/{p.name}"]) for p in got.params)


# --- DeepSpeed itself loads the fixtures -----------------------------------------------------------------------


def _load_in_deepspeed(
    name: str, load: Path, tmp_path: Path, universal: bool = False, nproc: int = 4, tp: int = 2
) -> dict[str, torch.Tensor]:
    tmp_path.mkdir(parents=True)
    dump = tmp_path / "dump.safetensors"
    args = ["--fixture-meta", str(FIXTURES / name / "meta.json"), "--load", str(load), "--dump", str(dump),
            "--tp", str(tp)]  # fmt: skip
    run = ds_launch.torchrun(nproc, WORKER, args + (["--universal"] if universal else []), cwd=tmp_path, timeout=900)
    assert run.rc == 0, run.tail()
    return load_file(str(dump))


def _universal_shards(name: str) -> list[dict[str, torch.Tensor]]:
    """Per TP rank, every state of the ds_to_universal reference cut back into that rank's local shard by
    DeepSpeed's own ParamAffineMap.extract."""
    import re

    from deepspeed.checkpoint.affine import ParamAffineMap

    info = _model_states(name)["universal_checkpoint_info"]
    maps = info["affine_map"]["params"]
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, full in _ref(name, "universal_full.safetensors").items():
        (pattern,) = [p for p in maps if re.match(p, key.split("/", 1)[1])]
        for r in range(2):
            shards[r][key] = ParamAffineMap.from_dict(maps[pattern]).extract(full, r)
    return shards


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[:1])
def test_deepspeed_loads_the_fixture_and_its_universal_conversion(name, tmp_path):
    """The original fixture loads in a fresh AutoTP engine (DP 2 x TP 2) and holds exactly what was saved: fp32
    equal to the live engine's, Adam moments equal to ds_to_universal's merge cut back into TP shards, the module's
    16-bit shards equal to the engine's; the same for DeepSpeed's own universal conversion (load_universal)."""
    live = [_ref(name, f"live_fp32_tp{r}.safetensors") for r in range(2)]
    bit16 = [_ref(name, f"bit16_tp{r}.safetensors") for r in range(2)]
    universal_shards = _universal_shards(name)
    for r in range(2):  # the reference merge agrees with the live engine
        assert all(torch.equal(universal_shards[r][k], v) for k, v in live[r].items())

    def check(dump: dict[str, torch.Tensor]) -> None:
        for r in range(2):
            for key, want in universal_shards[r].items():
                assert torch.equal(dump[f"tp{r}/{key}"], want), (r, key)
            for key, want in bit16[r].items():
                assert torch.equal(dump[f"tp{r}/module/{key}"], want), (r, key)

    check(_load_in_deepspeed(name, _ckpt(name), tmp_path / "native"))
    universal = tmp_path / "universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(_ckpt(name) / TAG),
           "--output_folder", str(universal / "global_step2_universal")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=ds_launch.worker_env(), timeout=600)
    assert (universal / "latest_universal").read_text() == "global_step2_universal"  # written by ds_to_universal
    check(_load_in_deepspeed(name, universal, tmp_path / "loaded_universal", universal=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[:2])
def test_deepspeed_loads_a_checkpoint_resharded_to_another_dp_size(name, tmp_path):
    """`reshard --dp 1` re-cuts every TP rank's ZeRO-1/2 files on its own (TP shards and the map unchanged); a DP 1 x
    TP 2 AutoTP engine loads it with plain load_checkpoint and holds exactly the saved state."""
    from ckpttools.ops.reshard import reshard

    before = tree_digest(FIXTURES / name)
    res = reshard(_ckpt(name), tmp_path / "dp1", dp=1)
    assert tree_digest(FIXTURES / name) == before
    assert read_checkpoint(res.output_dir).layout.describe() == "DP 1 x TP 2"
    dump = _load_in_deepspeed(name, Path(res.output_dir), tmp_path / "load", nproc=2)
    bit16 = [_ref(name, f"bit16_tp{r}.safetensors") for r in range(2)]
    for r, want in enumerate(_universal_shards(name)):
        for key, t in want.items():
            assert torch.equal(dump[f"tp{r}/{key}"], t), (r, key)
        for key, t in bit16[r].items():
            assert torch.equal(dump[f"tp{r}/module/{key}"], t), (r, key)


def test_a_folder_missing_every_file_of_a_tp_rank_names_it(tmp_path):
    """Without any mp_rank_01 file the names look data-parallel; the recorded mp_world_size tells the truth."""
    from ckpttools.errors import CheckpointNotFoundError

    ckpt = _copy(ENGINE[0], tmp_path)
    for f in (ckpt / TAG).glob("*mp_rank_01*"):
        f.unlink()
    with pytest.raises(CheckpointNotFoundError, match="mp_rank_00 only: mp rank 1 missing"):
        read_checkpoint(ckpt)


# --- accelerate: Accelerator(DeepSpeedPlugin(... tensor_parallel.autotp_size=2 ...)) + accelerator.save_state ---


def _cli(*args: object):
    from click.testing import CliRunner

    from ckpttools.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_accelerate_save_state_is_an_autotp_folder_the_live_engine_agrees_with():
    """The pytorch_model/ tag folder holds one model-states file per TP rank and one optimizer file per (DP, TP)
    rank, like the engine's; ds_to_universal's merge cut back into TP shards equals the live engine's fp32."""
    meta = fixture_meta(ACCELERATE)
    assert (meta["tag"], meta["optimizer"], meta["step_type"]) == ("pytorch_model", "AdamW", "tensor")
    assert not (_ckpt(ACCELERATE) / "config.json").exists()
    assert meta["files"] == [f"bf16_zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt" for d in (0, 1) for t in (0, 1)] + [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # fmt: skip
    for r, want in enumerate(_universal_shards(ACCELERATE)):
        live = _ref(ACCELERATE, f"live_fp32_tp{r}.safetensors")
        assert live.keys() == {k for k in want if k.startswith("fp32/")}
        assert all(torch.equal(want[k], v) for k, v in live.items())


def test_accelerate_inspect_reports_dp2_by_tp2():
    res = _cli("inspect", _ckpt(ACCELERATE))
    assert res.exit_code == 0, res.output
    assert "ZeRO-1, DP 2 x TP 2 (tensor-parallel (AutoTP))" in res.output
    assert "tag pytorch_model" in res.output
    res = _cli("inspect", _ckpt(ACCELERATE), "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert (info["parallel"]["kind"], info["parallel"]["dp"], info["parallel"]["tp"]) == ("tensor", 2, 2)
    assert (info["zero_stage"], info["dp_world_size"], info["tag"]) == (1, 2, "pytorch_model")


def test_accelerate_consolidate_with_config_is_bit_identical_and_loads_in_transformers(tmp_path):
    """`ckpt consolidate --config model_config/`: fp32 equal to ds_to_universal's fp32, bf16 equal to the engine's
    16-bit TP shards merged by DeepSpeed's affine map, config files copied, from_pretrained loads it."""
    config = FIXTURES / ACCELERATE / "model_config"
    before = tree_digest(FIXTURES / ACCELERATE)
    for dtype in ("fp32", "bf16"):
        res = _cli("consolidate", _ckpt(ACCELERATE), "--dtype", dtype, "--out", tmp_path / dtype, "--config", config)
        assert res.exit_code == 0, res.output
        assert "--config" not in res.stderr, res.stderr
        assert sorted(p.name for p in (tmp_path / dtype).iterdir()) == [
            ".ckpt-manifest.json", "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip
        written = json.loads((tmp_path / dtype / "config.json").read_text())
        assert written.pop("dtype") == written.pop("torch_dtype") == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
        assert written == json.loads((config / "config.json").read_text())  # the given config, dtype recorded
    _assert_equal_to_deepspeed(ACCELERATE, tmp_path / "fp32", tmp_path / "bf16")
    assert tree_digest(FIXTURES / ACCELERATE) == before


def test_accelerate_consolidate_without_config_says_to_pass_it(tmp_path):
    res = _cli("consolidate", _ckpt(ACCELERATE), "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "pass --config" in res.stderr, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".ckpt-manifest.json", "model.safetensors"]

"""accelerate `save_state` folders (fixtures/accelerate_*, written by accelerate + DeepSpeed on CPU at DP 2).

`accelerator.save_state(dir)` leaves `dir/latest` ("pytorch_model"), the shards in `dir/pytorch_model/`, per-process
`random_states_{r}.pkl`, `scheduler.bin` and DeepSpeed's recovery scripts, but no config.json: the model's config
is passed with `config=` / `--config` (each fixture's `model_config/` holds what `model.save_pretrained` writes
besides the weights). References: `reference/zero_to_fp32.safetensors` (DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint(dir, tag="pytorch_model")`, ties cloned) and `reference/bit16.safetensors`
(the engine's 16-bit weights: ZeRO-3 gathered, ZeRO-2 `module_state_dict`).
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpttools import CkptError, consolidate, reshard
from ckpttools.cli import main
from ckpttools.io.staging import MANIFEST

from .conftest import FIXTURES, fixture_meta, fixture_names, tree_digest

ROOT = Path(__file__).resolve().parent.parent
NAMES = fixture_names("accelerate")
TIED = "lm_head.weight"  # -> transformer.wte.weight
IDS = torch.tensor([[1, 5, 7, 3, 9, 2], [4, 4, 8, 0, 2, 6]])


@pytest.fixture(autouse=True)
def _restore_progress_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # `ckpt push` sets it in CI


def _state(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def _model_config(name: str) -> Path:
    return FIXTURES / name / "model_config"


def _ref(name: str, which: str = "zero_to_fp32") -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "reference" / f"{which}.safetensors")


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_error_line(res, code: int, *needles: str) -> str:
    assert res.exit_code == code, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    model, info = loaded  # (model, loading info)
    return model.eval(), info


def _reference_model(name: str):
    """The model built from model_config/ with DeepSpeed's own fp32 state dict loaded (strict)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_model_config(name)), dtype=torch.float32)
    model.load_state_dict(_ref(name), strict=True)
    return model.eval()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- The fixtures are what accelerate writes -------------------------------------------------------------------


def test_there_are_accelerate_fixtures_for_zero_2_and_3():
    assert sorted(fixture_meta(n)["zero_stage"] for n in NAMES) == [2, 3]
    assert not set(NAMES) & set(fixture_names("engine") + fixture_names("trainer"))


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_save_state_output_untouched(name):
    meta = fixture_meta(name)
    state = _state(name)
    sizes = {str(p.relative_to(state)): p.stat().st_size for p in sorted(state.rglob("*")) if p.is_file()}
    assert sizes == meta["save_state_files"]  # as listed by the worker right after save_state
    assert (state / "latest").read_text() == "pytorch_model" and meta["tag"] == "pytorch_model"
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= set(sizes)
    assert not (state / "config.json").exists() and meta["removed_files"] == []
    assert sorted(p.name for p in _model_config(name).iterdir()) == ["config.json", "generation_config.json"]
    assert meta["prepared"]["scheduler"] == "AcceleratedScheduler" and meta["dp"] == 2


# --- consolidate ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_without_config_writes_weights_only_with_one_note(name, tmp_path):
    before = tree_digest(_state(name))
    result = consolidate(_state(name), tmp_path / "out")
    assert result.files == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MANIFEST, "model.safetensors"]
    assert [n for n in result.notes if "--config" in n] == result.notes and len(result.notes) == 1, result.notes
    assert "save_state" in result.notes[0]
    assert result.source["tag"] == "pytorch_model" and result.source["global_steps"] == 2

    ours, ref = load_file(tmp_path / "out" / "model.safetensors"), _ref(name)
    assert set(ours) == set(ref) and TIED in ours  # not an HF folder: a bare state dict, the alias kept
    for key, value in ref.items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], value), key
    assert tree_digest(_state(name)) == before


def test_consolidate_without_config_cli_prints_the_note(tmp_path):
    name = NAMES[0]
    res = _cli("consolidate", _state(name), "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if line.startswith("Note: ")]
    assert len(notes) == 1 and "--config" in notes[0], res.stderr
    res = _cli("consolidate", _state(name), "--out", tmp_path / "json", "--json", "-q")
    assert res.exit_code == 0 and res.stderr == ""  # -q: no notes on stderr, still in the JSON
    assert [n for n in json.loads(res.stdout)["notes"] if "--config" in n]


@pytest.mark.parametrize("given", ["folder", "file"])
@pytest.mark.parametrize("name", NAMES)
def test_consolidate_with_config_loads_with_from_pretrained(name, given, tmp_path):
    config = _model_config(name) if given == "folder" else _model_config(name) / "config.json"
    result = consolidate(_state(name), tmp_path / "hf", config=config, check_keys=given == "file")
    out = tmp_path / "hf"
    assert sorted(result.files) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *result.files])
    assert not [n for n in result.notes if "--config" in n], result.notes

    written = json.loads((out / "config.json").read_text())
    source = json.loads((_model_config(name) / "config.json").read_text())
    assert source["dtype"] == "bfloat16" and written["dtype"] == "float32"  # rewritten to the dtype written
    assert {k: v for k, v in written.items() if k != "dtype"} == {k: v for k, v in source.items() if k != "dtype"}
    gen = (_model_config(name) / "generation_config.json").read_bytes()
    assert (out / "generation_config.json").read_bytes() == gen

    ours, ref = load_file(out / "model.safetensors"), _ref(name)
    assert set(ours) == set(ref) - {TIED}  # an HF folder: the tied alias stored once, as save_pretrained does
    for key, value in ours.items():
        assert torch.equal(value, ref[key]), key

    model, info = _load_hf(out)
    assert all(not v for v in info.values()), info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _reference_model(name)(IDS).logits)


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_bf16_with_config_equals_the_engines_16bit_weights(name, tmp_path):
    consolidate(_state(name), tmp_path / "hf", config=_model_config(name), dtype="bf16")
    ours, ref = load_file(tmp_path / "hf" / "model.safetensors"), _ref(name, "bit16")
    assert set(ours) == set(ref) - {TIED}
    for key, value in ours.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, ref[key]), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def _bad_configs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    tmp_path.mkdir()
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "gpt2", ')
    (tmp_path / "list.json").write_text("[1, 2]")
    return {
        "missing": (tmp_path / "nope", "no such config.json"),
        "dir without config.json": (tmp_path / "empty_dir", "no such config.json"),
        "broken JSON (folder)": (tmp_path / "broken", "not valid JSON"),
        "broken JSON (file)": (tmp_path / "broken" / "config.json", "not valid JSON"),
        "not an object": (tmp_path / "list.json", "not an object"),
    }


@pytest.mark.parametrize(
    "case", ["missing", "dir without config.json", "broken JSON (folder)", "broken JSON (file)", "not an object"]
)
def test_bad_config_is_one_line_error_and_nothing_is_written(case, tmp_path):
    name = NAMES[0]
    config, needle = _bad_configs(tmp_path / "cfg")[case]
    work = tmp_path / "work"
    work.mkdir()
    before = tree_digest(_state(name))

    with pytest.raises(CkptError) as err:
        consolidate(_state(name), work / "a", config=config)
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CkptError, match=needle):
        reshard(_state(name), work / "b", dp=1, config=config)

    runs = [
        _cli("consolidate", _state(name), "--out", work / "c", "--config", config),
        _cli("reshard", _state(name), "--dp", 3, "--out", work / "d", "--config", config),
        _cli("push", _state(name), "--repo", "org/x", "--dry-run", "--json", "--config", config),
    ]
    for res in runs:
        if case == "missing":  # a path that does not exist is a usage error, caught while parsing
            assert res.exit_code == 2 and "does not exist" in res.stderr, res.output
        else:
            _one_error_line(res, 1, needle)
    error = json.loads(runs[-1].stdout)["error"]  # --json: the failure as one JSON object on stdout
    assert error["exit_code"] == runs[-1].exit_code and (case == "missing" or needle in error["message"])

    assert list(work.iterdir()) == []  # no output folder, no partial sibling
    assert sorted(p.name for p in _state(name).parent.iterdir()) == ["checkpoint", "meta.json", "model_config",
                                                                    "reference"]  # fmt: skip
    assert tree_digest(_state(name)) == before


# --- reshard ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_reshard_with_config_maps_rng_files_by_rank_and_consolidates_identically(name, dp, tmp_path):
    state = _state(name)
    out = tmp_path / f"dp{dp}"
    result = reshard(state, out, dp=dp, config=_model_config(name))
    assert result.dp_from == 2 and result.dp_to == dp and result.tag == "pytorch_model"

    source = json.loads((_model_config(name) / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == source
    gen = (_model_config(name) / "generation_config.json").read_bytes()
    assert (out / "generation_config.json").read_bytes() == gen
    assert (out / "latest").read_text() == "pytorch_model"
    assert (out / "scheduler.bin").read_bytes() == (state / "scheduler.bin").read_bytes()
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (out / script).read_bytes() == (state / script).read_bytes()

    rng = sorted(p.name for p in out.glob("random_states_*.pkl"))
    assert rng == [f"random_states_{r}.pkl" for r in range(min(dp, 2))]  # kept for ranks that exist, none for new
    for n in rng:
        assert (out / n).read_bytes() == (state / n).read_bytes()
    assert any(n.startswith("RNG states") for n in result.notes), result.notes

    rank_files = sorted(p.name for p in (out / "pytorch_model").glob("*optim_states.pt"))
    assert len(rank_files) == dp

    ours = consolidate(out, tmp_path / "hf_resharded")  # config.json is in the folder now: no --config needed
    assert not [n for n in ours.notes if "--config" in n]
    theirs = consolidate(state, tmp_path / "hf_original", config=_model_config(name))
    assert _files(tmp_path / "hf_resharded") == _files(tmp_path / "hf_original")
    assert ours.files == theirs.files


@pytest.mark.parametrize("name", NAMES)
def test_reshard_without_config_consolidates_bit_for_bit(name, tmp_path):
    reshard(_state(name), tmp_path / "dp3", dp=3)
    assert not (tmp_path / "dp3" / "config.json").exists()
    consolidate(tmp_path / "dp3", tmp_path / "a")
    consolidate(_state(name), tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


class _Tripwire:
    """Unpickling this creates `path`: a copy of an RNG file that anyone loads leaves a trace."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_rng_files_are_never_unpickled(tmp_path):
    name = next(n for n in NAMES if fixture_meta(n)["zero_stage"] == 3)
    state = tmp_path / "checkpoint"
    shutil.copytree(_state(name), state)
    marker = tmp_path / "unpickled"
    trap = {f"random_states_{r}.pkl": pickle.dumps(_Tripwire(marker)) + bytes([r]) for r in range(2)}
    for n, data in trap.items():
        (state / n).write_bytes(data)

    for dp in (1, 3):
        reshard(state, tmp_path / f"dp{dp}", dp=dp, config=_model_config(name))
        for r in range(min(dp, 2)):
            n = f"random_states_{r}.pkl"
            assert (tmp_path / f"dp{dp}" / n).read_bytes() == trap[n]
    consolidate(state, tmp_path / "hf", config=_model_config(name))
    assert _cli("inspect", state).exit_code == 0
    assert _cli("push", state, "--repo", "org/x", "--dry-run", "--config", _model_config(name)).exit_code == 0
    assert not marker.exists()


# --- push -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_push_dry_run_with_config_lists_config_json(name):
    before = tree_digest(_state(name))
    res = _cli("push", _state(name), "--repo", "org/x", "--dry-run", "--json", "--config", _model_config(name))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dry_run"] and data["commit_url"] is None and data["verified"] and data["problems"] == []
    paths = [f["path"] for f in data["files"]]
    assert paths == ["config.json", "generation_config.json", "model.safetensors", "README.md"]
    assert data["source"]["tag"] == "pytorch_model" and data["architecture"] == "GPT2LMHeadModel"
    assert tree_digest(_state(name)) == before


def test_push_without_config_is_refused():
    res = _cli("push", _state(NAMES[0]), "--repo", "org/x", "--dry-run")
    assert res.exit_code == 1 and "no config.json" in res.stderr


# --- resume with accelerate's load_state (slow: real DeepSpeed under torchrun) --------------------------------


def _run_resume(name: str, folder: Path, dp: int, info: Path):
    from fixtures.build import ds_launch

    spec = {"zero_stage": fixture_meta(name)["zero_stage"], "dp": dp, "dtype": fixture_meta(name)["dtype"]}
    ref = FIXTURES / name / "reference" / "zero_to_fp32.safetensors"
    return ds_launch.torchrun(dp, "fixtures.build.fixture_worker",
                              ["accelerate_resume", "--spec", json.dumps(spec), "--ckpt", folder, "--ref", ref,
                               "--out", info], cwd=info.parent, timeout=600)  # fmt: skip


def _resume(name: str, folder: Path, dp: int, info: Path):
    run = _run_resume(name, folder, dp, info)
    assert run.rc == 0, run.tail()
    return [json.loads(Path(f"{info}.{r}.json").read_text()) for r in range(dp)]


@pytest.mark.slow
def test_the_original_save_state_cannot_resume_at_another_dp_size(tmp_path):
    """Why reshard: DeepSpeed refuses a ZeRO checkpoint saved at DP 2 when loaded at DP 1."""
    name = next(n for n in NAMES if fixture_meta(n)["zero_stage"] == 3)
    shutil.copytree(_state(name), tmp_path / "state")
    run = _run_resume(name, tmp_path / "state", 1, tmp_path / "info")
    assert run.rc != 0 and "DP world size of 2 but the current world size is 1" in run.output, run.tail()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dp"), [(n, 1) for n in NAMES] + [(n, 3) for n in NAMES if "z3" in n])
def test_resharded_save_state_resumes_with_accelerate_load_state(name, dp, tmp_path):
    reshard(_state(name), tmp_path / "state", dp=dp, config=_model_config(name))
    infos = _resume(name, tmp_path / "state", dp, tmp_path / "info")
    saved_epoch = fixture_meta(name)["scheduler_last_epoch"]
    for info in infos:
        assert info["num_processes"] == dp
        assert all(info["fp32_equal"].values()) and len(info["fp32_equal"]) == 28, info["fp32_equal"]
        assert info["global_steps_after_load"] == 2 and info["global_steps_after_step"] == 3
        assert info["scheduler_last_epoch_after_load"] == saved_epoch
        # AcceleratedScheduler steps the LambdaLR once per process and optimizer step
        assert info["scheduler_last_epoch_after_step"] == saved_epoch + dp
        assert info["rng_restored"] is (True if info["rank"] < 2 else None)
        assert all(math.isfinite(x) for x in info["losses_after_resume"])

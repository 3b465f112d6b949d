"""Megatron-Bridge save dirs (`iter_*` with `run_config.yaml`, train state) and NeMo 2 checkpoints (`<name>/weights/`
+ `<name>/context/`): recognised, config.json generated from the run config's `model:` section (NeMo 2: the
`config:` of `context/model.yaml`), logits equal to the model's own forward.

The fixtures (fixtures/megatron_bridge_*) were written by Megatron-Bridge 0.6.2's own `save_checkpoint` on CPU
(fixtures/build/fixture_megatron_bridge.py, TP 2 over gloo): run_config.yaml by `ConfigContainer.to_yaml`, the
train state by `torch.save`, the weights by Megatron-Core's `dist_checkpointing.save`. Neither Bridge nor
megatron-core is needed here. The damaged run configs below are the real file with one value changed.

fixtures/nemo2_llama (TP 1) and nemo2_tp2_llama (TP 2) were written by NeMo 2.7.3's own code on CPU gloo ranks
(fixtures/build/fixture_nemo2.py):
`weights/` by its MegatronCheckpointIO.save_checkpoint of `MegatronParallel.sharded_state_dict()` (names under
`module.`), `context/` by `TrainerContext.io_dump`; two checkpoints (step 4, step 9 and its `-last` copy).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpttools import consolidate
from ckpttools.errors import CheckpointNotFoundError
from ckpttools.layouts.megatron_config import RUN_CONFIG, read_run_config
from ckpttools.layouts.registry import open_checkpoint
from tests.support.megatron import FIXTURES, ckpt_cli, logits_error, run_folder

BRIDGE_LLAMA, BRIDGE_QWEN3_TIED = "megatron_bridge_tp2_llama", "megatron_bridge_tp2_qwen3_tied"
ITER = "iter_0000003"
TOLERANCE = 1e-5


def _copy(tmp_path: Path, name: str = BRIDGE_LLAMA) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run_folder(name), run)
    return run


def _edit_run_config(run: Path, old: str, new: str) -> None:
    path = run / ITER / RUN_CONFIG
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def _one_error_line(r: object) -> str:
    stderr = getattr(r, "stderr", "")
    assert getattr(r, "returncode", 0) == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_bridge_save_dir_is_recognised_with_its_run_config() -> None:
    ckpt = open_checkpoint(run_folder(BRIDGE_LLAMA))
    details = ckpt.layout.details
    assert ckpt.layout.kind == "megatron" and details["source"] == "Megatron-Bridge"
    assert ckpt.location.tag == ITER and ckpt.global_steps == 3 and details["args_from"] == RUN_CONFIG
    args = details["args"]
    assert (args["hidden_size"], args["num_query_groups"], args["vocab_size"], args["padded_vocab_size"]) == (
        32, 2, 61, 64)  # fmt: skip
    assert args["swiglu"] and args["untie_embeddings_and_output_weights"] and args["group_query_attention"]
    assert args["params_dtype"] == "float32" and args["activation_func"] == "torch.nn.functional.silu"
    assert (ckpt.layout.tp, ckpt.layout.dp) == (2, 1)
    assert open_checkpoint(run_folder(BRIDGE_LLAMA) / ITER).location.tag == ITER  # the iteration folder itself


def test_inspect_names_megatron_bridge() -> None:
    r = ckpt_cli("inspect", str(run_folder(BRIDGE_LLAMA)))
    assert r.returncode == 0, r.stderr
    assert "Megatron-Bridge" in r.stdout and "iteration 3" in r.stdout and "(run_config.yaml)" in r.stdout
    assert "maps to        megatron-core -> LlamaForCausalLM" in r.stdout, r.stdout


@pytest.mark.parametrize(("name", "arch", "tied"), [(BRIDGE_LLAMA, "LlamaForCausalLM", False),
                                                    (BRIDGE_QWEN3_TIED, "Qwen3ForCausalLM", True)])  # fmt: skip
def test_consolidated_logits_equal_the_models_forward(tmp_path: Path, name: str, arch: str, tied: bool) -> None:
    result = consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and config["vocab_size"] == 61  # the provider padded 61 -> 64
    assert config["tie_word_embeddings"] is tied
    assert any("generated from the run's arguments" in n for n in result.notes)
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


def test_the_train_state_chooses_the_iteration_without_a_tracker(tmp_path: Path) -> None:
    """An older Bridge wrote no latest_checkpointed_iteration.txt: latest_train_state.pt's step (3) is the one,
    not the newest folder (a later, unfinished copy)."""
    run = _copy(tmp_path)
    (run / "latest_checkpointed_iteration.txt").unlink()
    shutil.copytree(run / ITER, run / "iter_0000005")
    assert open_checkpoint(run).location.tag == ITER
    assert open_checkpoint(run, step=5).location.tag == "iter_0000005"
    shutil.rmtree(run / ITER)
    with pytest.raises(CheckpointNotFoundError, match="names step 3"):
        open_checkpoint(run)


def test_garbage_run_config_is_one_line_and_exit_1(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    (run / ITER / RUN_CONFIG).write_text("model: [unclosed\n  : : :\n")
    r = ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o"))
    line = _one_error_line(r)
    assert RUN_CONFIG in line and "not plain YAML" in line and "--config" in line, line
    assert not (tmp_path / "o").exists()
    info = ckpt_cli("inspect", str(run))
    assert info.returncode == 0 and "run arguments  none" in info.stdout, info.stdout + info.stderr


def test_python_tags_in_the_run_config_are_not_executed(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    marker = tmp_path / "executed"
    path = run / ITER / RUN_CONFIG
    path.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n" + path.read_text())
    r = ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o"))
    line = _one_error_line(r)
    assert RUN_CONFIG in line and "python/object" in line, line
    assert not marker.exists()


def test_an_activation_without_a_mapping_is_refused(tmp_path: Path) -> None:
    """A gated GeLU (GeGLU) has no Megatron-LM flag the adapters map: refused, never written as SwiGLU."""
    run = _copy(tmp_path)
    _edit_run_config(run, "_target_: torch.nn.functional.silu", "_target_: torch.nn.functional.gelu")
    line = _one_error_line(ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o")))
    assert "activation torch.nn.functional.gelu with gated linear units" in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [("layernorm_zero_centered_gamma: false", "layernorm_zero_centered_gamma: true", "zero-centered norm"),
     ("normalization: RMSNorm", "normalization: LayerNorm", "input_layernorm.bias"),  # StableLM: no such bias
     ("rotary_interleaved: false", "rotary_interleaved: true", "interleaved rotary"),
     ("share_embeddings_and_output_weights: false", "share_embeddings_and_output_weights: true", "output_layer")],
)  # fmt: skip
def test_what_the_adapter_refuses_reaches_it(tmp_path: Path, old: str, new: str, said: str) -> None:
    """Bridge's field names translated: the adapter's own refusals apply (never a silently wrong config)."""
    run = _copy(tmp_path)
    _edit_run_config(run, old, new)
    line = _one_error_line(ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o")))
    assert said in line, line
    assert not (tmp_path / "o").exists()


def test_the_translation_table() -> None:
    args = read_run_config(run_folder(BRIDGE_QWEN3_TIED) / ITER / RUN_CONFIG)
    assert args["qk_layernorm"] and not args["untie_embeddings_and_output_weights"]
    assert args["num_experts"] is None and args["use_rope_scaling"] is False  # num_moe_experts, rope_scaling
    assert (args["rotary_base"], args["layernorm_epsilon"], args["normalization"]) == (1000000, 1e-6, "RMSNorm")
    assert "transformer_layer_spec" not in args  # a module spec, not a value


@pytest.mark.parametrize("name", [BRIDGE_LLAMA, BRIDGE_QWEN3_TIED])
def test_tensors_equal_megatron_bridges_own_export(tmp_path: Path, name: str) -> None:
    """AutoBridge.export_ckpt of the same checkpoint (run by the builder, on CPU): every tensor equal. Bridge keeps
    the provider's padded vocabulary rows (64) while its config.json says 61; ckpt drops them: the rows kept are
    equal."""
    import torch
    from safetensors.torch import load_file

    consolidate(run_folder(name), tmp_path / "hf")
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    theirs = load_file(run_folder(name).parent / "reference" / "bridge_export.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key][: tensor.shape[0]]), key
    assert theirs["model.embed_tokens.weight"].shape[0] == 64 and ours["model.embed_tokens.weight"].shape[0] == 61


# --- NeMo 2 ------------------------------------------------------------------------------------------------------

NEMO2, NEMO2_TP2 = "nemo2_llama", "nemo2_tp2_llama"
NEMO_RUN = FIXTURES / NEMO2 / "checkpoints"
STEP4, STEP9 = "nemo2-llama--step=4-consumed_samples=40.0", "nemo2-llama--step=9-consumed_samples=80.0"
LAST = STEP9 + "-last"


def _nemo_copy(tmp_path: Path) -> Path:
    run = tmp_path / "checkpoints"
    shutil.copytree(NEMO_RUN, run)
    return run


def test_a_nemo2_run_folder_opens_its_last_checkpoint_with_the_context_config() -> None:
    ckpt = open_checkpoint(NEMO_RUN)
    details = ckpt.layout.details
    assert ckpt.layout.kind == "megatron" and details["source"] == "NeMo 2"
    assert ckpt.location.tag == LAST and ckpt.global_steps == 9 and details["args_from"] == "context/model.yaml"
    assert ckpt.location.tags == [STEP4, STEP9, LAST]
    assert "embedding.word_embeddings.weight" in ckpt.keys  # NeMo's `module.` prefix stripped
    assert not [k for k in ckpt.keys if k.startswith("module.")]
    args = details["args"]
    assert (args["hidden_size"], args["num_query_groups"], args["vocab_size"], args["padded_vocab_size"]) == (
        32, 2, 64, 64)  # fmt: skip
    assert args["swiglu"] and args["untie_embeddings_and_output_weights"] and args["rotary_base"] == 50000


@pytest.mark.parametrize("where", [STEP4, f"{STEP4}/weights"])
def test_a_nemo2_checkpoint_folder_or_its_weights(where: str) -> None:
    ckpt = open_checkpoint(NEMO_RUN / where)
    assert ckpt.location.tag == STEP4 and ckpt.global_steps == 4 and ckpt.layout.details["source"] == "NeMo 2"


def test_step_chooses_the_nemo2_checkpoint(tmp_path: Path) -> None:
    assert open_checkpoint(NEMO_RUN, step=4).location.tag == STEP4
    assert open_checkpoint(NEMO_RUN, step=9).location.tag == STEP9  # the step's own folder before its -last copy
    with pytest.raises(CheckpointNotFoundError, match="no NeMo checkpoint of step 7 \\(steps: 4, 9\\)"):
        open_checkpoint(NEMO_RUN, step=7)
    run = _nemo_copy(tmp_path)
    shutil.rmtree(run / LAST)
    shutil.copytree(run / STEP4, run / STEP4.replace("step=4", "step=12"))
    assert open_checkpoint(run).global_steps == 12  # without -last: the highest step


def test_inspect_names_nemo2() -> None:
    r = ckpt_cli("inspect", str(NEMO_RUN))
    assert r.returncode == 0, r.stderr
    assert "(NeMo 2, Megatron-Core torch_dist, iteration 9)" in r.stdout and "(context/model.yaml)" in r.stdout
    assert "maps to        megatron-core -> LlamaForCausalLM" in r.stdout, r.stdout


@pytest.mark.parametrize(("name", "where"), [(NEMO2, ""), (NEMO2, f"{STEP9}/weights"), (NEMO2_TP2, "")])
def test_nemo2_logits_equal_the_models_forward(tmp_path: Path, name: str, where: str) -> None:
    ckpt = open_checkpoint(FIXTURES / name / "checkpoints" / where)
    assert ckpt.layout.tp == (2 if name == NEMO2_TP2 else 1) and ckpt.layout.details["world_size"] == ckpt.layout.tp
    consolidate(FIXTURES / name / "checkpoints" / where, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 64
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


def test_nemo2_step_4_is_another_model(tmp_path: Path) -> None:
    """The reference is step 9's forward: step 4's weights (chosen by --step) are not it."""
    consolidate(NEMO_RUN, tmp_path / "hf", step=4)
    assert logits_error(tmp_path / "hf", NEMO2) > 0.1


def test_garbage_nemo2_context_is_one_line_and_exit_1(tmp_path: Path) -> None:
    run = _nemo_copy(tmp_path)
    (run / LAST / "context" / "model.yaml").write_text("config: [unclosed\n  : : :\n")
    line = _one_error_line(ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o")))
    assert "model.yaml" in line and "not plain YAML" in line and "--config" in line, line
    assert not (tmp_path / "o").exists()


def test_python_tags_in_the_nemo2_context_are_not_executed(tmp_path: Path) -> None:
    run = _nemo_copy(tmp_path)
    marker = tmp_path / "executed"
    path = run / LAST / "context" / "model.yaml"
    path.write_text(f"config: !!python/object/apply:os.system ['touch {marker}']\n")
    line = _one_error_line(ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o")))
    assert "model.yaml" in line and "python/object" in line, line
    assert not marker.exists()


def test_a_nemo2_checkpoint_without_its_model_yaml_needs_config(tmp_path: Path) -> None:
    run = _nemo_copy(tmp_path)
    (run / LAST / "context" / "model.yaml").unlink()
    info = ckpt_cli("inspect", str(run))
    assert info.returncode == 0 and "model.yaml is missing" in info.stdout, info.stdout + info.stderr
    r = ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--config" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_a_nemo2_vocabulary_set_by_the_tokenizer_keeps_the_padded_rows(tmp_path: Path) -> None:
    """NeMo's config leaves vocab_size null when a tokenizer sets it (the real model.yaml, that value changed):
    the embedding's rows are the padded vocabulary, kept with a note, never guessed smaller."""
    run = _nemo_copy(tmp_path)
    path = run / LAST / "context" / "model.yaml"
    path.write_text(path.read_text().replace("  vocab_size: 64\n", "  vocab_size: null\n", 1))
    args = open_checkpoint(run).layout.details["args"]
    assert args["vocab_size"] is None and args["padded_vocab_size"] == 64
    result = consolidate(run, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 64
    assert any("padded vocabulary" in n for n in result.notes), result.notes
    assert logits_error(tmp_path / "hf", NEMO2) <= TOLERANCE

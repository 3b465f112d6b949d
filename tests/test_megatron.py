"""Megatron-Core `torch_dist` input mapped to Hugging Face names, against Megatron's own forward.

The fixtures (fixtures/megatron_*) were saved by megatron-core 0.19.2 itself (fixtures/build/fixture_megatron.py,
tensor-parallel 2 over gloo on CPU); each carries the logits of the Megatron model's forward on a fixed input. The
oracle is behaviour: the model transformers builds from `ckpt consolidate`'s output gives the same logits (fp32,
<= 1e-5). Negative controls (a naive QKV split, gate/up swapped) must fail the same comparison. megatron-core is not
needed here: only the committed folders are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpttools import consolidate
from ckpttools.adapters import ConfigNeededError, MappingError, adapt, megatron_gpt
from ckpttools.adapters.segments import grouped_rows, split_rows
from ckpttools.errors import VerificationError
from ckpttools.layouts.dcp.metadata import parse_metadata
from ckpttools.layouts.megatron import is_weight
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops import consolidate as consolidate_module
from tests.support.megatron import ckpt_cli, logits_error, run_folder

from .conftest import FIXTURES

LLAMA, NOARGS, QWEN3 = "megatron_tp2_llama", "megatron_tp2_llama_noargs", "megatron_tp2_qwen3"
ADAM, ADAM_FULL = "megatron_tp2_llama_adam", "megatron_tp2_llama_adam_full"  # distributed optimizer state saved
MOE = "megatron_tp2_qwen3_moe"  # 4 experts top-2 on every layer, grouped [L, E, 2F, H] expert stacks
COMMON_PT = "megatron_tp2_llama_commonpt"  # the args in common.pt (megatron-core < 0.19's layout)
TIED = "megatron_tp2_llama_tied"  # output layer tied to the embedding: no output_layer saved
PP2 = "megatron_tp2_pp2_llama"  # 4 layers over 2 pipeline stages: each stage saved its slice of the layer axis
TOLERANCE = 1e-5


def test_metadata_with_megatron_save_plans_is_read() -> None:
    path = run_folder(LLAMA) / "iter_0000002" / ".metadata"
    meta = parse_metadata(path.read_bytes(), str(path))  # holds all_local_plans (SavePlan, WriteItem, ...)
    assert "decoder.layers.self_attention.linear_qkv.weight" in meta.tensors
    assert any(fqn.startswith("common_state/") for fqn in meta.byte_storage)


def test_reads_the_tracked_iteration_with_the_runs_args() -> None:
    ckpt = open_checkpoint(run_folder(LLAMA))
    assert ckpt.layout.kind == "megatron"
    assert (ckpt.layout.tp, ckpt.layout.dp) == (2, 1)
    assert ckpt.location.tag == "iter_0000002" and ckpt.global_steps == 2
    assert not [k for k in ckpt.keys if "_extra_state" in k or k.startswith("common_state")]
    assert ckpt.masters["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 64, 32)
    args = ckpt.layout.details["args"]
    assert (args["hidden_size"], args["num_query_groups"], args["padded_vocab_size"]) == (32, 2, 64)
    assert args["params_dtype"] == "float32" and args["exit_signal"] == "signal.Signals(15)"  # inert records


def test_pipeline_stages_read_as_one_layer_stack() -> None:
    ckpt = open_checkpoint(run_folder(PP2))
    assert (ckpt.layout.tp, ckpt.layout.pp) == (2, 2) and ckpt.layout.details["world_size"] == 4
    assert ckpt.masters["decoder.layers.mlp.linear_fc1.weight"].shape == (4, 96, 32)


def test_the_tracker_file_chooses_the_iteration(tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "checkpoint"
    shutil.copytree(run_folder(LLAMA), run)
    (run / "latest_checkpointed_iteration.txt").write_text("5")  # names a save that is not there
    r = ckpt_cli("consolidate", str(run), "--out", str(tmp_path / "o"))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "iteration 5" in last and "--step" in last, r.stderr
    assert open_checkpoint(run, step=2).location.tag == "iter_0000002"
    assert open_checkpoint(run / "iter_0000002").location.tag == "iter_0000002"  # the iteration folder itself


def test_which_keys_are_weights() -> None:
    assert is_weight("decoder.layers.mlp.linear_fc1.weight")
    for fqn in ("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2", "common_state/shard_0_1",
                "rng_state/shard_0.0_1", "optimizer.state.exp_avg.decoder.final_layernorm.weight",
                "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_0.param"):  # fmt: skip
        assert not is_weight(fqn), fqn


@pytest.mark.parametrize(("name", "layout"), [(ADAM, "per-bucket"), (ADAM_FULL, "per-parameter")])
def test_optimizer_state_is_not_read_as_weights(name: str, layout: str) -> None:
    ckpt = open_checkpoint(run_folder(name))
    assert len(ckpt.keys) == 9 and not [k for k in ckpt.keys if k.startswith("optimizer")]
    r = ckpt_cli("inspect", str(run_folder(name)))
    assert r.returncode == 0 and layout in r.stdout and "exp_avg_sq" in r.stdout, r.stdout + r.stderr


def test_inspect_tells_megatron_from_fsdp2() -> None:
    r = ckpt_cli("inspect", str(run_folder(LLAMA)))
    assert r.returncode == 0, r.stderr
    assert "Megatron-Core torch_dist" in r.stdout and "FSDP2" not in r.stdout
    assert "TP 2" in r.stdout and "maps to        megatron-core -> LlamaForCausalLM" in r.stdout
    info = json.loads(ckpt_cli("inspect", str(run_folder(NOARGS)), "--json").stdout)
    assert info["adapter"].startswith("megatron-core: needs --config")
    docs = (FIXTURES.parent / "docs" / "json.md").read_text()
    parallel_row = next(row for row in docs.splitlines() if row.startswith("| inspect | `parallel`"))
    assert "`adapter`" in docs and all(f"`{key}`" in parallel_row for key in info["parallel"]), info["parallel"]


@pytest.mark.parametrize(
    ("name", "arch"),
    [(LLAMA, "LlamaForCausalLM"), (QWEN3, "Qwen3ForCausalLM"), (ADAM, "LlamaForCausalLM"),
     (ADAM_FULL, "LlamaForCausalLM"), (PP2, "LlamaForCausalLM"), (MOE, "Qwen3MoeForCausalLM"),
     (COMMON_PT, "LlamaForCausalLM"), (TIED, "LlamaForCausalLM")],
)  # fmt: skip
def test_consolidated_logits_equal_megatrons(tmp_path: Path, name: str, arch: str) -> None:
    result = consolidate(run_folder(name), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and config["vocab_size"] == 61  # padded 64 -> the run's 61
    assert any("generated from the run's arguments" in n for n in result.notes)
    assert logits_error(tmp_path / "hf", name) <= TOLERANCE


def test_a_generated_config_is_key_checked_like_any_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config.json generated from the run's arguments has no file until the output is published: the key check
    builds the class from a private copy of it (it once looked for the checkpoint's own config.json, found none,
    and only noted 'keys not checked'); --check-keys with a generated config runs instead of exiting 1."""
    result = consolidate(run_folder(LLAMA), tmp_path / "hf", check_keys=True)
    assert not any("keys not checked" in n for n in result.notes), result.notes
    seen: list[Path] = []
    real = consolidate_module.hf.KeyCheck

    def wrong_class(config: Path, shapes: Any) -> Any:  # the check reads the generated config, made Qwen3's here
        seen.append(config)
        data = json.loads(config.read_text())
        config.write_text(json.dumps({**data, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
        return real(config, shapes)

    monkeypatch.setattr(consolidate_module.hf, "KeyCheck", wrong_class)
    with pytest.raises(VerificationError, match="do not match Qwen3ForCausalLM"):
        consolidate(run_folder(LLAMA), tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    assert seen and not seen[0].exists(), "the private copy of the config is left behind"


def test_verify_against_the_megatron_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    consolidate(run_folder(MOE), tmp_path / "hf")
    r = ckpt_cli("verify", str(tmp_path / "hf"), "--against", str(run_folder(MOE)))
    assert r.returncode == 0 and "all 25 tensors bit-identical" in r.stdout + r.stderr, r.stdout + r.stderr
    targets, _ = megatron_gpt.LAYER["self_attention.linear_qkv.weight"]
    monkeypatch.setitem(megatron_gpt.LAYER, "self_attention.linear_qkv.weight", (targets, _naive_qkv))
    consolidate(run_folder(LLAMA), tmp_path / "naive")  # written with the wrong split: verify must not vouch for it
    monkeypatch.undo()
    r = ckpt_cli("verify", str(tmp_path / "naive"), "--against", str(run_folder(LLAMA)))
    assert r.returncode == 1 and "q_proj" in r.stdout + r.stderr


def test_without_args_needs_config(tmp_path: Path) -> None:
    r = ckpt_cli("consolidate", str(run_folder(NOARGS)), "--out", str(tmp_path / "hf"))
    assert r.returncode == 1 and r.stderr.count("\n") <= 3, r.stderr
    assert "--config" in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr
    assert not (tmp_path / "hf").exists()


def test_without_args_with_config(tmp_path: Path) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "ref")
    consolidate(run_folder(NOARGS), tmp_path / "hf", config=tmp_path / "ref" / "config.json")
    assert logits_error(tmp_path / "hf", NOARGS) <= TOLERANCE


@pytest.mark.parametrize(
    ("field", "value", "tensor"),
    [("intermediate_size", 40, "decoder.layers.mlp.linear_fc1.weight"),
     ("num_key_value_heads", 4, "decoder.layers.self_attention.linear_qkv.weight"),
     ("num_hidden_layers", 3, "decoder.layers."),
     ("vocab_size", 65, "embedding.word_embeddings.weight")],
)  # fmt: skip
def test_a_config_not_the_runs_is_refused_naming_the_tensor(
    tmp_path: Path, field: str, value: int, tensor: str
) -> None:
    consolidate(run_folder(LLAMA), tmp_path / "ref")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, field: value}))
    r = ckpt_cli(
        "consolidate", str(run_folder(LLAMA)), "--out", str(tmp_path / "hf"), "--config", str(tmp_path / "wrong")
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and tensor in last, r.stderr
    assert not (tmp_path / "hf").exists()


def _naive_qkv(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    """q, k, v as three consecutive blocks (ignoring Megatron's per-group interleave)."""
    return split_rows(src, (d.heads * d.head_dim, d.groups * d.head_dim, d.groups * d.head_dim), names)


def _swapped_halves(src: Any, names: tuple[str, ...], d: Any) -> list[Any]:
    return megatron_gpt.halves(src, (names[1], names[0]), d)


@pytest.mark.parametrize(
    ("key", "op"), [("self_attention.linear_qkv.weight", _naive_qkv), ("mlp.linear_fc1.weight", _swapped_halves)]
)
def test_negative_controls_fail_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, op: Any
) -> None:
    targets, _ = megatron_gpt.LAYER[key]
    monkeypatch.setitem(megatron_gpt.LAYER, key, (targets, op))
    consolidate(run_folder(LLAMA), tmp_path / "hf")
    assert logits_error(tmp_path / "hf", LLAMA) > 1e-2  # the comparison catches a wrong mapping


def test_the_adapter_reads_no_bytes_and_keeps_segments() -> None:
    mapped = adapt(open_checkpoint(run_folder(LLAMA)), None)
    assert mapped is not None and mapped.adapter == "megatron-core -> LlamaForCausalLM"
    sources = {s.name: s for s in mapped.checkpoint.sources(mapped.checkpoint.train_dtype)}
    q = sources["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == (32, 32) and sum(seg.count for seg in q.segments) == 32 * 32
    assert "lm_head.weight" in sources and sources["lm_head.weight"].shape == (61, 32)


def test_pieces_that_do_not_tile_are_refused() -> None:
    src = open_checkpoint(run_folder(LLAMA)).masters["decoder.final_layernorm.weight"]
    with pytest.raises(MappingError, match=r"decoder\.final_layernorm\.weight"):
        split_rows(src, (16, 15), ("a", "b"))
    with pytest.raises(MappingError, match=r"decoder\.final_layernorm\.weight"):
        grouped_rows(src, 3, (5, 5), ("a", "b"))


def test_a_missing_weight_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = open_checkpoint(run_folder(LLAMA))
    monkeypatch.setattr(ckpt, "keys", [k for k in ckpt.keys if k != "decoder.layers.mlp.linear_fc2.weight"])
    monkeypatch.setattr(ckpt, "params", [p for p in ckpt.params if p.name != "decoder.layers.mlp.linear_fc2.weight"])
    with pytest.raises(MappingError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        adapt(ckpt, None)


def test_no_args_no_config_raises() -> None:
    with pytest.raises(ConfigNeededError, match="--config"):
        adapt(open_checkpoint(run_folder(NOARGS)), None)

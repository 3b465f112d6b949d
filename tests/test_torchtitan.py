"""torchtitan `step-N` checkpoints mapped to LlamaForCausalLM, against torchtitan's own model and adapter.

The fixture (fixtures/torchtitan_llama3_step2) was saved by torchtitan 0.3.0's CheckpointManager
(fixtures/build/fixture_torchtitan.py); it carries the logits of torchtitan's forward and the output of torchtitan's
own `Llama3StateDictAdapter.to_hf` (which materialises every tensor; ours streams segments). torchtitan is not
needed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools import consolidate
from ckpttools.adapters import torchtitan_llama
from ckpttools.adapters.segments import renamed

from .conftest import FIXTURES

FIXTURE = FIXTURES / "torchtitan_llama3_step2"
RUN, CONFIG = FIXTURE / "checkpoint", FIXTURE / "reference" / "config.json"
QWEN3 = FIXTURES / "torchtitan_qwen3_step2"  # qk-norm, cos/sin RoPE (no permutation), tied embeddings


def _logits_error(out: Path, fixture: Path = FIXTURE) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = load_file(fixture / "reference" / "logits.safetensors")
    with torch.no_grad():
        return float((model(ref["input_ids"]).logits - ref["logits"]).abs().max())


@pytest.mark.parametrize("fixture", [FIXTURE, QWEN3], ids=["llama3", "qwen3"])
def test_equal_to_torchtitans_own_to_hf_and_its_logits(tmp_path: Path, fixture: Path) -> None:
    consolidate(fixture / "checkpoint", tmp_path / "hf", config=fixture / "reference" / "config.json")
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    theirs = load_file(fixture / "reference" / "hf_state.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)  # Llama's wq/wk RoPE permutation included
    assert _logits_error(tmp_path / "hf", fixture) <= 1e-5


def test_verify_against_the_torchtitan_checkpoint(tmp_path: Path) -> None:
    consolidate(RUN, tmp_path / "hf", config=CONFIG)
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "verify", str(tmp_path / "hf"), "--against", str(RUN)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "all 21 tensors bit-identical" in r.stdout + r.stderr, r.stdout + r.stderr


def test_without_the_rope_permutation_the_logits_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchtitan_llama, "permuted_rows", lambda src, order, name: renamed(src, name))
    consolidate(RUN, tmp_path / "hf", config=CONFIG)
    assert _logits_error(tmp_path / "hf") > 1e-2  # the negative control: the comparison catches it


def test_qwen3_rows_are_not_permuted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchtitan_llama, "PERMUTED", ("LlamaForCausalLM", "Qwen3ForCausalLM"))
    consolidate(QWEN3 / "checkpoint", tmp_path / "hf", config=QWEN3 / "reference" / "config.json")
    assert _logits_error(tmp_path / "hf", QWEN3) > 1e-2  # permuting Qwen3's rows as Llama's would be wrong


def test_rope_order_is_torchtitans_permute() -> None:
    w = torch.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8
    theirs = w.view(2, 4, 2, 3).transpose(1, 2).reshape(16, 3)  # torchtitan's Llama3StateDictAdapter._permute
    assert torch.equal(w[torchtitan_llama.rope_order(2, 8)], theirs)


def test_without_config_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "consolidate", str(RUN), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("Error: ") and "--config" in last and "torchtitan" in last
    assert not (tmp_path / "o").exists()


def test_a_config_not_the_runs_is_refused(tmp_path: Path) -> None:
    config = json.loads(CONFIG.read_text())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    r = subprocess.run([sys.executable, "-m", "ckpttools.cli", "consolidate", str(RUN), "--out", str(tmp_path / "o"),
                        "--config", str(tmp_path / "c")], capture_output=True, text=True)  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "layers.0.attention.qkv_linear.wk.weight" in last, r.stderr
    assert not (tmp_path / "o").exists()

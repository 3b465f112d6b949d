"""What the Megatron-Core and torchtitan adapter tests share: a fixture's checkpoint folder, the oracle (the largest
logits difference between the Hugging Face model built from an output and the trainer's own forward, stored with
the fixture), and `ckpt` as a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parent.parent.parent / "fixtures"


def run_folder(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def logits_error(out: Path, name: str) -> float:
    """Largest |HF logits - trainer logits| over the fixture's input (padded vocabulary columns left out)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = load_file(FIXTURES / name / "reference" / "logits.safetensors")
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    return float((logits - ref["logits"][..., : logits.shape[-1]]).abs().max())


def ckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckpttools.cli", *args], capture_output=True, text=True)

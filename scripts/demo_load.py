"""Load a consolidated folder with from_pretrained and print a short report (used by scripts/demo)."""

import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.set_verbosity_error()
logging.disable_progress_bar()
folder = sys.argv[1]
loaded: Any = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)  # (model, loading info)
model, info = loaded
tokenizer = AutoTokenizer.from_pretrained(folder)
problems = {k: v for k, v in info.items() if v}
params = sum(p.numel() for p in model.parameters())
print(f"model      {type(model).__name__}, {params:,} parameters, dtype {model.dtype}")
print(f"loading    {problems or 'no missing, unexpected or mismatched keys'}")
print(f"tied       lm_head shares wte: {model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()}")
ids = tokenizer("the quick brown fox", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(f"generate   {tokenizer.decode(out[0])!r}")
sys.exit(1 if problems else 0)

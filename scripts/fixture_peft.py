"""PEFT/LoRA fixtures for scripts/make_fixtures.py: real DeepSpeed runs of a PEFT model, PEFT's own outputs beside.

Run by make_fixtures as `torchrun --nproc_per_node <world_size> scripts/fixture_peft.py build --spec <json> --out
<dir>`. Two kinds of run:

  trainer  the HF Trainer + DeepSpeed on a PeftModel (Trainer saves PEFT runs with exclude_frozen_parameters=True,
           so the checkpoint holds the adapters only); the checkpoint is <dir>/out/checkpoint-2.
  engine   a bare deepspeed.initialize on a PeftModel, engine.save_checkpoint(<dir>/checkpoint) with the frozen base
           (ZeRO-2/3 frozen_param_fragments), the adapter_config.json of each adapter saved beside it.

Every fixture also holds <dir>/base/ (the base model's save_pretrained before PEFT wrapped it, fp32) and, in
<dir>/reference/: bit16/full_state (the live engine's 16-bit state dict and fp32 masters, as every fixture),
adapter/ (PeftModel.save_pretrained of the live model with the gathered fp32 masters as its state_dict),
merged_fp32.safetensors / merged_bf16.safetensors (merge_and_unload() of the PEFT model rebuilt from base/ with the
fp32 masters, in fp32 and cast to bf16 with .to(torch.bfloat16), on CPU) and, for engine runs,
merged_fp32_ckptbase.safetensors (the same in fp32 but with the checkpoint's bf16 base weights upcast).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fixture_worker import (  # noqa: E402
    SEED,
    TinyDataset,
    build_tokenizer,
    common_meta,
    engine_param_groups,
    finish_distributed,
    inspect_optim_file,
    model_facts,
    quiet_loggers,
    rank,
    save_st,
    tiny_gpt2_config,
    write_engine_references,
)

STEPS = 2
KIND = "peft"

GPT2_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True, "lora_dropout": 0.0}
LLAMA_LORA = {"r": 4, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": True,
              "lora_dropout": 0.0}  # fmt: skip


def specs() -> list[dict]:
    return [
        {
            "name": "peft_trainer_z2_bf16",
            "kind": KIND,
            "mode": "trainer",
            "world_size": 2,
            "zero_stage": 2,
            "dp": 2,
            "dtype": "bf16",
            "model": "gpt2",
            "checkpoint": "out/checkpoint-2",
            "adapters": {"default": {**GPT2_LORA, "modules_to_save": ["ln_f"]}},
            "notes": "HF Trainer + PEFT LoRA (GPT-2 Conv1D c_attn: fan_in_fan_out; modules_to_save ln_f), ZeRO-2; the "
            "Trainer saved it with exclude_frozen_parameters=True: adapters only, base from base/.",
        },
        {
            "name": "peft_trainer_z3_bf16",
            "kind": KIND,
            "mode": "trainer",
            "world_size": 2,
            "zero_stage": 3,
            "dp": 2,
            "dtype": "bf16",
            "model": "llama",
            "checkpoint": "out/checkpoint-2",
            "gather": False,
            "adapters": {"default": {**LLAMA_LORA, "modules_to_save": ["lm_head"]}},
            "notes": "HF Trainer + PEFT rsLoRA on a tiny untied Llama (q/v/down_proj; modules_to_save lm_head), ZeRO-3 "
            "without stage3_gather_16bit_weights_on_model_save: exclude_frozen_parameters=True, adapters only.",
        },
        {
            "name": "peft_engine_z2_bf16",
            "kind": KIND,
            "mode": "engine",
            "world_size": 2,
            "zero_stage": 2,
            "dp": 2,
            "dtype": "bf16",
            "model": "gpt2",
            "adapters": {
                "default": dict(GPT2_LORA),
                "second": {
                    "r": 2,
                    "lora_alpha": 4,
                    "target_modules": ["c_fc"],
                    "fan_in_fan_out": True,
                    "use_rslora": True,
                    "lora_dropout": 0.0,
                },
            },
            "notes": "bare DeepSpeed engine on a PeftModel with TWO trained adapters (default on c_attn, second on "
            "c_fc, both active), ZeRO-2, saved with the frozen base (frozen_param_fragments).",
        },
        {
            "name": "peft_engine_z1_bf16",
            "kind": KIND,
            "mode": "engine",
            "world_size": 2,
            "zero_stage": 1,
            "dp": 2,
            "dtype": "bf16",
            "model": "gpt2",
            "adapters": {"default": {**GPT2_LORA, "modules_to_save": ["ln_f"]}},
            "notes": "bare DeepSpeed engine on a PeftModel (modules_to_save ln_f), ZeRO-1: the frozen base lives only "
            "in the module's 16-bit state dict.",
        },
        {
            "name": "peft_engine_z3_bf16",
            "kind": KIND,
            "mode": "engine",
            "world_size": 2,
            "zero_stage": 3,
            "dp": 2,
            "dtype": "bf16",
            "model": "llama",
            "adapters": {"default": {**LLAMA_LORA, "modules_to_save": ["lm_head"]}},
            "notes": "bare DeepSpeed engine on a PeftModel (rsLoRA, modules_to_save lm_head), ZeRO-3, saved with the "
            "frozen base as ZeRO-3 frozen fragments.",
        },
    ]


def build_base(spec: dict, tokenizer):
    from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    if spec["model"] == "gpt2":
        return GPT2LMHeadModel(tiny_gpt2_config(tokenizer))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(config)


def build_peft(base, spec: dict):
    """The PEFT model: the first adapter through get_peft_model, the others with add_adapter; all adapters active
    (so all trained) when there are several."""
    from peft import LoraConfig, get_peft_model

    names = list(spec["adapters"])
    model: Any = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **spec["adapters"][names[0]]), names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(task_type="CAUSAL_LM", **spec["adapters"][name]))
    if len(names) > 1:
        model.base_model.set_adapter(names)  # LoraModel: several active adapters, each trainable
    return model


def ds_config(spec: dict, trainer: bool) -> dict:
    zero = {"stage": spec["zero_stage"]}
    if spec["zero_stage"] == 3:
        zero.update({"stage3_gather_16bit_weights_on_model_save": bool(spec.get("gather", True)),
                     "stage3_param_persistence_threshold": 0, "sub_group_size": 1000})  # fmt: skip
    if trainer:
        return {
            "zero_optimization": zero,
            "bf16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
    return {"zero_optimization": zero, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}  # fmt: skip


def train_with_trainer(model, tokenizer, spec: dict, out: Path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out / "out"), use_cpu=True, bf16=True, deepspeed=ds_config(spec, True),
        per_device_train_batch_size=2, max_steps=STEPS, save_strategy="steps", save_steps=STEPS, logging_steps=1,
        report_to=[], learning_rate=1e-2, weight_decay=0.01, seed=SEED, data_seed=SEED, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(tokenizer), processing_class=tokenizer)
    quiet_loggers()
    trainer.train()
    return trainer.model_wrapped


def train_with_engine(model, tokenizer, spec: dict, out: Path):
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(spec, False))
    quiet_loggers()
    data = TinyDataset(tokenizer)
    for step in range(STEPS):
        items = [data[(2 * step + k + 4 * rank()) % len(data)] for k in range(2)]
        batch = {key: torch.stack([it[key] for it in items]) for key in items[0]}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out / "checkpoint"))
    if rank() == 0:
        for name, cfg in model.peft_config.items():  # the adapter configs beside the checkpoint, as PEFT names them
            cfg.save_pretrained(str(out / "checkpoint" / ("" if name == "default" else name)))
    return engine


def fp32_masters(engine) -> dict:
    """The trainable params' fp32 masters under their in-memory (PEFT) names; collective under ZeRO-3."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone()
            for n, p in engine.module.named_parameters() if p.requires_grad}  # fmt: skip


def rebuilt_peft(spec: dict, out: Path, masters: dict):
    """The PEFT model rebuilt from base/ (fp32) with the run's fp32 masters loaded into it."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained builds under zero.Init: collectives on rank 0 alone hang
    base = AutoModelForCausalLM.from_pretrained(str(out / "base"), dtype=torch.float32)
    model = build_peft(base, spec)
    names = dict(model.named_parameters())
    missing = sorted(set(masters) - set(names))
    if missing:
        raise RuntimeError(f"rebuilt PEFT model lacks {missing[:3]}")
    with torch.no_grad():
        for n, t in masters.items():
            names[n].copy_(t)
    return model.eval()


def merged(model, dtype: torch.dtype | None = None, bf16_base: bool = False) -> dict:
    model = copy.deepcopy(model)
    if bf16_base:
        with torch.no_grad():
            for _, p in model.named_parameters():
                if not p.requires_grad:
                    p.copy_(p.to(torch.bfloat16).float())
    if dtype is not None:
        model = model.to(dtype)
    return model.merge_and_unload().state_dict()


def listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def safetensors_keys(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in f.keys()}  # noqa: SIM118


def build(spec: dict, out: Path) -> None:
    import deepspeed

    quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    quiet_loggers()
    tokenizer = build_tokenizer()
    base = build_base(spec, tokenizer)
    if rank() == 0:
        base.save_pretrained(str(out / "base"))
        tokenizer.save_pretrained(str(out / "base"))
    model = build_peft(base, spec)
    trainer = spec["mode"] == "trainer"
    engine = (train_with_trainer if trainer else train_with_engine)(model, tokenizer, spec, out)
    write_engine_references(engine, out / "reference", spec["zero_stage"])
    masters = fp32_masters(engine)
    if rank() != 0:
        return
    ref = out / "reference"
    engine.module.save_pretrained(str(ref / "adapter"), state_dict=masters)
    rebuilt = rebuilt_peft(spec, out, masters)
    save_st(merged(rebuilt), ref / "merged_fp32.safetensors")
    save_st(merged(rebuilt, torch.bfloat16), ref / "merged_bf16.safetensors")
    if not trainer:
        save_st(merged(rebuilt, bf16_base=True), ref / "merged_fp32_ckptbase.safetensors")
    ckpt = out / spec.get("checkpoint", "checkpoint")
    tag = (ckpt / "latest").read_text().strip()
    groups, sub = engine_param_groups(engine)
    meta = {"name": spec["name"], "kind": KIND, "zero_stage": spec["zero_stage"], "dp": spec["dp"], "dtype": "bf16"}
    meta.update(common_meta(engine))
    meta.update(model_facts(engine.module, groups))
    if sub is not None:
        meta["sub_groups"] = sub
    import peft

    meta.update({
        "peft_version": peft.__version__, "mode": spec["mode"], "model": spec["model"], "adapters": spec["adapters"],
        "tag": tag, "global_steps": engine.global_steps, "checkpoint": spec.get("checkpoint", "checkpoint"),
        "exclude_frozen_parameters": trainer,  # Trainer always passes it for PEFT models (transformers trainer.py)
        "checkpoint_files": listing(ckpt),
        "reference_adapter_files": listing(ref / "adapter"),
        "reference_adapter_keys": safetensors_keys(ref / "adapter" / "adapter_model.safetensors"),
        "merged_keys": list(safetensors_keys(ref / "merged_fp32.safetensors")),
        "notes": spec.get("notes", ""),
    })  # fmt: skip
    if (ckpt / "adapter_model.safetensors").is_file():
        meta["trainer_adapter_model_keys"] = safetensors_keys(ckpt / "adapter_model.safetensors")
    meta.update(inspect_optim_file(ckpt / tag))
    (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


def save_adapters(spec: dict, out: Path) -> None:
    """tests/test_peft.py: an engine run as `build`'s, then ckpttools' save_pretrained_from_engine(adapter=True)
    into <out>/ours and PEFT's own save_pretrained of the live model (its params gathered) into <out>/peft."""
    import deepspeed

    from ckpttools.live.engine_save import save_pretrained_from_engine

    quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    quiet_loggers()
    tokenizer = build_tokenizer()
    model = build_peft(build_base(spec, tokenizer), spec)
    engine = train_with_engine(model, tokenizer, spec, out)
    result = save_pretrained_from_engine(engine, out / "ours", adapter=True)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=spec["zero_stage"] == 3):
        if rank() == 0:
            engine.module.save_pretrained(str(out / "peft"))
    if rank() == 0:
        (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "save"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    (build if a.mode == "build" else save_adapters)(json.loads(a.spec), Path(a.out).resolve())
    finish_distributed()
    return 0


if __name__ == "__main__":
    import ds_launch

    ds_launch.exit_worker(main)

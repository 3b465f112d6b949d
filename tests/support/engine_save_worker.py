"""Worker for tests/test_engine_save.py, run under torchrun (DS_ACCELERATOR=cpu, gloo). Not a test module.

    engine  --stage {2,3} --out DIR   train the toy model (tied/frozen/int buffers) and a tiny GPT-2 with
                                      bare DeepSpeed engines, save_checkpoint, then save_pretrained_from_engine
                                      (plain, sharded + small gather groups, fp32) and DeepSpeed's own 16-bit
                                      state dict as the reference; then train one more step.
    trainer --out DIR                 HF Trainer + ZeRO-3 with stage3_gather_16bit_weights_on_model_save=false
                                      and ConsolidateCallback (one without the trainer, one bound to it).

Rank 0 writes DIR/<case>/{checkpoint,hf,hf_sharded,hf_fp32,reference.safetensors,result.json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from ckpttools.live.engine_save import save_pretrained_from_engine
from fixtures.build import fixture_worker as fw

SEED = 1234


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def ds_config(stage: int, persistence: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(
            {
                "stage3_gather_16bit_weights_on_model_save": False,  # our save must not need it
                "stage3_param_persistence_threshold": persistence,
                "sub_group_size": 1000,
            }
        )
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": True},
    }


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=56, n_positions=32, bos_token_id=2, eos_token_id=2)
    return GPT2LMHeadModel(config)


def batches(kind: str, vocab: int):
    g = torch.Generator().manual_seed(SEED + 1000 * (rank() + 1))
    while True:
        ids = torch.randint(0, vocab, (2, 6), generator=g)
        targets = torch.randint(0, vocab, (2, 6), generator=g)
        yield (ids, targets) if kind == "toy" else (ids, ids)


def step(engine, kind: str, batch) -> float:
    ids, targets = batch
    loss = engine(ids, targets) if kind == "toy" else engine(input_ids=ids, labels=targets).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def released(engine) -> bool:
    """After our save every non-persistent ZeRO-3 param is partitioned again (its full tensor freed)."""
    for p in engine.module.parameters():
        if (
            hasattr(p, "ds_id")
            and not getattr(p, "ds_persist", False)
            and (p.ds_status.name != "NOT_AVAILABLE" or p.data.numel() != 0)
        ):
            return False
    return True


def error_paths(engine, out: Path) -> None:
    """Errors reach every rank instead of leaving the others blocked in a collective."""
    from ckpttools.errors import OutputError
    from ckpttools.live import engine_save

    outcome: dict[str, Any] = {}
    try:
        save_pretrained_from_engine(engine, out / "hf")  # exists: refused before any gather, on every rank
        outcome["exists"] = "no error"
    except OutputError as e:
        outcome["exists"] = type(e).__name__
    original = engine_save._ShardWriter._write_tensor

    def failing(self, entry):
        if entry.name in ("fc2.weight", "transformer.h.0.mlp.c_fc.weight"):
            raise OSError("simulated disk error")
        return original(self, entry)

    engine_save._ShardWriter._write_tensor = failing  # type: ignore[method-assign]
    try:
        save_pretrained_from_engine(engine, out / "hf_fail", max_gather_bytes=512)
        outcome["write_error"] = "no error"
    except Exception as e:  # noqa: BLE001
        outcome["write_error"] = f"{type(e).__name__}: {e}"
    finally:
        engine_save._ShardWriter._write_tensor = original  # type: ignore[method-assign]
    outcome["partial_left"] = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    (out / f"errors_rank{rank()}.json").write_text(json.dumps(outcome))


def run_case(kind: str, stage: int, out: Path) -> None:
    import deepspeed

    torch.manual_seed(SEED)
    if kind == "toy":
        model: Any = fw.ToyModel()
        decay, no_decay = fw.decay_groups(model.named_parameters())
        params = [{"params": [p for _, p in decay]}, {"params": [p for _, p in no_decay], "weight_decay": 0.0}]
        vocab = fw.VOCAB
        persistence = 0
    else:
        model = gpt2()
        params = [p for p in model.parameters() if p.requires_grad]
        vocab = model.config.vocab_size
        persistence = 20  # LayerNorms and small biases stay resident (no gather), the rest is partitioned
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(stage, persistence))
    fw.quiet_loggers()
    data = batches(kind, vocab)
    for _ in range(2):
        step(engine, kind, next(data))
    ckpt = out / "checkpoint"
    engine.save_checkpoint(str(ckpt))
    if kind == "gpt2" and rank() == 0:
        model.config.save_pretrained(ckpt)  # as the Trainer does: makes ckpt an HF checkpoint folder

    results: dict[str, Any] = {}
    results["hf"] = save_pretrained_from_engine(engine, out / "hf").to_dict()
    small: tuple[Any, int] = {"toy": (300, 200), "gpt2": ("4KB", 2048)}[kind]
    results["hf_sharded"] = save_pretrained_from_engine(
        engine, out / "hf_sharded", max_shard_size=small[0], max_gather_bytes=small[1], chunk_bytes=64
    ).to_dict()
    results["hf_fp32"] = save_pretrained_from_engine(engine, out / "hf_fp32", dtype="fp32").to_dict()
    results["released_after_save"] = released(engine) if stage == 3 else None
    error_paths(engine, out)

    # DeepSpeed's own 16-bit weights, taken after ours: our save must not have changed anything.
    if stage == 3:
        reference = engine._zero3_consolidated_16bit_state_dict()
    else:
        reference = engine.module_state_dict() if rank() == 0 else None
    if rank() == 0:  # copied now: on CPU the reference shares storage with live buffers / ZeRO-2 params
        fw.save_st(reference, out / "reference.safetensors")
    results["loss_after_save"] = step(engine, kind, next(data))  # the engine still trains
    if rank() == 0:
        results["finite_loss"] = math.isfinite(results["loss_after_save"])
        results["state_dict_keys"] = list(engine.module.state_dict().keys())
        (out / "result.json").write_text(json.dumps(results, indent=1))


def run_engine(stage: int, out: Path) -> None:
    import deepspeed

    fw.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    fw.quiet_loggers()
    for kind in ("toy", "gpt2"):
        run_case(kind, stage, out / kind)


def run_trainer(out: Path) -> None:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from ckpttools.live.integrations import ConsolidateCallback

    fw.quiet_loggers()
    tokenizer = fw.build_tokenizer()
    torch.manual_seed(SEED)
    config = fw.tiny_gpt2_config(tokenizer)
    ds_cfg = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    args = TrainingArguments(
        output_dir=str(out / "out"),
        use_cpu=True,
        bf16=True,
        deepspeed=ds_cfg,
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        learning_rate=1e-2,
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    on_save = ConsolidateCallback(max_shard_size="8KB")  # engine reached only through the `model` callbacks get
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=fw.TinyDataset(tokenizer),
        processing_class=tokenizer,
        callbacks=[on_save],
    )
    at_end = ConsolidateCallback(trainer, on_save=False, on_train_end=True, final_dir=out / "final")
    trainer.add_callback(at_end)
    fw.quiet_loggers()
    trainer.train()
    wrapped: Any = trainer.model_wrapped  # the DeepSpeed engine (typed as the wrapped module)
    reference = wrapped._zero3_consolidated_16bit_state_dict()
    if rank() == 0:
        fw.save_st(reference, out / "reference.safetensors")
        results = {
            "on_save": [r.to_dict() for r in on_save.results],
            "at_end": [r.to_dict() for r in at_end.results],
            "engine_type": type(at_end.engine(None)).__name__,
            "gather_flag": wrapped.zero_gather_16bit_weights_on_model_save(),
        }
        (out / "result.json").write_text(json.dumps(results, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["engine", "trainer"])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out).resolve()
    if a.mode == "engine":
        run_engine(a.stage, out)
    else:
        run_trainer(out)
    fw.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

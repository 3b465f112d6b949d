"""Fixture worker: DeepSpeed AutoTP (tensor parallel) checkpoints.  Run by scripts/make_fixtures.py.

    torchrun --nproc_per_node 4 scripts/fixture_autotp.py build --spec <json> --out <dir>

A tiny Hugging Face Llama (built from its config with a fixed seed) is sharded by AutoTP
(`deepspeed.tp_model_init(model, tp_size=2, dtype=bf16)`, config `tensor_parallel.autotp_size=2`), trained
2 steps at DP 2 x TP 2 with ZeRO-1 or 2, and saved with `engine.save_checkpoint(<dir>/checkpoint)`. Beside the
tag folder sit `config.json` and `generation_config.json`, as in a Trainer `checkpoint-N/` folder.
Mode "trainer": the HF Trainer does the same from its DeepSpeed config. Mode "accelerate": accelerate's
DeepSpeedPlugin with `tensor_parallel.autotp_size=2` (deepspeed.initialize shards the model from the config; nothing
calls tp_model_init), `accelerator.save_state(<dir>/checkpoint)` (tag folder `pytorch_model/`, no config.json) and
the model's config.json + generation_config.json under `<dir>/model_config/`, as save_pretrained writes them.

References (rank 0 writes them):
  reference/bit16_tp{r}.safetensors     the engine's 16-bit module state on TP rank r, DP rank 0 (TP shards)
  reference/live_fp32_tp{r}.safetensors safe_get_full_fp32_param / safe_get_full_optimizer_state on TP rank r:
                                        fp32/<name>, exp_avg/<name>, exp_avg_sq/<name> (the LOCAL TP shards,
                                        gathered over DP only)
  reference/universal_full.safetensors  fp32/<hf name>, exp_avg/..., exp_avg_sq/... read from the output of
                                        `python -m deepspeed.checkpoint.ds_to_universal` (the folder is dropped)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_worker import finish_distributed, quiet_loggers, relink_hp_optimizer_state, save_st  # noqa: E402

SEED = 1234
STEPS = 2
TP = 2
DP = 2
# Odd on purpose: AutoTP splits the vocabulary dimension of embed_tokens/lm_head unevenly or pads it,
# which is what original_vocab_size and the affine map have to say.
VOCAB = 61
KIND = "autotp"
# Small enough to keep each fixture near 250 KB (fp32 + 2 moments + references of every element); intermediate
# != hidden so that row- and column-parallel weights are not square.
HIDDEN = 16
INTERMEDIATE = 24
HEADS = 2  # both split over TP 2 (head_dim 8); KV heads = HEADS
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def specs() -> list[dict]:
    return [
        {
            "name": f"autotp_tp2_dp2_z{stage}_bf16", "kind": KIND, "world_size": TP * DP, "zero_stage": stage,
            "dp": DP, "tp": TP, "dtype": "bf16", "checkpoint": "checkpoint",
            "notes": f"AutoTP: tiny LlamaForCausalLM (hidden {HIDDEN}, intermediate {INTERMEDIATE}, {HEADS} heads, "
            f"{HEADS} KV heads, 2 layers, vocab {VOCAB}, untied head) from its config, "
            f"deepspeed.tp_model_init(tp_size=2, bf16), tensor_parallel.autotp_size=2, ZeRO-{stage}, "
            f"DP 2 x TP 2 (4 processes), DeepSpeed FusedAdam, {STEPS} steps, engine.save_checkpoint(checkpoint/); "
            "config.json + generation_config.json beside the tag folder.",
        }
        for stage in (1, 2)
    ] + [
        {
            "name": "autotp_trainer_tp2_dp2_z1_bf16", "kind": KIND, "mode": "trainer", "world_size": TP * DP,
            "zero_stage": 1, "dp": DP, "tp": TP, "dtype": "bf16", "checkpoint": f"out/checkpoint-{STEPS}",
            "notes": "HF Trainer (bf16, ZeRO-1, DS config tensor_parallel.autotp_size=2: the Trainer calls "
            "deepspeed.tp_model_init itself), the tiny Llama sized to the Trainer fixtures' tokenizer, torch AdamW of "
            f"the Trainer, {STEPS} steps, one checkpoint (out/checkpoint-{STEPS}/) with config, generation config "
            "and tokenizer files as the Trainer writes them.",
        },
        {
            "name": "accelerate_autotp_tp2_dp2_z1_bf16", "kind": KIND, "mode": "accelerate", "world_size": TP * DP,
            "zero_stage": 1, "dp": DP, "tp": TP, "dtype": "bf16", "checkpoint": "checkpoint",
            "notes": "accelerate: Accelerator(DeepSpeedPlugin(hf_ds_config: ZeRO-1, bf16, "
            "tensor_parallel.autotp_size=2), mixed_precision bf16), the tiny Llama of the engine fixtures, "
            "torch AdamW, all through "
            "accelerator.prepare (deepspeed.initialize applies AutoTP from the config; no tp_model_init), "
            f"DP 2 x TP 2 (4 processes), {STEPS} steps, accelerator.save_state(checkpoint/): tag folder "
            "pytorch_model/, no config.json; model_config/ holds what save_pretrained writes besides the weights.",
        },
    ]  # fmt: skip


def llama_config(vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "tensor_parallel": {"autotp_size": TP},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }  # fmt: skip


def build_engine(stage: int, config_extra: dict | None = None, prepare=None):
    """The fixture's model, sharded by AutoTP, inside a fresh engine (collective: every rank calls).
    `prepare(model)` runs on the full model before AutoTP shards it (tests/autotp_load_worker.py scrambles it)."""
    import deepspeed
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    if prepare is not None:
        prepare(model)
    model = deepspeed.tp_model_init(model, tp_size=TP, dtype=torch.bfloat16)
    cfg = ds_config(stage)
    cfg.update(config_extra or {})
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def ranks() -> tuple[int, int]:
    """(dp rank, tp rank) of this process."""
    from deepspeed.utils import groups

    return groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank()


def batch(step: int, dp_rank: int) -> torch.Tensor:
    """Token ids for one step: equal on the TP ranks of a DP rank, different between DP ranks."""
    g = torch.Generator().manual_seed(SEED + 100 * step + dp_rank)
    return torch.randint(3, VOCAB, (2, 12), generator=g)


def train(engine, steps: int, first: int = 0) -> list[float]:
    dp_rank, _ = ranks()
    losses = []
    for s in range(first, first + steps):
        ids = batch(s, dp_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def live_state(engine) -> dict[str, torch.Tensor]:
    """What DeepSpeed's safe_get_full_* API returns on this rank (collective over DP)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink_hp_optimizer_state(engine)
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p)
        for key in ADAM_KEYS:
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key)
    return out


def gather_to_rank0(obj):
    import torch.distributed as dist

    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def write_hf_config(folder: Path) -> None:
    """config.json and generation_config.json, as a Trainer checkpoint-N/ folder holds them."""
    from transformers import GenerationConfig

    config = llama_config()
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)


def universal_reference(tag_dir: Path, out_file: Path) -> dict:
    """Run DeepSpeed's ds_to_universal on the tag folder; keep fp32/exp_avg/exp_avg_sq of every param."""
    with tempfile.TemporaryDirectory(prefix="autotp_uc_") as tmp:
        uc = Path(tmp) / "universal"
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
               "--output_folder", str(uc), "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return {"ok": False, "error": (r.stdout + r.stderr)[-3000:]}
        tensors, extras = {}, {}
        for param_dir in sorted((uc / "zero").iterdir()):
            for state in ("fp32", *ADAM_KEYS):
                f = param_dir / f"{state}.pt"
                if f.is_file():
                    d = torch.load(f, map_location="cpu", weights_only=False)
                    tensors[f"{state}/{param_dir.name}"] = d["param"]
                    extras[f"{state}/{param_dir.name}"] = sorted(k for k in d if k != "param")
        save_st(tensors, out_file)
        return {"ok": True, "files": sorted(p.name for p in (uc / "zero").iterdir())[:3], "entry_keys": extras}


def build(spec: dict, out: Path) -> None:
    import deepspeed

    quiet_loggers()
    if spec.get("mode") == "accelerate":  # the Accelerator starts the process group itself
        engine, ckpt, losses = run_accelerate(spec, out)
        write_references(spec, out, engine, ckpt, losses)
        return
    deepspeed.init_distributed(dist_backend="gloo")
    quiet_loggers()
    if spec.get("mode") == "trainer":
        engine, ckpt, losses = run_trainer(spec, out)
    else:
        engine = build_engine(spec["zero_stage"])
        losses = train(engine, STEPS)
        ckpt = out / spec["checkpoint"]
        engine.save_checkpoint(str(ckpt))
    write_references(spec, out, engine, ckpt, losses)


def run_trainer(spec: dict, out: Path):
    """The HF Trainer with a DeepSpeed config holding tensor_parallel.autotp_size (the Trainer calls
    tp_model_init itself); the tiny Llama sized to the Trainer fixtures' tokenizer."""
    from fixture_worker import TinyDataset, build_tokenizer
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    tokenizer = build_tokenizer()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(len(tokenizer)))
    ds_cfg = {
        "zero_optimization": {"stage": spec["zero_stage"]}, "bf16": {"enabled": "auto"},
        "tensor_parallel": {"autotp_size": TP}, "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    }  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out / "out"), use_cpu=True, bf16=True, deepspeed=ds_cfg, per_device_train_batch_size=2,
        max_steps=STEPS, save_strategy="steps", save_steps=STEPS, logging_steps=1, report_to=[], learning_rate=1e-2,
        weight_decay=0.01, seed=SEED, data_seed=SEED, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(tokenizer), processing_class=tokenizer)
    quiet_loggers()
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [result.training_loss]
    return trainer.model_wrapped, out / spec["checkpoint"], losses


class TokenBatches(torch.utils.data.Dataset):
    """Rows of token ids; accelerate's DataLoader hands TP ranks of one DP rank the same rows."""

    def __init__(self, rows: int = 8, length: int = 12):
        g = torch.Generator().manual_seed(SEED)
        self.ids = torch.randint(3, VOCAB, (rows, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_accelerate(spec: dict, out: Path):
    """An accelerate script: Accelerator(deepspeed_plugin=...) with tensor_parallel.autotp_size, the tiny Llama,
    a torch AdamW and a DataLoader through accelerator.prepare, STEPS steps, accelerator.save_state."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed
    from transformers import LlamaForCausalLM

    cfg = {
        "zero_optimization": {"stage": spec["zero_stage"]}, "bf16": {"enabled": True},
        "tensor_parallel": {"autotp_size": TP}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    }  # fmt: skip
    # backend="gloo": without a backend accelerate (no GPU here) would count one process per rank
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), mixed_precision="bf16",
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # fmt: skip
    quiet_loggers()
    set_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(TokenBatches(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    quiet_loggers()
    model.train()
    losses = []
    for i, rows in enumerate(loader):
        if i == STEPS:
            break
        loss = model(**rows).loss
        accelerator.backward(loss)  # DeepSpeed: engine.backward + engine.step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach().float()))
    check_tp_peers_saw_one_batch(losses)
    ckpt = out / spec["checkpoint"]
    accelerator.save_state(str(ckpt))
    accelerator.wait_for_everyone()
    return model, ckpt, losses  # accelerate hands back the DeepSpeedEngine itself


def check_tp_peers_saw_one_batch(losses: list[float]) -> None:
    """AutoTP needs the same rows on the TP ranks of a DP rank (accelerate's DataLoader splits by DP rank only):
    their losses then agree exactly (collective)."""
    by_dp: dict[int, set] = {}
    for dp_rank, rank_losses in gather_to_rank0((ranks()[0], losses)):
        by_dp.setdefault(dp_rank, set()).add(tuple(rank_losses))
    if any(len(seen) != 1 for seen in by_dp.values()):
        raise RuntimeError(f"TP ranks of one DP rank saw different batches: losses {by_dp}")


def write_references(spec: dict, out: Path, engine, ckpt: Path, losses: list[float]) -> None:
    """reference/ and meta.partial.json from the live engine after the save (collective: every rank calls)."""
    import deepspeed
    import torch.distributed as dist

    dp_rank, tp_rank = ranks()
    bit16 = dict(engine.module.state_dict().items())
    live = live_state(engine)
    fp32_only = {k: v for k, v in live.items() if k.startswith("fp32/")}
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    everyone = gather_to_rank0({"dp": dp_rank, "tp": tp_rank, "rank": dist.get_rank(), "shapes": shapes,
                                "bit16": bit16 if dp_rank == 0 else None,
                                "live": fp32_only if dp_rank == 0 else None,
                                "live_shapes": {k: list(v.shape) for k, v in live.items()}})  # fmt: skip
    meta: dict = {}
    tag = ""  # rank 0's, the only rank that uses it
    if dist.get_rank() == 0:
        ref = out / "reference"
        for info in everyone:
            if info["dp"] == 0:
                save_st(info["bit16"], ref / f"bit16_tp{info['tp']}.safetensors")
                save_st(info["live"], ref / f"live_fp32_tp{info['tp']}.safetensors")
        if spec.get("mode") == "accelerate":  # save_state writes no config: kept beside it, as save_pretrained would
            write_hf_config(out / "model_config")
        elif spec.get("mode") != "trainer":
            write_hf_config(ckpt)
        tag = (ckpt / "latest").read_text().strip()
        meta = {
            "name": spec["name"], "kind": KIND, "zero_stage": spec["zero_stage"], "dp": DP, "tp": TP,
            "dtype": "bf16", "optimizer": type(engine.basic_optimizer).__name__,
            "optimizer_wrapper": type(engine.optimizer).__name__, "tag": tag,
            "step_type": "int" if type(engine.basic_optimizer).__name__ == "FusedAdam" else "tensor",
            "checkpoint": spec["checkpoint"], "ds_version": deepspeed.__version__, "losses": losses,
            "global_steps": engine.global_steps, "ds_config": engine.config,
            "rank_grid": [{k: i[k] for k in ("rank", "dp", "tp")} for i in everyone],
            "local_shapes_tp0": everyone[0]["shapes"],
            "live_api_shapes_tp1": next(i["live_shapes"] for i in everyone if i["tp"] == 1),
            "files": sorted(p.name for p in (ckpt / tag).iterdir()),
            "checkpoint_files": sorted(p.name for p in ckpt.iterdir()),
            "notes": spec.get("notes", ""),
            "live_api": "safe_get_full_fp32_param / safe_get_full_optimizer_state on an AutoTP param return this "
            "TP rank's LOCAL shard (gathered over DP only): reference/live_fp32_tp{r}.safetensors holds fp32/<n> "
            "of TP rank r (the moments' shapes are the same, see live_api_shapes_tp1)",
        }  # fmt: skip
    finish_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        meta["ds_to_universal"] = universal_reference(ckpt / tag, out / "reference" / "universal_full.safetensors")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    build(json.loads(a.spec), Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Worker for scripts/make_fixtures.py.  Not meant to be run by hand.

Modes (all but zero2fp32 given a JSON fixture spec, built by make_fixtures.py):

  engine   (under torchrun, N ranks)  train the toy model for 2 steps with a bare
           DeepSpeed engine, save_checkpoint, write reference/bit16.safetensors,
           reference/full_state.safetensors and meta.json (partial).
  trainer  (under torchrun, N ranks)  train a tiny GPT-2 with the HF Trainer + DeepSpeed,
           then write the same references from the live engine.
  accelerate (under torchrun, N ranks)  train the same tiny GPT-2 with accelerate + DeepSpeed
           (DeepSpeedPlugin, torch AdamW + LR scheduler through accelerator.prepare), then
           accelerator.save_state; write reference/bit16.safetensors and model_config/.
  accelerate_resume (under torchrun, N ranks)  the same setup, accelerator.load_state of a
           (resharded) save_state folder, one more step; facts per rank (tests/test_accelerate.py).
  zero2fp32 (one process)  run DeepSpeed's get_fp32_state_dict_from_zero_checkpoint on
           a finished checkpoint and write reference/zero_to_fp32.safetensors.

Every rank computes the same thing; rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

SEED = 1234
VOCAB = 24
DIM = 8
STEPS = 2

# --------------------------------------------------------------------------------------
# The toy model used by every "engine" fixture.
# --------------------------------------------------------------------------------------


class ToyModel(nn.Module):
    """Embedding(24, 8) tied to a Linear(8, 24, bias=False) head, LayerNorm(8),
    Linear(8, 12), Linear(12, 7), a frozen Linear(8, 5) used in forward, a persistent
    float buffer, a persistent int64 buffer (changes during training) and a
    non-persistent buffer."""

    scale: torch.Tensor  # the buffers registered below, as the type checker should see them
    counts: torch.Tensor
    mask: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        # persistent float buffer, persistent int64 buffer, non-persistent buffer
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("counts", torch.tensor([7, 0, -3], dtype=torch.int64))
        self.register_buffer("mask", torch.ones(DIM), persistent=False)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 12)
        self.fc2 = nn.Linear(12, 7)
        self.frozen = nn.Linear(DIM, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: state_dict has both, named_parameters only emb.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids))
        h = h * self.scale.to(h.dtype) * self.mask.to(h.dtype)
        a = self.fc2(torch.tanh(self.fc1(h)))  # (..., 7)
        f = self.frozen(h)  # (..., 5)
        z = h + 0.1 * F.pad(a, (0, DIM - 7)) + 0.1 * F.pad(f, (DIM - 5, 0))
        logits = self.head(z)
        if self.training:
            with torch.no_grad():
                self.counts[1] += 1
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def decay_groups(named_params):
    """HF-Trainer-like split: weights decay 0.01, biases and LayerNorm 0.0.
    Only trainable params, like Trainer.get_decay_parameter_names + requires_grad filter."""
    decay, no_decay = [], []
    for n, p in named_params:
        if not p.requires_grad:
            continue
        if n.endswith(".bias") or ".ln" in "." + n or "ln_" in n or "layernorm" in n.lower():
            no_decay.append((n, p))
        else:
            decay.append((n, p))
    return decay, no_decay


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def quiet_loggers() -> None:
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except Exception:  # noqa: BLE001, S110 - quieter logs are a nicety: a run never fails over them
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:  # noqa: BLE001, S110 - quieter logs are a nicety: a run never fails over them
        pass


def save_st(tensors: dict, path: Path) -> None:
    """Store every tensor as an independent contiguous copy (safetensors cannot alias)."""
    from safetensors.torch import save_file

    out = {}
    for k, value in tensors.items():
        v = value if isinstance(value, torch.Tensor) else value.contiguous()  # lazy GatheredTensor etc.
        out[k] = v.detach().cpu().clone().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata={"format": "pt"})


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def find_steps(obj, path="", out=None):
    """Find every 'step' entry inside an optimizer state dict (path, type)."""
    if out is None:
        out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}[{k!r}]"
            if k in {"step", "base_optimizer_state_step"}:
                if isinstance(v, torch.Tensor):
                    out.append(
                        (
                            p,
                            f"tensor(dim={v.dim()}, dtype={dtype_name(v.dtype)}, value={v.item() if v.numel() == 1 else '?'})",
                        )
                    )
                else:
                    out.append((p, f"{type(v).__name__}({v})"))
            else:
                find_steps(v, p, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            find_steps(v, f"{path}[{i}]", out)
    return out


def inspect_optim_file(tag_dir: Path) -> dict:
    """Look at rank 0's optimizer shard (only for meta.json facts)."""
    files = sorted(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if not files:
        return {}
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    osd = sd["optimizer_state_dict"]
    steps = find_steps(osd)
    kinds = sorted({("tensor" if s.startswith("tensor") else "int") for _, s in steps})
    info = {
        "optim_file_rank0": files[0].name,
        "optim_state_keys": sorted(osd.keys()),
        "has_zero_stage_key": "zero_stage" in osd,
        "step_type": "+".join(kinds) or "none",
        "step_locations": [f"optimizer_state_dict{p}: {s}" for p, s in steps],
    }
    # the torch optimizer's own state_dict inside the shard: how many state entries, which keys
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(inner, dict) and isinstance(inner.get("state"), dict):
        info["file_optimizer_state_entries"] = len(inner["state"])
        info["file_optimizer_state_keys"] = sorted({k for st in inner["state"].values() for k in st})
        info["file_optimizer_param_groups"] = len(inner.get("param_groups", []))
    if "fp32_flat_groups" in osd:
        info["num_sub_groups"] = len(osd["fp32_flat_groups"])
        info["sub_group_numels_rank0"] = [int(t.numel()) for t in osd["fp32_flat_groups"]]
        info["sub_groups_per_param_group"] = [list(g["params"]) for g in osd["optimizer_state_dict"]["param_groups"]]
    if "partition_count" in osd:
        pc = osd["partition_count"]
        info["partition_count"] = pc if isinstance(pc, int) else list(pc)
    return info


def common_meta(engine) -> dict:
    import deepspeed
    import transformers

    return {
        "ds_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "optimizer": type(engine.basic_optimizer).__name__ if engine.basic_optimizer is not None else None,
        "optimizer_module": type(engine.basic_optimizer).__module__ if engine.basic_optimizer is not None else None,
        "optimizer_wrapper": type(engine.optimizer).__name__,
    }


def engine_param_groups(engine) -> tuple[list, list | None]:
    """Param names per optimizer param group, in DeepSpeed's flat-buffer order, read from
    the live optimizer wrapper; for ZeRO-3 also the names per sub-group."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    if hasattr(opt, "round_robin_bit16_groups"):  # ZeRO-1/2
        return [[names[id(p)] for p in g] for g in opt.round_robin_bit16_groups], None
    if hasattr(opt, "bf16_groups"):  # BF16_Optimizer
        return [[names[id(p)] for p in g] for g in opt.bf16_groups], None
    if hasattr(opt, "sub_group_to_group_id"):  # ZeRO-3
        sub = [[names[id(p)] for p in g] for g in opt.fp16_groups]
        groups: dict[int, list] = {}
        for i, g in enumerate(sub):
            groups.setdefault(opt.sub_group_to_group_id[i], []).extend(g)
        return [groups[k] for k in sorted(groups)], sub
    raise RuntimeError(f"unknown optimizer wrapper {type(opt).__name__}")


def model_facts(module: nn.Module, param_groups_named) -> dict:
    sd_keys = set(module.state_dict().keys())
    named = dict(module.named_parameters())  # deduplicated (aliases dropped)
    # tied: state_dict keys that are parameters but not in named_parameters
    tied = {}
    ptr_owner: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in ptr_owner:
            tied[n] = ptr_owner[key]
        else:
            ptr_owner[key] = n
    frozen = [n for n, p in named.items() if not p.requires_grad]
    buffers, nonpersistent = {}, []
    for n, b in module.named_buffers():
        if n in sd_keys:
            buffers[n] = dtype_name(b.dtype)
        else:
            nonpersistent.append(n)
    return {
        "tied": tied,
        "frozen": frozen,
        "buffers": buffers,
        "nonpersistent_buffers": nonpersistent,
        "param_groups": param_groups_named,
        "trainable": [n for n, p in named.items() if p.requires_grad],
        "state_dict_keys": list(module.state_dict().keys()),
        "param_shapes": {n: list(p.ds_shape if hasattr(p, "ds_shape") else p.shape) for n, p in named.items()},
    }


def relink_hp_optimizer_state(engine) -> bool:
    """Work around a DeepSpeed 0.19.8 bug: ZeRO-1/2 (and BF16_Optimizer) link the per-param
    optimizer-state fragments (used by safe_get_full_optimizer_state) lazily right after
    stepping param group 0 only, so params of param groups >= 1 get an empty fragment and
    safe_get_full_optimizer_state raises "exp_avg not found in optimizer state fragment".
    Re-running DeepSpeed's own linking after the steps fixes it (pure bookkeeping; no
    tensor values change)."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
        return True
    return False


ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def write_engine_references(engine, ref_dir: Path, stage: int, state_keys=ADAM_STATE_KEYS) -> None:
    """bit16 + full_state (fp32/<n> and <key>/<n> for every key in `state_keys`) from the live engine.
    Collective for ZeRO-3: all ranks call."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if stage == 3:
        sd16 = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd16 = engine.module_state_dict() if rank() == 0 else None
    relink_hp_optimizer_state(engine)
    full = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        full[f"fp32/{n}"] = safe_get_full_fp32_param(p)
        for key in state_keys:
            full[f"{key}/{n}"] = safe_get_full_optimizer_state(p, key)
    if rank() == 0:
        missing = [k for k, t in full.items() if t is None]
        if missing:
            raise RuntimeError(f"safe_get_full_* returned None for {missing}")
        save_st(sd16, ref_dir / "bit16.safetensors")
        save_st(full, ref_dir / "full_state.safetensors")


# --------------------------------------------------------------------------------------
# engine mode
# --------------------------------------------------------------------------------------


def ds_config_for(spec: dict) -> dict:
    zero = {"stage": spec["zero_stage"]}
    if spec["zero_stage"] == 3:
        zero.update(
            {
                "sub_group_size": spec["sub_group_size"],
                "stage3_gather_16bit_weights_on_model_save": True,
                "stage3_param_persistence_threshold": 0,
            }
        )
    if spec.get("elastic"):
        zero["elastic_checkpoint"] = True
    opt_params = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    if spec.get("torch_adam"):
        opt_params["torch_adam"] = True
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": opt_params},
        "zero_optimization": zero,
    }
    client = spec.get("client_optimizer")
    if client:  # a torch optimizer built by the caller: no DS "optimizer" block
        del cfg["optimizer"]
        if client["type"] not in ("Adam", "AdamW", "Adagrad"):  # DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS
            cfg["zero_allow_untested_optimizer"] = True
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if spec.get("bf16_optimizer"):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def client_param_groups(model: nn.Module, how: str) -> list[dict]:
    """The param groups handed to a client torch optimizer, by name: "decay" (the HF-Trainer-like split the
    DS-optimizer fixtures use: weight_decay 0.01 / 0.0) or "single" (every trainable param, weight_decay 0.0)."""
    decay, no_decay = decay_groups(model.named_parameters())
    if how == "single":
        return [{"params": [n for n, _ in decay + no_decay], "weight_decay": 0.0}]
    return [{"params": [n for n, _ in decay], "weight_decay": 0.01},
            {"params": [n for n, _ in no_decay], "weight_decay": 0.0}]  # fmt: skip


def build_client_optimizer(model: nn.Module, client: dict) -> torch.optim.Optimizer:
    """torch.optim.<type>(<groups of model's params>, **params), as a training script would build it."""
    params = dict(model.named_parameters())
    groups = [{**g, "params": [params[n] for n in g["params"]]} for g in client["param_groups"]]
    return getattr(torch.optim, client["type"])(groups, **client["params"])


def optimizer_state_facts(engine) -> dict:
    """What the torch optimizer DeepSpeed drives holds right now (this rank): its param groups and the keys of
    its per-param state, split into tensor states (sliced per param by DeepSpeed) and scalars (`step`)."""
    base = getattr(engine.optimizer, "optimizer", None)
    if base is None:
        return {}
    tensor_keys: set[str] = set()
    scalar_keys: set[str] = set()
    for st in base.state.values():
        for k, v in st.items():
            (tensor_keys if isinstance(v, torch.Tensor) and v.dim() > 0 else scalar_keys).add(k)
    return {
        "base_optimizer": type(base).__name__,
        "base_optimizer_is_client_object": base is getattr(engine, "client_optimizer", None),
        "base_optimizer_num_param_groups": len(base.param_groups),
        "base_optimizer_num_state_entries": len(base.state),
        "optimizer_state_keys": sorted(tensor_keys | scalar_keys),
        "optimizer_tensor_state_keys": sorted(tensor_keys),
        "optimizer_scalar_state_keys": sorted(scalar_keys),
    }


def probe_optimizer_state_api(engine, keys, stage: int) -> dict:
    """What DeepSpeed answers for optimizer state `keys` of a trainable param (all ranks call).  ZeRO-3:
    safe_get_full_optimizer_state on the first trainable param (it fails, if at all, on every rank before its
    all-reduce).  ZeRO-1/2: the rank-local fragment lookup safe_get_full_optimizer_state starts with
    (`_hp_mapping.get_optim_state_fragment`), on this rank's first param with a fragment: the full call would
    fail on the ranks that hold a fragment only and leave the others waiting in its all-reduce."""
    from deepspeed.utils import safe_get_full_optimizer_state

    params = [p for p in engine.module.parameters() if p.requires_grad]
    mapped = next((p for p in params if getattr(p, "_hp_mapping", None) is not None), None)

    def lookup(key: str) -> str:
        try:
            if stage == 3:
                v = safe_get_full_optimizer_state(params[0], key)
            else:
                v = mapped._hp_mapping.get_optim_state_fragment(key)  # type: ignore[union-attr]  # None: recorded
        except Exception as e:  # noqa: BLE001 - recorded
            return f"{type(e).__name__}: {e}"
        return "None" if v is None else f"tensor{tuple(v.shape)}"

    return {key: lookup(key) for key in keys}


def run_engine(spec: dict, out: Path) -> None:
    import deepspeed

    quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    quiet_loggers()
    r = rank()
    torch.manual_seed(SEED)
    model = ToyModel()
    client = spec.get("client_optimizer")
    cfg = ds_config_for(spec)
    if client:
        client = {**client, "param_groups": client_param_groups(model, client.get("groups", "decay"))}
        groups_named = [g["params"] for g in client["param_groups"]]
        optimizer = build_client_optimizer(model, client)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    else:
        decay, no_decay = decay_groups(model.named_parameters())
        groups = [
            {"params": [p for _, p in decay], "weight_decay": 0.01},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0},
        ]
        groups_named = [[n for n, _ in decay], [n for n, _ in no_decay]]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    quiet_loggers()
    after_init = optimizer_state_facts(engine)

    steps = int(spec.get("steps", STEPS))
    g = torch.Generator().manual_seed(SEED + 1000 * (r + 1))
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 6), generator=g)
        targets = torch.randint(0, VOCAB, (4, 6), generator=g)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()

    ckpt = out / "checkpoint"
    engine.save_checkpoint(str(ckpt))
    tag = f"global_step{engine.global_steps}"
    state = optimizer_state_facts(engine)
    if client:
        state_keys = tuple(state.get("optimizer_tensor_state_keys", ()))
        api = probe_optimizer_state_api(engine, sorted({*ADAM_STATE_KEYS, *state_keys}), spec["zero_stage"])
    else:
        state_keys, api = ADAM_STATE_KEYS, None
    write_engine_references(engine, out / "reference", spec["zero_stage"], state_keys)

    if r == 0:
        meta = {
            "name": spec["name"],
            "kind": spec["kind"],
            "zero_stage": spec["zero_stage"],
            "dp": spec["dp"],
            "dtype": spec["dtype"],
        }
        meta.update(common_meta(engine))
        if spec["zero_stage"] == 3:
            meta["sub_group_size"] = spec["sub_group_size"]
        eg, sub = engine_param_groups(engine)
        if [sorted(g) for g in eg] != [sorted(g) for g in groups_named]:
            raise RuntimeError(f"engine param groups {eg} differ from client groups {groups_named}")
        meta.update(model_facts(engine.module, eg))
        if sub is not None:
            meta["sub_groups"] = sub
        meta["param_group_weight_decay"] = [g["weight_decay"] for g in engine.optimizer.optimizer.param_groups]
        meta["tag"] = tag
        meta["global_steps"] = engine.global_steps
        meta["elastic_checkpoint"] = bool(spec.get("elastic"))
        meta["bf16_optimizer"] = type(engine.optimizer).__name__ == "BF16_Optimizer"
        meta["ds_config"] = cfg
        meta.update(inspect_optim_file(ckpt / tag))
        if client:
            meta["client_optimizer"] = client
            meta["train_steps"] = steps
            meta["reference_state_keys"] = list(state_keys)
            meta.update(state)
            meta["after_initialize"] = after_init
            meta["optimizer_state_api_at_save"] = api
        meta["notes"] = spec.get("notes", "")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1))


# --------------------------------------------------------------------------------------
# trainer mode
# --------------------------------------------------------------------------------------

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model learns to count one two three four",
    "deepspeed saves partitioned optimizer states for every rank",
    "the dog sleeps while the fox runs in the field",
    "one two three four five six seven eight nine ten",
    "checkpoints hold weights and moments and a step counter",
    "a lazy cat watches the quick brown bird",
    "every rank writes its own shard of the state",
]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, tokenizer, length=16):
        self.items = []
        for s in SENTENCES:
            ids = tokenizer(s)["input_ids"] + [tokenizer.eos_token_id]
            ids = ids[:length]
            n = len(ids)
            pad = length - n
            self.items.append(
                {
                    "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                    "attention_mask": torch.tensor([1] * n + [0] * pad),
                    "labels": torch.tensor(ids + [-100] * pad),
                }
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_gpt2_config(tokenizer):
    """The Trainer fixtures' model: a 2-layer GPT-2 (tied head) sized to the tokenizer."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=len(tokenizer), n_positions=32,
                      bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)  # fmt: skip


def run_trainer(spec: dict, out: Path) -> None:
    import deepspeed  # noqa: F401 - imported up front: a missing or broken DeepSpeed fails here, not inside the Trainer
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    quiet_loggers()
    tokenizer = build_tokenizer()
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(tiny_gpt2_config(tokenizer))
    zero = {"stage": spec["zero_stage"]}
    if spec["zero_stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = bool(spec["gather"])
        zero["sub_group_size"] = spec["sub_group_size"]
    ds_cfg = {
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    if spec.get("ds_optimizer"):
        ds_cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
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
        weight_decay=0.01,
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(tokenizer), processing_class=tokenizer)
    quiet_loggers()
    trainer.train()

    engine: Any = trainer.model_wrapped  # the DeepSpeed engine (typed as the wrapped module)
    write_engine_references(engine, out / "reference", spec["zero_stage"])
    if rank() == 0:
        import torch.distributed as dist

        # With a DS "optimizer" block the Trainer hands DeepSpeed ONE group of all trainable
        # params (no decay/no-decay split); without it, Trainer's own 2-group AdamW is used.
        groups_named, sub = engine_param_groups(engine)
        ckpts = sorted((out / "out").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        newest = ckpts[-1]
        tag = (newest / "latest").read_text().strip()
        meta = {
            "name": spec["name"],
            "kind": "trainer",
            "trainer": True,
            "checkpoint": newest.name,
            "checkpoints": [p.name for p in ckpts],
            "zero_stage": spec["zero_stage"],
            "dp": dist.get_world_size(),
            "dtype": "bf16",
        }
        meta.update(common_meta(engine))
        if spec["zero_stage"] == 3:
            meta["sub_group_size"] = spec["sub_group_size"]
            meta["stage3_gather_16bit_weights_on_model_save"] = bool(spec["gather"])
        meta.update(model_facts(engine.module, groups_named))
        if sub is not None:
            meta["sub_groups"] = sub
        meta["param_group_weight_decay"] = (
            [g["weight_decay"] for g in engine.optimizer.optimizer.param_groups]
            if hasattr(engine.optimizer, "optimizer")
            else None
        )
        meta["tag"] = tag
        meta["global_steps"] = engine.global_steps
        meta["ds_config"] = engine.config if isinstance(engine.config, dict) else None
        meta["model_safetensors_present"] = {p.name: (p / "model.safetensors").exists() for p in ckpts}
        meta.update(inspect_optim_file(newest / tag))
        meta["notes"] = spec.get("notes", "")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


# --------------------------------------------------------------------------------------
# accelerate mode
# --------------------------------------------------------------------------------------


def accelerate_ds_config(spec: dict) -> dict:
    """The DeepSpeed config handed to accelerate's DeepSpeedPlugin (no optimizer/scheduler blocks: the torch
    AdamW and LR scheduler are the script's own, as in accelerate's examples)."""
    zero = {"stage": spec["zero_stage"]}
    cfg = {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _tree_listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class AccelerateRun:
    accelerator: Any
    model: Any  # the DeepSpeedEngine accelerate hands back
    optimizer: Any
    loader: Any
    scheduler: Any
    groups_named: list
    zero3_init: bool
    ds_cfg: dict
    mixed: str


def accelerate_setup(spec: dict) -> AccelerateRun:
    """accelerate + DeepSpeed as an accelerate script sets it up: Accelerator(deepspeed_plugin=...), the Trainer
    fixtures' tiny GPT-2 built from its config after the Accelerator (so ZeRO-3 builds it under zero.Init), a
    torch AdamW with the decay split and a linear warmup schedule, all through accelerator.prepare."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    quiet_loggers()
    ds_cfg = accelerate_ds_config(spec)
    plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(ds_cfg)))
    mixed = "bf16" if spec["dtype"] == "bf16" else "no"
    # backend="gloo": without a backend accelerate (no GPU here) would count one process per rank
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # fmt: skip
    quiet_loggers()
    if accelerator.num_processes != spec["dp"] or accelerator.distributed_type.name != "DEEPSPEED":
        raise RuntimeError(f"accelerate set up {accelerator.distributed_type} x {accelerator.num_processes}")
    set_seed(SEED)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))
    zero3_init = any(hasattr(p, "ds_id") for p in model.parameters())
    decay, no_decay = decay_groups(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in decay], "weight_decay": 0.01},
         {"params": [p for _, p in no_decay], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
    )  # fmt: skip
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=8)
    loader = torch.utils.data.DataLoader(TinyDataset(tokenizer), batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    quiet_loggers()
    return AccelerateRun(accelerator, model, optimizer, loader, scheduler,
                         [[n for n, _ in decay], [n for n, _ in no_decay]], zero3_init, ds_cfg, mixed)  # fmt: skip


def accelerate_train(run: AccelerateRun, steps: int) -> list[float]:
    """`steps` optimizer steps the way accelerate's examples write the loop; rank-local losses."""
    run.model.train()
    losses = []
    for i, batch in enumerate(run.loader):
        if i == steps:
            break
        loss = run.model(**batch).loss
        run.accelerator.backward(loss)  # DeepSpeed: engine.backward + engine.step
        run.optimizer.step()
        run.scheduler.step()  # AcceleratedScheduler: steps the LambdaLR once per process (num_processes times)
        run.optimizer.zero_grad()
        losses.append(float(loss.detach().float()))
    return losses


def run_accelerate(spec: dict, out: Path) -> None:
    """accelerate_setup, STEPS steps, accelerator.save_state(out/checkpoint), references, model_config/."""
    import zipfile

    import accelerate

    run = accelerate_setup(spec)
    accelerator, model, optimizer, loader, scheduler = (run.accelerator, run.model, run.optimizer, run.loader,
                                                        run.scheduler)  # fmt: skip
    groups_named, zero3_init, ds_cfg, mixed = run.groups_named, run.zero3_init, run.ds_cfg, run.mixed
    steps = int(spec.get("steps", STEPS))
    losses = accelerate_train(run, steps)

    ckpt = out / "checkpoint"
    accelerator.save_state(str(ckpt))
    accelerator.wait_for_everyone()

    engine = model  # accelerate hands back the DeepSpeedEngine itself
    ref = out / "reference"
    if spec["zero_stage"] == 3:
        sd16 = engine._zero3_consolidated_16bit_state_dict()  # collective
    else:
        sd16 = engine.module_state_dict() if rank() == 0 else None
    if rank() == 0:
        save_st(sd16, ref / "bit16.safetensors")
        # what model.save_pretrained writes besides the weights, OUTSIDE the save_state folder
        import shutil
        import tempfile

        unwrapped = accelerator.unwrap_model(model)
        with tempfile.TemporaryDirectory() as tmp:
            unwrapped.save_pretrained(tmp, state_dict=sd16, is_main_process=True)
            written = sorted(os.listdir(tmp))
            (out / "model_config").mkdir(parents=True, exist_ok=True)
            for name in ("config.json", "generation_config.json"):
                if name in written:
                    shutil.copy2(Path(tmp) / name, out / "model_config" / name)

        eg, sub = engine_param_groups(engine)
        if [sorted(g) for g in eg] != [sorted(g) for g in groups_named]:
            raise RuntimeError(f"engine param groups {eg} differ from the script's groups {groups_named}")
        inner = scheduler.scheduler if hasattr(scheduler, "scheduler") else scheduler
        rs = sorted(ckpt.glob("random_states_*.pkl"))
        meta = {
            "name": spec["name"],
            "kind": spec["kind"],
            "accelerate": True,
            "zero_stage": spec["zero_stage"],
            "dp": accelerator.num_processes,
            "dtype": spec["dtype"],
        }
        meta.update(common_meta(engine))
        meta["accelerate_version"] = accelerate.__version__
        meta["distributed_type"] = accelerator.distributed_type.name
        meta["mixed_precision"] = mixed
        meta["zero3_init"] = zero3_init
        meta.update(model_facts(engine.module, eg))
        if sub is not None:
            meta["sub_groups"] = sub
        meta["param_group_weight_decay"] = [g["weight_decay"] for g in engine.optimizer.optimizer.param_groups]
        meta["tag"] = (ckpt / "latest").read_text().strip()
        meta["global_steps"] = engine.global_steps
        meta["train_steps"] = steps
        meta["losses_rank0"] = losses
        meta["ds_config_given"] = ds_cfg
        meta["ds_config"] = accelerator.deepspeed_config
        meta["prepared"] = {"model": type(model).__name__, "optimizer": type(optimizer).__name__,
                            "scheduler": type(scheduler).__name__, "scheduler_inner": type(inner).__name__,
                            "dataloader": type(loader).__name__}  # fmt: skip
        meta["scheduler_last_epoch"] = inner.last_epoch
        meta["scheduler_lrs"] = inner.get_last_lr()
        meta["save_state_files"] = _tree_listing(ckpt)
        meta["random_states_files"] = [p.name for p in rs]
        meta["random_states_is_torch_zip"] = {p.name: zipfile.is_zipfile(p) for p in rs}
        meta["save_pretrained_wrote"] = written
        meta["model_config_files"] = sorted(os.listdir(out / "model_config"))
        meta.update(inspect_optim_file(ckpt / meta["tag"]))
        meta["notes"] = spec.get("notes", "")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


def run_accelerate_resume(spec: dict, ckpt: Path, ref_file: Path, info_file: Path) -> None:
    """accelerate_setup at spec["dp"] processes, accelerator.load_state(ckpt), then one more training step.
    Each rank writes `info_file` with `.<rank>.json` appended: the fp32 masters against `ref_file`
    (zero_to_fp32 of the saved run), the engine step, the scheduler, whether this rank's RNG state came back."""
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file

    spec = {**spec, "dtype": spec.get("dtype", "bf16")}
    run = accelerate_setup(spec)
    acc = run.accelerator
    acc.load_state(str(ckpt))
    quiet_loggers()
    rng_after_load = torch.get_rng_state().clone()
    ref = load_file(str(ref_file))
    fp32_equal = {}
    for n, p in run.model.module.named_parameters():
        full = safe_get_full_fp32_param(p)  # collective under ZeRO-3
        fp32_equal[n] = bool(full is not None and torch.equal(full.detach().cpu().float(), ref[n]))
    rs = ckpt / f"random_states_{acc.process_index}.pkl"
    rng_restored = None
    if rs.is_file():  # the worker may unpickle it (accelerate itself does); ckpttools never does
        saved = torch.load(rs, weights_only=False)
        rng_restored = bool(torch.equal(rng_after_load, saved["torch_manual_seed"]))
    inner = run.scheduler.scheduler
    info = {
        "rank": acc.process_index,
        "num_processes": acc.num_processes,
        "fp32_equal": fp32_equal,
        "global_steps_after_load": run.model.global_steps,
        "scheduler_last_epoch_after_load": inner.last_epoch,
        "scheduler_lrs_after_load": inner.get_last_lr(),
        "random_states_file": rs.name if rs.is_file() else None,
        "rng_restored": rng_restored,
    }
    losses = accelerate_train(run, 1)
    info["losses_after_resume"] = losses
    info["global_steps_after_step"] = run.model.global_steps
    info["scheduler_last_epoch_after_step"] = inner.last_epoch
    Path(f"{info_file}.{acc.process_index}.json").write_text(json.dumps(info, indent=1))


# --------------------------------------------------------------------------------------
# zero2fp32 mode
# --------------------------------------------------------------------------------------


def run_zero2fp32(ckpt_dir: Path, out_file: Path, info_file: Path, tag: str | None = None) -> None:
    quiet_loggers()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    quiet_loggers()
    info: dict[str, Any] = {"checkpoint_dir": str(ckpt_dir), "tag": tag}
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    except Exception as e:  # noqa: BLE001 - recorded: e.g. BF16_Optimizer checkpoints are rejected
        info["ok"] = False
        info["error"] = f"{type(e).__name__}: {e}"
    else:
        info["ok"] = True
        info["keys"] = list(sd.keys())
        info["dtypes"] = {k: dtype_name(v.dtype) for k, v in sd.items()}
        aliases: dict[str, str] = {}
        seen: dict[tuple[Any, ...], str] = {}
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                key = (v.data_ptr(), v.storage_offset(), tuple(v.shape))
                if key in seen:
                    aliases[k] = seen[key]
                else:
                    seen[key] = k
        info["aliased_in_api_output"] = aliases
        save_st(sd, out_file)
    info_file.write_text(json.dumps(info, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["engine", "trainer", "accelerate", "accelerate_resume", "zero2fp32"])
    ap.add_argument("--spec", help="JSON fixture spec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--info")
    ap.add_argument("--tag", help="zero2fp32: the tag folder (default: `latest`)")
    ap.add_argument("--ref", help="accelerate_resume: the zero_to_fp32 reference of the saved run")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if a.mode == "zero2fp32":
        run_zero2fp32(Path(a.ckpt), out, Path(a.info), a.tag)
        return 0
    spec = json.loads(a.spec)
    if a.mode == "engine":
        run_engine(spec, out)
    elif a.mode == "accelerate":
        run_accelerate(spec, out)
    elif a.mode == "accelerate_resume":
        run_accelerate_resume(spec, Path(a.ckpt), Path(a.ref), out)
    else:
        run_trainer(spec, out)
    finish_distributed()
    return 0


def finish_distributed() -> None:
    """Wait for every rank, then leave the process group (a worker's last step)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    import ds_launch

    ds_launch.exit_worker(main)

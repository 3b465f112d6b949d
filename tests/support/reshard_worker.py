"""Worker for tests/test_reshard_deepspeed.py: load a native ZeRO checkpoint with plain DeepSpeed at the
current world size, dump what the engine holds, and keep training.  Run it under torchrun; not a test.

Engine mode (the toy model of fixtures/build/fixture_worker.py, rebuilt from a fixture's meta.json):

    torchrun --nproc_per_node M -m tests.support.reshard_worker --fixture-meta fixtures/z2_dp2_fp32/meta.json \
        --load CKPT_ROOT [--dump OUT.safetensors] [--steps K --losses OUT.json]

  * the model is built exactly as the fixture worker built it (same class, same seed, same two param
    groups, the fixture's ds_config; for `client_optimizer` fixtures the same client torch optimizer, from
    meta.json `client_optimizer`) and then *scrambled* (every parameter and persistent buffer is
    overwritten with other values), so anything `load_checkpoint` does not restore shows up in the dump;
  * only the batch-size keys of the ds_config change: the GLOBAL batch is GLOBAL_BATCH rows at every world
    size (micro batch GLOBAL_BATCH // M, gradient_accumulation_steps 1);
  * `engine.load_checkpoint(CKPT_ROOT, load_optimizer_states=True, load_lr_scheduler_states=True)`; a None
    load path is an error;
  * --dump (rank 0 writes; every rank takes part in the collectives): `fp32/<n>`, `exp_avg/<n>`,
    `exp_avg_sq/<n>` (or the fixture's meta.json `reference_state_keys`, e.g. `momentum_buffer`, `sum`, none
    for a step-0 checkpoint) for every trainable param (deepspeed.utils.safe_get_full_fp32_param /
    safe_get_full_optimizer_state), `module/<key>` for every entry of the module's state_dict as the module
    holds it (ZeRO-3: gathered), `module/mask` (non-persistent buffer), and OUT.json beside it with the
    optimizer steps, loss-scaler scale, global steps/samples and per-rank facts;
  * universal loads: `"checkpoint": {"load_universal": true}` is added to the config when the job has
    `"load_universal": true` (--jobs mode) or RESHARD_WORKER_LOAD_UNIVERSAL is set;
  * --steps K: K more training steps on a fixed-seed global batch sequence that is the same at every world
    size (rank r takes rows [r*micro, (r+1)*micro)); --losses gets the global mean loss per step.

Trainer mode (--trainer): the Trainer setup of fixtures/build/fixture_worker.py's Trainer fixtures (tiny GPT-2,
tokenizer files from the checkpoint folder, ds_config rebuilt from the fixture's meta.json) with
max_steps=--max-steps and `trainer.train(resume_from_checkpoint=--resume)`; output_dir is the parent of
--resume; rank 0 writes --result (global_step, log_history).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")


def private_extensions_dir() -> str:
    """A torch_extensions cache of this interpreter's own: DeepSpeed JIT-builds its CPU ops
    (deepspeed_shm_comm, fused_adam) into ~/.cache/torch_extensions/py311_cpu/<op> whatever the venv, so
    two venvs on one machine rebuild each other's ops on every start (about a minute each time)."""
    import hashlib

    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    return str(Path.home() / ".cache" / f"torch_extensions_{tag}")


os.environ.setdefault("TORCH_EXTENSIONS_DIR", private_extensions_dir())

import torch  # noqa: E402

# the toy model and helpers the fixtures were written with
from fixtures.build import fixture_worker as FW  # noqa: E402

GLOBAL_BATCH = 12  # rows per global batch; divisible by every world size used (1, 2, 3, 4)
SEQ = 6
DATA_SEED = 987654
SCRAMBLE_SEED = 4242


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def log(msg: str) -> None:
    if rank() == 0:
        print(f"[reshard_worker] {msg}", flush=True)


def init_dist() -> None:
    import deepspeed

    FW.quiet_loggers()
    # a short timeout: a rank that fails alone must not leave the others waiting for 30 minutes
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=180))
    FW.quiet_loggers()


# --------------------------------------------------------------------------------------------------------
# engine mode
# --------------------------------------------------------------------------------------------------------


def ds_config_for(meta: dict, m: int, load_universal: bool | None = None) -> dict:
    cfg = copy.deepcopy(meta["ds_config"])
    if GLOBAL_BATCH % m:
        raise SystemExit(f"world size {m} does not divide the global batch {GLOBAL_BATCH}")
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // m
    cfg["gradient_accumulation_steps"] = 1
    if "train_batch_size" in cfg:
        cfg["train_batch_size"] = GLOBAL_BATCH
    if load_universal is None:
        load_universal = bool(os.environ.get("RESHARD_WORKER_LOAD_UNIVERSAL"))
    if load_universal:  # the one config change a universal load needs
        cfg.setdefault("checkpoint", {})["load_universal"] = True
    return cfg


def scramble(model: torch.nn.Module) -> None:
    """Overwrite every parameter and persistent buffer, so nothing can pass by being left at its init."""
    g = torch.Generator().manual_seed(SCRAMBLE_SEED)
    sd_keys = set(model.state_dict().keys())
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 0.7)
        for n, b in model.named_buffers():
            if n not in sd_keys:  # non-persistent (mask): not in the checkpoint, keep it
                continue
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g) + 5.0)
            else:
                b.fill_(-99)


def clear_zero3_adagrad_param_groups(engine) -> bool:
    """Work around a DeepSpeed 0.19.8 bug: ZeRO-3 empties the torch optimizer's param groups after creating its fp32
    partitions (they are filled per sub-group around each step and for state_dict/load_state_dict), but then
    re-creates a torch.optim.Adagrad as Adagrad(<all fp32 sub-group partitions>, **defaults), which leaves them
    in group 0.  A fresh engine's load_checkpoint then appends the partitions once more and torch refuses the
    state ("loaded state dict contains a parameter group that doesn't match the size of optimizer's group"),
    even for the checkpoint that very engine setup wrote at the same DP size.  Emptying them again, as DeepSpeed
    itself does after every step, restores the invariant (bookkeeping only; no tensor changes)."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", None)
    if (isinstance(base, torch.optim.Adagrad) and hasattr(opt, "_clear_fp32_optimizer_param_groups")
            and any(g["params"] for g in base.param_groups)):  # fmt: skip
        opt._clear_fp32_optimizer_param_groups()
        return True
    return False


def build_engine(meta: dict, do_scramble: bool, load_universal: bool | None = None):
    import deepspeed

    torch.manual_seed(FW.SEED)
    model = FW.ToyModel()
    if do_scramble:
        scramble(model)
    client = meta.get("client_optimizer")
    if client:  # the fixture's own client torch optimizer (no DS "optimizer" block), built the same way
        names = [g["params"] for g in client["param_groups"]]
        if [sorted(g) for g in names] != [sorted(g) for g in meta["param_groups"]]:
            raise RuntimeError(f"client param groups {names} differ from the fixture's {meta['param_groups']}")
        optimizer = FW.build_client_optimizer(model, client)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config_for(meta, world(), load_universal)
        )
        FW.quiet_loggers()
        clear_zero3_adagrad_param_groups(engine)
        return engine
    decay, no_decay = FW.decay_groups(model.named_parameters())
    names = [[n for n, _ in decay], [n for n, _ in no_decay]]
    if [sorted(g) for g in names] != [sorted(g) for g in meta["param_groups"]]:
        raise RuntimeError(f"param groups {names} differ from the fixture's {meta['param_groups']}")
    wd = meta.get("param_group_weight_decay", [0.01, 0.0])
    groups = [
        {"params": [p for _, p in decay], "weight_decay": wd[0]},
        {"params": [p for _, p in no_decay], "weight_decay": wd[1]},
    ]
    cfg = ds_config_for(meta, world(), load_universal)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    FW.quiet_loggers()
    return engine


def _num(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else None
    return v


def optimizer_facts(engine) -> dict:
    """Per-rank: every `step` in the torch optimizer's state and param groups, loss scale, lrs."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", None)
    facts: dict = {"wrapper": type(opt).__name__, "base": type(base).__name__ if base is not None else None}
    if base is not None:
        facts["state_steps"] = sorted({float(_num(s["step"])) for s in base.state.values() if "step" in s})
        facts["num_state_entries"] = len(base.state)
        facts["state_numels"] = sorted(
            int(s["exp_avg"].numel()) for s in base.state.values() if isinstance(s.get("exp_avg"), torch.Tensor)
        )
        facts["state_keys"] = sorted({k for s in base.state.values() for k in s})
        facts["num_nonempty_state_entries"] = sum(1 for s in base.state.values() if s)
        facts["group_steps"] = [_num(g.get("step")) for g in base.param_groups]
        facts["group_lrs"] = [g.get("lr") for g in base.param_groups]
        facts["group_weight_decay"] = [g.get("weight_decay") for g in base.param_groups]
    scaler = getattr(opt, "loss_scaler", None)
    facts["loss_scaler"] = type(scaler).__name__ if scaler is not None else None
    facts["cur_scale"] = _num(getattr(scaler, "cur_scale", None)) if scaler is not None else None
    facts["clip_grad"] = _num(getattr(opt, "clip_grad", None))
    return facts


def dump_state(engine, dump: Path, stage: int, load_path: str, state_keys=FW.ADAM_STATE_KEYS) -> None:
    """Collective: every rank must call it.  `state_keys`: the optimizer states dumped as `<key>/<n>`."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    FW.relink_hp_optimizer_state(engine)  # DeepSpeed 0.19.8 links param-group >= 1 states lazily (see FW)
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        got = [(f"fp32/{n}", safe_get_full_fp32_param(p))]
        got += [(f"{k}/{n}", safe_get_full_optimizer_state(p, k)) for k in state_keys]
        for key, t in got:
            if t is None:
                raise RuntimeError(f"{key}: safe_get_full_* returned None after load")
            out[key] = t.detach().cpu().clone().contiguous()

    params = list(engine.module.parameters())
    if stage == 3:
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        for k, t in engine.module.state_dict().items():
            out[f"module/{k}"] = t.detach().cpu().clone().contiguous()
    for n, b in engine.module.named_buffers():
        if f"module/{n}" not in out:  # non-persistent
            out[f"module/{n}"] = b.detach().cpu().clone().contiguous()

    per_rank = optimizer_facts(engine)
    all_ranks: list[Any] = [None] * world()
    dist.all_gather_object(all_ranks, per_rank)
    if rank() == 0:
        from safetensors.torch import save_file

        dump.parent.mkdir(parents=True, exist_ok=True)
        save_file(out, str(dump), metadata={"format": "pt"})
        info = {
            "world_size": world(),
            "load_path": load_path,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "zero_stage": engine.zero_optimization_stage(),
            "dp_world_size": engine.seq_dp_world_size,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "optimizer_step": sorted({s for f in all_ranks for s in f.get("state_steps", [])}),
            "cur_scale": per_rank["cur_scale"],
            "ranks": all_ranks,
        }
        dump.with_suffix(".json").write_text(json.dumps(info, indent=1, default=str))


def train_steps(engine, steps: int) -> list[float]:
    import torch.distributed as dist

    m, r = world(), rank()
    micro = GLOBAL_BATCH // m
    g = torch.Generator().manual_seed(DATA_SEED)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, FW.VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        targets = torch.randint(0, FW.VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        sl = slice(r * micro, (r + 1) * micro)
        loss = engine(ids[sl], targets[sl])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / m)
    return losses


def run_engine(job: dict) -> None:
    """One load (+ dump, + training).  job: fixture_meta, load, dump, steps, losses, scramble."""
    t0 = time.time()
    meta = json.loads(Path(job["fixture_meta"]).read_text())
    engine = build_engine(meta, job.get("scramble", True), job.get("load_universal"))
    t1 = time.time()
    load_path, _client = engine.load_checkpoint(job["load"], load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"engine.load_checkpoint({job['load']!r}) returned None: nothing was loaded")
    t2 = time.time()
    if job.get("dump"):
        dump_state(
            engine,
            Path(job["dump"]),
            meta["zero_stage"],
            str(load_path),
            meta.get("reference_state_keys", FW.ADAM_STATE_KEYS),
        )
    t3 = time.time()
    steps = int(job.get("steps") or 0)
    losses = train_steps(engine, steps) if steps else []
    t4 = time.time()
    after: list[Any] | None = None
    if steps:  # the step counters after training: catches e.g. one `step` tensor shared by several states
        import torch.distributed as dist

        after = [None] * world()
        dist.all_gather_object(after, optimizer_facts(engine))
    if rank() == 0 and job.get("losses"):
        Path(job["losses"]).write_text(
            json.dumps(
                {
                    "world_size": world(),
                    "global_batch": GLOBAL_BATCH,
                    "losses": losses,
                    "global_steps_after": engine.global_steps,
                    "optimizer_step_after": sorted({s for f in after or [] for s in f.get("state_steps", [])}),
                    "ranks_after": after,
                },
                indent=1,
                default=str,
            )
        )
    log(
        f"{meta['name']} @ {world()} ranks from {job['load']}: engine {t1 - t0:.1f}s, load {t2 - t1:.1f}s, "
        f"dump {t3 - t2:.1f}s, {steps} steps {t4 - t3:.1f}s; losses {losses}"
    )
    del engine


class GlobalPatches:
    """DeepSpeed leaves some process-wide patches behind, e.g. ZeRO-3 replaces torch.nn.functional.linear
    with its memory-efficient version "until manually reset", which changes bf16 rounding for any later
    engine in the same process.  A snapshot of the patched namespaces, restored after every job, makes each
    job see what a fresh process would."""

    def __init__(self) -> None:
        import torch.nn.functional as F

        self.spaces = {
            "torch": torch,
            "torch.nn.functional": F,
            "torch.nn.Module": torch.nn.Module,
            "torch.Tensor": torch.Tensor,
        }
        self.saved = {name: dict(vars(ns)) for name, ns in self.spaces.items()}

    def restore(self) -> list[str]:
        restored = []
        for name, ns in self.spaces.items():
            now = vars(ns)
            for k, v in self.saved[name].items():
                if now.get(k, v) is not v:
                    try:
                        setattr(ns, k, v)
                        restored.append(f"{name}.{k}")
                    except (AttributeError, TypeError):
                        pass
        return restored


def run_jobs(jobs_file: Path) -> None:
    """Several loads in one process group (saves the ~10 s start-up per run).  Rank 0 writes each job's
    `status` file: {"ok": true, "seconds": s} or {"ok": false, "error": ...}.  A job that fails on every
    rank is recorded and the next one runs; a failure that leaves ranks out of step ends the process (the
    caller re-runs whatever has no status on its own)."""
    import gc
    import traceback

    import torch.distributed as dist

    jobs = json.loads(jobs_file.read_text())
    patches = GlobalPatches()
    for job in jobs:
        t0 = time.time()
        err = None
        try:
            run_engine(job)
        except Exception as e:  # noqa: BLE001 - recorded for the caller
            err = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        gc.collect()
        restored = patches.restore()
        if restored:
            log(f"restored after the job: {', '.join(restored)}")
        errors = [None] * world()
        dist.all_gather_object(errors, err)
        if rank() == 0:
            bad = {r: e for r, e in enumerate(errors) if e}
            status: dict[str, Any] = {"ok": not bad, "seconds": round(time.time() - t0, 2)}
            if bad:
                status["error"] = next(iter(bad.values()))
                status["failed_ranks"] = sorted(bad)
            Path(job["status"]).write_text(json.dumps(status, indent=1))
        if any(errors) and not all(errors):
            raise SystemExit("a job failed on some ranks only; stopping this batch")


# --------------------------------------------------------------------------------------------------------
# trainer mode
# --------------------------------------------------------------------------------------------------------


def trainer_ds_config(meta: dict) -> dict:
    """The ds_config the fixture worker handed the Trainer ("auto" where the Trainer fills values in)."""
    src = meta["ds_config"]
    ds_cfg = {
        "zero_optimization": copy.deepcopy(src["zero_optimization"]),
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    if "optimizer" in src:
        ds_cfg["optimizer"] = {
            "type": src["optimizer"]["type"],
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return ds_cfg


def run_trainer(a) -> None:
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, Trainer, TrainingArguments

    t0 = time.time()
    meta = json.loads(Path(a.fixture_meta).read_text())
    resume = Path(a.resume).resolve()
    FW.quiet_loggers()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(resume))
    torch.manual_seed(FW.SEED)
    model = GPT2LMHeadModel(FW.tiny_gpt2_config(tokenizer))
    args = TrainingArguments(
        output_dir=str(resume.parent),
        use_cpu=True,
        bf16=True,
        deepspeed=trainer_ds_config(meta),
        per_device_train_batch_size=2,
        max_steps=a.max_steps,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        learning_rate=1e-2,
        weight_decay=0.01,
        seed=FW.SEED,
        data_seed=FW.SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=FW.TinyDataset(tokenizer), processing_class=tokenizer)
    FW.quiet_loggers()
    trainer.train(resume_from_checkpoint=str(resume))
    engine = trainer.model_wrapped
    if rank() == 0 and a.result:
        Path(a.result).write_text(
            json.dumps(
                {
                    "world_size": world(),
                    "global_step": trainer.state.global_step,
                    "engine_global_steps": engine.global_steps,
                    "dp_world_size": engine.seq_dp_world_size,
                    "log_history": trainer.state.log_history,
                },
                indent=1,
                default=str,
            )
        )
    log(
        f"trainer {meta['name']} @ {world()} ranks resumed from {resume}: global_step "
        f"{trainer.state.global_step} in {time.time() - t0:.1f}s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture-meta", help="the source fixture's meta.json")
    ap.add_argument("--load", help="checkpoint root (with `latest`) to load")
    ap.add_argument("--dump", help="rank 0 writes the loaded state here (.safetensors, + .json beside it)")
    ap.add_argument("--steps", type=int, default=0, help="training steps after the load")
    ap.add_argument("--losses", help="rank 0 writes the global mean loss per step here (JSON)")
    ap.add_argument("--no-scramble", action="store_true", help="keep the model's init values before the load")
    ap.add_argument(
        "--jobs",
        help="JSON list of engine jobs (fixture_meta, load, dump, steps, losses, status) "
        "to run one after the other in this process group",
    )
    ap.add_argument("--trainer", action="store_true", help="HF Trainer resume mode")
    ap.add_argument("--resume", help="trainer mode: checkpoint-N folder to resume from")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--result", help="trainer mode: rank 0 writes global_step and log_history here (JSON)")
    a = ap.parse_args(argv)
    if not a.jobs and not a.fixture_meta:
        ap.error("--fixture-meta is required")
    if a.trainer:
        if not a.resume:
            ap.error("--trainer needs --resume")
        run_trainer(a)
    elif a.jobs:
        init_dist()
        run_jobs(Path(a.jobs))
    else:
        if not a.load:
            ap.error("--load is required (or --jobs)")
        init_dist()
        run_engine(
            {
                "fixture_meta": a.fixture_meta,
                "load": a.load,
                "dump": a.dump,
                "steps": a.steps,
                "losses": a.losses,
                "scramble": not a.no_scramble,
            }
        )
    FW.finish_distributed()
    return 0


if __name__ == "__main__":
    from fixtures.build import ds_launch

    ds_launch.exit_worker(main)

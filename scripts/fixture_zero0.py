"""Fixture worker for DeepSpeed engines WITHOUT ZeRO (stage 0), loaded by scripts/make_fixtures.py.

    torchrun --nproc_per_node N scripts/fixture_zero0.py build --spec <json> --out <dir>

At stage 0 the whole optimizer state lives in `mp_rank_00_model_states.pt["optimizer"]` (no
`*_optim_states.pt`): the wrapper DeepSpeed picks depends on the dtype and the torch optimizer
(`engine._do_optimizer_sanity_check`, `_configure_fp16_optimizer`):

  * bf16 + a fused optimizer (DS "optimizer" block -> FusedAdam): FP16_Optimizer, one flat fp32 master per group;
  * bf16 + a client torch optimizer: FP16_UnfusedOptimizer, one fp32 master per param;
  * fp32: no wrapper, the torch optimizer itself (the module params are the masters).

The toy model, data and param groups are scripts/fixture_worker.py's (imported). References come from the live
engine's own objects (DeepSpeed's safe_get_full_* helpers answer None without ZeRO): `fp32/<n>` (the masters),
`<state>/<n>` for every tensor state of the torch optimizer, and `bit16.safetensors` (engine.module_state_dict()).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
KIND = "zero0"
STEPS = 2


def _fixture_worker():
    spec = importlib.util.spec_from_file_location("ckpt_fixture_worker", HERE / "fixture_worker.py")
    assert spec
    assert spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ckpt_fixture_worker"] = mod
    spec.loader.exec_module(mod)
    return mod


CLIENT_ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}, "groups": "decay"}


def specs() -> list[dict]:
    base = {"kind": KIND, "world_size": 2, "zero_stage": 0, "dp": 2, "steps": STEPS}
    return [
        {**base, "name": "z0_dp2_bf16", "dtype": "bf16",
         "notes": "stage 0, bf16, DS optimizer block AdamW (FusedAdam): FP16_Optimizer with bf16, one flat fp32 "
         "master per param group (fp32_groups_flat)."},
        {**base, "name": "z0_dp2_bf16_client", "dtype": "bf16", "client_optimizer": CLIENT_ADAMW,
         "notes": "stage 0, bf16, client torch.optim.AdamW (2 decay groups): FP16_UnfusedOptimizer, one fp32 "
         "master per param (fp32_groups)."},
        {**base, "name": "z0_dp2_fp32", "dtype": "fp32",
         "notes": "stage 0, fp32, DS optimizer block AdamW (FusedAdam), no wrapper: the optimizer entry is "
         "FusedAdam's own state_dict, the module weights are the masters."},
        {**base, "name": "z0_dp2_fp32_client", "dtype": "fp32", "client_optimizer": CLIENT_ADAMW,
         "notes": "stage 0, fp32, client torch.optim.AdamW (2 decay groups), no wrapper: the optimizer entry is "
         "torch AdamW's state_dict (0-dim tensor steps)."},
    ]  # fmt: skip


# --- the engine --------------------------------------------------------------------------------------------


def build_engine(fw, spec: dict):
    import deepspeed

    torch.manual_seed(fw.SEED)
    model = fw.ToyModel()
    cfg = fw.ds_config_for(spec)
    client = spec.get("client_optimizer")
    if client:
        client = {**client, "param_groups": fw.client_param_groups(model, client.get("groups", "decay"))}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=fw.build_client_optimizer(model, client),
                                               config=cfg)  # fmt: skip
        groups_named = [g["params"] for g in client["param_groups"]]
    else:
        decay, no_decay = fw.decay_groups(model.named_parameters())
        groups = [{"params": [p for _, p in decay], "weight_decay": 0.01},
                  {"params": [p for _, p in no_decay], "weight_decay": 0.0}]  # fmt: skip
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
        groups_named = [[n for n, _ in decay], [n for n, _ in no_decay]]
    return engine, cfg, client, groups_named


def train(fw, engine, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(fw.SEED + 1000 * (fw.rank() + 1))
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, fw.VOCAB, (4, 6), generator=g)
        targets = torch.randint(0, fw.VOCAB, (4, 6), generator=g)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def masters_by_name(engine) -> list[list[tuple[str, torch.Tensor, torch.Tensor, int, int]]]:
    """Per optimizer param group: (name, the tensor the torch optimizer steps, ..., offset, numel) of every
    trained param: a slice of the flat fp32 group (FP16_Optimizer), its own fp32 copy (FP16_UnfusedOptimizer) or
    the module param itself (no wrapper)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    kind = type(opt).__name__
    out = []
    if kind == "FP16_Optimizer":
        for g, params in enumerate(opt.fp16_groups):
            flat, off, group = opt.fp32_groups_flat[g], 0, []
            for p in params:
                group.append((names[id(p)], flat, flat, off, p.numel()))
                off += p.numel()
            out.append(group)
    elif kind == "FP16_UnfusedOptimizer":
        for params, masters in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            out.append([(names[id(p)], m, m, 0, p.numel()) for p, m in zip(params, masters, strict=True)])
    else:
        out += [[(names[id(p)], p, p, 0, p.numel()) for p in pg["params"]] for pg in opt.param_groups]
    return out


def write_references(fw, engine, ref_dir: Path) -> list[str]:
    """full_state.safetensors (fp32/<n>, <state>/<n>) and bit16.safetensors; returns the tensor state keys."""
    full, state_keys = engine_full_state(engine)
    if fw.rank() == 0:
        fw.save_st(full, ref_dir / "full_state.safetensors")
        fw.save_st(engine.module_state_dict(), ref_dir / "bit16.safetensors")
    return state_keys


def engine_full_state(engine) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`fp32/<n>` and `<state>/<n>` of every trained param as the live engine holds them, and the state keys."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}
    full: dict[str, torch.Tensor] = {}
    state_keys: set[str] = set()
    for group in masters_by_name(engine):
        for name, master, stepped, off, numel in group:
            full[f"fp32/{name}"] = master.detach().reshape(-1)[off : off + numel].view(shapes[name])
            for key, value in base.state.get(stepped, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state_keys.add(key)
                    full[f"{key}/{name}"] = value.reshape(-1)[off : off + numel].view(shapes[name])
    return full, sorted(state_keys)


def optimizer_layout_facts(model_states: dict) -> dict:
    """What stage 0 keeps in `optimizer` (read back with torch.load for meta.json only)."""
    osd = model_states.get("optimizer")
    if not isinstance(osd, dict):
        return {"optimizer_entry": type(osd).__name__}
    facts: dict = {"optimizer_entry_keys": sorted(osd)}
    inner = osd.get("optimizer_state_dict", osd)
    facts["inner_state_keys"] = sorted({k for st in inner.get("state", {}).values() for k in st})
    facts["inner_num_state_entries"] = len(inner.get("state", {}))
    facts["inner_param_groups_params"] = [list(g["params"]) for g in inner.get("param_groups", [])]
    for key in ("fp32_groups_flat", "fp32_groups"):
        if key in osd:
            facts[f"{key}_shapes"] = [
                [list(t.shape) for t in g] if isinstance(g, list) else list(g.shape) for g in osd[key]
            ]
    steps = {}
    for pid, st in inner.get("state", {}).items():
        if "step" in st:
            v = st["step"]
            steps[str(pid)] = f"tensor({v.item()})" if isinstance(v, torch.Tensor) else repr(v)
    facts["inner_state_steps"] = steps
    facts["param_group_steps"] = [g.get("step") for g in inner.get("param_groups", [])]
    facts["scalars"] = {k: v for k, v in osd.items() if isinstance(v, (int, float, bool, str))}
    return facts


def run_build(spec: dict, out: Path) -> None:
    import deepspeed

    fw = _fixture_worker()
    fw.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    fw.quiet_loggers()
    engine, cfg, client, groups_named = build_engine(fw, spec)
    fw.quiet_loggers()
    losses = train(fw, engine, int(spec.get("steps", STEPS)))
    ckpt = out / spec.get("checkpoint", "checkpoint")
    engine.save_checkpoint(str(ckpt))
    tag = f"global_step{engine.global_steps}"
    state_keys = write_references(fw, engine, out / "reference")
    if fw.rank() == 0:
        files = sorted(p.name for p in (ckpt / tag).iterdir())
        saved = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        meta = {"name": spec["name"], "kind": spec["kind"], "zero_stage": 0, "dp": spec["dp"], "dtype": spec["dtype"]}
        meta.update(fw.common_meta(engine))
        meta.update(fw.model_facts(engine.module, [[n for n, *_ in g] for g in masters_by_name(engine)]))
        meta["script_param_groups"] = groups_named
        meta["tag"] = tag
        meta["tag_files"] = files
        meta["global_steps"] = engine.global_steps
        meta["dp_world_size_saved"] = saved.get("dp_world_size")
        meta["losses_rank0"] = losses
        meta["ds_config"] = cfg
        meta["reference_state_keys"] = state_keys
        meta["step_type"] = "tensor" if client else "int"
        meta.update(optimizer_layout_facts(saved))
        if client:
            meta["client_optimizer"] = client
        meta["notes"] = spec.get("notes", "")
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


# --- Lightning's DeepSpeedStrategy ------------------------------------------------------------------------------
# Lightning 2.6.6 refuses DeepSpeed off CUDA (DeepSpeedStrategy.setup_environment: "The DeepSpeed strategy is only
# supported on CUDA GPUs but `CPUAccelerator` is used."), so these fixtures are built on a GPU machine (one GPU:
# DP 1) with `lightning --stage S --out DIR`, a plain `python` process (Lightning starts its own process group).

LIGHTNING_PREFIX = "_forward_module."


def lightning_module(fw):
    import lightning as L

    class ToyLightning(L.LightningModule):
        """The toy model inside a LightningModule (keys `model.<name>`); torch AdamW over the decay groups."""

        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 0.01, "seed": fw.SEED})  # -> hyper_parameters in the model states
            torch.manual_seed(fw.SEED)
            self.model = fw.ToyModel()

        def training_step(self, batch, _i):
            return self.model(batch[0], batch[1])

        def configure_optimizers(self):
            decay, no_decay = fw.decay_groups(self.named_parameters())
            return torch.optim.AdamW([{"params": [p for _, p in decay], "weight_decay": 0.01},
                                      {"params": [p for _, p in no_decay], "weight_decay": 0.0}], lr=0.01)  # fmt: skip

    return ToyLightning()


def run_lightning(stage: int, out: Path) -> None:
    """Trainer.fit for STEPS steps with DeepSpeedStrategy(stage) in bf16; ModelCheckpoint writes
    checkpoint/epoch=0-step=2.ckpt/; references from the live engine; Lightning's own converter output."""
    import deepspeed
    import lightning as L
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    fw = _fixture_worker()
    g = torch.Generator().manual_seed(fw.SEED + 1000)
    data = torch.utils.data.TensorDataset(torch.randint(0, fw.VOCAB, (8, 6), generator=g),
                                          torch.randint(0, fw.VOCAB, (8, 6), generator=g))  # fmt: skip
    ckpt_dir = out / "checkpoint"
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=DeepSpeedStrategy(stage=stage), precision="bf16-mixed",
                        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir))])  # fmt: skip
    ref = out / "reference"
    facts: dict = {}

    class References(L.Callback):
        """After the last step, before Lightning's teardown moves the module off the GPU."""

        def on_train_end(self, trainer, pl_module) -> None:
            engine = trainer.strategy.deepspeed_engine
            fw.relink_hp_optimizer_state(engine)  # DeepSpeed links group >= 1's state fragments lazily (ZeRO-1/2)
            full = {}
            for n, p in engine.module.named_parameters():
                if p.requires_grad:
                    key = n.removeprefix(LIGHTNING_PREFIX)
                    full[f"fp32/{key}"] = safe_get_full_fp32_param(p).cpu()
                    for state in ("exp_avg", "exp_avg_sq"):
                        full[f"{state}/{key}"] = safe_get_full_optimizer_state(p, state).cpu()
            bit16 = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module_state_dict()
            fw.save_st(full, ref / "full_state.safetensors")
            fw.save_st({k.removeprefix(LIGHTNING_PREFIX): v for k, v in bit16.items()}, ref / "bit16.safetensors")
            facts.update(fw.common_meta(engine))
            facts.update(fw.model_facts(engine.module, fw.engine_param_groups(engine)[0]))
            facts["global_steps"] = engine.global_steps

    trainer.callbacks.append(References())
    trainer.fit(lightning_module(fw), torch.utils.data.DataLoader(data, batch_size=4))
    folders = sorted(p.name for p in ckpt_dir.iterdir())
    converted = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir / folders[0]), str(out / "converted.pt"))
    fw.save_st(converted["state_dict"], ref / "lightning_converter.safetensors")
    meta = {"name": f"lightning_z{stage}_bf16", "kind": "lightning", "zero_stage": stage, "dp": 1, "dtype": "bf16"}
    meta.update(facts)
    meta.update({"lightning_version": L.__version__, "deepspeed_version": deepspeed.__version__,
                 "torch_version": torch.__version__, "device": torch.cuda.get_device_name(0),
                 "checkpoint": f"checkpoint/{folders[0]}", "checkpoint_folders": folders,
                 "files": {str(p.relative_to(ckpt_dir)): p.stat().st_size
                           for p in sorted(ckpt_dir.rglob("*")) if p.is_file()},
                 "converter_keys": list(converted["state_dict"]),
                 "converter_client_state_keys": sorted(k for k in converted if k != "state_dict")})  # fmt: skip
    (out / "converted.pt").unlink()
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "lightning"])
    ap.add_argument("--spec")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.mode == "lightning":
        run_lightning(a.stage, Path(a.out).resolve())
        return 0
    run_build(json.loads(a.spec), Path(a.out).resolve())
    fw = sys.modules["ckpt_fixture_worker"]
    fw.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSpeed-MoE fixtures for scripts/make_fixtures.py (kind `moe`).  Not meant to be run by hand.

    torchrun --nproc_per_node <world_size> scripts/fixture_moe.py build --spec <json> --out <dir>
    torchrun --nproc_per_node 2 scripts/fixture_moe.py probe_zero3 --out <dir>   (records DeepSpeed's answer)

The model (`MoEToy`): Embedding(24, 8) -> Linear(8, 8) -> MoE layer 0 (4 experts, top-1) -> LayerNorm(8)
-> MoE layer 1 (4 experts, top-2) -> Linear(8, 24) head.  Each expert is Linear(8, 6) -> ReLU -> Linear(6, 8).
Both MoE layers use ep_size=2, so each rank holds 2 of the 4 experts of each layer.  The optimizer gets
DeepSpeed's own param groups: `split_params_into_different_moe_groups_for_optimizer` over a weight-decay /
no-decay split moves the expert params into groups marked `moe: True`, `name: "ep_size_2"`.

References (written from the live engine, rank 0 writes, every rank takes part in the gathers):
  reference/full_state.safetensors  fp32/<key>, exp_avg/<key>, exp_avg_sq/<key> for every trainable param, experts
                                    under their GLOBAL key (...deepspeed_experts.<global id>...) gathered from
                                    every expert-parallel rank (safe_get_full_fp32_param/_optimizer_state)
  reference/bit16.safetensors       the engine's 16-bit module state with global expert keys
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = Path(__file__).resolve().parent
KIND = "moe"
SEED = 1234
VOCAB = 24
DIM = 8
HIDDEN = 6
NUM_EXPERTS = 4
EP_SIZE = 2
STEPS = 2
MICRO_BATCH = 4
SEQ = 6
EXPERT_RE = re.compile(r"^(?P<prefix>.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<local>\d+)\.(?P<rest>.*)$")


def _fixture_worker():
    """scripts/fixture_worker.py: quiet_loggers, save_st, relink_hp_optimizer_state, common_meta, ..."""
    spec = importlib.util.spec_from_file_location("ckpt_fixture_worker", HERE / "fixture_worker.py")
    assert spec
    assert spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ckpt_fixture_worker", mod)
    spec.loader.exec_module(mod)
    return mod


fw = _fixture_worker()


def specs() -> list[dict]:
    def spec(stage: int, dp: int, notes: str, suffix: str = "", **extra: Any) -> dict:
        return {
            "name": f"moe_ep{EP_SIZE}_dp{dp}_z{stage}_bf16{suffix}",
            "kind": KIND,
            "world_size": dp,
            "zero_stage": stage,
            "dp": dp,
            "dtype": "bf16",
            "ep_size": EP_SIZE,
            "notes": notes,
            **extra,
        }

    return [
        spec(2, 2, "ZeRO-2, 2 ranks, ep_size 2: expert-DP size 1 (each rank holds its 2 experts per layer whole)"),
        spec(2, 4, "ZeRO-2, 4 ranks, ep_size 2: expert-DP size 2 (each expert group partitioned over 2 ranks)"),
        spec(1, 2, "ZeRO-1, 2 ranks, ep_size 2: the same files as ZeRO-2 but zero_stage 1, no frozen_param_*"),
        spec(
            2,
            4,
            "ZeRO-2, 4 ranks, ep_size 2, use_data_before_expert_parallelism: expert-DP groups [0, 1], [2, 3]",
            "_dbe",
            data_before_expert=True,
        ),
    ]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class MoEToy(nn.Module):
    """Two DeepSpeed MoE layers (top-1 and top-2 gates) between ordinary layers."""

    def __init__(self, ep_size: int = EP_SIZE) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.moe0 = MoE(DIM, Expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, k=1, min_capacity=SEQ * MICRO_BATCH)
        self.ln = nn.LayerNorm(DIM)
        self.moe1 = MoE(DIM, Expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, k=2, min_capacity=SEQ * MICRO_BATCH)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.emb(ids)))
        m0, aux0, _ = self.moe0(h)
        h = self.ln(h + m0)
        m1, aux1, _ = self.moe1(h)
        logits = self.head(h + m1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
        return loss + 0.01 * (aux0 + aux1).float()


def param_groups(model: nn.Module) -> list[dict]:
    """A weight-decay / no-decay split, then DeepSpeed's own split of the expert params into MoE groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay: list[Any] = []
    no_decay: list[Any] = []
    for n, p in model.named_parameters():
        (no_decay if n.endswith(".bias") or n.startswith("ln.") else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]  # fmt: skip
    return split_params_into_different_moe_groups_for_optimizer(groups)


def ds_config(stage: int, micro_batch: int = MICRO_BATCH, data_before_expert: bool = False) -> dict:
    """The fixtures' config; `data_before_expert` picks DeepSpeed's D+E rank topology (contiguous expert-DP groups)."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
    }
    if data_before_expert:
        cfg["use_data_before_expert_parallelism"] = True
    return cfg


def moe_layers(module: nn.Module) -> list[tuple[str, Any]]:
    from deepspeed.moe.layer import MoE

    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoE)]


def global_key(name: str, module: nn.Module) -> str:
    """A parameter/state-dict key of this rank's module under the expert's global index."""
    from deepspeed.utils import groups

    m = EXPERT_RE.match(name)
    if not m:
        return name
    layer = dict(moe_layers(module))[m["prefix"]]
    ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    gid = ep_rank * layer.num_local_experts + int(m["local"])
    return f"{m['prefix']}.deepspeed_moe.experts.deepspeed_experts.{gid}.{m['rest']}"


def gather_global(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's {global key: tensor} merged; replicas (expert-DP ranks, dense params) must be bit-identical."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu().clone() for k, v in local.items()})
    merged: dict[str, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for k, v in part.items():
            if k in merged and not torch.equal(merged[k], v):
                raise RuntimeError(f"rank {r} holds another {k} than a lower rank")
            merged.setdefault(k, v)
    return merged


def ordered_bit16(module: nn.Module, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state-dict order with each layer's local experts expanded to all global experts."""
    out: dict[str, torch.Tensor] = {}
    for key in module.state_dict():
        m = EXPERT_RE.match(key)
        if not m:
            out[key] = merged[key]
            continue
        prefix = f"{m['prefix']}.deepspeed_moe.experts.deepspeed_experts."
        for k in sorted((k for k in merged if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :].split(".")[0])):
            out.setdefault(k, merged[k])
    return out


def full_state(engine, state_keys=("exp_avg", "exp_avg_sq")) -> dict[str, torch.Tensor]:
    """fp32 masters and Adam moments of every trainable param under global keys (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    fw.relink_hp_optimizer_state(engine)
    local = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        key = global_key(n, engine.module)
        local[f"fp32/{key}"] = safe_get_full_fp32_param(p)
        for sk in state_keys:
            local[f"{sk}/{key}"] = safe_get_full_optimizer_state(p, sk)
    missing = [k for k, v in local.items() if v is None]
    if missing:
        raise RuntimeError(f"safe_get_full_* returned None for {missing}")
    return gather_global(local)


def bit16_state(engine) -> dict[str, torch.Tensor]:
    local = {global_key(k, engine.module): v for k, v in engine.module.state_dict().items()}
    return ordered_bit16(engine.module, gather_global(local))


def rank_topology(engine) -> dict:
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    name = f"ep_size_{EP_SIZE}"
    mine = {
        "rank": dist.get_rank(),
        "ep_rank": groups._get_expert_parallel_rank(name),
        "expert_dp_rank": groups._get_expert_data_parallel_rank(name),
        "expert_dp_world_size": groups._get_expert_data_parallel_world_size(name),
    }
    parts: list[Any] = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    return {"ranks": parts}


def train(engine, rank: int, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(SEED + 1000 * (rank + 1))
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def init(stage: int, data_before_expert: bool = False):
    import deepspeed

    fw.quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    fw.quiet_loggers()
    torch.manual_seed(SEED)
    model = MoEToy()
    cfg = ds_config(stage, data_before_expert=data_before_expert)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    fw.quiet_loggers()
    return engine, cfg


def file_facts(tag_dir: Path) -> dict:
    """Which files the save wrote and what the optimizer param groups say (meta.json facts)."""
    optims = sorted(tag_dir.glob("*_optim_states.pt"))
    sd = torch.load(optims[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
    base = sd["base_optimizer_state"]["param_groups"]
    model = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {
        "files": sorted(p.name for p in tag_dir.iterdir()),
        "num_experts": model.get("num_experts"),
        "ds_autoep_layers": model.get("ds_autoep_layers"),
        "param_group_names": [g.get("name") for g in base],
        "param_group_moe": [bool(g.get("moe")) for g in base],
        "partition_count": list(sd["partition_count"]),
        "param_shapes": [{k: list(v) for k, v in g.items()} for g in model["param_shapes"]],
    }


def run_build(spec: dict, out: Path) -> None:
    engine, cfg = init(spec["zero_stage"], bool(spec.get("data_before_expert")))
    rank = int(os.environ.get("RANK", "0"))
    topo = rank_topology(engine)
    losses = train(engine, rank, STEPS)
    ckpt = out / spec.get("checkpoint", "checkpoint")
    engine.save_checkpoint(str(ckpt))
    tag = f"global_step{engine.global_steps}"
    full = full_state(engine)
    bit16 = bit16_state(engine)
    if rank == 0:
        fw.save_st(full, out / "reference" / "full_state.safetensors")
        fw.save_st(bit16, out / "reference" / "bit16.safetensors")
        meta = {k: spec[k] for k in ("name", "kind", "zero_stage", "dp", "dtype", "ep_size")}
        meta["data_before_expert"] = bool(spec.get("data_before_expert"))
        meta.update(fw.common_meta(engine))
        meta.update(
            {
                "step_type": "int",
                "tag": tag,
                "global_steps": engine.global_steps,
                "num_experts_per_layer": NUM_EXPERTS,
                "moe_layers": [n for n, _ in moe_layers(engine.module)],
                "gate_k": [m.deepspeed_moe.gate.k for _, m in moe_layers(engine.module)],
                "expert_dp_size": spec["dp"] // EP_SIZE,
                "topology": topo,
                "losses_rank0": losses,
                "ds_config": cfg,
                "state_dict_keys": list(bit16),
                "trainable": [k.split("/", 1)[1] for k in full if k.startswith("fp32/")],
                **file_facts(ckpt / tag),
                "notes": spec.get("notes", ""),
            }
        )
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1, default=str))


def run_probe_zero3(out: Path) -> None:
    """What DeepSpeed says to MoE + ZeRO-3 (train 1 step and save); rank 0 records the outcome."""
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {}
    try:
        engine, _ = init(3)
        result["initialize"] = "ok"
        train(engine, rank, 1)
        result["train"] = "ok"
        engine.save_checkpoint(str(out / "checkpoint"))
        result["save"] = sorted(p.name for p in (out / "checkpoint").rglob("*.pt"))
    except Exception as e:  # noqa: BLE001 - the outcome is the point
        result["error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        (out / "probe_zero3.json").write_text(json.dumps(result, indent=1))


def run_probe_autoep(out: Path) -> None:
    """Whether a tiny transformers Mixtral trains under DeepSpeed AutoEP (expert_parallel) on CPU; rank 0 records."""
    import deepspeed
    from transformers import MixtralConfig, MixtralForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {}
    try:
        fw.quiet_loggers()
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(SEED)
        config = MixtralConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=NUM_EXPERTS,
                               num_experts_per_tok=2, max_position_embeddings=32)  # fmt: skip
        model = MixtralForCausalLM(config)
        cfg = ds_config(2)
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": EP_SIZE, "preset_model": "mixtral",
                                  "use_grouped_mm": False}  # fmt: skip
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        result["initialize"] = "ok"
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(SEED + rank))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        result["train"] = "ok"
        engine.save_checkpoint(str(out / "checkpoint"))
        result["save"] = sorted(p.name for p in (out / "checkpoint").rglob("*.pt"))
    except Exception as e:  # noqa: BLE001 - the outcome is the point
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["where"] = traceback.format_exc().splitlines()[-6:]
    if rank == 0:
        (out / "probe_autoep.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "probe_zero3", "probe_autoep"])
    ap.add_argument("--spec")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if a.mode == "build":
        run_build(json.loads(a.spec), out)
    else:
        (run_probe_zero3 if a.mode == "probe_zero3" else run_probe_autoep)(out)
        os._exit(0)  # a failed ZeRO-3 init can leave ranks out of step: no final barrier
    fw.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

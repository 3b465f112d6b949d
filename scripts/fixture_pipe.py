"""Fixture worker: DeepSpeed PipelineModule (pipeline-parallel) checkpoints.  Not meant to be run by hand.

    torchrun --nproc_per_node <stages*dp> scripts/fixture_pipe.py build --spec <json> --out <dir>
    torchrun --nproc_per_node 2 scripts/fixture_pipe.py probe_zero2 --out <file.json>

`build` trains the toy pipeline model (`pipe_layers()`) for 2 steps with ZeRO-1 and bf16, saves it with
`engine.save_checkpoint`, and writes from the live engines of every stage (merged on global rank 0):
  reference/full_state.safetensors  fp32/<key>, exp_avg/<key>, exp_avg_sq/<key> for every trainable parameter
                                     (safe_get_full_fp32_param / safe_get_full_optimizer_state), whole-model keys
  reference/bit16.safetensors        every stage's engine.module.state_dict() (16-bit), whole-model keys
  meta.partial.json                  layout facts (stages, layer->stage map, tied keys, partition method, ...)
`probe_zero2` records what DeepSpeed says to ZeRO-2 with a PipelineModule.

Whole-model keys are the stage-local names: PipelineModule registers layer i as `str(i)` on whichever stage
builds it and tied modules as `tied_modules.<key>` on every stage that uses them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_worker import dtype_name, finish_distributed, quiet_loggers, relink_hp_optimizer_state, save_st  # noqa: E402

SEED = 1234
VOCAB = 16
DIM = 8
STEPS = 2
MICRO_BATCH = 2
GAS = 2  # micro-batches per step: the pipeline schedule actually interleaves
SEQ = 5
STAGES = 2
PARTITION_METHOD = "uniform"
KIND = "pipeline"


class ScaledLinear(nn.Linear):
    """A Linear with a persistent float buffer (so stage files carry buffer_names)."""

    scale: torch.Tensor  # the buffer registered below, as the type checker should see it

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.to(x.dtype)


def head_fn(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """The output head: the tied embedding's weight as a Linear (TiedLayerSpec forward_fn)."""
    return F.linear(h, embedding.weight)


def tanh(x: torch.Tensor) -> torch.Tensor:  # a parameterless layer: no layer file
    return torch.tanh(x)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def pipe_layers() -> list:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, tied_weight_attr="weight"),  # 0
        LayerSpec(nn.LayerNorm, DIM),  # 1
        LayerSpec(nn.Linear, DIM, 11),  # 2 (odd size: ZeRO padding on stage 0)
        tanh,  # 3
        LayerSpec(ScaledLinear, 11, DIM),  # 4
        LayerSpec(nn.LayerNorm, DIM),  # 5
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head_fn, tied_weight_attr="weight"),  # 6
    ]


def build_model(stages: int = STAGES, partition_method: str = PARTITION_METHOD):
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(SEED)
    return PipelineModule(
        layers=pipe_layers(), num_stages=stages, loss_fn=loss_fn, partition_method=partition_method, base_seed=SEED
    )


def ds_config(spec: dict, dp: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO_BATCH * GAS * dp,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": spec["zero_stage"]},
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if spec.get("grad_accum_dtype"):
        cfg["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    return cfg


def batches(dp_rank: int, seed_offset: int = 0):
    """An endless iterator of (ids, labels) micro-batches, different per DP replica."""
    g = torch.Generator().manual_seed(SEED + 1000 * (dp_rank + 1) + seed_offset)
    while True:
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        yield ids, torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)


def make_engine(spec: dict, dp: int, extra_cfg: dict | None = None):
    import deepspeed

    quiet_loggers()
    deepspeed.init_distributed(dist_backend="gloo")
    quiet_loggers()
    model = build_model(spec.get("stages", STAGES), spec.get("partition_method", PARTITION_METHOD))
    cfg = {**ds_config(spec, dp), **(extra_cfg or {})}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    quiet_loggers()
    return engine, cfg


def stage_full_state(engine, state_keys=("exp_avg", "exp_avg_sq")) -> dict:
    """fp32/<key> and <state>/<key> of this stage's trainable params (collective over the stage's DP group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink_hp_optimizer_state(engine)
    full = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            full[f"fp32/{n}"] = safe_get_full_fp32_param(p)
            for key in state_keys:
                full[f"{key}/{n}"] = safe_get_full_optimizer_state(p, key)
    missing = [k for k, t in full.items() if t is None]
    if missing:
        raise RuntimeError(f"safe_get_full_* returned None for {missing}")
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def merge_stages(parts: list[dict]) -> tuple[dict, dict, dict]:
    """One dict from every stage's (stage order), a key held by several stages (tied) from the first; also, per
    such key, whether all copies are bit-identical, and every stage's copy as `<stage>/<key>`."""
    merged: dict[str, Any] = {}
    equal: dict[str, Any] = {}
    copies: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if k in merged:
                equal[k] = bool(equal.get(k, True) and merged[k].dtype == v.dtype and torch.equal(merged[k], v))
            else:
                merged[k] = v
    for stage, part in enumerate(parts):
        copies.update({f"{stage}/{k}": v for k, v in part.items() if k in equal})
    return merged, equal, copies


def max_diff(copies: dict, key: str) -> float:
    vals = [v.float() for k, v in copies.items() if k.split("/", 1)[1] == key]
    return max(float((v - vals[0]).abs().max()) for v in vals)


def layer_stage_map(engine) -> dict[str, int]:
    parts = engine.module.parts  # stage s holds layers [parts[s], parts[s+1])
    return {str(i): s for s in range(len(parts) - 1) for i in range(parts[s], parts[s + 1])}


def layer_name(spec) -> str:
    if hasattr(spec, "typename"):  # LayerSpec / TiedLayerSpec
        key = getattr(spec, "key", None)
        return spec.typename.__name__ + (f" (tied '{key}')" if key else "")
    return f"function {spec.__name__}"


def gather_to_rank0(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_build(spec: dict, out: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    dp = spec["dp"]
    engine, cfg = make_engine(spec, dp)
    grid = engine.grid
    stage, dp_rank = grid.get_stage_id(), grid.get_data_parallel_rank()
    it = batches(dp_rank)
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(spec.get("steps", STEPS))]
    ckpt = out / spec.get("checkpoint", "checkpoint")
    engine.save_checkpoint(str(ckpt))
    full = stage_full_state(engine)
    bit16 = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    local = {
        "stage": stage,
        "dp_rank": dp_rank,
        "full": full if dp_rank == 0 else None,
        "bit16": bit16 if dp_rank == 0 else None,
        "names": [n for n, _ in engine.module.named_parameters()],
        "state_dict_keys": list(bit16),
        "buffers": [n for n, _ in engine.module.named_buffers()],
        "tied": {k: engine.module.tied_weight_attrs[k] for k in engine.module.tied_modules},
        "losses": losses,
    }
    everyone = gather_to_rank0(local)
    if dist.get_rank() == 0:
        firsts = sorted((p for p in everyone if p["dp_rank"] == 0), key=lambda p: p["stage"])
        full_all, tied_masters, full_copies = merge_stages([p["full"] for p in firsts])
        bit16_all, tied_bit16, bit16_copies = merge_stages([p["bit16"] for p in firsts])
        save_st(full_all, out / "reference" / "full_state.safetensors")
        save_st(bit16_all, out / "reference" / "bit16.safetensors")
        # every stage's own copy of the tied entries: <stage>/fp32/<key>, <stage>/exp_avg/<key>, <stage>/module/<key>
        tied_copies = {**full_copies, **{f"{k.split('/', 1)[0]}/module/{k.split('/', 1)[1]}": v
                                         for k, v in bit16_copies.items()}}  # fmt: skip
        save_st(tied_copies, out / "reference" / "tied_per_stage.safetensors")
        tag = f"global_step{engine.global_steps}"
        meta = {
            "name": spec["name"],
            "kind": spec["kind"],
            "zero_stage": spec["zero_stage"],
            "dp": dp,
            "dtype": spec["dtype"],
            "optimizer": type(engine.basic_optimizer).__name__,
            "optimizer_wrapper": type(engine.optimizer).__name__,
            "step_type": "int",
            "ds_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "world_size": dist.get_world_size(),
            "stages": STAGES,
            "partition_method": PARTITION_METHOD,
            "parts": list(engine.module.parts),
            "layer_stage": layer_stage_map(engine),
            "layers": [layer_name(s) for s in pipe_layers()],
            "tied_modules": local["tied"],
            "tied_keys_on_several_stages": sorted(tied_masters),
            "tied_masters_equal_across_stages": tied_masters,
            "tied_bit16_equal_across_stages": tied_bit16,
            "tied_max_abs_diff_across_stages": {k: max_diff(full_copies, k) for k in tied_masters},
            "stage_param_names": {str(p["stage"]): p["names"] for p in firsts},
            "stage_state_dict_keys": {str(p["stage"]): p["state_dict_keys"] for p in firsts},
            "stage_buffers": {str(p["stage"]): p["buffers"] for p in firsts},
            "whole_model_keys": list(bit16_all),
            "trainable": [k[len("fp32/") :] for k in full_all if k.startswith("fp32/")],
            "tag": tag,
            "global_steps": engine.global_steps,
            "losses": {f"stage{p['stage']}_dp{p['dp_rank']}": p["losses"] for p in everyone},
            "tag_files": sorted(os.listdir(ckpt / tag)),
            "bit16_dtypes": {k: dtype_name(v.dtype) for k, v in bit16_all.items()},
            "ds_config": cfg,
            "notes": spec.get("notes", ""),
        }
        (out / "meta.partial.json").write_text(json.dumps(meta, indent=1))


def run_probe_zero2(out: Path) -> None:
    """What DeepSpeed does with ZeRO-2 and a PipelineModule (recorded, not raised)."""
    spec = {"zero_stage": 2, "dtype": "bf16", "dp": 1}
    try:
        engine, _ = make_engine(spec, 1)
        info = {"ok": True, "optimizer_wrapper": type(engine.optimizer).__name__}
    except BaseException as e:  # noqa: BLE001 - recorded
        info = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(info, indent=1))


def specs() -> list[dict]:
    common = {"kind": KIND, "worker": "fixture_pipe.py", "zero_stage": 1, "dtype": "bf16", "stages": STAGES}
    return [
        {**common, "name": f"pp{STAGES}_dp{dp}_z1_bf16", "world_size": STAGES * dp, "dp": dp,
         "notes": f"PipelineModule, {STAGES} stages x DP {dp} ({STAGES * dp} processes), ZeRO-1, bf16 "
         "(DeepSpeedZeroOptimizer: bf16 + ZeRO-1 without grad_accum_dtype=fp32), partition_method=uniform, "
         f"embedding tied to the head (TiedLayerSpec 'embed'), {GAS} micro-batches, {STEPS} train_batch steps."}
        for dp in (1, 2)
    ] + [
        {**common, "name": f"pp{STAGES}_dp2_z0_bf16", "world_size": STAGES * 2, "dp": 2, "zero_stage": 0,
         "notes": f"PipelineModule, {STAGES} stages x DP 2, ZeRO stage 0, bf16: DeepSpeed picks BF16_Optimizer "
         "(bf16 + pipeline without ZeRO, the Megatron-DeepSpeed default); its optimizer files are "
         "bf16_zero_pp_rank_D_mp_rank_SS_optim_states.pt with no zero_stage key. Same model and steps."}
    ]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "probe_zero2"])
    ap.add_argument("--spec")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if a.mode == "probe_zero2":
        run_probe_zero2(out)
    else:
        run_build(json.loads(a.spec), out)
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

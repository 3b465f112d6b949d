"""Benchmark `ckpt consolidate` on torch Distributed Checkpoint (FSDP2) folders against torch's `dcp_to_torch_save`
and accelerate's `merge-weights`.

    python -m benchmarks.bench_dcp --work /tmp/bench-dcp [--ranks 8] [--layers 22] [--out DIR]

1. Writes two DCP checkpoints of a TinyLlama-1.1B-shaped model (hidden 2048, 22 layers, intermediate 5632, 4 KV
   heads, vocab 32000: 1.10 B fp32 parameters, 4.4 GB) with `--ranks` CPU processes (torchrun + gloo), each holding
   its dim-0 shard of every parameter as a DTensor, as FSDP2 does, plus AdamW's exp_avg / exp_avg_sq / step:
     accelerate/  checkpoint as accelerate's SHARDED_STATE_DICT saves it: pytorch_model_fsdp_0/ ({"model": ...})
                  and optimizer_0/ ({"optim": ...});
     combined/    one folder {"model": ..., "optim": ...}, as get_state_dict + dcp.save (torchtitan, OpenRLHF).
2. Runs, each a subprocess measured by `bench_consolidate.run_measured` (wall, peak RSS of the tree, bytes read
   through read syscalls (rchar) and from storage):
     ckpt-fp32 / ckpt-bf16 on combined/ and ckpt-fp32 on accelerate/pytorch_model_fsdp_0;
     dcp_to_torch_save on combined/ (what it is for: it loads every key) and on the model folder;
     accelerate merge-weights on the model folder;
     floor: read the model chunks' bytes and write them to one file, in-process, one thread.
3. Checks that ckpt's fp32 output equals every peer's model entries (torch.equal) and writes OUT/dcp.json and
   OUT/dcp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODULE = "benchmarks.bench_dcp"
SHAPE = {"hidden": 2048, "intermediate": 5632, "kv": 256, "vocab": 32000}
GB = 1e9


def param_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, i, kv, v = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["kv"], SHAPE["vocab"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


# --- building (one process per rank, under torchrun) -------------------------------------------------------------


def build_worker(work: Path, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1234 + rank)
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for name, shape in param_shapes(layers).items():
        full_meta = torch.empty(shape, device="meta")
        local_shape = distribute_tensor(full_meta, mesh, [Shard(0)]).to_local().shape
        tensors = [torch.randn(local_shape, generator=gen) * 0.02 for _ in range(3)]
        model[name], avg, avg_sq = (DTensor.from_local(t, mesh, [Shard(0)], shape=full_meta.shape, stride=full_meta.stride())
                                    for t in tensors)  # fmt: skip
        state[name] = {"step": torch.tensor(100.0), "exp_avg": avg, "exp_avg_sq": avg_sq.abs()}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(model)}]
    optim = {"state": state, "param_groups": groups}
    dcp.save({"model": model}, checkpoint_id=str(work / "accelerate" / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": optim}, checkpoint_id=str(work / "accelerate" / "optimizer_0"))
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(work / "combined"))
    dist.barrier()
    dist.destroy_process_group()


def build(work: Path, ranks: int, layers: int) -> float:
    if (work / "combined" / ".metadata").is_file():
        return 0.0
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_port=29555",
           "-m", MODULE, "--worker", "--work", str(work), "--layers", str(layers)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return time.perf_counter() - t0


# --- the peers, each run as `python -m benchmarks.bench_dcp --peer NAME SRC DST` ---------------------------------


def run_peer(name: str, src: str, dst: str) -> None:
    if name == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, dst)
    elif name == "merge_weights":
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(src, dst, safe_serialization=True)
    elif name == "floor":
        floor(Path(src), Path(dst))


def floor(folder: Path, out: Path) -> None:
    """Read every model chunk's byte range (from .metadata) and write the bytes to one file: the disk's part."""
    from ckpttools.layouts.dcp.read import model_tensors, read_metadata

    buf = bytearray(8 << 20)
    with open(out, "wb") as dst:
        for entry in model_tensors(read_metadata(folder), folder).values():
            for chunk in entry.chunks:
                with open(folder / chunk.stored.relative_path, "rb") as src:
                    src.seek(chunk.stored.offset)
                    left = chunk.stored.length
                    while left:
                        n = src.readinto(memoryview(buf)[: min(left, len(buf))])
                        dst.write(memoryview(buf)[:n])
                        left -= n


# --- measuring -------------------------------------------------------------------------------------------------


def runs(work: Path) -> list[tuple[str, str, list[str], Path]]:
    model = work / "accelerate" / "pytorch_model_fsdp_0"
    combined = work / "combined"
    me = [sys.executable, "-m", MODULE, "--peer"]
    ckpt = [sys.executable, "-m", "ckpttools.cli", "consolidate"]
    out = work / "out"
    return [
        ("ckpt-fp32", "combined", [*ckpt, str(combined), "--out", str(out / "ckpt-fp32")], out / "ckpt-fp32"),
        ("ckpt-bf16", "combined", [*ckpt, str(combined), "--out", str(out / "ckpt-bf16"), "--dtype", "bf16"],
         out / "ckpt-bf16"),
        ("ckpt-fp32", "model", [*ckpt, str(model), "--out", str(out / "ckpt-model")], out / "ckpt-model"),
        ("dcp_to_torch_save", "combined", [*me, "dcp_to_torch_save", str(combined), str(out / "d2t.pt")],
         out / "d2t.pt"),
        ("dcp_to_torch_save", "model", [*me, "dcp_to_torch_save", str(model), str(out / "d2t-model.pt")],
         out / "d2t-model.pt"),
        ("merge-weights", "model", [*me, "merge_weights", str(model), str(out / "merge")], out / "merge"),
        ("floor", "model", [*me, "floor", str(model), str(out / "floor.bin")], out / "floor.bin"),
    ]  # fmt: skip


def measure(work: Path) -> list[dict[str, Any]]:
    from benchmarks.bench_consolidate import drop_caches, run_measured

    env = {**os.environ, "CI": "1", "PYTHONPATH": str(Path.cwd())}
    results = []
    for tool, on, cmd, _ in runs(work):
        dropped, _why = drop_caches()
        with open(work / f"{tool}-{on}.log", "wb") as log:
            r = run_measured(cmd, env, log)
        r |= {"tool": tool, "on": on, "cache_dropped": dropped}
        results.append(r)
        print(f"{tool:18} {on:9} rc={r['returncode']} {r['wall_s']:.1f}s rss={r['peak_rss_tree'] / GB:.2f}GB "
              f"rchar={r['rchar_polled'] / GB:.2f}GB read={r['read_bytes'] / GB:.2f}GB", flush=True)  # fmt: skip
    return results


def check_outputs(work: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    out = work / "out"
    ours = load_file(out / "ckpt-fp32" / "model.safetensors") if (out / "ckpt-fp32" / "model.safetensors").exists() \
        else _load_folder(out / "ckpt-fp32")  # fmt: skip
    checks = {}
    d2t = torch.load(out / "d2t.pt", weights_only=True, mmap=True)["model"]
    checks["dcp_to_torch_save"] = all(torch.equal(ours[k], d2t[k]) for k in d2t) and len(d2t) == len(ours)
    merged = _load_folder(out / "merge")
    checks["merge-weights"] = all(torch.equal(ours[k], merged[k]) for k in merged) and len(merged) == len(ours)
    model = _load_folder(out / "ckpt-model")
    checks["ckpt model folder"] = all(torch.equal(ours[k], model[k]) for k in model) and len(model) == len(ours)
    return checks


def _load_folder(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def report(results: list[dict[str, Any]], checks: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "dcp.json").write_text(json.dumps({"meta": meta, "checks": checks, "runs": results}, indent=1))
    model_bytes = meta["model_bytes"]
    floor_s = next(r["wall_s"] for r in results if r["tool"] == "floor")
    lines = [f"# ckpt consolidate on torch DCP ({meta['params'] / 1e9:.2f} B params, {meta['ranks']} ranks)", "",
             "| tool | folder | wall s | x floor | peak RSS GB | read (rchar) GB | x model bytes |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['tool']} | {r['on']} | {r['wall_s']:.1f} | {r['wall_s'] / floor_s:.2f} | {r['peak_rss_tree'] / GB:.2f} | "
        f"{r['rchar_polled'] / GB:.2f} | {r['rchar_polled'] / model_bytes:.2f} |"
        for r in results
    ]
    lines += ["", f"outputs equal (torch.equal): {checks}", "", f"machine: {meta['machine']}"]
    (out / "dcp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-dcp"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return build_worker(args.work, args.layers)
    if args.peer:
        return run_peer(*args.peer)
    build_s = build(args.work, args.ranks, args.layers)
    shapes = param_shapes(args.layers)
    params = sum(_numel(s) for s in shapes.values())
    shutil.rmtree(args.work / "out", ignore_errors=True)
    (args.work / "out").mkdir()
    results = measure(args.work)
    checks = check_outputs(args.work)
    meta = {"params": params, "model_bytes": params * 4, "ranks": args.ranks, "build_s": build_s,
            "machine": f"{platform.node()} {os.cpu_count()} cores, python {platform.python_version()}"}  # fmt: skip
    report(results, checks, meta, args.out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()

"""`ckpt consolidate` of a 1B+ Megatron-Core `torch_dist` checkpoint against the disk floor and the peers (issue 32).

    python -m benchmarks.bench_megatron --work /tmp/megatron [--size 1B] [--runs 3] [--out DIR] [--budget-s 400]
    python -m benchmarks.bench_megatron --work /tmp/megatron --size tiny --cpu    # a quick try (CPU, gloo)

Megatron-Core (0.19.2 here) must be importable: on the lent H200 host it travels as its cp312 wheel. On the GPU
Megatron runs natively (local layer spec, no Transformer Engine); `--cpu` uses the fixture builder's CPU redirections
(`fixtures/build/fixture_megatron._cpu_only`).

1. Build (a child process, one rank, tensor-parallel 1): `GPTModel` of a Llama-3.2-1B shape (hidden 2048, 16 layers,
   32 heads / 8 query groups of 64, FFN 8192, SwiGLU, RMSNorm, RoPE base 500000, vocab 128256, tied embeddings:
   1.24 B fp32 parameters, 4.9 GB), Megatron's own initialisation, saved as Megatron-LM's `save_checkpoint` does for
   `--ckpt-format torch_dist`: `dist_checkpointing.save({"model": model.sharded_state_dict(), "args": Namespace,
   "checkpoint_version": 3.0, "iteration": N}, save_dir/iter_000000N)` and `latest_checkpointed_iteration.txt`
   (`args` under Megatron-LM's names, as the fixtures' builder fills them).
2. Megatron-Bridge: `from megatron.bridge import AutoBridge` is tried (its wheel travels too); what it says is
   recorded. Megatron-Bridge 0.6.2 imports Transformer Engine unconditionally (megatron/bridge/peft/lora_layers.py),
   whose CUDA 13 core wheel (276.5 MB) is over what a call can carry, so its export cannot run on the host. On the
   development VM it runs on CPU under BRIDGE_PYTHON (default /work/bridge-venv/bin/python, built as
   fixtures/build/fixture_megatron_bridge.py says) with that builder's workarounds: `--tools ...,bridge`; the
   Hugging Face folder `AutoBridge.from_hf_pretrained` needs (config, random weights, tokenizer) is written once
   to WORK/hf-source, untimed.
3. Rounds (order rotated each round), each a subprocess measured by `bench_consolidate.run_measured`, the output
   deleted, `sync` and the page cache dropped before each:
     ckpt             ckpt consolidate SAVE_DIR --out OUT (fp32 safetensors, config.json from the run's args,
                      keys checked against LlamaForCausalLM on the meta device)
     torch-d2t        the simplest peer: torch's dcp_to_torch_save to a .pt, torch.load, the Megatron -> HF name map
                      in torch (un-stack layers, QKV split per query group, fc1 -> gate/up, padded vocabulary
                      trimmed), save_file into 5 GB shards
     torch-mem        the same with the checkpoint loaded straight into memory (torch's
                      _load_state_dict_from_keys, no .pt file)
     bridge           Megatron-Bridge's `AutoBridge.from_hf_pretrained(WORK/hf-source).export_ckpt(SAVE_DIR, OUT)`,
                      one gloo process on CPU (see `bridge_export` for what is worked around), fsync
     floor            the .distcp bytes read (8 threads, 16 MiB reads) while the output's bytes are written to one
                      file, then fsync
4. Check (not timed): ckpt's output equals the peer's (bridge's when it ran, torch-mem's otherwise), tensor by
   tensor (torch.equal), same names.
5. OUT/megatron-<size>.json (every run) and OUT/megatron-<size>.md, rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODULE = "benchmarks.bench_megatron"
REPO = Path(__file__).resolve().parent.parent
GB = 1e9
ITERATION = 100
SHARD_BYTES = 5 * 10**9
FUSED = ("apply_rope_fusion", "bias_swiglu_fusion", "bias_gelu_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
         "gradient_accumulation_fusion")  # fmt: skip
# Megatron-LM's arguments for unfused kernels, as a CPU run of the local spec has them
NO_FUSIONS = {**dict.fromkeys(FUSED, False), "no_persist_layer_norm": True}
BRIDGE_PYTHON = os.environ.get("BRIDGE_PYTHON", "/work/bridge-venv/bin/python")  # Megatron-Bridge 0.6.2's venv
SIZES = {
    "tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
             "ffn_hidden_size": 128, "vocab_size": 500, "padded_vocab_size": 512, "rotary_base": 500000,
             "layernorm_epsilon": 1e-5, "tied": True},
    "1B": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 8, "kv_channels": 64,
           "ffn_hidden_size": 8192, "vocab_size": 128256, "padded_vocab_size": 128256, "rotary_base": 500000,
           "layernorm_epsilon": 1e-5, "tied": True},
}  # fmt: skip


# --- the build (one rank, in a child process) --------------------------------------------------------------------


def build_worker(work: Path, size: str, cpu: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if cpu:
        from fixtures.build.fixture_megatron import _cpu_only

        _cpu_only()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    m = {**SIZES[size], "max_position_embeddings": 8192, "qk_layernorm": False}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if cpu else "nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1234)
    if not cpu:
        model_parallel_cuda_manual_seed(1234)
    t0 = time.perf_counter()
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], kv_channels=m["kv_channels"], ffn_hidden_size=m["ffn_hidden_size"],
        normalization="RMSNorm", layernorm_epsilon=m["layernorm_epsilon"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, tensor_model_parallel_size=1, use_cpu_initialization=cpu,
        params_dtype=torch.float32, bf16=False, fp16=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False, sequence_parallel=False,
    )  # fmt: skip
    gpt = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=m["padded_vocab_size"], max_sequence_length=m["max_position_embeddings"],
        position_embedding_type="rope", rotary_base=m["rotary_base"], share_embeddings_and_output_weights=m["tied"],
    )  # fmt: skip
    if not cpu:
        gpt = gpt.cuda()
    with torch.no_grad():  # norm weights are all 1 after init: noise, so a mix-up of norms would show
        for name, p in gpt.named_parameters():
            if "norm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    params = sum(p.numel() for p in gpt.parameters())
    t_init = time.perf_counter() - t0
    args = megatron_lm_args(m)
    save_dir = work / "checkpoint"
    folder = save_dir / f"iter_{ITERATION:07d}"
    folder.mkdir(parents=True)
    state = {"model": gpt.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    t1 = time.perf_counter()
    dist_checkpointing.save(state, str(folder))
    t_save = time.perf_counter() - t1
    (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.destroy_process_group()
    import importlib.metadata as md

    files = sum(f.stat().st_size for f in folder.iterdir())
    return {"size": size, "params": params, "model": m, "checkpoint_bytes": files, "init_s": round(t_init, 1),
            "save_s": round(t_save, 1), "device": "cpu" if cpu else torch.cuda.get_device_name(0),
            "megatron_core": md.version("megatron-core"), "torch": torch.__version__}  # fmt: skip


def megatron_lm_args(m: dict[str, Any]) -> Any:
    """The run's arguments under Megatron-LM's names and types (megatron/training/arguments.py), as its
    save_checkpoint stores them in common_state: what `ckpt` builds config.json from."""
    import argparse
    import signal

    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], group_query_attention=True,
        num_query_groups=m["num_query_groups"], kv_channels=m["kv_channels"],
        max_position_embeddings=m["max_position_embeddings"], seq_length=4096, position_embedding_type="rope",
        rotary_base=m["rotary_base"], rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        normalization="RMSNorm", layernorm_epsilon=m["layernorm_epsilon"], swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False, untie_embeddings_and_output_weights=not m["tied"],
        vocab_size=m["vocab_size"], padded_vocab_size=m["padded_vocab_size"], make_vocab_size_divisible_by=128,
        tokenizer_type="NullTokenizer", tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        context_parallel_size=1, expert_model_parallel_size=1, data_parallel_size=1, world_size=1, num_experts=None,
        params_dtype=torch.float32, bf16=False, fp16=False, ckpt_format="torch_dist", use_distributed_optimizer=False,
        iteration=ITERATION, exit_signal=signal.SIGTERM, attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder, transformer_impl="local", init_method_std=0.02, seed=1234,
    )  # fmt: skip


def build(work: Path, size: str, cpu: bool) -> dict[str, Any]:
    meta_file = work / "built.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("size") == size:
        return dict(json.loads(meta_file.read_text()))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", MODULE, "--build-worker", "--work", str(work), "--size", size] + (
        ["--cpu"] if cpu else []
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise SystemExit(f"build failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    built = json.loads(proc.stdout.strip().splitlines()[-1]) | {"build_s": round(time.perf_counter() - t0, 1)}
    meta_file.write_text(json.dumps(built))
    return built


# --- the peers (each `python -m benchmarks.bench_megatron --peer NAME CKPT OUT`) ----------------------------------------


def megatron_to_hf(state: dict[str, Any], args: Any) -> dict[str, Any]:
    """The Megatron-Core GPT (local or TE spec, stacked layers) -> LlamaForCausalLM names and tensors, in torch."""
    heads, groups, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    hidden, vocab = args.hidden_size, args.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}  # fmt: skip
    if "output_layer.weight" in state and args.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    qkv = state["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = state["decoder.layers.mlp.linear_fc1.weight"]
    per = heads // groups
    for i in range(qkv.shape[0]):
        p = f"model.layers.{i}."
        grouped = qkv[i].view(groups, per + 2, d, hidden)
        ffn = fc1[i].shape[0] // 2
        out |= {
            p + "self_attn.q_proj.weight": grouped[:, :per].reshape(heads * d, hidden),
            p + "self_attn.k_proj.weight": grouped[:, per].reshape(groups * d, hidden),
            p + "self_attn.v_proj.weight": grouped[:, per + 1].reshape(groups * d, hidden),
            p + "self_attn.o_proj.weight": state["decoder.layers.self_attention.linear_proj.weight"][i],
            p + "mlp.gate_proj.weight": fc1[i][:ffn], p + "mlp.up_proj.weight": fc1[i][ffn:],
            p + "mlp.down_proj.weight": state["decoder.layers.mlp.linear_fc2.weight"][i],
            p + "input_layernorm.weight": state["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
            p + "post_attention_layernorm.weight": state["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i],
        }  # fmt: skip
    return {k: v.contiguous() for k, v in out.items()}


def _save_shards(tensors: dict[str, Any], out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    used = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and used + n > SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += n
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))  # fmt: skip
    for fh in out.iterdir():  # durable, as ckpt's output is before it is published
        with open(fh, "rb") as f:
            os.fsync(f.fileno())


def peer(name: str, folder: Path, out: Path) -> None:
    import torch

    if name == "torch-d2t":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tmp = out.with_suffix(".pt")
        dcp_to_torch_save(str(folder), str(tmp))
        state = torch.load(str(tmp), weights_only=False)  # the run's args are a pickled Namespace
        tmp.unlink()
    else:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    args = _run_args(state)
    _save_shards(megatron_to_hf(state, args), out)


def _run_args(state: dict[str, Any]) -> Any:
    """Megatron-LM's args: in megatron-core 0.19 the common state is the ShardedObject `common_state/shard_0_1`."""
    if "args" in state:
        return state["args"]
    for key, value in state.items():
        if key.startswith("common_state"):
            common = value[0] if isinstance(value, list) else value
            return common["args"]
    raise KeyError("no args in the checkpoint's common state")


def floor(folder: Path, out: Path, out_bytes: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.bench_device_reduce import _read_all

    def write() -> None:
        buf = bytes(16 << 20)
        left = out_bytes
        with open(out, "wb") as fh:
            while left:
                left -= fh.write(memoryview(buf)[: min(left, len(buf))])
            fh.flush()
            os.fsync(fh.fileno())

    files = sorted(folder.glob("*.distcp"))
    with ThreadPoolExecutor(2) as pool:
        r, w = pool.submit(_read_all, files), pool.submit(write)
        r.result(), w.result()


# --- Megatron-Bridge's CPU export (a peer, run under BRIDGE_PYTHON) ---------------------------------------------------


def bridge_source(work: Path, size: str) -> Path:
    """The Hugging Face folder `AutoBridge.from_hf_pretrained` needs (config, random weights, a tokenizer), built
    once by the fixture builder's `_hf_source` under Bridge's interpreter; untimed."""
    source = work / "hf-source"
    if not (source / "config.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        model = {**SIZES[size], "qk_layernorm": False, "seq_length": 8192}
        code = ("import json, sys; from pathlib import Path; from fixtures.build.fixture_megatron_bridge import "
                "_hf_source; _hf_source(json.loads(sys.argv[1]), Path(sys.argv[2]))")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run([BRIDGE_PYTHON, "-c", code, json.dumps(model), str(source)], check=True, cwd=REPO, env=env)
    return source


def bridge_export(save_dir: Path, source: Path, out: Path) -> None:
    """`AutoBridge.export_ckpt` on CPU (one gloo process), with fixture_megatron_bridge.export's workarounds for
    Megatron-Bridge 0.6.2: Transformer Engine stubbed (`import_bridge`), CPU initialisation and no fused kernels asked for, and, for a
    Megatron-LM checkpoint (args, no run_config.yaml), the model type Bridge requires but export_ckpt does not pass
    (without it: `AssertionError: model type None not supported.`). Bridge reads Megatron-LM's whole argument
    namespace (`args.multi_latent_attention`, ...) where the build stores the model's subset, so the checkpoint's args
    are laid over Megatron-LM's parser defaults as read, fused kernels off (as a CPU run of the local spec has them)."""
    import torch

    from fixtures.build.fixture_megatron import _cpu_only
    from fixtures.build.fixture_megatron_bridge import import_bridge

    _cpu_only()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    import_bridge()
    import megatron.bridge.training.mlm_compat.arguments as mlm_args
    import megatron.bridge.training.model_load_save as load_save
    from megatron.bridge import AutoBridge
    from megatron.training.arguments import parse_args

    load_model_config, load_megatron_model = load_save.load_model_config, load_save.load_megatron_model
    load_args = mlm_args._load_args_from_checkpoint

    def args_over_defaults(path: str) -> Any:  # the checkpoint's args over Megatron-LM's defaults (see the docstring)
        argv, sys.argv = sys.argv, sys.argv[:1]
        try:
            defaults = parse_args(ignore_unknown_args=True)
        finally:
            sys.argv = argv
        return argparse.Namespace(**(vars(defaults) | NO_FUSIONS | vars(load_args(path))))

    def model_config(path: str) -> Any:
        config, args = load_model_config(path)
        config.use_cpu_initialization = True
        return config, args

    def load_gpt(*a: Any, **k: Any) -> Any:
        return load_megatron_model(*a, **{"model_type": "gpt", **k})

    load_save.load_model_config, load_save.load_megatron_model = model_config, load_gpt
    mlm_args._load_args_from_checkpoint = args_over_defaults
    AutoBridge.from_hf_pretrained(str(source)).export_ckpt(str(save_dir), str(out), show_progress=False)
    for fh in out.iterdir():  # durable, as ckpt's output is before it is published
        if fh.is_file():
            with open(fh, "rb") as f:
                os.fsync(f.fileno())


def try_bridge() -> dict[str, Any]:
    """Whether Megatron-Bridge imports as it is, without the workarounds (under BRIDGE_PYTHON where that exists);
    its last error lines if not."""
    code = "from megatron.bridge import AutoBridge; import megatron.bridge, importlib.metadata as m; print(m.version('megatron-bridge'))"
    python = BRIDGE_PYTHON if Path(BRIDGE_PYTHON).is_file() else sys.executable
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/")
    return {
        "python": python,
        "rc": proc.returncode,
        "stdout": proc.stdout[-500:],
        "error": "\n".join(proc.stderr.strip().splitlines()[-6:]),
    }


# --- the harness ---------------------------------------------------------------------------------------------------


def commands(tool: str, work: Path, out_bytes: int) -> list[str]:
    save_dir, out = work / "checkpoint", work / "out"
    folder = save_dir / f"iter_{ITERATION:07d}"
    if tool == "ckpt":
        return [sys.executable, "-m", "ckpttools.cli", "consolidate", str(save_dir), "--out", str(out), "--json", "-q"]
    if tool == "bridge":
        return [BRIDGE_PYTHON, "-m", MODULE, "--bridge-export", str(save_dir), str(work / "hf-source"), str(out)]
    if tool == "floor":
        return [sys.executable, "-m", MODULE, "--floor", str(folder), str(out), str(out_bytes)]
    return [sys.executable, "-m", MODULE, "--peer", tool, str(folder), str(out)]


def clear(work: Path) -> None:
    for p in (work / "out", work / "out.pt", work / "keep"):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def run_one(tool: str, work: Path, out_bytes: int) -> dict[str, Any]:
    from benchmarks.bench_consolidate import drop_caches, run_measured

    clear(work)
    dropped, why = drop_caches()
    time.sleep(1)
    env = {
        **os.environ,
        "CI": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log = work / f"{tool}.log"
    with open(log, "wb") as fh:
        r = run_measured(commands(tool, work, out_bytes), env, fh, cwd=REPO)
    text = log.read_text(errors="replace")
    out_gb = (
        sum(f.stat().st_size for f in (work / "out").rglob("*") if f.is_file()) / GB if (work / "out").is_dir() else 0
    )
    return {"tool": tool, "rc": r["returncode"], "wall_s": round(r["wall_s"], 2), "peak_rss_gb": round(r["peak_rss_tree"] / GB, 3),
            "rchar_gb": round(r["rchar_polled"] / GB, 2), "written_gb": round(r["write_bytes"] / GB, 2),
            "output_gb": round(out_gb, 2), "user_s": round(r["user_s"], 1), "sys_s": round(r["sys_s"], 1),
            "cache_dropped": dropped, "load1": [round(r["loadavg1_before"], 1), round(r["loadavg1_after"], 1)], "why_warm": why, "output": text[-3000:]}  # fmt: skip


def check(work: Path, peer: str) -> dict[str, Any]:
    """ckpt's output against a peer's (torch-mem or bridge), tensor by tensor (both written now, untimed)."""
    env = {
        **os.environ,
        "CI": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    clear(work)
    for tool in ("ckpt", peer):
        subprocess.run(commands(tool, work, 0), check=True, capture_output=True, cwd=REPO, env=env)
        (work / "out").rename(work / "keep" if tool == "ckpt" else work / "peer")
    code = (
        "import sys, json, torch; from safetensors.torch import load_file; from pathlib import Path\n"
        "def load(d): return {k: v for f in sorted(Path(d).glob('*.safetensors')) for k, v in load_file(f).items()}\n"
        "a, b = load(sys.argv[1]), load(sys.argv[2])\n"
        "bad = [k for k in a if k in b and not torch.equal(a[k], b[k])]\n"
        "cfg = json.loads((Path(sys.argv[1]) / 'config.json').read_text())\n"
        "print(json.dumps({'tensors': len(a), 'only_ckpt': sorted(set(a) - set(b)), 'only_peer': sorted(set(b) - set(a)),"
        " 'unequal': bad, 'config': {k: cfg.get(k) for k in ('architectures', 'hidden_size', 'num_hidden_layers',"
        " 'num_key_value_heads', 'vocab_size', 'rope_theta', 'tie_word_embeddings', 'rms_norm_eps')}}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(work / "keep"), str(work / "peer")], capture_output=True, text=True
    )
    shutil.rmtree(work / "peer", ignore_errors=True)
    clear(work)
    try:
        return {"peer": peer} | dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"peer": peer, "rc": proc.returncode, "stderr": proc.stderr[-2000:]}


def render(report: dict[str, Any]) -> str:
    b, runs = report["built"], report["runs"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["tool"], []).append(r)
    med = {t: statistics.median([r["wall_s"] for r in rs if r["rc"] == 0] or [float("nan")]) for t, rs in by.items()}
    f = med.get("floor")
    lines = [f"# ckpt consolidate on a Megatron-Core torch_dist checkpoint, {b['params'] / 1e9:.2f} B ({report['machine']})", "",
             (f"Llama-3.2-1B-shaped GPTModel (megatron-core {b['megatron_core']}, {b['device']}, TP 1, fp32, tied "
              f"embeddings), `dist_checkpointing.save` with Megatron-LM's args: {b['checkpoint_bytes'] / GB:.2f} GB. "
              f"Page cache dropped before every run: {all(r['cache_dropped'] for r in runs)}."), "",
             "| tool | runs | wall s (median) | each run | x floor | peak RSS GB | read() GB | output GB | rc |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tool, rs in by.items():
        ratio = f"{med[tool] / f:.2f}" if f else "-"
        lines.append(f"| {tool} | {len(rs)} | {med[tool]:.2f} | {', '.join(str(r['wall_s']) for r in rs)} | {ratio} | "
                     f"{max(r['peak_rss_gb'] for r in rs):.2f} | {max(r['rchar_gb'] for r in rs):.2f} | "
                     f"{max(r['output_gb'] for r in rs):.2f} | {','.join(str(r['rc']) for r in rs)} |")  # fmt: skip
    lines += ["", f"Megatron-Bridge here: `{json.dumps(report.get('bridge'))}`", "",
              f"check (ckpt output vs a peer's): `{json.dumps(report.get('check'))}`"]  # fmt: skip
    return "\n".join(lines) + "\n"


def save(report: dict[str, Any], out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = render(report)
    (out / f"{name}.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpt-bench-megatron"))
    ap.add_argument("--size", default="1B", choices=list(SIZES))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--tools", default="ckpt,torch-d2t,torch-mem,floor")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--build-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--floor", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--bridge-export", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_worker:
        print(json.dumps(build_worker(args.work, args.size, args.cpu)))
        return
    if args.peer:
        return peer(args.peer[0], Path(args.peer[1]), Path(args.peer[2]))
    if args.bridge_export:
        return bridge_export(*(Path(a) for a in args.bridge_export))
    if args.floor:
        return floor(Path(args.floor[0]), Path(args.floor[1]), int(args.floor[2]))
    t0 = time.monotonic()
    built = build(args.work, args.size, args.cpu)
    print(f"built {built}", flush=True)
    name = f"megatron-{args.size}"
    report: dict[str, Any] = {"machine": f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}",
                              "built": built, "bridge": try_bridge(), "runs": []}  # fmt: skip
    print(f"bridge {report['bridge']}", flush=True)
    if "bridge" in args.tools.split(","):
        report["bridge_source"] = str(bridge_source(args.work, args.size))
    out_bytes = built["params"] * 4  # tied: the embedding once, as the output holds it
    tools = args.tools.split(",")
    plan = [t for r in range(args.runs) for t in tools[r % len(tools) :] + tools[: r % len(tools)]]
    for i, tool in enumerate(plan):
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            report["not_started"] = plan[i:]
            print(f"budget reached: {len(plan) - i} runs not started", flush=True)
            break
        r = run_one(tool, args.work, out_bytes)
        report["runs"].append(r)
        print(f"{tool:10} rc={r['rc']} {r['wall_s']:7.2f}s rss={r['peak_rss_gb']:.2f}GB read()={r['rchar_gb']:.2f}GB "
              f"out={r['output_gb']:.2f}GB cold={r['cache_dropped']}", flush=True)  # fmt: skip
        save(report, args.out, name)
    clear(args.work)
    if not args.no_check:
        report["check"] = check(args.work, "bridge" if "bridge" in tools else "torch-mem")
    print(save(report, args.out, name))


if __name__ == "__main__":
    main()

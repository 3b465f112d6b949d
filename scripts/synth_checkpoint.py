"""Synthetic DeepSpeed ZeRO checkpoints at Llama 70B / 405B shapes whose tensor records are holes.

Every non-tensor entry comes from a real DeepSpeed fixture (`fixtures/z2_dp2_bf16`, `fixtures/z3_dp2_bf16`):
ds_config, loss scaler, param_groups (hyper-parameters), step, versions, the model-states keys. Only the
shapes change: the parameters become a Llama's, and the rank files are laid out for the requested DP size
by `ckpttools.ops.reshard`'s partition code (`_rank_files`, the code proven against DeepSpeed's own
`load_checkpoint`), plus what a real save has that a reshard does not write (ZeRO-3's `ds_id` on the fp32
partitions, ZeRO-2's module weights as views of one flat 16-bit buffer per param group padded to 2*dp).

`data.pkl` is written by `ckpttools.io.torchwriter`'s pickler (opcode for opcode what `torch.save` writes);
the zip around it is written here, with each storage record's bytes skipped by `seek`, so a file of a
terabyte takes a few KB on disk. The CRC-32 of each record is that of all-zero bytes (what a hole reads
as), computed with GF(2) polynomial arithmetic (the "append n zeros" operator, by squaring), never by
hashing the bytes.

    python scripts/synth_checkpoint.py --model llama-70b --stage 3 --dp 1024 --out /tmp/synth/70b-z3-dp1024
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import struct
import sys
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckpttools.io import dtypes, torchwriter  # noqa: E402
from ckpttools.io.crc import crc32_zeros  # noqa: E402
from ckpttools.io.torchfile import LazyTensor, Record, StorageRef, TorchSize, load_pickle  # noqa: E402
from ckpttools.layouts.registry import read_checkpoint  # noqa: E402
from ckpttools.model.checkpoint import OptimizerState, Param, Segment, TensorSource, ZeroCheckpoint  # noqa: E402
from ckpttools.ops.reshard import _rank_files  # noqa: E402

TEMPLATES = {2: ROOT / "fixtures/z2_dp2_bf16/checkpoint", 3: ROOT / "fixtures/z3_dp2_bf16/checkpoint"}
SUB_GROUP_SIZE = 1_000_000_000  # the run's zero_optimization.sub_group_size (DeepSpeed's default)
FAKE = Path("<synthetic>")  # the path of the records that only the pickler sees
HEAD_DIM = 128


# --- Model shapes -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    ffn: int
    kv: int  # k/v projection width: num_key_value_heads * head_dim
    vocab: int


MODELS = {
    "llama-tiny": LlamaShape(2, 256, 512, 128, 512),  # small enough for DeepSpeed's zero_to_fp32 to load whole
    "llama-1b": LlamaShape(16, 2048, 8192, 512, 128256),  # Llama-3.2-1B's shapes, embeddings untied
    "llama-1b-wide": LlamaShape(16, 4096, 16384, 1024, 128256),  # same tensors, ~4x the parameters
    "llama-70b": LlamaShape(80, 8192, 28672, 1024, 128256),
    "llama-405b": LlamaShape(126, 16384, 53248, 1024, 128256),
}


def llama_params(m: LlamaShape) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, param group) in the module's parameter order; group 1 holds the norms (no weight decay)."""
    out: list[tuple[str, tuple[int, ...], int]] = [("model.embed_tokens.weight", (m.vocab, m.hidden), 0)]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (m.hidden, m.hidden), 0),
            (p + "self_attn.k_proj.weight", (m.kv, m.hidden), 0),
            (p + "self_attn.v_proj.weight", (m.kv, m.hidden), 0),
            (p + "self_attn.o_proj.weight", (m.hidden, m.hidden), 0),
            (p + "mlp.gate_proj.weight", (m.ffn, m.hidden), 0),
            (p + "mlp.up_proj.weight", (m.ffn, m.hidden), 0),
            (p + "mlp.down_proj.weight", (m.hidden, m.ffn), 0),
            (p + "input_layernorm.weight", (m.hidden,), 1),
            (p + "post_attention_layernorm.weight", (m.hidden,), 1),
        ]
    return [*out, ("model.norm.weight", (m.hidden,), 1), ("lm_head.weight", (m.vocab, m.hidden), 0)]


def llama_config(m: LlamaShape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.hidden // HEAD_DIM,
        "num_key_value_heads": m.kv // HEAD_DIM,
        "head_dim": HEAD_DIM,
        "vocab_size": m.vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


# --- A torch.save zip whose storage records are holes ---------------------------------------------------------

ZIP64_LIMIT = (1 << 31) - 1  # zipfile's own threshold for zip64 fields
ALIGNMENT = 64
DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, as torch and ckpttools write
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


def _zip64(*values: int) -> bytes:
    return struct.pack("<HH" + "Q" * len(values), 1, 8 * len(values), *values) if values else b""


def _write_entry(fh: Any, name: str, size: int, payload: bytes | None) -> _Entry:
    """A stored entry with data 64-byte aligned (padding in torch's "FB" extra field); no payload: a hole."""
    raw = name.encode()
    offset = fh.tell()
    zip64 = size > ZIP64_LIMIT
    local64 = _zip64(size, size) if zip64 else b""
    pad = -(offset + _LOCAL.size + len(raw) + len(local64) + 4) % ALIGNMENT
    extra = local64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    crc = zlib.crc32(payload) if payload is not None else crc32_zeros(size)
    stored = 0xFFFFFFFF if zip64 else size
    fh.write(_LOCAL.pack(b"PK\003\004", 45 if zip64 else 20, 0, 0, 0, 0, DOS_DATE, crc, stored, stored,
                         len(raw), len(extra)) + raw + extra)  # fmt: skip
    if payload is not None:
        fh.write(payload)
    else:
        fh.seek(size, os.SEEK_CUR)  # the hole
    return _Entry(raw, offset, size, crc)


def _write_central(fh: Any, entries: list[_Entry]) -> None:
    start = fh.tell()
    for e in entries:
        big_size, big_offset = e.size > ZIP64_LIMIT, e.offset > ZIP64_LIMIT
        extra = _zip64(*([e.size, e.size] if big_size else []), *([e.offset] if big_offset else []))
        size = 0xFFFFFFFF if big_size else e.size
        version = 45 if extra else 20
        fh.write(_CENTRAL.pack(b"PK\001\002", version, 3, version, 0, 0, 0, 0, DOS_DATE, e.crc, size, size,
                               len(e.name), len(extra), 0, 0, 0, 0o600 << 16,
                               0xFFFFFFFF if big_offset else e.offset) + e.name + extra)  # fmt: skip
    end = fh.tell()
    count, cd_size = len(entries), end - start
    if start > ZIP64_LIMIT or cd_size > ZIP64_LIMIT or count >= 0xFFFF:
        fh.write(struct.pack("<4sQ2H2L4Q", b"PK\006\006", 44, 45, 45, 0, 0, count, count, cd_size, start))
        fh.write(struct.pack("<4sLQL", b"PK\006\007", 0, end, 1))
        fh.write(struct.pack("<4s4H2LH", b"PK\005\006", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                             min(cd_size, 0xFFFFFFFF), min(start, 0xFFFFFFFF), 0))  # fmt: skip
    else:
        fh.write(struct.pack("<4s4H2LH", b"PK\005\006", 0, 0, count, count, cd_size, start, 0))


def write_sparse_torch_file(path: Path, obj: Any) -> int:
    """`torch.save(obj, path)` with every storage record a hole of its size. Returns the logical size."""
    table = torchwriter._StorageTable()
    data_pkl = torchwriter._pickle(obj, table)
    stem = path.stem
    with open(path, "wb") as fh:
        head = (
            ("data.pkl", data_pkl),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", b"little"),
        )
        entries = [_write_entry(fh, f"{stem}/{n}", len(p), p) for n, p in head]
        for key, _source, dtype, numel in table.entries:
            entries.append(_write_entry(fh, f"{stem}/data/{key}", numel * dtype.itemsize, None))
        entries.append(_write_entry(fh, f"{stem}/version", 2, b"3\n"))
        entries.append(_write_entry(fh, f"{stem}/.data/serialization_id", 16, os.urandom(8).hex().encode()))
        _write_central(fh, entries)
        return fh.tell()


# --- The synthetic checkpoint model -----------------------------------------------------------------------------

_ids = itertools.count()


def _stored(dtype: dtypes.DType, nbytes: int, offset: int, shape: tuple[int, ...], **kw: Any) -> LazyTensor:
    """A tensor of a record of its own that exists only for the pickler (path `<synthetic>`)."""
    record = Record(FAKE, f"synthetic/{next(_ids)}", 0, nbytes, 0)
    strides = torchwriter._contiguous_strides(shape)
    return LazyTensor(StorageRef(record, dtype), offset, shape, strides, **kw)


def _view(storage: LazyTensor, offset: int, shape: tuple[int, ...]) -> LazyTensor:
    return LazyTensor(storage.storage, offset, shape, torchwriter._contiguous_strides(shape))


def shape_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _with_sub_group_size(config: dict[str, Any], stage: int) -> dict[str, Any]:
    if stage != 3:
        return config
    return {**config, "zero_optimization": {**config["zero_optimization"], "sub_group_size": SUB_GROUP_SIZE}}


def _zero2_module(
    params: list[tuple[str, tuple[int, ...], int]], dp: int, dtype: dtypes.DType
) -> OrderedDict[str, LazyTensor]:
    """ZeRO-1/2 module weights: views of one flat 16-bit buffer per param group, padded to 2*dp (bit16_groups_flat)."""
    totals: dict[int, int] = {}
    offsets = []
    for _, shape, group in params:
        offsets.append(totals.get(group, 0))
        totals[group] = totals.get(group, 0) + shape_numel(shape)
    align = 2 * dp
    flats = {g: _stored(dtype, -(-t // align) * align * dtype.itemsize, 0, (1,)) for g, t in totals.items()}
    return OrderedDict(
        (name, _view(flats[group], off, shape)) for (name, shape, group), off in zip(params, offsets, strict=True)
    )


ParamSpec = tuple[str, tuple[int, ...], int]


def synthetic_source(template: ZeroCheckpoint, params: list[ParamSpec], dp: int) -> ZeroCheckpoint:
    """The template checkpoint with its parameters replaced: every state one segment of a stand-in tensor."""
    stage, dtype = template.zero_stage, template.train_dtype
    whole = _stored(dtypes.FLOAT32, 0, 0, (max(shape_numel(s) for _, s, _ in params),))
    keys = template.state_keys
    model_params = []
    for name, shape, group in params:
        numel = shape_numel(shape)
        src = TensorSource(name, shape, dtypes.FLOAT32, (Segment(whole, 0, numel),), "trainable")
        states = {k: dataclasses.replace(src, kind="state") for k in keys}
        model_params.append(Param(name, name, shape, group, 0, src, states))
    opt = template.optimizer
    common = dict(opt.common)
    if "param_alignment_paddings" in common:
        common["param_alignment_paddings"] = [[0] * sum(1 for p in params if p[2] == g) for g in range(2)]
    file_meta = {**opt.file_meta, "ds_config": _with_sub_group_size(opt.file_meta["ds_config"], stage)}
    if stage == 3:
        module = OrderedDict((name, _stored(dtype, 0, 0, (0,))) for name, _, _ in params)
        param_shapes: list[Any] = []  # laid out per sub-group by reshard
    else:
        module = _zero2_module(params, dp, dtype)
        param_shapes = [OrderedDict((n, TorchSize(s)) for n, s, g in params if g == group) for group in range(2)]
    model0 = {**template.model_files[0], "module": module, "buffer_names": [], "param_shapes": param_shapes,
              "frozen_param_shapes": OrderedDict(), "frozen_param_fragments": OrderedDict(), "shared_params": {},
              "ds_config": file_meta["ds_config"], "dp_world_size": dp}  # fmt: skip
    return dataclasses.replace(
        template, dp_world_size=dp, keys=[n for n, _, _ in params], params=model_params,
        optimizer=OptimizerState(opt.group_scalars, common, file_meta), bit16={}, buffers={}, shared_params={},
        frozen_excluded=False, ds_config=file_meta["ds_config"], model_files=[model0],
    )  # fmt: skip


def _stored_copy(t: torchwriter.NewTensor, attrs: dict[str, Any]) -> LazyTensor:
    shape = t.view_shape()
    return _stored(t.dtype, t.numel() * t.dtype.itemsize, 0, shape, attrs=attrs, requires_grad=t.requires_grad)


def _add_ds_ids(files: dict[str, Any], keys: list[str]) -> None:
    """ZeRO-3 tags each fp32 sub-group partition with `ds_id` "<first>_<last>" (the params' module order)."""
    ds_id = {name: i for i, name in enumerate(keys)}
    model0 = next(obj for name, obj in files.items() if name.endswith("_model_states.pt"))
    ids = [f"{ds_id[next(iter(g))]}_{ds_id[next(reversed(g))]}" for g in model0["param_shapes"]]
    for name, obj in files.items():
        if name.endswith("_optim_states.pt"):
            osd = obj["optimizer_state_dict"]
            osd["fp32_flat_groups"] = [_stored_copy(t, {"ds_id": i}) for t, i in zip(osd["fp32_flat_groups"], ids,
                                                                                        strict=True)]  # fmt: skip


def _in_order_of(obj: Any, like: Any) -> Any:
    """`obj` with its keys in the order of the same dict in a file DeepSpeed wrote (reshard orders a few
    differently, which no loader minds), down through the nested optimizer dicts."""
    if not isinstance(obj, dict) or not isinstance(like, dict):
        return obj
    keys = [k for k in like if k in obj] + [k for k in obj if k not in like]
    return type(obj)((k, _in_order_of(obj[k], like.get(k)) if k == "optimizer_state_dict" else obj[k]) for k in keys)


def _template_files(stage: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's optimizer and model-states objects of the template, as DeepSpeed wrote them."""
    tag_dir = TEMPLATES[stage] / (TEMPLATES[stage] / "latest").read_text().strip()
    optim = load_pickle(next(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")))
    model = load_pickle(next(tag_dir.glob("*mp_rank_00_model_states.pt")))
    return optim, model


def rank_files(model: str, stage: int, dp: int) -> tuple[ZeroCheckpoint, dict[str, Any]]:
    """The template of `stage`, reshaped to `model`, and every rank file's object tree at `dp` ranks."""
    template = read_checkpoint(TEMPLATES[stage])
    source = synthetic_source(template, llama_params(MODELS[model]), dp)
    files = _rank_files(source, dp, stage)
    if stage == 3:
        _add_ds_ids(files, source.keys)
    optim, model_states = _template_files(stage)
    for name, obj in files.items():
        files[name] = _in_order_of(obj, optim if name.endswith("_optim_states.pt") else model_states)
    return source, files


@dataclass
class SynthResult:
    root: str
    model: str
    stage: int
    dp: int
    files: int
    parameters: int
    tensors: int
    logical_bytes: int
    allocated_bytes: int
    seconds: float


def allocated(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def write_synthetic(out: Path, model: str, stage: int, dp: int) -> SynthResult:
    """Write `out/latest`, `out/config.json` and `out/<tag>/` with every rank file of the synthetic checkpoint."""
    t0 = time.perf_counter()
    source, files = rank_files(model, stage, dp)
    tag_dir = out / source.location.tag
    tag_dir.mkdir(parents=True, exist_ok=False)
    logical = sum(write_sparse_torch_file(tag_dir / name, obj) for name, obj in files.items())
    (out / "latest").write_text(source.location.tag)
    (out / "config.json").write_text(json.dumps(llama_config(MODELS[model]), indent=2) + "\n")
    params = sum(p.numel for p in source.params)
    return SynthResult(str(out), model, stage, dp, len(files), params, len(source.params), logical, allocated(out),
                       time.perf_counter() - t0)  # fmt: skip


# --- Proof that DeepSpeed itself loads it (run under torchrun, at the checkpoint's DP size) --------------------


def deepspeed_load(root: Path) -> dict[str, Any]:
    """Build the Llama of `root/config.json` in a DeepSpeed engine with the checkpoint's own ds_config and
    param groups, `load_checkpoint` it, check that every fp32 master and Adam state came back as zeros
    (the holes), and take one training step. Returns rank 0's facts."""
    import deepspeed
    import torch
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from fixture_worker import relink_hp_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    config = json.loads((root / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    torch.nn.Module.to(model, torch.bfloat16)  # Module.to: transformers' typed wrapper of `to` confuses mypy
    tag_dir = root / (root / "latest").read_text().strip()
    ds_config = load_pickle(next(tag_dir.glob("*mp_rank_00_model_states.pt")))["ds_config"]
    groups = [[p for n, p in model.named_parameters() if ("norm" in n) == bool(g)] for g in range(2)]
    param_groups = [{"params": groups[0]}, {"params": groups[1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=param_groups)
    path, _ = engine.load_checkpoint(str(root), load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {root}")
    relink_hp_optimizer_state(engine)  # DeepSpeed links param group >= 1's states lazily (fixture_worker.py)
    nonzero = []
    for name, p in engine.module.named_parameters():
        states = [safe_get_full_fp32_param(p)] + [
            safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")
        ]
        if any(t is None or t.any() for t in states):
            nonzero.append(name)
    batch = torch.randint(0, config["vocab_size"], (ds_config["train_micro_batch_size_per_gpu"], 16))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    return {"loaded": str(path), "params": len(list(engine.module.parameters())), "nonzero": nonzero,
            "loss": float(loss), "global_steps": engine.global_steps}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspeed-load", type=Path, metavar="ROOT", help="(under torchrun) load ROOT with DeepSpeed")
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--stage", type=int, choices=(2, 3))
    ap.add_argument("--dp", type=int)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.deepspeed_load:
        facts = deepspeed_load(args.deepspeed_load)
        if int(os.environ.get("RANK", "0")) == 0:
            print("DEEPSPEED_LOAD " + json.dumps(facts), flush=True)
        return
    if None in (args.model, args.stage, args.dp, args.out):
        ap.error("--model, --stage, --dp and --out are required")
    print(json.dumps(dataclasses.asdict(write_synthetic(args.out, args.model, args.stage, args.dp)), indent=2))


if __name__ == "__main__":
    main()

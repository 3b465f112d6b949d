"""Seeded mutations of the real DeepSpeed fixtures, for tests/test_mutations.py.

Every mutation is a function of (family, fixture, seed): `random.Random(f"{family}:{fixture}:{seed}")` draws all its
choices, so a case id `family:fixture:seed` rebuilds exactly the same damaged checkpoint. Mutations work on a copy in
a scratch folder (never on fixtures/), and touch nothing of ckpttools: only the standard library, and torch for the
pickle-level edits (`torch.load(weights_only=False)` on the trusted fixture copy, then `torch.save` back to the same
path, so the archive folder inside the zip is the file's original stem and only the semantic edit differs).

A mutation may find that it does not apply to a fixture (no frozen params, a single rank, ...): it raises
`NotApplicable` and the case is counted as such, not run.
"""

from __future__ import annotations

import enum
import functools
import io
import itertools
import json
import os
import pickle
import pickletools
import random
import re
import shutil
import struct
import warnings
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
MODEL_FILE = "mp_rank_00_model_states.pt"
SERIALIZATION_ID = ".data/serialization_id"  # random per torch.save: ignored when comparing outputs

# Keys whose values are only carried along (configs, versions, counters): generic edits leave them alone, as no
# redundancy elsewhere in a checkpoint could tell an edited value from a real one.
CARRIED_KEYS = {"ds_config", "ds_version", "lr_scheduler", "data_sampler", "random_ltd", "global_samples",
                "skipped_steps", "global_steps", "optimizer", "client_state"}  # fmt: skip


class NotApplicable(Exception):
    """This mutation has nothing to act on in this fixture (counted, not run)."""


# --- Fixtures -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixtureInfo:
    """What a mutation needs to know about one fixture, read from its files (not from ckpttools)."""

    name: str  # "z3_dp2_bf16", "gpu/gpu_z2_dp1_fp16"
    kind: str  # "engine" | "trainer"
    stage: int
    dp: int
    train_dtype: str  # "bf16" | "fp16" | "fp32"
    copy_src: Path  # what is copied into the scratch folder: fixtures/<name>/checkpoint or fixtures/<name>/out
    root_rel: str  # the checkpoint root inside that copy: "." or "checkpoint-2"
    tag: str
    optim_files: tuple[str, ...]  # by DP rank
    model_files: tuple[str, ...]  # ZeRO-3: by DP rank; ZeRO-0/1/2: (mp_rank_00_model_states.pt,)
    tag_dirs: tuple[Path, ...]  # every tag folder of the fixture (Trainer: one per checkpoint-N), pristine
    elastic: bool
    bf16_optimizer: bool
    has_saved_weights: bool  # a Trainer folder with model.safetensors beside global_stepN/

    @property
    def src_root(self) -> Path:
        return (self.copy_src / self.root_rel).resolve()

    @property
    def zero3(self) -> bool:
        return self.stage == 3


def load_fixture_info(fixtures: Path, name: str) -> FixtureInfo:
    base = fixtures / name
    meta = json.loads((base / "meta.json").read_text())
    if (base / "out").is_dir():
        copy_src = base / "out"
        ckpts = sorted((p for p in copy_src.iterdir() if re.fullmatch(r"checkpoint-\d+", p.name)),
                       key=lambda p: int(p.name.split("-")[1]))  # fmt: skip
        root_rel = ckpts[-1].name
        roots = ckpts
    else:
        copy_src, root_rel, roots = base / "checkpoint", ".", [base / "checkpoint"]
    root = copy_src / root_rel
    tag = (root / "latest").read_text().strip()
    names = sorted(p.name for p in (root / tag).iterdir())
    optim = {int(m[2]): n for n in names if (m := OPTIM_RE.match(n))}
    z3 = {int(m[1]): n for n in names if (m := ZERO3_MODEL_RE.match(n))}
    models = tuple(z3[r] for r in sorted(z3)) if z3 else (MODEL_FILE,)
    tag_dirs = tuple(r / (r / "latest").read_text().strip() for r in roots)
    dtype = str(meta.get("dtype", "fp32"))
    osd_keys = set(meta.get("optim_state_keys") or [])
    return FixtureInfo(
        name=name,
        kind=meta.get("kind", "engine"),
        stage=int(meta.get("zero_stage", 3 if z3 else 2)),
        dp=len(optim),
        train_dtype={"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype),
        copy_src=copy_src,
        root_rel=root_rel,
        tag=tag,
        optim_files=tuple(optim[r] for r in sorted(optim)),
        model_files=models,
        tag_dirs=tag_dirs,
        elastic=bool(meta.get("elastic_checkpoint")),
        bf16_optimizer=bool(meta.get("bf16_optimizer")) or (bool(osd_keys) and "zero_stage" not in osd_keys),
        has_saved_weights=(root / "model.safetensors").is_file(),
    )


# --- The context a mutation runs in ---------------------------------------------------------------------------


@dataclass
class Ctx:
    info: FixtureInfo
    root: Path  # the mutated checkpoint root (inside the scratch copy)
    work: Path  # the case's scratch folder: in/ (the copy), outs/, outside/ (files placed outside the checkpoint)
    rng: random.Random
    infos: dict[str, FixtureInfo]  # every fixture, for stale files
    touched: set[str] = field(default_factory=set)  # root-relative paths of files changed outside the tag folder
    entry: str = "root"  # what the commands are given: "root" (the checkpoint) or "output_dir" (Trainer out/)
    extra_keys: set[str] = field(default_factory=set)  # top-level keys added to a pickle, ignored in outputs

    @property
    def tag_dir(self) -> Path:
        return self.root / self.info.tag

    @property
    def sentinel(self) -> Path:
        """Created by the hostile pickles' payloads if they ever run."""
        return self.work / "SENTINEL"

    @property
    def decoy(self) -> Path:
        """A folder the hostile pickles try to delete."""
        return self.work / "decoy"

    @property
    def outside(self) -> Path:
        path = self.work / "outside"
        path.mkdir(exist_ok=True)
        return path

    def rank_files(self, kind: str = "any") -> list[Path]:
        optim = [self.tag_dir / n for n in self.info.optim_files]
        model = [self.tag_dir / n for n in self.info.model_files]
        files = {"optim": optim, "model": model, "any": optim + model}[kind]
        if not files:  # ZeRO-0: no optimizer files
            raise NotApplicable(f"no {kind} rank files")
        return files

    def pick_rank_file(self, kind: str = "any") -> Path:
        return self.rng.choice(self.rank_files(kind))

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.root)

    def touch(self, path: Path) -> None:
        self.touched.add(self.rel(path))

    def other_rank(self, rank: int) -> int:
        if self.info.dp < 2:
            raise NotApplicable("needs two ranks")
        return self.rng.choice([r for r in range(self.info.dp) if r != rank])


Mutation = Callable[[Ctx], str]


@dataclass(frozen=True)
class Family:
    name: str
    group: str  # byte | file | pickle | latest | config | hostile | fs | trainer | control
    fn: Mutation
    applies: Callable[[FixtureInfo], bool] = lambda info: True
    weight: int = 1  # how many times the default count this family gets
    expect: str = "any"  # "any" (clean rejection or identical output) | "success" (controls)
    entry: str = "root"
    needs_non_root: bool = False


FAMILIES: dict[str, Family] = {}


def family(name: str, group: str, **kwargs: Any) -> Callable[[Mutation], Mutation]:
    def register(fn: Mutation) -> Mutation:
        FAMILIES[name] = Family(name, group, fn, **kwargs)
        return fn

    return register


# --- Zip helpers ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZipEntry:
    name: str
    header: int  # offset of the local header
    start: int  # first byte of the data
    end: int  # one past the last byte of the data
    compress_type: int


@dataclass(frozen=True)
class ZipLayout:
    entries: list[ZipEntry]
    cd_start: int
    size: int

    def regions(self) -> dict[str, list[tuple[int, int]]]:
        return {
            "pickle": [(e.start, e.end) for e in self.entries if e.name.endswith("/data.pkl")],
            "tensor": [(e.start, e.end) for e in self.entries if "/data/" in e.name and e.end > e.start],
            "local_header": [(e.header, e.start) for e in self.entries],
            "central_dir": [(self.cd_start, self.size)],
            "anywhere": [(0, self.size)],
        }


def zip_layout(data: bytes) -> ZipLayout:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        entries = []
        for info in zf.infolist():
            n, e = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + n + e
            entries.append(ZipEntry(info.filename, info.header_offset, start, start + info.compress_size,
                                    info.compress_type))  # fmt: skip
        return ZipLayout(entries, zf.start_dir, len(data))


def read_entries(path: Path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(info, zf.read(info)) for info in zf.infolist()]


def write_zip(path: Path, entries: list[tuple[str, bytes, int]]) -> None:
    """(name, bytes, compress_type) in order, with correct CRCs (Python's zipfile, not torch's writer)."""
    with zipfile.ZipFile(path, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are written on purpose
        for name, data, method in entries:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.compress_type = method
            zf.writestr(zi, data)


def rezip(path: Path, *, replace: dict[str, bytes] | None = None, methods: dict[str, int] | None = None,
          extra: list[tuple[str, bytes, int]] | None = None) -> None:  # fmt: skip
    replace, methods = replace or {}, methods or {}
    entries = [(i.filename, replace.get(i.filename, d), methods.get(i.filename, zipfile.ZIP_STORED))
               for i, d in read_entries(path)]  # fmt: skip
    write_zip(path, entries + (extra or []))


def pickle_entry(path: Path) -> tuple[str, bytes]:
    for info, data in read_entries(path):
        if info.filename.endswith("/data.pkl"):
            return info.filename, data
    raise NotApplicable(f"{path.name} has no data.pkl")


def patch_headers(path: Path, name: str, *, field_offsets: tuple[int, int], value: bytes) -> None:
    """Overwrite a field of `name`'s local header (offset field_offsets[0]) and central-directory header ([1])."""
    data = bytearray(path.read_bytes())
    encoded = name.encode("utf-8")
    lay = zip_layout(bytes(data))
    entry = next(e for e in lay.entries if e.name == name)
    data[entry.header + field_offsets[0] : entry.header + field_offsets[0] + len(value)] = value
    pos = lay.cd_start
    while data[pos : pos + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<HHH", data, pos + 28)
        if bytes(data[pos + 46 : pos + 46 + n]) == encoded:
            data[pos + field_offsets[1] : pos + field_offsets[1] + len(value)] = value
        pos += 46 + n + e + c
    path.write_bytes(bytes(data))


# --- Pickle helpers ------------------------------------------------------------------------------------------------


def load_obj(path: Path) -> Any:
    """The trusted fixture copy, loaded permissively (DeepSpeed's classes included) to be edited and saved back."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def save_obj(obj: Any, path: Path) -> None:
    """torch.save to the same path: the archive folder inside the zip is the file's stem, as DeepSpeed wrote it."""
    import torch

    torch.save(obj, path)


def edit(path: Path, fn: Callable[[Any], str]) -> str:
    obj = load_obj(path)
    desc = fn(obj)
    save_obj(obj, path)
    return desc


def op_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def op_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    enc = pickle.encode_long(n)
    return b"\x8a" + bytes([len(enc)]) + enc


def inject_top(pkl: bytes, key: str, value_ops: bytes) -> bytes:
    """Add (or override) one item of the pickled top-level dict: its last op is STOP with the dict on the stack."""
    if not pkl.endswith(b"."):
        raise NotApplicable("pickle does not end with STOP")
    return pkl[:-1] + op_str(key) + value_ops + b"s."


def tensor_offset_ops(pkl: bytes) -> list[tuple[int, int, Any]]:
    """(position, length, value) of every tensor's storage_offset argument: the op right after BINPERSID."""
    ops = list(pickletools.genops(pkl))
    found: list[tuple[int, int, Any]] = []
    for (op, _, _), (nop, arg, npos) in itertools.pairwise(ops):
        if op.name == "BINPERSID" and nop.name in ("BININT1", "BININT2", "BININT", "LONG1"):
            assert npos is not None  # genops over bytes always knows the position
            length = {"BININT1": 2, "BININT2": 3, "BININT": 5}.get(nop.name) or 2 + pkl[npos + 1]
            found.append((npos, length, arg))
    return found


# --- Object-tree helpers (pickle-level edits) -------------------------------------------------------------------


def walk(obj: Any, path: tuple = (), depth: int = 6, skip: set[str] = CARRIED_KEYS):
    """Yield (path, value) for every node below obj; a path step is ("item", key) or ("attr", name)."""
    if depth == 0 or isinstance(obj, enum.Enum):  # enum members are process-wide singletons: never edit them
        return
    if isinstance(obj, dict):
        children = [(("item", k), v) for k, v in obj.items() if not (isinstance(k, str) and k in skip)]
    elif isinstance(obj, (list, tuple)) and not _is_size(obj):
        children = [(("item", i), v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
        children = [(("attr", k), v) for k, v in vars(obj).items()]
    else:
        return
    for step, value in children:
        yield (*path, step), value
        yield from walk(value, (*path, step), depth - 1, skip)


def _is_size(obj: Any) -> bool:
    return type(obj).__name__ == "Size"


def get_at(obj: Any, path: tuple) -> Any:
    for kind, key in path:
        obj = getattr(obj, key) if kind == "attr" else obj[key]
    return obj


def set_at(obj: Any, path: tuple, value: Any) -> None:
    parent_path, (kind, key) = path[:-1], path[-1]
    parent = get_at(obj, parent_path)
    if kind == "attr":
        setattr(parent, key, value)
    elif isinstance(parent, tuple):
        items = list(parent)
        items[key] = value
        set_at(obj, parent_path, type(parent)(items) if not _is_size(parent) else tuple(items))
    else:
        parent[key] = value


def del_at(obj: Any, path: tuple) -> None:
    parent_path, (kind, key) = path[:-1], path[-1]
    parent = get_at(obj, parent_path)
    if kind == "attr":
        delattr(parent, key)
    elif isinstance(parent, tuple):
        items = [v for i, v in enumerate(parent) if i != key]
        set_at(obj, parent_path, type(parent)(items))
    else:
        del parent[key]


def fmt_path(path: tuple) -> str:
    return "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in path)


def is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def alien(rng: random.Random) -> Any:
    # No tensors: a tensor replaced by another tensor is a different checkpoint, not a damaged one.
    return rng.choice([None, 0, -1, 7, 2**63, 1.5, float("nan"), "x", "", b"\x00", [], {}, [1, 2], (), True,
                       OrderedDict(a=1)])  # fmt: skip


SINGLE_COPY_SCALARS = {"loss_scaler", "clip_grad", "overflow", "dynamic_loss_scale", "param_alignment_paddings",
                       "group_paddings", "param_slice_mappings", "base_optimizer_state_step", "step"}  # fmt: skip


def editable(info: FixtureInfo, obj: dict, path: tuple, value: Any, *, deleting: bool = False) -> bool:
    """Whether a generic edit at `path` could be told from a real checkpoint, so that refusing it is the only
    right answer (or the output cannot change). Values with no second copy anywhere are left alone:

    - ZeRO-1 keeps frozen params and buffers only in `module` (frozen_param_* are None), and `buffer_names` is the
      only list of buffers there;
    - with one rank, optimizer hyper-parameters, the loss scaler and Adam's step exist once;
    - deleting a None or empty value gives what older DeepSpeed versions wrote (no frozen_param_*, no shared_params),
      and so does deleting checkpoint_parallel_dimensions.
    """
    keys = [k for kind, k in path if kind == "item"]
    if deleting and (value is None or (isinstance(value, (dict, list, tuple)) and not value)):
        return False
    if deleting and keys[:1] == ["checkpoint_parallel_dimensions"] and len(keys) == 1:
        return False  # older DeepSpeed versions write no such key, and none reads it at load time
    if info.stage == 1 and keys and keys[0] in ("module", "buffer_names"):
        trainable = {n for g in obj.get("param_shapes") or [] for n in g}
        if keys[0] == "buffer_names" or len(keys) < 2 or keys[1] not in trainable:
            return False
    if info.dp == 1:
        if "param_groups" in keys and "params" not in keys:
            return False
        if any(isinstance(k, str) and k in SINGLE_COPY_SCALARS for k in keys) or ("attr", "cur_scale") in path:
            return False
    return True


def osd(obj: dict) -> dict:
    inner = obj.get("optimizer_state_dict")
    if not isinstance(inner, dict):
        raise NotApplicable("no optimizer_state_dict")
    return inner


def masters_key(info: FixtureInfo) -> str:
    return "fp32_flat_groups" if info.zero3 else "single_partition_of_fp32_groups"


def moment_states(info: FixtureInfo, inner: dict) -> list[dict]:
    """Per (sub-)group optimizer state dicts (Adam: step, exp_avg, exp_avg_sq)."""
    base = inner.get("optimizer_state_dict") if info.zero3 else inner.get("base_optimizer_state")
    if isinstance(base, list):  # elastic
        return [s for s in base if isinstance(s, dict)]
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        return [s for s in base["state"].values() if isinstance(s, dict)]
    return []


def param_groups(info: FixtureInfo, inner: dict) -> list[dict]:
    base = inner.get("optimizer_state_dict") if info.zero3 else inner.get("base_optimizer_state")
    if isinstance(base, dict) and isinstance(base.get("param_groups"), list):
        return base["param_groups"]
    return []


def one_rank_optim(ctx: Ctx) -> tuple[int, Path]:
    """A rank of a multi-rank checkpoint: edits 'on one rank' only make sense where other ranks can disagree."""
    if ctx.info.dp < 2:
        raise NotApplicable("needs two ranks for a one-rank edit")
    rank = ctx.rng.randrange(ctx.info.dp)
    return rank, ctx.tag_dir / ctx.info.optim_files[rank]


# ================================================================================================================
# Byte-level damage
# ================================================================================================================


def _flip_in(ctx: Ctx, region: str, path: Path | None = None) -> str:
    path = path or ctx.pick_rank_file()
    data = bytearray(path.read_bytes())
    spans = [s for s in zip_layout(bytes(data)).regions()[region] if s[1] > s[0]]
    if not spans:
        raise NotApplicable(f"no {region} bytes")
    count = ctx.rng.choice([1, 1, 1, 2, 3, 8])
    offsets = []
    for _ in range(count):
        lo, hi = ctx.rng.choice(spans)
        off = ctx.rng.randrange(lo, hi)
        data[off] ^= ctx.rng.randrange(1, 256)
        offsets.append(off)
    path.write_bytes(bytes(data))
    return f"{count} byte(s) flipped in the {region} of {ctx.rel(path)} at {sorted(offsets)}"


for _region in ("pickle", "tensor", "local_header", "central_dir", "anywhere"):
    family(f"flip_{_region}", "byte", weight=2 if _region in ("pickle", "anywhere") else 1)(
        functools.partial(_flip_in, region=_region)
    )


@family("truncate", "byte", weight=2)
def m_truncate(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    data = path.read_bytes()
    lay = zip_layout(data)
    if ctx.rng.random() < 0.4:
        cuts = {lay.cd_start, len(data) - 1, len(data) - 22}
        for e in lay.entries:
            cuts |= {e.header, e.start, e.end, e.end - 1}
        cut = ctx.rng.choice(sorted(c for c in cuts if 0 <= c < len(data)))
    else:
        cut = ctx.rng.randrange(len(data))
    path.write_bytes(data[:cut])
    return f"{ctx.rel(path)} truncated to {cut} of {len(data)} bytes"


@family("append_junk", "byte")
def m_append(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    data = path.read_bytes()
    kind = ctx.rng.choice(["random", "random", "fake_eocd", "own_tail", "other_rank_file", "prepend"])
    if kind == "random":
        junk = ctx.rng.randbytes(ctx.rng.choice([1, 7, 100, 4096]))
        path.write_bytes(data + junk)
    elif kind == "fake_eocd":
        path.write_bytes(data + b"PK\x05\x06" + bytes(18))
    elif kind == "own_tail":
        path.write_bytes(data + data[-ctx.rng.choice([22, 98, 500]) :])
    elif kind == "other_rank_file":  # a whole other zip appended: zipfile then reads the *appended* archive
        others = [p for p in ctx.rank_files() if p != path and p.read_bytes() != data]
        if not others:
            raise NotApplicable("no other rank file")
        other = ctx.rng.choice(others)
        path.write_bytes(data + other.read_bytes())
        return f"{ctx.rel(other)} appended to {ctx.rel(path)}"
    else:
        path.write_bytes(ctx.rng.randbytes(ctx.rng.choice([1, 64, 1000])) + data)
    return f"{kind} junk added to {ctx.rel(path)}"


@family("zero_length", "byte")
def m_zero_length(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    path.write_bytes(b"")
    return f"{ctx.rel(path)} emptied"


@family("damage_saved_weights", "byte", applies=lambda i: i.has_saved_weights)
def m_saved_weights(ctx: Ctx) -> str:
    """The 16-bit model.safetensors a Trainer saved beside the shards, which consolidate compares with."""
    path = ctx.root / "model.safetensors"
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack_from("<Q", data)
    ctx.touch(path)
    kind = ctx.rng.choice(["flip_header", "flip_data", "truncate", "huge_header_len", "header_not_json", "empty"])
    if kind == "flip_header":
        off = ctx.rng.randrange(8, 8 + hlen)
        data[off] ^= ctx.rng.randrange(1, 256)
    elif kind == "flip_data":
        off = ctx.rng.randrange(8 + hlen, len(data))
        data[off] ^= ctx.rng.randrange(1, 256)
    elif kind == "truncate":
        data = data[: ctx.rng.randrange(len(data))]
    elif kind == "huge_header_len":
        data[:8] = struct.pack("<Q", ctx.rng.choice([2**63, len(data), 2**40]))
    elif kind == "header_not_json":
        data[8 : 8 + hlen] = (b"[1, 2, 3]" + b" " * hlen)[:hlen]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    return f"model.safetensors: {kind}"


# ================================================================================================================
# File-level damage: missing, duplicated, swapped, stale and stray rank files
# ================================================================================================================


@family("delete_rank_file", "file")
def m_delete(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    path.unlink()
    return f"{ctx.rel(path)} deleted"


def _pair(ctx: Ctx) -> tuple[Path, Path]:
    kinds = ["optim"] + (["model"] if ctx.info.zero3 else [])
    files = ctx.rank_files(ctx.rng.choice(kinds))
    if len(files) < 2:
        raise NotApplicable("needs two ranks")
    a, b = ctx.rng.sample(files, 2)
    return a, b


@family("duplicate_rank_file", "file")
def m_duplicate(ctx: Ctx) -> str:
    a, b = _pair(ctx)
    shutil.copyfile(a, b)
    return f"{ctx.rel(a)} copied over {ctx.rel(b)}"


@family("swap_rank_files", "file", weight=2)
def m_swap(ctx: Ctx) -> str:
    a, b = _pair(ctx)
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return f"{ctx.rel(a)} and {ctx.rel(b)} swapped"


@family("stale_rank_file", "file", weight=2)
def m_stale(ctx: Ctx) -> str:
    """A rank file from another step of the same run, or from another fixture (same file name)."""
    if ctx.info.stage == 0:  # the one file is the whole checkpoint: another run's is just another checkpoint
        raise NotApplicable("a stage-0 checkpoint is one file")
    path = ctx.pick_rank_file()
    own = path.read_bytes()
    same_shape: list[Any] = []
    other: list[Any] = []
    for info in ctx.infos.values():
        for tag_dir in info.tag_dirs:
            cand = tag_dir / path.name
            if cand.is_file() and cand.resolve() != (ctx.info.src_root / ctx.info.tag / path.name).resolve():
                if cand.read_bytes() == own:
                    continue
                similar = info.dp == ctx.info.dp and info.zero3 == ctx.info.zero3 and info.kind == ctx.info.kind
                (same_shape if similar else other).append(cand)
    pool = same_shape if same_shape and (ctx.rng.random() < 0.7 or not other) else other
    if not pool:
        raise NotApplicable("no stale candidate")
    src = ctx.rng.choice(sorted(pool))
    shutil.copyfile(src, path)
    return f"{ctx.rel(path)} replaced by {'/'.join(src.parts[-4:])}"


@family("stray_rank_file", "file")
def m_stray(ctx: Ctx) -> str:
    info, tag = ctx.info, ctx.tag_dir
    if not info.optim_files:
        raise NotApplicable("no optimizer files")
    rank0 = tag / info.optim_files[0]
    prefix = cast("re.Match[str]", OPTIM_RE.match(info.optim_files[0]))[1] or ""  # optim_files all match it
    other_prefix = ctx.rng.choice([p for p in ("", "bf16_", "fp16_") if p != prefix])
    choices = {
        "extra_rank": (rank0, f"{prefix}zero_pp_rank_{info.dp}_mp_rank_00_optim_states.pt"),
        "far_rank": (rank0, f"{prefix}zero_pp_rank_{info.dp + 7}_mp_rank_00_optim_states.pt"),
        "other_prefix": (rank0, f"{other_prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        "mp_rank_01": (rank0, f"{prefix}zero_pp_rank_0_mp_rank_01_optim_states.pt"),
        "legacy_name": (rank0, f"{prefix}zero_pp_rank_0_mp_rank_00optim_states.pt"),
        "zero_padded_rank": (rank0, f"{prefix}zero_pp_rank_00_mp_rank_00_optim_states.pt"),
        "backup_copy": (rank0, info.optim_files[0] + ".bak"),
        "notes": (None, "notes.txt"),
        "hidden": (None, ".DS_Store"),
        "offloaded_dir": (None, "offloaded_tensors/"),
        "random_dir": (None, "somedir/"),
    }
    if info.zero3:
        choices["extra_model_rank"] = (tag / info.model_files[0], f"zero_pp_rank_{info.dp}_mp_rank_00_model_states.pt")
        choices["plain_model_file"] = (tag / info.model_files[0], MODEL_FILE)
    else:
        choices["zero3_model_file"] = (tag / MODEL_FILE, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    kind = ctx.rng.choice(sorted(choices))
    src, name = choices[kind]
    dst = tag / name
    if name.endswith("/"):
        dst.mkdir()
    elif src is None:
        dst.write_bytes(ctx.rng.randbytes(64))
    else:
        shutil.copyfile(src, dst)
    return f"stray {kind}: {ctx.rel(dst)}"


@family("model_states_removed_or_swapped", "file")
def m_model_states(ctx: Ctx) -> str:
    info, tag = ctx.info, ctx.tag_dir
    rank = ctx.rng.randrange(len(info.model_files))
    model = tag / info.model_files[rank]
    optim = tag / info.optim_files[min(rank, info.dp - 1)]
    kind = ctx.rng.choice(["remove", "optim_bytes", "swap_with_optim", "stale"])
    if kind == "remove":
        model.unlink()
    elif kind == "optim_bytes":
        shutil.copyfile(optim, model)
    elif kind == "swap_with_optim":
        tmp = model.with_name("swap.tmp")
        model.rename(tmp)
        optim.rename(model)
        tmp.rename(optim)
    else:
        cands = sorted(d / model.name for i in ctx.infos.values() if i.name != info.name for d in i.tag_dirs
                       if (d / model.name).is_file())  # fmt: skip
        if not cands:
            raise NotApplicable("no stale model file")
        shutil.copyfile(ctx.rng.choice(cands), model)
    return f"{ctx.rel(model)}: {kind}"


# ================================================================================================================
# Pickle-level semantic edits (valid zips, correct CRCs, original archive names)
# ================================================================================================================


@family("resave_identity", "control", expect="success")
def m_resave(ctx: Ctx) -> str:
    """Control: torch.load + torch.save with no edit must give the same outputs (validates the harness)."""
    path = ctx.pick_rank_file()
    save_obj(load_obj(path), path)
    return f"{ctx.rel(path)} re-saved unchanged"


@family("rezip_identity", "control", expect="success")
def m_rezip(ctx: Ctx) -> str:
    """Control: the same entries rewritten by Python's zipfile (no alignment padding, no data descriptors)."""
    path = ctx.pick_rank_file()
    rezip(path)
    return f"{ctx.rel(path)} re-zipped unchanged"


@family("master_dtype", "pickle", weight=2)
def m_master_dtype(ctx: Ctx) -> str:
    import torch

    path = ctx.pick_rank_file("optim")
    how = ctx.rng.choice(["view_int16", "view_int32", "view_uint8", "to_bf16", "to_fp16", "to_fp64", "storage_global"])
    if how == "storage_global":  # the pickle's storage class renamed: every fp32 storage of the file reinterpreted
        name, pkl = pickle_entry(path)
        new = ctx.rng.choice([b"BFloat16Storage", b"HalfStorage", b"ShortStorage", b"DoubleStorage", b"IntStorage"])
        if b"torch\nFloatStorage\n" not in pkl:
            raise NotApplicable("no FloatStorage")
        rezip(path, replace={name: pkl.replace(b"torch\nFloatStorage\n", b"torch\n" + new + b"\n")})
        return f"{ctx.rel(path)}: FloatStorage renamed {new.decode()}"

    def fn(obj: dict) -> str:
        groups = osd(obj).get(masters_key(ctx.info))
        if not isinstance(groups, list) or not groups:
            raise NotApplicable("no master partitions")
        g = ctx.rng.randrange(len(groups))
        t = groups[g]
        new = {
            "view_int16": lambda: t.view(torch.int16),
            "view_int32": lambda: t.view(torch.int32),
            "view_uint8": lambda: t.view(torch.uint8),
            "to_bf16": lambda: t.to(torch.bfloat16),
            "to_fp16": lambda: t.to(torch.float16),
            "to_fp64": lambda: t.to(torch.float64),
        }[how]()
        new.__dict__.update(t.__dict__)  # keep DeepSpeed's ds_id on ZeRO-3 flat groups
        groups[g] = new
        return f"{ctx.rel(path)}: {masters_key(ctx.info)}[{g}] {how}"

    return edit(path, fn)


def _model_files_to_edit(ctx: Ctx, *, all_allowed: bool = True) -> tuple[list[Path], str]:
    """ZeRO-3 keeps param_shapes in every rank's model file: edit one rank's (detectable by cross-checking) or,
    where the edit is detectable anyway, all of them."""
    files = ctx.rank_files("model")
    if len(files) == 1:
        return files, "the model file"
    if all_allowed and ctx.rng.random() < 0.4:
        return files, "every rank's model file"
    rank = ctx.rng.randrange(len(files))
    return [files[rank]], f"rank {rank}'s model file"


@family("param_shapes_group", "pickle")
def m_param_shapes_group(ctx: Ctx) -> str:
    files, where = _model_files_to_edit(ctx)
    how = ctx.rng.choice(["remove_group", "empty_group", "empty_list", "none", "extra_empty_group", "duplicate_group"])
    group_seed = ctx.rng.random()
    desc = ""  # files is never empty
    for path in files:
        g_rng = random.Random(group_seed)  # the same group in every file

        def fn(obj: dict, g_rng: random.Random = g_rng) -> str:
            shapes = obj.get("param_shapes")
            if not isinstance(shapes, list) or not shapes:
                raise NotApplicable("no param_shapes")
            g = g_rng.randrange(len(shapes))
            if how == "remove_group":
                del shapes[g]
            elif how == "empty_group":
                shapes[g] = OrderedDict()
            elif how == "empty_list":
                obj["param_shapes"] = []
            elif how == "none":
                obj["param_shapes"] = None
            elif how == "extra_empty_group":
                shapes.append(OrderedDict())
            else:
                shapes.insert(g, OrderedDict(shapes[g]))
            return f"group {g}"

        desc = edit(path, fn)
    return f"param_shapes {how} ({desc}) in {where}"


def _all_param_names(obj: dict) -> list[str]:
    return [n for g in obj.get("param_shapes") or [] for n in g]


@family("rename_param", "pickle", weight=2)
def m_rename(ctx: Ctx) -> str:
    model0 = load_obj(ctx.rank_files("model")[0])
    trainable = _all_param_names(model0)
    buffers = list(model0.get("buffer_names") or [])
    frozen = list(model0.get("frozen_param_shapes") or {})
    shared = dict(model0.get("shared_params") or {})
    where = ctx.rng.choice(["param_shapes", "module_trainable", "module_buffer", "buffer_names", "frozen_param_shapes",
                            "frozen_param_fragments", "shared_params_key", "shared_params_value"])  # fmt: skip
    pools = {"param_shapes": trainable, "module_trainable": trainable, "module_buffer": buffers,
             "buffer_names": buffers, "frozen_param_shapes": frozen, "frozen_param_fragments": frozen,
             "shared_params_key": list(shared), "shared_params_value": list(shared)}  # fmt: skip
    if not pools[where]:
        raise NotApplicable(f"nothing to rename in {where}")
    old = ctx.rng.choice(pools[where])
    others = [n for n in trainable + frozen + buffers if n != old]
    new = ctx.rng.choice([old + ".x", "renamed", "", "module.", others[0] if others else old + "_"] +
                         [ctx.rng.choice(others)] * bool(others))  # fmt: skip
    if where.startswith(("frozen", "shared")):
        files, scope = ctx.rank_files("model")[:1], "rank 0's model file"
    else:
        files, scope = _model_files_to_edit(ctx, all_allowed=where != "param_shapes" or not ctx.info.zero3)

    def rename_key(d: dict, key: str) -> None:
        items = [(new if k == key else k, v) for k, v in d.items()]
        d.clear()
        d.update(items)

    def fn(obj: dict) -> str:
        if where == "param_shapes":
            for g in obj.get("param_shapes") or []:
                if old in g:
                    rename_key(g, old)
        elif where in ("module_trainable", "module_buffer"):
            rename_key(obj["module"], old)
        elif where == "buffer_names":
            obj["buffer_names"] = [new if n == old else n for n in obj["buffer_names"]]
        elif where in ("frozen_param_shapes", "frozen_param_fragments"):
            if isinstance(obj.get(where), dict):
                rename_key(obj[where], old)
        elif where == "shared_params_key":
            rename_key(obj["shared_params"], old)
        else:
            obj["shared_params"][old] = new
        return ""

    for path in files:
        edit(path, fn)
    return f"{where} {old!r} -> {new!r} in {scope}"


@family("change_shape", "pickle", weight=2)
def m_change_shape(ctx: Ctx) -> str:
    import torch

    key = ctx.rng.choice(["param_shapes", "param_shapes", "frozen_param_shapes"])
    same_numel = ctx.rng.random() < 0.5
    # ZeRO-3 model files hold only placeholders: a consistent same-numel edit of every rank's file cannot be told
    # from a real model, so ZeRO-3 edits touch one rank's file (and need two ranks to be detectable).
    if ctx.info.zero3:
        files = ctx.rank_files("model")
        if len(files) < 2 and (same_numel or key == "frozen_param_shapes"):
            raise NotApplicable("undetectable with one ZeRO-3 rank")
        rank = ctx.rng.randrange(len(files))
        files, scope = [files[rank]], f"rank {rank}'s model file"
    else:
        files, scope = ctx.rank_files("model"), "the model file"
    pick = random.Random(ctx.rng.random())

    def fn(obj: dict) -> str:
        found = obj.get("param_shapes") if key == "param_shapes" else [obj.get("frozen_param_shapes")]
        tables: list[dict] = [t for t in found or [] if isinstance(t, dict) and t]
        if not tables:
            raise NotApplicable(f"no {key}")
        table = pick.choice(tables)
        name = pick.choice(list(table))
        shape = list(table[name])
        numel = 1
        for s in shape:
            numel *= s
        if same_numel:
            options = [shape[::-1], [*shape, 1], [1, *shape], [numel]]
            options = [o for o in options if o != shape]
            if not options:
                raise NotApplicable("no same-numel shape")
            new = pick.choice(options)
        else:
            new = pick.choice([[numel + 1], [*shape[:-1], shape[-1] + 1], [max(numel - 1, 0)], [0], [-1], [],
                               [2**40], [*shape, 2]])  # fmt: skip
            if new == shape:
                new = [numel + 1]
        table[name] = torch.Size(new) if all(s >= 0 for s in new) else tuple(new)
        return f"{key} {name}: {shape} -> {new}"

    desc = ""
    for path in files:
        desc = edit(path, fn)
    return f"{desc} in {scope}"


@family("remove_shared_params", "pickle")
def m_remove_shared(ctx: Ctx) -> str:
    path = ctx.rank_files("model")[0]
    how = ctx.rng.choice(["delete", "empty", "none"])

    def fn(obj: dict) -> str:
        if not obj.get("shared_params"):
            raise NotApplicable("no shared params")
        if how == "delete":
            del obj["shared_params"]
        else:
            obj["shared_params"] = {} if how == "empty" else None
        return ""

    edit(path, fn)
    return f"shared_params {how} in {ctx.rel(path)}"


@family("storage_offset", "pickle")
def m_storage_offset(ctx: Ctx) -> str:
    """data.pkl bytes edited directly: one tensor's storage_offset made negative, huge or just past its record."""
    path = ctx.pick_rank_file()
    name, pkl = pickle_entry(path)
    ops = tensor_offset_ops(pkl)
    if not ops:
        raise NotApplicable("no tensors")
    pos, length, value = ctx.rng.choice(ops)
    new = ctx.rng.choice([-1, -(2**31), -(2**40), 2**31 - 1, 2**40, 2**63, 2**64 + 3, value + 10**6])
    rezip(path, replace={name: pkl[:pos] + op_int(new) + pkl[pos + length :]})
    return f"{ctx.rel(path)}: a storage_offset {value} -> {new}"


@family("drop_moment", "pickle")
def m_drop_moment(ctx: Ctx) -> str:
    path = ctx.pick_rank_file("optim")
    key = ctx.rng.choice(["exp_avg", "exp_avg", "exp_avg_sq"])

    def fn(obj: dict) -> str:
        states = [s for s in moment_states(ctx.info, osd(obj)) if key in s]
        if not states:
            raise NotApplicable(f"no {key}")
        i = ctx.rng.randrange(len(states))
        del states[i][key]
        return f"{key} of (sub-)group {i}"

    return f"{ctx.rel(path)}: dropped {edit(path, fn)}"


@family("change_step", "pickle")
def m_change_step(ctx: Ctx) -> str:
    import torch

    rank, path = one_rank_optim(ctx)
    delta = ctx.rng.choice([1, -1, 100])

    def fn(obj: dict) -> str:
        inner = osd(obj)
        states = [s for s in moment_states(ctx.info, inner) if "step" in s]
        if ctx.info.elastic and "base_optimizer_state_step" in inner and ctx.rng.random() < 0.3:
            inner["base_optimizer_state_step"] = inner["base_optimizer_state_step"] + delta
            return "base_optimizer_state_step"
        if not states:
            raise NotApplicable("no step")
        for s in states:
            s["step"] = s["step"] + delta if not is_tensor(s["step"]) else s["step"] + torch.tensor(float(delta))
        return f"step {delta:+d} in every group"

    return f"rank {rank}: {edit(path, fn)}"


@family("change_lr", "pickle")
def m_change_lr(ctx: Ctx) -> str:
    rank, path = one_rank_optim(ctx)
    key = ctx.rng.choice(["lr", "lr", "weight_decay", "betas", "eps"])

    def fn(obj: dict) -> str:
        groups = [g for g in param_groups(ctx.info, osd(obj)) if key in g]
        if not groups:
            raise NotApplicable(f"no param group {key}")
        g = ctx.rng.randrange(len(groups))
        groups[g][key] = [0.5, 0.5] if key == "betas" else groups[g][key] * 10 + 0.125
        return f"param_groups[{g}][{key!r}] changed"

    return f"rank {rank}: {edit(path, fn)}"


@family("change_partition_count", "pickle", weight=2)
def m_partition_count(ctx: Ctx) -> str:
    if ctx.info.stage == 0:  # no partitions: the recorded dp_world_size is all there is, and nothing depends on it
        raise NotApplicable("stage 0 partitions nothing")
    dp = ctx.info.dp
    target = ctx.rng.choice(["partition_count", "partition_count", "dp_world_size"])
    value = ctx.rng.choice([dp + 1, dp - 1, 0, -1, 10**12, 2**64, "2", None, [dp, dp]])
    if target == "partition_count":
        files = ctx.rank_files("optim")
        files, scope = (files, "every rank") if ctx.rng.random() < 0.4 else ([ctx.rng.choice(files)], "one rank")
    else:
        files, scope = _model_files_to_edit(ctx)

    def fn(obj: dict) -> str:
        if target == "partition_count":
            inner = osd(obj)
            if "partition_count" not in inner:
                raise NotApplicable("no partition_count")
            old = inner["partition_count"]
            if isinstance(old, list) and ctx.rng.random() < 0.5 and old:
                old[ctx.rng.randrange(len(old))] = value
            else:
                inner["partition_count"] = value
        else:
            obj["dp_world_size"] = value
        return ""

    for path in files:
        edit(path, fn)
    return f"{target} = {value!r} in {scope}"


@family("tensor_to_scalar", "pickle", weight=2)
def m_tensor_to_scalar(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    replacement: Any = ctx.rng.choice([7, "str", None, [1, 2], {}, 0.5, b"bytes", -3])

    def fn(obj: dict) -> str:
        tensors = [p for p, v in walk(obj) if is_tensor(v) and editable(ctx.info, obj, p, v)]
        if not tensors:
            raise NotApplicable("no tensors")
        p = ctx.rng.choice(tensors)
        set_at(obj, p, replacement)
        return fmt_path(p)

    return f"{ctx.rel(path)}: tensor {edit(path, fn)} -> {replacement!r}"


TARGETED_KEYS: dict[str, list[tuple[str, ...]]] = {
    "optim": [("optimizer_state_dict",), ("optimizer_state_dict", "single_partition_of_fp32_groups"),
              ("optimizer_state_dict", "fp32_flat_groups"), ("optimizer_state_dict", "base_optimizer_state"),
              ("optimizer_state_dict", "optimizer_state_dict"), ("optimizer_state_dict", "partition_count"),
              ("optimizer_state_dict", "zero_stage"), ("optimizer_state_dict", "loss_scaler"),
              ("optimizer_state_dict", "group_paddings")],
    "model": [("module",), ("param_shapes",), ("buffer_names",), ("frozen_param_shapes",),
              ("frozen_param_fragments",), ("dp_world_size",), ("shared_params",), ("mp_world_size",)],
}  # fmt: skip


@family("delete_key", "pickle", weight=3)
def m_delete_key(ctx: Ctx) -> str:
    kind = ctx.rng.choice(["optim", "model"])
    path = ctx.pick_rank_file(kind)
    targeted = ctx.rng.random() < 0.5

    def fn(obj: dict) -> str:
        if targeted:
            steps = {k: tuple(("item", x) for x in k) for k in TARGETED_KEYS[kind]}
            present = [k for k, p in steps.items()
                       if _has_path(obj, k) and editable(ctx.info, obj, p, get_at(obj, p), deleting=True)]  # fmt: skip
            if not present:
                raise NotApplicable("no targeted key")
            keys = ctx.rng.choice(present)
            p = tuple(("item", k) for k in keys)
        else:
            paths = [p for p, v in walk(obj, depth=4) if editable(ctx.info, obj, p, v, deleting=True)]
            if not paths:
                raise NotApplicable("nothing to delete")
            p = ctx.rng.choice(paths)
        del_at(obj, p)
        return fmt_path(p)

    return f"{ctx.rel(path)}: deleted {edit(path, fn)}"


def _has_path(obj: Any, keys: tuple) -> bool:
    for k in keys:
        if not isinstance(obj, dict) or k not in obj:
            return False
        obj = obj[k]
    return True


@family("type_confusion", "pickle", weight=3)
def m_type_confusion(ctx: Ctx) -> str:
    """Any node of any rank file (configs and counters aside) replaced by a value of another type."""
    path = ctx.pick_rank_file()
    value = alien(ctx.rng)

    def fn(obj: dict) -> str:
        paths = [p for p, v in walk(obj, depth=5) if type(v) is not type(value) and editable(ctx.info, obj, p, v)]
        if not paths:
            raise NotApplicable("nothing to replace")
        p = ctx.rng.choice(paths)
        set_at(obj, p, value)
        return fmt_path(p)

    return f"{ctx.rel(path)}: {edit(path, fn)} -> {type(value).__name__} {value!r:.40}"


@family("loss_scale", "pickle")
def m_loss_scale(ctx: Ctx) -> str:
    rank, path = one_rank_optim(ctx)
    attr = ctx.rng.choice(["cur_scale", "cur_scale", "dynamic", "cur_iter"])

    def fn(obj: dict) -> str:
        scaler = osd(obj).get("loss_scaler")
        if scaler is None or not hasattr(scaler, "cur_scale"):
            raise NotApplicable("no loss scaler")
        if attr == "dynamic":
            scaler.dynamic = not scaler.dynamic
        elif attr == "cur_iter":
            if not hasattr(scaler, "cur_iter"):
                raise NotApplicable("static loss scaler")
            scaler.cur_iter += 5
        else:
            scaler.cur_scale = scaler.cur_scale * 2 + 1
        return attr

    return f"rank {rank}: loss_scaler.{edit(path, fn)} changed"


@family("reorder_param_shapes", "pickle")
def m_reorder(ctx: Ctx) -> str:
    if ctx.info.zero3:
        # Every rank's flat groups follow param_shapes; only a rank disagreeing with the others is detectable.
        files = ctx.rank_files("model")
        if len(files) < 2:
            raise NotApplicable("undetectable with one ZeRO-3 rank")
        rank = ctx.rng.randrange(len(files))
        files, scope = [files[rank]], f"rank {rank}'s model file"
    else:
        files, scope = ctx.rank_files("model"), "the model file"
    how = ctx.rng.choice(["swap_two", "rotate", "reverse_groups", "swap_same_shape"])

    def fn(obj: dict) -> str:
        shapes = obj.get("param_shapes")
        if not shapes:  # ZeRO-0 records none
            raise NotApplicable("no param_shapes")
        if how == "reverse_groups":
            if len(shapes) < 2:
                raise NotApplicable("one group")
            shapes.reverse()
            return "groups reversed"
        groups = [g for g in shapes if len(g) >= 2]
        if how == "swap_same_shape":
            groups = [g for g in groups if len({tuple(s) for s in g.values()}) < len(g)]
        if not groups:
            raise NotApplicable("no group with two params")
        g = ctx.rng.choice(groups)
        items = list(g.items())
        if how == "rotate":
            items = items[1:] + items[:1]
        else:
            if how == "swap_same_shape":
                by_shape: dict = {}
                for i, (_, s) in enumerate(items):
                    by_shape.setdefault(tuple(s), []).append(i)
                i, j = ctx.rng.sample(next(v for v in by_shape.values() if len(v) > 1), 2)
            else:
                i, j = ctx.rng.sample(range(len(items)), 2)
            items[i], items[j] = items[j], items[i]
        g.clear()
        g.update(items)
        return f"{how}: {[n for n, _ in items]}"

    desc = ""
    for path in files:
        desc = edit(path, fn)
    return f"param_shapes {desc} in {scope}"


# ================================================================================================================
# `latest`, config.json / trainer_state.json
# ================================================================================================================


@family("odd_latest", "latest", weight=2)
def m_latest(ctx: Ctx) -> str:
    latest = ctx.root / "latest"
    tag = ctx.info.tag
    ctx.touch(latest)
    variants: dict[str, Any] = {
        "empty": b"",
        "whitespace": b" \n\t \r\n",
        "dotdot": b"../x",
        "escape_and_back": f"../{ctx.root.name}/{tag}".encode(),
        "absolute_real": str(ctx.tag_dir).encode(),
        "absolute_etc": b"/etc",
        "non_utf8": b"\xff\xfe" + tag.encode(),
        "utf8_bom": b"\xef\xbb\xbf" + tag.encode(),
        "missing_tag": b"global_step99",
        "very_long": b"g" * 5000,
        "name_max": b"g" * 255,
        "nul": tag.encode() + b"\x00",
        "trailing_newline": tag.encode() + b"\n",
        "trailing_slash": tag.encode() + b"/",
        "dot_slash": b"./" + tag.encode(),
        "dot": b".",
        "dotdot_only": b"..",
        "windows_abs": b"C:\\x",
        "uppercase": tag.upper().encode(),
        "two_lines": tag.encode() + b"\nglobal_step1\n",
        "inner_dotdot": f"{tag}/../{tag}".encode(),
        "deleted": None,
        "directory": "dir",
        "symlink_outside": "link",
    }
    kind = ctx.rng.choice(sorted(variants))
    value = variants[kind]
    latest.unlink()
    if value == "dir":
        latest.mkdir()
    elif value == "link":
        target = ctx.outside / "latest"
        target.write_text(tag)
        latest.symlink_to(target)
    elif value is not None:
        latest.write_bytes(value)
    return f"latest: {kind}"


def _deep(n: int, open_: str, close: str) -> bytes:
    return (open_ * n + close * n).encode()


BROKEN_JSON: dict[str, Callable[[bytes], bytes]] = {
    "utf8_bom": lambda orig: b"\xef\xbb\xbf" + orig,
    "utf16": lambda orig: orig.decode().encode("utf-16"),
    "truncated": lambda orig: orig[: len(orig) // 2],
    "invalid": lambda orig: b"{not json",
    "string": lambda orig: b'"a string"',
    "null": lambda orig: b"null",
    "number": lambda orig: b"42",
    "list": lambda orig: b"[1, 2, 3]",
    "non_utf8": lambda orig: b'{"a": "\xff\xfe"}',
    "digits_5000": lambda orig: b"1" * 5000,
    "digits_5000_in_object": lambda orig: orig.rstrip().rstrip(b"}") + b', "ckpt_mutation": ' + b"7" * 5000 + b"}",
    "deep_list": lambda orig: _deep(100_000, "[", "]"),
    "deep_object": lambda orig: b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "empty": lambda orig: b"",
    "nan": lambda orig: orig.rstrip().rstrip(b"}") + b', "ckpt_mutation": NaN}',
    "duplicate_keys": lambda orig: orig.rstrip().rstrip(b"}") + b', "model_type": "llama"}',
}


@family("broken_json", "config", applies=lambda i: i.kind == "trainer", weight=2)
def m_broken_json(ctx: Ctx) -> str:
    target = ctx.rng.choice(["config.json", "config.json", "trainer_state.json"])
    path = ctx.root / target
    kind = ctx.rng.choice(sorted(BROKEN_JSON))
    path.write_bytes(BROKEN_JSON[kind](path.read_bytes()))
    ctx.touch(path)
    return f"{target}: {kind}"


# ================================================================================================================
# Hostile pickles and zips
# ================================================================================================================


def _payloads(ctx: Ctx) -> dict[str, bytes]:
    s = str(ctx.sentinel)
    cmd = f"touch '{s}'"
    code = f"open({s!r}, 'w').close()"
    call1 = lambda arg: b"(" + arg + b"tR"  # noqa: E731  MARK arg TUPLE REDUCE
    proto = b"\x80\x02"
    legacy_evil = pickle.dumps(_Sentinel(s), protocol=2)
    return {
        "os.system": proto + op_global("os", "system") + call1(op_str(cmd)) + b".",
        "posix.system": proto + op_global("posix", "system") + call1(op_str(cmd)) + b".",
        "builtins.exec": proto + op_global("builtins", "exec") + call1(op_str(code)) + b".",
        "builtins.eval": proto
        + op_global("builtins", "eval")
        + call1(op_str(f"__import__('os').system({cmd!r})"))
        + b".",
        "__builtin__.eval": proto + op_global("__builtin__", "eval") + call1(op_str(f"exec({code!r})")) + b".",
        "subprocess.call": proto + op_global("subprocess", "call") + b"((" + op_str("touch") + op_str(s) + b"ltR.",
        "stack_global_exec": b"\x80\x04" + op_str("builtins") + op_str("exec") + b"\x93" + call1(op_str(code)) + b".",
        "inst_exec": b"(" + op_str(code) + b"ibuiltins\nexec\n.",
        "obj_exec": b"(" + op_global("builtins", "exec") + op_str(code) + b"o.",
        "getattr_chain": proto
        + op_global("builtins", "getattr")
        + b"("
        + op_global("builtins", "__import__")
        + call1(op_str("os"))
        + op_str("system")
        + b"tR"
        + call1(op_str(cmd))
        + b".",
        "nested_in_dict": proto
        + b"}"
        + op_str("optimizer_state_dict")
        + op_global("posix", "system")
        + call1(op_str(cmd))
        + b"s.",
        "pickle_loads": proto + op_global("pickle", "loads") + b"(C" + bytes([len(legacy_evil)]) + legacy_evil + b"tR."
        if len(legacy_evil) < 256
        else b"",
        "torch_load_from_bytes": proto
        + op_global("torch.storage", "_load_from_bytes")
        + b"(B"
        + struct.pack("<I", len(legacy_evil))
        + legacy_evil
        + b"tR.",
        "shutil.rmtree": proto + op_global("shutil", "rmtree") + call1(op_str(str(ctx.decoy))) + b".",
        "importlib": proto + op_global("importlib", "import_module") + call1(op_str("antigravity")) + b".",
        "arbitrary_module": proto + op_global("ckpttools.cli", "main") + b")R.",
        "torch.load": proto + op_global("torch", "load") + call1(op_str(str(ctx.decoy / "x.pt"))) + b".",
        "numpy_reconstruct": proto + op_global("numpy.core.multiarray", "_reconstruct") + b")R.",
        "copyreg_reconstructor": proto
        + op_global("copyreg", "_reconstructor")
        + b"("
        + op_global("os", "system")
        + op_global("builtins", "object")
        + b"NtR.",
        "ext_registry": proto + b"\x82\x01.",  # EXT1 code 1
        "persid_text": b"Pfoo\n.",
    }


class _Sentinel:
    """Pickles as a call creating the sentinel file (used inside other payloads)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch '{self.path}'",))


@family("hostile_pickle", "hostile", weight=3)
def m_hostile(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    payloads = {k: v for k, v in _payloads(ctx).items() if v}
    kind = ctx.rng.choice(sorted(payloads))
    name, _ = pickle_entry(path)
    rezip(path, replace={name: payloads[kind]})
    return f"{ctx.rel(path)}: data.pkl replaced by {kind}"


@family("hostile_nested", "hostile")
def m_hostile_nested(ctx: Ctx) -> str:
    """The real pickle with one value replaced by an object whose reduce runs os.system (saved by torch.save)."""
    path = ctx.pick_rank_file()

    def fn(obj: dict) -> str:
        paths = [p for p, _ in walk(obj, depth=4, skip=set())]
        p = ctx.rng.choice(paths)
        set_at(obj, p, _Sentinel(str(ctx.sentinel)))
        return fmt_path(p)

    return f"{ctx.rel(path)}: {edit(path, fn)} -> os.system reduce"


def _rebuild_recursion(depth: int) -> bytes:
    f = op_global("torch._tensor", "_rebuild_from_type_v2") + b"q\x00" + op_global("torch", "Tensor") + b"q\x01"
    body = b")"
    for _ in range(depth):
        body = b"(h\x00h\x01" + body + b"}t"  # (F, T, inner_args, {})
    return f + b"0" + b"0" + b"h\x00" + body + b"R"


def _dag(levels: int) -> bytes:
    ops = b"]" + b"r" + struct.pack("<I", 0) + b"0"
    for i in range(1, levels + 1):
        get = b"j" + struct.pack("<I", i - 1)
        ops += b"](" + get + get + b"er" + struct.pack("<I", i) + b"0"
    return ops + b"j" + struct.pack("<I", levels)


@family("pickle_abuse", "hostile", weight=2)
def m_pickle_abuse(ctx: Ctx) -> str:
    """Valid pickles built only from allowlisted names, abused: deep nesting, recursion, shared-reference bombs."""
    path = ctx.pick_rank_file()
    name, pkl = pickle_entry(path)
    key = ctx.rng.choice(["ckpt_mutation", "optimizer_state_dict", "module", "param_shapes", "ds_config",
                          "dp_world_size"])  # fmt: skip
    values = {
        "deep_list": b"]" * 100_000 + b"a" * 99_999,
        "deep_dict": (b"}" + op_str("a")) * 50_000 + b"]" + b"s" * 50_000,
        "rebuild_recursion": _rebuild_recursion(5000),
        "dag_2^40": _dag(40),
        "ordered_dict_bad_args": op_global("collections", "OrderedDict") + b"(K\x01K\x02tR",
        "set_unhashable": op_global("builtins", "set") + b"((]ltR",
        "size_of_strings": op_global("torch", "Size") + b"((" + op_str("a") + b"ltR",
        "codecs_bad": op_global("_codecs", "encode") + b"(K\x05" + op_str("latin1") + b"tR",
        "complex_huge": op_global("builtins", "complex") + b"(" + op_str("1" * 100_000 + "j") + b"tR",
        "slice_obj": op_global("builtins", "slice") + b"(K\x01K\x02K\x03tR",
        "big_long": b"\x8b" + struct.pack("<I", 1 << 20) + b"\x01" * (1 << 20),  # LONG4, a 1 MiB integer
        "stub_with_state": op_global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
        + b")\x81}"
        + op_str("__class__")
        + op_str("x")
        + b"sb",
        "enum_bad": op_global("deepspeed.runtime.zero.config", "ZeroStageEnum") + b"(K\x09tR",
    }
    kind = ctx.rng.choice(sorted(values))
    if key not in load_obj(path):  # a new top-level key: carrying it along (as client_state is) is not wrong
        ctx.extra_keys.add(key)
    rezip(path, replace={name: inject_top(pkl, key, values[kind])})
    return f"{ctx.rel(path)}: [{key!r}] = {kind}"


@family("persistent_id_abuse", "hostile")
def m_persid(ctx: Ctx) -> str:
    """A storage's persistent id (the tuple before BINPERSID) naming a missing record, another record, a path."""
    path = ctx.pick_rank_file()
    name, pkl = pickle_entry(path)
    ops = list(pickletools.genops(pkl))
    keys: list[tuple[Any, Any]] = []  # (position, storage key) pairs from genops
    for i, (op, _, _) in enumerate(ops):
        if op.name != "BINPERSID":
            continue
        j = i - 1
        while j >= 0 and ops[j][0].name != "MARK":
            j -= 1
        keys += [(pos, arg) for o, arg, pos in ops[j:i] if o.name == "BINUNICODE" and str(arg).isdigit()]
    if not keys:
        raise NotApplicable("no storages")
    kind = ctx.rng.choice(["missing_key", "other_key", "path_key", "huge_key"])
    pos, arg = ctx.rng.choice(keys)
    new = {"missing_key": "999", "other_key": str((int(arg) + 1) % max(len(keys), 2)), "path_key": "../../etc/passwd",
           "huge_key": "9" * 40}[kind]  # fmt: skip
    old_op = op_str(arg)
    if pkl[pos : pos + len(old_op)] != old_op:
        raise NotApplicable("unexpected encoding")
    rezip(path, replace={name: pkl[:pos] + op_str(new) + pkl[pos + len(old_op) :]})
    return f"{ctx.rel(path)}: storage key {arg!r} -> {new!r} ({kind})"


@family("zip_entry_name", "hostile")
def m_zip_name(ctx: Ctx) -> str:
    """Entry names that are not UTF-8 (with and without the UTF-8 flag), or disagree with the file name."""
    path = ctx.pick_rank_file()
    entries = read_entries(path)
    prefix = path.stem
    kind = ctx.rng.choice(["non_utf8_prefix_flagged", "non_utf8_prefix_cp437", "extra_non_utf8_entry",
                           "duplicate_data_pkl", "second_archive_folder", "backslash_names"])  # fmt: skip
    placeholder = "Q" * len(prefix)
    if kind.startswith("non_utf8_prefix"):
        write_zip(path, [(i.filename.replace(prefix, placeholder, 1), d, zipfile.ZIP_STORED) for i, d in entries])
        raw = bytearray(path.read_bytes())
        bad = (b"\xff\xfe" * len(prefix))[: len(prefix)]
        raw = bytearray(bytes(raw).replace(placeholder.encode(), bad))
        path.write_bytes(bytes(raw))
        if kind.endswith("flagged"):
            _set_utf8_flag(path, bad)
    elif kind == "extra_non_utf8_entry":
        write_zip(path, [(i.filename, d, zipfile.ZIP_STORED) for i, d in entries] + [("ZZZZ", b"x", 0)])
        path.write_bytes(path.read_bytes().replace(b"ZZZZ", b"\xc3\x28\xff\xfe"))
        _set_utf8_flag(path, b"\xc3\x28\xff\xfe")
    elif kind == "duplicate_data_pkl":
        pkl_name, _ = pickle_entry(path)
        write_zip(path, [(i.filename, d, 0) for i, d in entries] + [(pkl_name, b"\x80\x02}.", 0)])
    elif kind == "second_archive_folder":
        write_zip(path, [("other/data.pkl", b"\x80\x02}.", 0)] + [(i.filename, d, 0) for i, d in entries])
    else:
        write_zip(path, [(i.filename.replace("/", "\\"), d, 0) for i, d in entries])
    return f"{ctx.rel(path)}: {kind}"


def _set_utf8_flag(path: Path, target: bytes) -> None:
    """Set general-purpose flag bit 11 (names are UTF-8) on every entry whose raw name contains `target`."""
    data = bytearray(path.read_bytes())
    pos = 0
    while (pos := data.find(b"PK\x03\x04", pos)) >= 0:
        n = struct.unpack_from("<H", data, pos + 26)[0]
        if target in bytes(data[pos + 30 : pos + 30 + n]):
            struct.pack_into("<H", data, pos + 6, struct.unpack_from("<H", data, pos + 6)[0] | 0x800)
        pos += 4
    pos = 0
    while (pos := data.find(b"PK\x01\x02", pos)) >= 0:
        n = struct.unpack_from("<H", data, pos + 28)[0]
        if target in bytes(data[pos + 46 : pos + 46 + n]):
            struct.pack_into("<H", data, pos + 8, struct.unpack_from("<H", data, pos + 8)[0] | 0x800)
        pos += 4
    path.write_bytes(bytes(data))


@family("zip_compression", "hostile")
def m_zip_compression(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    entries = read_entries(path)
    pkl_name = next(i.filename for i, _ in entries if i.filename.endswith("/data.pkl"))
    records = [i.filename for i, _ in entries if "/data/" in i.filename]
    kind = ctx.rng.choice(["pickle_deflated", "pickle_bzip2", "pickle_lzma", "record_deflated", "record_bzip2",
                           "pickle_unknown_method", "record_unknown_method", "pickle_aes_method"])  # fmt: skip
    methods = {"deflated": zipfile.ZIP_DEFLATED, "bzip2": zipfile.ZIP_BZIP2, "lzma": zipfile.ZIP_LZMA}
    target = pkl_name if kind.startswith("pickle") or not records else ctx.rng.choice(records)
    method_name = kind.split("_", 1)[1]
    if method_name in methods:
        rezip(path, methods={target: methods[method_name]})
    else:
        rezip(path)
        method = struct.pack("<H", 99 if "aes" in kind else 77)
        patch_headers(path, target, field_offsets=(8, 10), value=method)
    return f"{ctx.rel(path)}: {target.rsplit('/', 1)[-1]} {method_name}"


@family("zip_bomb_sizes", "hostile")
def m_zip_bomb(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    pkl_name, pkl = pickle_entry(path)
    records = [i.filename for i, _ in read_entries(path) if "/data/" in i.filename]
    kind = ctx.rng.choice(["declared_pickle_size", "declared_record_size", "declared_compressed_size",
                           "deflate_bomb_after_stop", "declared_offset_past_end"])  # fmt: skip
    if kind == "deflate_bomb_after_stop":  # the pickle stops early; 32 MiB of zeros follow, compressed
        rezip(path, replace={pkl_name: pkl + bytes(32 << 20)}, methods={pkl_name: zipfile.ZIP_DEFLATED})
        return f"{ctx.rel(path)}: data.pkl deflate bomb"
    rezip(path)
    target = pkl_name if kind == "declared_pickle_size" or not records else ctx.rng.choice(records)
    huge = struct.pack("<I", ctx.rng.choice([0xFFFFFFF0, 1 << 31, 10**9]))
    if kind == "declared_compressed_size":
        patch_headers(path, target, field_offsets=(18, 20), value=huge)
    elif kind == "declared_offset_past_end":
        data = bytearray(path.read_bytes())
        lay = zip_layout(bytes(data))
        pos = lay.cd_start
        while data[pos : pos + 4] == b"PK\x01\x02":
            n, e, c = struct.unpack_from("<HHH", data, pos + 28)
            if bytes(data[pos + 46 : pos + 46 + n]).decode() == target:
                data[pos + 42 : pos + 46] = huge
            pos += 46 + n + e + c
        path.write_bytes(bytes(data))
    else:
        patch_headers(path, target, field_offsets=(22, 24), value=huge)
    return f"{ctx.rel(path)}: {kind} of {target.rsplit('/', 1)[-1]}"


# ================================================================================================================
# Folders, symlinks, permissions
# ================================================================================================================


@family("tag_is_file", "fs")
def m_tag_is_file(ctx: Ctx) -> str:
    if not ctx.info.optim_files:
        raise NotApplicable("no optimizer files")
    shutil.rmtree(ctx.tag_dir)
    content = ctx.rng.choice([b"", b"global_step2", (ctx.info.src_root / ctx.info.tag / ctx.info.optim_files[0])
                              .read_bytes()])  # fmt: skip
    ctx.tag_dir.write_bytes(content)
    return f"{ctx.info.tag} is a file of {len(content)} bytes"


@family("rank_is_dir", "fs")
def m_rank_is_dir(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    path.unlink()
    path.mkdir()
    if ctx.rng.random() < 0.5:
        (path / "data.pkl").write_bytes(b"\x80\x02}.")
    return f"{ctx.rel(path)} is a folder"


@family("symlink_outside", "fs", weight=2)
def m_symlink_outside(ctx: Ctx) -> str:
    path = ctx.pick_rank_file()
    kind = ctx.rng.choice(["same_bytes", "other_fixture", "dev_null", "dangling", "directory", "tag_dir_same",
                           "etc_file"])  # fmt: skip
    if kind == "tag_dir_same":
        target = ctx.outside / ctx.info.tag
        shutil.move(str(ctx.tag_dir), str(target))
        ctx.tag_dir.symlink_to(target, target_is_directory=True)
        return f"{ctx.info.tag} -> a folder outside the checkpoint (same files)"
    target = ctx.outside / path.name
    if kind == "same_bytes":
        shutil.move(str(path), str(target))
    elif kind == "other_fixture":
        cands = sorted(d / path.name for i in ctx.infos.values() if i.name != ctx.info.name for d in i.tag_dirs
                       if (d / path.name).is_file())  # fmt: skip
        if not cands:
            raise NotApplicable("no other file")
        shutil.copyfile(ctx.rng.choice(cands), target)
        path.unlink()
    elif kind == "dev_null":
        target = Path("/dev/null")
        path.unlink()
    elif kind == "dangling":
        target = ctx.outside / "does-not-exist.pt"
        path.unlink()
    elif kind == "directory":
        target = ctx.outside / "a-folder"
        target.mkdir()
        path.unlink()
    else:
        target = Path("/etc/hostname") if Path("/etc/hostname").is_file() else Path("/etc/passwd")
        path.unlink()
    path.symlink_to(target)
    return f"{ctx.rel(path)} -> {kind} ({target})"


@family("symlink_loop", "fs")
def m_symlink_loop(ctx: Ctx) -> str:
    kind = ctx.rng.choice(["rank_self", "rank_pair", "tag_dir", "latest"] +
                          (["config"] if ctx.info.kind == "trainer" else []))  # fmt: skip
    if kind == "rank_self":
        path = ctx.pick_rank_file()
        path.unlink()
        path.symlink_to(path.name)
    elif kind == "rank_pair":
        path = ctx.pick_rank_file()
        other = path.with_name("loop-partner.pt")
        path.unlink()
        path.symlink_to(other.name)
        other.symlink_to(path.name)
    elif kind == "tag_dir":
        shutil.rmtree(ctx.tag_dir)
        ctx.tag_dir.symlink_to(ctx.info.tag)
    elif kind == "latest":
        (ctx.root / "latest").unlink()
        (ctx.root / "latest").symlink_to("latest")
        ctx.touch(ctx.root / "latest")
    else:
        (ctx.root / "config.json").unlink()
        (ctx.root / "config.json").symlink_to("config.json")
        ctx.touch(ctx.root / "config.json")
    return f"symlink loop: {kind}"


@family("unreadable", "fs", needs_non_root=True)
def m_unreadable(ctx: Ctx) -> str:
    kind = ctx.rng.choice(["rank_file", "tag_dir", "latest"] + (["config"] if ctx.info.kind == "trainer" else []))
    target = {"rank_file": ctx.pick_rank_file, "tag_dir": lambda: ctx.tag_dir,
              "latest": lambda: ctx.root / "latest", "config": lambda: ctx.root / "config.json"}[kind]()  # fmt: skip
    target.chmod(0)
    return f"{ctx.rel(target)} chmod 000"


# ================================================================================================================
# A Trainer output_dir given as PATH: which checkpoint-N is the newest
# ================================================================================================================


@family("trainer_output_dir", "trainer", applies=lambda i: i.kind == "trainer", entry="output_dir")
def m_trainer_dir(ctx: Ctx) -> str:
    out = ctx.root.parent
    kind = ctx.rng.choice(["empty_newer_dir", "newer_file", "huge_step_dir", "ambiguous_step", "negative_name",
                           "newer_dir_without_latest", "unchanged"])  # fmt: skip
    step = int(ctx.root.name.split("-")[1])
    if kind == "empty_newer_dir":
        (out / f"checkpoint-{step + 1}").mkdir()
    elif kind == "newer_file":
        (out / f"checkpoint-{step + 1}").write_text("not a folder")
    elif kind == "huge_step_dir":
        (out / ("checkpoint-" + "9" * 30)).mkdir()
    elif kind == "ambiguous_step":  # checkpoint-0002 beside checkpoint-2: two folders claim the newest step
        older = sorted(p for p in out.iterdir() if p.is_dir() and p != ctx.root)
        if not older:
            raise NotApplicable("one checkpoint")
        shutil.copytree(older[0], out / f"checkpoint-{step:04d}", symlinks=True)
    elif kind == "negative_name":
        (out / "checkpoint--5").mkdir()
    elif kind == "newer_dir_without_latest":
        newer = out / f"checkpoint-{step + 1}"
        shutil.copytree(ctx.root / ctx.info.tag, newer / ctx.info.tag)
    return f"output_dir: {kind}"


# ================================================================================================================
# Case generation
# ================================================================================================================


@dataclass(frozen=True)
class Case:
    family: str
    fixture: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.family}:{self.fixture}:{self.seed}"

    def rng(self) -> random.Random:
        return random.Random(self.id)

    @classmethod
    def parse(cls, text: str) -> tuple[Case, str | None]:
        """`family:fixture:seed` or `family:fixture:seed:command`."""
        parts = text.strip().split(":")
        if len(parts) not in (3, 4) or not parts[2].isdigit():
            raise ValueError(f"not a case id: {text!r} (family:fixture:seed[:command])")
        return cls(parts[0], parts[1], int(parts[2])), (parts[3] if len(parts) == 4 else None)


def generate_cases(infos: list[FixtureInfo], count: int, family_name: str) -> list[Case]:
    """`count * weight` cases of one family, spread over the fixtures it applies to (a per-family shuffled order,
    so a small count still reaches every kind of fixture)."""
    fam = FAMILIES[family_name]
    eligible = sorted(i.name for i in infos if fam.applies(i))
    random.Random(family_name).shuffle(eligible)
    if not eligible:
        return []
    n = count * fam.weight
    return [Case(family_name, eligible[k % len(eligible)], k // len(eligible)) for k in range(n)]


def apply_mutation(case: Case, ctx: Ctx) -> str:
    return FAMILIES[case.family].fn(ctx)


def commands_for(case: Case, info: FixtureInfo) -> list[tuple[str, list[str]]]:
    """(name, extra CLI args) for the commands run on this case, drawn from the case id."""
    rng = random.Random(case.id + ":commands")
    m = info.dp % 4 + 1  # one new DP size per fixture (2, 3, 4, 1 for DP 1-4), another for a third of the cases
    if rng.random() < 0.33:
        m = (info.dp + 1) % 5 + 1
    cmds = [("inspect", ["--json"]), ("consolidate", []), (f"reshard-dp{m}", ["--dp", str(m)])]
    if info.train_dtype in ("bf16", "fp16") and rng.random() < 0.25:
        cmds.insert(2, (f"consolidate-{info.train_dtype}", ["--dtype", info.train_dtype]))
    if rng.random() < 0.35:
        cmds.append(("universal", ["--universal"]))
    return cmds


def command_args(name: str) -> tuple[str, list[str]]:
    """A command name back to (click command, extra args): for case ids given by hand."""
    if name == "inspect":
        return "inspect", ["--json"]
    if name == "consolidate":
        return "consolidate", []
    if name.startswith("consolidate-"):
        return "consolidate", ["--dtype", name.split("-", 1)[1]]
    if name.startswith("reshard-dp"):
        return "reshard", ["--dp", name[len("reshard-dp") :]]
    if name == "universal":
        return "reshard", ["--universal"]
    raise ValueError(f"unknown command {name!r}")


def crc_ok(path: Path) -> bool:
    """True when every entry of the zip at `path` matches its CRC-32 (for sanity checks of the generators)."""
    try:
        for info, data in read_entries(path):
            if zlib.crc32(data) != info.CRC:
                return False
    except (zipfile.BadZipFile, OSError, NotImplementedError):
        return False
    return True

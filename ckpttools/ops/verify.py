"""Check a consolidated folder the way a user's loader will, before anyone relies on it.

Cheap checks read only file headers and config.json: safetensors headers are sound, the index agrees with
the shard files, dtypes agree with config.json, and the keys and shapes are those of the model built from
config.json on the meta device (as `from_pretrained` would build it). With `against=CKPT`, every tensor is
also compared bit for bit with the one reconstructed from the ZeRO shards, one tensor at a time.

A PEFT adapter folder (adapter_config.json) is checked as PEFT will read it: the config, the adapter weights'
headers, PEFT's key layout, and with a base model, the keys and shapes of the PeftModel built on the meta device;
with `against=CKPT` (a PEFT run), every adapter tensor bit for bit against the one `ckpt consolidate` writes from it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError, UsageError
from ckpttools.io import dtypes
from ckpttools.ops import hf, peft

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # in the order PEFT looks for them
# PEFT types whose weights are virtual-token embeddings, not tensors beside the base model's modules
PROMPT_LEARNING = {"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "CPT"}
SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# In the order from_pretrained looks for them: the first present wins.
WEIGHT_NAMES = ("model.safetensors", SAFE_INDEX, "pytorch_model.bin", BIN_INDEX)
SHARD_RE = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")
MAX_HEADER = 100 << 20  # safetensors refuses larger headers

# safetensors dtype code -> (torch dtype name, bits per element)
ST_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8), "U8": ("uint8", 8), "I8": ("int8", 8), "I16": ("int16", 16), "U16": ("uint16", 16),
    "I32": ("int32", 32), "U32": ("uint32", 32), "I64": ("int64", 64), "U64": ("uint64", 64),
    "F16": ("float16", 16), "BF16": ("bfloat16", 16), "F32": ("float32", 32), "F64": ("float64", 64),
    "C64": ("complex64", 64), "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8), "F6_E2M3": ("float6_e2m3fn", 6), "F6_E3M2": ("float6_e3m2fn", 6),
    "F4": ("float4_e2m1fn_x2", 4),
}  # fmt: skip
FLOAT_NAMES = {"float16", "bfloat16", "float32", "float64"} | {
    n for n, _ in ST_DTYPES.values() if n.startswith("float")
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a weight file declares it."""

    name: str
    file: str
    dtype: str  # torch name: "bfloat16", "int64", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_floating(self) -> bool:
        return self.dtype in FLOAT_NAMES


@dataclass
class VerifyReport:
    """What `verify_folder` found. `problems` is empty when the folder is sound."""

    folder: str
    problems: list[str] = field(default_factory=list)
    kind: str = "model"  # "model", or "adapter" for a PEFT adapter folder
    files: list[str] = field(default_factory=list)  # the weight files from_pretrained (or PEFT) reads
    num_tensors: int = 0
    num_parameters: int = 0  # elements of every tensor stored, a tie the model makes counted once
    total_size: int = 0  # tensor bytes
    dtype: str | None = None  # floating dtype of the weights (float32, bfloat16, ...); "mixed (a, b)" when several
    architecture: str | None = None
    base_model: str | None = None  # an adapter's base model (adapter_config.json, or --base)
    checks: list[str] = field(default_factory=list)  # what was checked, in words
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    against: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


# --- weight files ----------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> tuple[list[TensorInfo], dict[str, Any] | None, list[str]]:
    """Parse and check one safetensors header without reading tensor data: (tensors, metadata, problems)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return [], None, [f"{path.name}: {size} bytes, too short to be a safetensors file"]
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            why = (
                f"{path.name}: header length {n} does not fit in the file ({size} bytes); truncated or not safetensors"
            )
            return [], None, [why]
        raw = fh.read(n)
    dupes: list[str] = []

    def no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        dupes.extend(k for k, c in Counter(k for k, _ in pairs).items() if c > 1)
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_dupes)
    except (UnicodeDecodeError, ValueError) as e:
        return [], None, [f"{path.name}: the header is not valid JSON ({e})"]
    if not isinstance(header, dict):
        return [], None, [f"{path.name}: the header is not a JSON object"]
    problems = [f"{path.name}: key {k} appears twice in the header" for k in dupes]
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (not isinstance(metadata, dict) or metadata.get("format") not in ("pt", "mlx")):
        fmt = metadata.get("format") if isinstance(metadata, dict) else metadata
        problems.append(
            f"{path.name}: metadata format is {fmt!r}, not 'pt'; transformers v4 and huggingface_hub refuse to load it"
        )
    tensors, spans = [], []
    for name, entry in header.items():
        info, span, problem = _header_entry(path.name, name, entry)
        if problem:
            problems.append(problem)
        if info:
            tensors.append(info)
            spans.append((span[0], span[1], name))
    problems += _check_spans(path.name, sorted(spans), size - 8 - n)
    return tensors, metadata, problems


def _header_entry(fname: str, name: str, entry: Any) -> tuple[TensorInfo | None, tuple[int, int], str | None]:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return None, (0, 0), f"{fname}: {name} lacks dtype, shape or data_offsets"
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in ST_DTYPES:
        return None, (0, 0), f"{fname}: {name} has unknown dtype code {code!r}"
    ints = isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)
    pair = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)
    if not ints or not pair:
        return None, (0, 0), f"{fname}: {name} has a malformed shape {shape!r} or data_offsets {offsets!r}"
    torch_name, bits = ST_DTYPES[code]
    info = TensorInfo(name, fname, torch_name, tuple(shape))
    begin, end = offsets
    nbytes = (info.numel * bits + 7) // 8
    if end - begin != nbytes:
        return info, (begin, end), f"{fname}: {name} spans {end - begin} bytes, but {code} {shape} needs {nbytes}"
    return info, (begin, end), None


def _check_spans(fname: str, spans: list[tuple[int, int, str]], data_size: int) -> list[str]:
    """Data offsets must tile the data buffer exactly: from 0, no gaps or overlaps, to the end of the file."""
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a {begin - pos}-byte gap before it"
            return [f"{fname}: {name} starts at byte {begin}, which {what}"]
        pos = end
    if pos != data_size:
        return [f"{fname}: tensors cover {pos} data bytes, but the file holds {data_size}; truncated or padded"]
    return []


def _read_bin(path: Path) -> tuple[list[TensorInfo], list[str]]:
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to load is the problem to report
        return [], [f"{path.name}: torch.load fails ({type(e).__name__}: {e})"]
    if not isinstance(state, dict):
        return [], [f"{path.name} does not hold a state dict"]
    infos = [
        TensorInfo(k, path.name, str(v.dtype).removeprefix("torch."), tuple(v.shape))
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    ]
    return infos, []


def _safe_name(name: Any) -> bool:
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    posix, win = PurePosixPath(name), PureWindowsPath(name)
    return not (posix.is_absolute() or win.drive or win.root or ".." in posix.parts)


def _read_index(folder: Path, index_name: str, report: VerifyReport) -> dict[str, str]:
    """The index's weight_map, after checking its shape (an empty map when unusable)."""
    try:
        index = json.loads((folder / index_name).read_text())
    except (OSError, ValueError) as e:
        report.problems.append(f"{index_name} is not valid JSON ({e})")
        return {}
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        report.problems.append(f"{index_name} has no weight_map object")
        return {}
    if not isinstance(index.get("metadata"), dict):
        report.problems.append(
            f"{index_name} has no \"metadata\" object; transformers 5 fails with KeyError: 'metadata'"
        )
    weight_map = index["weight_map"]
    bad = sorted({f for f in weight_map.values() if not _safe_name(f)}, key=str)
    if bad:
        report.problems.append(f"{index_name} points outside the folder: {hf.names(map(str, bad))}")
    return {k: f for k, f in weight_map.items() if _safe_name(f)}


def collect_tensors(folder: Path, report: VerifyReport) -> dict[str, TensorInfo]:
    """Every tensor from_pretrained would read, by name, with problems of the files and index recorded."""
    present = [n for n in WEIGHT_NAMES if (folder / n).is_file()]
    if not present:
        report.problems.append(f"no weight file: none of {', '.join(WEIGHT_NAMES)} is in {folder}")
        return {}
    chosen = present[0]
    if chosen == "model.safetensors" and SAFE_INDEX in present:
        report.problems.append(
            f"model.safetensors and {SAFE_INDEX} are both here: from_pretrained loads model.safetensors and "
            "ignores the shards the index lists; remove the stale one"
        )
    if chosen.endswith(".index.json"):
        weight_map = _read_index(folder, chosen, report)
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = {}, [chosen]
    shard_kind = ".safetensors" if chosen.startswith("model.") else ".bin"
    stray = sorted(
        p.name
        for p in folder.iterdir()
        if SHARD_RE.match(p.name) and p.name.endswith(shard_kind) and p.name not in files
    )
    if stray:
        report.problems.append(
            f"stray shard files that {chosen} does not use (left from another save?): {hf.names(stray)}"
        )
    by_file = _read_files(folder, files, report)
    report.files = [f for f in files if f in by_file]
    return _merge(by_file, weight_map, chosen, report)


def _read_files(folder: Path, files: list[str], report: VerifyReport) -> dict[str, list[TensorInfo]]:
    by_file: dict[str, list[TensorInfo]] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            report.problems.append(f"{name} is listed in the index but missing")
            continue
        if name.endswith(".safetensors"):
            infos, _, problems = read_safetensors_header(path)
        else:
            infos, problems = _read_bin(path)
        report.problems += problems
        by_file[name] = infos
    return by_file


def _merge(
    by_file: dict[str, list[TensorInfo]], weight_map: dict[str, str], index: str, report: VerifyReport
) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    twice: list[str] = []
    for infos in by_file.values():
        for info in infos:
            if info.name in tensors:
                twice.append(f"{info.name} ({tensors[info.name].file}, {info.file})")
            tensors.setdefault(info.name, info)
    if twice:
        report.problems.append(f"tensors stored in more than one file: {hf.names(twice)}")
    if weight_map:
        unlisted = [f"{t.name} ({t.file})" for t in tensors.values() if t.name not in weight_map]
        if unlisted:
            report.problems.append(f"{index} does not list tensors its shards hold: {hf.names(unlisted)}")
        wrong = [
            f"{k} -> {f}" for k, f in weight_map.items() if f in by_file and (k not in tensors or tensors[k].file != f)
        ]
        if wrong:
            report.problems.append(f"{index} maps keys to files that do not hold them: {hf.names(wrong)}")
    return tensors


# --- the model ----------------------------------------------------------------------------------------


def _check_keys(model: hf.MetaModel, tensors: dict[str, TensorInfo], report: VerifyReport) -> dict[str, str]:
    """Missing, unexpected and shape-mismatched keys; returns file key -> model key for the keys that load."""
    keys = hf.compare_keys(model, {k: t.shape for k, t in tensors.items()})
    report.problems += keys.messages(model.architecture)
    return keys.loaded


def _check_placeholders(tensors: dict[str, TensorInfo], report: VerifyReport) -> None:
    empty = [f"{t.name} {list(t.shape)}" for t in tensors.values() if t.numel == 0]
    if empty:
        report.problems.append(f"empty (0-element) tensors, placeholders rather than weights: {hf.names(empty)}")


def _check_dtype(config: dict[str, Any], tensors: list[TensorInfo], keep_fp32: list[str], report: VerifyReport) -> None:
    declared = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(declared, str) or declared == "auto":
        report.notes.append("config.json declares no dtype: from_pretrained takes the first floating tensor's")
        return
    declared = declared.removeprefix("torch.")
    if declared not in FLOAT_NAMES:
        report.problems.append(f"config.json dtype {declared!r} is not a floating dtype torch knows")
        return
    off = [
        t for t in tensors
        if t.is_floating and t.dtype != declared and not (t.dtype == "float32" and any(m in t.name for m in keep_fp32))
    ]  # fmt: skip
    if off:
        kinds = ", ".join(sorted({t.dtype for t in off}))
        report.problems.append(
            f"config.json says dtype {declared}, but {len(off)} floating tensors are {kinds} "
            f"({hf.names(t.name for t in off)}); "
            f"from_pretrained would silently load them as {declared}"
        )
    report.checks.append(
        f"floating weights match config.json dtype {declared}" if not off else "dtype against config.json"
    )


def _summarise(
    tensors: dict[str, TensorInfo], params: list[TensorInfo], report: VerifyReport, duplicates: Iterable[str] = ()
) -> None:
    """Counts and dtype. num_parameters: elements of every stored tensor (buffers too, as consolidate counts what
    it writes), less the stored copies of weights the model ties (`duplicates`: a tie is one parameter)."""
    skip = set(duplicates)
    report.num_tensors = len(tensors)
    report.num_parameters = sum(t.numel for t in tensors.values() if t.name not in skip)
    report.total_size = sum((t.numel * _bits(t.dtype) + 7) // 8 for t in tensors.values())
    floats = sorted({t.dtype for t in params if t.is_floating})
    report.dtype = floats[0] if len(floats) == 1 else (f"mixed ({', '.join(floats)})" if floats else None)


def _bits(torch_name: str) -> int:
    for name, bits in ST_DTYPES.values():
        if name == torch_name:
            return bits
    return 8 * dtypes.BY_NAME[torch_name].itemsize if torch_name in dtypes.BY_NAME else 8


# --- against the checkpoint ---------------------------------------------------------------------------


def _bit_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads included, which torch.equal would call unequal)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype.is_floating_point or a.dtype == torch.bool:
        return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))
    return torch.equal(flat_a, flat_b)


def check_against(
    folder: Path,
    tensors: dict[str, TensorInfo],
    against: Path | str,
    report: VerifyReport,
    *,
    tag: str | None = None,
    step: int | None = None,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    adapter: bool = False,
) -> None:
    """Compare every tensor with the one rebuilt from the ZeRO shards, one at a time (bounded memory).

    `adapter`: `tensors` are a PEFT adapter folder's (a sub-folder's keys prefixed `name/`), compared with the
    adapter tensors `ckpt consolidate` writes from the run (PEFT's saved names). `on_start(total bytes)` and
    `on_progress(bytes)` after each tensor, for a progress bar.
    """
    from ckpttools.io import integrity
    from ckpttools.io.safetensors_writer import read_tensor
    from ckpttools.io.torchfile import RecordReader
    from ckpttools.layouts.crosscheck import check_module_copies
    from ckpttools.layouts.registry import open_checkpoint
    from ckpttools.ops.consolidate import check_integrity, plan_tensors

    ckpt = open_checkpoint(against, tag=tag, step=step)
    if integrity_note := check_integrity(ckpt):  # a checkpoint changed since its save vouches for nothing
        (report.notes if integrity.skipped() else report.checks).append(integrity_note)
    ckpt = _mapped(ckpt, folder)  # a trainer's own names (Megatron, torchtitan) mapped as consolidate maps them
    report.against = f"{ckpt.location.root} (tag {ckpt.location.tag})"
    floats = Counter(t.dtype for t in tensors.values() if t.is_floating)
    dtype = dtypes.BY_NAME.get(floats.most_common(1)[0][0], dtypes.FLOAT32) if floats else dtypes.FLOAT32
    if adapter:
        found = _adapter_plan(ckpt, dtype)
        if found is None:
            report.problems.append(f"{ckpt.location.root} is not a PEFT (LoRA) run: it holds no adapter tensors to "
                                   "compare the adapter folder with")  # fmt: skip
            return
        plan = found
    else:
        plan = {t.name: t for t in plan_tensors(ckpt, dtype, hf_folder=False)[0]}
    absent = [
        n for n in plan if n not in tensors and not (n in ckpt.shared_params and ckpt.shared_params[n] in tensors)
    ]
    extra = [n for n in tensors if n not in plan]
    differing, wrong_dtype, nonfinite = [], [], []
    with RecordReader() as reader:
        try:
            check_module_copies(ckpt, full=True)  # a mixed-up checkpoint cannot vouch for anything
        except CorruptCheckpointError as e:
            report.problems.append(f"the checkpoint itself is inconsistent: {e}")
            return
        if on_start:
            on_start(sum((t.numel * _bits(t.dtype) + 7) // 8 for k, t in tensors.items() if k in plan))
        by_file: dict[Path, dict[str, str]] = {}  # file -> its key -> the key in `plan` (`tensors`')
        for key, t in tensors.items():
            if key in plan:  # an adapter sub-folder's keys are `name/` + the file's key
                by_file.setdefault(folder / (key[: len(key) - len(t.name)] + t.file), {})[t.name] = key
        for path, keys in by_file.items():
            for file_key, ours in _iter_file_tensors(path, list(keys)):
                name = keys[file_key]
                out = plan[name]
                if str(ours.dtype).removeprefix("torch.") != out.dtype.name:
                    wrong_dtype.append(f"{name} is {str(ours.dtype).removeprefix('torch.')}, expected {out.dtype.name}")
                elif tuple(ours.shape) != out.shape or not _bit_equal(ours, read_tensor(out.source, reader, out.dtype)):
                    differing.append(name)
                if ours.is_floating_point() and not bool(ours.isfinite().all()):  # issue 34: never silently
                    nonfinite.append(f"{name} ({int(ours.isnan().sum())} NaN, {int(ours.isinf().sum())} Inf)")
                if on_progress:
                    on_progress(ours.numel() * ours.element_size())
        try:
            reader.finish()
        except CorruptCheckpointError as e:
            report.problems.append(f"the checkpoint itself is damaged: {e}")
    where = f"the checkpoint {ckpt.location.root}"
    for label, items in (
        (f"tensors that differ from {where}", differing),
        (f"tensors in a dtype the {dtype.name} consolidation of {where} does not give", wrong_dtype),
        (f"tensors of {where} missing from the folder", absent),
        (f"tensors not in {where}", extra),
        ("tensors holding NaN or Inf", nonfinite),
    ):
        if items:
            report.problems.append(f"{label}: {hf.names(items)}")
    if not (differing or wrong_dtype or absent or extra):
        report.checks.append(f"all {len(tensors)} tensors bit-identical to {where} (tag {ckpt.location.tag})")


def _mapped(ckpt: Any, folder: Path) -> Any:
    """The checkpoint under the Hugging Face names an architecture adapter gives it with the folder's config.json
    (`ckpt consolidate`'s mapping); as it is when no adapter claims it."""
    from ckpttools import adapters

    mapped = adapters.adapt(ckpt, hf.read_config(folder / "config.json"))
    return ckpt if mapped is None else mapped.checkpoint


def _adapter_plan(ckpt: Any, dtype: dtypes.DType) -> dict[str, Any] | None:
    """The adapter tensors `ckpt consolidate` writes from a PEFT run, keyed as `_verify_adapters` keys a folder's
    (`name/` before a sub-folder adapter's); None when the checkpoint is not a PEFT run."""
    if not peft.is_peft(ckpt):
        return None
    run = peft.read_peft_run(ckpt)
    if not run.adapters:
        return None
    return {(f"{a.folder}/" if a.folder else "") + t.name: t for a in run.adapters
            for t in peft.adapter_tensors(ckpt, a, dtype)}  # fmt: skip


def _iter_file_tensors(path: Path, names: list[str]) -> Iterable[tuple[str, Any]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)
    else:
        import torch

        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for name in names:
            yield name, state[name]


# --- PEFT adapter folders ---------------------------------------------------------------------------------


def _verify_adapters(folder: Path, base: Path | str | None, report: VerifyReport) -> dict[str, TensorInfo]:
    """The adapter at the top of `folder` and those PEFT saves in sub-folders named after them."""
    report.kind = "adapter"
    every: dict[str, TensorInfo] = {}
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / ADAPTER_CONFIG).is_file())
    for where in [folder, *subs]:
        prefix = "" if where == folder else f"{where.name}/"
        config = _adapter_config(where / ADAPTER_CONFIG, prefix, report)
        tensors = _adapter_tensors(where, prefix, report)
        if config is None or not tensors:
            continue
        if where == folder:
            named = config.get("base_model_name_or_path")
            report.base_model = str(base) if base is not None else (named if isinstance(named, str) and named else None)
        _check_peft_layout(config, tensors, prefix, report)
        if base is not None:
            _check_against_base(Path(base) if Path(base).exists() else str(base), where, tensors, prefix, report)
        every.update({prefix + k: v for k, v in tensors.items()})
    if report.files:
        report.checks.insert(0, f"adapter_config.json and the headers of {len(report.files)} adapter weight file(s)")
    return every


def _adapter_config(path: Path, prefix: str, report: VerifyReport) -> dict[str, Any] | None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        report.problems.append(f"{prefix}{ADAPTER_CONFIG} is not valid JSON ({e})")
        return None
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        report.problems.append(f"{prefix}{ADAPTER_CONFIG} is not a PEFT config: no peft_type in a JSON object")
        return None
    return config


def _adapter_tensors(folder: Path, prefix: str, report: VerifyReport) -> dict[str, TensorInfo]:
    name = next((n for n in ADAPTER_WEIGHTS if (folder / n).is_file()), None)
    if name is None:
        report.problems.append(f"{prefix or 'the folder'}: no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
        return {}
    if name.endswith(".safetensors"):
        infos, _, problems = read_safetensors_header(folder / name)
    else:
        infos, problems = _read_bin(folder / name)
    report.problems += [prefix + p for p in problems]
    report.files.append(prefix + name)
    if not infos and not problems:
        report.problems.append(f"{prefix}{name} holds no tensors")
    return {t.name: t for t in infos}


def _check_peft_layout(
    config: dict[str, Any], tensors: dict[str, TensorInfo], prefix: str, report: VerifyReport
) -> None:
    """The names PEFT's save_pretrained writes: `base_model.model.<module>.lora_A.weight`, adapter name removed."""
    where = f"{prefix}{next(n for n in ADAPTER_WEIGHTS if n.endswith(tensors[next(iter(tensors))].file))}"
    peft_type = config["peft_type"]
    if peft_type in PROMPT_LEARNING:
        if "prompt_embeddings" not in tensors:
            report.problems.append(f"{where}: a {peft_type} adapter without prompt_embeddings")
        return
    outside = [k for k in tensors if not k.startswith("base_model.model.")]
    if outside:
        report.problems.append(
            f"{where}: keys outside PEFT's layout (base_model.model.<module>...): {hf.names(outside)}; "
            "PEFT would not load them"
        )
    named = [k for k in tensors if _keeps_adapter_name(k)]
    if named:
        report.problems.append(
            f"{where}: keys still carry an adapter name ({hf.names(named)}); PEFT's saved names leave it out, "
            "so PEFT would not load them (save with save_pretrained, or `ckpt consolidate`)"
        )
    if peft_type == "LORA" and not any(".lora_" in k for k in tensors):
        report.problems.append(f"{where}: a LORA adapter without any lora_A / lora_B tensor")
    _check_placeholders(tensors, report)
    report.checks.append(f"PEFT key layout ({peft_type})" + (f" in {prefix}" if prefix else ""))


def _keeps_adapter_name(key: str) -> bool:
    """`...lora_A.default.weight` (a live state_dict key) rather than `...lora_A.weight` (what PEFT saves)."""
    parts = key.split(".")
    return any(p.startswith("lora_") and i + 2 <= len(parts) - 1 for i, p in enumerate(parts)) or any(
        p.startswith("lora_embedding_") and i + 1 == len(parts) - 1 for i, p in enumerate(parts)
    )


def _check_against_base(
    base: Path | str, folder: Path, tensors: dict[str, TensorInfo], prefix: str, report: VerifyReport
) -> None:
    """Build the base model on the meta device, wrap it in a PeftModel with this adapter's config, and compare
    the keys and shapes PEFT would save (and so load) with the file's."""
    expected = peft.peft_model_keys(base, folder)
    if isinstance(expected, str):
        report.notes.append(f"{prefix}adapter not checked against the base model: {expected}")
        return
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    wrong = [
        f"{k} {list(t.shape)} (the model has {list(expected[k])})"
        for k, t in tensors.items()
        if k in expected and tuple(t.shape) != expected[k]
    ]
    for label, items in (("missing", missing), ("not in the PeftModel", unexpected), ("of the wrong shape", wrong)):
        if items:
            report.problems.append(f"{prefix}adapter keys {label} (built on {base}): {hf.names(items)}")
    if not (missing or unexpected or wrong):
        where = f" ({prefix})" if prefix else ""
        report.checks.append(f"adapter keys and shapes{where} against a PeftModel of {base} on the meta device")


# --- entry point ---------------------------------------------------------------------------------------


def _refuse_training_checkpoint(folder: Path) -> None:
    """A training checkpoint (DeepSpeed, FSDP2/DCP) without a weight file is not what verify checks: say what to run."""
    if any((folder / n).is_file() for n in WEIGHT_NAMES):
        return
    from ckpttools.layouts.registry import checkpoint_root

    try:
        checkpoint_root(folder)
    except CkptError:
        return  # not a checkpoint either: the missing weight file is the problem reported
    raise UsageError(
        f"{folder} is a training checkpoint, not a model folder: verify checks what consolidate writes; run "
        f"`ckpt consolidate {folder} --out DIR`, then `ckpt verify DIR --against {folder}`"
    )


def verify_folder(
    folder: Path | str,
    *,
    against: Path | str | None = None,
    tag: str | None = None,
    step: int | None = None,
    base: Path | str | None = None,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    check_finite: bool = True,
) -> VerifyReport:
    """Check a consolidated folder as from_pretrained will read it.

    Args:
        folder: the folder holding model.safetensors (or shards and their index) and config.json.
        against: a ZeRO checkpoint; every tensor must then be bit-identical to the one rebuilt from its shards (for
            an adapter folder: to the run's adapter tensors; a checkpoint that is not a PEFT run is a problem).
        tag, step: which tag / checkpoint-N of `against` to read (default: `latest` / the newest).
        base: for a PEFT adapter folder, the base model (folder or Hub id): the PeftModel is built on the meta
            device and its keys and shapes compared with the adapter's. Given for a model folder: UsageError.
        on_start, on_progress: with `against`, called with the bytes to compare, then with each tensor's bytes.
        check_finite: without `against`, read every weight once (streamed) and report NaN or Inf as a problem (with
            `against` the comparison finds them in the tensors it loads); False for a caller with its own check
            (push, whose --allow-nonfinite may publish them).

    Returns:
        A VerifyReport; `report.ok` is True when nothing is wrong. Problems are reported, not raised;
        only an unreadable `against` checkpoint raises (a CkptError).

    Example:
        >>> report = verify_folder("out/model", against="out/checkpoint-500")
        >>> report.ok, report.problems
        (True, [])
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder} is not a folder")
    report = VerifyReport(folder=str(folder))
    if (folder / ADAPTER_CONFIG).is_file():
        tensors = _verify_adapters(folder, base, report)
        _summarise(tensors, list(tensors.values()), report)
        if against is not None and tensors:
            check_against(folder, tensors, against, report, tag=tag, step=step, on_start=on_start,
                          on_progress=on_progress, adapter=True)  # fmt: skip
        return report
    if base is not None:  # an option asked for that cannot apply is refused, never skipped with a note
        raise UsageError(f"--base is the base model of a PEFT adapter folder, and {folder} has no "
                         "adapter_config.json; drop --base")  # fmt: skip
    _refuse_training_checkpoint(folder)
    tensors = collect_tensors(folder, report)
    if report.files:
        indexed = any((folder / n).is_file() for n in (SAFE_INDEX, BIN_INDEX))
        report.checks.append(f"headers of {len(report.files)} weight file(s)" + (" and their index" if indexed else ""))
    config = hf.read_config(folder / "config.json") if (folder / "config.json").is_file() else None
    params = list(tensors.values())
    duplicates: list[str] = []
    keep_fp32: list[str] = []
    if config is None:
        report.notes.append("no readable config.json: keys and dtype not checked against a model")
        _check_placeholders(tensors, report)
    elif tensors:
        model = hf.build_meta_model(folder)
        if isinstance(model, str):
            report.notes.append(f"keys not checked against the model: {model}")
            _check_placeholders(tensors, report)
        else:
            report.architecture, keep_fp32 = model.architecture, model.keep_fp32
            loaded = _check_keys(model, tensors, report)
            present = set(loaded.values())
            duplicates = [k for k, target in loaded.items() if target in model.tied and model.tied[target] in present]
            params = [tensors[k] for k, target in loaded.items() if target in model.parameters and k not in duplicates]
            report.checks.append(f"keys and shapes against {model.architecture} built on the meta device")
    if config is not None and tensors:
        _check_dtype(config, params, keep_fp32, report)
    _summarise(tensors, params, report, duplicates)
    if against is not None and tensors:
        check_against(folder, tensors, against, report, tag=tag, step=step, on_start=on_start, on_progress=on_progress)
    elif check_finite and tensors and report.files and report.ok:  # a broken file is reported already, not read
        _check_finite(folder, report)
    return report


def _check_finite(folder: Path, report: VerifyReport) -> None:
    """NaN or Inf in any weight is a problem: a model holding them is never called sound (streamed, memory
    O(chunk); the one full read verify makes without --against)."""
    from ckpttools.ops.reduce import nonfinite_in

    found = nonfinite_in(folder)
    report.checks.append("every weight finite (no NaN or Inf)")
    if found.found:
        report.problems.append(f"weights hold NaN or Inf: {found.describe()}")

"""Reductions over a checkpoint's tensors, streamed: the one loop `ckpt diff`, `ckpt stats` and the non-finite check
share.

Whatever `ckpt` reads (DeepSpeed, universal, DCP folders, a Hugging Face folder or one weights file, local or
remote) becomes a `Side`: named `OutputTensor`s, the very ones `consolidate` writes, so a reduction sees the values
a consolidation would write. `stream` walks them chunk by chunk (`safetensors_writer.stream_chunks`: a reader
thread ahead, memory O(chunk)) and hands each chunk to the reducers: `Moments` (statistics), `Comparison` (diff),
`values.NonFiniteCounter`. Values are reduced in float64 with numpy; torch is never needed.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttools.errors import CheckpointNotFoundError, CkptError, UnsupportedCheckpointError
from ckpttools.io import dtypes, values
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import CHUNK_BYTES, OutputTensor, output_dtype, stream_chunks
from ckpttools.io.segments import Segment
from ckpttools.io.source import location_name
from ckpttools.io.threads import Workers
from ckpttools.io.torchfile import LazyTensor, RecordReader, lazy_tensors, load_pickle
from ckpttools.io.values import NonFinite, NonFiniteCounter
from ckpttools.model.checkpoint import Checkpoint, TensorSource

BLOCK = 1 << 16  # elements reduced per numpy pass: the float64 temporaries of one block stay in the cache
SAFE_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
# The weight files of a folder, in the order from_pretrained (then PEFT) looks for them: the first present wins.
WEIGHT_FILES = ("model.safetensors", SAFE_INDEX, "pytorch_model.bin", BIN_INDEX, "adapter_model.safetensors",
                "adapter_model.bin")  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


# --------------------------------------------------------------------------------------------------
# What a reduction reads: a Side
# --------------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One thing to reduce: its output tensors by name, in model order.

    `checkpoint` is the training checkpoint it was read from, under its own names (None for a weights folder or
    file: its optimizer states are under the names the trainer gave its parameters); `aliases` the
    tied names it stores once (alias -> owner); `dtype` the dtype its weights were taken in (a training
    checkpoint's fp32 masters or 16-bit weights), None for weight files, which are taken as stored.
    """

    path: str
    kind: str  # "checkpoint" (a training checkpoint) or "weights" (a Hugging Face folder, a weights file)
    tensors: list[OutputTensor]
    aliases: dict[str, str] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    dtype: DType | None = None
    description: str = ""
    notes: list[str] = field(default_factory=list)

    def by_name(self) -> dict[str, OutputTensor]:
        return {t.name: t for t in self.tensors}

    def floating_dtype(self) -> DType | None:
        """The most common floating dtype among its tensors (by elements), if any."""
        counts: dict[DType, int] = {}
        for t in self.tensors:
            if t.dtype.is_floating_point:
                counts[t.dtype] = counts.get(t.dtype, 0) + t.source.numel()
        return max(counts, key=lambda d: counts[d]) if counts else None


def open_side(path: Path | str, *, dtype: DType | None = None, tag: str | None = None, step: int | None = None,
              best: bool = False) -> Side:  # fmt: skip
    """A training checkpoint (any layout `ckpt` reads), a Hugging Face folder, or one weights file.

    `dtype`: which weights of a training checkpoint (FLOAT32: the fp32 masters, as `consolidate --dtype fp32`
    writes; BFLOAT16/FLOAT16: the 16-bit weights it writes); default FLOAT32.
    """
    path = Path(path)
    if path.is_file():
        return _weights_side(path, [path])
    if not path.exists():
        raise CheckpointNotFoundError(f"{location_name(path)} does not exist")
    files = weight_files(path)
    if files and not _is_training_checkpoint(path):
        return _weights_side(path, files)
    # a training checkpoint, also one a Trainer saved 16-bit weights beside: its own problems are the answer
    return checkpoint_side(_open_checkpoint(path, tag=tag, step=step, best=best), dtype or dtypes.FLOAT32)


def _is_training_checkpoint(path: Path) -> bool:
    """Whether `path` is (or holds) a training checkpoint by its file names alone, as `open_checkpoint` finds one:
    a folder format (universal, DCP, ...) or a DeepSpeed save_dir, tag folder, Trainer or Lightning folder."""
    from ckpttools.layouts import locate
    from ckpttools.layouts.registry import folder_format_of

    try:
        return folder_format_of(path) is not None or any(
            find(path, None, False) is not None for find in locate.LOCATORS
        )
    except CkptError:  # recognised, with a problem that opening it names
        return True


def preload() -> None:
    """Import what `open_side` imports on first use, on this thread: two sides opened on two threads would otherwise
    import the layouts' modules at once, and their import cycles then show a thread a half-imported module."""
    import ckpttools.adapters
    import ckpttools.layouts.crosscheck
    import ckpttools.layouts.dcp.chunks
    import ckpttools.layouts.dcp.hf_shards
    import ckpttools.layouts.dcp.optim
    import ckpttools.layouts.locate
    import ckpttools.layouts.registry
    import ckpttools.ops.consolidate
    import ckpttools.ops.hf  # noqa: F401 - imported for the side effect of being imported


def _open_checkpoint(path: Path, **select: Any) -> Checkpoint:
    from ckpttools.layouts.crosscheck import check_module_copies
    from ckpttools.layouts.registry import open_checkpoint

    ckpt = open_checkpoint(path, **select)
    check_module_copies(ckpt)  # a mixed-up checkpoint is refused before any value is believed
    return ckpt


def _adapted(ckpt: Checkpoint) -> tuple[Checkpoint, list[str]]:
    """Under Hugging Face's names when an architecture adapter claims it (Megatron-Core, ...), as `consolidate`
    writes it; the config comes from the checkpoint's config.json or the run's arguments."""
    from ckpttools import adapters
    from ckpttools.ops import hf

    config_path = ckpt.location.root / "config.json"
    try:
        mapped = adapters.adapt(ckpt, hf.read_config(config_path) if config_path.is_file() else None)
    except adapters.ConfigNeededError as e:  # the values are there all the same: under the trainer's names
        return ckpt, [f"names as the trainer saved them: {e}"]
    if mapped is None:
        return ckpt, []
    return mapped.checkpoint, [f"names mapped {mapped.adapter}, as consolidate writes them"]


def checkpoint_side(ckpt: Checkpoint, dtype: DType) -> Side:
    """The tensors `consolidate --dtype <dtype>` writes for a bare folder: every tied alias under its own name (it
    stands for its owner's values), listed in `aliases`."""
    from ckpttools.ops.consolidate import plan_tensors, source_summary

    summary = source_summary(ckpt)
    named, notes = _adapted(ckpt)
    tensors, _ = plan_tensors(named, dtype, hf_folder=False, config={})
    description = f"{summary['checkpoint_kind']} checkpoint, tag {ckpt.location.tag}"
    return Side(location_name(ckpt.location.root), "checkpoint", tensors, dict(named.shared_params), ckpt, dtype,
                description, notes)  # fmt: skip


def weight_files(folder: Path) -> list[Path]:
    """The weight files from_pretrained would read in `folder` (the index's shards), or PEFT's adapter weights."""
    import json

    for name in WEIGHT_FILES:
        if not (folder / name).is_file():
            continue
        if not name.endswith(".index.json"):
            return [folder / name]
        try:
            weight_map = json.loads((folder / name).read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise CkptError(f"{folder / name} is not a readable index ({e}); restore it") from e
        if not isinstance(weight_map, dict):
            raise CkptError(f"{folder / name} has no weight_map; restore the index")
        shards = sorted(set(map(str, weight_map.values())))
        bad = [s for s in shards if "/" in s or "\\" in s or s.startswith(".") or not (folder / s).is_file()]
        if bad:
            raise CheckpointNotFoundError(f"{folder / name} names shard {bad[0]!r}, which is not a file in {folder}")
        return [folder / s for s in shards]
    return []


def _weights_side(path: Path, files: list[Path]) -> Side:
    tensors: list[OutputTensor] = []
    for file in files:
        if file.suffix == ".safetensors":
            found = _safetensors_tensors(file)
        elif file.suffix in WEIGHT_SUFFIXES:
            found = _torch_file_tensors(file)
        else:
            raise UnsupportedCheckpointError(
                f"{location_name(file)}: not a weights file ckpt reads (.safetensors, or a torch.save state dict)"
            )
        tensors += [OutputTensor(s.name, s, s.dtype) for s in found]
    # no model order is stored (safetensors headers are sorted by name): layers.10 after layers.9
    tensors.sort(key=lambda t: natural_key(t.name))
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise CkptError(f"{location_name(path)}: tensor {twice[0]} is stored in more than one file")
    aliases = _tied_by_config(path if path.is_dir() else path.parent, names)
    what = "weights file" if path.is_file() else f"weights folder ({', '.join(f.name for f in files[:3])}" + (
        ", ...)" if len(files) > 3 else ")")  # fmt: skip
    return Side(location_name(path), "weights", tensors, aliases, description=what)


# Input embeddings, as transformers' models name them: the owner of an output embedding tied to it.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
               "tok_embeddings.weight", "shared.weight", "embeddings.weight")  # fmt: skip


def _tied_by_config(folder: Path, names: list[str]) -> dict[str, str]:
    """`lm_head.weight` -> the input embedding, for a folder whose config.json ties word embeddings (the default)
    and which stores no lm_head.weight: save_pretrained stores a tie once, from_pretrained re-ties it."""
    from ckpttools.ops import hf

    config = hf.read_config(folder / "config.json") if (folder / "config.json").is_file() else None
    if not config or config.get("tie_word_embeddings", True) is False or "lm_head.weight" in names:
        return {}
    owner = next((n for n in names if n.endswith(_EMBEDDINGS)), None)
    return {"lm_head.weight": owner} if owner else {}


def _safetensors_tensors(file: Path) -> list[TensorSource]:
    """A safetensors file's tensors as segments of its bytes: only its JSON header is parsed. Names as stored."""
    from ckpttools.layouts.dcp.hf_shards import _entry, read_header

    _, entries, data_start, size = read_header(file)
    out = []
    for key, entry in entries.items():
        dtype, shape, begin, end = _entry(file, key, entry)
        if data_start + end > size:
            raise CkptError(f"{location_name(file)} is truncated: {key!r} runs past its end; re-copy it")
        out.append(_whole(key, shape, dtype, file, f"{key}@{begin}", data_start + begin, end - begin))
    return out


def _whole(name: str, shape: tuple[int, ...], dtype: DType, file: Path, record: str, offset: int, nbytes: int
           ) -> TensorSource:  # fmt: skip
    from ckpttools.io.torchfile import Record, StorageRef
    from ckpttools.layouts.dcp.chunks import contiguous_strides

    rec = Record(file, record, offset, nbytes, None)
    tensor = LazyTensor(StorageRef(rec, dtype), 0, shape, tuple(contiguous_strides(shape)))
    return TensorSource(name, shape, dtype, (Segment(tensor, 0, tensor.numel()),), "trainable")


def _torch_file_tensors(file: Path) -> list[TensorSource]:
    """A torch.save state dict's tensors (read through the pickle allowlist, never whole)."""
    state = load_pickle(file, check_identity=False)
    if not isinstance(state, dict):
        raise UnsupportedCheckpointError(f"{location_name(file)} does not hold a state dict")
    out = []
    for key, tensor in state.items():
        if not isinstance(tensor, LazyTensor):
            if lazy_tensors(tensor):
                raise UnsupportedCheckpointError(
                    f"{location_name(file)}: entry {key!r} nests tensors; it is a training checkpoint's file, not "
                    "a state dict: give its folder"
                )
            continue
        if not tensor.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{location_name(file)}: tensor {key!r} is a strided view of another tensor's storage, which ckpt does "
                "not read; save the state dict with contiguous tensors (t.contiguous()), as save_pretrained does"
            )
        out.append(TensorSource(str(key), tensor.shape, tensor.dtype, (Segment(tensor, 0, tensor.numel()),),
                                "trainable"))  # fmt: skip
    return out


def state_tensors(ckpt: Checkpoint) -> list[tuple[str, OutputTensor]]:
    """Every optimizer state of a training checkpoint as (state key, tensor named after its parameter), in the
    parameters' order: Adam's exp_avg / exp_avg_sq, Muon's momentum_buffer, Adagrad's sum, ... (a step counter is
    no tensor of the model's shape and is left out)."""
    found = [(key, OutputTensor(p.name, src, src.dtype)) for p in ckpt.params for key, src in p.states.items()
             if src.dtype.numpy is not None]  # fmt: skip
    if not found and ckpt.optimizer.read_states is not None:  # a source that reads its states on demand
        found = [(key, OutputTensor(param, src, src.dtype)) for param, key, src in ckpt.optimizer.read_states()
                 if src.dtype.numpy is not None]  # fmt: skip
    return found


def cast_to(side: Side, dtype: DType) -> Side:
    """A weights side's floating tensors as `dtype` (cast as consolidate casts: round to nearest even)."""
    tensors = [OutputTensor(t.name, t.source, output_dtype(t.source, dtype)) for t in side.tensors]
    return Side(side.path, side.kind, tensors, side.aliases, side.checkpoint, dtype, side.description, side.notes)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """Elements [start, start + len) of tensor `index` of a stream, as stored in its output dtype (`raw`)."""

    index: int
    start: int
    raw: np.ndarray


def stream(tensors: Sequence[OutputTensor], reader: RecordReader, *, chunk_bytes: int = CHUNK_BYTES,
           workers: Workers | None = None) -> Iterator[Piece]:  # fmt: skip
    """The tensors' values chunk by chunk, in order; a piece is valid until the next one is asked for. Casts and
    CRC-32 checks run on `workers`' threads when given."""
    pos: dict[int, int] = {}
    for index, chunk in stream_chunks(tensors, reader, chunk_bytes=chunk_bytes, workers=workers):
        arr = values.raw(chunk, tensors[index].dtype)
        start = pos.get(index, 0)
        pos[index] = start + len(arr)
        yield Piece(index, start, arr)


def reduce_tensors(
    tensors: Sequence[OutputTensor],
    reader: RecordReader,
    each: Callable[[int, int, np.ndarray], None],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: Workers | None = None,
) -> None:
    """Call `each(tensor index, element offset, raw values)` for every chunk of every tensor, in order."""
    for piece in stream(tensors, reader, chunk_bytes=chunk_bytes, workers=workers):
        each(piece.index, piece.start, piece.raw)


def nonfinite(tensors: Sequence[OutputTensor], reader: RecordReader | None = None) -> NonFiniteCounter:
    """NaN / +Inf / -Inf per tensor over a stream of the tensors' values (their output dtype): the check verify
    fails on and push refuses without --allow-nonfinite. Reads each byte once; memory O(chunk)."""
    counter = NonFiniteCounter()
    with _reader(reader) as r:
        reduce_tensors(tensors, r, lambda i, _, raw: counter.add(tensors[i].name, tensors[i].dtype, raw))
        r.finish()
    return counter


def nonfinite_in(path: Path | str, *, dtype: DType | None = None) -> NonFiniteCounter:
    """NaN / +Inf / -Inf per tensor of anything `open_side` reads: a folder before `push` publishes it, a training
    checkpoint's weights (`dtype`: which, as in `open_side`). Streamed, each byte read once.

    Example:
        >>> found = nonfinite_in("out/model")
        >>> bool(found.found), found.describe()
        (True, 'lm_head.weight (3 NaN)')
    """
    return nonfinite(open_side(path, dtype=dtype).tensors)


class _reader:
    """The caller's reader (left open), or a new one closed at the end."""

    def __init__(self, reader: RecordReader | None) -> None:
        self.given, self.reader = reader is not None, reader or RecordReader()

    def __enter__(self) -> RecordReader:
        return self.reader

    def __exit__(self, *exc: object) -> None:
        if not self.given:
            self.reader.close()


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------


@dataclass
class Moments:
    """Statistics of a tensor's values, NaN-aware: NaN and ±Inf are counted apart; min, max, mean, RMS and L2 norm
    are those of the finite elements, computed in float64 (torch's on `t.double()[t.isfinite()]`)."""

    count: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    minimum: float = math.inf
    maximum: float = -math.inf
    total: float = 0.0  # sum of the finite elements
    squares: float = 0.0  # sum of their squares

    @property
    def finite(self) -> int:
        return self.count - self.nan - self.posinf - self.neginf

    def add(self, raw: np.ndarray, dtype: DType, workers: Workers | None = None) -> None:
        """Take in a chunk of `raw` values (see `values.raw`), split over `workers`' threads when given."""
        if dtype.numpy is None or not (dtype.is_floating_point or raw.dtype.kind in "biu"):
            return
        spans = _spans(len(raw), workers)
        if len(spans) == 1:
            self._serial(raw, dtype)
            return
        parts = [Moments() for _ in spans]
        assert workers is not None
        workers.run([functools.partial(p._serial, raw[a:b], dtype) for p, (a, b) in zip(parts, spans, strict=True)])
        for p in parts:
            self.merge(p)

    def _serial(self, raw: np.ndarray, dtype: DType) -> None:
        for a in range(0, len(raw), BLOCK):
            self._block(raw[a : a + BLOCK], dtype)

    def _block(self, raw: np.ndarray, dtype: DType) -> None:
        self.count += len(raw)
        x = values.numbers(raw, dtype)
        x64 = x.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf: NaN, which says "look closer" below
            total, squares = float(x64.sum()), _sumsq(x64)
        if dtype.is_floating_point and not (math.isfinite(total) and math.isfinite(squares)):
            # a NaN or Inf is in the block (float32 values cannot overflow a float64 sum): count them, leave them out
            bad = values.count_nonfinite(raw, dtype)
            self.nan, self.posinf, self.neginf = self.nan + bad.nan, self.posinf + bad.posinf, self.neginf + bad.neginf
            x = x[np.isfinite(x)]
            x64 = x.astype(np.float64)
            total, squares = float(x64.sum()), _sumsq(x64)
        if not len(x):
            return
        self.minimum = min(self.minimum, float(x.min()))
        self.maximum = max(self.maximum, float(x.max()))
        self.total += total
        self.squares += squares

    def merge(self, other: Moments) -> None:
        self.count += other.count
        self.nan, self.posinf, self.neginf = (
            self.nan + other.nan,
            self.posinf + other.posinf,
            self.neginf + other.neginf,
        )
        self.minimum, self.maximum = min(self.minimum, other.minimum), max(self.maximum, other.maximum)
        self.total += other.total
        self.squares += other.squares

    @property
    def nonfinite(self) -> NonFinite:
        return NonFinite(self.nan, self.posinf, self.neginf)

    def to_dict(self) -> dict[str, Any]:
        n = self.finite
        return {
            "count": self.count,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "min": self.minimum if n else None,
            "max": self.maximum if n else None,
            "mean": self.total / n if n else None,
            "rms": math.sqrt(self.squares / n) if n else None,
            "l2": math.sqrt(self.squares),
        }


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """How tensor B differs from tensor A, element by element, streamed.

    An element differs when not |a - b| <= atol + rtol * |a| (NaN equals NaN in the same place; an Inf equals the
    same Inf). `identical`: same dtype and every byte equal. `max_abs_diff` and `rel_l2` (||b - a|| / ||a||) are
    over the elements finite on both sides, and infinite when a NaN or Inf meets a number; `first` locates the
    first differing element.
    """

    atol: float = 0.0
    rtol: float = 0.0
    count: int = 0
    identical: bool = True
    differing: int = 0
    max_abs_diff: float = 0.0
    diff_squares: float = 0.0
    a_squares: float = 0.0
    first: int | None = None  # flat index of the first differing element
    first_values: tuple[float, float] | None = None
    unbounded: bool = False  # a NaN or Inf met a number: the distance is infinite

    def add(self, start: int, a_raw: np.ndarray, a_dtype: DType, b_raw: np.ndarray, b_dtype: DType,
            workers: Workers | None = None) -> None:  # fmt: skip
        """Take in elements [start, start + len(a_raw)) of both tensors, split over `workers`' threads if given."""
        spans = _spans(len(a_raw), workers)
        if len(spans) == 1:
            self._serial(start, a_raw, a_dtype, b_raw, b_dtype)
            return
        parts = [Comparison(self.atol, self.rtol) for _ in spans]
        assert workers is not None
        workers.run([functools.partial(p._serial, start + a, a_raw[a:b], a_dtype, b_raw[a:b], b_dtype)
                     for p, (a, b) in zip(parts, spans, strict=True)])  # fmt: skip
        for p in parts:  # in element order: the first part with a difference holds the first one
            self.count += p.count
            self.identical = self.identical and p.identical
            self.differing += p.differing
            self.max_abs_diff = max(self.max_abs_diff, p.max_abs_diff)
            self.unbounded = self.unbounded or p.unbounded
            self.diff_squares += p.diff_squares
            self.a_squares += p.a_squares
            if self.first is None and p.first is not None:
                self.first, self.first_values = p.first, p.first_values

    def _serial(self, start: int, a_raw: np.ndarray, a_dtype: DType, b_raw: np.ndarray, b_dtype: DType) -> None:
        self.count += len(a_raw)
        if a_dtype is b_dtype and np.array_equal(_bits(a_raw), _bits(b_raw)):
            self.a_squares += _squares(a_raw, a_dtype)  # ||a|| for rel_l2, should a later chunk differ
            return
        self.identical = False
        for s in range(0, len(a_raw), BLOCK):
            self._block(start + s, a_raw[s : s + BLOCK], a_dtype, b_raw[s : s + BLOCK], b_dtype)

    def _block(self, start: int, a_raw: np.ndarray, a_dtype: DType, b_raw: np.ndarray, b_dtype: DType) -> None:
        a = values.numbers(a_raw, a_dtype).astype(np.float64)
        b = values.numbers(b_raw, b_dtype).astype(np.float64)
        exact = a_dtype is b_dtype and not a_dtype.is_floating_point
        if exact:  # integers compared as stored: float64 would merge int64 values above 2**53
            equal = a_raw == b_raw
        else:
            with np.errstate(invalid="ignore"):
                equal = (a == b) | (np.isnan(a) & np.isnan(b))
        both = np.isfinite(a) & np.isfinite(b)
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.where(both, np.abs(a - b), 0.0)
            close = equal | (both & (delta <= self.atol + self.rtol * np.abs(a))) if not exact else equal
        fa = np.where(np.isfinite(a), a, 0.0)
        self.a_squares += _sumsq(fa)
        self.diff_squares += _sumsq(delta)
        if len(delta):
            self.max_abs_diff = max(self.max_abs_diff, float(delta.max()))
        off = ~close
        n = int(np.count_nonzero(off))
        if n:
            self.differing += n
            if self.first is None:
                i = int(np.argmax(off))
                self.first, self.first_values = start + i, (float(a[i]), float(b[i]))
            if not both[off].all():  # a NaN or Inf against a number: no finite difference says how far
                self.max_abs_diff = math.inf
                self.unbounded = True

    @property
    def rel_l2(self) -> float:
        if self.unbounded:
            return math.inf
        if self.diff_squares == 0:
            return 0.0
        return math.sqrt(self.diff_squares / self.a_squares) if self.a_squares else math.inf


MIN_SPLIT = 1 << 19  # elements: below this a chunk is reduced on one thread (handing it out costs more)


def _spans(n: int, workers: Workers | None) -> list[tuple[int, int]]:
    """[a, b) element ranges of a chunk, one per thread of `workers`."""
    parts = 1 if workers is None else max(1, min(workers.n, n // MIN_SPLIT))
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _bits(raw: np.ndarray) -> np.ndarray:
    """The elements' bytes as unsigned integers of their size: equal bits, NaN payloads and -0.0 included."""
    size = raw.dtype.itemsize
    return raw.view(f"<u{size}") if size in (1, 2, 4, 8) else raw.view(np.uint8)


def _squares(raw: np.ndarray, dtype: DType) -> float:
    """Sum of the squares of the finite elements, in float64."""
    total = 0.0
    for s in range(0, len(raw), BLOCK):
        x = values.numbers(raw[s : s + BLOCK], dtype).astype(np.float64)
        part = _sumsq(x)
        total += part if math.isfinite(part) else _sumsq(x[np.isfinite(x)])  # a NaN or Inf here: leave them out
    return total


def _sumsq(x: np.ndarray) -> float:
    """sum(x * x) in one pass without BLAS: np.dot's threads spin against each other on a busy machine."""
    return float(np.einsum("i,i->", x, x))


class _Cursor:
    """Walks one stream of pieces, handing out runs of elements of the tensor asked for."""

    def __init__(self, pieces: Iterator[Piece]) -> None:
        self.pieces, self.pos = pieces, 0
        self.piece: Piece | None = None

    def available(self, index: int) -> np.ndarray:
        """The current piece's elements from the cursor on (tensor `index`), fetching the next piece if spent."""
        while self.piece is None or self.pos >= len(self.piece.raw):
            self.piece, self.pos = next(self.pieces, None), 0
            if self.piece is None:
                raise CkptError("a stream ended early (a tensor's bytes ran short); this is a bug, please report it")
        if self.piece.index != index:
            raise CkptError(f"streams out of step (tensor {self.piece.index}, expected {index}); please report it")
        return self.piece.raw[self.pos :]

    def take(self, n: int) -> None:
        self.pos += n


def compare_streams(a: Sequence[OutputTensor], b: Sequence[OutputTensor], reader_a: RecordReader,
                    reader_b: RecordReader, comparisons: Sequence[Comparison], *, chunk_bytes: int = CHUNK_BYTES,
                    on_progress: Callable[[int], None] | None = None, workers: Workers | None = None
                    ) -> None:  # fmt: skip
    """Compare a[i] with b[i] (same number of elements) into comparisons[i], both streamed at once: two reader
    threads, so two remote sources are fetched in parallel, each byte read once. `on_progress(bytes of both)`
    after each run compared."""
    ca = _Cursor(stream(a, reader_a, chunk_bytes=chunk_bytes, workers=workers))
    cb = _Cursor(stream(b, reader_b, chunk_bytes=chunk_bytes, workers=workers))
    for i, (ta, tb) in enumerate(zip(a, b, strict=True)):
        done, total = 0, ta.source.numel()
        while done < total:
            xa, xb = ca.available(i), cb.available(i)
            n = min(len(xa), len(xb), total - done)
            comparisons[i].add(done, xa[:n], ta.dtype, xb[:n], tb.dtype, workers)
            ca.take(n)
            cb.take(n)
            done += n
            if on_progress:
                on_progress(n * (ta.dtype.itemsize + tb.dtype.itemsize))


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------

_NUMBERED = re.compile(r"^(.*?\.\d+)\.")  # `model.layers.3.` , `transformer.h.11.`: the first numbered module


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: the path up to its first numbered module (`model.layers.3`), else the
    module holding it (`model.embed_tokens`, `lm_head`), else the name itself."""
    m = _NUMBERED.match(name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0] or name


def natural_key(text: str) -> list[Any]:
    """`layers.10` after `layers.9`: numbers compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]

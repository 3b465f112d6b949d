"""ZeRO checkpoint -> a folder `from_pretrained` loads: safetensors (or .bin) shards, index, config.

Output goes to a temporary sibling folder that is renamed into place only when complete and verified;
inputs are never touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ckpttools import extras
from ckpttools.errors import CkptError, UsageError, short
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import (
    OutputTensor,
    ProgressFn,
    output_dtype,
    read_tensor,
    reused_buffers,
    write_pt,
    write_safetensors,
)
from ckpttools.io.staging import check_output_dir, shared_staged_folder, staged_folder
from ckpttools.io.torchfile import Record, RecordReader
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import checkpoint_root, open_checkpoint
from ckpttools.model.checkpoint import TensorSource, ZeroCheckpoint
from ckpttools.ops import hf, peft
from ckpttools.ranks import nodelocal
from ckpttools.ranks.distributed import check_records

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import ProcessGroup

DTYPES = dtypes.SHORT


class _HasSize(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


_Sized = TypeVar("_Sized", bound=_HasSize)
FORMATS = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}
SPACE_MARGIN = 64 << 20


@dataclass
class ConsolidateResult:
    output_dir: str
    files: list[str]
    dtype: str  # as passed (fp32 / bf16 / fp16); to_dict spells it float32 / bfloat16 / float16
    format: str
    num_parameters: int  # elements of every tensor written (a tied alias left out of an HF folder is not)
    num_tensors: int
    total_size: int
    source: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    world_size: int | None = None  # set by a run on many ranks, with the rank that wrote each file
    ranks: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dtype"] = DTYPES[self.dtype].name if self.dtype in DTYPES else self.dtype  # float32, as torch spells it
        return d if self.world_size is not None else {k: v for k, v in d.items() if k not in ("world_size", "ranks")}


def default_output_dir(ckpt: ZeroCheckpoint) -> Path:
    """`hf-<checkpoint>` beside the checkpoint (a name Trainer's checkpoint rotation never matches)."""
    root = ckpt.location.root
    return root.parent / f"hf-{root.name}"


def plan_tensors(
    ckpt: ZeroCheckpoint, dtype: DType, *, hf_folder: bool, config: dict[str, Any] | None = None
) -> tuple[list[OutputTensor], dict[str, str]]:
    """Output tensors in model order, and the tied aliases left out.

    In a Hugging Face folder whose config ties word embeddings, a tied alias (lm_head.weight -> wte.weight)
    is stored once, under its owner, as save_pretrained does; from_pretrained re-ties it. Bare checkpoints
    (and configs with tie_word_embeddings false) keep every alias as its own tensor, so
    `load_state_dict(strict=True)` works.
    """
    if config is None:
        config = hf.read_config(ckpt.location.root / "config.json") or {}
    hf_folder = hf_folder and config.get("tie_word_embeddings", True) is not False
    tensors = [OutputTensor(s.name, s, output_dtype(s, dtype)) for s in ckpt.sources(dtype)]
    by_name = {t.name: t for t in tensors}
    omitted: dict[str, str] = {}
    for alias, owner in ckpt.shared_params.items():
        if owner not in by_name:
            continue
        if hf_folder:
            omitted[alias] = owner
        else:
            src = by_name[owner].source
            aliased = TensorSource(alias, src.shape, src.dtype, src.segments, src.kind)
            tensors.append(OutputTensor(alias, aliased, by_name[owner].dtype))
    return tensors, omitted


def plan_shards(tensors: Sequence[_Sized], fmt: str, max_shard_size: int | str) -> dict[str, list[_Sized]]:
    """Output files and their tensors, by huggingface_hub's planner (the shard names save_pretrained uses)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    stem, ext = FORMATS[fmt]
    split = split_state_dict_into_shards_factory(
        {t.name: t for t in tensors},
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=stem + "{suffix}" + ext,
        max_shard_size=max_shard_size,
    )
    by_name = {t.name: t for t in tensors}
    return {fname: [by_name[n] for n in names] for fname, names in split.filename_to_tensors.items()}


def _require_libraries(*, to: str, check_keys: bool, merge: bool) -> None:
    """The optional libraries the options need, checked before any work (see ckpttools.extras)."""
    needed = [*(["torch", "transformers"] if check_keys else []), *(["torch"] if to == "pt" else []),
              *(["torch", "safetensors"] if merge else [])]  # fmt: skip
    extras.require(*dict.fromkeys(needed))


class _KeyCheck:
    """Builds the model on the meta device in a child process while the shards are written."""

    def __init__(self, folder: Path | None, tensors: list[OutputTensor]) -> None:
        self.proc = hf.start_key_check(folder, {t.name: t.shape for t in tensors}) if folder else None

    def cancel(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def problems(self, ckpt: ZeroCheckpoint, omitted: dict[str, str], notes: list[str]) -> None:
        if self.proc is None:
            return
        result = hf.finish_key_check(self.proc)
        if isinstance(result, str):
            notes.append(f"keys not checked against the model: {result}")
            return
        arch, keys = result
        keys.missing = [f"{k} (tied during training, but {arch} does not tie it on load)" if k in omitted else k
                        for k in keys.missing]  # fmt: skip
        if ckpt.frozen_excluded and keys.missing:
            notes.append(f"{len(keys.missing)} base-model weights are absent (saved without frozen params)")
        problems = keys.messages(arch, ignore_missing=ckpt.frozen_excluded)
        if problems:
            raise CkptError(
                f"the consolidated keys do not match {arch} from config.json: {'; '.join(problems)}. "
                "Is config.json from the same model?"
            )


def consolidate(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    to: str = "safetensors",
    dtype: str = "fp32",
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
    check_existing: bool = True,
    check_keys: bool = False,
    config: Path | str | None = None,
    merge: bool = False,
    base: Path | str | None = None,
    on_progress: ProgressFn | None = None,
    on_start: Any = None,
    group: ProcessGroup | None = None,
) -> ConsolidateResult:
    """Consolidate a ZeRO checkpoint into a Hugging Face-loadable folder.

    Args:
        path: checkpoint folder (see `read_checkpoint`).
        out_dir: output folder; defaults to `hf-<checkpoint name>` beside the checkpoint.
        to: "safetensors" or "pt".
        dtype: "fp32" (bit-identical to zero_to_fp32) or "bf16"/"fp16" (bit-identical to the engine's
            16-bit weights when that is the training dtype).
        max_shard_size: largest shard, e.g. "5GB".
        overwrite: replace an existing output folder.
        check_existing: compare with 16-bit weights a Trainer already saved beside the shards.
        config: the model's config.json, or a folder holding it (tokenizer files come from there too), for
            checkpoints saved without one (accelerate's save_state); default: the one beside the checkpoint.
        check_keys: also build the model from config.json on the meta device (in a child process that
            imports transformers and torch: about 3 s and 350 MB more) and fail on missing or unexpected
            keys. `ckpt verify` always does this check.
        merge: a PEFT (LoRA) run: write the full model with the adapters merged into the base weights,
            bit-identical to PEFT's merge_and_unload() in that dtype on CPU. Without it, a PEFT run gives the
            adapter folder PEFT's save_pretrained writes.
        base: the base model's folder (save_pretrained's, sharded safetensors included) for a merge: its weights
            and config.json; needed when the run was saved without its frozen base weights.
        on_progress: called with the number of bytes written after each chunk.
        on_start: called once with the total bytes to write (on many ranks: this rank's share).
        group: the ranks of a launcher (`ckpttools.ranks.distributed.join_group`) sharing the work: each writes the
            shards `plan_by_bytes` gives it into one staged folder on a filesystem all of them see, rank 0 the
            index, config and companion files; the folder appears only when every rank succeeded, byte-identical
            to a one-process run, and every rank returns rank 0's result.

    Example:
        >>> consolidate("out/checkpoint-500", "out/model", dtype="bf16").files
        ['model.safetensors', 'config.json', ...]
    """
    if to not in FORMATS:
        raise UsageError(f"--to must be one of {', '.join(FORMATS)}, not {to!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if (merge or base is not None) and to != "safetensors":
        raise UsageError("--merge writes safetensors only (what from_pretrained loads); drop --to pt")
    if base is not None and not merge:
        raise UsageError("--base is the base model of a --merge; pass --merge too")
    _require_libraries(to=to, check_keys=check_keys, merge=merge)
    if group is not None and group.world_size > 1:
        holdings = nodelocal.exchange_holdings(group, Path(path))
        if not nodelocal.is_shared(holdings):
            options = {"to": to, "dtype": dtype, "max_shard_size": max_shard_size, "tag": tag, "step": step,
                       "best": best, "overwrite": overwrite, "check_existing": check_existing,
                       "check_keys": check_keys, "config": config, "merge": merge, "base": base,
                       "on_progress": on_progress, "on_start": on_start}  # fmt: skip
            return _gathered(group, Path(path), holdings, out_dir, options)
        return _RanksJob(group, path, out_dir, to, dtype, max_shard_size, tag, step, best, overwrite,
                         check_existing, check_keys, config, merge, base, on_progress, on_start).run()  # fmt: skip
    ckpt = open_checkpoint(path, tag=tag, step=step, best=best)
    out = check_output_dir(Path(out_dir) if out_dir else default_output_dir(ckpt), ckpt.location.root, overwrite)
    out_dtype = DTYPES[dtype]
    if merge or peft.is_peft(ckpt):
        job = _PeftJob(ckpt, out, out_dtype, overwrite, max_shard_size, on_progress, on_start)
        return job.merge(base, config) if merge else job.adapters(to)
    plan = _plan_output(ckpt, out_dtype, to, max_shard_size, config)
    shards, total = plan.shards, plan.total
    keycheck = plan.key_check(check_keys)
    try:
        with RecordReader() as reader:
            check_module_copies(ckpt)  # before anything is written
            with staged_folder(out, overwrite=overwrite, needed_bytes=total, notes=plan.notes) as tmp:
                if on_start:
                    on_start(total)
                files = _write_shards(tmp, shards, to, reader, on_progress)
                files += plan.finish_folder(tmp, keycheck, reader, check_existing)
                reader.finish()  # CRC-32 of every record read; raises before anything is published
    except BaseException:
        keycheck.cancel()
        raise
    return plan.result(out, files, dtype)


def _gathered(group: ProcessGroup, path: Path, holdings: list[nodelocal.Holdings], out_dir: Path | str | None,
              options: dict[str, Any]) -> ConsolidateResult:  # fmt: skip
    """A node-local checkpoint (each node holds its own ranks' files): rank 0 gathers it and writes the output."""
    select = {k: options[k] for k in ("tag", "step", "best")}

    def out_for(root: Path) -> Path:
        return check_output_dir(Path(out_dir) if out_dir else root.parent / f"hf-{root.name}", root,
                                options["overwrite"])  # fmt: skip

    def on_copy(view: Path, user_path: Callable[[Path], Path]) -> dict[str, Any]:
        out = out_for(user_path(checkpoint_root(view, **select)[0]))  # names only: consolidate reads the rest
        result = consolidate(view, out, **options)
        result.world_size, result.ranks = group.world_size, dict.fromkeys(result.files, 0)
        return result.to_dict()

    steps = nodelocal.GatherSteps(lambda v: checkpoint_root(v, **select), out_for,
                                  lambda v: open_checkpoint(v, **select), on_copy)  # fmt: skip
    done = nodelocal.convert_on_rank0(group, path, holdings, nodelocal.gather_parent(path, out_dir), steps,
                                      optimizer_states=False)  # fmt: skip
    return ConsolidateResult(**done)


@dataclass
class _Output:
    """What a consolidation writes, planned before anything is: tensors, shards, the config and notes."""

    ckpt: ZeroCheckpoint
    dtype: DType
    to: str
    model_config: hf.ModelConfig | None
    tensors: list[OutputTensor]
    omitted: dict[str, str]
    shards: dict[str, list[OutputTensor]]
    total: int
    notes: list[str]

    def key_check(self, check_keys: bool) -> _KeyCheck:
        mc = self.model_config
        return _KeyCheck(mc.folder if mc is not None and mc.standard_name and check_keys else None, self.tensors)

    def finish_folder(self, tmp: Path, keycheck: _KeyCheck, reader: RecordReader, check_existing: bool) -> list[str]:
        """After the shards: the key check's verdict, the index, config and companion files, the comparison with
        the weights a Trainer saved beside the shards."""
        ckpt = self.ckpt
        keycheck.problems(ckpt, self.omitted, self.notes)
        files = _write_hf_files(tmp, ckpt, self.shards, self.tensors, self.to, self.dtype, self.model_config)
        if check_existing and (ckpt.location.root / "config.json").is_file():
            self.notes += compare_with_existing(ckpt, reader, self.dtype)
        return files

    def result(self, out: Path, files: list[str], dtype: str) -> ConsolidateResult:
        return ConsolidateResult(
            output_dir=str(out),
            files=files,
            dtype=dtype,
            format=self.to,
            num_parameters=sum(t.source.numel() for t in self.tensors),  # every element written, as verify counts
            num_tensors=len(self.tensors),
            total_size=self.total,
            source=source_summary(self.ckpt),
            notes=self.notes,
        )


def _plan_output(
    ckpt: ZeroCheckpoint, dtype: DType, to: str, max_shard_size: int | str, config: Path | str | None
) -> _Output:
    model_config = hf.find_config(ckpt.location.root, config)  # read once, refused before writing
    tensors, omitted = plan_tensors(ckpt, dtype, hf_folder=model_config is not None,
                                    config=model_config.config if model_config else {})  # fmt: skip
    shards = plan_shards(tensors, to, max_shard_size)
    notes: list[str] = [] if model_config is not None or not _is_accelerate(ckpt) else [_NO_CONFIG_NOTE]
    if ckpt.frozen_excluded:
        notes.append("this checkpoint holds only trainable (e.g. LoRA) weights: base weights are absent, as saved")
    total = sum(t.nbytes for t in tensors)
    return _Output(ckpt, dtype, to, model_config, tensors, omitted, shards, total, notes)


_NO_CONFIG_NOTE = (
    "an accelerate save_state folder holds no config.json: wrote the weights only; pass --config (the model's "
    "config.json, or the folder save_pretrained wrote it to) for a folder from_pretrained loads"
)


def _is_accelerate(ckpt: ZeroCheckpoint) -> bool:
    """accelerate's save_state: tag `pytorch_model`, RNG states as `random_states_N.pkl` (never loaded)."""
    loc = ckpt.location
    return loc.tag == "pytorch_model" and any(loc.root.glob("random_states_*.pkl"))


def _param_count(tensors: list[OutputTensor], ckpt: ZeroCheckpoint) -> int:
    """Parameters written, each tied weight counted once."""
    return sum(t.source.numel() for t in tensors if t.source.kind != "buffer" and t.name not in ckpt.shared_params)


def source_summary(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    return {
        "path": str(ckpt.location.root),
        "tag": ckpt.location.tag,
        "zero_stage": ckpt.zero_stage,
        "dp_world_size": ckpt.dp_world_size,
        "train_dtype": ckpt.train_dtype.name,
        "ds_version": ckpt.ds_version,
        "global_steps": ckpt.global_steps,
    }


def _write_shards(
    tmp: Path, shards: dict[str, list[OutputTensor]], to: str, reader: RecordReader, on_progress: ProgressFn | None
) -> list[str]:
    with reused_buffers():
        for fname, group in shards.items():
            if to == "safetensors":
                write_safetensors(tmp / fname, group, reader, metadata={"format": "pt"}, on_progress=on_progress)
            else:
                write_pt(tmp / fname, group, reader, on_progress=on_progress)
    return list(shards)


def _write_hf_files(
    tmp: Path,
    ckpt: ZeroCheckpoint,
    shards: dict[str, list[OutputTensor]],
    tensors: list[OutputTensor],
    to: str,
    dtype: DType,
    model_config: hf.ModelConfig | None,
) -> list[str]:
    files = []
    if len(shards) > 1:
        stem, ext = FORMATS[to]
        weight_map = {t.name: fname for fname, group in shards.items() for t in group}
        total = sum(t.nbytes for t in tensors)
        files.append(hf.write_index(tmp, f"{stem}{ext}.index.json", weight_map, total, _param_count(tensors, ckpt)))
    root = ckpt.location.root
    if model_config is not None:
        hf.write_config(model_config.config, tmp / "config.json", dtype)
        files.append("config.json")
        files += hf.copy_side_files(model_config.folder, model_config.side_files, tmp)
    files += hf.copy_side_files(root, [n for n in ckpt.location.side_files if n not in files], tmp)
    return files


def compare_with_existing(ckpt: ZeroCheckpoint, reader: RecordReader, dtype: DType = dtypes.FLOAT32) -> list[str]:
    """Compare the 16-bit weights a Trainer saved beside the shards with what this consolidation writes."""
    files = hf.existing_weight_files(ckpt.location.root)
    if not files:
        return []
    where = ", ".join(p.name for p in files)
    try:
        differing, seen = _differences(ckpt, reader, dtype, files)
    except CkptError:
        raise  # the checkpoint itself is damaged: that fails the consolidation
    except Exception as e:  # noqa: BLE001 - those files are not the input; a broken one only cancels the comparison
        reason = f"{type(e).__name__}: {short(e, 80)}"
        return [f"the weights saved beside the shards ({where}) could not be read ({reason}); not compared"]
    absent = [k for k in ckpt.keys if k not in seen and k not in ckpt.shared_params]
    if differing or absent:
        counts = (
            f"{len(differing)} differing ({', '.join(differing[:3])}), {len(absent)} absent ({', '.join(absent[:3])})"
        )
        return [f"the weights already saved beside the shards ({where}) differ from the shards: {counts}"]
    return [f"the weights already saved beside the shards ({where}) match the shards exactly"]


def _differences(
    ckpt: ZeroCheckpoint, reader: RecordReader, dtype: DType, files: list[Path]
) -> tuple[list[str], set[str]]:
    import torch
    from safetensors import safe_open

    written = {s.name: s for s in ckpt.sources(dtype)}
    differing: list[str] = []
    seen: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                seen.add(key)
                src = written.get(ckpt.shared_params.get(key, key))
                if src is None:
                    differing.append(f"{key} (not in the shards)")
                    continue
                saved = f.get_tensor(key)
                saved_dtype = dtypes.from_torch(saved.dtype)
                ours = read_tensor(src, reader, saved_dtype if saved_dtype.is_floating_point else None)
                if ours.shape != saved.shape or not torch.equal(ours, saved):
                    differing.append(key)
    return differing, seen


@dataclass
class _PeftJob:
    """A PEFT run's outputs: the adapter folder(s) save_pretrained writes, or the merged model."""

    ckpt: ZeroCheckpoint
    out: Path
    dtype: DType
    overwrite: bool
    max_shard_size: int | str
    on_progress: ProgressFn | None
    on_start: Any

    def adapters(self, to: str) -> ConsolidateResult:
        if to != "safetensors":
            raise UsageError(
                "a PEFT run's adapter folder is safetensors only (adapter_model.safetensors); drop --to pt"
            )
        run = peft.read_peft_run(self.ckpt)
        if not run.adapters:
            raise peft.PeftError(f"{self.ckpt.location.root} holds adapter_config.json but no adapter tensors")
        tensors = [t for a in run.adapters for t in peft.adapter_tensors(self.ckpt, a, self.dtype)]
        total = sum(t.nbytes for t in tensors)
        written = ", ".join(a.name for a in run.adapters)
        notes = [f"wrote the adapter folder PEFT's save_pretrained writes for adapter(s) {written}"]
        notes += self._adapter_notes(run)
        with RecordReader() as reader:
            check_module_copies(self.ckpt)
            with staged_folder(self.out, overwrite=self.overwrite, needed_bytes=total, notes=notes) as tmp:
                if self.on_start:
                    self.on_start(total)
                files = []
                for adapter in run.adapters:
                    files += peft.write_adapter_folder(tmp, self.ckpt, adapter, self.dtype, reader, self.on_progress)
                files += self._side_files(tmp, exclude=files)
                reader.finish()
        return self._result(files, tensors, total, notes, sum(t.source.numel() for t in tensors))

    def merge(self, base: Path | str | None, config: Path | str | None) -> ConsolidateResult:
        ckpt = self.ckpt
        run = peft.trained_adapters(peft.read_peft_run(ckpt), ckpt)
        if not run.adapters:
            raise peft.PeftError(f"{ckpt.location.root} holds no trained LoRA adapter tensors: nothing to merge")
        base_dir = peft.find_base(base)
        model_config = hf.find_config(base_dir, config) if base_dir is not None else hf.find_config(
            ckpt.location.root, config)  # fmt: skip
        if model_config is None and base_dir is not None:
            raise peft.PeftError(f"--base {base_dir} holds no config.json; pass the folder the base model's "
                                 "save_pretrained wrote (or --config)")  # fmt: skip
        if model_config is None:
            raise peft.PeftError(f"{ckpt.location.root} holds no config.json of the base model; pass --base with the "
                                 "base model's folder")  # fmt: skip
        base_tensors = peft.base_from_folder(base_dir) if base_dir is not None else peft.base_from_checkpoint(ckpt)
        tied = peft.tied_aliases(base_tensors, model_config.config, ckpt)
        tensors = peft.plan_merge(ckpt, run, base_tensors, self.dtype, tied)
        shards = plan_shards(tensors, "safetensors", self.max_shard_size)
        total = sum(t.nbytes for t in tensors)
        merged = ", ".join(a.name for a in run.adapters)
        source = "--base" if base_dir is not None else "the checkpoint's frozen weights"
        notes = [f"merged adapter(s) {merged} into the base weights from {source}"]
        with RecordReader() as reader:
            check_module_copies(ckpt)
            with staged_folder(self.out, overwrite=self.overwrite, needed_bytes=total, notes=notes) as tmp:
                if self.on_start:
                    self.on_start(total)
                for fname, group in shards.items():
                    peft.write_merged_safetensors(tmp / fname, group, reader, self.on_progress)
                files = list(shards)
                if len(shards) > 1:
                    weight_map = {t.name: f for f, group in shards.items() for t in group}
                    count = sum(math.prod(t.shape) for t in tensors)
                    files.append(hf.write_index(tmp, "model.safetensors.index.json", weight_map, total, count))
                hf.write_config(model_config.config, tmp / "config.json", self.dtype)
                files.append("config.json")
                files += hf.copy_side_files(model_config.folder, model_config.side_files, tmp)
                files += self._side_files(tmp, exclude=files)
                reader.finish()
        return self._result(files, tensors, total, notes, sum(math.prod(t.shape) for t in tensors))

    def _side_files(self, tmp: Path, exclude: list[str]) -> list[str]:
        """The tokenizer and generation config the Trainer left (never adapter_config.json at the top of a merged
        model: from_pretrained would load the folder as an adapter)."""
        names = [n for n in self.ckpt.location.side_files
                 if n not in exclude and n != peft.ADAPTER_CONFIG and not (tmp / n).exists()]  # fmt: skip
        return hf.copy_side_files(self.ckpt.location.root, names, tmp)

    def _adapter_notes(self, run: peft.PeftRun) -> list[str]:
        notes = [
            f"adapter {a.name!r} has no adapter_config.json beside the checkpoint: PEFT cannot load its folder "
            "until the run's config is copied in"
            for a in run.adapters
            if a.config_path is None
        ]
        if run.untracked:
            notes.append(f"{len(run.untracked)} trained tensors belong to no adapter and are not written (PEFT's "
                         f"save_pretrained drops them too): {hf.names(run.untracked, 3)}")  # fmt: skip
        return notes

    def _result(self, files: list[str], tensors: Sequence[Any], total: int, notes: list[str],
                params: int) -> ConsolidateResult:  # fmt: skip
        return ConsolidateResult(
            output_dir=str(self.out), files=files, dtype=_short(self.dtype),
            format="safetensors", num_parameters=params, num_tensors=len(tensors), total_size=total,
            source=source_summary(self.ckpt), notes=notes,
        )  # fmt: skip


def _short(dtype: DType) -> str:
    return next(k for k, v in DTYPES.items() if v is dtype)


@dataclass
class _RanksJob:
    """One consolidation shared by the ranks of a launcher: each writes the shards planned for it (balanced by
    bytes read and written), rank 0 also the index, config and companion files, all into one staged folder."""

    group: ProcessGroup
    path: Path | str
    out_dir: Path | str | None
    to: str
    dtype: str
    max_shard_size: int | str
    tag: str | None
    step: int | None
    best: bool
    overwrite: bool
    check_existing: bool
    check_keys: bool
    config: Path | str | None
    merge: bool
    base: Path | str | None
    on_progress: ProgressFn | None
    on_start: Any

    def run(self) -> ConsolidateResult:
        ckpt, out = self.group.run_agreed(self._open)
        if self.merge or peft.is_peft(ckpt):
            return self._share(self.group.run_agreed(self._peft_on_rank0))
        plan = self.group.run_agreed(lambda: self._plan(ckpt))
        owners = dict(zip(plan.shards, _plan_ranks(plan.shards, self.group.world_size), strict=True))
        mine = {f: group for f, group in plan.shards.items() if owners[f] == self.group.rank}
        keycheck = plan.key_check(self.check_keys and self.group.rank == 0)
        try:
            staging = shared_staged_folder(out, overwrite=self.overwrite, needed_bytes=plan.total, group=self.group,
                                           notes=plan.notes)  # fmt: skip
            with RecordReader(pieces=True) as reader, staging as tmp:

                def write() -> list[str]:
                    if self.on_start:
                        self.on_start(sum(t.nbytes for group in mine.values() for t in group))
                    _write_shards(tmp, mine, self.to, reader, self.on_progress)
                    rank0 = self.group.rank == 0
                    return plan.finish_folder(tmp, keycheck, reader, self.check_existing) if rank0 else []

                extra = self.group.run_agreed(write)
                # CRC-32 of every record read, each checked by one rank from the pieces all of them read
                check_records(self.group, reader, _tensor_records(plan.tensors))
        except BaseException:
            keycheck.cancel()
            raise
        result = plan.result(out, list(plan.shards) + extra, self.dtype)
        result.world_size, result.ranks = self.group.world_size, {**owners, **dict.fromkeys(extra, 0)}
        return self._share(result)

    def _open(self) -> tuple[ZeroCheckpoint, Path]:
        ckpt = open_checkpoint(self.path, tag=self.tag, step=self.step, best=self.best)
        out_dir = Path(self.out_dir) if self.out_dir else default_output_dir(ckpt)
        return ckpt, check_output_dir(out_dir, ckpt.location.root, self.overwrite)

    def _plan(self, ckpt: ZeroCheckpoint) -> _Output:
        plan = _plan_output(ckpt, DTYPES[self.dtype], self.to, self.max_shard_size, self.config)
        if self.group.rank == 0:
            check_module_copies(ckpt)  # before anything is written; one whole-model pass
        return plan

    def _peft_on_rank0(self) -> ConsolidateResult | None:
        """A PEFT run's outputs are small (adapters) or written as one merge: rank 0 writes them alone."""
        if self.group.rank != 0:
            return None
        result = consolidate(self.path, self.out_dir, to=self.to, dtype=self.dtype, max_shard_size=self.max_shard_size,
                             tag=self.tag, step=self.step, best=self.best, overwrite=self.overwrite,
                             check_existing=self.check_existing, check_keys=self.check_keys, config=self.config,
                             merge=self.merge, base=self.base, on_progress=self.on_progress,
                             on_start=self.on_start)  # fmt: skip
        result.world_size, result.ranks = self.group.world_size, dict.fromkeys(result.files, 0)
        return result

    def _share(self, result: ConsolidateResult | None) -> ConsolidateResult:
        """Rank 0's result, on every rank (notes from its checks included)."""
        text = self.group.share(json.dumps(result.to_dict()) if result is not None else "")
        return ConsolidateResult(**json.loads(text))


def _plan_ranks(shards: dict[str, list[OutputTensor]], world_size: int) -> list[int]:
    """The rank writing each shard, balanced by the bytes it reads and writes (16-bit output reads fp32)."""
    from ckpttools.ranks.distributed import plan_by_bytes

    return plan_by_bytes([_shard_bytes(group) for group in shards.values()], world_size)


def _tensor_records(tensors: Sequence[OutputTensor]) -> list[Record]:
    """Every record the tensors read from, once each, in a fixed order."""
    return list({(seg.tensor.record.path, seg.tensor.record.name): seg.tensor.record
                 for t in tensors for seg in t.source.segments}.values())  # fmt: skip


def _shard_bytes(tensors: Sequence[OutputTensor]) -> int:
    read = sum(seg.count * seg.tensor.dtype.itemsize for t in tensors for seg in t.source.segments)
    return read + sum(t.nbytes for t in tensors)

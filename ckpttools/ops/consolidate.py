"""ZeRO checkpoint -> a folder `from_pretrained` loads: safetensors (or .bin) shards, index, config.

Output goes to a temporary sibling folder that is renamed into place only when complete and verified;
inputs are never touched.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ckpttools import adapters, extras
from ckpttools.errors import CkptError, UsageError, VerificationError, short
from ckpttools.io import dtypes, integrity
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import OutputTensor, ProgressFn, output_dtype, read_tensor
from ckpttools.io.source import location_name
from ckpttools.io.staging import check_output_dir
from ckpttools.io.torchfile import Record, RecordReader
from ckpttools.io.values import NonFiniteCounter
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import layout_of, open_checkpoint
from ckpttools.model.checkpoint import Checkpoint, TensorSource
from ckpttools.ops import hf, peft
from ckpttools.ranks import executor

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import ProcessGroup

DTYPES = dtypes.SHORT
_T = TypeVar("_T")
FORMATS = hf.FORMATS
SPACE_MARGIN = 64 << 20
plan_shards = hf.plan_shards  # where it was before ops/hf.py held the folder writer


@dataclass(frozen=True)
class ConsolidateOptions:
    """Everything `consolidate` is asked to do, in one place: the CLI, the library call, the ranks and the gathered
    copy of a node-local checkpoint all pass this (see `consolidate` for what each means)."""

    to: str = "safetensors"
    dtype: str = "fp32"
    max_shard_size: int | str = "5GB"
    tag: str | None = None
    step: int | None = None
    best: bool = False
    overwrite: bool = False
    check_existing: bool = True
    check_keys: bool = False
    config: Path | str | None = None
    replace_config: bool = False
    merge: bool = False
    base: Path | str | None = None

    @property
    def select(self) -> dict[str, Any]:
        """Which checkpoint and tag PATH means."""
        return {"tag": self.tag, "step": self.step, "best": self.best}

    def check(self) -> None:
        """Refuse options that do not go together, and check the optional libraries they need, before any work."""
        if self.to not in FORMATS:
            raise UsageError(f"--to must be one of {', '.join(FORMATS)}, not {self.to!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if (self.merge or self.base is not None) and self.to != "safetensors":
            raise UsageError("--merge writes safetensors only (what from_pretrained loads); drop --to pt")
        if self.base is not None and not self.merge:
            raise UsageError("--base is the base model of a --merge; pass --merge too")
        if self.replace_config and self.config is None:
            raise UsageError("--replace-config writes --config instead of the checkpoint's own config.json; "
                             "pass --config too")  # fmt: skip
        _require_libraries(to=self.to, check_keys=self.check_keys, merge=self.merge)


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


def plan_tensors(
    ckpt: Checkpoint, dtype: DType, *, hf_folder: bool, config: dict[str, Any] | None = None
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


def _require_libraries(*, to: str, check_keys: bool, merge: bool) -> None:
    """The optional libraries the options need, checked before any work (see ckpttools.extras)."""
    needed = [*(["torch", "transformers"] if check_keys else []), *(["torch"] if to == "pt" else []),
              *(["torch", "safetensors"] if merge else [])]  # fmt: skip
    extras.require(*dict.fromkeys(needed))


class _KeyCheck:
    """Builds the model config.json names on the meta device (in a child process while the shards are written, see
    hf.KeyCheck), and fails the consolidation, before anything is published, when from_pretrained would load the
    output with missing or unexpected keys (random weights at exit 0 otherwise).

    It runs whenever a config.json is written and transformers is installed (`asked`: `--check-keys`, which also
    makes a check that cannot run a failure instead of a note). Without transformers there is no child: the base
    install imports nothing heavy.
    """

    def __init__(self, config: hf.ModelConfig | None, tensors: Sequence[_Shaped], *, asked: bool = False) -> None:
        self.asked = asked
        self.scratch: Path | None = None  # a private copy of a config.json that has no file of its own
        self.proc = None
        if config is not None:
            self.proc = hf.KeyCheck(self._config_file(config), {t.name: tuple(t.shape) for t in tensors})

    def _config_file(self, config: hf.ModelConfig) -> Path:
        """The file the model is built from: the config.json itself, or, for one generated from the run's arguments
        or rewritten by an architecture adapter, a private copy of the config that will be written (the check is of
        the output as it will be loaded, never of a file that is not there)."""
        if config.path.is_file() and hf.load_config(config.path) == config.config:
            return config.path
        self.scratch = Path(tempfile.mkdtemp(prefix="ckpt-keycheck-"))
        (self.scratch / "config.json").write_text(json.dumps(config.config))
        return self.scratch / "config.json"

    def _remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)  # made by _config_file; nothing else is in it
            self.scratch = None

    @classmethod
    def start(cls, model_config: hf.ModelConfig | None, tensors: Sequence[_Shaped], *, asked: bool,
              rank0: bool = True) -> _KeyCheck:  # fmt: skip
        """A check of `tensors` against `model_config`'s class, when there is a config, this is the rank that
        writes it, and transformers is installed (`asked` has required it already)."""
        runs = model_config is not None and rank0 and (asked or not _lacking("torch", "transformers"))
        return cls(model_config if runs else None, tensors, asked=asked)

    def cancel(self) -> None:
        if self.proc is not None:
            self.proc.cancel()
        self._remove_scratch()

    def problems(self, ckpt: Checkpoint, omitted: dict[str, str], notes: list[str], *, all_weights: bool = False
                 ) -> None:  # fmt: skip
        """Raise when the keys do not match; `all_weights`: the output must hold the base weights even when the
        checkpoint lacks them (a merge from --base)."""
        if self.proc is None:
            return
        try:
            result = self.proc.result()
        finally:
            self._remove_scratch()
        if isinstance(result, str):
            if self.asked:
                raise VerificationError(f"--check-keys cannot check the keys: {result}")
            notes.append(f"keys not checked against the model: {result}")
            return
        arch, keys, guessed = result
        keys.missing = [f"{k} (tied during training, but {arch} does not tie it on load)" if k in omitted else k
                        for k in keys.missing]  # fmt: skip
        partial = ckpt.frozen_excluded and not all_weights
        if partial and keys.missing:
            notes.append(f"{len(keys.missing)} base-model weights are absent (saved without frozen params)")
        problems = keys.messages(arch, ignore_missing=partial)
        if problems and guessed and not self.asked:  # no class named: the user may load it with another Auto class
            notes.append(f"config.json names no architecture, and the keys match neither {guessed} (the classes "
                         f"AutoModelForCausalLM and AutoModel build for it): {'; '.join(problems)}")  # fmt: skip
            return
        if problems and guessed:
            raise VerificationError(
                f"--check-keys: config.json names no architecture, and the keys match neither {guessed} (the classes "
                f"AutoModelForCausalLM and AutoModel build for it): {'; '.join(problems)}. Add `architectures` to "
                "config.json, or pass --config with the model's own"
            )
        if problems:
            raise VerificationError(
                f"the consolidated keys do not match {arch} from config.json: {'; '.join(problems)}. "
                "Is config.json from the same model? Nothing was written"
            )


class _Shaped(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


def _lacking(*modules: str) -> list[str]:
    """Which of `modules` (of ckpttools[verify]) are not installed."""
    return [m for m in hf.missing_verify_libraries() if m in modules]


def _skipped_note(skipped: list[str]) -> list[str]:
    """One note for every check skipped on a base install (no torch, transformers, safetensors), saying which."""
    if not skipped:
        return []
    note = f"not checked, as ckpttools[verify] is not installed: {'; '.join(skipped)} (pip install 'ckpttools[verify]')"
    return [note]


def consolidate(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    options: ConsolidateOptions | None = None,
    on_progress: ProgressFn | None = None,
    on_start: Any = None,
    group: ProcessGroup | None = None,
    **fields: Any,
) -> ConsolidateResult:
    """Consolidate a ZeRO checkpoint into a Hugging Face-loadable folder.

    Args:
        path: checkpoint folder (see `read_checkpoint`).
        out_dir: output folder; defaults to `hf-<checkpoint name>` beside the checkpoint.
        options: a `ConsolidateOptions`; or give its fields as keyword arguments (below), as before.
        to: "safetensors" or "pt".
        dtype: "fp32" (bit-identical to zero_to_fp32) or "bf16"/"fp16" (bit-identical to the engine's
            16-bit weights when that is the training dtype).
        max_shard_size: largest shard, e.g. "5GB"; a tensor larger than that is never split: it gets a shard of its
            own, as save_pretrained does, and a note names it.
        overwrite: replace an existing output folder.
        check_existing: compare with 16-bit weights a Trainer already saved beside the shards.
        config: the model's config.json, or a folder holding it (tokenizer files come from there too), for
            checkpoints saved without one (accelerate's save_state); default: the one beside the checkpoint. One
            that differs from the checkpoint's own (beyond dtype, transformers_version, _name_or_path) is refused
            (UsageError) unless `replace_config`.
        replace_config: write `config` although the checkpoint has its own, different config.json (a note says so).
        check_keys: whenever a config.json is written and transformers is installed, the output's keys and shapes
            are checked against the class it names (built on the meta device in a child process while the shards
            are written: about 5 s of CPU and 400 MB, whatever the model's size) and a mismatch fails before
            anything is published; `check_keys` also makes a check that cannot run (no config.json, no class,
            no transformers) a failure instead of a note, and on a PEFT adapter folder checks its keys against
            PeftModel of the base model (`config`). `ckpt verify` always checks the keys.
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
    opts = replace(options, **fields) if options is not None else ConsolidateOptions(**fields)
    opts.check()

    def run(ckpt_path: Path, on: ProcessGroup | None, user_path: Callable[[Path], Path]) -> ConsolidateResult:
        return _Consolidation(opts, on, on_progress, on_start).run(ckpt_path, out, user_path)

    def check_output(root: Path) -> Path:  # a node-local copy: refused before any byte moves
        return check_output_dir(out or default_output_dir(root), root, opts.overwrite)

    out = Path(out_dir) if out_dir else None
    job = executor.Job(Path(path), out, opts.select, run, ConsolidateResult.to_dict,
                       lambda d: ConsolidateResult(**d), check_output, optimizer_states=False)  # fmt: skip
    return executor.run_job(job, group)


def check_integrity(ckpt: Checkpoint, group: ProcessGroup | None = None) -> str | None:
    """Hash again the files the save hashed (a layout's `details["integrity"]`: Megatron-LM's --verify-integrity)
    before any tensor is read; consolidate and verify --against both call it. On ranks, each hashes its share of
    the files. The note saying what was checked, None when the save listed nothing; CorruptCheckpointError naming
    the first file that changed since the save."""
    part = (group.rank, group.world_size) if group is not None else (0, 1)
    return integrity.check(ckpt.location.tag_dir, ckpt.layout.details.get("integrity"), part=part)


def nonfinite_note(counter: NonFiniteCounter) -> str:
    """The note for NaN/Inf found in the output (`push` refuses such weights unless --allow-nonfinite)."""
    return (f"non-finite values in the output: {counter.total().describe()} in {len(counter.found)} tensors "
            f"({counter.describe()}); check the run before publishing it")  # fmt: skip


def default_output_dir(root: Path) -> Path:
    """`hf-<checkpoint>` beside the checkpoint root (a name Trainer's checkpoint rotation never matches)."""
    return root.parent / f"hf-{root.name}"


class _Consolidation:
    """One consolidation, planned as an `executor.OutputPlan` and run by the executor on one process or many."""

    def __init__(self, opts: ConsolidateOptions, group: ProcessGroup | None, on_progress: ProgressFn | None,
                 on_start: Any) -> None:  # fmt: skip
        self.opts, self.group, self.on_progress, self.on_start = opts, group, on_progress, on_start
        self.rank0 = group is None or group.rank == 0

    def run(self, path: Path, out_dir: Path | None, user_path: Callable[[Path], Path]) -> ConsolidateResult:
        opts = self.opts

        def open_output() -> tuple[Checkpoint, Path, str | None]:
            ckpt = open_checkpoint(path, **opts.select)
            root = ckpt.location.root
            out = executor.output_folder(out_dir, default_output_dir, root, user_path, opts.overwrite)
            return ckpt, out, check_integrity(ckpt, self.group)  # before anything is planned or staged

        ckpt, out, integrity_note = self._agreed(open_output)
        if opts.merge or peft.is_peft(ckpt):
            job = _PeftJob(ckpt, out, DTYPES[opts.dtype], opts.max_shard_size, self.on_progress, self.on_start,
                           opts.check_keys, opts.replace_config)  # fmt: skip
            plan, result_of = self._agreed(lambda: job.merge(opts.base, opts.config) if opts.merge
                                           else job.adapters(opts.to, opts.config))  # fmt: skip
            return self._share(self._executed(plan, result_of))
        output = self._agreed(lambda: _plan_output(ckpt, DTYPES[opts.dtype], opts.to, opts.max_shard_size,
                                                   opts.config, replace_config=opts.replace_config,
                                                   check_keys=opts.check_keys))  # fmt: skip
        output.notes += [integrity_note] if integrity_note else []
        keycheck = _KeyCheck.start(output.model_config, output.tensors, asked=opts.check_keys, rank0=self.rank0)
        try:
            plan = self._output_plan(output, out, keycheck)
            return self._share(self._executed(plan, lambda files: output.result(out, files, opts.dtype)))
        except BaseException:
            keycheck.cancel()
            raise

    def _output_plan(self, output: _Output, out: Path, keycheck: _KeyCheck) -> executor.OutputPlan:
        files = [executor.OutputFile(fname, _shard_bytes(group)) for fname, group in output.shards.items()]

        def write(tmp: Path, mine: list[executor.OutputFile], reader: RecordReader) -> None:
            shards = {f.name: output.shards[f.name] for f in mine}
            if self.on_start:
                self.on_start(sum(t.nbytes for group in shards.values() for t in group))
            # NaN/Inf counted from the bytes written (issue 34); one process only: ranks would need their counts
            # gathered before rank 0's result, and a note that saw only rank 0's shards would mislead
            counter = NonFiniteCounter() if self.group is None else None
            hf.write_shards(tmp, shards, reader, fmt=output.to, on_progress=self.on_progress, nonfinite=counter)
            if counter is not None and counter.found:
                output.notes.append(nonfinite_note(counter))

        def finish(tmp: Path, reader: RecordReader) -> list[str]:
            return output.finish_folder(tmp, keycheck, reader, self.opts.check_existing)

        return executor.OutputPlan(out, files, write, output.total, output.notes, finish,
                                   check=lambda: check_module_copies(output.ckpt),
                                   records=_tensor_records(output.tensors))  # fmt: skip

    def _executed(self, plan: executor.OutputPlan,
                  result_of: Callable[[list[str]], ConsolidateResult]) -> ConsolidateResult:  # fmt: skip
        done = executor.execute(plan, self.group, overwrite=self.opts.overwrite)
        result = result_of(done.files)
        result.world_size, result.ranks = done.world_size, done.ranks
        return result

    def _agreed(self, fn: Callable[[], _T]) -> _T:
        return fn() if self.group is None else self.group.run_agreed(fn)

    def _share(self, result: ConsolidateResult) -> ConsolidateResult:
        """Rank 0's result, on every rank (notes from its checks included)."""
        if self.group is None:
            return result
        text = self.group.share(json.dumps(result.to_dict()) if self.rank0 else "")
        return ConsolidateResult(**json.loads(text))


@dataclass
class _Output:
    """What a consolidation writes, planned before anything is: tensors, shards, the config and notes."""

    ckpt: Checkpoint
    dtype: DType
    to: str
    model_config: hf.ModelConfig | None
    tensors: list[OutputTensor]
    omitted: dict[str, str]
    shards: dict[str, list[OutputTensor]]
    total: int
    notes: list[str]

    def finish_folder(self, tmp: Path, keycheck: _KeyCheck, reader: RecordReader, check_existing: bool) -> list[str]:
        """After the shards: the key check's verdict, the index, config and companion files, the comparison with
        the weights a Trainer saved beside the shards."""
        ckpt = self.ckpt
        keycheck.problems(ckpt, self.omitted, self.notes)
        skipped = []
        if self.model_config is not None and keycheck.proc is None and _lacking("torch", "transformers"):
            skipped.append("the keys and shapes against the model class config.json names")
        files = _write_hf_files(tmp, ckpt, self.shards, self.tensors, self.to, self.dtype, self.model_config)
        existing = hf.existing_weight_files(ckpt.location.root)
        if check_existing and existing and (ckpt.location.root / "config.json").is_file():
            if _lacking("torch", "safetensors"):  # they are read with torch
                skipped.append(f"the weights already saved beside the shards ({', '.join(p.name for p in existing)}) "
                               "against the shards")  # fmt: skip
            else:
                self.notes += compare_with_existing(ckpt, reader, self.dtype)
        self.notes += _skipped_note(skipped)
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
    ckpt: Checkpoint, dtype: DType, to: str, max_shard_size: int | str, config: Path | str | None, *,
    replace_config: bool = False, check_keys: bool = False,
) -> _Output:  # fmt: skip
    model_config, config_notes = _model_config(ckpt.location.root, config, replace_config)
    ckpt, model_config, adapter_notes = _adapted(ckpt, model_config)  # trainer names -> Hugging Face's (adapters)
    if model_config is None and check_keys:  # after the adapter: it may generate config.json from the run's args
        raise VerificationError(
            f"--check-keys needs a config.json to build the model from, and {ckpt.location.root} has none; "
            "pass --config (the model's config.json, or the folder save_pretrained wrote)"
        )
    config_notes = adapter_notes + config_notes
    tensors, omitted = plan_tensors(ckpt, dtype, hf_folder=model_config is not None,
                                    config=model_config.config if model_config else {})  # fmt: skip
    shards = plan_shards(tensors, to, max_shard_size)
    notes: list[str] = [] if model_config is not None or not _is_accelerate(ckpt) else [_NO_CONFIG_NOTE]
    notes += config_notes + hf.oversized_shards(shards, max_shard_size)
    if ckpt.frozen_excluded:
        notes.append("this checkpoint holds only trainable (e.g. LoRA) weights: base weights are absent, as saved")
    total = sum(t.nbytes for t in tensors)
    return _Output(ckpt, dtype, to, model_config, tensors, omitted, shards, total, notes)


def _adapted(ckpt: Checkpoint, model_config: hf.ModelConfig | None
             ) -> tuple[Checkpoint, hf.ModelConfig | None, list[str]]:  # fmt: skip
    """The checkpoint under Hugging Face names when an architecture adapter claims it (Megatron-Core, ...), with
    the config.json it loads with (--config's, else generated from the run's arguments); else as it is."""
    mapped = adapters.adapt(ckpt, model_config.config if model_config is not None else None)
    if mapped is None:
        return ckpt, model_config, []
    if model_config is None:  # generated: no file of its own, and no companion files beside it
        return mapped.checkpoint, hf.ModelConfig(ckpt.location.root, mapped.config, [], False), mapped.notes
    return mapped.checkpoint, replace(model_config, config=mapped.config), mapped.notes


def _model_config(root: Path, given: Path | str | None, replace: bool) -> tuple[hf.ModelConfig | None, list[str]]:
    """The config.json to write (`given`, else the one at `root`) and notes, read once and refused before writing:
    a `given` one that differs from `root`'s own without `replace`."""
    model_config = hf.find_config(root, given)
    return model_config, hf.check_config_override(root, given, model_config, replace)


_NO_CONFIG_NOTE = (
    "an accelerate save_state folder holds no config.json: wrote the weights only; pass --config (the model's "
    "config.json, or the folder save_pretrained wrote it to) for a folder from_pretrained loads"
)


def _is_accelerate(ckpt: Checkpoint) -> bool:
    """accelerate's save_state: tag `pytorch_model`, RNG states as `random_states_N.pkl` (never loaded); its FSDP
    saves: tag `pytorch_model_fsdp_N` (the DCP folder or per-rank files; the Trainer's copy holds config.json)."""
    loc = ckpt.location
    fsdp = loc.tag.startswith("pytorch_model_fsdp_")
    return fsdp or (loc.tag == "pytorch_model" and any(loc.root.glob("random_states_*.pkl")))


def _param_count(tensors: list[OutputTensor], ckpt: Checkpoint) -> int:
    """Parameters written, each tied weight counted once."""
    return sum(t.source.numel() for t in tensors if t.source.kind != "buffer" and t.name not in ckpt.shared_params)


def source_summary(ckpt: Checkpoint) -> dict[str, Any]:
    deepspeed = bool(ckpt.ds_version)  # other writers (torch DCP) have no ZeRO stage
    return {
        "path": location_name(ckpt.location.root),  # a remote checkpoint's URL, not its local mount
        "tag": ckpt.location.tag,
        "checkpoint_kind": "DeepSpeed ZeRO" if deepspeed else layout_of(ckpt).title,
        "zero_stage": ckpt.zero_stage if deepspeed else None,
        "dp_world_size": ckpt.dp_world_size,
        "train_dtype": ckpt.train_dtype.name,
        "ds_version": ckpt.ds_version or None,  # null: not written by DeepSpeed
        "global_steps": ckpt.global_steps,
    }


def _write_hf_files(
    tmp: Path,
    ckpt: Checkpoint,
    shards: dict[str, list[OutputTensor]],
    tensors: list[OutputTensor],
    to: str,
    dtype: DType,
    model_config: hf.ModelConfig | None,
) -> list[str]:
    files = hf.write_folder_files(tmp, shards, total_parameters=_param_count(tensors, ckpt), model_config=model_config,
                                  dtype=dtype, fmt=to)  # fmt: skip
    root = ckpt.location.root
    return files + hf.copy_side_files(root, [n for n in ckpt.location.side_files if n not in files], tmp)


def compare_with_existing(ckpt: Checkpoint, reader: RecordReader, dtype: DType = dtypes.FLOAT32) -> list[str]:
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


def _differences(ckpt: Checkpoint, reader: RecordReader, dtype: DType, files: list[Path]) -> tuple[list[str], set[str]]:
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


_ResultOf = Callable[[list[str]], ConsolidateResult]


@dataclass
class _PeftJob:
    """A PEFT run's outputs, planned for the executor: the adapter folder(s) save_pretrained writes, or the merged
    model. Both are written whole by rank 0 (`finish`): the adapters are small, the merge one pass."""

    ckpt: Checkpoint
    out: Path
    dtype: DType
    max_shard_size: int | str
    on_progress: ProgressFn | None
    on_start: Any
    check_keys: bool = False
    replace_config: bool = False

    def adapters(self, to: str, config: Path | str | None = None) -> tuple[executor.OutputPlan, _ResultOf]:
        if to != "safetensors":
            raise UsageError(
                "a PEFT run's adapter folder is safetensors only (adapter_model.safetensors); drop --to pt"
            )
        run = peft.read_peft_run(self.ckpt)
        if not run.adapters:
            raise peft.PeftError(f"{self.ckpt.location.root} holds adapter_config.json but no adapter tensors")
        if config is not None and not self.check_keys:
            raise UsageError(
                "a PEFT run's adapter folder holds no config.json: --config is for --merge (the merged "
                "model's config) or --check-keys (the base model the adapter is checked against)"
            )
        base_config = self._adapter_base_config(run, config) if self.check_keys else None
        tensors = [t for a in run.adapters for t in peft.adapter_tensors(self.ckpt, a, self.dtype)]
        total = sum(t.nbytes for t in tensors)
        written = ", ".join(a.name for a in run.adapters)
        notes = [f"wrote the adapter folder PEFT's save_pretrained writes for adapter(s) {written}"]
        notes += self._adapter_notes(run)

        def finish(tmp: Path, reader: RecordReader) -> list[str]:
            if self.on_start:
                self.on_start(total)
            files = []
            for adapter in run.adapters:
                files += peft.write_adapter_folder(tmp, self.ckpt, adapter, self.dtype, reader, self.on_progress)
                if base_config is not None:
                    self._check_adapter_keys(tmp, adapter, base_config)
            return files + self._side_files(tmp, exclude=files)

        result_of = partial(self._result, tensors=tensors, total=total, notes=notes,
                            params=sum(t.source.numel() for t in tensors))  # fmt: skip
        return self._plan(total, notes, finish), result_of

    def _adapter_base_config(self, run: peft.PeftRun, config: Path | str | None) -> Path:
        """The base model's config for `--check-keys` on adapter folders: --config, the checkpoint's own, or the
        local folder adapter_config.json names; else the check cannot run, which fails before any writing."""
        extras.require("torch", "transformers", "peft")  # PeftModel is built on the meta device
        root = self.ckpt.location.root
        model_config, _ = _model_config(root, config, self.replace_config)
        if model_config is not None:  # the folder when it can be: PEFT looks for config.json in the base's folder
            return model_config.folder if model_config.standard_name else model_config.path
        named = run.adapters[0].config.get("base_model_name_or_path")
        if isinstance(named, str) and named and (Path(named) / "config.json").is_file():
            return Path(named) / "config.json"
        raise VerificationError(
            f"--check-keys checks a PEFT adapter against the PeftModel of its base model, and neither {root} nor "
            "adapter_config.json (base_model_name_or_path) gives the base model's config.json; pass --config (the "
            "base model's config.json, or its folder)"
        )

    def _check_adapter_keys(self, tmp: Path, adapter: peft.Adapter, base_config: Path) -> None:
        """The written adapter's keys and shapes against what PeftModel(base, adapter_config) saves and loads."""
        where = f"adapter {adapter.name!r}"
        if adapter.config_path is None:
            raise VerificationError(f"--check-keys cannot check {where}: it has no adapter_config.json beside the "
                                    "checkpoint to build the PeftModel from")  # fmt: skip
        expected = peft.peft_model_keys(base_config, tmp / adapter.folder)
        if isinstance(expected, str):
            raise VerificationError(f"--check-keys cannot check {where}: {expected}")
        written = {t.name: tuple(t.shape) for t in peft.adapter_tensors(self.ckpt, adapter, self.dtype)}
        problems = peft.compare_adapter_keys(expected, written)
        if problems:
            raise VerificationError(f"the keys of {where} do not match the PeftModel of {base_config}: "
                                    f"{'; '.join(problems)}. Nothing was written")  # fmt: skip

    def merge(self, base: Path | str | None, config: Path | str | None) -> tuple[executor.OutputPlan, _ResultOf]:
        ckpt = self.ckpt
        run = peft.trained_adapters(peft.read_peft_run(ckpt), ckpt)
        if not run.adapters:
            raise peft.PeftError(f"{ckpt.location.root} holds no trained LoRA adapter tensors: nothing to merge")
        base_dir = peft.find_base(base)
        model_config, config_notes = _model_config(base_dir if base_dir is not None else ckpt.location.root, config,
                                                   self.replace_config)  # fmt: skip
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
        count = sum(math.prod(t.shape) for t in tensors)
        merged = ", ".join(a.name for a in run.adapters)
        source = "--base" if base_dir is not None else "the checkpoint's frozen weights"
        notes = [f"merged adapter(s) {merged} into the base weights from {source}", *config_notes,
                 *hf.oversized_shards(shards, self.max_shard_size)]  # fmt: skip

        def finish(tmp: Path, reader: RecordReader) -> list[str]:
            keycheck = _KeyCheck.start(model_config, tensors, asked=self.check_keys)  # config.json is written
            try:
                if self.on_start:
                    self.on_start(total)
                for fname, group in shards.items():
                    peft.write_merged_safetensors(tmp / fname, group, reader, self.on_progress)
                keycheck.problems(ckpt, tied, notes, all_weights=True)
            except BaseException:
                keycheck.cancel()
                raise
            if keycheck.proc is None and _lacking("torch", "transformers"):
                notes.extend(_skipped_note(["the keys and shapes against the model class config.json names"]))
            files = list(shards)
            files += hf.write_folder_files(tmp, shards, total_parameters=count, model_config=model_config,
                                           dtype=self.dtype)  # fmt: skip
            return files + self._side_files(tmp, exclude=files)

        return self._plan(total, notes, finish), partial(
            self._result, tensors=tensors, total=total, notes=notes, params=count
        )

    def _plan(self, total: int, notes: list[str], finish: Callable[[Path, RecordReader], list[str]]
              ) -> executor.OutputPlan:  # fmt: skip
        return executor.OutputPlan(self.out, [], _nothing, total, notes, finish,
                                   check=lambda: check_module_copies(self.ckpt))  # fmt: skip

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


def _nothing(tmp: Path, files: list[executor.OutputFile], reader: RecordReader) -> None:
    """A plan whose every file rank 0 writes in `finish` has no shared files to write."""


def _short(dtype: DType) -> str:
    return next(k for k, v in DTYPES.items() if v is dtype)


def _tensor_records(tensors: Sequence[OutputTensor]) -> list[Record]:
    """Every record the tensors read from, once each, in a fixed order."""
    return list({(seg.tensor.record.path, seg.tensor.record.name): seg.tensor.record
                 for t in tensors for seg in t.source.segments}.values())  # fmt: skip


def _shard_bytes(tensors: Sequence[OutputTensor]) -> int:
    read = sum(seg.count * seg.tensor.dtype.itemsize for t in tensors for seg in t.source.segments)
    return read + sum(t.nbytes for t in tensors)

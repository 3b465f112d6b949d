"""Reshard a ZeRO checkpoint to a new data-parallel size, or to and from DeepSpeed's universal format.

DeepSpeed refuses to load a checkpoint saved at another DP size. The fp32 master weights and every
optimizer state are laid out by pure arithmetic (see `partition`), so they can be re-cut offline.
The validated checkpoint model (`sources.open_checkpoint`: native of any layout, or universal) already describes
every state of every parameter as the flat stored slices it is made of; the new files are planned as
slices of those plus zero padding, exactly as DeepSpeed lays them out for the new size, and streamed
into place. Native results load with a plain `engine.load_checkpoint` at the new size
and the user's unchanged config; universal ones with `"checkpoint": {"load_universal": true}`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckpttools.errors import UnsupportedCheckpointError, UsageError
from ckpttools.io.staging import check_output_dir
from ckpttools.io.torchfile import LazyTensor, Record, RecordReader
from ckpttools.io.torchwriter import NewTensor, ProgressFn, Slice, write_torch_files
from ckpttools.layouts.base import ReshardTarget
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import layout_of, open_checkpoint
from ckpttools.layouts.zero import nvme, stages
from ckpttools.model.checkpoint import Checkpoint
from ckpttools.ops import hf
from ckpttools.ranks import executor

if TYPE_CHECKING:
    from ckpttools.ranks.distributed import ProcessGroup


_ProgressFns = tuple[ProgressFn | None, ProgressFn | None]  # (on_start, on_progress)
_T = TypeVar("_T")


@dataclass
class ReshardResult:
    output_dir: str | None
    tag: str
    zero_stage: int
    dp_from: int | None  # None when the source is a universal checkpoint
    dp_to: int | None  # None when the output is a universal checkpoint
    files: list[str]
    notes: list[str] = field(default_factory=list)
    zero_stage_from: int | None = None  # the source's stage when --stage changed it
    world_size: int | None = None  # set by a run on many ranks, with the rank that wrote each file
    ranks: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d if self.world_size is not None else {k: v for k, v in d.items() if k not in ("world_size", "ranks")}


# --- Files around the tag: latest, Trainer files, RNG states ------------------------------------------------


@dataclass(frozen=True)
class _RngScheme:
    """How a framework names its per-process RNG files beside the checkpoint."""

    glob: str
    per_rank: str  # with {} for the rank
    single: str | None  # the name at one process, when it differs
    who: str


RNG_SCHEMES = (
    _RngScheme("rng_state*.pth", "rng_state_{}.pth", "rng_state.pth", "the Trainer"),
    _RngScheme("random_states_*.pkl", "random_states_{}.pkl", None, "accelerate's load_state"),  # never unpickled
)


def _copy_root_files(root: Path, out: Path, old_dp: int | None, new_dp: int | None, skip: set[str],
                     written: list[str]) -> list[str]:  # fmt: skip
    """Everything beside the tag folders comes along; RNG files follow the new ranks. Appends every file written
    (relative to `out`) to `written`; returns the notes."""
    rng = {scheme: sorted(p.name for p in root.glob(scheme.glob)) for scheme in RNG_SCHEMES}
    rng_files = {name for names in rng.values() for name in names}
    for item in sorted(root.iterdir()):
        if item.name in skip or item.name in rng_files:
            continue
        if item.is_dir():
            if not any(item.glob("*_model_states.pt")):  # tag folders: only the converted one is written
                shutil.copytree(item, out / item.name)
                written += sorted(p.relative_to(out).as_posix() for p in (out / item.name).rglob("*") if p.is_file())
        else:
            shutil.copy2(item, out / item.name)
            written.append(item.name)
    notes = []
    for scheme, names in rng.items():
        if not names:
            continue
        if old_dp is None or new_dp is None:
            for name in names:
                shutil.copy2(root / name, out / name)
                written.append(name)
            notes.append("RNG states copied as they are")
        else:
            notes.append(_place_rng_states(root, out, old_dp, new_dp, scheme, written))
    return notes


def _place_rng_states(root: Path, out: Path, old_dp: int, new_dp: int, scheme: _RngScheme, written: list[str]
                      ) -> str:  # fmt: skip
    """Each process restores its own RNG file; keep what maps over, by rank."""

    def name(rank: int, dp: int) -> str:
        return scheme.single if (dp == 1 and scheme.single) else scheme.per_rank.format(rank)

    def old_file(rank: int) -> Path | None:
        path = root / name(rank, old_dp)
        return path if path.is_file() else None

    for rank in range(min(old_dp, new_dp)):
        if src := old_file(rank):
            shutil.copy2(src, out / name(rank, new_dp))
            written.append(name(rank, new_dp))
    if new_dp == 1:
        return f"RNG states: rank 0's kept as {name(0, 1)}; the other ranks' random streams do not carry over"
    if new_dp > old_dp:
        return (
            f"RNG states: carried over for {_ranks(0, old_dp)}; {_ranks(old_dp, new_dp)} start without one, so "
            f"{scheme.who} logs that it found no RNG file and continues with fresh random streams there"
        )
    if new_dp == old_dp:
        return f"RNG states: carried over for {_ranks(0, new_dp)}"
    return f"RNG states: carried over for {_ranks(0, new_dp)}; those of {_ranks(new_dp, old_dp)} are dropped"


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


# --- Entry point --------------------------------------------------------------------------------------------


def reshard(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    dp: int | None = None,
    universal: bool = False,
    stage: int | None = None,
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    overwrite: bool = False,
    config: Path | str | None = None,
    on_start: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
    group: ProcessGroup | None = None,
) -> ReshardResult:
    """Write a native ZeRO checkpoint for `dp` ranks, or (`universal=True`) a universal checkpoint.

    Args:
        path: a native checkpoint (see `read_checkpoint`) or a universal one (holding `latest_universal`).
        out_dir: output folder; defaults to `dp<M>-<name>` or `universal-<name>` beside the input.
        dp: the new data-parallel size (native output).
        universal: write DeepSpeed's universal format instead, loadable at any DP size.
        stage: write the files DeepSpeed saves at this ZeRO stage (1, 2 or 3) instead of the checkpoint's own,
            so the run resumes at that stage; the DP size stays unless `dp` is given.
        config: the model's config.json (or its folder, tokenizer files included), copied into the output
            for checkpoints saved without one (accelerate's save_state).
        on_start: called once with the number of tensor bytes to write.
        on_progress: called with the number of bytes written after each chunk.
        group: the ranks of a launcher (`ckpttools.ranks.distributed.join_group`) sharing the work: each writes the
            rank files (or universal parameter folders) planned for it, balanced by bytes, into one staged
            folder that is committed only when every rank succeeded; rank 0 also writes `latest` and the files
            beside the tag. Every rank returns the same result, with `world_size` and each file's rank.

    Example:
        >>> reshard("out/checkpoint-500", "out/dp8-checkpoint-500", dp=8).files[0]
        'global_step500/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'
    """
    _check_arguments(dp, universal, stage)  # every rank alike, before anything is read
    progress = (on_start, on_progress)

    def run(ckpt_path: Path, on: ProcessGroup | None, user_path: Callable[[Path], Path]) -> ReshardResult:
        job = _agreed(on, lambda: _prepare(ckpt_path, out_dir, dp, universal, stage, tag, step, best, config))
        if isinstance(job, ReshardResult):  # nothing to do
            if on is not None:
                job.world_size, job.ranks = on.world_size, {}
            return job
        return _write(job, out_dir, overwrite, progress, on, user_path)

    def check_output(root: Path) -> None:  # before any byte moves; the default folder's name needs the checkpoint
        if out_dir is not None:
            check_output_dir(Path(out_dir), root, overwrite)

    select = {"tag": tag, "step": step, "best": best}
    job = executor.Job(Path(path), Path(out_dir) if out_dir else None, select, run, ReshardResult.to_dict,
                       lambda d: ReshardResult(**d), check_output, optimizer_states=True)  # fmt: skip
    return executor.run_job(job, group)


def _agreed(group: ProcessGroup | None, fn: Callable[[], _T]) -> _T:
    return fn() if group is None else group.run_agreed(fn)


@dataclass(frozen=True)
class _Job:
    """What `reshard` writes, once its arguments and the checkpoint are checked."""

    ckpt: Checkpoint
    dp: int | None  # None: universal output
    stage: int
    model_config: hf.ModelConfig | None


def _check_arguments(dp: int | None, universal: bool, stage: int | None) -> None:
    if universal and (dp is not None or stage is not None):
        raise UsageError("--universal writes a checkpoint for any DP size and stage; pass it without --dp/--stage")
    if not universal and dp is None and stage is None:
        raise UsageError("pass --dp M, --stage S or --universal")
    if dp is not None and not 1 <= dp <= 1 << 20:
        raise UsageError(f"--dp must be at least 1 (and at most {1 << 20}), not {dp}")
    if stage is not None and stage not in (1, 2, 3):
        raise UsageError(f"--stage must be 1, 2 or 3, not {stage}")


def _prepare(
    path: Path | str,
    out_dir: Path | str | None,
    dp: int | None,
    universal: bool,
    stage: int | None,
    tag: str | None,
    step: int | None,
    best: bool,
    config: Path | str | None,
) -> _Job | ReshardResult:
    """Check the arguments and open the checkpoint: the job, or the result when there is nothing to do."""
    _check_arguments(dp, universal, stage)
    ckpt = open_checkpoint(path, tag=tag, step=step, best=best)
    if universal and ckpt.source_format == "universal":
        raise UsageError(f"{path} is already a universal checkpoint; pass --dp M to turn it into native shards")
    if not universal and dp is None:
        if ckpt.source_format == "universal":
            raise UsageError(f"{path} is a universal checkpoint; pass --dp M with --stage to write native shards")
        dp = ckpt.dp_world_size
    target = stage if stage is not None else ckpt.zero_stage
    layout_of(ckpt).check_reshard(ckpt, ReshardTarget(None if universal else dp, target))
    if target != ckpt.zero_stage:
        stages.check_stage_change(ckpt, target)
    unchanged = dp == ckpt.dp_world_size and target == ckpt.zero_stage and ckpt.source_format == "native"
    if unchanged and out_dir is None:
        result = ReshardResult(None, ckpt.location.tag, ckpt.zero_stage, dp, dp, [])
        result.notes.append(f"the checkpoint is already at DP {dp}, ZeRO-{target}; nothing to do")
        return result
    if universal and ckpt.optimizer.param_groups is None:
        raise UnsupportedCheckpointError(
            f"{ckpt.location.tag_dir} is an elastic ZeRO-1/2 checkpoint: it carries no param_groups, which the "
            "universal format needs; reshard it natively with --dp M instead"
        )
    model_config = hf.find_config(ckpt.location.root, config) if config is not None else None
    return _Job(ckpt, dp, target, model_config)


def _default_out(root: Path, dp: int | None, stage: int | None = None) -> Path:
    """`dp<M>-<name>`, `zero<S>-dp<M>-<name>` or `universal-<name>` beside the input (never matched by the
    Trainer's checkpoint rotation)."""
    if not dp:
        return root.parent / f"universal-{root.name}"
    return root.parent / (f"zero{stage}-dp{dp}-{root.name}" if stage else f"dp{dp}-{root.name}")


def _write(job: _Job, out_dir: Any, overwrite: bool, progress: _ProgressFns, group: ProcessGroup | None,
           user_path: Callable[[Path], Path]) -> ReshardResult:  # fmt: skip
    """Plan the output folder for the executor and run it: the tag's rank files (on many ranks, each rank its
    share, balanced by bytes), then rank 0's files beside the tag and `latest`."""
    ckpt, tag = job.ckpt, job.ckpt.location.tag
    out, files, needed, result = _agreed(group, lambda: _plan_output(ckpt, job.dp, job.stage, out_dir, overwrite,
                                                                     user_path))  # fmt: skip
    shared = {"zero/optimizer_state.pt", *ckpt.layout_files}  # files every rank's share refers to: rank 0's
    outputs = [executor.OutputFile(f"{tag}/{name}", _tensor_bytes(obj), unit=_unit(name), rank0=name in shared)
               for name, obj in files.items()]  # fmt: skip

    def write(tmp: Path, mine: list[executor.OutputFile], reader: RecordReader) -> None:
        _write_files(tmp / tag, {f.name[len(tag) + 1 :]: files[f.name[len(tag) + 1 :]] for f in mine}, reader, progress)

    def finish(tmp: Path, reader: RecordReader) -> list[str]:
        return _finish_folder(ckpt, job.dp, job.stage, tmp, job.model_config, result)

    plan = executor.OutputPlan(out, outputs, write, needed, result.notes, finish,
                               check=lambda: check_module_copies(ckpt), records=_records_read(files))  # fmt: skip
    done = executor.execute(plan, group, overwrite=overwrite)
    result.files, result.output_dir = done.files, str(out)
    result.world_size, result.ranks = done.world_size, done.ranks
    return result


def _unit(name: str) -> str:
    """Files written by one rank together: a universal parameter folder (`zero/<param>/...`) goes whole."""
    parts = name.split("/")
    return "/".join(parts[:2]) if parts[0] == "zero" and len(parts) > 2 else name


def _plan_output(
    ckpt: Checkpoint,
    dp: int | None,
    stage: int,
    out_dir: Any,
    overwrite: bool,
    user_path: Callable[[Path], Path] = Path,
) -> tuple[Path, dict[str, Any], int, ReshardResult]:
    """The checked output folder, the tag's files, the disk space the whole output needs and the result to fill in."""
    loc = ckpt.location
    old_dp = ckpt.dp_world_size if ckpt.source_format == "native" else None
    new_stage = stage if stage != ckpt.zero_stage else None
    out = executor.output_folder(out_dir, lambda root: _default_out(root, dp, new_stage), loc.root, user_path,
                                 overwrite)  # fmt: skip
    files = _tag_files(ckpt, dp, stage)
    result = ReshardResult(None, loc.tag, stage, old_dp, dp, [], zero_stage_from=new_stage and ckpt.zero_stage)
    return out, files, _output_bytes(files, loc.root), result


_FILE_OVERHEAD = 8192  # a torch file's zip records and pickle, and the last block it fills only in part


def _output_bytes(files: dict[str, Any], root: Path) -> int:
    """What the output takes on the disk: every tensor of the tag's files with each file's overhead, and the files
    copied from beside the tag (for a universal output, thousands of small files: the tag folder's size is no
    guide)."""
    tag = files_bytes(files)
    beside = 0
    for item in root.iterdir():
        if item.is_file():
            beside += item.stat().st_size + _FILE_OVERHEAD
        elif item.is_dir() and not any(item.glob("*_model_states.pt")):  # other tags are not copied
            beside += sum(p.stat().st_size + _FILE_OVERHEAD for p in item.rglob("*") if p.is_file())
    return tag + beside


def files_bytes(files: dict[str, Any]) -> int:
    """What torch files (relative path -> object) take on the disk: their tensors and each file's overhead."""
    return sum(_tensor_bytes(obj) + _FILE_OVERHEAD for obj in files.values())


def _finish_folder(
    ckpt: Checkpoint,
    dp: int | None,
    stage: int,
    tmp: Path,
    model_config: hf.ModelConfig | None,
    result: ReshardResult,
) -> list[str]:
    """Everything but the tag's rank files: notes, the files beside the tag, config.json and `latest`; returns the
    files written (relative to `tmp`), which the result lists after the rank files."""
    loc = ckpt.location
    if result.zero_stage_from is not None:
        result.notes.append(
            f"ZeRO-{ckpt.zero_stage} -> ZeRO-{stage}: resume with zero_optimization.stage {stage} in the "
            "DeepSpeed config"
        )
    elif dp is not None and dp == result.dp_from:
        result.notes.append(f"the checkpoint is already at DP {dp}; rewritten as it is, every record checked")
    result.notes += nvme.resume_notes(ckpt)  # the offload config an NVMe-offloaded run's output resumes with
    skip = {loc.tag, "latest", "latest_universal"}
    written: list[str] = []
    result.notes += _copy_root_files(loc.root, tmp, result.dp_from, dp, skip, written)
    if model_config is not None:
        (tmp / "config.json").write_text(json.dumps(model_config.config, indent=2) + "\n")
        written += ["config.json", *hf.copy_side_files(model_config.folder, model_config.side_files, tmp)]
    latest = "latest" if dp else "latest_universal"
    (tmp / latest).write_text(loc.tag)
    written.append(latest)
    if dp is None:
        result.notes.append('load it with "checkpoint": {"load_universal": true} in the DeepSpeed config')
    return list(dict.fromkeys(written))  # --config replaces a copied config.json: listed once


def _records_read(files: dict[str, Any]) -> list[Record]:
    """Every record any rank's files read."""
    records: list[Record] = []
    for obj in files.values():
        for t in _tensors_in(obj):
            if isinstance(t, LazyTensor):
                records.append(t.record)
            else:
                records += [p.tensor.record for p in t.pieces if isinstance(p, Slice)]
    return records


def _tensors_in(obj: Any) -> Iterator[LazyTensor | NewTensor]:
    """Every stored or new tensor a file object holds (in containers and DeepSpeed stand-ins)."""
    if isinstance(obj, LazyTensor | NewTensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors_in(value)
    elif not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
        yield from _tensors_in(vars(obj))


def _tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in _tensors_in(obj))


def universal_tag_files(ckpt: Checkpoint) -> dict[str, Any]:
    """Relative path -> object: the universal tag folder of a checkpoint of any layout that has one."""
    return layout_of(ckpt).universal_files(ckpt)


def _tag_files(ckpt: Checkpoint, dp: int | None, stage: int) -> dict[str, Any]:
    """Relative path in the tag folder -> object: every file the output's tag holds (dp None: universal)."""
    return layout_of(ckpt).tag_files(ckpt, ReshardTarget(dp, stage))


def _write_files(tag_dir: Path, files: dict[str, Any], reader: RecordReader, progress: _ProgressFns) -> None:
    for name in files:
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
    on_start, on_progress = progress
    write_torch_files([(tag_dir / name, obj) for name, obj in files.items()], reader, on_start=on_start,
                      on_progress=on_progress)  # fmt: skip

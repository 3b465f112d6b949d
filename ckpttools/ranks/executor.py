"""One executor for the commands that write an output folder: a plan of files, run on one process or many.

A command plans its output (`OutputPlan`): the folder, its large files (each with the bytes it costs and the
records it reads) and a function that writes any of them into a staging folder, plus what rank 0 writes after
them (index, config, companion files). `execute` runs the plan

- on one process: every file into `staged_folder`, then the CRC-32 of every record read, then the publish;
- on a launcher's ranks sharing one filesystem: the files shared among the ranks by bytes (`plan_by_bytes`) into
  one `shared_staged_folder`, each record's CRC-32 checked by one rank (`check_records`), one publish.

`run_job` is the entry point of a command: it also handles the node-local case (each node holds only its own
ranks' files), where rank 0 gathers the checkpoint (`nodelocal.convert_on_rank0`) and runs the one-process job
on its copy, so every mode runs the same planning and writing code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ckpttools.io.staging import check_output_dir, shared_staged_folder, staged_folder
from ckpttools.io.torchfile import Record, RecordReader
from ckpttools.ranks import nodelocal
from ckpttools.ranks.distributed import check_records, plan_by_bytes

if TYPE_CHECKING:
    from ckpttools.model.checkpoint import Checkpoint
    from ckpttools.ranks.distributed import ProcessGroup

R = TypeVar("R")


@dataclass(frozen=True)
class OutputFile:
    """One large file of the output: its path in the folder, what it costs (bytes read and written, for balancing
    the ranks), the records it reads, and the unit it is written with (files of one unit go to one rank)."""

    name: str
    nbytes: int
    records: Sequence[Record] = ()
    unit: str | None = None  # default: the file alone
    rank0: bool = False  # written by rank 0 (files every rank's share depends on, small ones)


@dataclass
class OutputPlan:
    """What a command writes, planned before anything is (every rank plans the same).

    `write(tmp, files, reader)` writes the given files (this rank's share) into the staging folder `tmp`, reading
    through `reader`; `finish(tmp, reader)` runs on rank 0 after them and returns the names of the small files it
    wrote; `check()` runs on rank 0 before anything is written (a whole-model consistency pass)."""

    folder: Path
    files: list[OutputFile]
    write: Callable[[Path, list[OutputFile], RecordReader], None]
    needed_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    finish: Callable[[Path, RecordReader], list[str]] | None = None
    check: Callable[[], object] | None = None
    records: Sequence[Record] | None = None  # the records to check on many ranks, in this order (default: the files')


@dataclass(frozen=True)
class Executed:
    """The files written (the large ones in plan order, then rank 0's), and on many ranks who wrote each."""

    files: list[str]
    world_size: int | None = None
    ranks: dict[str, int] | None = None


def plan_ranks(files: Sequence[OutputFile], world_size: int) -> dict[str, int]:
    """The rank writing each file: each unit whole to one rank, balanced by bytes; `rank0` files to rank 0."""
    units: dict[str, list[OutputFile]] = {}
    for f in files:
        if not f.rank0:
            units.setdefault(f.unit if f.unit is not None else f.name, []).append(f)
    owners = {f.name: 0 for f in files}
    sizes = [sum(f.nbytes for f in members) for members in units.values()]
    for members, rank in zip(units.values(), plan_by_bytes(sizes, world_size), strict=True):
        owners.update(dict.fromkeys((f.name for f in members), rank))
    return owners


def records_read(files: Sequence[OutputFile]) -> list[Record]:
    """Every record the files read, once each, in a fixed order (every rank computes the same list)."""
    return list({(r.path, r.name): r for f in files for r in f.records}.values())


def execute(plan: OutputPlan, group: ProcessGroup | None = None, *, overwrite: bool = False) -> Executed:
    """Write the plan's folder: on one process, or shared by the ranks of `group` (a filesystem all of them see).

    The folder appears only when every file was written and every record read passed its CRC-32 check; on many
    ranks it is byte-identical to a one-process run, and a failure on any rank fails every rank.
    """
    if group is None or group.world_size == 1:
        return _execute_alone(plan, overwrite)
    return _execute_on_ranks(plan, group, overwrite)


def _execute_alone(plan: OutputPlan, overwrite: bool) -> Executed:
    with RecordReader() as reader:
        if plan.check is not None:
            plan.check()  # before anything is written
        with staged_folder(plan.folder, overwrite=overwrite, needed_bytes=plan.needed_bytes, notes=plan.notes) as tmp:
            _make_parents(tmp, plan.files)
            plan.write(tmp, plan.files, reader)
            extra = plan.finish(tmp, reader) if plan.finish is not None else []
            reader.finish()  # CRC-32 of every record read; raises before anything is published
    return Executed([f.name for f in plan.files] + extra)


def _execute_on_ranks(plan: OutputPlan, group: ProcessGroup, overwrite: bool) -> Executed:
    owners = plan_ranks(plan.files, group.world_size)
    group.run_agreed(lambda: plan.check() if plan.check is not None and group.rank == 0 else None)
    mine = [f for f in plan.files if owners[f.name] == group.rank]
    shared = bool(plan.files)  # else rank 0 writes everything in `finish` and checks what it read itself
    staging = shared_staged_folder(plan.folder, overwrite=overwrite, needed_bytes=plan.needed_bytes, group=group,
                                   notes=plan.notes)  # fmt: skip
    with RecordReader(pieces=shared) as reader, staging as tmp:

        def write() -> list[str]:
            _make_parents(tmp, mine)
            plan.write(tmp, mine, reader)
            if plan.finish is None or group.rank != 0:
                return []
            extra = plan.finish(tmp, reader)
            if not shared:
                reader.finish()
            return extra

        extra = group.run_agreed(write)
        if shared:  # CRC-32 of every record read, each checked by one rank from the pieces all of them read
            check_records(group, reader, plan.records if plan.records is not None else records_read(plan.files))
    extra = json.loads(group.share(json.dumps(extra)))  # rank 0's names, on every rank
    return Executed([f.name for f in plan.files] + extra, group.world_size, {**owners, **dict.fromkeys(extra, 0)})


def _make_parents(tmp: Path, files: Sequence[OutputFile]) -> None:
    for f in files:
        (tmp / f.name).parent.mkdir(parents=True, exist_ok=True)


# --- A command, on one process, on many, or gathered on rank 0 -----------------------------------------------


@dataclass(frozen=True)
class Job(Generic[R]):
    """One command, as `run_job` runs it in every mode.

    `run(path, group, user_path)` opens, plans and writes (through `execute`) on one process (`group` None) or on
    every rank alike; `user_path` maps a path of the checkpoint read to the user's (the identity, except on rank
    0's gathered copy of a node-local checkpoint, where the default output folder is named after the user's
    checkpoint). `to_dict` / `from_dict` carry the result from rank 0 to the others."""

    path: Path
    out_dir: Path | None
    select: dict[str, Any]  # tag, step, best: which checkpoint and tag PATH means
    run: Callable[[Path, ProcessGroup | None, Callable[[Path], Path]], R]
    to_dict: Callable[[R], dict[str, Any]]
    from_dict: Callable[[dict[str, Any]], R]
    check_output: Callable[[Path], object]  # node-local: refuse a bad output folder (given the user's checkpoint)
    optimizer_states: bool  # node-local: whether the job reads the optimizer moments


def run_job(job: Job[R], group: ProcessGroup | None = None) -> R:
    """Run a command: on one process, on the ranks of `group` (one shared folder), or, when each node holds only
    its own ranks' files, gathered on rank 0 and run there as one process, its result on every rank."""
    if group is None or group.world_size == 1:
        return job.run(job.path, None, _same)
    holdings = nodelocal.exchange_holdings(group, job.path)
    if nodelocal.is_shared(holdings):
        return job.run(job.path, group, _same)
    return _gathered(job, group, holdings)


def _same(path: Path) -> Path:
    return path


def output_folder(out_dir: Path | None, default: Callable[[Path], Path], root: Path,
                  user_path: Callable[[Path], Path], overwrite: bool) -> Path:  # fmt: skip
    """The checked output folder of a job reading the checkpoint at `root`: `out_dir`, else `default` of the user's
    checkpoint root; it must overlap neither the user's checkpoint nor the copy read (see `check_output_dir`)."""
    user_root = user_path(root)
    out = check_output_dir(Path(out_dir) if out_dir else default(user_root), user_root, overwrite)
    return out if user_root == root else check_output_dir(out, root, overwrite)


def _gathered(job: Job[R], group: ProcessGroup, holdings: list[nodelocal.Holdings]) -> R:
    """A node-local checkpoint: rank 0 gathers it and runs the one-process job on the copy."""
    from ckpttools.layouts.registry import checkpoint_root, open_checkpoint

    def on_copy(view: Path, user_path: Callable[[Path], Path]) -> dict[str, Any]:
        result = job.to_dict(job.run(view, None, user_path))
        return {**result, "world_size": group.world_size, "ranks": dict.fromkeys(result["files"], 0)}

    def open_view(view: Path) -> Checkpoint:
        return open_checkpoint(view, **job.select)

    steps = nodelocal.GatherSteps(lambda v: checkpoint_root(v, **job.select), job.check_output, open_view, on_copy)
    done = nodelocal.convert_on_rank0(group, job.path, holdings, nodelocal.gather_parent(job.path, job.out_dir),
                                      steps, optimizer_states=job.optimizer_states)  # fmt: skip
    return job.from_dict(done)

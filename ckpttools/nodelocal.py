"""Node-local checkpoint folders: each node holds only its own ranks' files and no filesystem is shared.

Under a launcher every rank lists what it holds under PATH (`exchange_holdings`). When all lists are the same the
folder is shared and the ranks split the work as usual. When they differ, rank 0 gathers (`Gather`):

1. a file several ranks hold must be the same file everywhere (zip directories or contents compared);
2. each file rank 0 lacks comes as a skeleton: every byte but its large storage records, written at the same
   offsets into a sparse file, so the one-process reader parses and validates the whole checkpoint unchanged;
3. the records the conversion reads (consolidate: all but the optimizer moments; reshard: all) come from the
   rank holding them, in chunks over torch.distributed (`ProcessGroup.move`), into those files;
4. rank 0 runs the one-process conversion on that folder, so the output is byte-identical to one process's
   on the whole checkpoint; the other ranks wait and share its result or its failure.

Records that were not fetched stay holes that torchfile refuses to read (`torchfile.mark_absent`): a missed
fetch fails loudly instead of reading zeros. The gathered folder lives beside the output on rank 0's disk (it
holds the bytes fetched, about the size of what the conversion reads from other nodes) and is removed after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import torchfile
from .errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    from .distributed import ProcessGroup
    from .reader import TensorSource, ZeroCheckpoint

# Storage records up to this size travel with the skeleton (scalars, small params); CKPT_SKELETON_RECORD_MAX
# lowers it (the tests send every record on its own).
SKELETON_RECORD_MAX = int(os.environ.get("CKPT_SKELETON_RECORD_MAX") or 1 << 20)
HASHED_FILE_MAX = 64 << 20  # files up to this size are compared by their whole content
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Held:
    """One file a rank holds: its size and what identifies its content."""

    size: int
    fingerprint: str


Holdings = dict[str, Held]  # path relative to PATH -> the file


def list_held(root: Path, fingerprints: bool = True) -> Holdings:
    """Every file under `root` (followed links included), keyed by its path relative to `root`; with
    `fingerprints`, what identifies each one's content too."""
    if not root.is_dir():
        return {}
    held = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            size = path.stat().st_size
            held[path.relative_to(root).as_posix()] = Held(size, fingerprint(path, size) if fingerprints else "")
    return held


def fingerprint(path: Path, size: int) -> str:
    """A zip's directory (every entry's name, size and CRC-32), else the content (its ends for large files)."""
    try:
        with zipfile.ZipFile(path) as zf:
            entries = sorted((i.filename, i.file_size, i.CRC) for i in zf.infolist())
        return "zip:" + hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        pass
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        if size <= HASHED_FILE_MAX:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(fh.read(1 << 20))
            fh.seek(size - (1 << 20))
            digest.update(fh.read())
    return "bytes:" + digest.hexdigest()


def exchange_holdings(group: ProcessGroup, root: Path) -> list[Holdings]:
    """Collective: every rank's holdings under its own `root`, in rank order, on every rank.

    Names and sizes first: when every rank lists the same (a shared folder) that is all. Otherwise the files
    several ranks hold are fingerprinted, so that `check_copies_agree` can compare the copies.
    """
    listed = _gather_holdings(group, group.run_agreed(lambda: list_held(root, fingerprints=False)))
    if is_shared(listed):
        return listed
    counts: dict[str, int] = {}
    for held in listed:
        for rel in held:
            counts[rel] = counts.get(rel, 0) + 1

    def fingerprinted() -> Holdings:
        return {rel: Held(h.size, fingerprint(root / rel, h.size) if counts[rel] > 1 else "")
                for rel, h in listed[group.rank].items()}  # fmt: skip

    return _gather_holdings(group, group.run_agreed(fingerprinted))


def _gather_holdings(group: ProcessGroup, mine: Holdings) -> list[Holdings]:
    text = json.dumps({rel: [h.size, h.fingerprint] for rel, h in mine.items()}, sort_keys=True)
    reports = [json.loads(r) for r in group.gather_bytes(text.encode())]
    for rank, report in enumerate(reports):
        for rel in report:
            _check_relative(rel, rank)
    return [{rel: Held(int(n), str(f)) for rel, (n, f) in report.items()} for report in reports]


def _check_relative(rel: str, rank: int) -> None:
    """A path another rank reports must stay inside the folder (rank 0 creates files under these names)."""
    if any(part in ("..", ".", "") for part in rel.split("/")) or "\\" in rel:
        raise UnsafeCheckpointError(f"rank {rank} reports a file {rel!r} outside its checkpoint folder")


def is_shared(holdings: Sequence[Holdings]) -> bool:
    """Every rank sees the same files: one shared folder (or identical copies)."""
    return all(h == holdings[0] for h in holdings[1:])


def check_copies_agree(holdings: Sequence[Holdings]) -> None:
    """A file two ranks hold must be the same file (a node with a stale or foreign copy would mix runs)."""
    first: dict[str, tuple[int, Held]] = {}
    for rank, held in enumerate(holdings):
        for rel, h in held.items():
            seen = first.setdefault(rel, (rank, h))
            if seen[1] != h:
                raise CorruptCheckpointError(
                    f"{rel} differs between rank {seen[0]} ({seen[1].size} bytes) and rank {rank} ({h.size} bytes): "
                    "each node's copy of a shared file must be the same file; re-copy it from the node that saved it"
                )


def holders(holdings: Sequence[Holdings]) -> dict[str, int]:
    """The rank that serves each file: the lowest that holds it."""
    out: dict[str, int] = {}
    for rank, held in enumerate(holdings):
        for rel in held:
            out.setdefault(rel, rank)
    return out


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + length) of one file, moved from the rank holding it to rank 0."""

    rel: str
    offset: int
    length: int
    holder: int


def skeleton_spans(path: Path, rel: str, holder: int) -> tuple[list[Span], list[str]]:
    """A file's bytes but its large storage records, and the names of those records (left as holes)."""
    size = path.stat().st_size
    try:
        records = torchfile.storage_records(path)
    except (CkptError, zipfile.BadZipFile, OSError, ValueError, EOFError):
        return [Span(rel, 0, size, holder)], []  # not a torch file (or damaged): all of it, the reader judges
    holes = sorted((r for r in records if r.nbytes > SKELETON_RECORD_MAX), key=lambda r: r.offset)
    spans, pos = [], 0
    for r in holes:
        if r.offset > pos:
            spans.append(Span(rel, pos, r.offset - pos, holder))
        pos = max(pos, r.offset + r.nbytes)
    if pos < size:
        spans.append(Span(rel, pos, size - pos, holder))
    return spans, [r.name for r in holes]


def chunked(spans: Sequence[Span], chunk_bytes: int = CHUNK_BYTES) -> list[Span]:
    """Spans of at most `chunk_bytes`, taken from the holders in turn so that they all read at once."""
    per_holder: dict[int, list[Span]] = {}
    for s in spans:
        pieces = per_holder.setdefault(s.holder, [])
        pieces += [Span(s.rel, s.offset + a, min(chunk_bytes, s.length - a), s.holder)
                   for a in range(0, s.length, chunk_bytes)]  # fmt: skip
    queues = [iter(per_holder[h]) for h in sorted(per_holder)]
    out = []
    while queues:
        alive = []
        for q in queues:
            nxt = next(q, None)
            if nxt is not None:
                out.append(nxt)
                alive.append(q)
        queues = alive
    return out


def records_to_fetch(
    ckpt: ZeroCheckpoint, absent: set[tuple[str, str]], *, optimizer_states: bool
) -> set[tuple[str, str]]:
    """The (file, record) holes a conversion of `ckpt` may read: those under its folder (a Trainer output_dir's
    other checkpoints are never read), for a reshard all of them, for a consolidation all but those only the
    optimizer moments use (most of the bytes)."""
    inside = os.path.abspath(ckpt.location.root) + os.sep
    absent = {r for r in absent if r[0].startswith(inside)}
    if optimizer_states:
        return absent

    def records(sources: Iterable[TensorSource]) -> set[tuple[str, str]]:
        return {
            (os.path.abspath(seg.tensor.record.path), seg.tensor.record.name) for src in sources for seg in src.segments
        }

    parts = [ckpt, *ckpt.slices]
    used = records(src for c in parts for src in [*c.masters.values(), *c.bit16.values(), *c.buffers.values()])
    moments = records(src for c in parts for p in c.params for src in p.states.values())
    return {r for r in absent if r in used or r not in moments}


class Gather:
    """Rank 0's copy of a node-local checkpoint: skeletons of the files it lacks, then the records it reads.

    Every method is collective; local work between the collectives runs under `run_agreed`, so a rank that
    fails (a file gone, a full disk) fails every rank instead of leaving them waiting.
    """

    def __init__(self, group: ProcessGroup, root: Path, holdings: list[Holdings], view_parent: Path) -> None:
        self.group, self.root, self.holdings = group, root, holdings
        self.serve = holders(holdings)
        self.missing = sorted(rel for rel in self.serve if rel not in holdings[0])
        self.view_parent = view_parent
        self.view: Path | None = None

    def skeletons(self) -> None:
        """The holders describe the files rank 0 lacks; rank 0 writes them with their large records as holes."""
        mine = self.group.run_agreed(lambda: {rel: self._describe(rel) for rel in self.missing
                                              if self.serve[rel] == self.group.rank})  # fmt: skip
        reports = [json.loads(r) for r in self.group.gather_bytes(json.dumps(mine).encode())]
        described = {rel: d for report in reports for rel, d in report.items()}
        self.view = self.group.run_agreed(lambda: self._make_view() if self.group.rank == 0 else None)
        spans = [Span(rel, o, n, self.serve[rel]) for rel, (ranges, _) in described.items() for o, n in ranges]
        self.group.run_agreed(lambda: self._move(spans))
        if self.view is not None:
            for rel, (_, holes) in described.items():
                torchfile.mark_absent(self.view / rel, holes)

    def records(self, wanted: set[tuple[str, str]]) -> None:
        """The records rank 0 names (holes its conversion reads) come from their holders."""
        text = json.dumps(sorted({(self._rel(path), name) for path, name in wanted})) if self.group.rank == 0 else ""
        by_file: dict[str, list[str]] = {}
        for rel, name in json.loads(self.group.share(text)):
            by_file.setdefault(rel, []).append(name)
        mine = self.group.run_agreed(lambda: {rel: self._record_spans(rel, names) for rel, names in by_file.items()
                                              if self.serve[rel] == self.group.rank})  # fmt: skip
        spans = [Span(rel, o, n, self.serve[rel])
                 for report in self.group.gather_bytes(json.dumps(mine).encode())
                 for rel, ranges in json.loads(report).items() for o, n in ranges]  # fmt: skip
        self.group.run_agreed(lambda: self._move(spans))
        if self.view is not None:
            for rel, names in by_file.items():
                torchfile.mark_present(self.view / rel, names)

    def _rel(self, path: str) -> str:
        assert self.view is not None
        return Path(path).relative_to(self.view.resolve()).as_posix()

    def _describe(self, rel: str) -> tuple[list[tuple[int, int]], list[str]]:
        spans, holes = skeleton_spans(self.root / rel, rel, self.group.rank)
        return [(s.offset, s.length) for s in spans], holes

    def _record_spans(self, rel: str, names: Sequence[str]) -> list[tuple[int, int]]:
        by_name = {r.name: r for r in torchfile.storage_records(self.root / rel)}
        return [(by_name[n].offset, by_name[n].nbytes) for n in names]

    def _make_view(self) -> Path:
        """The folder rank 0 reads: links to its own files, sparse files of the right size for the others."""
        self.view_parent.mkdir(parents=True, exist_ok=True)
        top = Path(tempfile.mkdtemp(prefix=".ckpt-gather-", dir=self.view_parent)).resolve()
        view = top / (self.root.resolve().name or "checkpoint")
        for rel in self.holdings[0]:
            dst = view / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink((self.root / rel).resolve(), dst)
        for rel in self.missing:
            dst = view / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(dst, "wb") as fh:
                fh.truncate(self.holdings[self.serve[rel]][rel].size)
        view.mkdir(exist_ok=True)
        return view

    def _move(self, spans: Sequence[Span]) -> None:
        chunks = chunked(spans)
        files: dict[str, Any] = {}

        def fd(path: Path, mode: str) -> int:
            if str(path) not in files:
                files[str(path)] = open(path, mode)  # noqa: SIM115 - closed below
            return int(files[str(path)].fileno())

        def read(i: int, buf: memoryview) -> None:
            s = chunks[i]
            if os.preadv(fd(self.root / s.rel, "rb"), [buf], s.offset) != s.length:
                raise CorruptCheckpointError(f"{self.root / s.rel} got shorter while it was read; run again")

        def write(i: int, buf: memoryview) -> None:
            assert self.view is not None
            s = chunks[i]
            os.pwrite(fd(self.view / s.rel, "r+b"), buf, s.offset)

        try:
            self.group.move([(c.holder, 0, c.length) for c in chunks], read, write)
        finally:
            for fh in files.values():
                fh.close()

    def cleanup(self) -> None:
        if self.view is not None:
            torchfile.forget_absent(self.view.parent)
            shutil.rmtree(self.view.parent, ignore_errors=True)


@contextmanager
def gathered(group: ProcessGroup, root: Path, holdings: list[Holdings], view_parent: Path,
             open_view: Callable[[Path], ZeroCheckpoint], *,
             optimizer_states: bool) -> Iterator[Path | None]:  # fmt: skip
    """Collective: rank 0's gathered copy of the checkpoint (None on the others), removed on leaving the block.

    `open_view` reads the copy (skeletons only) as the conversion will, to learn which records it reads.
    """
    gather = Gather(group, root, holdings, view_parent)
    try:
        group.run_agreed(lambda: check_copies_agree(holdings))
        gather.skeletons()
        view = gather.view

        def wanted() -> set[tuple[str, str]]:
            if view is None:
                return set()
            with user_paths_in_errors(view, root):
                ckpt = open_view(view)
            return records_to_fetch(ckpt, torchfile.absent_records(), optimizer_states=optimizer_states)

        gather.records(group.run_agreed(wanted))
        yield view
    finally:
        gather.cleanup()


def convert_on_rank0(group: ProcessGroup, root: Path, holdings: list[Holdings], view_parent: Path,
                     open_view: Callable[[Path], ZeroCheckpoint], convert: Callable[[Path], dict[str, Any]], *,
                     optimizer_states: bool) -> dict[str, Any]:  # fmt: skip
    """Collective: gather the checkpoint on rank 0, run `convert` (one process) on the copy there, and return its
    result (a dict naming the user's paths) on every rank; a failure anywhere fails every rank."""
    with gathered(group, root, holdings, view_parent, open_view, optimizer_states=optimizer_states) as view:

        def run() -> dict[str, Any] | None:
            if view is None:
                return None
            with user_paths_in_errors(view, root):
                return convert(view)

        result = group.run_agreed(run)
        text = group.share(map_paths(json.dumps(result), view, root) if result is not None else "")
    return dict(json.loads(text))


@contextmanager
def user_paths_in_errors(view: Path, root: Path) -> Iterator[None]:
    """Errors raised inside name the user's files, not the gathered copy's."""
    try:
        yield
    except CkptError as e:
        e.args = (map_paths(str(e), view, root),)
        raise


def map_paths(text: str, view: Path | None, root: Path) -> str:
    """`text` with the gathered copy's path replaced by the user's PATH (messages and results name the input)."""
    return text if view is None else text.replace(str(view), str(root.resolve()))


def map_path(path: Path, view: Path, root: Path) -> Path:
    """A path inside the gathered copy, as the same path under the user's PATH."""
    return root.resolve() / path.resolve().relative_to(view.resolve())

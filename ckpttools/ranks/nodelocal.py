"""Node-local checkpoint folders: each node holds only its own ranks' files and no filesystem is shared.

Under a launcher every rank lists what it holds under PATH (`exchange_holdings`: names, sizes, mtimes, inodes,
compared by one digest). When all listings are equal the folder is shared and the ranks split the work as usual.
Otherwise rank 0 gathers (`gathered`, `Gather`):

1. a file several ranks hold must be the same file everywhere (copies whose metadata differ are compared by zip
   directory or content);
2. the small files that select the checkpoint (`latest`, trainer_state.json) come whole, the others' names as
   empty files, so rank 0 can tell which checkpoint and tag the command reads, and refuse a bad output folder;
3. each of that checkpoint's files rank 0 lacks comes as a skeleton: every byte but its large storage records, at
   the same offsets in a sparse file, so the one-process reader parses and validates it unchanged;
4. the records the conversion reads (consolidate: all but the optimizer moments; reshard: all) come from the
   ranks holding them, in chunks over torch.distributed (`ProcessGroup.move`), into those files;
5. rank 0 runs the one-process conversion on that copy, so the output is byte-identical to one process's on the
   whole checkpoint; the other ranks wait and share its result or its failure.

Records that were not fetched stay holes that torchfile refuses to read (`torchfile.mark_absent`): a missed
fetch fails loudly instead of reading zeros. The copy lives beside the output on rank 0's disk (it holds the
bytes fetched from the other nodes) and is removed after, failed or not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttools.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError
from ckpttools.io import staging, threads, torchfile

if TYPE_CHECKING:
    from ckpttools.model.checkpoint import Checkpoint, TensorSource
    from ckpttools.ranks.distributed import ProcessGroup

# Storage records up to this size travel with the skeleton (scalars, small params); CKPT_SKELETON_RECORD_MAX
# lowers it (the tests send every record on its own).
SKELETON_RECORD_MAX = int(os.environ.get("CKPT_SKELETON_RECORD_MAX") or 1 << 20)
HASHED_FILE_MAX = 64 << 20  # files up to this size are compared by their whole content
CHUNK_BYTES = 16 << 20
GATHER_NAME = "ckpt-gather"  # rank 0's copy: .ckpt-gather.ckpt-staging.<host>.<pid>.<start>.<hex>
MAX_WINDOW = 32  # chunks in flight per rank while gathering (rank 0 holds this many buffers)


@dataclass(frozen=True)
class Held:
    """One file a rank holds: its size and metadata (equal on every client of a shared filesystem), and, when
    copies on several ranks differ in metadata, what identifies its content."""

    size: int
    mtime_ns: int
    inode: int
    fingerprint: str = ""

    @property
    def content(self) -> tuple[int, str]:
        return self.size, self.fingerprint


Holdings = dict[str, Held]  # path relative to the listed folder -> the file


def listing_root(path: Path) -> tuple[Path, str]:
    """The folder to list for PATH, and PATH inside it: a tag folder's parent (the checkpoint root, where `latest`,
    config and tokenizer files lie), else PATH itself."""
    if path.is_dir() and any(path.glob("*_states.pt")):
        return path.parent, path.name
    return path, ""


def gather_parent(path: Path, out_dir: Path | str | None) -> Path:
    """Where rank 0 keeps its copy: beside the output (the same filesystem), else beside the checkpoint (never
    inside it)."""
    if out_dir is not None and Path(out_dir).absolute().parent.is_dir():
        return Path(out_dir).absolute().parent
    return listing_root(path)[0].resolve().parent


def list_held(root: Path) -> Holdings:
    """Every file under `root` (linked folders followed, each real folder once), keyed by its path relative to it."""
    if not root.is_dir():
        return {}
    held: Holdings = {}
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            try:
                st = path.stat()
            except OSError:
                continue  # a dangling link: not a file this rank holds
            if stat.S_ISREG(st.st_mode):
                held[path.relative_to(root).as_posix()] = Held(st.st_size, st.st_mtime_ns, st.st_ino)
    return held


def fingerprint(path: Path, size: int) -> str:
    """A zip's directory (every entry's name, size and CRC-32), else the content (for files over HASHED_FILE_MAX:
    the size and the first and last MiB)."""
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


def exchange_holdings(group: ProcessGroup, path: Path) -> list[Holdings]:
    """Collective: every rank's holdings under its own `listing_root(path)`, in rank order, on every rank.

    A digest of each listing first: when all are equal (one shared folder) nothing more travels. Otherwise the
    listings, then the fingerprints of the files whose copies on several ranks differ in metadata, so that
    `check_copies_agree` compares their contents.
    """
    root = listing_root(path)[0]
    mine = group.run_agreed(lambda: list_held(root))
    digests = group.gather_bytes(hashlib.sha256(_encode(mine)).digest())
    if all(d == digests[0] for d in digests):
        return [mine] * group.world_size
    listed = _gather_holdings(group, mine)
    versions: dict[str, set[Held]] = {}
    for held in listed:
        for rel, h in held.items():
            versions.setdefault(rel, set()).add(h)
    differing = {rel for rel, v in versions.items() if len(v) > 1}

    def fingerprinted() -> Holdings:
        return {rel: replace(h, fingerprint=fingerprint(root / rel, h.size)) if rel in differing else h
                for rel, h in mine.items()}  # fmt: skip

    return _gather_holdings(group, group.run_agreed(fingerprinted))


def _encode(held: Holdings) -> bytes:
    return json.dumps({rel: [h.size, h.mtime_ns, h.inode, h.fingerprint] for rel, h in held.items()}).encode()


def _gather_holdings(group: ProcessGroup, mine: Holdings) -> list[Holdings]:
    reports = [json.loads(r) for r in group.gather_bytes(_encode(mine))]
    for rank, report in enumerate(reports):
        for rel in report:
            _check_relative(rel, rank)
    return [{rel: Held(int(n), int(t), int(i), str(f)) for rel, (n, t, i, f) in report.items()} for report in reports]


def _check_relative(rel: str, rank: int) -> None:
    """A path another rank reports must stay inside the folder (rank 0 creates files under these names)."""
    if any(part in ("..", ".", "") for part in rel.split("/")) or "\\" in rel:
        raise UnsafeCheckpointError(f"rank {rank} reports a file {rel!r} outside its checkpoint folder")


def is_shared(holdings: Sequence[Holdings]) -> bool:
    """Every rank lists the same files with the same metadata: one shared folder. (Copies on each node, equal or
    not, are gathered on rank 0 instead: its output folder may not be one the others see.)"""
    return all(h == holdings[0] for h in holdings[1:])


def check_copies_agree(holdings: Sequence[Holdings]) -> None:
    """A file two ranks hold must be the same file (a node with a stale or foreign copy would mix runs)."""
    first: dict[str, tuple[int, Held]] = {}
    for rank, held in enumerate(holdings):
        for rel, h in held.items():
            seen = first.setdefault(rel, (rank, h))
            if seen[1].content != h.content:
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


def records_to_fetch(ckpt: Checkpoint, absent: set[tuple[str, str]], *, optimizer_states: bool) -> set[tuple[str, str]]:
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


SELECTOR_MAX = 64 << 20


def is_selector(rel: str, size: int) -> bool:
    """Files that say which checkpoint and tag PATH means (`latest`, trainer_state.json, ...): fetched whole first."""
    name = rel.rsplit("/", 1)[-1]
    return size <= SELECTOR_MAX and (name in ("latest", "latest_universal") or name.endswith(".json"))


class Gather:
    """Rank 0's copy of a node-local checkpoint, built in steps that are each collective (local work between the
    collectives runs under `run_agreed`, so a rank that fails, a file gone or a disk full, fails every rank):

    1. `build_view`: links to rank 0's own files; the files that select the checkpoint (`is_selector`), whole;
       every other file rank 0 lacks as an empty file;
    2. `skeletons(rels)`: the selected checkpoint's files rank 0 lacks, full size with their large records as holes;
    3. `records(wanted)`: the holes the conversion reads.
    """

    def __init__(self, group: ProcessGroup, root: Path, holdings: list[Holdings], view_parent: Path) -> None:
        self.group, self.root, self.holdings = group, root, holdings
        self.serve = holders(holdings)
        self.missing = sorted(rel for rel in self.serve if rel not in holdings[0])
        self.view_parent = view_parent
        self.top: Path | None = None  # the temporary folder, removed by cleanup
        self.view: Path | None = None
        self.notes: list[str] = []  # rank 0's, for the result

    def build_view(self) -> None:
        def make() -> Path | None:
            return self._make_view() if self.group.rank == 0 else None

        self.view = self.group.run_agreed(make)
        selectors = [rel for rel in self.missing if is_selector(rel, self._size(rel))]
        self._move([Span(rel, 0, self._size(rel), self.serve[rel]) for rel in selectors], resize=selectors)

    def skeletons(self, rels: Sequence[str]) -> None:
        """The holders describe the selected files rank 0 lacks; rank 0 writes them, large records left as holes."""
        wanted = [rel for rel in rels if rel in self.serve and rel not in self.holdings[0]]
        mine = self.group.run_agreed(lambda: {rel: self._describe(rel) for rel in wanted
                                              if self.serve[rel] == self.group.rank})  # fmt: skip
        reports = [json.loads(r) for r in self.group.gather_bytes(json.dumps(mine).encode())]
        described = {rel: d for report in reports for rel, d in report.items()}
        spans = [Span(rel, o, n, self.serve[rel]) for rel, (ranges, _) in described.items() for o, n in ranges]
        self._move(spans, resize=wanted)
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
        self._move(spans)
        if self.view is not None:
            for rel, names in by_file.items():
                torchfile.mark_present(self.view / rel, names)

    def _size(self, rel: str) -> int:
        return self.holdings[self.serve[rel]][rel].size

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
        """Links to rank 0's own files and an empty file for each of the others (names are all that locating the
        checkpoint reads of them; an empty file read by mistake fails as damaged, it never reads as zeros)."""
        self.view_parent.mkdir(parents=True, exist_ok=True)
        self.notes += staging.sweep_stale(self.view_parent, GATHER_NAME)  # copies left by runs that were killed
        top = self.view_parent / staging.staging_name(GATHER_NAME)  # owned: a later run removes it once stale
        top.mkdir()
        self.top = top.resolve()
        view = self.top / (self.root.resolve().name or "checkpoint")
        view.mkdir()
        for rel in self.holdings[0]:
            (view / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink((self.root / rel).resolve(), view / rel)
        for rel in self.missing:
            (view / rel).parent.mkdir(parents=True, exist_ok=True)
            (view / rel).touch()
        return view

    def _move(self, spans: Sequence[Span], resize: Sequence[str] = ()) -> None:
        """Collective: the spans' bytes from their holders into rank 0's copy (files in `resize` first get their
        full size)."""

        def run() -> None:
            if self.view is not None:
                for rel in resize:
                    os.truncate(self.view / rel, self._size(rel))
            self._transfer(spans)

        self.group.run_agreed(run)

    def _transfer(self, spans: Sequence[Span]) -> None:
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

        window = min(MAX_WINDOW, max(4, len({c.holder for c in chunks})))  # every holder reading at once
        try:
            self.group.move([(c.holder, 0, c.length) for c in chunks], read, write, window=window)
        finally:
            for fh in files.values():
                fh.close()

    def cleanup(self) -> None:
        if self.top is not None:
            with staging.shielded():
                torchfile.forget_absent(self.top)
                shutil.rmtree(self.top, ignore_errors=True)


def selected_files(holdings: Sequence[Holdings], root_rel: str, tag: str) -> list[str]:
    """The files a conversion of the checkpoint at `root_rel` (relative to the listed folder), tag `tag`, reads: the
    tag folder's and those beside it (config, tokenizer, rng states), not other tags' or checkpoints'."""
    prefix = f"{root_rel}/" if root_rel else ""
    out = set()
    for held in holdings:
        for rel in held:
            inner = rel[len(prefix) :] if rel.startswith(prefix) else None
            if inner is not None and ("/" not in inner or inner.startswith(f"{tag}/")):
                out.add(rel)
    return sorted(out)


@contextmanager
def gathered(group: ProcessGroup, root: Path, holdings: list[Holdings], view_parent: Path, steps: GatherSteps, *,
             optimizer_states: bool, notes: list[str] | None = None) -> Iterator[Path | None]:  # fmt: skip
    """Collective: rank 0's gathered copy of the listed folder `root` (None on the others), removed on leaving.

    Only the checkpoint `steps.locate` picks is gathered; `steps.check_output` refuses a bad output folder before
    any of its bytes move; `steps.open` reads the copy to learn which records the conversion reads.
    """
    gather = Gather(group, root, holdings, view_parent)
    try:
        group.run_agreed(lambda: check_copies_agree(holdings))
        gather.build_view()
        view = gather.view
        if notes is not None:
            notes += gather.notes

        def select() -> str:
            if view is None:
                return ""
            with user_paths_in_errors(view, root):
                ckpt_root, tag = steps.locate(view)
                steps.check_output(map_path(ckpt_root, view, root))
            root_rel = ckpt_root.resolve().relative_to(view.resolve()).as_posix()
            return json.dumps(selected_files(holdings, "" if root_rel == "." else root_rel, tag))

        rels = json.loads(group.share(group.run_agreed(select)))
        gather.skeletons(rels)

        def wanted() -> set[tuple[str, str]]:
            if view is None:
                return set()
            with user_paths_in_errors(view, root):
                ckpt = steps.open(view)
            return records_to_fetch(ckpt, torchfile.absent_records(), optimizer_states=optimizer_states)

        gather.records(group.run_agreed(wanted))
        yield view
    finally:
        gather.cleanup()


@dataclass(frozen=True)
class GatherSteps:
    """What a command does on rank 0 with the gathered copy (each given the copy's listed folder)."""

    locate: Callable[[Path], tuple[Path, str]]  # the checkpoint root and tag the command reads
    check_output: Callable[[Path], object]  # refuse the output folder (given the user's checkpoint root)
    open: Callable[[Path], Checkpoint]  # read the checkpoint, as the command will
    # the one-process conversion of the copy of PATH, given a map from the copy's paths to the user's; its result
    convert: Callable[[Path, Callable[[Path], Path]], dict[str, Any]]


def convert_on_rank0(group: ProcessGroup, path: Path, holdings: list[Holdings], view_parent: Path,
                     steps: GatherSteps, *, optimizer_states: bool) -> dict[str, Any]:  # fmt: skip
    """Collective: gather the checkpoint at the user's `path` on rank 0, run `steps.convert` on the copy there, and
    return its result (naming the user's paths) on every rank; a failure anywhere fails every rank."""
    root, sub = listing_root(path)
    notes: list[str] = []
    with gathered(group, root, holdings, view_parent, steps, optimizer_states=optimizer_states, notes=notes) as view:

        def run() -> dict[str, Any] | None:
            if view is None:
                return None
            with user_paths_in_errors(view, root), threads.whole_node():  # the node's other ranks only wait
                result = steps.convert(view / sub if sub else view, lambda p: map_path(p, view, root))
            return {**result, "notes": notes + list(result.get("notes") or [])} if notes else result

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
    except OSError as e:
        if e.filename is not None:
            e.filename = map_paths(str(e.filename), view, root)
        raise


def map_paths(text: str, view: Path | None, root: Path) -> str:
    """`text` with the gathered copy's path replaced by the user's folder (messages and results name the input)."""
    return text if view is None else text.replace(str(view), str(root.resolve()))


def map_path(path: Path, view: Path, root: Path) -> Path:
    """A path inside the gathered copy, as the same path under the user's folder."""
    return root.resolve() / path.resolve().relative_to(view.resolve())

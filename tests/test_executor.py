"""The executor (ckpttools.ranks.executor): plans shared among ranks by bytes, one-process runs staged and published
whole, output folders named after the user's checkpoint; consolidate's options as one object."""

from pathlib import Path

import pytest

from ckpttools import consolidate
from ckpttools.errors import CorruptCheckpointError, OutputError, UsageError
from ckpttools.io.torchfile import Record, RecordReader
from ckpttools.ops.consolidate import ConsolidateOptions
from ckpttools.ranks import executor
from ckpttools.ranks.executor import OutputFile, OutputPlan

from .conftest import FIXTURES, fixture_names, tree_digest


def _record(path: str, name: str, nbytes: int = 8) -> Record:
    return Record(Path(path), name, 0, nbytes, 0)


def test_plan_ranks_balances_units_by_bytes_and_pins_rank0_files():
    files = [
        OutputFile("big", 100),
        OutputFile("zero/a/fp32.pt", 30, unit="zero/a"),
        OutputFile("zero/a/exp_avg.pt", 30, unit="zero/a"),
        OutputFile("small", 10),
        OutputFile("zero/optimizer_state.pt", 1000, rank0=True),
    ]
    owners = executor.plan_ranks(files, 2)
    assert owners["big"] == 0  # largest first, to the least loaded rank
    assert owners["zero/a/fp32.pt"] == owners["zero/a/exp_avg.pt"] == 1  # a unit goes whole to one rank
    assert owners["small"] == 1
    assert owners["zero/optimizer_state.pt"] == 0  # pinned, and not counted in the balance
    assert set(executor.plan_ranks(files, 1).values()) == {0}


def test_records_read_lists_each_record_once_in_file_order():
    a, b = _record("/x/1.pt", "data/0"), _record("/x/1.pt", "data/1")
    files = [OutputFile("f", 1, (a, b)), OutputFile("g", 1, (b, _record("/x/1.pt", "data/0")))]
    assert executor.records_read(files) == [a, b]


def _plan(out: Path, calls: list[str], fail: bool = False) -> OutputPlan:
    def write(tmp: Path, mine: list[OutputFile], reader: RecordReader) -> None:
        for f in mine:
            calls.append(f"write {f.name}")
            (tmp / f.name).write_text(f.name)
        if fail:
            raise CorruptCheckpointError("damaged")

    def finish(tmp: Path, reader: RecordReader) -> list[str]:
        calls.append("finish")
        (tmp / "index.json").write_text("{}")
        return ["index.json"]

    files = [OutputFile("a.bin", 3), OutputFile("sub/b.bin", 2)]
    return OutputPlan(out, files, write, 0, [], finish, check=lambda: calls.append("check"))


def test_execute_alone_checks_writes_finishes_and_publishes(tmp_path):
    calls: list[str] = []
    done = executor.execute(_plan(tmp_path / "out", calls))
    assert calls == ["check", "write a.bin", "write sub/b.bin", "finish"]
    assert done.files == ["a.bin", "sub/b.bin", "index.json"]
    assert done.world_size is None and done.ranks is None
    assert (tmp_path / "out" / "sub" / "b.bin").read_text() == "sub/b.bin"


def test_execute_alone_publishes_nothing_when_a_write_fails(tmp_path):
    with pytest.raises(CorruptCheckpointError):
        executor.execute(_plan(tmp_path / "out", [], fail=True))
    assert list(tmp_path.iterdir()) == []  # no output, no staging folder


def test_output_folder_is_named_after_the_users_checkpoint_and_refuses_overlap(tmp_path):
    user, copy = tmp_path / "user" / "ckpt", tmp_path / "copy" / "ckpt"
    user.mkdir(parents=True)
    copy.mkdir(parents=True)

    def default(root: Path) -> Path:
        return root.parent / f"hf-{root.name}"

    out = executor.output_folder(None, default, copy, lambda p: user if p == copy else p, overwrite=False)
    assert out == (tmp_path / "user" / "hf-ckpt").absolute()
    with pytest.raises(OutputError):
        executor.output_folder(user / "inside", default, user, lambda p: p, overwrite=False)


def test_consolidate_options_refuse_what_does_not_go_together():
    with pytest.raises(UsageError, match="--to must be one of"):
        ConsolidateOptions(to="gguf").check()
    with pytest.raises(UsageError, match="--base is the base model of a --merge"):
        ConsolidateOptions(base="b").check()
    with pytest.raises(TypeError):
        consolidate("nowhere", bogus=True)


def test_options_object_and_keywords_write_the_same_folder(tmp_path):
    ckpt = FIXTURES / fixture_names()[0] / "checkpoint"
    options = ConsolidateOptions(dtype="bf16", max_shard_size="1KB")
    by_object = consolidate(ckpt, tmp_path / "a", options=options)
    by_keywords = consolidate(ckpt, tmp_path / "b", dtype="bf16", max_shard_size="1KB")
    assert by_object.files == by_keywords.files
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    mixed = consolidate(ckpt, tmp_path / "c", options=options, dtype="fp32")  # keywords override
    assert mixed.dtype == "fp32"

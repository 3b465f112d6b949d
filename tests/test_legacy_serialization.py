"""torch's legacy (non-zip) serialization: files written by real `torch.save(..., _use_new_zipfile_serialization=False)`
(what DeepSpeed's `"checkpoint": {"checkpoint_serialization": false}` makes), read lazily through the allowlist, and
the real DeepSpeed checkpoints saved that way (fixtures/legacy_*) consolidated, verified and resharded bit-identical
to the live engine's own state."""

from __future__ import annotations

import os
import shutil
import struct
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from ckpttools.io import legacyfile
from ckpttools.io.torchfile import (
    RecordReader,
    check_present,
    forget_absent,
    lazy_tensors,
    load_pickle,
    mark_absent,
    storage_records,
)
from tests.support.memo_bombs import FUZZ_INDEX, capped_memory, plant_long_binput

from .conftest import FIXTURES

LEGACY_FIXTURES = [n for n in ("legacy_z1_dp2_bf16", "legacy_z2_dp2_bf16", "legacy_z3_dp2_bf16")
                   if (FIXTURES / n / "checkpoint").is_dir()]  # fmt: skip


def _save_legacy(obj: object, path: Path) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:4] != b"PK\x03\x04"  # really the legacy format
    return path


def _state() -> dict:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    return {
        "w": base,
        "view": base[1:3, ::2],  # a strided view into w's storage: one storage for both
        "bf16": torch.linspace(-2, 2, 10, dtype=torch.bfloat16),
        "ints": torch.tensor([7, 0, -3], dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "nested": OrderedDict(step=2, groups=[{"lr": 0.01, "params": [0, 1]}], t=(torch.ones(2, dtype=torch.half),)),
    }


def _load_all(obj: object, reader: RecordReader) -> object:
    if hasattr(obj, "load"):
        return obj.load(reader)
    if isinstance(obj, dict):
        return {k: _load_all(v, reader) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_load_all(v, reader) for v in obj)
    return obj


def _assert_same(ours: object, theirs: object) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs)
        for k in theirs:
            _assert_same(ours[k], theirs[k])
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs)  # type: ignore[arg-type]
        for a, b in zip(ours, theirs, strict=True):  # type: ignore[call-overload]
            _assert_same(a, b)
    else:
        assert ours == theirs


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


# --- Reading real torch.save legacy files -------------------------------------------------------------------------


def test_legacy_file_reads_like_torch_load(tmp_path):
    path = _save_legacy(_state(), tmp_path / "state.pt")
    obj = load_pickle(path)
    with RecordReader() as reader:
        ours = _load_all(obj, reader)
        reader.finish()
    _assert_same(ours, torch.load(path, weights_only=True))
    assert all(t.record.crc32 is None for t in lazy_tensors(obj))  # the format stores no checksum


def test_a_view_reads_only_its_bytes(tmp_path):
    big = torch.arange(1 << 16, dtype=torch.float32)
    path = _save_legacy({"big": big, "tail": big[-3:]}, tmp_path / "big.pt")
    obj = load_pickle(path)
    with RecordReader() as reader:
        tail = obj["tail"].load(reader)
        reader.finish()  # no CRC to check: nothing more is read for it
        assert reader.bytes_read == 3 * 4
    assert torch.equal(tail, big[-3:])


def test_records_are_the_raw_storages_after_their_counts(tmp_path):
    """Each record starts right after its 8-byte element count and holds the storage's bytes as torch wrote them."""
    t = torch.arange(10, dtype=torch.int16)
    path = _save_legacy({"a": t, "b": torch.ones(3, dtype=torch.float64)}, tmp_path / "r.pt")
    raw = path.read_bytes()
    records = storage_records(path)
    assert {r.nbytes for r in records} == {20, 24}
    for r in records:
        (count,) = struct.unpack("<q", raw[r.offset - 8 : r.offset])
        assert count * (2 if r.nbytes == 20 else 8) == r.nbytes
    last = max(records, key=lambda r: r.offset)
    assert last.offset + last.nbytes == len(raw)
    a = next(r for r in records if r.nbytes == 20)
    assert raw[a.offset : a.offset + 20] == t.numpy().tobytes()
    assert sorted(records, key=lambda r: r.name) == sorted(
        {x.record for x in lazy_tensors(load_pickle(path))}, key=lambda r: r.name
    )


def test_pieces_and_holes_work_on_legacy_records(tmp_path):
    path = _save_legacy({"w": torch.arange(8.0)}, tmp_path / "p.pt")
    lazy = load_pickle(path)["w"]
    with RecordReader(pieces=True) as reader:
        lazy.load(reader)
        assert reader.pieces == []  # nothing to combine into a CRC
        reader.verify_pieces(lazy.record, [])
        assert reader.bytes_read == 32
    mark_absent(path, [lazy.record.name])
    try:
        with pytest.raises(RuntimeError, match="never fetched"):
            check_present(lazy.record)
    finally:
        forget_absent(tmp_path)


def test_opening_reads_the_pickles_and_counts_only(tmp_path, monkeypatch):
    """Bounded memory: opening a 20 MB file reads its pickles and 8 bytes per storage, not the storages."""
    from ckpttools.io import source

    state = {"big": torch.randn(4 << 20), "many": [torch.randn(100) for _ in range(50)], "half": torch.ones(1 << 20)}
    path = _save_legacy(state, tmp_path / "big.pt")
    read = [0]
    plain = source.LocalFile.read_into

    def counting(self: source.LocalFile, offset: int, buffer: memoryview) -> int:
        n = plain(self, offset, buffer)
        read[0] += n
        return n

    monkeypatch.setattr(source.LocalFile, "read_into", counting)
    obj = load_pickle(path)
    assert read[0] < 64 << 10 < path.stat().st_size
    with RecordReader() as reader:
        assert torch.equal(obj["many"][7].load(reader), state["many"][7])
        assert reader.bytes_read == 400


def test_node_local_skeleton_of_a_legacy_file(tmp_path, monkeypatch):
    """ranks.nodelocal gathers a file's bytes but its large records: with the records left as zero-filled holes the
    file still opens, the same records at the same offsets."""
    from ckpttools.ranks import nodelocal

    monkeypatch.setattr(nodelocal, "SKELETON_RECORD_MAX", 16)
    path = _save_legacy({"w": torch.randn(64), "tiny": torch.ones(2), "b": torch.randn(32).half()}, tmp_path / "n.pt")
    spans, holes = nodelocal.skeleton_spans(path, "n.pt", 0)
    records = {r.name: r for r in storage_records(path)}
    assert len(holes) == 2 and set(holes) < set(records)
    raw = path.read_bytes()
    copy = bytearray(len(raw))
    for span in spans:
        copy[span.offset : span.offset + span.length] = raw[span.offset : span.offset + span.length]
    gathered = tmp_path / "gathered" / "n.pt"
    gathered.parent.mkdir()
    gathered.write_bytes(copy)
    assert {r.name: (r.offset, r.nbytes) for r in storage_records(gathered)} == {
        n: (r.offset, r.nbytes) for n, r in records.items()
    }
    with RecordReader() as reader:
        assert torch.equal(load_pickle(gathered)["tiny"].load(reader), torch.ones(2))


def test_all_pickle_protocols_are_recognized(tmp_path):
    for protocol in (2, 3, 4, 5):
        path = tmp_path / f"p{protocol}.pt"
        torch.save({"x": torch.ones(2)}, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        with RecordReader() as reader:
            assert torch.equal(load_pickle(path)["x"].load(reader), torch.ones(2))


# --- Damaged and hostile files: one line each, nothing executed ---------------------------------------------------


def _small(tmp_path: Path) -> Path:
    return _save_legacy({"a": torch.arange(6, dtype=torch.bfloat16), "b": torch.ones(4)}, tmp_path / "s.pt")


def test_truncated_in_the_storages(tmp_path):
    path = _small(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert "truncated" in _one_line(e)


@pytest.mark.parametrize("keep", [10, 120, 200, 400])  # magic number, sys_info, data pickle, key list
def test_truncated_in_the_pickles(tmp_path, keep):
    path = _small(tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CkptErrors) as e:
        load_pickle(path)
    assert any(word in _one_line(e) for word in ("truncated", "cannot read", "magic number")), _one_line(e)


def test_appended_bytes(tmp_path):
    path = _small(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 5)
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert "5 bytes after its last storage" in _one_line(e)


def _last_count_offset(path: Path) -> int:
    last = max(storage_records(path), key=lambda r: r.offset)
    return last.offset - 8


def test_wrong_count_running_past_the_end(tmp_path):
    path = _small(tmp_path)
    raw = bytearray(path.read_bytes())
    at = _last_count_offset(path)
    (count,) = struct.unpack_from("<q", raw, at)
    struct.pack_into("<q", raw, at, count + 1)
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert "runs past the end" in _one_line(e) or "run past the end" in _one_line(e)


def test_count_disagreeing_with_the_pickle(tmp_path):
    """A count one short with the file one element shorter tiles the file exactly: the pickle's numel catches it."""
    path = _small(tmp_path)
    raw = bytearray(path.read_bytes())
    at = _last_count_offset(path)
    (count,) = struct.unpack_from("<q", raw, at)
    itemsize = max(storage_records(path), key=lambda r: r.offset).nbytes // count
    struct.pack_into("<q", raw, at, count - 1)
    path.write_bytes(raw[:-itemsize])
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert "is declared as" in _one_line(e)


def test_negative_count(tmp_path):
    path = _small(tmp_path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<q", raw, _last_count_offset(path), -1)
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    _one_line(e)


def test_damaged_memo_index_is_refused_before_unpickling(tmp_path):
    """Without a CRC a flipped bit reaches the pickle; a memo index far beyond the entries so far would make the
    unpickler allocate a table by its value (in a fuzz run a LONG_BINPUT of 1393191011 got the process OOM-killed)."""
    import io
    import pickletools

    path = _small(tmp_path)
    raw = bytearray(path.read_bytes())
    fh = io.BytesIO(bytes(raw))
    for _ in range(3):  # magic number, protocol version, sys_info
        for _op in pickletools.genops(fh):
            pass
    puts = [pos for op, _, pos in pickletools.genops(fh) if op.name == "BINPUT"]
    raw[puts[2] + 1] = 250  # BINPUT's one-byte index: the third entry claims index 250
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert "memo index 250 after 2 entries" in _one_line(e)


def _pickle_starts(raw: bytes) -> list[int]:
    """Where each of the five pickles of a legacy file starts (magic number, version, sys_info, data, key list)."""
    import io
    import pickletools

    fh, starts = io.BytesIO(raw), []
    for _ in range(5):
        starts.append(fh.tell())
        for _op in pickletools.genops(fh):
            pass
    return starts


@pytest.mark.parametrize("index", [2**31, FUZZ_INDEX])
@pytest.mark.parametrize("which, what", [(3, "data pickle"), (4, "storage key list")])
def test_memo_bomb_is_one_line_without_allocating(tmp_path, index, which, what):
    """A LONG_BINPUT index (the fuzz run's 1393191011, or 2**31) planted in a pickle with more than 256 memo entries,
    so that it has LONG_BINPUTs: refused by the walk, under a memory cap that the unpickler's table would break."""
    path = _save_legacy({f"w{i}": torch.ones(1) for i in range(300)}, tmp_path / "m.pt")
    raw = path.read_bytes()
    path.write_bytes(plant_long_binput(raw, index, _pickle_starts(raw)[which]))
    started = time.perf_counter()
    with capped_memory(), pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert time.perf_counter() - started < 5
    assert f"cannot read the {what}" in _one_line(e) and f"memo index {index} after" in _one_line(e)
    assert str(path) in _one_line(e)


def test_a_long_pickle_is_walked_window_by_window(tmp_path, monkeypatch):
    """A data pickle of ~450 KB, past the walk's first windows (4 KiB, doubling): the walk resumes where each ends."""
    state = {f"layer.{i}.weight": torch.ones(1) for i in range(5000)}
    path = _save_legacy(state, tmp_path / "long.pt")
    walks = []
    plain = legacyfile.pickles.walk
    monkeypatch.setattr(legacyfile.pickles, "walk", lambda *a: walks.append(len(a[0])) or plain(*a))
    obj = load_pickle(path)
    assert len(obj) == 5000 and len(walks) > 5 and walks[:3] == [4096] * 3  # 3 framing pickles in the first


def test_wrong_magic_number(tmp_path):
    path = _small(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0xFF  # inside the magic number's bytes: no longer torch's, so not taken for a legacy file at all
    path.write_bytes(raw)
    with pytest.raises(CkptErrors) as e:
        load_pickle(path)
    assert "magic number" in _one_line(e)


CkptErrors = (CorruptCheckpointError, UnsupportedCheckpointError)


class _Payload:
    """Pickles as a call of os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_foreign_global_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    path = _save_legacy({"w": torch.ones(2), "x": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError) as e:
        load_pickle(path)
    assert "refusing to unpickle" in _one_line(e)
    with pytest.raises(UnsafeCheckpointError):
        storage_records(path)  # the pass that finds the storages' dtypes goes through the same allowlist
    assert not marker.exists()


def test_foreign_global_in_the_framing_is_refused(tmp_path):
    """The small pickles before the data pickle accept no global at all."""
    import pickle

    marker = tmp_path / "ran"
    path = _small(tmp_path)
    raw = path.read_bytes()
    magic = pickle.dumps(legacyfile.MAGIC_NUMBER, protocol=2)
    version = pickle.dumps(legacyfile.PROTOCOL_VERSION, protocol=2)
    assert raw.startswith(magic + version)
    path.write_bytes(magic + version + pickle.dumps(_Payload(marker), protocol=2) + raw[len(magic + version) :])
    with pytest.raises(UnsafeCheckpointError) as e:
        load_pickle(path)
    _one_line(e)
    assert not marker.exists()


def test_storage_listed_but_used_by_no_tensor(tmp_path):
    """torch.save lists exactly the storages its pickle uses; a file that lists another was altered."""
    path = _small(tmp_path)
    other = _save_legacy({"a": torch.arange(6, dtype=torch.bfloat16)}, tmp_path / "other.pt")
    # a's pickle with b's storage key list and storages: the keys differ (they are storage addresses)
    _splice_data_pickle(other, path, tmp_path / "mixed.pt")
    with pytest.raises(CorruptCheckpointError) as e:
        load_pickle(tmp_path / "mixed.pt")
    assert "belongs to no tensor" in _one_line(e)


def _splice_data_pickle(pickle_from: Path, rest_from: Path, out: Path) -> None:
    """`pickle_from`'s framing and data pickle followed by `rest_from`'s key list and storages."""
    import pickle

    def after_data_pickle(path: Path) -> int:
        import io

        fh = io.BytesIO(path.read_bytes())
        for _ in range(3):
            pickle.load(fh)

        class Skip(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> object:
                return lambda *a, **k: None

            def persistent_load(self, pid: object) -> None:
                return None

        Skip(fh).load()
        return fh.tell()

    a, b = pickle_from.read_bytes(), rest_from.read_bytes()
    out.write_bytes(a[: after_data_pickle(pickle_from)] + b[after_data_pickle(rest_from) :])


def test_plain_pickle_is_not_taken_for_a_torch_file(tmp_path):
    import pickle

    path = tmp_path / "plain.pt"
    path.write_bytes(pickle.dumps({"w": [1, 2]}, protocol=2))
    with pytest.raises(UnsupportedCheckpointError) as e:
        load_pickle(path)
    assert "magic number" in _one_line(e)


# --- Real DeepSpeed checkpoints saved with "checkpoint_serialization": false ---------------------------------------


def _engine_references(name: str) -> tuple[dict, dict]:
    full = load_file(FIXTURES / name / "reference" / "full_state.safetensors")
    bit16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    return full, bit16


def _folder(out: Path) -> dict:
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_fixture_files_are_legacy(name):
    files = sorted((FIXTURES / name / "checkpoint").rglob("*.pt"))
    assert files and all(legacyfile.is_legacy(p.read_bytes()[:32]) for p in files)


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_consolidate_matches_the_live_engine(name, tmp_path):
    from ckpttools import consolidate

    consolidate(FIXTURES / name / "checkpoint", tmp_path / "fp32")
    full, bit16 = _engine_references(name)
    ours = _folder(tmp_path / "fp32")
    fp32 = {k.removeprefix("fp32/"): v for k, v in full.items() if k.startswith("fp32/")}
    assert fp32
    for key, expected in fp32.items():
        assert torch.equal(ours[key], expected), key
    consolidate(FIXTURES / name / "checkpoint", tmp_path / "bf16", dtype="bf16")
    ours16 = _folder(tmp_path / "bf16")
    for key in fp32:
        assert torch.equal(ours16[key], bit16[key]), key


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_verify_against_the_legacy_checkpoint(name, tmp_path):
    from ckpttools import consolidate, verify_folder

    consolidate(FIXTURES / name / "checkpoint", tmp_path / "out")
    report = verify_folder(tmp_path / "out", against=FIXTURES / name / "checkpoint")
    assert report.ok, report


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_cli_consolidates_and_names_a_damaged_rank_file(name, tmp_path):
    from click.testing import CliRunner

    from ckpttools.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name / "checkpoint", ckpt)
    res = CliRunner().invoke(main, ["consolidate", str(ckpt), "--out", str(tmp_path / "ok")])
    assert res.exit_code == 0, res.output
    optim = max(ckpt.rglob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-100])
    res = CliRunner().invoke(main, ["consolidate", str(ckpt), "--out", str(tmp_path / "bad")])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code != 0 and len(lines) == 1 and "truncated" in lines[0], res.stderr
    assert optim.name in lines[0] and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_reshard_keeps_every_value(name, tmp_path):
    """Resharded (written as zip files) to DP 1 and DP 4: fp32 masters and Adam moments unchanged."""
    from ckpttools import consolidate, read_checkpoint, reshard

    full, _ = _engine_references(name)
    for dp in (1, 4):
        out = tmp_path / f"dp{dp}"
        reshard(FIXTURES / name / "checkpoint", out, dp=dp)
        consolidate(out, tmp_path / f"fp32_dp{dp}")
        ours = _folder(tmp_path / f"fp32_dp{dp}")
        for key, expected in full.items():
            if key.startswith("fp32/"):
                assert torch.equal(ours[key.removeprefix("fp32/")], expected), (dp, key)
        ckpt = read_checkpoint(out)
        assert ckpt.dp_world_size == dp


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_universal_form_carries_masters_and_moments(name, tmp_path):
    """Per-parameter fp32 masters and Adam moments (reshard --universal) against safe_get_full_fp32_param /
    safe_get_full_optimizer_state on the live engine; also after a detour through DP 4."""
    from ckpttools import reshard

    full, _ = _engine_references(name)
    reshard(FIXTURES / name / "checkpoint", tmp_path / "dp4", dp=4)
    for src, out in ((FIXTURES / name / "checkpoint", tmp_path / "u"), (tmp_path / "dp4", tmp_path / "u4")):
        reshard(src, out, universal=True)
        zero = out / "global_step2" / "zero"
        checked = 0
        for key, expected in full.items():
            state, param = key.split("/", 1)
            ours = torch.load(zero / param / f"{state}.pt", weights_only=True)["param"]
            assert torch.equal(ours.reshape(expected.shape), expected), (src, key)
            checked += 1
        assert checked == len(full) and {k.split("/")[0] for k in full} == {"fp32", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_zero_to_fp32_drop_in_reads_what_deepspeeds_own_cannot(name):
    """DeepSpeed's zero_to_fp32 loads with mmap=True, which torch refuses for legacy files (its error is in meta.json);
    the drop-in reads them."""
    import json

    from ckpttools.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    assert not meta["zero_to_fp32"]["ok"] and "mmap can only be used" in meta["zero_to_fp32"]["error"]
    ours = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / name / "checkpoint"))
    full, _ = _engine_references(name)
    for key, expected in full.items():
        if key.startswith("fp32/"):
            assert torch.equal(ours[key.removeprefix("fp32/")], expected), key

import os
import pickle
import pickletools
import re
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckpttools.io import pickles
from ckpttools.io.torchfile import LazyTensor, RecordReader, _AllowlistUnpickler, lazy_tensors, load_pickle
from tests.support.memo_bombs import BOMB, FUZZ_INDEX, capped_memory, plant_long_binput

from .conftest import FIXTURES, fixture_names


def _materialise(obj, reader):
    if isinstance(obj, LazyTensor):
        return obj.load(reader)
    if isinstance(obj, dict):
        return {k: _materialise(v, reader) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialise(v, reader) for v in obj)
    return obj


def _assert_same(a, b, where="root"):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(b, dict):
        assert list(a) == list(b), where
        for k in b:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")


def test_views_dtypes_and_scalars_match_torch_load(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    obj = {
        "a": base,
        "view": base[3:9],
        "t": base.view(4, 5).t(),
        "bf16": base.bfloat16(),
        "i": torch.tensor(3),
        "empty": torch.empty(0, dtype=torch.bfloat16),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
    }
    torch.save(obj, tmp_path / "x.pt")
    with RecordReader() as reader:
        ours = _materialise(load_pickle(tmp_path / "x.pt"), reader)
        reader.finish()
    _assert_same(ours, torch.load(tmp_path / "x.pt", weights_only=True))
    assert ours["size"] == (2, 3) and ours["dtype"].name == "float16"


def _pt_files():
    files = []
    for name in fixture_names():
        files += sorted((FIXTURES / name).rglob("*.pt"))
    return files


@pytest.mark.parametrize("path", _pt_files()[:40], ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_file_reads_like_torch_load(path):
    """Our allowlisted lazy reader sees exactly what DeepSpeed's own (unrestricted) load sees."""
    pytest.importorskip("deepspeed")
    expected = torch.load(path, weights_only=False, map_location="cpu")
    with RecordReader() as reader:
        ours = _materialise(load_pickle(path), reader)
        reader.finish()
    _assert_same(ours, expected)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickled_code_is_refused_and_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"x": torch.ones(2), "evil": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"refusing to unpickle 'posix\.system'|refusing to unpickle 'os\.system'"
    ):
        load_pickle(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def _tensor_file(tmp_path: Path) -> tuple[Path, LazyTensor]:
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "w.pt")
    return tmp_path / "w.pt", load_pickle(tmp_path / "w.pt")["w"]


def test_damaged_tensor_bytes_fail_the_crc_check(tmp_path):
    path, lazy = _tensor_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[lazy.record.offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    lazy = load_pickle(path)["w"]  # the pickle itself is intact
    with RecordReader() as reader:
        lazy.load(reader)
        with pytest.raises(CorruptCheckpointError, match="CRC-32"):
            reader.finish()


def test_crc_is_checked_for_partly_read_records(tmp_path):
    path, lazy = _tensor_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[lazy.record.offset + lazy.record.nbytes - 1] ^= 0x01  # a byte nobody asks for
    path.write_bytes(bytes(data))
    lazy = load_pickle(path)["w"]
    buf = memoryview(bytearray(16))
    with RecordReader() as reader:
        reader.readinto(lazy.record, 0, buf)
        with pytest.raises(CorruptCheckpointError, match="CRC-32"):
            reader.finish()


@pytest.mark.parametrize("pieces", [[], [(64, 16)], [(0, 40), (30, 50), (200, 8)], [(8, 8), (0, 32)]],
                         ids=["none", "one", "overlapping", "covered"])  # fmt: skip
def test_a_record_is_checked_from_the_pieces_ranks_read(tmp_path, pieces):
    """Ranks sharing a conversion log (start, length, CRC-32) of what they read; the checking rank combines them
    and reads only what no piece covers: damage anywhere, inside a piece or between them, is caught."""
    import zlib

    path, lazy = _tensor_file(tmp_path)
    record = lazy.record
    good = path.read_bytes()[record.offset : record.offset + record.nbytes]
    logged = [(s, n, zlib.crc32(good[s : s + n])) for s, n in pieces]
    covered = sum(n for _, n in pieces)
    with RecordReader(pieces=True) as reader:
        reader.verify_pieces(record, logged)  # intact
        assert reader.bytes_read <= record.nbytes - covered + 64  # what the pieces cover is not read again
    for where in (3, 100, record.nbytes - 1):
        data = bytearray(path.read_bytes())
        data[record.offset + where] ^= 0x01
        path.write_bytes(bytes(data))
        with RecordReader(pieces=True) as reader, pytest.raises(CorruptCheckpointError, match="CRC-32"):
            # the pieces' CRCs are of the bytes as their ranks read them: damage inside one is seen in its CRC
            damaged = bytes(data[record.offset : record.offset + record.nbytes])
            reader.verify_pieces(record, [(s, n, zlib.crc32(damaged[s : s + n])) for s, n in pieces])
        data[record.offset + where] ^= 0x01
        path.write_bytes(bytes(data))


def test_reads_in_pieces_mode_are_logged_not_checked(tmp_path):
    _path, lazy = _tensor_file(tmp_path)
    with RecordReader(pieces=True) as reader:
        reader.readinto(lazy.record, 64, memoryview(bytearray(16)))
        reader.finish()  # nothing tracked: another rank may check this record
        assert reader.bytes_read == 16
        assert [(s, n) for _, s, n, _ in reader.pieces] == [(64, 16)]


def test_truncated_file_is_corrupt(tmp_path):
    path, _ = _tensor_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CorruptCheckpointError):
        load_pickle(path)


def test_garbage_file_is_corrupt(tmp_path):
    (tmp_path / "g.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CorruptCheckpointError, match="not a torch checkpoint"):
        load_pickle(tmp_path / "g.pt")


def test_legacy_serialization_is_read(tmp_path):
    """Once refused by name; now read (tests/test_legacy_serialization.py), its records without a CRC-32."""
    torch.save({"w": torch.ones(3)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    lazy = load_pickle(tmp_path / "old.pt")["w"]
    assert lazy.record.crc32 is None and lazy.shape == (3,)


def test_lazy_tensors_walks_nested_structures(tmp_path):
    torch.save({"a": [torch.ones(1), {"b": (torch.zeros(2),)}], "c": 3}, tmp_path / "n.pt")
    assert len(lazy_tensors(load_pickle(tmp_path / "n.pt"))) == 2


# --- Memo bombs: a memo index that would make the unpickler allocate by its value -----------------------------------


def _walk_objects() -> list[object]:
    return [
        {"a": [1, 2.5, "x" * 300, b"y" * 70000, None, True, (1, 2), {3, 4}, frozenset([5]), bytearray(b"zz")]},
        {"big": [2**100, -(2**70), 2**40, -5], "text": "é\n\\u\r\x1a", "float": 1.5, "cls": int},
        [[f"s{i}"] * 3 for i in range(400)],  # past 256 memo entries: LONG_BINPUT / LONG_BINGET
        OrderedDict(step=2, groups=[{"lr": 0.1}] * 3),
    ]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_walk_ends_where_pickletools_does_and_resumes_after_a_cut(protocol):
    for obj in _walk_objects():
        data = pickle.dumps(obj, protocol=protocol)
        ends = [pos for _, _, pos in pickletools.genops(data)]
        assert pickles.walk(data + b"trailing") == ends[-1] + 1 == len(data)
        for cut in range(0, len(data), max(1, len(data) // 500)):
            with pytest.raises(pickles.Truncated) as e:
                pickles.walk(data[:cut])
            assert pickles.walk(data, e.value.at, e.value.puts) == len(data)  # resumed over the whole


def test_walk_of_a_real_data_pkl():
    path = next(p for p in sorted(FIXTURES.glob("z3_dp2_bf16/checkpoint/*/*.pt")))
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    assert pickles.walk(data) == len(data)


@pytest.mark.parametrize(
    "bomb, reason",
    [
        (BOMB, "memo index 2147483648 after 0 entries"),
        (b"}p2147483648\n.", "memo index 2147483648 after 0 entries"),  # protocol 0's decimal PUT
        (b"]\x94r" + FUZZ_INDEX.to_bytes(4, "little") + b".", f"memo index {FUZZ_INDEX} after 1 entries"),
        (b"\x80\x02}q\x05.", "memo index 5 after 0 entries"),
        (b"}p-1\n.", "memo index -1 after 0 entries"),
        (b"}pxyz\n.", "not a number"),
        (b"}\xff.", "unknown opcode"),
    ],
)
def test_walk_refuses_memo_bombs(bomb, reason):
    with pytest.raises(pickles.Damaged, match=re.escape(reason)):
        pickles.walk(bomb)


def test_a_memo_bomb_is_real():
    """Why the walk exists: CPython's unpickler allocates the table (here failing under a cap, else OOM-killed)."""
    with capped_memory(), pytest.raises(MemoryError):
        pickle.loads(BOMB)


def _rezip(path: Path, member: str, data: bytes) -> None:
    """Rewrite the zip at `path` with `member` replaced by `data`, every CRC correct (a crafted file, not damage)."""
    with zipfile.ZipFile(path) as zf:
        members = [(info.filename, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, content in members:
            zf.writestr(name, data if name == member else content)


@pytest.mark.parametrize("index", [2**31, FUZZ_INDEX])
def test_memo_bomb_in_a_zip_data_pkl_is_one_line(tmp_path, index):
    path = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.ones(1) for i in range(100)}, path)  # > 256 memo entries: LONG_BINPUTs
    with zipfile.ZipFile(path) as zf:
        data = zf.read("m/data.pkl")
    _rezip(path, "m/data.pkl", plant_long_binput(data, index))
    started = time.perf_counter()
    with capped_memory(), pytest.raises(CorruptCheckpointError) as e:
        load_pickle(path)
    assert time.perf_counter() - started < 5
    message = str(e.value)
    assert "\n" not in message and str(path) in message and f"memo index {index} after" in message


def test_memo_bomb_as_the_whole_data_pkl(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(1)}, path)
    _rezip(path, "m/data.pkl", BOMB)
    with capped_memory(), pytest.raises(CorruptCheckpointError, match="memo index 2147483648 after 0 entries"):
        load_pickle(path)


def test_every_allowlist_unpickler_walks_first():
    """DCP chunks (torch.save zips inside .distcp files) unpickle through the same class."""
    with capped_memory(), pytest.raises(CorruptCheckpointError, match=r"x\.distcp: .*memo index 2147483648"):
        _AllowlistUnpickler(BOMB, {}, Path("x.distcp"))

import os
from pathlib import Path

import pytest
import torch

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckpttools.io.torchfile import LazyTensor, RecordReader, lazy_tensors, load_pickle

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

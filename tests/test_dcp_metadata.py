"""The DCP `.metadata` reader (allowlist, field checks) and the chunk tiling, piece by piece."""

from __future__ import annotations

import pickle
import pickletools
import time
from pathlib import Path

import pytest

from ckpttools.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, Record, StorageRef
from ckpttools.layouts.dcp.chunks import tensor_segments
from ckpttools.layouts.dcp.metadata import Chunk, StoredChunk, TensorEntry, _is_plain_name, parse_metadata
from tests.support.memo_bombs import FUZZ_INDEX, capped_memory

from .conftest import FIXTURES

METADATA = sorted(FIXTURES.glob("fsdp2_*/checkpoint/*/.metadata"))


def _stored(i: int) -> StoredChunk:
    return StoredChunk(f"__{i}_0.distcp", 0, 100, ())


def _tensor(shape: tuple[int, ...], i: int) -> LazyTensor:
    n = 1
    for s in shape:
        n *= s
    record = Record(Path(f"__{i}_0.distcp"), f"r{i}", 0, n * 4, 0)
    stride = tuple(int(x) for x in _strides(shape))
    return LazyTensor(StorageRef(record, dtypes.FLOAT32), 0, shape, stride)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    acc = 1
    for s in reversed(shape):
        out.insert(0, acc)
        acc *= s
    return out


def _entry(size: tuple[int, ...], blocks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorEntry:
    return TensorEntry("w", dtypes.FLOAT32, size, tuple(Chunk(o, s, _stored(i)) for i, (o, s) in enumerate(blocks)))


def _flat(entry: TensorEntry) -> list[tuple[str, int, int]]:
    tensors = [_tensor(c.sizes, i) for i, c in enumerate(entry.chunks)]
    return [(seg.tensor.record.name, seg.start, seg.count) for seg in tensor_segments(entry, tensors)]


@pytest.mark.parametrize("path", METADATA, ids=lambda p: p.parts[-4])
def test_real_metadata_parses_into_every_tensor(path):
    meta = parse_metadata(path.read_bytes(), str(path))
    assert meta.tensors and all(e.chunks for e in meta.tensors.values())
    assert any(k.startswith("model.") for k in meta.tensors)
    assert all(meta.file_ends[c.stored.relative_path] >= c.stored.offset + c.stored.length
               for e in meta.tensors.values() for c in e.chunks)  # fmt: skip


def test_dim0_shards_are_one_segment_each():
    entry = _entry((5, 3), [((0, 0), (3, 3)), ((3, 0), (2, 3))])
    assert _flat(entry) == [("r0", 0, 9), ("r1", 0, 6)]


def test_uneven_and_empty_shards():
    entry = _entry((2, 4), [((0, 0), (1, 4)), ((1, 0), (1, 4)), ((2, 0), (0, 4))])
    assert _flat(entry) == [("r0", 0, 4), ("r1", 0, 4)]


def test_2d_blocks_interleave_by_row():
    entry = _entry((2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))])
    assert _flat(entry) == [("r0", 0, 2), ("r1", 0, 2), ("r0", 2, 2), ("r1", 2, 2)]


def test_a_scalar_is_one_element():
    assert _flat(_entry((), [((), ())])) == [("r0", 0, 1)]


def test_overlap_and_holes_are_refused():
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        _flat(_entry((4,), [((0,), (3,)), ((2,), (2,))]))
    with pytest.raises(CorruptCheckpointError, match="uncovered"):
        _flat(_entry((4,), [((0,), (1,)), ((2,), (2,))]))
    with pytest.raises(CorruptCheckpointError, match="hold 2 of its 4"):
        _flat(_entry((4,), [((0,), (2,))]))


def test_storage_paths_must_stay_in_the_folder():
    assert _is_plain_name("__0_0.distcp")
    for bad in ("../x.distcp", "/etc/passwd", "a\\..\\b", "", "C:/x", "a/../../b"):
        assert not _is_plain_name(bad), bad


def test_only_dcp_classes_are_unpickled():
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.eval"):
        parse_metadata(b"cbuiltins\neval\n(S'1'\ntR.", "m")
    with pytest.raises(CorruptCheckpointError, match="does not hold"):
        parse_metadata(pickle.dumps([1, 2]), "m")
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        parse_metadata(b"\x80\x04garbage", "m")


def _memoize_to_long_binput(data: bytes, index: int) -> bytes:
    """A protocol-4 pickle with its first MEMOIZE replaced by a LONG_BINPUT of `index` (4 bytes longer), the frame
    around it lengthened to match: a crafted file the unpickler reads up to the bomb."""
    ops = [(op.name, arg, int(pos or 0)) for op, arg, pos in pickletools.genops(data)]
    at = next(pos for name, _, pos in ops if name == "MEMOIZE")
    frame_at, frame_len = max((pos, int(arg or 0)) for name, arg, pos in ops if name == "FRAME" and pos < at)
    data = data[:at] + b"r" + index.to_bytes(4, "little") + data[at + 1 :]
    return data[: frame_at + 1] + (frame_len + 4).to_bytes(8, "little") + data[frame_at + 9 :]


@pytest.mark.parametrize("index", [2**31, FUZZ_INDEX])
def test_memo_bomb_in_metadata_is_one_line_without_allocating(index):
    path = METADATA[0]
    data = _memoize_to_long_binput(path.read_bytes(), index)
    started = time.perf_counter()
    with capped_memory(), pytest.raises(CorruptCheckpointError) as e:
        parse_metadata(data, str(path))
    assert time.perf_counter() - started < 5
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and f"memo index {index} after 0 entries" in message

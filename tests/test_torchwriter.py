"""torch.save-compatible files streamed from other files: same pickle bytes as torch.save, exact tensors."""

import subprocess
import sys
import zipfile
from collections import OrderedDict

import pytest
import torch

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io.dtypes import FLOAT32
from ckpttools.io.torchfile import RecordReader, lazy_tensors, load_pickle
from ckpttools.io.torchwriter import Fill, NewTensor, Slice, write_torch_file, write_torch_files

from .conftest import FIXTURES, fixture_names

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402


def _deepspeed_like_state():
    flat = torch.randn(1000)
    return {
        "flat": flat,
        "view": flat[10:110].view(10, 10),
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "step": torch.tensor(7),
        "loss_scaler": DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                         consecutive_hysteresis=False, dtype=torch.float16),
        "zero_stage": ZeroStageEnum.gradients,
        "shape": torch.Size([3, 4]),
        "device": torch.device("cpu"),
        "hooks": OrderedDict(a=1),
        "dtype": torch.bfloat16,
        "groups": [{"lr": 1e-3, "params": [0, 1]}],
    }  # fmt: skip


def _pickle_bytes(path):
    with zipfile.ZipFile(path) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))


def test_rewritten_file_has_torch_saves_exact_pickle_and_loads_with_deepspeeds_classes(tmp_path):
    state = _deepspeed_like_state()
    torch.save(state, tmp_path / "src.pt")
    with RecordReader() as reader:
        write_torch_file(tmp_path / "out.pt", load_pickle(tmp_path / "src.pt"), reader)
        reader.finish()
    assert _pickle_bytes(tmp_path / "out.pt") == _pickle_bytes(tmp_path / "src.pt")
    for mmap in (False, True):
        back = torch.load(tmp_path / "out.pt", weights_only=False, mmap=mmap)
        for key in ("flat", "view", "bf16", "step"):
            assert torch.equal(back[key], state[key]) and back[key].dtype == state[key].dtype
        assert type(back["loss_scaler"]) is DynamicLossScaler
        assert back["loss_scaler"].__dict__ == state["loss_scaler"].__dict__
        assert back["zero_stage"] is ZeroStageEnum.gradients
        assert back["shape"] == state["shape"] and back["device"] == state["device"] and back["dtype"] is torch.bfloat16


def _rank_files(name):
    return sorted(p for p in (FIXTURES / name).rglob("*_states.pt"))


@pytest.mark.parametrize("name", [n for n in fixture_names() if not n.startswith("gpu/")])
def test_every_deepspeed_file_rewritten_unchanged_has_the_same_pickle_bytes(name, tmp_path):
    """Tensors with requires_grad (fp32 masters), ZeRO-3's ds_id attributes, loss scalers, ds_config: all as written."""
    for path in _rank_files(name):
        with RecordReader() as reader:
            write_torch_file(tmp_path / path.name, load_pickle(path), reader)
        assert _pickle_bytes(tmp_path / path.name) == _pickle_bytes(path), path


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) and a.requires_grad == b.requires_grad and a.__dict__ == b.__dict__
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


@pytest.mark.parametrize("name", [n for n in fixture_names() if n.startswith("gpu/")])
def test_gpu_written_files_load_back_equal_with_storages_on_the_cpu(name, tmp_path):
    """The one deliberate difference: storages are written with location "cpu" (no map_location needed)."""
    for path in _rank_files(name):
        with RecordReader() as reader:
            write_torch_file(tmp_path / path.name, load_pickle(path), reader)
        ours = torch.load(tmp_path / path.name, weights_only=False)
        assert _same(torch.load(path, weights_only=False, map_location="cpu"), ours), path


def test_new_tensors_are_assembled_from_slices_and_zero_fills_across_many_chunks(tmp_path):
    a, b = torch.randn(5000), torch.randn(3000)
    torch.save({"a": a, "b": b}, tmp_path / "src.pt")
    src = load_pickle(tmp_path / "src.pt")
    pieces = (Slice(src["b"], 100, 2000), Fill(777), Slice(src["a"], 0, 5000), Fill(3))
    obj = {"joined": NewTensor(FLOAT32, pieces), "square": NewTensor(FLOAT32, (Slice(src["a"], 4, 16),), (4, 4))}
    with RecordReader() as reader:
        write_torch_files([(tmp_path / "out.pt", obj)], reader, chunk_bytes=4096)  # many chunks, buffers reused
        reader.finish()
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(back["joined"], torch.cat([b[100:2100], torch.zeros(777), a, torch.zeros(3)]))
    assert torch.equal(back["square"], a[4:20].view(4, 4))


def test_several_files_in_one_pass_with_aligned_records_and_shared_storages_written_once(tmp_path):
    x = torch.randn(64, 32)
    torch.save({"x": x, "t": x.t(), "row": x[3]}, tmp_path / "src.pt")
    src = load_pickle(tmp_path / "src.pt")
    files = [(tmp_path / f"out{i}.pt", {"i": i, **src}) for i in range(3)]
    with RecordReader() as reader:
        written = write_torch_files(files, reader, chunk_bytes=1000)
    assert written == sum(p.stat().st_size for p, _ in files)
    for path, _ in files:
        back = torch.load(path, weights_only=True, mmap=True)
        assert torch.equal(back["t"], x.t()) and torch.equal(back["row"], x[3])
        assert back["t"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
        with zipfile.ZipFile(path) as zf:
            data = [i for i in zf.infolist() if "/data/" in i.filename]
            assert len(data) == 1  # one storage for the three views, as torch.save writes it
            for info in data:
                name_len, extra_len = len(info.filename.encode()), len(info.extra)
                assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0


def test_a_damaged_source_record_is_reported_not_laundered_into_a_fresh_crc(tmp_path):
    torch.save({"w": torch.randn(100_000)}, tmp_path / "src.pt")
    src = load_pickle(tmp_path / "src.pt")
    record = lazy_tensors(src)[0].record
    with open(tmp_path / "src.pt", "r+b") as fh:
        fh.seek(record.offset + 1234)
        byte = fh.read(1)
        fh.seek(record.offset + 1234)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with RecordReader() as reader, pytest.raises(CorruptCheckpointError, match="CRC-32"):
        write_torch_file(tmp_path / "out.pt", src, reader)
        reader.finish()


def test_a_read_failure_on_the_reader_thread_reaches_the_caller(tmp_path):
    torch.save({"w": torch.randn(100_000)}, tmp_path / "src.pt")
    src = load_pickle(tmp_path / "src.pt")
    record = lazy_tensors(src)[0].record
    with open(tmp_path / "src.pt", "r+b") as fh:
        fh.truncate(record.offset + 1000)  # truncated after the archive was read
    with RecordReader() as reader, pytest.raises(CorruptCheckpointError, match="truncated"):
        write_torch_files([(tmp_path / "out.pt", src)], reader, chunk_bytes=4096)


def test_writing_needs_neither_torch_nor_deepspeed_imported(tmp_path):
    torch.save(_deepspeed_like_state(), tmp_path / "src.pt")
    code = (
        "import sys\n"
        "from ckpttools.io.torchfile import RecordReader, load_pickle\n"
        "from ckpttools.io.torchwriter import write_torch_file\n"
        f"src = load_pickle({str(tmp_path / 'src.pt')!r})\n"
        f"write_torch_file({str(tmp_path / 'out.pt')!r}, src, RecordReader())\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert _pickle_bytes(tmp_path / "out.pt") == _pickle_bytes(tmp_path / "src.pt")


def test_a_write_failure_stops_the_reader_thread(tmp_path):
    import threading

    torch.save({"w": torch.randn(100_000)}, tmp_path / "src.pt")
    src = load_pickle(tmp_path / "src.pt")
    files = [(tmp_path / "a.pt", src), (tmp_path / "missing" / "b.pt", src)]
    with RecordReader() as reader, pytest.raises(FileNotFoundError):
        write_torch_files(files, reader, chunk_bytes=4096)
    assert not [t for t in threading.enumerate() if t.name == "ckpt-reader"]


@pytest.mark.parametrize("chunk_bytes", [1000, 16 << 20])
def test_slices_of_another_dtype_are_cast_like_torch(tmp_path, chunk_bytes):
    """A 16-bit module weight written from its fp32 master (ZeRO-3 -> 1/2) rounds to nearest even, as .to()."""
    from ckpttools.io import dtypes
    from ckpttools.io.torchfile import RecordReader, load_pickle
    from ckpttools.io.torchwriter import Fill, NewTensor, Slice, write_torch_files

    x = torch.randn(20000) * 1e3
    x[5] = float("inf")
    torch.save({"x": x}, tmp_path / "src.pt")
    lazy = load_pickle(tmp_path / "src.pt")["x"]
    pieces = (Slice(lazy, 10, 5000), Fill(3), Slice(lazy, 0, 7))
    with RecordReader() as reader:
        write_torch_files([(tmp_path / "out.pt", {"y": NewTensor(dtypes.BFLOAT16, pieces)})], reader,
                          chunk_bytes=chunk_bytes)  # fmt: skip
    want = torch.cat([x[10:5010], torch.zeros(3), x[:7]]).to(torch.bfloat16)
    assert torch.equal(torch.load(tmp_path / "out.pt")["y"], want)

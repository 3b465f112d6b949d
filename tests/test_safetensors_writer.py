"""io/safetensors_writer: files the safetensors library reads back holding DeepSpeed's own values, bit for bit."""

import itertools
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import (
    OutputTensor,
    output_dtype,
    read_tensor,
    reused_buffers,
    safetensors_header,
    write_pt,
    write_safetensors,
    written_dtype,
)
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.model.checkpoint import Segment, TensorSource

from .conftest import FIXTURES

FP32, BF16, FP16 = dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16


def _outputs(name, dtype):
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    return [OutputTensor(s.name, s, output_dtype(s, dtype)) for s in ckpt.sources(dtype)]


def _write(path, tensors, **kw):
    with RecordReader() as reader:
        return write_safetensors(path, tensors, reader, **kw)


def _identical(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp2_bf16", "z1_dp3_fp32"])
def test_fp32_output_holds_zero_to_fp32s_values(tmp_path, name):
    ours = load_file(_write_and_path(tmp_path, _outputs(name, FP32)))
    ref = load_file(FIXTURES / name / "reference" / "zero_to_fp32.safetensors")
    # zero_to_fp32 leaves out the frozen params of fp32 runs: those are the engine's module weights
    bit16 = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    for key, value in ours.items():
        want = ref.get(key, bit16[key])
        # zero_to_fp32 keeps frozen params in their 16-bit dtype; the upcast is exact
        assert _identical(value, want.to(value.dtype) if value.is_floating_point() else want), key
    assert set(ref) - set(ours) <= {"head.weight"}  # the tied alias, which consolidate adds by name


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "z3_dp2_bf16", "z1_dp2_bf16_bf16opt"])
def test_bf16_output_holds_the_engines_16bit_state_dict(tmp_path, name):
    ours = load_file(_write_and_path(tmp_path, _outputs(name, BF16)))
    ref = load_file(FIXTURES / name / "reference" / "bit16.safetensors")
    for key, value in ours.items():
        assert _identical(value, ref[key]), key  # fp32 buffers stay fp32, as in the engine


def test_casts_round_as_torch_does(tmp_path):
    """fp32 masters written as fp16 and bf16: the bytes torch's own .to() gives (round to nearest even)."""
    fp32 = load_file(_write_and_path(tmp_path / "a", _outputs("z3_dp2_fp32", FP32)))
    for dtype in (FP16, BF16):
        out = load_file(_write_and_path(tmp_path / dtype.name, _outputs("z3_dp2_fp32", dtype)))
        for key, value in out.items():
            if key not in ("scale", "counts"):  # buffers keep their dtype (see test_written_dtype)
                assert value.dtype == dtype.to_torch(), key
            assert _identical(value, fp32[key].to(value.dtype)), (dtype.name, key)


def _write_and_path(folder, tensors, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    size = _write(path, tensors, **kw)
    assert size == path.stat().st_size
    return path


@pytest.mark.parametrize("chunk_bytes", [8, 12, 20, 64, 1000])
def test_any_chunk_size_writes_the_same_bytes(tmp_path, chunk_bytes):
    tensors = _outputs("z2_dp2_bf16", FP32)  # bf16 module copies cast chunk by chunk, int64 and fp32 buffers
    whole = _write_and_path(tmp_path / "whole", tensors).read_bytes()
    seen = []
    path = _write_and_path(tmp_path / "chunked", tensors, chunk_bytes=chunk_bytes, on_progress=seen.append)
    assert path.read_bytes() == whole
    header_len = 8 + struct.unpack("<Q", whole[:8])[0]
    assert sum(seen) == len(whole) - header_len == sum(t.nbytes for t in tensors)


def test_a_chunk_smaller_than_an_element_is_refused_or_written_right(tmp_path):
    buffers = [t for t in _outputs("z2_dp2_bf16", FP32) if t.name in ("scale", "counts")]  # fp32, int64: no cast
    whole = _write_and_path(tmp_path / "whole", buffers).read_bytes()
    try:
        small = _write_and_path(tmp_path / "small", buffers, chunk_bytes=2).read_bytes()
    except ValueError as e:
        small = whole if "chunk" in str(e) else b""  # a refusal that says why is right too
    assert small == whole


def test_files_written_in_reused_buffers_are_the_same(tmp_path):
    tensors = _outputs("z2_dp2_bf16", BF16)
    alone = _write_and_path(tmp_path / "alone", tensors).read_bytes()
    with reused_buffers():
        for i in range(3):
            assert _write_and_path(tmp_path / str(i), tensors[i:] + tensors[:i]).read_bytes() != b""
        assert _write_and_path(tmp_path / "again", tensors).read_bytes() == alone


def test_header_is_read_by_safetensors_with_metadata_and_8_byte_alignment(tmp_path):
    tensors = _outputs("z2_dp2_bf16", BF16)
    path = _write_and_path(tmp_path, tensors, metadata={"format": "pt", "note": "x"})
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["__metadata__"] == {"format": "pt", "note": "x"}
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
        assert list(f.keys()) == sorted(t.name for t in tensors)
        for t in tensors:
            assert f.get_slice(t.name).get_shape() == list(t.shape)
            assert f.get_slice(t.name).get_dtype() == t.dtype.safetensors
    # the tensors lie back to back in the order given
    ends = [header[t.name]["data_offsets"] for t in tensors]
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ends))
    assert len(raw) == 8 + n + ends[-1][1]


def test_header_agrees_with_safetensors_own_writer_on_every_tensor(tmp_path):
    tensors = _outputs("z3_dp2_bf16", BF16)
    ours = _write_and_path(tmp_path / "ours", tensors)
    theirs = tmp_path / "theirs.safetensors"
    save_file(load_file(ours), theirs, metadata={"format": "pt"})
    with safe_open(ours, "pt") as a, safe_open(theirs, "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert _identical(a.get_tensor(key), b.get_tensor(key))


def test_an_empty_tensor_and_an_empty_file(tmp_path):
    src = _outputs("z2_dp2_bf16", BF16)[2].source
    empty = TensorSource("empty", (0, 4), BF16, (), "trainable")
    part = TensorSource("part", (2, 3), src.dtype, (Segment(src.segments[0].tensor, 5, 6),), "trainable")
    path = _write_and_path(tmp_path, [OutputTensor("empty", empty, BF16), OutputTensor("part", part, BF16)])
    out = load_file(path)
    assert out["empty"].shape == (0, 4) and out["empty"].dtype == torch.bfloat16
    with RecordReader() as reader:
        assert _identical(out["part"], read_tensor(src, reader).reshape(-1)[5:11].view(2, 3))
    nothing = _write_and_path(tmp_path / "none", [])
    assert load_file(nothing) == {}
    with safe_open(nothing, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_safetensors_header_pads_with_spaces_to_8_bytes():
    t = _outputs("z2_dp2_bf16", BF16)[0]
    for meta in ({}, {"a": ""}, {"a": "bc"}, {"a": "bcd"}):
        raw = safetensors_header([t], meta)
        n = struct.unpack("<Q", raw[:8])[0]
        assert len(raw) == 8 + n and n % 8 == 0
        assert json.loads(raw[8:]) == {
            "__metadata__": meta,
            t.name: {"dtype": t.dtype.safetensors, "shape": list(t.shape), "data_offsets": [0, t.nbytes]},
        }


def test_read_tensor_gives_the_stored_values_and_casts_like_torch():
    ref = load_file(FIXTURES / "z2_dp2_bf16" / "reference" / "zero_to_fp32.safetensors")
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint")
    with RecordReader() as reader:
        for p in ckpt.params:
            master = read_tensor(p.fp32, reader)
            assert _identical(master, ref[p.name])
            assert _identical(read_tensor(p.fp32, reader, FP16), ref[p.name].half())
            assert read_tensor(p.fp32, reader, FP32) is not None
        counts = read_tensor(ckpt.buffers["counts"], reader, BF16)
        assert _identical(counts, ref["counts"].to(torch.bfloat16))


def test_write_pt_holds_the_same_tensors_as_the_safetensors_file(tmp_path):
    tensors = _outputs("z3_dp2_bf16", BF16)
    seen = []
    with RecordReader() as reader:
        size = write_pt(tmp_path / "pytorch_model.bin", tensors, reader, on_progress=seen.append)
    assert size == (tmp_path / "pytorch_model.bin").stat().st_size
    assert sum(seen) == sum(t.nbytes for t in tensors)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    safetensors = load_file(_write_and_path(tmp_path, tensors))
    assert list(state) == [t.name for t in tensors]
    for key, value in safetensors.items():
        assert _identical(state[key], value), key


@pytest.mark.parametrize(
    "stored,kind,asked,written",
    [
        (dtypes.INT64, "buffer", BF16, dtypes.INT64),
        (dtypes.BOOL, "buffer", FP32, dtypes.BOOL),
        (dtypes.INT32, "trainable", FP16, dtypes.INT32),
        (FP32, "trainable", BF16, BF16),
        (BF16, "frozen", FP32, FP32),
        (FP32, "buffer", BF16, FP32),  # the engine keeps an fp32 buffer fp32 in its 16-bit state dict
        (dtypes.FLOAT64, "buffer", FP16, dtypes.FLOAT64),
        (BF16, "buffer", FP16, FP16),  # another 16-bit type takes the one asked for
        (FP16, "buffer", FP32, FP32),  # fp32 output upcasts buffers, as zero_to_fp32 does
    ],
)
def test_written_dtype(stored, kind, asked, written):
    assert written_dtype(stored, kind, asked) is written

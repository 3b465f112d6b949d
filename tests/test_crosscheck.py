"""layouts/crosscheck: DeepSpeed's module copies equal its cast masters and AutoTP replicas agree; a copy that does
not belong is found."""

import dataclasses

import numpy as np
import pytest
import torch

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import read_tensor
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts import crosscheck
from ckpttools.layouts.registry import read_checkpoint

from .conftest import FIXTURES

ZERO12 = ["z1_dp2_bf16", "z2_dp3_bf16", "z2_dp4_fp32", "z1_dp2_bf16_bf16opt", "trainer_z2_bf16"]


def _read(name):
    return read_checkpoint(next((FIXTURES / name).rglob("latest")).parent)


def _with_copy(ckpt, name, source):
    """The checkpoint with the module copy of `name` taken from another stored tensor of the same size."""
    bit16 = {**ckpt.bit16, name: dataclasses.replace(source, name=name, shape=ckpt.bit16[name].shape)}
    return dataclasses.replace(ckpt, bit16=bit16)


@pytest.mark.parametrize("name", ZERO12)
@pytest.mark.parametrize("full", [False, True])
def test_deepspeeds_module_copies_are_its_cast_masters(name, full):
    ckpt = _read(name)
    assert crosscheck.module_matches_masters(ckpt, full=full) is None
    crosscheck.check_module_copies(ckpt, full=full)


def test_a_copy_from_another_tensor_is_named():
    ckpt = _read("z2_dp2_bf16")  # ln.weight and ln.bias: 8 elements each
    bad = _with_copy(ckpt, "ln.weight", ckpt.bit16["ln.bias"])
    assert crosscheck.module_matches_masters(bad) == "ln.weight"
    with pytest.raises(CorruptCheckpointError, match=r"master of ln\.weight does not match"):
        crosscheck.check_module_copies(bad)


def test_read_elements_reads_what_the_reader_reads():
    ckpt = _read("z3_dp3_fp32")  # sources spread over three rank files
    files = crosscheck.OpenFiles()
    try:
        with RecordReader() as reader:
            for src in ckpt.sources(dtypes.FLOAT32):
                whole = read_tensor(src, reader).reshape(-1).numpy()
                n = src.numel()
                for start, count in [(0, n), (1, n - 1), (n // 2, n - n // 2), (n - 1, 1)]:
                    got = crosscheck.read_elements(src, start, count, files)
                    assert np.array_equal(got.view(np.uint8), whole[start : start + count].view(np.uint8))
    finally:
        files.close()


@pytest.mark.parametrize("dtype", [dtypes.BFLOAT16, dtypes.FLOAT16, dtypes.FLOAT32])
def test_casts_equal_agrees_with_torchs_cast(dtype):
    values = torch.tensor([0.0, -0.0, 1.0, 1 / 3, 65504.0, 1e-8, 3.4e38, float("inf"), -2.5e-3], dtype=torch.float32)
    cast = values.to(dtype.to_torch())
    master = values.numpy()
    copy = cast.view(torch.int16).numpy() if dtype.itemsize == 2 else cast.numpy()
    assert crosscheck.casts_equal(master, copy, dtype)
    if dtype.itemsize == 2:
        nudged = copy.copy()
        nudged[3] ^= 1  # one ulp off: a truncating cast, not torch's round to nearest even
        assert not crosscheck.casts_equal(master, nudged, dtype)


def test_first_difference_finds_the_first_differing_element():
    ckpt = _read("z2_dp2_bf16")
    files = crosscheck.OpenFiles()
    try:
        fc1 = ckpt.masters["fc1.weight"]
        assert crosscheck.first_difference(fc1, fc1, files) is None
        assert crosscheck.first_difference(fc1, ckpt.masters["emb.weight"], files) == 0  # other size
        with RecordReader() as reader:
            a, b = (read_tensor(ckpt.masters[n], reader) for n in ("ln.weight", "ln.bias"))
        first = int(torch.nonzero(a.view(torch.int32) != b.view(torch.int32))[0])
        assert crosscheck.first_difference(ckpt.masters["ln.weight"], ckpt.masters["ln.bias"], files) == first
    finally:
        files.close()


@pytest.mark.parametrize("name", ["autotp_tp2_dp2_z1_bf16", "autotp_trainer_tp2_dp2_z1_bf16"])
@pytest.mark.parametrize("full", [False, True])
def test_autotps_replicas_agree(name, full):
    ckpt = _read(name)
    assert ckpt.replicas
    assert crosscheck.replica_mismatch(ckpt, full=full) is None
    crosscheck.check_replicas(ckpt, full=full)


def test_a_replica_from_another_tensor_is_named():
    ckpt = _read("autotp_tp2_dp2_z1_bf16")
    replica = next(r for r in ckpt.replicas if "input_layernorm" in r.what and "fp32" in r.what)
    other = next(r for r in ckpt.replicas if "post_attention_layernorm" in r.what and "fp32" in r.what)
    swapped = dataclasses.replace(replica, copy=other.copy)
    bad = dataclasses.replace(ckpt, replicas=[swapped if r is replica else r for r in ckpt.replicas])
    assert crosscheck.replica_mismatch(bad, full=True) == replica.what
    with pytest.raises(CorruptCheckpointError, match="differs from TP rank 0's copy"):
        crosscheck.check_replicas(bad)


@pytest.mark.parametrize("nan_bits", [0x7FFF, 0xFFFF])
def test_a_nan_master_and_the_engines_nan_copy_are_equal(nan_bits):
    master = np.array([1.0, float("nan")], dtype=np.float32)
    copy = np.array([0x3F80, nan_bits], dtype=np.uint16).view(np.int16)  # 1.0, and a NaN torch writes for NaN
    assert crosscheck.casts_equal(master, copy, dtypes.BFLOAT16)


def test_torch_writes_a_bf16_nan_for_a_nan_master():
    cast = torch.tensor([float("nan")] * 64, dtype=torch.float32).to(torch.bfloat16)
    assert torch.isnan(cast).all()
    assert {int(x) & 0xFFFF for x in cast.view(torch.int16)} <= {0x7FC0, 0x7FFF, 0xFFFF}

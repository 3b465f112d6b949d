import pytest
import torch

from ckpttools.io import dtypes

SPECIAL = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    1e-45,
    -1e-40,
    3.4e38,
    65504.0,
    65520.0,
    1e-8,
]


def _values():
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000)
    # exact ties between two bf16 values: low 16 bits 0x8000
    ties = (torch.randint(0, 2**15, (1000,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    return torch.cat([rand, ties, torch.tensor(SPECIAL)])


@pytest.mark.parametrize(
    "src,dst",
    [
        ("float32", "bfloat16"),
        ("float32", "float16"),
        ("bfloat16", "float32"),
        ("float16", "float32"),
        ("bfloat16", "float16"),
        ("float16", "bfloat16"),
    ],
)
def test_cast_is_bit_identical_to_torch(src, dst):
    x = _values().to(getattr(torch, src))
    n = x.numel()
    out = bytearray(n * dtypes.BY_NAME[dst].itemsize)
    dtypes.cast(x.view(torch.uint8).numpy().tobytes(), dtypes.BY_NAME[src], out, dtypes.BY_NAME[dst], n)
    ours = torch.frombuffer(out, dtype=getattr(torch, dst))
    expected = x.to(getattr(torch, dst))
    same = ours.view(torch.int16 if ours.element_size() == 2 else torch.int32) == expected.view(
        torch.int16 if expected.element_size() == 2 else torch.int32
    )
    nan = expected.isnan()
    assert bool((same | (nan & ours.isnan())).all())


def test_names_round_trip_with_torch():
    for name in ("float32", "bfloat16", "float16", "int64", "bool", "uint8"):
        assert dtypes.from_torch(getattr(torch, name)).to_torch() is getattr(torch, name)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_a_cast_split_over_threads_and_blocks_is_the_same(workers, dst):
    from ckpttools.io.threads import Workers

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * dtypes.CAST_BLOCK + 7, generator=g) * 1e3  # parts end inside blocks
    x[::1001] = float("nan")
    out = bytearray(x.numel() * 2)
    with Workers(workers) as pool:
        dtypes.cast(x.numpy().tobytes(), dtypes.FLOAT32, out, dtypes.BY_NAME[dst], x.numel(), pool)
    ours, expected = torch.frombuffer(out, dtype=getattr(torch, dst)), x.to(getattr(torch, dst))
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_an_empty_cast_with_workers_does_nothing():
    from ckpttools.io.threads import Workers

    with Workers(2) as pool:
        dtypes.cast(b"", dtypes.FLOAT32, bytearray(), dtypes.BFLOAT16, 0, pool)

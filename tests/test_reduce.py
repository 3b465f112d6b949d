"""The streaming reduction loop (ops/reduce.py) and the non-finite count (io/values.py), piece by piece."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttools.io import dtypes, values
from ckpttools.io.torchfile import RecordReader
from ckpttools.ops import reduce

from .conftest import FIXTURES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_count_nonfinite_equals_torch(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=g).to(dtype)
    x[torch.randint(0, 5000, (40,), generator=g)] = float("nan")
    x[torch.randint(0, 5000, (7,), generator=g)] = float("inf")
    x[torch.randint(0, 5000, (9,), generator=g)] = float("-inf")
    dt = dtypes.from_torch(dtype)
    raw = values.raw(x.view(torch.uint8).numpy().tobytes(), dt)
    counts = values.count_nonfinite(raw, dt)
    expected = (int(x.isnan().sum()), int(x.isposinf().sum()), int(x.isneginf().sum()))
    assert (counts.nan, counts.posinf, counts.neginf) == expected
    assert values.count_nonfinite(values.raw(torch.ones(9, dtype=dtype).view(torch.uint8).numpy(), dt), dt).total == 0


def test_bf16_numbers_widen_exactly():
    x = torch.randn(1000).to(torch.bfloat16)
    raw = values.raw(x.view(torch.uint8).numpy().tobytes(), dtypes.BFLOAT16)
    assert torch.equal(torch.from_numpy(values.numbers(raw, dtypes.BFLOAT16).copy()), x.float())


def test_the_stream_hands_out_every_element_once_in_order_in_small_chunks():
    side = reduce.open_side(FIXTURES / "z3_dp2_bf16" / "checkpoint")  # ZeRO-3: tensors split across two ranks
    ref = load_file(FIXTURES / "z3_dp2_bf16" / "reference" / "zero_to_fp32.safetensors")
    got: dict[int, list] = {}
    with RecordReader() as reader:
        for piece in reduce.stream(side.tensors, reader, chunk_bytes=24):  # 6 fp32 elements a chunk
            assert piece.start == sum(len(p) for p in got.get(piece.index, []))
            got.setdefault(piece.index, []).append(piece.raw.copy())
    for i, t in enumerate(side.tensors):
        if t.name in ref and ref[t.name].dtype == torch.float32:
            flat = torch.cat([torch.from_numpy(p) for p in got[i]]) if t.source.numel() else torch.zeros(0)
            assert torch.equal(flat.view(ref[t.name].shape), ref[t.name]), t.name


def test_streams_cut_at_different_places_are_compared_element_by_element(tmp_path):
    """A (two ZeRO-3 partitions per tensor) and B (one file) split their chunks at different elements."""
    a = reduce.open_side(FIXTURES / "z3_dp2_bf16" / "checkpoint")
    ref = {t.name: load_file(FIXTURES / "z3_dp2_bf16" / "reference" / "zero_to_fp32.safetensors").get(t.name)
           for t in a.tensors}  # fmt: skip
    flipped = {k: v.clone() for k, v in ref.items() if v is not None and v.dtype == torch.float32}
    before = float(flipped["fc1.weight"][7, 5])
    flipped["fc1.weight"][7, 5] += 1
    moved = float(flipped["fc1.weight"][7, 5]) - before  # 1, as fp32 rounds it
    save_file(flipped, tmp_path / "b.safetensors")
    b = reduce.open_side(tmp_path / "b.safetensors").by_name()
    pairs = [(t, b[t.name]) for t in a.tensors if t.name in b]
    comparisons = [reduce.Comparison() for _ in pairs]
    with RecordReader() as ra, RecordReader() as rb:
        reduce.compare_streams([p[0] for p in pairs], [p[1] for p in pairs], ra, rb, comparisons, chunk_bytes=28)
    for (t, _), c in zip(pairs, comparisons, strict=True):
        if t.name == "fc1.weight":
            assert (c.identical, c.differing, c.first, c.max_abs_diff) == (False, 1, 7 * 8 + 5, moved)
        else:
            assert c.identical and c.differing == 0, t.name


def test_nonfinite_over_a_stream_names_the_tensors(tmp_path):
    x = torch.ones(100, dtype=torch.bfloat16)
    x[3] = float("nan")
    save_file({"a": torch.zeros(4), "b": x, "c": torch.tensor([float("-inf"), 1.0])}, tmp_path / "w.safetensors")
    counter = reduce.nonfinite(reduce.open_side(tmp_path / "w.safetensors").tensors)
    assert {k: v.to_dict() for k, v in counter.found.items()} == {
        "b": {"nan": 1, "posinf": 0, "neginf": 0},
        "c": {"nan": 0, "posinf": 0, "neginf": 1},
    }
    assert counter.describe() == "b (1 NaN), c (1 -Inf)"
    assert reduce.nonfinite_in(tmp_path / "w.safetensors").describe() == counter.describe()
    assert not reduce.nonfinite_in(FIXTURES / "z2_dp2_bf16" / "checkpoint").found


@pytest.mark.parametrize(("name", "layer"), [
    ("model.layers.12.self_attn.q_proj.weight", "model.layers.12"),
    ("transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("lm_head.weight", "lm_head"),
    ("scale", "scale"),
])  # fmt: skip
def test_layer_of(name, layer):
    assert reduce.layer_of(name) == layer


def test_the_writer_counts_nonfinite_values_from_the_bytes_it_writes(tmp_path):
    from ckpttools.io.safetensors_writer import write_safetensors

    x = torch.randn(300, 7)
    x[5, 1], x[200, 6], x[17, 0] = float("nan"), float("inf"), float("nan")
    save_file({"clean": torch.ones(9), "x": x}, tmp_path / "in.safetensors")
    side = reduce.open_side(tmp_path / "in.safetensors")
    counter = values.NonFiniteCounter()
    bf16 = reduce.cast_to(side, dtypes.BFLOAT16).tensors  # counted after the cast, as written
    with RecordReader() as reader:
        write_safetensors(tmp_path / "out.safetensors", bf16, reader, chunk_bytes=64, nonfinite=counter)
        write_safetensors(tmp_path / "plain.safetensors", bf16, reader, chunk_bytes=64)
    assert {k: v.to_dict() for k, v in counter.found.items()} == {"x": {"nan": 2, "posinf": 1, "neginf": 0}}
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    written, expected = load_file(tmp_path / "out.safetensors")["x"], x.bfloat16()
    assert torch.equal(written.isnan(), expected.isnan())  # NaN bits: ckpt writes 0x7FC0, torch's vector cast 0xFFFF
    assert torch.equal(written[~written.isnan()], expected[~expected.isnan()])


def test_chunks_split_over_threads_reduce_to_the_same_numbers():
    from ckpttools.io.threads import Workers

    g = torch.Generator().manual_seed(2)
    a = torch.randn(3 << 20, generator=g)  # split in 4 parts, one per thread
    a[2_500_000] = float("nan")
    b = a.clone()
    b[[2_000_001, 3_000_000]] += 0.5  # both in later parts of the split
    raw_a, raw_b = a.numpy(), b.numpy()
    with Workers(4) as pool:
        serial, split = reduce.Moments(), reduce.Moments()
        serial.add(raw_a, dtypes.FLOAT32)
        split.add(raw_a, dtypes.FLOAT32, pool)
        one, many = reduce.Comparison(), reduce.Comparison()
        one.add(0, raw_a, dtypes.FLOAT32, raw_b, dtypes.FLOAT32)
        many.add(0, raw_a, dtypes.FLOAT32, raw_b, dtypes.FLOAT32, pool)
    s, p = serial.to_dict(), split.to_dict()
    assert {k: s[k] for k in ("count", "nan", "min", "max")} == {k: p[k] for k in ("count", "nan", "min", "max")}
    assert p["l2"] == pytest.approx(s["l2"], rel=1e-12) and p["mean"] == pytest.approx(s["mean"], rel=1e-9)
    assert (many.differing, many.first, many.count, many.identical) == (2, 2_000_001, 3 << 20, False)
    assert (many.max_abs_diff, many.rel_l2) == (one.max_abs_diff, pytest.approx(one.rel_l2, rel=1e-12))


@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_consolidate_notes_nonfinite_values_counted_as_it_writes(tmp_path, to):
    """A NaN planted in an fp32 master of a real rank file (torch.load / torch.save) is named in consolidate's
    notes, from the bytes it writes; a clean checkpoint gets no such note."""
    from ckpttools.ops.consolidate import consolidate

    pytest.importorskip("deepspeed")  # torch.load of a DeepSpeed rank file unpickles DeepSpeed's classes
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    rank0 = ckpt / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(rank0, map_location="cpu", weights_only=False)
    with torch.no_grad():  # the fp32 partition is saved as a Parameter
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][3] = float("nan")  # emb.weight[0, 3]
    torch.save(state, rank0)
    module = ckpt / "global_step2" / "mp_rank_00_model_states.pt"  # the bf16 module copy, as the engine keeps it
    model_states = torch.load(module, map_location="cpu", weights_only=False)
    model_states["module"]["emb.weight"][0, 3] = float("nan")
    torch.save(model_states, module)
    result = consolidate(ckpt, tmp_path / "out", to=to)
    expected = ("non-finite values in the output: 2 NaN in 2 tensors (emb.weight (1 NaN), head.weight (1 NaN)); "
                "check the run before publishing it")  # head.weight: the tie, written too (no config.json) # fmt: skip
    assert [n for n in result.notes if "non-finite" in n] == [expected]
    clean = consolidate(FIXTURES / "z2_dp2_bf16" / "checkpoint", tmp_path / "clean", to=to)
    assert not [n for n in clean.notes if "non-finite" in n]
    from ckpttools.ops.verify import verify_folder  # verify --against fails on them (the bytes it reads anyway)

    report = verify_folder(tmp_path / "out", against=ckpt)
    assert not report.ok
    assert [p for p in report.problems if "NaN" in p] == [
        "tensors holding NaN or Inf: emb.weight (1 NaN, 0 Inf), head.weight (1 NaN, 0 Inf)"
    ]
    assert verify_folder(tmp_path / "clean", against=FIXTURES / "z2_dp2_bf16" / "checkpoint").ok

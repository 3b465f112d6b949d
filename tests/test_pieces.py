"""layouts/zero/pieces: cutting a group at the saved DP gives DeepSpeed's own rank partitions, byte for byte."""

import pytest
import torch

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io.torchfile import LazyTensor, RecordReader
from ckpttools.io.torchwriter import Fill, NewTensor, Slice
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.zero import partition
from ckpttools.layouts.zero.pieces import (
    Flat,
    cut_group,
    group_count,
    group_keys,
    group_params,
    padded,
    pieces_of,
    slice_mappings,
)

from .conftest import FIXTURES

pytest.importorskip("deepspeed")  # torch.load of DeepSpeed's files needs its classes

ZERO12 = ["z1_dp2_bf16", "z2_dp2_bf16", "z1_dp3_fp32", "z2_dp4_bf16", "z2_dp2_bf16_sgd", "z1_dp2_bf16_step0"]


def _tag_dir(name):
    return next((FIXTURES / name / "checkpoint").glob("global_step*"))


def _deepspeed_osds(name, dp, mp=0):
    """optimizer_state_dict of every DP rank (of model-parallel rank `mp`), as torch.load reads DeepSpeed's files."""
    files = [next(_tag_dir(name).glob(f"*zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt")) for r in range(dp)]
    return [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]


def _materialize(pieces, dtype, reader):
    """The elements a list of Slice/Fill pieces stands for, read from the stored tensors."""
    parts = []
    for p in pieces:
        if isinstance(p, Fill):
            parts.append(torch.zeros(p.count, dtype=dtype))
        else:
            parts.append(p.tensor.load(reader).reshape(-1)[p.start : p.start + p.count].to(dtype))
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def _tensor(new: NewTensor, reader):
    return _materialize(new.pieces, new.dtype.to_torch(), reader).view(new.view_shape())


def _same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_cut_as_deepspeed(ckpt, osds, reader):
    """Every param group cut at the saved DP equals each DP rank's optimizer_state_dict."""
    dp = len(osds)
    for g in range(group_count(ckpt)):
        group = group_params(ckpt, g)
        scalars = ckpt.optimizer.group_scalars[g] if g < len(ckpt.optimizer.group_scalars) else {}
        parts = cut_group(group, scalars, dp)
        for r, (part, osd) in enumerate(zip(parts, osds, strict=True)):
            theirs = osd["single_partition_of_fp32_groups"][g]
            assert _same(_tensor(part.master, reader), theirs.detach()), (g, r)
            assert part.master.requires_grad == theirs.requires_grad
            assert part.padding == osd["group_paddings"][g]
            their_map = {k: (v.numel, v.start) for k, v in osd["param_slice_mappings"][g].items()}
            assert {k: (v.numel, v.start) for k, v in part.mapping.items()} == their_map
            their_state = osd["base_optimizer_state"]["state"].get(g, {})
            assert sorted(part.state) == sorted(their_state)
            for key, value in part.state.items():
                if isinstance(value, NewTensor):
                    assert _same(_tensor(value, reader), their_state[key]), (g, r, key)
                elif isinstance(value, LazyTensor):  # the step, stored as a tensor by some optimizers
                    assert _same(value.load(reader), their_state[key])
                else:
                    assert value == their_state[key]


@pytest.mark.parametrize("name", ZERO12)
def test_cut_at_the_saved_dp_gives_deepspeeds_partitions(name):
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    with RecordReader() as reader:
        _assert_cut_as_deepspeed(ckpt, _deepspeed_osds(name, ckpt.dp_world_size), reader)


@pytest.mark.parametrize("name", ["autotp_tp2_dp2_z1_bf16", "autotp_tp2_dp2_z2_bf16", "pp2_dp2_z1_bf16"])
def test_each_model_parallel_slice_cuts_into_its_own_ranks_partitions(name):
    """A TP rank's or pipeline stage's slice is a DP ZeRO checkpoint: cut, it gives that rank's optimizer files."""
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    assert len(ckpt.slices) == 2
    with RecordReader() as reader:
        for mp, part in enumerate(ckpt.slices):
            _assert_cut_as_deepspeed(part, _deepspeed_osds(name, ckpt.dp_world_size, mp), reader)


def test_bf16_optimizer_pads_every_partition_and_records_the_padding_on_the_last_rank():
    name = "z1_dp2_bf16_bf16opt"
    ckpt = read_checkpoint(FIXTURES / name / "checkpoint")
    assert ckpt.optimizer_kind == "bf16_optimizer"
    osds = _deepspeed_osds(name, 2)
    with RecordReader() as reader:
        for g in range(group_count(ckpt)):
            parts = cut_group(group_params(ckpt, g), ckpt.optimizer.group_scalars[g], 2, bf16_optimizer=True)
            for part, osd in zip(parts, osds, strict=True):
                assert _same(_tensor(part.master, reader), osd["single_partition_of_fp32_groups"][g].detach())
                assert part.padding == osd["group_paddings"][g]


def test_elastic_states_keep_no_padding():
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16_elastic" / "checkpoint")
    assert ckpt.optimizer.elastic
    for g in range(group_count(ckpt)):
        group = group_params(ckpt, g)
        total = sum(p.numel + p.align_pad for p in group)
        parts = cut_group(group, ckpt.optimizer.group_scalars[g], 2, elastic=True)
        for key in group_keys(group):
            assert sum(part.state[key].numel() for part in parts) == total


@pytest.mark.parametrize("dp", [1, 2, 3, 5, 8])
def test_partitions_of_all_ranks_tile_the_group_and_pad_to_2_dp(dp):
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint")
    with RecordReader() as reader:
        for g in range(group_count(ckpt)):
            group = group_params(ckpt, g)
            parts = cut_group(group, ckpt.optimizer.group_scalars[g], dp)
            size = partition.zero12_partition_size(sum(p.numel for p in group), dp)
            masters = [_tensor(p.master, reader) for p in parts]
            whole = torch.cat([_materialize(pieces_of(p.fp32), torch.float32, reader) for p in group])
            assert _same(torch.cat(masters), whole)
            for part in parts:
                assert part.master.numel() + part.padding == size
                for key in group_keys(group):
                    assert part.state[key].numel() == size  # states are padded with zeros, masters are not
            assert sum(part.padding for part in parts) == size * dp - whole.numel()


def test_recut_to_another_dp_and_back_gives_the_original_bytes():
    ckpt = read_checkpoint(FIXTURES / "z1_dp2_bf16" / "checkpoint")
    osds = _deepspeed_osds("z1_dp2_bf16", 2)
    with RecordReader() as reader:
        for g in range(group_count(ckpt)):
            group = group_params(ckpt, g)
            three = cut_group(group, {}, 3)
            # a group made of the 3-rank partitions, cut again at 2 ranks
            flat = Flat([x for part in three for x in part.master.pieces])
            size = partition.zero12_partition_size(len(flat), 2)
            for r, osd in enumerate(osds):
                n = max(0, min(size, len(flat) - r * size))
                ours = _materialize(flat.take(r * size, n), torch.float32, reader)
                assert _same(ours, osd["single_partition_of_fp32_groups"][g].detach())


def _lazy():
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint")
    return ckpt.params[0].fp32.segments[0].tensor


def test_flat_take_cuts_across_slices_and_fills():
    t = _lazy()
    flat = Flat([Slice(t, 0, 5), Fill(3), Slice(t, 10, 4)])
    assert len(flat) == 12
    assert flat.take(0, 12) == [Slice(t, 0, 5), Fill(3), Slice(t, 10, 4)]
    assert flat.take(3, 4) == [Slice(t, 3, 2), Fill(2)]
    assert flat.take(7, 3) == [Fill(1), Slice(t, 10, 2)]
    assert flat.take(5, 3) == [Fill(3)]
    assert flat.take(12, 0) == []
    with RecordReader() as reader:
        whole = _materialize(flat.take(0, 12), torch.float32, reader)
        for start in range(12):
            for count in range(12 - start + 1):
                got = _materialize(flat.take(start, count), torch.float32, reader)
                assert _same(got, whole[start : start + count])


def test_flat_take_refuses_a_range_past_its_end():
    flat = Flat([Slice(_lazy(), 0, 4), Fill(2)])
    with pytest.raises(CorruptCheckpointError, match="shorter"):
        flat.take(3, 4)
    with pytest.raises(CorruptCheckpointError):
        Flat([]).take(0, 1)


def test_padded_appends_one_fill_only_when_there_is_padding():
    pieces = [Fill(2)]
    assert padded(pieces, 0) == [Fill(2)]
    assert padded(pieces, 3) == [Fill(2), Fill(3)]
    assert padded(pieces, -1) == [Fill(2)]


def test_slice_mappings_give_each_param_its_start_in_the_partition():
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint")
    group = group_params(ckpt, 1)
    numels = [p.numel for p in group]
    offsets = partition.zero12_param_offsets(numels)
    lo, hi = offsets[1] + 1, offsets[-1] + 1  # from inside the second param to the first element of the last
    mapping = {k: (v.numel, v.start) for k, v in slice_mappings(group, lo, hi).items()}
    expected = {group[1].file_name: (numels[1] - 1, 0)}
    expected.update({p.file_name: (p.numel, off - lo) for p, off in zip(group[2:-1], offsets[2:-1], strict=True)})
    expected[group[-1].file_name] = (1, offsets[-1] - lo)
    assert mapping == expected
    assert slice_mappings(group, 0, 0) == {}


def test_group_keys_refuses_params_whose_states_differ():
    ckpt = read_checkpoint(FIXTURES / "z2_dp2_bf16" / "checkpoint")
    group = group_params(ckpt, 0)
    assert sorted(group_keys(group)) == ["exp_avg", "exp_avg_sq"]
    assert group_keys([]) == []
    odd = group[1].__class__(**{**group[1].__dict__, "states": {"exp_avg": group[1].states["exp_avg"]}})
    with pytest.raises(CorruptCheckpointError, match=odd.name):
        group_keys([group[0], odd])

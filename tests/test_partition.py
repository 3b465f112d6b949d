import pytest

from ckpttools.layouts.zero import partition
from ckpttools.layouts.zero.partition import Piece


@pytest.mark.parametrize("total,dp,size", [(808, 2, 404), (1, 4, 2), (9, 3, 4), (407, 4, 102), (0, 2, 0), (6, 1, 6)])
def test_zero12_partition_size_pads_to_2_dp(total, dp, size):
    assert partition.zero12_partition_size(total, dp) == size
    assert size * dp >= total and (size * dp) % (2 * dp) == 0


def test_zero12_offsets_include_alignment_padding():
    assert partition.zero12_param_offsets([3, 5, 2]) == [0, 3, 8]
    assert partition.zero12_param_offsets([3, 5, 2], [1, 3, 0]) == [0, 4, 12]


def test_split_range_across_ranks_matches_deepspeed_slice_mappings():
    # DeepSpeed's param_slice_mappings for the 16->32->8 MLP at DP=2 (deepspeed-format notes):
    # rank 0 holds 404 elements of 0.weight; rank 1 holds the other 108 and then the rest.
    lengths = [404, 404]
    assert partition.split_range(0, 512, lengths) == [Piece(0, 0, 404), Piece(1, 0, 108)]
    assert partition.split_range(512, 32, lengths) == [Piece(1, 108, 32)]
    assert partition.split_range(800, 8, lengths) == [Piece(1, 396, 8)]


def test_split_range_refuses_to_run_past_the_partitions():
    with pytest.raises(ValueError):
        partition.split_range(5, 10, [4, 4])


@pytest.mark.parametrize("numel,dp", [(1, 1), (7, 2), (8, 4), (13, 3), (2, 5), (96, 4)])
def test_zero3_pieces_cover_the_param_exactly_once(numel, dp):
    pieces = partition.zero3_pieces(numel, dp, offset=10)
    p = partition.zero3_partition_numel(numel, dp)
    assert sum(pc.count for pc in pieces) == numel
    assert all(pc.start == 10 and pc.count <= p for pc in pieces)
    assert [pc.rank for pc in pieces] == list(range(len(pieces)))


def test_zero3_subgroup_offsets_use_ceil_numel_over_dp():
    # 256+16+128+4 = 404 per rank for the MLP at DP=2 (checked on a real file)
    numels = [512, 32, 256, 8]
    assert partition.zero3_subgroup_offsets(numels, 2) == [0, 256, 272, 400]

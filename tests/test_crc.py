import os
import zlib

import pytest

from ckpttools.io import crc
from ckpttools.io.threads import Workers


@pytest.mark.parametrize("sizes", [(0, 5), (7, 0), (1, 1), (1000, 3), (12345, 678901)])
def test_combining_two_checksums_is_the_checksum_of_both(sizes):
    a, b = os.urandom(sizes[0]), os.urandom(sizes[1])
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_the_checksum_of_zeros_needs_no_bytes():
    for n in (0, 1, 4096, 10**6 + 3):
        assert crc.crc32_zeros(n) == zlib.crc32(bytes(n))


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_a_checksum_split_over_threads_is_zlibs(workers):
    data = bytearray(os.urandom(8 * crc.PIECE_MIN + 12345))
    with Workers(workers) as pool:
        assert crc.crc32(data, 0, pool) == zlib.crc32(data)
        assert crc.crc32(memoryview(data)[7:], 0xDEADBEEF, pool) == zlib.crc32(memoryview(data)[7:], 0xDEADBEEF)
        assert crc.crc32(b"small", 5, pool) == zlib.crc32(b"small", 5)
    with Workers(64) as pool:  # more threads than 1 MiB pieces: capped
        assert crc.crc32(data[: 3 * crc.PIECE_MIN], 0, pool) == zlib.crc32(data[: 3 * crc.PIECE_MIN])

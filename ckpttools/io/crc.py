"""CRC-32 (zlib's) arithmetic: combining the checksums of consecutive pieces, and checksums split over threads.

A CRC is linear over GF(2): the checksum of A followed by B is crc(A) multiplied by x^(8*len(B)) modulo the
polynomial, plus crc(B) (zlib's crc32_combine, which Python's zlib does not expose). So the pieces of one buffer can
be checksummed at once on several threads (zlib releases the GIL) and combined in a few microseconds.
"""

from __future__ import annotations

import functools
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpttools.io.threads import Workers

_POLY = 0xEDB88320  # CRC-32 (zlib), reflected
PIECE_MIN = 1 << 20  # the least bytes a thread checksums (a buffer under 2 pieces stays on the calling thread)


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial, both reflected (bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return p


@functools.lru_cache(maxsize=256)
def x_pow_8n(n: int) -> int:
    """x^(8n) modulo the polynomial, by repeated squaring of x^8."""
    result, square = 1 << 31, 1 << (31 - 8)  # x^0, x^8
    while n:
        if n & 1:
            result = _multmodp(square, result)
        square = _multmodp(square, square)
        n >>= 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(a + b) from crc1 = zlib.crc32(a), crc2 = zlib.crc32(b) and len2 = len(b)."""
    return _multmodp(x_pow_8n(len2), crc1) ^ crc2


def crc32_zeros(n: int) -> int:
    """zlib.crc32(bytes(n)) without the bytes: the register starts at ~0, n zero bytes multiply it by x^(8n)."""
    return _multmodp(x_pow_8n(n), 0xFFFFFFFF) ^ 0xFFFFFFFF


def crc32(buf: Any, crc: int = 0, workers: Workers | None = None) -> int:
    """zlib.crc32(buf, crc), the pieces of a large buffer checksummed on `workers`' threads at once."""
    view = memoryview(buf).cast("B")
    n = len(view)
    parts = 1 if workers is None else min(workers.n, n // PIECE_MIN)
    if workers is None or parts < 2:
        return zlib.crc32(view, crc)
    bounds = [n * i // parts for i in range(parts + 1)]
    crcs = [0] * parts

    def piece(i: int) -> None:
        crcs[i] = zlib.crc32(view[bounds[i] : bounds[i + 1]], crc if i == 0 else 0)

    workers.run([functools.partial(piece, i) for i in range(parts)])
    result = crcs[0]
    for i in range(1, parts):
        result = crc32_combine(result, crcs[i], bounds[i + 1] - bounds[i])
    return result

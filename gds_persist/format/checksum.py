"""CRC32C (Castagnoli), the one checksum algorithm of the format, on the host, and the algebra
that joins CRCs of pieces computed apart.

The host CRC comes from ``awscrt`` (aws-checksums, botocore's CRC32C: carry-less multiplication
folding, with VPCLMULQDQ/AVX-512 where the CPU has it), else from the ``crc32c`` package (SSE4.2
/ ARMv8 CRC instructions). On this project's 2-core AMD EPYC VM one core checksums 1 GiB of
DRAM at 32 GB/s with the first and 17 GB/s with the second; a CPU-bound save to tmpfs went
from 0.71 to 0.75-0.77 of the aligned writer with it (docs/BENCHMARK.md, "The checksum's share
of a save").
Both release the GIL for large buffers, so checksumming overlaps I/O threads.
``crc32c(b, crc32c(a)) == crc32c(a + b)``. CRCs of device memory: :mod:`gds_persist.transfer.crc`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import crc32c as _sse42

Buffer = Any  # anything with the buffer protocol: bytes, memoryview, mmap, numpy array


Combine = Callable[[int, int, int], int]


def _host_crc32c() -> tuple[str, Callable[[Buffer, int], int], Combine | None]:
    """Which package checksums, its CRC function, and its combine in C (None: the algebra
    below, in Python)."""
    try:
        from awscrt.checksums import combine_crc32c
        from awscrt.checksums import crc32c as folded
    except ImportError:  # a machine without awscrt's wheel: the SSE4.2 package
        return "crc32c", _sse42.crc32c, None
    return "awscrt", folded, combine_crc32c


IMPLEMENTATION, _crc32c_impl, _combine_impl = _host_crc32c()


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    if isinstance(data, str):  # awscrt would checksum its UTF-8 encoding
        raise TypeError("crc32c takes bytes-like data, not str: encode it first")
    return _crc32c_impl(data, value)


# --- CRC32C shift / combine algebra -------------------------------------------------------------
# A CRC register is a polynomial over GF(2) in the reflected bit order (bit 31 is x^0). Appending
# n zero bytes to a message multiplies its register by x^(8n) modulo the CRC polynomial, and the
# CRC is linear in the message, so for the standard (pre- and post-inverted) CRC32C:
#
#     crc32c(A + B) == crc32c_shift(crc32c(A), len(B)) ^ crc32c(B)
#
# (the inversions cancel: they depend only on the lengths). This is what lets independently
# computed chunk CRCs (GPU thread blocks, I/O threads) be joined without touching the bytes again.
# Cost: O(log n) carry-less 32x32 multiplications, independent of n, so offsets of many GiB or
# TiB cost the same as a few bytes. The device kernel (kernels/crc32c.cu) uses the same tables.

POLY_REFLECTED = 0x82F63B78  # Castagnoli, x^32 + x^28 + ... reflected
_X0 = 1 << 31  # the polynomial 1 in reflected order


def gf2_multiply(a: int, b: int) -> int:
    """``a * b mod P`` for two reflected 32-bit CRC polynomials."""
    product = 0
    bit = _X0
    while bit:
        if a & bit:
            product ^= b
        bit >>= 1
        b = (b >> 1) ^ POLY_REFLECTED if b & 1 else b >> 1
    return product


def _x_pow_2k_table(count: int = 64) -> tuple[int, ...]:
    table = [1 << 30]  # x^(2^0) = x
    for _ in range(count - 1):
        table.append(gf2_multiply(table[-1], table[-1]))
    return tuple(table)


X_POW_2K: tuple[int, ...] = _x_pow_2k_table()  # X_POW_2K[k] = x^(2^k) mod P, k = 0..63


@functools.lru_cache(maxsize=1024)  # joins repeat the same lengths (whole blocks)
def x_pow_8n(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``: the factor that moves a CRC register past ``nbytes`` bytes."""
    if nbytes < 0:
        raise ValueError(f"a byte count cannot be negative (got {nbytes})")
    if nbytes >= 1 << 61:
        raise ValueError(f"byte count {nbytes} is beyond 2**61")
    result, k = _X0, 3  # 8 * nbytes = nbytes << 3
    while nbytes:
        if nbytes & 1:
            result = gf2_multiply(X_POW_2K[k], result)
        nbytes >>= 1
        k += 1
    return result


def crc32c_shift(crc: int, nbytes: int) -> int:
    """The CRC register ``crc`` carried past ``nbytes`` more bytes of zeros (no final xor):
    ``crc32c_shift(crc32c(A), len(B)) ^ crc32c(B) == crc32c(A + B)``."""
    return gf2_multiply(x_pow_8n(nbytes), crc & 0xFFFFFFFF)


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` (like zlib's
    ``crc32_combine``); no data is read, and ``length_b`` may be many GiB. Used to join the CRCs
    of pieces checksummed apart (GPU threads, ranks reading parts of one extent). In C where
    awscrt is installed: a save joins hundreds of pieces after its writes, 0.4 ms against 13."""
    if length_b < 0:
        raise ValueError(f"a byte count cannot be negative (got {length_b})")
    if _combine_impl is not None and length_b:  # (awscrt ignores crc_b where B is empty)
        return _combine_impl(crc_a & 0xFFFFFFFF, crc_b & 0xFFFFFFFF, length_b)
    return crc32c_shift(crc_a, length_b) ^ (crc_b & 0xFFFFFFFF)


def crc32c_segmented(data: bytes | bytearray | memoryview, segment_bytes: int) -> int:
    """CPU reference of the device kernel's scheme (kernels/crc32c.cu): the buffer is cut into
    ``segment_bytes`` pieces (the last may be short), each piece's CRC32C is computed on its own,
    shifted past all the bytes after it, and the results are XORed together (in any order).
    Equal to :func:`crc32c` of the whole buffer."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if segment_bytes <= 0 or segment_bytes % 8:
        raise ValueError(f"segment_bytes={segment_bytes} must be a positive multiple of 8")
    total = 0
    for lo in range(0, n, segment_bytes):
        hi = min(lo + segment_bytes, n)
        total ^= crc32c_shift(crc32c(view[lo:hi]), n - hi)
    return total


def joined_crcs(pieces: Iterable[tuple[int, int, int, int]],
                sizes: Sequence[int]) -> list[int | None]:
    """Each storage's CRC32C from its pieces ``(storage, start, length, crc32c)`` (extents, maybe
    written by several ranks), joined in order of ``start``; None for a storage of ``sizes`` whose
    pieces do not tile ``[0, size)`` exactly (nothing to say about its whole bytes)."""
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for storage, start, length, crc in pieces:
        by_storage.setdefault(storage, []).append((start, length, crc))
    out: list[int | None] = []
    for k, size in enumerate(sizes):
        crc, end = 0, 0
        for start, length, piece in sorted(by_storage.get(k, [])):
            if start != end:
                break
            crc, end = crc32c_combine(crc, piece, length), end + length
        out.append(crc if end == size else None)
    return out

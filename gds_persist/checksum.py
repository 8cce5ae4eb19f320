"""Host-side CRC32C (Castagnoli), the one checksum algorithm of the format.

Uses the ``crc32c`` package (SSE4.2 / ARMv8 CRC instructions; it releases the GIL for large
buffers, so checksumming overlaps I/O threads). ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import crc32c as _crc32c_impl

if TYPE_CHECKING:
    import torch

HARDWARE_ACCELERATED: bool = bool(_crc32c_impl.hardware_based)


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    return _crc32c_impl.crc32c(data, value)


def device_crc32c(data: torch.Tensor) -> int:
    """CRC32C of a uint8 tensor on any device; equal to :func:`crc32c` of the same bytes."""
    if data.is_cuda:
        from .cuda_crc import cuda_crc32c  # computed on the device, no host copy

        return cuda_crc32c(data)
    return crc32c(data.numpy())


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _gf2_times(matrix: list[int], vector: int) -> int:
    out = 0
    i = 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (zlib's method), so
    pieces of one extent checksummed by different ranks can be checked against its CRC."""
    if length_b <= 0:
        return crc_a
    odd = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if length_b & 1:
            crc_a = _gf2_times(even, crc_a)
        length_b >>= 1
        if not length_b:
            break
        odd = _gf2_square(even)
        if length_b & 1:
            crc_a = _gf2_times(odd, crc_a)
        length_b >>= 1
        if not length_b:
            break
    return crc_a ^ crc_b

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

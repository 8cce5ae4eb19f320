"""CRC32C of tensors on any device (host bytes here, CUDA ones by gds_persist.cuda_crc)."""

from __future__ import annotations

import torch

from .format.checksum import crc32c


def device_crc32c(data: torch.Tensor) -> int:
    """CRC32C of a uint8 tensor on any device; equal to :func:`crc32c` of the same bytes."""
    return device_crc32c_many([data])[0]


def device_crc32c_many(pieces: list[torch.Tensor]) -> list[int]:
    """:func:`device_crc32c` of each uint8 tensor; CUDA ones are launched together and waited
    for once (one stream sync instead of one per piece)."""
    cuda = [i for i, p in enumerate(pieces) if p.is_cuda]
    result = [0] * len(pieces)
    if cuda:
        from .cuda_crc import cuda_crc32c_many

        for i, crc in zip(cuda, cuda_crc32c_many([pieces[i] for i in cuda]), strict=True):
            result[i] = crc
    for i, p in enumerate(pieces):
        if not p.is_cuda:
            result[i] = crc32c(p.numpy())  # type: ignore[arg-type]
    return result

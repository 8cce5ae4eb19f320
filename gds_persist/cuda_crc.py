"""CRC32C of CUDA memory.

Interim implementation: copies the bytes to the host and uses the host CRC32C. The device kernel
in ``kernels/`` (issue: GPU path) replaces this so GDS writes never bounce through the host.
"""

from __future__ import annotations

import torch

from .checksum import crc32c


def cuda_crc32c(data: torch.Tensor) -> int:
    return crc32c(data.cpu().numpy())

"""CRC32C of tensor bytes wherever they live: the one dispatch between host and device.

Host bytes go to the host CRC32C (:func:`gds_persist.format.checksum.crc32c`). CUDA bytes go to
the device kernel (:mod:`.device_crc`), all launched before one wait; where that kernel cannot
run (no cupy, NVRTC failure, ...) they are copied to the host and checksummed there, and the
reason is logged once. Either way the result equals the host CRC32C of the same bytes.
"""

from __future__ import annotations

import logging

import torch

from ..errors import BackendError
from ..format.checksum import crc32c
from .device_crc import cuda_crc32c_many
from .device_kernels import as_bytes

log = logging.getLogger("gds_persist")
_fallback_logged: set[str] = set()


def device_crc32c(data: torch.Tensor) -> int:
    """CRC32C of a tensor's bytes on any device; equal to :func:`crc32c` of the same bytes."""
    return device_crc32c_many([data])[0]


def device_crc32c_many(pieces: list[torch.Tensor]) -> list[int]:
    """:func:`device_crc32c` of each tensor; CUDA ones are launched together and waited for
    once (one stream sync instead of one per piece)."""
    pieces = [as_bytes(p) for p in pieces]
    result = [0] * len(pieces)
    cuda = [i for i, p in enumerate(pieces) if p.is_cuda]
    if cuda:
        try:
            crcs = cuda_crc32c_many([pieces[i] for i in cuda])
        except BackendError as e:
            _log_fallback(e)
            crcs = [crc32c(pieces[i].cpu().numpy()) for i in cuda]  # type: ignore[arg-type]
        for i, crc in zip(cuda, crcs, strict=True):
            result[i] = crc
    for i, p in enumerate(pieces):
        if not p.is_cuda:
            result[i] = crc32c(p.numpy())  # type: ignore[arg-type]
    return result


def device_crc32c_or_none(pieces: list[torch.Tensor]) -> list[int] | None:
    """CRC32C of CUDA tensors on the device, or None where the kernel cannot run (the reason is
    logged once): for callers that can checksum a bounded host copy they make anyway."""
    try:
        return cuda_crc32c_many([as_bytes(p) for p in pieces])
    except BackendError as e:
        _log_fallback(e)
        return None


def _log_fallback(e: BackendError) -> None:
    log_fallback_once("CRCs", e)


def log_fallback_once(what: str, e: BackendError) -> None:
    """Log, once per process and kind (``what``), that a device kernel is unusable and its
    ``what`` of CUDA memory use a host copy."""
    if what not in _fallback_logged:
        _fallback_logged.add(what)
        log.warning("gds_persist: %s; %s of CUDA memory use a host copy", e, what)

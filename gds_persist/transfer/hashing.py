"""BLAKE3-128 content hashes of tensor bytes wherever they live: the one dispatch between host
and device (like :mod:`.crc` for CRC32C).

CUDA bytes go to the device kernel (:mod:`.device_hash`), all launched together before one wait;
where it cannot run they are copied to the host (a bounded piece at a time) and hashed there, and
the reason is logged once. Host bytes are hashed by the ``blake3`` binding on the given thread
pool (it releases the GIL, so pieces hash on every core at once). Either way the value equals
:func:`gds_persist.format.hashing.content_hash` of the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from ..errors import BackendError
from ..format.hashing import content_hash
from ..stages import stage
from .crc import log_fallback_once
from .device_hash import cuda_hash_many
from .device_kernels import as_bytes


def host_hash(piece: torch.Tensor) -> str:
    """BLAKE3-128 of a host tensor's bytes (a CUDA one is copied to the host first)."""
    piece = as_bytes(piece)
    data = piece.cpu() if piece.is_cuda else piece
    with stage("hash", piece.numel()):
        return content_hash(data.numpy())


def hash_pieces(pieces: Sequence[torch.Tensor], pool: Executor | None = None) -> list[str]:
    """BLAKE3-128 (32 hex digits) of each tensor's bytes: CUDA ones on the device (one batch),
    host ones on ``pool`` (or this thread)."""
    pieces = [as_bytes(p) for p in pieces]
    result = [""] * len(pieces)
    cuda = [i for i, p in enumerate(pieces) if p.is_cuda]
    if cuda:
        with stage("hash (device)", sum(pieces[i].numel() for i in cuda)):
            try:
                hashes = cuda_hash_many([pieces[i] for i in cuda])
            except BackendError as e:
                log_fallback_once("content hashes", e)
                hashes = [host_hash(pieces[i]) for i in cuda]
        for i, h in zip(cuda, hashes, strict=True):
            result[i] = h
    host = [i for i, p in enumerate(pieces) if not p.is_cuda]
    if pool is None:
        for i in host:
            result[i] = host_hash(pieces[i])
    else:
        futures = [(i, pool.submit(host_hash, pieces[i])) for i in host]
        for i, fut in futures:
            result[i] = fut.result()
    return result


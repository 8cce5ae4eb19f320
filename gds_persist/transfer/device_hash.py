"""BLAKE3-128 of CUDA memory, computed on the device by ``kernels/blake3.cu`` (no host copy).

The result equals the host :func:`gds_persist.format.hashing.content_hash` of the same bytes bit
for bit (the first 16 bytes of the standard BLAKE3 digest), so an incremental save of GPU state
compares against a base written from host memory and vice versa.

All pieces go through each launch together: one launch computes every 1 KiB chunk's chaining
value, then one launch per tree level merges them pairwise (the host loop below mirrors
``tests/blake3_host_harness.cu``, which runs the same per-thread code on the CPU). Kernels are
compiled at first use with NVRTC through ``cupy.RawModule`` and launched on the caller's current
torch CUDA stream; where that cannot happen, :func:`cuda_hash_many` raises
:class:`~gds_persist.BackendError` saying why (then and on every later call) and
:mod:`gds_persist.transfer.hashing` hashes a host copy instead.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import BackendError
from .device_crc import as_bytes, cupy_stream, kernel_source, kernel_status, log, per_device

KERNEL_FILE = "blake3.cu"
CHUNKS_KERNEL = "gdsp_blake3_chunks"
PARENTS_KERNEL = "gdsp_blake3_parents"
THREADS_PER_BLOCK = 128
CHUNK = 1024

_lock = threading.Lock()
_module: Any = None
_kernels: dict[int, tuple[Any, Any]] = {}
_unavailable: str | None = None


def _functions(device_index: int) -> tuple[Any, Any]:
    global _module
    with _lock:
        found = _kernels.get(device_index)
        if found is not None:
            return found
        with warnings.catch_warnings(record=True) as caught:  # logged, not raised
            warnings.simplefilter("always")
            import cupy

            if _module is None:
                _module = cupy.RawModule(code=kernel_source(KERNEL_FILE))
            with cupy.cuda.Device(device_index):
                found = (_module.get_function(CHUNKS_KERNEL),
                         _module.get_function(PARENTS_KERNEL))
        for w in caught:
            log.info("gds_persist: building the BLAKE3 kernel: %s", w.message)
        _kernels[device_index] = found
        return found


def level_counts(lengths: Sequence[int]) -> list[list[int]]:
    """Node counts per piece, level by level, as the kernels are launched: chunks first (a
    0-byte piece has one empty chunk), then ``ceil(m / 2)`` per level until every piece is 1."""
    counts = [max(1, -(-n // CHUNK)) for n in lengths]
    levels = [counts]
    while any(c > 1 for c in counts):
        counts = [(c + 1) // 2 if c > 1 else 1 for c in counts]
        levels.append(counts)
    return levels


def _cumulative(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _launch_all(pieces: Sequence[torch.Tensor], device: torch.device) -> list[str]:
    import cupy
    import numpy as np

    index = device.index if device.index is not None else torch.cuda.current_device()
    chunks_fn, parents_fn = _functions(index)
    stream = torch.cuda.current_stream(device)
    levels = level_counts([p.numel() for p in pieces])
    with torch.cuda.device(index):
        def table(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=False)

        ptrs = table([p.data_ptr() for p in pieces])
        lens = table([p.numel() for p in pieces])
        starts = [table(_cumulative(c)) for c in levels]
        cvs = torch.empty(8 * sum(levels[0]), dtype=torch.int32, device=device)
        spare = torch.empty(8 * max(1, sum(levels[1]) if len(levels) > 1 else 1),
                            dtype=torch.int32, device=device)
    npieces = np.uint64(len(pieces))

    def grid(total: int) -> tuple[int]:
        return (-(-total // THREADS_PER_BLOCK),)

    with cupy.cuda.Device(index), cupy_stream(cupy, stream.cuda_stream, index):
        total = sum(levels[0])
        chunks_fn(grid(total), (THREADS_PER_BLOCK,),
                  (np.uint64(ptrs.data_ptr()), np.uint64(lens.data_ptr()),
                   np.uint64(starts[0].data_ptr()), npieces, np.uint64(total),
                   np.uint64(cvs.data_ptr())))
        for level in range(1, len(levels)):
            total = sum(levels[level])
            parents_fn(grid(total), (THREADS_PER_BLOCK,),
                       (np.uint64(starts[level - 1].data_ptr()),
                        np.uint64(starts[level].data_ptr()), npieces, np.uint64(total),
                        np.uint64(cvs.data_ptr()), np.uint64(spare.data_ptr())))
            cvs, spare = spare, cvs
    final = cvs[: 8 * len(pieces)].view(-1, 8)[:, :4].contiguous().cpu()  # waits for the kernels
    raw = final.numpy().view("<u4").tobytes()
    return [raw[16 * k : 16 * (k + 1)].hex() for k in range(len(pieces))]


def cuda_hash_many(pieces: Sequence[torch.Tensor]) -> list[str]:
    """BLAKE3-128 (32 hex digits) of each CUDA tensor's bytes, launched together per device.

    Ordered after earlier work on each device's current stream; returns once every hash is
    known. Raises :class:`BackendError` (with the reason) where the kernels cannot run.
    """
    global _unavailable
    pieces = [as_bytes(p) for p in pieces]
    if any(not p.is_cuda for p in pieces):
        raise TypeError("cuda_hash_many takes CUDA tensors; use "
                        "gds_persist.transfer.hashing.hash_pieces for memory anywhere")
    if _unavailable is not None:
        raise BackendError(_unavailable)
    try:
        return per_device(pieces, _launch_all, "")
    except Exception as e:  # noqa: BLE001 - no cupy, NVRTC failure, ...: unusable from now on
        _unavailable = f"device BLAKE3 kernel unusable ({type(e).__name__}: {e})"
        raise BackendError(_unavailable) from e


def device_hash_status() -> tuple[bool, str]:
    """Whether content hashes of CUDA memory run on the device, and why not (never raises)."""
    return kernel_status(_unavailable,
                         "device BLAKE3 kernel (kernels/blake3.cu via cupy.RawModule/NVRTC)")

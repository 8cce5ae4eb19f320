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

from collections.abc import Sequence

import numpy as np
import torch

from .device_kernels import DeviceKernels, cuda_bytes, cupy_stream, device_index

KERNEL_FILE = "blake3.cu"
CHUNKS_KERNEL = "gdsp_blake3_chunks"
PARENTS_KERNEL = "gdsp_blake3_parents"
THREADS_PER_BLOCK = 128
CHUNK = 1024

KERNELS = DeviceKernels(KERNEL_FILE, [CHUNKS_KERNEL, PARENTS_KERNEL], "BLAKE3")


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

    index = device_index(device)
    chunks_fn, parents_fn = KERNELS.functions(index)
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
    pieces = cuda_bytes(pieces, "cuda_hash_many", "gds_persist.transfer.hashing.hash_pieces")
    return KERNELS.run(pieces, _launch_all, "")


def device_hash_status() -> tuple[bool, str]:
    """Whether content hashes of CUDA memory run on the device, and why not (never raises)."""
    return KERNELS.status()

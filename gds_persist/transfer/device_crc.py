"""CRC32C of CUDA memory, computed on the device by ``kernels/crc32c.cu`` (no host copy).

The result equals the host :func:`gds_persist.format.checksum.crc32c` of the same bytes bit for
bit, so a checkpoint written from GPU memory verifies on a CPU-only machine and vice versa.

The kernel is compiled at first use with NVRTC through ``cupy.RawModule`` (CuPy caches the binary
per device and on disk) and launched on the caller's current torch CUDA stream, so it is ordered
after whatever produced the bytes. CuPy is imported lazily; where it is missing or the kernel
cannot be built, :func:`cuda_crc32c_many` raises :class:`~gds_persist.BackendError` saying why
(then and on every later call; :func:`device_crc_status` reports it) and
:mod:`gds_persist.transfer.crc` checksums a host copy instead. This module uses no host CRC.

Scheme (see the .cu file): ``segment_bytes_for(n)``-byte segments, one per GPU thread, each
segment CRC shifted past the bytes after it with the GF(2) algebra in
:mod:`gds_persist.format.checksum` and XORed together;
:func:`gds_persist.format.checksum.crc32c_segmented` is its CPU reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .device_kernels import DeviceKernels, cuda_bytes, cupy_stream, device_index

KERNEL_FILE = "crc32c.cu"
KERNEL_NAME = "gdsp_crc32c"
THREADS_PER_BLOCK = 256
MIN_SEGMENT = 256
MAX_SEGMENT = 16 << 10
TARGET_THREADS = 1 << 18  # about 2048 resident threads x 132 SMs (H100/H200): fill the GPU

KERNELS = DeviceKernels(KERNEL_FILE, [KERNEL_NAME], "CRC32C")


def segment_bytes_for(nbytes: int) -> int:
    """Bytes per GPU thread for an ``nbytes`` buffer: enough threads to fill the device, but
    segments long enough that the O(log n) shift per thread stays a small overhead."""
    per_thread = -(-nbytes // TARGET_THREADS)
    per_thread = (per_thread + 7) // 8 * 8
    return max(MIN_SEGMENT, min(MAX_SEGMENT, per_thread))


def _launch_all(pieces: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    import cupy

    index = device_index(device)
    (kernel,) = KERNELS.functions(index)
    stream = torch.cuda.current_stream(device)
    with torch.cuda.device(index):
        totals = torch.zeros(len(pieces), dtype=torch.int32, device=device)  # on `stream`
    base = totals.data_ptr()
    with cupy.cuda.Device(index), cupy_stream(cupy, stream.cuda_stream, index):
        for k, piece in enumerate(pieces):
            n = piece.numel()
            if n == 0:
                continue  # crc32c(b"") == 0, already in totals
            seg = segment_bytes_for(n)
            segments = -(-n // seg)
            blocks = -(-segments // THREADS_PER_BLOCK)
            kernel((blocks,), (THREADS_PER_BLOCK,),
                   (np.uint64(piece.data_ptr()), np.uint64(n), np.uint64(seg),
                    np.uint64(base + 4 * k), np.uint64(0)))
    return [int(v) & 0xFFFFFFFF for v in totals.cpu().tolist()]  # waits for the kernels


def cuda_crc32c_many(pieces: Sequence[torch.Tensor]) -> list[int]:
    """CRC32C of each CUDA tensor's bytes, all launched before one wait (one sync per device).

    Ordered after earlier work on each device's current stream; returns once every CRC is known.
    Raises :class:`~gds_persist.BackendError` (with the reason) where the kernel cannot run.
    """
    pieces = cuda_bytes(pieces, "cuda_crc32c_many",
                        "gds_persist.transfer.crc.device_crc32c_many")
    return KERNELS.run(pieces, _launch_all, 0)


def cuda_crc32c(data: torch.Tensor) -> int:
    """CRC32C of a CUDA tensor's bytes, equal to the host crc32c of the same bytes."""
    return cuda_crc32c_many([data])[0]


def device_crc_status() -> tuple[bool, str]:
    """Whether CRCs of CUDA memory run on the device, and why not (never raises)."""
    return KERNELS.status()

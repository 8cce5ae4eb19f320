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

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..errors import BackendError

log = logging.getLogger("gds_persist")
T = TypeVar("T")

KERNEL_FILE = "crc32c.cu"
KERNEL_NAME = "gdsp_crc32c"
THREADS_PER_BLOCK = 256
MIN_SEGMENT = 256
MAX_SEGMENT = 16 << 10
TARGET_THREADS = 1 << 18  # about 2048 resident threads x 132 SMs (H100/H200): fill the GPU


def segment_bytes_for(nbytes: int) -> int:
    """Bytes per GPU thread for an ``nbytes`` buffer: enough threads to fill the device, but
    segments long enough that the O(log n) shift per thread stays a small overhead."""
    per_thread = -(-nbytes // TARGET_THREADS)
    per_thread = (per_thread + 7) // 8 * 8
    return max(MIN_SEGMENT, min(MAX_SEGMENT, per_thread))


def kernel_source(name: str = KERNEL_FILE) -> str:
    """The CUDA C source ``name``: the top-level ``kernels/`` directory of the source checkout
    this package was imported from, else package data of an installed wheel
    (``gds_persist/kernels``). The checkout comes first: a worktree imported by path must not
    compile the kernels of another checkout installed in the environment."""
    checkout = Path(__file__).resolve().parents[2] / "kernels" / name
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    try:
        resource = resources.files("gds_persist.kernels").joinpath(name)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        pass
    raise FileNotFoundError(
        f"CUDA kernel source {name} not found in the package (gds_persist/kernels) nor at "
        f"{checkout}; reinstall gds_persist (the wheel ships kernels/*.cu as package data)"
    )


_lock = threading.Lock()
_kernels: dict[int, Any] = {}
_module: Any = None
_unavailable: str | None = None  # why the device kernel cannot be used (None: not known yet / ok)


def _kernel(device_index: int) -> Any:
    """The compiled kernel for one device (NVRTC via CuPy, once per device and process)."""
    global _module
    with _lock:
        kernel = _kernels.get(device_index)
        if kernel is not None:
            return kernel
        with warnings.catch_warnings(record=True) as caught:  # logged, not raised
            warnings.simplefilter("always")
            import cupy

            if _module is None:
                _module = cupy.RawModule(code=kernel_source())
            with cupy.cuda.Device(device_index):
                kernel = _module.get_function(KERNEL_NAME)
        for w in caught:
            log.info("gds_persist: building the CRC32C kernel: %s", w.message)
        _kernels[device_index] = kernel
        return kernel


def device_crc_status() -> tuple[bool, str]:
    """Whether CRCs of CUDA memory run on the device, and why not (never raises)."""
    return kernel_status(_unavailable,
                         "device CRC32C kernel (kernels/crc32c.cu via cupy.RawModule/NVRTC)")


def kernel_status(unavailable: str | None, working: str) -> tuple[bool, str]:
    """A device kernel's status: ``unavailable`` (why it failed once) or what stops it here,
    else ``working``."""
    if unavailable is not None:
        return False, unavailable
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return False, (f"cupy is not importable ({e}); install the GPU extra: "
                       "pip install 'gds_persist[gpu]'")
    if not torch.cuda.is_available():
        return False, "no usable CUDA device/driver"
    return True, working


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous uint8 view (or copy) of a tensor's bytes."""
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        t = t.contiguous().reshape(-1).view(torch.uint8)
    return t


class _StreamRef:
    """A raw CUDA stream handle behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(cupy: Any, ptr: int, device_index: int) -> Any:
    """A CuPy stream over the existing CUDA stream ``ptr`` (a torch stream's ``cuda_stream``):
    ``cupy.cuda.Stream.from_external`` where CuPy has it (CuPy 14 deprecates ``ExternalStream``,
    and under ``filterwarnings = error`` that warning switched the kernel off), else
    ``cupy.cuda.ExternalStream`` (older CuPy). Wrapping needs no driver; using it does."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamRef(ptr))
    return cupy.cuda.ExternalStream(ptr, device_index)


def _launch_all(pieces: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    import cupy
    import numpy as np

    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _kernel(index)
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


def per_device(pieces: Sequence[torch.Tensor],
               launch: Callable[[Sequence[torch.Tensor], torch.device], list[T]],
               fill: T) -> list[T]:
    """``launch(pieces of one device, device)`` for every device the pieces are on; the results
    in the order of ``pieces``."""
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(pieces):
        by_device.setdefault(p.device, []).append(i)
    result = [fill] * len(pieces)
    for device, indices in by_device.items():
        for i, value in zip(indices, launch([pieces[i] for i in indices], device), strict=True):
            result[i] = value
    return result


def cuda_crc32c_many(pieces: Sequence[torch.Tensor]) -> list[int]:
    """CRC32C of each CUDA tensor's bytes, all launched before one wait (one sync per device).

    Ordered after earlier work on each device's current stream; returns once every CRC is known.
    Raises :class:`BackendError` (with the reason) where the kernel cannot run.
    """
    global _unavailable
    pieces = [as_bytes(p) for p in pieces]
    if any(not p.is_cuda for p in pieces):
        raise TypeError("cuda_crc32c_many takes CUDA tensors; use "
                        "gds_persist.transfer.crc.device_crc32c_many for memory anywhere")
    if _unavailable is not None:
        raise BackendError(_unavailable)
    try:
        return per_device(pieces, _launch_all, 0)
    except Exception as e:  # noqa: BLE001 - no cupy, NVRTC failure, ...: unusable from now on
        _unavailable = f"device CRC32C kernel unusable ({type(e).__name__}: {e})"
        raise BackendError(_unavailable) from e


def cuda_crc32c(data: torch.Tensor) -> int:
    """CRC32C of a CUDA tensor's bytes, equal to the host crc32c of the same bytes."""
    return cuda_crc32c_many([data])[0]

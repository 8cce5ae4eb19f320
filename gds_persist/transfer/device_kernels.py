"""What the device kernels (``kernels/*.cu``) share: finding the source, compiling it once per
process with NVRTC through ``cupy.RawModule``, fetching its functions once per device, launching
on the caller's torch stream, and switching a kernel off for good after its first failure.

CuPy is imported lazily, so importing this module needs no GPU stack.
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


def kernel_source(name: str) -> str:
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


class DeviceKernels:
    """The functions ``names`` of one ``.cu`` file: compiled at first use, fetched once per
    device (thread-safe), and unusable from the first failure on, with the reason kept."""

    def __init__(self, source_file: str, names: Sequence[str], what: str):
        self.source_file = source_file
        self.names = tuple(names)
        self.what = what  # "CRC32C", "BLAKE3": named in logs and errors
        self.unavailable: str | None = None  # why the kernels cannot be used (None: not known)
        self._lock = threading.Lock()
        self._module: Any = None
        self._functions: dict[int, tuple[Any, ...]] = {}

    def functions(self, device_index: int) -> tuple[Any, ...]:
        """The compiled functions for one device, in the order of ``names``."""
        with self._lock:
            found = self._functions.get(device_index)
            if found is not None:
                return found
            with warnings.catch_warnings(record=True) as caught:  # logged, not raised
                warnings.simplefilter("always")
                import cupy

                if self._module is None:
                    self._module = cupy.RawModule(code=kernel_source(self.source_file))
                with cupy.cuda.Device(device_index):
                    found = tuple(self._module.get_function(n) for n in self.names)
            for w in caught:
                log.info("gds_persist: building the %s kernel: %s", self.what, w.message)
            self._functions[device_index] = found
            return found

    def run(self, pieces: Sequence[torch.Tensor],
            launch: Callable[[Sequence[torch.Tensor], torch.device], list[T]], fill: T) -> list[T]:
        """``launch`` per device over CUDA ``pieces`` (see :func:`per_device`); raises
        :class:`BackendError` with the reason where the kernels cannot run, then and later."""
        if self.unavailable is not None:
            raise BackendError(self.unavailable)
        try:
            return per_device(pieces, launch, fill)
        except Exception as e:  # noqa: BLE001 - no cupy, NVRTC failure, ...: unusable from now on
            self.unavailable = f"device {self.what} kernel unusable ({type(e).__name__}: {e})"
            raise BackendError(self.unavailable) from e

    def status(self) -> tuple[bool, str]:
        """Whether the kernels run here, and why not (never raises)."""
        if self.unavailable is not None:
            return False, self.unavailable
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            return False, (f"cupy is not importable ({e}); install the GPU extra: "
                           "pip install 'gds_persist[gpu]'")
        if not torch.cuda.is_available():
            return False, "no usable CUDA device/driver"
        return True, (f"device {self.what} kernel (kernels/{self.source_file} via "
                      "cupy.RawModule/NVRTC)")


def cuda_bytes(pieces: Sequence[torch.Tensor], caller: str, host_alternative: str
               ) -> list[torch.Tensor]:
    """Flat uint8 views of CUDA tensors; a TypeError naming ``host_alternative`` otherwise."""
    flat = [as_bytes(p) for p in pieces]
    if any(not p.is_cuda for p in flat):
        raise TypeError(f"{caller} takes CUDA tensors; use {host_alternative} for memory anywhere")
    return flat


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous uint8 view (or copy) of a tensor's bytes."""
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        t = t.contiguous().reshape(-1).view(torch.uint8)
    return t


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


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

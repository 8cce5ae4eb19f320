"""I/O backends and the ``auto`` choice between them.

``auto`` picks ``kvikio`` only where it is the faster choice: CUDA tensors and cuFile in
GPUDirect Storage mode (or ``auto_kvikio="always"``, after a measurement says so); else
``direct`` when the target filesystem accepts O_DIRECT, else ``buffered``. The rule is the pure
function :func:`gds_persist.backends.auto.decide` (with the measurement behind it). The choice and
its reason end up in the save's ``info`` and in the manifest.
"""

from __future__ import annotations

from .. import settings
from ..errors import BackendError
from ..settings import BACKEND_NAMES
from .auto import AutoEnvironment, decide
from .base import Backend
from .posix import (
    BufferedBackend,
    DirectBackend,
    o_direct_host_alignment,
    require_o_direct,
    supports_o_direct,
)
from .read_mode import measured_read_mode


def _direct(directory: str) -> DirectBackend:
    return DirectBackend(host_alignment=o_direct_host_alignment(directory))


def _kvikio(directory: str, io_threads: int, block_bytes: int, why: str) -> tuple[Backend, str]:
    """The kvikio backend if a real 4 KiB cuFile transfer in ``directory`` works, else the
    ``direct`` (or ``buffered``) backend, with the reason either way (see kvikio_backend)."""
    from .kvikio_backend import KvikioBackend

    be = KvikioBackend(io_threads=io_threads, task_size=block_bytes)
    ok, probe = be.probe(directory)
    if ok:
        return be, f"{why}; {probe}"
    direct, o_direct_why = supports_o_direct(directory)
    fallback: Backend = _direct(directory) if direct else BufferedBackend()
    return fallback, (
        f"{why}, but kvikio cannot work here ({probe}); fell back to "
        f"{fallback.name} ({o_direct_why})"
    )  # e.g. no CUDA driver (docs/GPU.md)


def choose_backend(
    requested: str,
    directory: str,
    wants_device: bool,
    io_threads: int = 4,
    block_bytes: int = 16 << 20,
    auto_kvikio: str | None = None,
    read_sample: tuple[str, int, str] | None = None,
) -> tuple[Backend, str]:
    """Resolve a backend name for files in ``directory``; returns the backend and why.

    ``auto_kvikio`` (None: the setting in force) says when ``auto`` takes kvikio
    (:mod:`.auto`). ``read_sample``: for a load, a data file there (what to open, its size,
    its name): where ``auto`` would read with O_DIRECT, it reads through the page cache instead
    if that measured faster on this filesystem (:mod:`.read_mode`)."""
    from .kvikio_backend import kvikio_facts

    if requested not in BACKEND_NAMES:
        raise BackendError(
            f"unknown backend {requested!r}; valid backends: {', '.join(BACKEND_NAMES)}"
        )
    if requested == "kvikio":
        return _kvikio(directory, io_threads, block_bytes, "requested explicitly")
    if requested == "direct":
        require_o_direct(directory)
        return _direct(directory), "requested explicitly"
    if requested == "buffered":
        return BufferedBackend(), "requested explicitly"
    policy = auto_kvikio or settings.current().auto_kvikio
    o_direct, o_direct_why = supports_o_direct(directory)
    examine = wants_device and policy != "never"
    name, reason = decide(AutoEnvironment(wants_device, o_direct, o_direct_why,
                                          kvikio_facts() if examine else None, policy))
    if name == "kvikio":
        return _kvikio(directory, io_threads, block_bytes, reason)
    if name != "direct":
        return BufferedBackend(), reason
    measured = (measured_read_mode(*read_sample, io_threads, block_bytes) if read_sample
                else None)
    if measured is None:
        return _direct(directory), reason
    buffered, why = measured
    return (BufferedBackend() if buffered else _direct(directory)), f"{reason}; {why}"


__all__ = [
    "AutoEnvironment",
    "Backend",
    "BACKEND_NAMES",
    "BufferedBackend",
    "DirectBackend",
    "choose_backend",
    "decide",
    "supports_o_direct",
]

"""I/O backends and the ``auto`` choice between them.

``auto`` picks ``kvikio`` only where it is the faster choice: CUDA tensors and cuFile in
GPUDirect Storage mode (or ``auto_kvikio="always"``, after a measurement says so); else
``direct`` when the target filesystem accepts O_DIRECT, else ``buffered``. The rule is the pure
function :func:`gds_persist.backends.auto.decide` (with the measurement behind it). The choice and
its reason end up in the save's ``info`` and in the manifest. A load that ``auto`` reads with
O_DIRECT reads through :class:`~.adaptive.AdaptiveReadBackend`: its own first requests measure
O_DIRECT against the page cache and pick the faster for the rest (:mod:`.read_mode`); except
where the page cache already holds the load's files (:mod:`.residency`, not on tmpfs, whose files
are all in it): those are read through it, and nothing is measured or recorded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .. import settings
from ..errors import BackendError
from ..settings import BACKEND_NAMES
from .adaptive import AdaptiveReadBackend
from .auto import AutoEnvironment, decide
from .base import Backend
from .posix import (
    BufferedBackend,
    DirectBackend,
    memory_backed,
    o_direct_host_alignment,
    require_o_direct,
    supports_o_direct,
)
from .residency import resident_bytes

CACHED_SHARE = 0.9  # a load whose files the page cache holds this much of reads through it


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
    read_load: tuple[str | Sequence[str], int] | None = None,
) -> tuple[Backend, str]:
    """Resolve a backend name for files in ``directory``; returns the backend and why.

    ``auto_kvikio`` (None: the setting in force) says when ``auto`` takes kvikio
    (:mod:`.auto`). ``read_load``: for a load, its data files there (what to open) and the
    bytes the load reads there: where ``auto`` would read with O_DIRECT, files the page cache
    holds (:data:`CACHED_SHARE`, not on tmpfs) are read through it, else the load's own
    requests decide between O_DIRECT and the page cache (:mod:`.adaptive`, tmpfs included);
    the reason is completed by :func:`read_reason` after the read."""
    from .kvikio_backend import kvikio_facts

    directory = directory or "."  # a file named without a directory ("model.pt")
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
    if read_load is None:
        return _direct(directory), reason
    sources, load_bytes = read_load
    sources = [sources] if isinstance(sources, str) else list(sources)
    in_memory = _in_memory(directory)
    cached = None if in_memory else _cached(sources)
    if cached is not None:
        return BufferedBackend(), f"{reason}; {cached}"
    return AdaptiveReadBackend(o_direct_host_alignment(directory), os.stat(sources[0]).st_dev,
                               load_bytes, io_threads, block_bytes, watch=not in_memory), reason


def _cached(sources: list[str]) -> str | None:
    """Why the load reads through the page cache, where it holds the files; else None."""
    held = resident_bytes(sources)
    if held is None or not held[1] or held[0] < CACHED_SHARE * held[1]:
        return None
    return (f"but the page cache holds {held[0] / held[1]:.0%} of the load's files: "
            "read through it (O_DIRECT would read them from the drive again)")


def _in_memory(directory: str) -> bool:
    try:
        return memory_backed(directory)
    except OSError:  # removed meanwhile: its files are held open; watch as on a drive
        return False


def read_reason(backend: Backend, reason: str) -> str:
    """``reason`` of :func:`choose_backend` completed with what a load measured (after it)."""
    if isinstance(backend, AdaptiveReadBackend):
        return f"{reason}; {backend.reason()}"
    return reason


__all__ = [
    "AutoEnvironment",
    "Backend",
    "BACKEND_NAMES",
    "BufferedBackend",
    "DirectBackend",
    "choose_backend",
    "decide",
    "read_reason",
    "supports_o_direct",
]

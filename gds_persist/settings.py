"""Tunable settings: an explicit argument beats ``settings.set(...)`` beats the environment beats
the default.

``settings.set(...)`` works both as a plain setter and as a context manager that restores the
previous values, like ``kvikio.defaults.set``::

    with gds_persist.settings.set(staging_bytes=64 << 20, io_threads=2):
        gds_persist.save(sd, path)
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import BackendError

MiB = 1 << 20
# The I/O backends (gds_persist.backends): "auto" chooses one and records why.
BACKEND_NAMES = ("auto", "direct", "buffered", "kvikio")
# When ``backend="auto"`` takes kvikio for CUDA tensors (gds_persist.backends.auto): "gds" - only
# where cuFile runs in GPUDirect Storage mode (compatibility mode measured slower than `direct`);
# "always" - wherever kvikio is usable (a measurement on this machine says kvikio is faster);
# "never".
AUTO_KVIKIO = ("gds", "always", "never")
# How a data-parallel load gets replicated data to every rank: "read_all" - every rank reads every
# byte itself; "broadcast" / "allgather" - each rank reads 1/N and the rest travels over the
# process group. The default was chosen by bench/bench_parallel.py (docs/DISTRIBUTED.md):
# broadcast matched read_all there while reading each byte once; gloo's all-gather was far slower.
LOAD_STRATEGIES = ("broadcast", "allgather", "read_all")
# How a save stores its bytes (gds_persist.saving.compression): "none" - raw; "lossless" -
# encoded by the lossless codec where it shrinks them; "auto" - encoded only where measured to be
# faster.
COMPRESSIONS = ("none", "lossless", "auto")


@dataclass(frozen=True)
class Settings:
    backend: str = "auto"  # auto | direct | buffered | kvikio
    block_bytes: int = 16 * MiB  # size of one staging buffer = one write/read request
    staging_bytes: int = 128 * MiB  # the whole staging ring; never grows with the checkpoint
    io_threads: int = 4  # concurrent pwrite/pread calls per process (the queue depth)
    io_timeout_s: float = 600.0  # no single wait on I/O or a peer lasts longer than this
    collective_timeout_s: float = 600.0  # data-parallel: longest wait for the other ranks
    load_strategy: str = "broadcast"  # data-parallel load of replicated data; see LOAD_STRATEGIES
    auto_kvikio: str = "gds"  # when backend="auto" takes kvikio; see AUTO_KVIKIO
    file_streams: int = 0  # data files one writer spreads a save over; 0: one per I/O thread
    # for large saves (gds_persist.format.layout.file_streams says why and when)
    compression: str = "none"  # none | lossless | auto; see COMPRESSIONS
    # threads that write a memory-tier step into the node's tmpfs: those writes are copies, and
    # each thread is a core taken from training (on 2 cores, 4 threads made the training thread
    # wait 14.1 ms an iteration for a core, 1 thread 1.3 ms:
    # bench/results/2026-12-03-cpu-tier-threads.txt)
    memory_io_threads: int = 1

    @property
    def ring_buffers(self) -> int:
        return self.staging_bytes // self.block_bytes


ENV_VARS = {f.name: f"GDS_PERSIST_{f.name.upper()}" for f in fields(Settings)}
_lock = threading.Lock()
_overrides: dict[str, Any] = {}


def _convert(name: str, value: Any) -> Any:
    kind = type(getattr(Settings(), name))
    # int(True) and int(2.5) would silently become 1 and 2: refuse them instead
    lossy = isinstance(value, bool) or (
        kind is int and isinstance(value, float) and not value.is_integer())
    try:
        if lossy:
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"setting {name}={value!r} must be a {kind.__name__}") from e


def _validate(s: Settings) -> Settings:
    if s.backend not in BACKEND_NAMES:
        raise BackendError(
            f"unknown backend {s.backend!r}; valid backends: {', '.join(BACKEND_NAMES)}")
    if s.block_bytes <= 0 or s.block_bytes % 4096:
        raise ValueError(f"setting block_bytes={s.block_bytes} must be a positive multiple of 4096")
    if s.staging_bytes < 2 * s.block_bytes:
        raise ValueError(
            f"setting staging_bytes={s.staging_bytes} must hold at least two blocks of "
            f"block_bytes={s.block_bytes} (double buffering); raise it or lower block_bytes"
        )
    for name in ("io_threads", "memory_io_threads"):
        if getattr(s, name) < 1:
            raise ValueError(f"setting {name}={getattr(s, name)} must be at least 1")
    if s.file_streams < 0:
        raise ValueError(f"setting file_streams={s.file_streams} must be 0 (automatic) or a "
                         "number of data files")
    for name in ("io_timeout_s", "collective_timeout_s"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):  # inf overflows queue/future waits
            raise ValueError(f"setting {name}={value} must be positive and finite (seconds)")
    if s.auto_kvikio not in AUTO_KVIKIO:
        raise ValueError(f"setting auto_kvikio={s.auto_kvikio!r} must be one of "
                         f"{', '.join(AUTO_KVIKIO)}")
    if s.compression not in COMPRESSIONS:
        raise ValueError(f"setting compression={s.compression!r} must be one of "
                         f"{', '.join(COMPRESSIONS)}")
    if s.load_strategy not in LOAD_STRATEGIES:
        raise ValueError(f"setting load_strategy={s.load_strategy!r} must be one of "
                         f"{', '.join(LOAD_STRATEGIES)}")
    return s


def _check_names(names: Any) -> None:
    unknown = {*names} - ENV_VARS.keys()
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; valid: {sorted(ENV_VARS)}")


def _from_environment() -> dict[str, Any]:
    return {name: _convert(name, os.environ[env]) for name, env in ENV_VARS.items()
            if env in os.environ}


def current(**arguments: Any) -> Settings:
    """The settings in force, with non-None ``arguments`` taking precedence."""
    _check_names(arguments)
    values = _from_environment()
    with _lock:
        values.update(_overrides)
    values.update({k: _convert(k, v) for k, v in arguments.items() if v is not None})
    return _validate(replace(Settings(), **values))


class _Scope:
    def __init__(self, previous: dict[str, Any]):
        self._previous = previous

    def __enter__(self) -> Settings:
        return current()

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _overrides.clear()
            _overrides.update(self._previous)


def set(**values: Any) -> _Scope:  # noqa: A001 - mirrors kvikio.defaults.set
    """Override settings process-wide; use as a context manager to restore them afterwards."""
    _check_names(values)
    converted = {k: _convert(k, v) for k, v in values.items()}
    with _lock:
        previous = dict(_overrides)
        candidate = {**_overrides, **converted}
    _validate(replace(Settings(), **{**_from_environment(), **candidate}))
    with _lock:
        _overrides.update(converted)
    return _Scope(previous)


@contextmanager
def _cleared() -> Iterator[None]:
    """Test helper: run with no programmatic overrides."""
    with _lock:
        saved = dict(_overrides)
        _overrides.clear()
    try:
        yield
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)

"""Tunable settings: ``settings.set(...)`` beats the environment (``GDS_PERSIST_<NAME>``) beats
the default (``docs/USAGE.md``, "Settings").

``settings.set(...)`` works both as a plain setter and as a context manager that restores the
previous values, like ``kvikio.defaults.set``::

    with gds_persist.settings.set(staging_bytes="64MiB", io_threads=2):
        gds_persist.save(sd, path)

Byte settings (``*_bytes``) take an int or a size with a unit: ``"128MB"`` (10^6),
``"64MiB"`` (2^20), KB/KiB, GB/GiB likewise.
"""

from __future__ import annotations

import math
import os
import re
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
    # object stores (s3://, gds_persist.stores): attempts of one request (throttling, 5xx, a
    # dropped connection), with the client's exponential backoff between them; then an error
    # naming the object and the HTTP status
    object_attempts: int = 5
    # objects under a checkpoint URL that no manifest names are removed by a later save once
    # this old: a concurrent save's objects are younger (docs/OBJECT_STORE.md, "Commit")
    object_grace_s: float = 3600.0

    @property
    def ring_buffers(self) -> int:
        return self.staging_bytes // self.block_bytes


ENV_VARS = {f.name: f"GDS_PERSIST_{f.name.upper()}" for f in fields(Settings)}
_lock = threading.Lock()
_overrides: dict[str, Any] = {}
_thread = threading.local()  # .overrides: in_this_thread's


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", re.IGNORECASE)


def _bad(name: str, value: Any, why: str) -> ValueError:
    """A settings error, naming the setting and its environment variable."""
    return ValueError(f"setting {name}={value!r} (environment variable {ENV_VARS[name]}) {why}")


def _size(value: str) -> int:
    """``"128MB"`` -> 128_000_000, ``"64MiB"`` -> 67_108_864, ``"4096"`` -> 4096."""
    m = _SIZE.fullmatch(value)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(value)
    nbytes = int(m.group(1)) * unit if "." not in m.group(1) else float(m.group(1)) * unit
    if nbytes != int(nbytes):
        raise ValueError(value)
    return int(nbytes)


def parse_size(value: int | str, what: str) -> int:
    """A size in bytes, given as an int or with a unit (``"5GB"``, ``"64MiB"``); ``what`` names
    it in the ValueError for anything else."""
    try:
        n = value if isinstance(value, int) and not isinstance(value, bool) else _size(str(value))
    except ValueError:
        n = -1
    if n <= 0:
        raise ValueError(f"{what}={value!r} is not a size: give bytes (an int) or a number with "
                         "a unit, such as '5GB' or '512MiB'")
    return n


def _convert(name: str, value: Any) -> Any:
    kind = type(getattr(Settings(), name))
    # int(True) and int(2.5) would silently become 1 and 2: refuse them instead
    lossy = isinstance(value, bool) or (
        kind is int and isinstance(value, float) and not value.is_integer())
    try:
        if lossy:
            raise ValueError(value)
        if name.endswith("_bytes") and isinstance(value, str):
            return _size(value)
        return kind(value)
    except (TypeError, ValueError) as e:
        raise _bad(name, value, "must be a size in bytes: an int or a number with a unit "
                   "(4096, 128MB, 64MiB, 1GiB)" if name.endswith("_bytes")
                   else f"must be {'an' if kind is int else 'a'} {kind.__name__}") from e


def _validate(s: Settings) -> Settings:
    if s.backend not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {s.backend!r}; valid backends: "
                           f"{', '.join(BACKEND_NAMES)} (argument backend=, setting backend, "
                           f"environment variable {ENV_VARS['backend']})")
    if s.block_bytes <= 0 or s.block_bytes % 4096:
        raise _bad("block_bytes", s.block_bytes, "must be a positive multiple of 4096 (e.g. 16MiB)")
    if s.staging_bytes < 2 * s.block_bytes:
        raise _bad("staging_bytes", s.staging_bytes,
                   f"must hold at least two blocks of block_bytes={s.block_bytes} (double "
                   "buffering); raise it or lower block_bytes")
    for name in ("io_threads", "memory_io_threads", "object_attempts"):
        if getattr(s, name) < 1:
            raise _bad(name, getattr(s, name), "must be at least 1")
    if s.file_streams < 0:
        raise _bad("file_streams", s.file_streams,
                   "must be 0 (automatic) or a number of data files")
    for name in ("io_timeout_s", "collective_timeout_s"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):  # inf overflows queue/future waits
            raise _bad(name, value, "must be positive and finite (seconds)")
    if not (math.isfinite(s.object_grace_s) and s.object_grace_s >= 0):
        raise _bad("object_grace_s", s.object_grace_s, "must be finite and >= 0 (seconds)")
    for name, valid in (("auto_kvikio", AUTO_KVIKIO), ("compression", COMPRESSIONS),
                        ("load_strategy", LOAD_STRATEGIES)):
        if getattr(s, name) not in valid:
            raise _bad(name, getattr(s, name), f"must be one of {', '.join(valid)}")
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
    values.update(getattr(_thread, "overrides", {}))
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
    """Override settings for the whole process; as a context manager, until the ``with`` ends.

    Parameters
    ----------
    **values
        Settings by name (the fields of :class:`Settings`: ``block_bytes``, ``io_threads``,
        ...); byte settings also take sizes with a unit (``"64MiB"``).

    Returns
    -------
    A context manager that restores the previous overrides on exit.

    Raises
    ------
    TypeError, ValueError
        An unknown setting; a value out of range (naming the setting and its variable).
    """
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
def in_this_thread(**values: Any) -> Iterator[None]:
    """Override settings for the calling thread only, inside the ``with`` (a background writer's
    saves, which must not change what other threads' saves use)."""
    _check_names(values)
    previous = getattr(_thread, "overrides", {})
    _thread.overrides = {**previous, **{k: _convert(k, v) for k, v in values.items()}}
    try:
        yield
    finally:
        _thread.overrides = previous

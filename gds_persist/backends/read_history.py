"""The read-mode ratios of recent loads (:mod:`.read_mode`), kept on disk per filesystem so that
a new process starts from what earlier ones measured.

A training job's restart is a new process whose one load would otherwise decide its read mode
from its own rounds alone: one noisy ratio (bench_restore's fresh-process restores took the
slower mode on a 0.95x or 1.15x round, 2026-12-02). With the history, the median of the
filesystem's last loads decides, whichever process measured them.

The file is ``read-modes.json`` in ``$GDS_PERSIST_CACHE_DIR`` (empty: nothing is kept on disk),
else ``$XDG_CACHE_HOME/gds_persist``, else ``~/.cache/gds_persist``. A filesystem is named by its
type, source and mount point (:func:`.mounts.filesystem_key`), which outlive a device number
that a remount or reboot may change. It is a cache: a file that is missing, unreadable or malformed
reads as empty and is rewritten; a write that fails is skipped. Processes that record at once
take turns (``flock``), each adding its ratio to what the file holds.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .mounts import filesystem_key

CACHE_ENV = "GDS_PERSIST_CACHE_DIR"
FILE_NAME = "read-modes.json"


def cache_dir() -> str | None:
    """Where the history lives; None where ``$GDS_PERSIST_CACHE_DIR`` is set empty."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return chosen or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gds_persist")


def load(dev: int) -> list[float]:
    """The ratios kept for ``dev``'s filesystem, oldest first (none where nothing is kept)."""
    path = _path()
    return [] if path is None else _ratios_in(_read(path), filesystem_key(dev))


def update(dev: int, change: Callable[[list[float]], list[float]]) -> None:
    """Replace the ratios kept for ``dev``'s filesystem with ``change(kept)``, under the lock."""
    path = _path()
    if path is None:
        return
    key = filesystem_key(dev)
    try:
        with _locked(path):
            table = _read(path)
            table[key] = change(_ratios_in(table, key))
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError:
        pass  # a cache: the next load measures again


def _path() -> str | None:
    folder = cache_dir()
    return None if folder is None else os.path.join(folder, FILE_NAME)


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _ratios_in(table: dict[str, Any], key: str) -> list[float]:
    kept = table.get(key)
    if not isinstance(kept, list):
        return []
    return [float(r) for r in kept if isinstance(r, (int, float)) and r > 0]


@contextmanager
def _locked(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

"""Work that must finish at a normal interpreter exit: the last checkpoints of a run.

Python's exit first stops ``concurrent.futures`` from taking new work, then joins threads, then
runs ``atexit`` hooks: too late for a save, which uses thread pools. Hooks registered here run
before that (threading's exit hooks run last-registered first, and ``concurrent.futures`` is
imported before any of ours registers). :func:`finish_at_exit` is the one registry of what a
background writer's owner does there (flush, commit, close).
"""

from __future__ import annotations

import atexit
import concurrent.futures  # noqa: F401 - imported first, so its exit hook runs after ours
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gds_persist")
_finishers: weakref.WeakKeyDictionary[Any, tuple[Callable[[Any], None], str]] = (
    weakref.WeakKeyDictionary())


def before_thread_pools_stop(hook: Callable[[], None]) -> None:
    """Run ``hook`` at a normal interpreter exit while thread pools still take work."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(hook)
    else:  # pragma: no cover - Python without threading._register_atexit
        atexit.register(hook)


def finish_at_exit(owner: Any, finish: Callable[[Any], None], what: str) -> None:
    """At a normal interpreter exit, call ``finish(owner)`` if ``owner`` still lives (it is held
    weakly); its error is logged as ``what`` (nothing is left to raise it to)."""
    _finishers[owner] = (finish, what)


def _finish_all() -> None:
    for owner, (finish, what) in list(_finishers.items()):
        try:
            finish(owner)
        except Exception as e:  # noqa: BLE001 - nothing is left to raise it to
            log.error("gds_persist at exit: %s: %s: %s", what, type(e).__name__, e)


before_thread_pools_stop(_finish_all)

"""Work that must finish at a normal interpreter exit: the last checkpoints of a run.

Python's exit first stops ``concurrent.futures`` from taking new work, then joins threads, then
runs ``atexit`` hooks: too late for a save, which uses thread pools. Hooks registered here run
before that (threading's exit hooks run last-registered first, and ``concurrent.futures`` is
imported before any of ours registers).
"""

from __future__ import annotations

import atexit
import concurrent.futures  # noqa: F401 - imported first, so its exit hook runs after ours
import threading
from collections.abc import Callable


def before_thread_pools_stop(hook: Callable[[], None]) -> None:
    """Run ``hook`` at a normal interpreter exit while thread pools still take work."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(hook)
    else:  # pragma: no cover - Python without threading._register_atexit
        atexit.register(hook)

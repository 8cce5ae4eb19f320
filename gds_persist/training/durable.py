"""When the durable level (a Checkpointer's ``root``) is flushed from the node-local levels:
:class:`DurableFlushes`, run by :class:`~.tiers.Tiers` in the writer thread.

Every ``drive_every`` steps a durable step is due: the step itself when a local level took it,
else the newest step the local levels hold. It is *queued* and flushed (:mod:`.tier.flush`, in
the flusher's thread) as soon as every rank's flusher is idle; until then its local copies are
pinned against the levels' retention, as is the step being flushed. A due step that finds one
still queued replaces it (the durable level skips the older; ``stats.flush_lag`` says so). A
failed flush leaves the previous durable step; every rank learns of it through the facts the
next level step gathers and flushes the newest local step then.

Every decision is taken alike on every rank: from the step number, and from facts every rank
gathered (its flusher idle, its last flush failed - a flusher reports a failure before it is
idle, and a failure is agreed by all ranks inside the flush).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..parallel.distributed import Comm
from .handles import CheckpointerStats
from .tier.flush import Flusher, FlushStats

ShareDirs = Callable[[int], list[str]]  # step -> this rank's committed copies of its own share


class DurableFlushes:
    """The flush schedule of one Checkpointer's durable level (see the module's text).

    ``share_dirs(step)``: this rank's copies of its share of ``step``, nearest level first.
    """

    def __init__(self, comm: Comm, process_group: Any, root: str, backend: str | None,
                 keep_last: int | None, timeout_s: float, share_dirs: ShareDirs,
                 stats: CheckpointerStats, lock: threading.RLock):
        self._comm, self._share_dirs = comm, share_dirs
        self._stats, self._lock = stats, lock
        stats.durable = FlushStats()
        self.flusher = Flusher(root, stats.durable, lock, process_group=process_group,
                               keep_last=keep_last, backend=backend, timeout_s=timeout_s)
        self.queued: int | None = None  # the durable step due, waiting for every flusher
        self.current: int | None = None  # the step this rank's flusher was last given
        self._failures = 0  # this rank's failed flushes as of the last start
        self._idle_everywhere = True  # as of the last facts gathered
        self._failed_anywhere = False
        self.newest_local: int | None = None  # the newest step the local levels committed

    # ------------------------------------------------------------ facts of the level steps

    @property
    def _failed(self) -> bool:
        """This rank's last flush failed (counted before its flusher is idle again)."""
        with self._lock:
            assert self._stats.durable is not None
            return self._stats.durable.failures > self._failures

    def flags(self) -> tuple[bool, bool]:
        """This rank's (flusher idle, last flush failed), for the next level step's facts."""
        idle = self.flusher.idle  # first: a failure is counted before the flusher is idle
        return idle, self._failed

    def gathered(self, flags: list[tuple[bool, bool]]) -> None:
        """Every rank's :meth:`flags`, as a level step gathered them."""
        self._idle_everywhere = all(idle for idle, _ in flags)
        self._failed_anywhere = any(failed for _, failed in flags)

    def pinned(self) -> set[int]:
        """Steps the local levels' retention must keep: being flushed, or queued."""
        running = None if self.flusher.idle else self.current
        return {s for s in (running, self.queued) if s is not None}

    # ------------------------------------------------------------ after each step

    def after_step(self, step: int, local: bool, due: bool) -> None:
        """After ``step``'s local commits (``local``: some level took it; ``due``: a durable
        step is due): queue what the durable level needs, and start its flush if every rank's
        flusher is idle."""
        if local:
            self.newest_local = step
        if due and self.newest_local is not None:
            self._queue(self.newest_local)
        elif local and self._failed_anywhere and self.queued is None:
            self._queue(step)  # the last flush failed: the newest local step, now
        if self.queued is None:
            return
        if not local:  # no level step gathered the facts just now
            self.gathered([tuple(f) for f in self._comm.all_gather_json(
                list(self.flags()), "durable level: flusher idle")])
        if self._idle_everywhere:
            self._start(self.queued)
        else:
            with self._lock:
                self._stats.flush_lag = (f"step {self.queued} waits: the flush of step "
                                         f"{self.current} is still running on some rank")

    def _queue(self, step: int) -> None:
        if self.queued is not None and self.queued != step:
            with self._lock:
                self._stats.flush_skipped += 1
        self.queued = step

    def _start(self, step: int) -> None:
        with self._lock:
            assert self._stats.durable is not None
            self._failures = self._stats.durable.failures
            self._stats.flush_lag = ""
        self.queued, self.current, self._failed_anywhere = None, step, False
        self.flusher.start(step, self._share_dirs(step))

    def yield_to_a_save(self, step: int, timeout: float) -> None:
        """Before ``step`` is written to the durable level from the state (no level had room):
        the flush in flight ends first, and a queued older step is dropped, so that no flush
        publishes a step older than the one saved (its retention would remove the newer)."""
        self.flusher.join(timeout)
        if self.queued is not None and self.queued <= step:
            with self._lock:
                self._stats.flush_skipped += 1
            self.queued = None

    # ------------------------------------------------------------ flush now, stop

    def finish(self, timeout: float, final: bool) -> None:
        """Once the writer is idle (every rank calls it): wait for the flush in flight, then
        flush the step still queued, or the newest local step if the last flush failed or
        (``final=False``: :meth:`Checkpointer.flush`) the durable level lacks it; ``final``:
        then stop the flusher."""
        self.flusher.join(timeout)
        with self._lock:
            assert self._stats.durable is not None
            flushed = self._stats.durable.last_step
        newest = self.newest_local
        want = self.queued
        if newest is not None and ((not final and newest != flushed)
                                   or (want is None and self._failed)):
            want = newest  # flush(): the newest step, whatever was queued before it
        wants = set(self._comm.all_gather_json(want, "durable level: last flush"))
        if len(wants) == 1 and None not in wants:  # the same step on every rank
            self._start(wants.pop())
            self.flusher.join(timeout)
        if final:
            self.flusher.close()

    def stop(self, timeout: float) -> None:
        """After a failed save at close: no last flush (the ranks may disagree), only a stop."""
        self.flusher.join(timeout)
        self.flusher.close()

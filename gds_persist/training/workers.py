"""The Checkpointer's worker threads: one per stage (``write``, and ``snapshot`` in snapshot mode),
each taking jobs from its own queue in order.

A worker reports a job's ``Exception`` through the job's handle (the stage function does); a
``BaseException`` that escapes (``SystemExit``, ``KeyboardInterrupt``, a test's injected death)
ends the thread. :meth:`Workers.check`, run between the slices of every wait, then fails the job
that thread was doing with :class:`~gds_persist.errors.WorkerDied` and starts a new thread for
the next ones, so that a dead thread never hangs a wait. Once :meth:`Workers.stop` has told the
threads to stop, dead ones are no longer replaced.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import WorkerDied
from .handles import Job

log = logging.getLogger("gds_persist")

_STOP = object()


class Workers:
    """The threads of the stages added with :meth:`add`. ``prepare(stage)`` runs for each job
    taken from the queue before it becomes the thread's current job (the writer waits there for
    the warm-up); it must not raise."""

    def __init__(self, prepare: Callable[[str], None]):
        self._prepare = prepare
        self._lock = threading.Lock()
        self._runs: dict[str, Callable[[Job], None]] = {}
        self._queues: dict[str, queue.Queue[Any]] = {}
        self.threads: dict[str, threading.Thread] = {}  # by stage: the thread now serving it
        self._current: dict[str, Job] = {}  # by stage: the job its thread is doing
        self._death: dict[str, str] = {}  # why a thread stopped
        self._stopping = False

    def add(self, stage: str, run: Callable[[Job], None]) -> None:
        """Start the thread of ``stage``; ``run(job)`` does each of its jobs."""
        with self._lock:
            self._runs[stage] = run
            self._queues[stage] = queue.Queue()
            self._start(stage)

    def put(self, stage: str, job: Job) -> None:
        self._queues[stage].put(job)

    def alive(self, stage: str) -> bool:
        return self.threads[stage].is_alive()

    def any_alive(self) -> bool:
        return any(t.is_alive() for t in self.threads.values())

    def check(self) -> list[tuple[Job, WorkerDied]]:
        """Start a new thread for each dead one; return the jobs the dead ones were doing, each
        with its error (the caller fails them)."""
        dead_jobs = []
        with self._lock:
            for stage, t in list(self.threads.items()):
                if not t.is_alive() and not self._stopping:
                    job = self._current.pop(stage, None)
                    if job is not None:
                        dead_jobs.append((stage, job))
                    self._start(stage)
        out = []
        for stage, job in dead_jobs:
            why = self._death.pop(stage, "see the log for why")
            out.append((job, WorkerDied(
                f"the gds_persist {stage} thread died while saving step {job.handle.step} "
                f"({why}); that save is lost, later saves use a new thread")))
        return out

    def stop(self, deadline: float) -> None:
        """Tell every thread to stop after the jobs queued before; join them until ``deadline``
        (``time.monotonic()``)."""
        with self._lock:
            self._stopping = True
        for q in self._queues.values():
            q.put(_STOP)
        for t in self.threads.values():
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _start(self, stage: str) -> None:
        t = threading.Thread(target=self._loop, args=(stage, self._queues[stage]),
                             name=f"gds_persist-{stage}", daemon=True)
        self.threads[stage] = t
        t.start()

    def _loop(self, stage: str, q: queue.Queue[Any]) -> None:
        run = self._runs[stage]
        while True:
            job = q.get()
            if job is _STOP:
                return
            self._prepare(stage)
            with self._lock:
                self._current[stage] = job
            try:
                run(job)  # reports an Exception through the job's handle
            except BaseException as e:  # noqa: BLE001 - SystemExit & co. end this thread
                self._death[stage] = f"{type(e).__name__}: {e}"
                log.error("gds_persist %s thread stopped by %s: %s", stage, type(e).__name__, e)
                return  # the job stays in _current: check() fails it
            with self._lock:
                self._current.pop(stage, None)

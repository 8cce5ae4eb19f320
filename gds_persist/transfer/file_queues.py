"""Running a save's write requests on the I/O threads with each thread keeping to a file of its
own.

Writes to one file serialize on its inode lock wherever the filesystem takes it for every write
(tmpfs does; ext4 does for writes it cannot run under a shared lock). Requests interleaved over
the files and handed to whichever thread was free put two or three threads on one file for most
of a save (measured on tmpfs: 83% of the write time overlapped another write to the same file,
and the cores idled while those threads waited). Here every thread takes its next request from a
file no other thread is writing whenever there is one, so N threads write N files as the
aligned-writer limit does; threads share a file only where there is no free one (a one-file
save, or the last requests of a save).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from ..errors import CheckpointError

T = TypeVar("T")


class FileQueues(Generic[T]):
    """The requests still to run, one queue per file, and how many threads write each file."""

    def __init__(self, queues: Sequence[Sequence[T]]):
        self._pending = [deque(q) for q in queues]
        self._writers = [0] * len(self._pending)
        self._changed = threading.Condition()
        self.finished = 0  # requests run to the end (a hung storage shows as no change)
        self.running = 0  # worker threads still taking requests
        self.error: BaseException | None = None
        self.stopped = False

    def take(self, current: int) -> tuple[int, T] | None:
        """The next request for a thread that last wrote file ``current`` (-1: none yet): from
        the file with the fewest writers, staying on ``current`` on a tie, then the file with
        the most requests left. None when nothing is left or the run was stopped."""
        with self._changed:
            open_files = [i for i, q in enumerate(self._pending) if q]
            if self.stopped or not open_files:
                return None
            i = min(open_files, key=lambda i: (self._writers[i], i != current,
                                               -len(self._pending[i])))
            self._writers[i] += 1
            return i, self._pending[i].popleft()

    def done(self, i: int, error: BaseException | None) -> None:
        """A request of file ``i`` ended (``error``: how it failed; the first one stops the run)."""
        with self._changed:
            self._writers[i] -= 1
            self.finished += 1
            if error is not None and self.error is None:
                self.error, self.stopped = error, True
            self._changed.notify_all()

    def exited(self) -> None:
        with self._changed:
            self.running -= 1
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self.stopped = True

    def progress(self) -> tuple[int, int]:
        """Requests ended and workers running: what changes as the run goes on."""
        with self._changed:
            return self.finished, self.running

    def wait(self, seen: tuple[int, int], timeout_s: float) -> tuple[int, int] | None:
        """The progress once it differs from ``seen`` (taken before, so a change in between
        is not missed); None if ``timeout_s`` passed without one."""
        with self._changed:
            changed = self._changed.wait_for(
                lambda: (self.finished, self.running) != seen, timeout_s)
            return (self.finished, self.running) if changed else None


def run_by_file(pool: ThreadPoolExecutor, threads: int, queues: Sequence[Sequence[T]],
                run: Callable[[T], None], timeout_s: float, what: str) -> None:
    """Run every request of ``queues`` (one queue per file, each in its order) with ``run`` on
    at most ``threads`` threads of ``pool``, each keeping to a file of its own where it can.
    Raises the first failure, after the requests running then have ended (within ``timeout_s``);
    the requests not started are dropped. No request ending for ``timeout_s`` is a hung storage.
    """
    work = FileQueues(queues)
    workers = min(threads, sum(len(q) for q in queues))
    work.running = workers
    futures: list[Future[None]] = []
    try:
        for _ in range(workers):
            futures.append(pool.submit(_worker, work, run))
        seen = work.progress()
        while seen[1] and work.error is None:
            now = work.wait(seen, timeout_s)
            if now is None:
                raise CheckpointError(
                    f"{what} did not finish within {timeout_s:.0f} s (hung storage?); "
                    "raise io_timeout_s if the drive is just slow")
            seen = now
    except BaseException:
        _stop_and_drain(work, futures, timeout_s)
        raise
    if work.error is not None:
        _stop_and_drain(work, futures, timeout_s)
        raise work.error


def _worker(work: FileQueues[T], run: Callable[[T], None]) -> None:
    try:
        current = -1
        while (taken := work.take(current)) is not None:
            current, request = taken
            try:
                run(request)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                work.done(current, e)
                return
            work.done(current, None)
    finally:
        work.exited()


def _stop_and_drain(work: FileQueues[T], futures: list[Future[None]], timeout_s: float) -> None:
    """Drop the requests not started and let running ones end (bounded): a request that ran
    after its descriptor was closed could hit another file that reused the number."""
    work.stop()
    for f in futures:
        if f.cancel():  # queued behind other work, never started
            work.exited()
    seen: tuple[int, int] | None = work.progress()
    while seen is not None and seen[1]:
        seen = work.wait(seen, timeout_s)

"""Page-aligned host staging memory, bounded: the only host memory a save or load adds.

A :class:`StagingRing` holds a fixed number of page-aligned (pinned where CUDA is usable)
buffers (:class:`~gds_persist.backends.buffers.AlignedBuffer`); a writer blocks (with a timeout)
until one is free, so staging memory never grows with the checkpoint.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ..backends.buffers import AlignedBuffer
from ..errors import CheckpointError


class StagingRing:
    """A fixed set of equal aligned buffers handed out and returned in any order."""

    def __init__(self, count: int, block_bytes: int, timeout_s: float):
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self._all = [AlignedBuffer(block_bytes) for _ in range(count)]
        self._free: queue.Queue[AlignedBuffer] = queue.Queue()
        for b in self._all:
            self._free.put(b)

    @property
    def idle(self) -> bool:
        """Every buffer is back in the ring (no I/O holds one)."""
        return self._free.qsize() == len(self._all)

    @property
    def count(self) -> int:
        return len(self._all)

    @property
    def nbytes(self) -> int:
        return len(self._all) * self.block_bytes

    def acquire(self) -> AlignedBuffer:
        try:
            return self._free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise CheckpointError(
                f"no staging buffer came free within {self.timeout_s:.0f} s: the I/O threads are "
                "stuck (hung storage?); raise io_timeout_s if the drive is just slow"
            ) from None

    def release(self, buf: AlignedBuffer) -> None:
        self._free.put(buf)

    def close(self) -> None:
        for b in self._all:
            b.close()
        self._all.clear()

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_idle_rings: list[StagingRing] = []
_idle_lock = threading.Lock()


@contextmanager
def borrow_ring(count: int, block_bytes: int, timeout_s: float) -> Iterator[StagingRing]:
    """A staging ring for one save or load, reused across calls.

    Reuse matters: faulting in (and pinning) a fresh 128 MiB every save would cost more than a
    small checkpoint's write. At most one idle ring is kept; :func:`release_cached` frees it.
    """
    with _idle_lock:
        ring = next(
            (r for r in _idle_rings if r.count == count and r.block_bytes == block_bytes), None
        )
        if ring is not None:
            _idle_rings.remove(ring)
    if ring is None:
        ring = StagingRing(count, block_bytes, timeout_s)
    ring.timeout_s = timeout_s
    try:
        yield ring
    finally:
        if ring.idle:  # else stuck I/O may still use a buffer: drop the ring, do not reuse it
            _cache(ring)


def _cache(ring: StagingRing) -> None:
    with _idle_lock:
        stale, _idle_rings[:] = list(_idle_rings), [ring]
    for r in stale:
        r.close()


@contextmanager
def io_session(count: int, block_bytes: int, timeout_s: float,
               io_threads: int) -> Iterator[tuple[StagingRing, ThreadPoolExecutor]]:
    """A staging ring and the I/O threads that fill and drain it, for one save or load.

    After an error (a timeout included) this returns at once instead of joining the I/O threads:
    a thread stuck in a hung ``pwrite`` would otherwise make the bounded wait unbounded.
    """
    pool = ThreadPoolExecutor(io_threads, thread_name_prefix="gds_persist-io")
    try:
        with borrow_ring(count, block_bytes, timeout_s) as ring:
            yield ring, pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def release_cached() -> None:
    """Free the idle staging ring kept for the next save/load."""
    with _idle_lock:
        stale, _idle_rings[:] = list(_idle_rings), []
    for r in stale:
        r.close()

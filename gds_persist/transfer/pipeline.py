"""What the writer and the reader of data files share: the I/O resources of a pipeline, running
its requests with bounded queues and waits, staging buffers handed to requests, copies that
checksum what they copy, and joining the CRC32C of an extent's pieces."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..backends.base import Backend
from ..errors import CheckpointError
from ..format import crc32c, crc32c_combine
from ..stages import stage
from .staging import AlignedBuffer, StagingRing

T = TypeVar("T")


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def result_within(fut: Future[T], timeout_s: float, what: str) -> T:
    """``fut``'s result, waiting at most ``timeout_s``; :class:`CheckpointError` naming ``what``
    when it does not come."""
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise CheckpointError(
            f"{what} did not finish within {timeout_s:.0f} s (hung storage?); "
            "raise io_timeout_s if the drive is just slow"
        ) from None


def wait_all(futures: deque[Future[None]], timeout_s: float, what: str) -> None:
    while futures:
        result_within(futures.popleft(), timeout_s, what)


def drain_quietly(futures: deque[Future[Any]], timeout_s: float) -> bool:
    """After an error: cancel queued I/O and let running I/O finish (within ``timeout_s`` in
    all) before its buffers and descriptor go away. False if some I/O is still stuck.

    Cancelling matters: a queued write that ran after its descriptor was closed could hit
    another file that reused the descriptor number.
    """
    for fut in futures:
        fut.cancel()
    deadline = time.monotonic() + timeout_s
    for fut in futures:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return False
        except BaseException:  # noqa: BLE001 - the first error is already being raised
            pass
    return True


PieceCrc = tuple[int, int, int, int]  # (extent index, file offset, length, CRC32C)
CACHE_CHUNK = 1 << 20  # copy, then checksum, this much at a time: the CRC reads cached bytes


def interleave(groups: Iterable[Iterable[T]]) -> list[T]:
    """Round-robin over the groups (one per file), so every file of a save makes progress at
    once; each group's items keep their order."""
    lists = [list(g) for g in groups]
    out = []
    for i in range(max((len(g) for g in lists), default=0)):
        out += [g[i] for g in lists if i < len(g)]
    return out


def copy_and_checksum(src: np.ndarray, dst: np.ndarray | None, checksum: bool = True,
                      copying: str = "copy") -> int:
    """Copy ``src`` into ``dst`` (None: no copy) and return the CRC32C of the bytes (0 without
    ``checksum``), a cache-sized chunk at a time; ``copying`` names the copy's stage."""
    crc = 0
    for lo in range(0, src.nbytes, CACHE_CHUNK):
        chunk = src[lo : lo + CACHE_CHUNK]
        if dst is not None:
            with stage(copying, chunk.nbytes):
                np.copyto(dst[lo : lo + CACHE_CHUNK], chunk)
        if checksum:
            with stage("checksum", chunk.nbytes):
                crc = crc32c(chunk, crc)
    return crc


def join_piece_crcs(pieces: Iterable[PieceCrc]) -> dict[int, int]:
    """Each extent's CRC32C joined from the CRCs of its pieces (in any order)."""
    by_extent: dict[int, list[PieceCrc]] = {}
    for p in pieces:
        by_extent.setdefault(p[0], []).append(p)
    joined = {}
    for k, parts in by_extent.items():
        crc = 0
        for _, _, length, piece in sorted(parts, key=lambda p: p[1]):
            crc = crc32c_combine(crc, piece, length)
        joined[k] = crc
    return joined


@dataclass
class FilePipeline:
    """The resources data files' writer or reader runs on, and how it runs requests on them."""

    backend: Backend
    ring: StagingRing | None  # None: device transfers only
    pool: ThreadPoolExecutor  # the I/O threads
    timeout_s: float  # the bound on every wait for I/O
    progress: Callable[[int], None] | None = None  # bytes of each block done (from any thread)

    @property
    def threads(self) -> int:
        """The I/O threads of :attr:`pool`."""
        return self.pool._max_workers

    def sync_all(self, handles: list[Any], what: str) -> None:
        """fsync every file, concurrently: the data is durable before the manifest is written."""
        syncs = deque(self.pool.submit(self.backend.sync, h) for h in handles)
        try:
            wait_all(syncs, self.timeout_s, what)
        except BaseException:
            drain_quietly(syncs, self.timeout_s)
            raise

    def run_requests(self, requests: Iterable[T], submit: Callable[[T], Future[None]],
                     what: str) -> None:
        """Submit every request, at most two rings' worth queued at once (direct requests hold
        no buffer), surfacing the first failure early; after an error, queued ones are cancelled
        and running ones waited for (bounded) before it is raised."""
        assert self.ring is not None
        in_flight: deque[Future[None]] = deque()
        try:
            for request in requests:
                in_flight.append(submit(request))
                while len(in_flight) > 2 * self.ring.count or (in_flight and in_flight[0].done()):
                    result_within(in_flight.popleft(), self.timeout_s, what)
            wait_all(in_flight, self.timeout_s, what)
        except BaseException:
            drain_quietly(in_flight, self.timeout_s)
            raise

    def submit_staged(self, fn: Callable[..., None], *args: Any,
                      prepare: Callable[[AlignedBuffer], Any] | None = None) -> Future[None]:
        """Run ``fn(buf, *args, prepared)`` on an I/O thread with a staging buffer taken now
        (waiting for one bounds the memory); ``prepare(buf)`` runs here first (queuing copies
        into it). ``fn`` must give the buffer back; a cancelled request's buffer comes back
        by itself."""
        ring = self.ring
        assert ring is not None
        with stage("wait for a staging buffer"):
            buf = ring.acquire()
        try:
            prepared = prepare(buf) if prepare is not None else None
            fut = self.pool.submit(fn, buf, *args, prepared)
        except BaseException:
            ring.release(buf)
            raise

        def release_if_cancelled(done: Future[None]) -> None:
            if done.cancelled():
                ring.release(buf)

        fut.add_done_callback(release_if_cancelled)
        return fut

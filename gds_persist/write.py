"""Stage 3 of a save: move the planned bytes into one data file, checksumming as they pass.

Staged path (``direct`` and ``buffered``): the calling thread fills one staging buffer at a time
with the file's next block (tensor bytes plus the zero gaps between extents) and CRCs each piece
in the buffer, while up to ``io_threads`` earlier buffers are being written by the pool. The ring
bounds memory: when every buffer is in flight the filler waits for one to come back.

Device path (a backend with ``accepts_device``, all sources on CUDA): each extent goes straight
from device memory to the file; no host staging.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from .backends.base import Backend
from .checksum import device_crc32c_many
from .cuda_copy import StreamCopier, copier_for
from .errors import CheckpointError
from .format import Extent, crc32c
from .plan import FilePlan
from .staging import AlignedBuffer, StagingRing


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def block_pieces(extents: Sequence[Extent], first: int, lo: int, hi: int):
    """Yield ``(extent index, file_lo, file_hi)`` for extent bytes inside ``[lo, hi)``.

    ``first`` is the index of the first extent that may overlap; extents are sorted by offset.
    """
    for k in range(first, len(extents)):
        e = extents[k]
        if e.offset >= hi:
            return
        start, end = max(e.offset, lo), min(e.offset + e.length, hi)
        if start < end:
            yield k, start, end


def next_first(extents: Sequence[Extent], first: int, hi: int) -> int:
    while first < len(extents) and extents[first].offset + extents[first].length <= hi:
        first += 1
    return first


def wait_all(futures: deque[Future[None]], timeout_s: float, what: str) -> None:
    while futures:
        fut = futures.popleft()
        try:
            fut.result(timeout=timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"{what} did not finish within {timeout_s:.0f} s (hung storage?); "
                "raise io_timeout_s if the drive is just slow"
            ) from None


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


class FileWriter:
    """Writes one planned data file with ``backend``; returns the CRC32C of every extent."""

    def __init__(
        self,
        backend: Backend,
        ring: StagingRing | None,
        pool: ThreadPoolExecutor,
        timeout_s: float,
        progress: Callable[[int], None] | None = None,
    ):
        self.backend = backend
        self.ring = ring
        self.pool = pool
        self.timeout_s = timeout_s
        self.progress = progress  # called with the bytes of each finished write (any thread)

    def write(self, path: str, plan: FilePlan, sources: Sequence[torch.Tensor]) -> list[int]:
        handle = self.backend.open(path, write=True, size=plan.size)
        try:
            if self.backend.accepts_device and all(
                sources[e.storage].is_cuda for e in plan.extents
            ):
                crcs = self._write_from_device(handle, plan, sources)
            else:
                crcs = self._write_staged(handle, plan, sources)
            self.backend.sync(handle)
            return crcs
        finally:
            self.backend.close(handle)

    def _write_from_device(
        self, handle: object, plan: FilePlan, sources: Sequence[torch.Tensor]
    ) -> list[int]:
        pieces = [sources[e.storage][e.start : e.start + e.length] for e in plan.extents]
        crcs = device_crc32c_many(pieces)  # on the device, no host copy; one stream sync
        for e, piece in zip(plan.extents, pieces, strict=True):
            self.backend.pwrite(handle, piece, e.offset)
            if self.progress is not None:
                self.progress(e.length)
        return crcs

    def _write_staged(
        self, handle: object, plan: FilePlan, sources: Sequence[torch.Tensor]
    ) -> list[int]:
        assert self.ring is not None
        crcs = [0] * len(plan.extents)
        in_flight: deque[Future[None]] = deque()
        first = 0
        copier = copier_for([sources[e.storage] for e in plan.extents])  # CUDA: side-stream D2H
        try:
            for lo in range(0, plan.size, self.ring.block_bytes):
                hi = min(lo + self.ring.block_bytes, plan.size)
                buf = self.ring.acquire()
                try:
                    self._fill(buf, lo, hi, plan.extents, first, sources, crcs, copier)
                except BaseException:
                    self.ring.release(buf)
                    raise
                first = next_first(plan.extents, first, hi)
                fut = self.pool.submit(self._write_block, handle, buf, hi - lo, lo)
                fut.add_done_callback(self._releaser(buf))  # a cancelled write frees its buffer
                in_flight.append(fut)
                while in_flight and in_flight[0].done():
                    in_flight.popleft().result()  # surface a failed write early
            wait_all(in_flight, self.timeout_s, f"writing {plan.name}")
        except BaseException:
            drain_quietly(in_flight, self.timeout_s)
            raise
        return crcs

    @staticmethod
    def _fill(
        buf: AlignedBuffer,
        lo: int,
        hi: int,
        extents: Sequence[Extent],
        first: int,
        sources: Sequence[torch.Tensor],
        crcs: list[int],
        copier: StreamCopier | None = None,
    ) -> None:
        cursor = lo
        pieces = list(block_pieces(extents, first, lo, hi))
        for k, start, end in pieces:
            if start > cursor:
                buf.tensor[cursor - lo : start - lo].zero_()
            e = extents[k]
            src_lo = e.start + start - e.offset
            dst = buf.tensor[start - lo : end - lo]
            src = sources[e.storage][src_lo : src_lo + end - start]
            if copier is None:
                dst.copy_(src)
            else:  # queued on the side stream while earlier buffers are being written
                copier.copy(dst, src)
            cursor = end
        if cursor < hi:
            buf.tensor[cursor - lo : hi - lo].zero_()
        if copier is not None:
            copier.wait()  # this buffer's device-to-host copies are done
        for k, start, end in pieces:
            crcs[k] = crc32c(buf.view[start - lo : end - lo], crcs[k])

    def _releaser(self, buf: AlignedBuffer) -> Callable[[Future[None]], None]:
        def release_if_cancelled(fut: Future[None]) -> None:
            if fut.cancelled():
                self.ring.release(buf)  # type: ignore[union-attr]

        return release_if_cancelled

    def _write_block(self, handle: object, buf: AlignedBuffer, length: int, offset: int) -> None:
        try:
            self.backend.pwrite(handle, buf.view[:length], offset)
            if self.progress is not None:
                self.progress(length)
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]

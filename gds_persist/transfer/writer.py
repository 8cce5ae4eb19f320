"""Writing: move the planned bytes into data files, checksumming as they pass.

Staged path (``direct`` and ``buffered``): the calling thread fills one staging buffer at a time
with the file's next block (tensor bytes plus the zero gaps between extents) and CRCs each piece
in the buffer, while up to ``io_threads`` earlier buffers are being written by the pool. The ring
bounds memory: when every buffer is in flight the filler waits for one to come back.

Device path (a backend with ``accepts_device``, all sources on CUDA): each extent goes straight
from device memory to the file; no host staging.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Protocol

import torch

from ..backends.base import Backend
from ..format import Extent, crc32c
from ..settings import Settings
from ..stages import stage
from .crc import device_crc32c_many
from .cuda_copy import StreamCopier, copier_for
from .pipeline import (
    FilePipeline,
    block_pieces,
    byte_view,
    drain_quietly,
    next_first,
    wait_all,
)
from .staging import AlignedBuffer, io_session


class FileLayout(Protocol):
    """What the writer needs of a planned data file (``gds_persist.layout.FilePlan`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...  # a multiple of ALIGNMENT; the gaps between extents are zeros

    @property
    def extents(self) -> tuple[Extent, ...]: ...  # sorted by offset


class FileWriter(FilePipeline):
    """Writes one planned data file; returns the CRC32C of every extent. Calls the backend in
    the documented order (open, pwrite..., sync, close; close also after an error)."""

    def write(self, path: str, plan: FileLayout, sources: Sequence[torch.Tensor]) -> list[int]:
        """Write ``plan``'s extents of ``sources`` (flat uint8 tensors, by storage) to ``path``
        and fsync it."""
        with stage("open + preallocate"):
            handle = self.backend.open(path, write=True, size=plan.size)
        try:
            if self.backend.accepts_device and all(
                sources[e.storage].is_cuda for e in plan.extents
            ):
                crcs = self._write_from_device(handle, plan, sources)
            else:
                crcs = self._write_staged(handle, plan, sources)
            with stage("fsync"):
                self.backend.sync(handle)
            return crcs
        finally:
            self.backend.close(handle)

    def _write_from_device(
        self, handle: object, plan: FileLayout, sources: Sequence[torch.Tensor]
    ) -> list[int]:
        pieces = [sources[e.storage][e.start : e.start + e.length] for e in plan.extents]
        with stage("checksum (device)", sum(e.length for e in plan.extents)):
            crcs = device_crc32c_many(pieces)  # on the device, no host copy; one stream sync
        for e, piece in zip(plan.extents, pieces, strict=True):
            with stage("write (from device)", e.length):
                self.backend.pwrite(handle, piece, e.offset)
            if self.progress is not None:
                self.progress(e.length)
        return crcs

    def _write_staged(
        self, handle: object, plan: FileLayout, sources: Sequence[torch.Tensor]
    ) -> list[int]:
        assert self.ring is not None
        crcs = [0] * len(plan.extents)
        in_flight: deque[Future[None]] = deque()
        first = 0
        copier = copier_for([sources[e.storage] for e in plan.extents])  # CUDA: side-stream D2H
        try:
            for lo in range(0, plan.size, self.ring.block_bytes):
                hi = min(lo + self.ring.block_bytes, plan.size)
                with stage("wait for a staging buffer"):
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
        pieces = list(block_pieces(extents, first, lo, hi))
        with stage("copy to staging" if copier is None else "queue D2H", hi - lo):
            FileWriter._copy_pieces(buf, lo, hi, extents, pieces, sources, copier)
        if copier is not None:
            with stage("wait D2H", hi - lo):
                copier.wait()  # this buffer's device-to-host copies are done
        with stage("checksum", sum(end - start for _, start, end in pieces)):
            for k, start, end in pieces:
                crcs[k] = crc32c(buf.view[start - lo : end - lo], crcs[k])

    @staticmethod
    def _copy_pieces(
        buf: AlignedBuffer,
        lo: int,
        hi: int,
        extents: Sequence[Extent],
        pieces: list[tuple[int, int, int]],
        sources: Sequence[torch.Tensor],
        copier: StreamCopier | None,
    ) -> None:
        cursor = lo
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

    def _releaser(self, buf: AlignedBuffer) -> Callable[[Future[None]], None]:
        def release_if_cancelled(fut: Future[None]) -> None:
            if fut.cancelled():
                self.ring.release(buf)  # type: ignore[union-attr]

        return release_if_cancelled

    def _write_block(self, handle: object, buf: AlignedBuffer, length: int, offset: int) -> None:
        try:
            with stage("write", length):
                self.backend.pwrite(handle, buf.view[:length], offset)
            if self.progress is not None:
                self.progress(length)
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]


def write_plan(
    backend: Backend,
    directory: str,
    files: Sequence[FileLayout],
    storages: Sequence[torch.UntypedStorage],
    cfg: Settings,
    progress: Callable[[int], None] | None = None,
) -> list[Extent]:
    """Write every planned file into ``directory`` from ``storages`` (indexed by the extents'
    ``storage``); return the sealed extents (with their CRC32C), file by file."""
    sources = [byte_view(s) for s in storages]
    sealed: list[Extent] = []
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        writer = FileWriter(backend, ring, pool, cfg.io_timeout_s, progress)
        for f in files:
            crcs = writer.write(os.path.join(directory, f.name), f, sources)
            sealed += [replace(e, crc32c=c) for e, c in zip(f.extents, crcs, strict=True)]
    return sealed

"""Load stages: read the extents of one data file into destination storages, verifying CRC32C.

Staged path: up to ``ring`` buffers of the file are being read by the I/O pool while the calling
thread copies finished blocks into the destination tensors and checksums them, in file order.
Device path (``accepts_device`` backend, CUDA destination): extents are read straight into
device memory.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .backends.base import Backend
from .checksum import device_crc32c_many
from .cuda_copy import StreamCopier, copier_for
from .errors import CheckpointError, ChecksumError, TruncatedError
from .format import DataFile, Extent, align_up, crc32c
from .staging import AlignedBuffer, StagingRing
from .write import block_pieces, drain_quietly, next_first

Describe = Callable[[int], str]  # storage index -> the key path(s) of its tensors


def check_file(directory: str, f: DataFile) -> str:
    path = os.path.join(directory, f.name)
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise TruncatedError(f"data file {path} is missing; the checkpoint is incomplete") from None
    if actual < f.size:
        raise TruncatedError(
            f"data file {path} is {actual} bytes but the manifest records {f.size}: it was "
            "truncated; restore it or use an earlier checkpoint"
        )
    return path


def blocks_to_read(extents: Sequence[Extent], block_bytes: int) -> list[tuple[int, int]]:
    """Aligned ``[lo, hi)`` ranges covering every extent (sorted by offset), each at most
    ``block_bytes``; nearby extents share blocks, so the reads stay large."""
    spans: list[list[int]] = []
    for e in extents:
        hi = align_up(e.offset + e.length)
        if spans and spans[-1][1] >= e.offset:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([e.offset, hi])
    blocks = []
    for span_lo, span_hi in spans:
        for lo in range(span_lo, span_hi, block_bytes):
            blocks.append((lo, min(lo + block_bytes, span_hi)))
    return blocks


class FileReader:
    def __init__(
        self,
        backend: Backend,
        ring: StagingRing | None,
        pool: ThreadPoolExecutor,
        timeout_s: float,
        verify: bool,
        describe: Describe,
        errors: list[ChecksumError] | None = None,
        progress: Callable[[int], None] | None = None,
    ):
        self.backend = backend
        self.ring = ring
        self.pool = pool
        self.timeout_s = timeout_s
        self.verify = verify
        self.describe = describe
        self.errors = errors  # collect mismatches here instead of raising the first one
        self.progress = progress  # called with the bytes of each block consumed

    def read(
        self, path: str, extents: Sequence[Extent], dests: Sequence[torch.Tensor] | None
    ) -> None:
        """Read ``extents`` of ``path`` into ``dests`` (per storage); ``None``: checksum only."""
        extents = sorted(extents, key=lambda e: e.offset)
        handle = self.backend.open(path, write=False)
        try:
            if (
                dests is not None
                and self.backend.accepts_device
                and all(dests[e.storage].is_cuda for e in extents)
            ):
                self._read_to_device(handle, path, extents, dests)
            else:
                self._read_staged(handle, path, extents, dests)
        finally:
            self.backend.close(handle)

    def _check(self, path: str, e: Extent, actual: int) -> None:
        if self.verify and actual != e.crc32c:
            error = ChecksumError(
                f"checksum mismatch in {self.describe(e.storage)}: file {path}, offset {e.offset}, "
                f"{e.length} bytes: recorded crc32c {e.crc32c:08x}, read {actual:08x}; the data "
                "file is corrupted - load an earlier checkpoint"
            )
            if self.errors is None:
                raise error
            self.errors.append(error)

    def _read_to_device(
        self, handle: object, path: str, extents: Sequence[Extent], dests: Sequence[torch.Tensor]
    ) -> None:
        pieces = []
        for e in extents:
            piece = dests[e.storage][e.start : e.start + e.length]
            got = self.backend.pread(handle, piece, e.offset)
            if got != e.length:
                raise TruncatedError(
                    f"{path}: short read at offset {e.offset} ({got} of {e.length} bytes)"
                )
            pieces.append(piece)
            if self.progress is not None:
                self.progress(e.length)
        if self.verify:  # on the device (kernels/crc32c.cu), before the data is handed back
            for e, crc in zip(extents, device_crc32c_many(pieces), strict=True):
                self._check(path, e, crc)

    def _read_staged(
        self,
        handle: object,
        path: str,
        extents: Sequence[Extent],
        dests: Sequence[torch.Tensor] | None,
    ) -> None:
        assert self.ring is not None
        blocks = blocks_to_read(extents, self.ring.block_bytes)
        crcs = [0] * len(extents)
        in_flight: deque[tuple[AlignedBuffer, int, int, Future[int]]] = deque()
        next_block = first = 0
        copier = copier_for([dests[e.storage] for e in extents]) if dests is not None else None
        try:
            while next_block < len(blocks) or in_flight:
                while next_block < len(blocks) and len(in_flight) < self.ring.count:
                    lo, hi = blocks[next_block]
                    buf = self.ring.acquire()
                    fut = self.pool.submit(self.backend.pread, handle, buf.view[: hi - lo], lo)
                    in_flight.append((buf, lo, hi, fut))
                    next_block += 1
                buf, lo, hi, fut = in_flight.popleft()
                try:
                    got = self._result(fut, path)
                    if got != hi - lo:
                        raise TruncatedError(
                            f"{path}: short read at offset {lo} ({got} of {hi - lo} bytes)"
                        )
                    self._consume(path, buf, lo, hi, extents, first, dests, crcs, copier)
                    if self.progress is not None:
                        self.progress(hi - lo)
                finally:
                    self.ring.release(buf)
                first = next_first(extents, first, hi)
        except BaseException:
            if drain_quietly(deque(f for *_, f in in_flight), self.timeout_s):
                for buf, *_ in in_flight:  # stuck reads keep theirs: the ring is then dropped
                    self.ring.release(buf)
            raise

    def _result(self, fut: Future[int], path: str) -> int:
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"reading {path} did not finish within {self.timeout_s:.0f} s (hung storage?)"
            ) from None

    def _consume(
        self,
        path: str,
        buf: AlignedBuffer,
        lo: int,
        hi: int,
        extents: Sequence[Extent],
        first: int,
        dests: Sequence[torch.Tensor] | None,
        crcs: list[int],
        copier: StreamCopier | None = None,
    ) -> None:
        try:
            for k, start, end in block_pieces(extents, first, lo, hi):
                e = extents[k]
                if dests is not None:
                    dst_lo = e.start + start - e.offset
                    dst = dests[e.storage][dst_lo : dst_lo + end - start]
                    src = buf.tensor[start - lo : end - lo]
                    if copier is None:
                        dst.copy_(src)
                    else:
                        copier.copy(dst, src)  # host-to-device on the side stream, under the CRC
                if self.verify:
                    crcs[k] = crc32c(buf.view[start - lo : end - lo], crcs[k])
                if end == e.offset + e.length:
                    self._check(path, e, crcs[k])
        finally:
            if copier is not None:
                copier.wait()  # the buffer goes back to the ring only once it was copied out

"""Reading: the extents of one data file into destination storages, checksumming as they pass.

Staged path: up to ``ring`` buffers of the file are being read by the I/O pool while the calling
thread copies finished blocks into the destination tensors and checksums them, in file order.
Device path (``accepts_device`` backend, CUDA destination): extents are read straight into
device memory and checksummed there.

Checksums: once every byte of an extent has passed, its CRC32C goes to the ``on_checksum`` hook
``(path, extent, actual)``. The default hook compares it with the recorded CRC32C and raises
:func:`checksum_mismatch`; others collect mismatches (``verify``) or record the CRC of a piece of
an extent to combine with other ranks' pieces (a shared load). ``on_bytes`` receives the bytes
of every piece as they pass, for readers that stream them elsewhere (an export).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..errors import ChecksumError, TruncatedError
from ..format import Extent, align_up, crc32c
from .crc import device_crc32c_many
from .cuda_copy import StreamCopier, copier_for
from .pipeline import FilePipeline, block_pieces, drain_quietly, next_first, result_within
from .staging import AlignedBuffer

Describe = Callable[[int], str]  # storage index -> the key path(s) of its tensors
OnChecksum = Callable[[str, Extent, int], None]  # (file path, extent, CRC32C of the bytes read)
OnBytes = Callable[[Extent, int, memoryview], None]  # (extent, offset in its storage, bytes)
Dests = Sequence[torch.Tensor | None]  # flat uint8 destination per storage; None: not read


def checksum_mismatch(what: str, path: str, e: Extent, actual: int) -> ChecksumError:
    """The error for bytes that do not match their recorded CRC32C (the one wording)."""
    return ChecksumError(
        f"checksum mismatch in {what}: file {path}, offset {e.offset}, {e.length} bytes: "
        f"recorded crc32c {e.crc32c:08x}, read {actual:08x}; the data file is corrupted - load "
        "an earlier checkpoint"
    )


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


@dataclass
class FileReader(FilePipeline):
    """Reads extents of one data file (backend calls: open, pread..., close; close also after
    an error).

    ``verify``: compute each extent's CRC32C and hand it to ``on_checksum`` (default: compare,
    and raise :func:`checksum_mismatch` naming ``describe(storage)``); with an ``on_checksum``
    hook CRCs are always computed. ``on_bytes``: see the module docstring (staged path only).
    """

    verify: bool = field(default=True, kw_only=True)
    describe: Describe = field(default=lambda storage: f"storage #{storage}", kw_only=True)
    on_checksum: OnChecksum | None = field(default=None, kw_only=True)
    on_bytes: OnBytes | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self.checksums = self.verify or self.on_checksum is not None
        self._on_checksum: OnChecksum = self.on_checksum or self.check

    def check(self, path: str, e: Extent, actual: int) -> None:
        """The default ``on_checksum``: raise if ``actual`` is not the recorded CRC32C."""
        if actual != e.crc32c:
            raise checksum_mismatch(self.describe(e.storage), path, e, actual)

    def read(self, path: str, extents: Sequence[Extent], dests: Dests | None, *,
             source: str | None = None) -> None:
        """Read ``extents`` of ``path`` into ``dests`` (per storage); ``None``: no copy (only
        the hooks see the bytes). ``source``: what to open instead of ``path`` (the held file's
        ``/proc/self/fd/N``, :mod:`gds_persist.transfer.opened`); ``path`` names it in errors."""
        extents = sorted(extents, key=lambda e: e.offset)
        handle = self.backend.open(source or path, write=False)
        try:
            targets = [dests[e.storage] for e in extents] if dests is not None else []
            if (
                dests is not None
                and self.on_bytes is None
                and self.backend.accepts_device
                and all(t is not None and t.is_cuda for t in targets)
            ):
                self._read_to_device(handle, path, extents, dests)
            else:
                self._read_staged(handle, path, extents, dests)
        finally:
            self.backend.close(handle)

    def _read_to_device(
        self, handle: object, path: str, extents: Sequence[Extent], dests: Dests
    ) -> None:
        pieces = []
        for e in extents:
            dest = dests[e.storage]
            assert dest is not None
            piece = dest[e.start : e.start + e.length]
            got = self.backend.pread(handle, piece, e.offset)
            if got != e.length:
                raise TruncatedError(
                    f"{path}: short read at offset {e.offset} ({got} of {e.length} bytes)"
                )
            pieces.append(piece)
            if self.progress is not None:
                self.progress(e.length)
        if self.checksums:  # on the device (kernels/crc32c.cu), before the data is handed back
            for e, crc in zip(extents, device_crc32c_many(pieces), strict=True):
                self._on_checksum(path, e, crc)

    def _read_staged(
        self, handle: object, path: str, extents: Sequence[Extent], dests: Dests | None
    ) -> None:
        assert self.ring is not None
        blocks = blocks_to_read(extents, self.ring.block_bytes)
        crcs = [0] * len(extents)
        in_flight: deque[tuple[AlignedBuffer, int, int, Future[int]]] = deque()
        next_block = first = 0
        targets = [dests[e.storage] for e in extents] if dests is not None else []
        copier = copier_for([t for t in targets if t is not None])
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
                    got = result_within(fut, self.timeout_s, f"reading {path}")
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

    def _consume(
        self,
        path: str,
        buf: AlignedBuffer,
        lo: int,
        hi: int,
        extents: Sequence[Extent],
        first: int,
        dests: Dests | None,
        crcs: list[int],
        copier: StreamCopier | None = None,
    ) -> None:
        try:
            for k, start, end in block_pieces(extents, first, lo, hi):
                e = extents[k]
                at = e.start + start - e.offset  # where the piece belongs in its storage
                dest = dests[e.storage] if dests is not None else None
                if dest is not None:
                    dst = dest[at : at + end - start]
                    src = buf.tensor[start - lo : end - lo]
                    if copier is None:
                        dst.copy_(src)
                    else:
                        copier.copy(dst, src)  # host-to-device on the side stream, under the CRC
                if self.on_bytes is not None:
                    with buf.view[start - lo : end - lo] as piece:
                        self.on_bytes(e, at, piece)
                if self.checksums:
                    crcs[k] = crc32c(buf.view[start - lo : end - lo], crcs[k])
                    if end == e.offset + e.length:
                        self._on_checksum(path, e, crcs[k])
        finally:
            if copier is not None:
                copier.wait()  # the buffer goes back to the ring only once it was copied out

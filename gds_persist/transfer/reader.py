"""Reading: extents of data files into destination storages, checksumming as they pass.

Every file's needed byte ranges are cut into requests (:mod:`.segments`) and all of them run on
the I/O threads at once, each doing its whole share of the work:

* a **direct** request reads a run of one extent's aligned interior (its whole blocks) straight
  into its destination's memory (no copy) and checksums it there, where that memory meets the
  backend's ``host_alignment``: on tmpfs any torch allocation, also for the records of a
  torch.save file, which sit 64 bytes apart rather than on block boundaries (a 1 GiB stock file
  from tmpfs: 0.82 of torch.load's time against 0.91 staging such extents whole); where
  O_DIRECT needs 512 bytes, staging into torch allocations measured faster on the virtio disk
  than page-aligned destinations read straight in (1.7 vs 2.6 GB/s for 2 GiB);
* a **staged** request reads a window of the file into a staging buffer (bounded memory: the
  submitting thread waits for a free one), then copies each piece out, checksumming it right
  after (while it is in cache); pieces for CUDA destinations go host-to-device on a side stream
  and are checksummed on the device afterwards, in one batch (a host CRC of the buffer where the
  device kernel cannot run).

Checksums: once every byte of an extent has been read, its CRC32C (joined from its pieces with
:func:`~gds_persist.format.checksum.crc32c_combine`) goes to the ``on_checksum`` hook
``(path, extent, actual)``. The default hook compares it with the recorded CRC32C and raises
:func:`checksum_mismatch`; others collect mismatches (``verify``) or record the CRC of a piece of
an extent to combine with other ranks' pieces (a shared load). ``on_bytes`` receives the bytes
of every piece as they pass (one call at a time, in no particular order), for readers that
stream them elsewhere (an export).

Device path (``accepts_device`` backend, CUDA destinations only): extents are read straight into
device memory and checksummed there.

Encoded extents (format version 4: stored as one blosc2 chunk, :mod:`gds_persist.format.codec`)
are one request each: the stored bytes are read into a staging buffer, their CRC32C checked
against ``stored_crc32c``, decoded straight into a host destination (into a scratch buffer for a
CUDA destination, then copied up), and the CRC32C of the decoded bytes goes to ``on_checksum``
like any extent's. Stored bytes that do not match, or do not decode, go to ``on_error`` as a
:class:`ChecksumError` naming the tensor (the default raises it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ChecksumError, TruncatedError
from ..format import Extent, align_up, codec, crc32c
from ..stages import stage
from .crc import device_crc32c_many, device_crc32c_or_none
from .cuda_copy import StreamCopier, copier_for
from .pipeline import FilePipeline, PieceCrc, copy_and_checksum, join_piece_crcs
from .segments import (
    SHORT_BYTES,
    Segment,
    cut,
    extent_spans,
    interior,
    short_first,
    split_head,
)
from .staging import AlignedBuffer

Describe = Callable[[int], str]  # storage index -> the key path(s) of its tensors
OnChecksum = Callable[[str, Extent, int], None]  # (file path, extent, CRC32C of the bytes read)
OnBytes = Callable[[Extent, int, memoryview], None]  # (extent, offset in its storage, bytes)
OnError = Callable[[ChecksumError], None]  # stored bytes that do not match or do not decode
Dests = Sequence[torch.Tensor | None]  # flat uint8 destination per storage; None: not read
DIRECT_MIN = 1 << 20  # an extent this large is read into its destination directly when aligned



def checksum_mismatch(what: str, path: str, e: Extent, actual: int) -> ChecksumError:
    """The error for bytes that do not match their recorded CRC32C (the one wording)."""
    return ChecksumError(
        f"checksum mismatch in {what}: file {path}, offset {e.offset}, {e.length} bytes: "
        f"recorded crc32c {e.crc32c:08x}, read {actual:08x}; the data file is corrupted - load "
        "an earlier checkpoint"
    )


def stored_mismatch(what: str, path: str, e: Extent, actual: int) -> ChecksumError:
    """The error for encoded bytes on disk that do not match their recorded CRC32C."""
    return ChecksumError(
        f"checksum mismatch in {what}: file {path}, offset {e.offset}, {e.stored} stored "
        f"({e.codec}-encoded) bytes: recorded stored_crc32c {e.stored_crc32c:08x}, read "
        f"{actual:08x}; the data file is corrupted - load an earlier checkpoint"
    )


def undecodable(what: str, path: str, e: Extent, why: str) -> ChecksumError:
    return ChecksumError(
        f"{what}: the {e.stored} stored ({e.codec}-encoded) bytes at file {path}, offset "
        f"{e.offset} do not decode to its {e.length} bytes ({why}); the data file is corrupted "
        "- load an earlier checkpoint"
    )


@dataclass
class _OpenFile:
    path: str
    extents: list[Extent]  # raw extents, sorted by offset
    handle: Any
    pieces: list[PieceCrc] = field(default_factory=list)  # host CRCs of pieces, any order
    encoded: list[Extent] = field(default_factory=list)  # encoded extents (version 4)


@dataclass
class FileReader(FilePipeline):
    """Reads extents of data files (backend calls per file: open, pread..., close; close also
    after an error).

    ``verify``: compute each extent's CRC32C and hand it to ``on_checksum`` (default: compare,
    and raise :func:`checksum_mismatch` naming ``describe(storage)``); with an ``on_checksum``
    hook CRCs are always computed. ``on_bytes``: see the module docstring (staged path only).
    """

    verify: bool = field(default=True, kw_only=True)
    describe: Describe = field(default=lambda storage: f"storage #{storage}", kw_only=True)
    on_checksum: OnChecksum | None = field(default=None, kw_only=True)
    on_bytes: OnBytes | None = field(default=None, kw_only=True)
    on_error: OnError | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self.checksums = self.verify or self.on_checksum is not None
        self._on_checksum: OnChecksum = self.on_checksum or self.check
        self._bytes_lock = threading.Lock()
        self._scratch = threading.local()

    def _error(self, error: ChecksumError) -> None:
        if self.on_error is None:
            raise error
        self.on_error(error)

    def check(self, path: str, e: Extent, actual: int) -> None:
        """The default ``on_checksum``: raise if ``actual`` is not the recorded CRC32C."""
        if actual != e.crc32c:
            raise checksum_mismatch(self.describe(e.storage), path, e, actual)

    def read(self, path: str, extents: Sequence[Extent], dests: Dests | None, *,
             source: str | None = None) -> None:
        """Read ``extents`` of ``path`` into ``dests`` (per storage); ``None``: no copy (only
        the hooks see the bytes). ``source``: what to open instead of ``path`` (the held file's
        ``/proc/self/fd/N``, :mod:`gds_persist.transfer.opened`); ``path`` names it in errors."""
        self.read_files([(path, extents, source)], dests)

    def read_files(self, files: Sequence[tuple[str, Sequence[Extent], str | None]],
                   dests: Dests | None) -> None:
        """Read the extents of several files (``(path, extents, source)`` as for :meth:`read`),
        all of them concurrently."""
        opened: list[_OpenFile] = []
        try:
            for path, extents, source in files:
                with stage("open"):
                    ordered = sorted(extents, key=lambda e: e.offset)
                    opened.append(_OpenFile(path, [e for e in ordered if not e.encoded],
                                            self.backend.open(source or path, write=False),
                                            encoded=[e for e in ordered if e.encoded]))
            device = [f for f in opened if not f.encoded and self._to_device(f, dests)]
            for f in device:
                assert dests is not None
                self._read_to_device(f, dests)
            staged = [f for f in opened if f not in device]
            if staged:
                self._read_staged(staged, dests)
        finally:
            for f in opened:
                self.backend.close(f.handle)

    def _to_device(self, f: _OpenFile, dests: Dests | None) -> bool:
        return (dests is not None and self.on_bytes is None and self.backend.accepts_device
                and all((t := dests[e.storage]) is not None and t.is_cuda for e in f.extents))

    def _read_to_device(self, f: _OpenFile, dests: Dests) -> None:
        pieces = []
        for e in f.extents:
            dest = dests[e.storage]
            assert dest is not None
            piece = dest[e.start : e.start + e.length]
            with stage("read (to device)", e.length):
                got = self.backend.pread(f.handle, piece, e.offset)
            if got != e.length:
                raise TruncatedError(
                    f"{f.path}: short read at offset {e.offset} ({got} of {e.length} bytes)"
                )
            pieces.append(piece)
            if self.progress is not None:
                self.progress(e.length)
        if self.checksums:  # on the device (kernels/crc32c.cu), before the data is handed back
            with stage("checksum (device)", sum(e.length for e in f.extents)):
                crcs = device_crc32c_many(pieces)
            for e, crc in zip(f.extents, crcs, strict=True):
                self._on_checksum(f.path, e, crc)

    def _read_staged(self, files: list[_OpenFile], dests: Dests | None) -> None:
        assert self.ring is not None
        hosts = [_host_array(d) for d in dests] if dests is not None else []
        cuda = [t for t in dests or () if t is not None and t.is_cuda]
        copier = copier_for(cuda)
        on_device = self.checksums and bool(cuda) and device_crc32c_or_none(
            [cuda[0][:1]]) is not None  # the kernel runs: CUDA pieces are checked there
        segments = self._in_order(sorted(
            [(f, seg) for f in files for seg in self._segments(f, hosts)],
            key=lambda r: r[1].lo))  # every file at once
        encoded = sorted([(f, e) for f in files for e in f.encoded], key=lambda r: r[1].offset)
        requests: list[tuple[_OpenFile, Segment | Extent]] = [*segments, *encoded]

        def submit(r: tuple[_OpenFile, Segment | Extent]) -> Future[None]:
            f, request = r
            if isinstance(request, Extent):
                return self._submit_encoded(f, request, dests, hosts, copier)
            return self._submit(f, request, dests, hosts, copier, on_device)

        self.run_requests(requests, submit, f"reading {files[0].path}")
        for f in files:
            self._check_extents(f, dests, on_device)

    def _in_order(self, segments: list[tuple[_OpenFile, Segment]]
                  ) -> list[tuple[_OpenFile, Segment]]:
        """The order requests are issued in. Where the backend times the load's first requests
        (``probe_requests``), those go first: long requests, each cut to its ``probe_bytes``
        head. Then the rest, short requests first (:func:`short_first`)."""
        head_bytes = self.backend.probe_bytes
        count = self.backend.probe_requests if head_bytes else 0
        long = [r for r in segments if r[1].nbytes >= max(SHORT_BYTES, head_bytes)]
        probed = (long if len(long) >= count else segments)[:count]
        heads: list[tuple[_OpenFile, Segment]] = []
        tails: list[tuple[_OpenFile, Segment]] = []
        for f, seg in probed:
            head, tail = split_head(seg, head_bytes)
            heads.append((f, head))
            if tail is not None:
                tails.append((f, tail))
        rest = tails + [r for r in segments if not any(r is p for p in probed)]
        return heads + short_first(rest, lambda r: r[1])

    def _segments(self, f: _OpenFile, hosts: Sequence[np.ndarray | None]) -> list[Segment]:
        align = self.backend.host_alignment
        # an object store: an extent smaller than a request is staged with its neighbours
        # (one ranged GET per window), not fetched alone
        least = self.ring.block_bytes if self.backend.whole_requests else DIRECT_MIN  # type: ignore

        def direct_bytes(e: Extent) -> int:
            dest = hosts[e.storage] if hosts else None
            if align is None or dest is None or e.length < least or self.on_bytes:
                return 0
            head, n = interior(e)
            return n if (dest.ctypes.data + e.start + head) % align == 0 else 0

        return cut(f.extents, extent_spans(f.extents), self.ring.block_bytes,  # type: ignore
                   direct_bytes)

    def _submit(self, f: _OpenFile, seg: Segment, dests: Dests | None,
                hosts: Sequence[np.ndarray | None], copier: StreamCopier | None,
                on_device: bool) -> Future[None]:
        if seg.direct:
            return self.pool.submit(self._read_direct, f, seg, hosts)
        return self.submit_staged(self._read_buffer, f, seg, dests, hosts, copier, on_device)

    def _submit_encoded(self, f: _OpenFile, e: Extent, dests: Dests | None,
                        hosts: Sequence[np.ndarray | None],
                        copier: StreamCopier | None) -> Future[None]:
        if align_up(e.stored) <= self.ring.block_bytes:  # type: ignore[union-attr]
            return self.submit_staged(self._read_encoded, f, e, dests, hosts, copier)
        # stored by a writer with larger units than this reader's staging buffers
        return self.pool.submit(self._read_encoded, None, f, e, dests, hosts, copier, None)

    def _read_encoded(self, buf: AlignedBuffer | None, f: _OpenFile, e: Extent,
                      dests: Dests | None, hosts: Sequence[np.ndarray | None],
                      copier: StreamCopier | None, _: None) -> None:
        own = buf is None  # the stored extent is larger than a staging buffer: a buffer of its own
        if own:
            buf = AlignedBuffer(align_up(e.stored), pin=False)
        assert buf is not None
        try:
            span = align_up(e.stored)
            view, array = buf.view[:span], buf.array[:span]
            self._pread(f, view, e.offset)
            stored = array[: e.stored]
            if self.checksums:
                with stage("checksum (stored)", e.stored):
                    actual = crc32c(stored)
                if actual != e.stored_crc32c:
                    self._error(stored_mismatch(self.describe(e.storage), f.path, e, actual))
                    return
            dest = dests[e.storage] if dests is not None else None
            host = hosts[e.storage] if hosts and dest is not None and not dest.is_cuda else None
            out = (host[e.start : e.start + e.length] if host is not None
                   else self._scratch_array(e.length))
            try:
                with stage("decompress", e.length):
                    codec.decode(stored, out)
            except ValueError as why:
                self._error(undecodable(self.describe(e.storage), f.path, e, str(why)))
                return
            if self.on_bytes is not None:
                with self._bytes_lock:
                    self.on_bytes(e, e.start, memoryview(out.data))
            if dest is not None and dest.is_cuda:
                assert copier is not None
                with stage("copy to device", e.length):
                    copier.copy_and_wait(dest[e.start : e.start + e.length],
                                         torch.from_numpy(out))
            if self.checksums:
                with stage("checksum", e.length):
                    self._on_checksum(f.path, e, crc32c(out))
        finally:
            if own:
                buf.close()
            else:
                self.ring.release(buf)  # type: ignore[union-attr]

    def _scratch_array(self, nbytes: int) -> np.ndarray:
        """This thread's reusable host buffer for decoded bytes bound elsewhere."""
        held = getattr(self._scratch, "array", None)
        if held is None or held.nbytes < nbytes:
            held = self._scratch.array = np.empty(max(nbytes, 1), dtype=np.uint8)
        return held[:nbytes]

    def _pread(self, f: _OpenFile, view: memoryview, offset: int, what: str = "read",
               need: int | None = None) -> None:
        """Fill ``view`` from ``offset``; only its first ``need`` bytes must be in the file (a
        window over the end of a file the engine did not write: a torch.save or safetensors
        file ends where its last record does, not at a block boundary)."""
        with stage(what, view.nbytes):
            got = self.backend.pread(f.handle, view, offset)
        if got < (view.nbytes if need is None else need):
            raise TruncatedError(
                f"{f.path}: short read at offset {offset} ({got} of {view.nbytes} bytes)"
            )
        if self.progress is not None:
            self.progress(view.nbytes)

    def _read_direct(self, f: _OpenFile, seg: Segment, hosts: Sequence[np.ndarray | None]) -> None:
        (k, lo, hi), = seg.pieces
        e = f.extents[k]
        dest = hosts[e.storage]
        assert dest is not None
        at = e.start + lo - e.offset
        data = dest[at : at + hi - lo]
        self._pread(f, data.data, lo, "read (into the tensor)")
        if self.checksums:
            with stage("checksum", hi - lo):
                f.pieces.append((k, lo, hi - lo, crc32c(data)))

    def _read_buffer(self, buf: AlignedBuffer, f: _OpenFile, seg: Segment, dests: Dests | None,
                     hosts: Sequence[np.ndarray | None], copier: StreamCopier | None,
                     on_device: bool, _: None) -> None:
        try:
            need = seg.pieces[-1][2] - seg.lo if seg.pieces else 0
            self._pread(f, buf.view[: seg.nbytes], seg.lo, need=need)
            for k, lo, hi in seg.pieces:
                e = f.extents[k]
                at = e.start + lo - e.offset  # where the piece belongs in its storage
                src = buf.array[lo - seg.lo : hi - seg.lo]
                dest = dests[e.storage] if dests is not None else None
                if self.on_bytes is not None:
                    with self._bytes_lock, buf.view[lo - seg.lo : hi - seg.lo] as piece:
                        self.on_bytes(e, at, piece)
                if dest is not None and dest.is_cuda:
                    assert copier is not None
                    with stage("copy to device", hi - lo):
                        copier.copy_and_wait(dest[at : at + hi - lo], buf.tensor[lo - seg.lo :
                                                                                 hi - seg.lo])
                    if on_device:
                        continue
                    dest_host = None
                else:
                    dest_host = hosts[e.storage] if hosts else None
                crc = copy_and_checksum(
                    src, dest_host[at : at + hi - lo] if dest_host is not None else None,
                    self.checksums, "copy from staging")
                f.pieces.append((k, lo, hi - lo, crc))
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]

    def _check_extents(self, f: _OpenFile, dests: Dests | None, on_device: bool) -> None:
        """Hand every extent's CRC32C to ``on_checksum``, in file order."""
        if not self.checksums:
            return
        joined = join_piece_crcs(f.pieces)
        device = {}
        if on_device and dests is not None:
            cuda = [k for k, e in enumerate(f.extents)
                    if (t := dests[e.storage]) is not None and t.is_cuda]
            pieces = []
            for k in cuda:
                e = f.extents[k]
                pieces.append(dests[e.storage][e.start : e.start + e.length])  # type: ignore
            with stage("checksum (device)", sum(p.numel() for p in pieces)):
                device = dict(zip(cuda, device_crc32c_many(pieces), strict=True))
        for k, e in enumerate(f.extents):
            self._on_checksum(f.path, e, device[k] if k in device else joined.get(k, 0))


def _host_array(t: torch.Tensor | None) -> np.ndarray | None:
    return t.numpy() if t is not None and not t.is_cuda else None

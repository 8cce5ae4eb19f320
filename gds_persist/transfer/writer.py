"""Writing: the planned bytes of one or more data files, checksummed as they pass.

Every data file of a save is cut into requests (:mod:`.segments`) and all of them, across all
files, run on the I/O threads at once, each doing its whole share of the work:

* a **direct** request checksums a run of a host tensor's own bytes and writes it from there
  (no copy): the aligned interior of a large extent whose memory there meets the backend's
  ``host_alignment``; the checksum runs beside the write, on a checksum thread, where the
  cores leave one free per I/O thread;
* a **staged** request takes a staging buffer from the ring (bounded memory: the submitting thread
  waits for a free one), copies its extents' bytes in and zeroes the gaps, checksumming each piece
  right after copying it (while it is still in cache), then writes the buffer.

So copies, checksums and writes of different requests overlap on every core, instead of one
thread filling buffers while only the writes run in parallel; requests of host bytes run with
each I/O thread keeping to a data file of its own (:mod:`.file_queues`). CUDA sources are
checksummed on the device up front (one batch, ``kernels/crc32c.cu``; a host CRC of the staged
copy where the kernel cannot run), and their device-to-host copies are queued on a side stream
by the submitting thread, as many buffers ahead as the ring holds, each request waiting only for
its own buffer's copies.
The CRC32C of an extent cut into several requests is joined from its pieces
(:func:`~gds_persist.format.checksum.crc32c_combine`).

Device path (a backend with ``accepts_device``, a file whose sources are all on CUDA): each extent
goes straight from device memory to the file; no host staging.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from ..backends.base import Backend
from ..format import ALIGNMENT, Extent, align_up, crc32c
from ..settings import Settings
from ..stages import stage
from .crc import device_crc32c_many, device_crc32c_or_none
from .cuda_copy import StreamCopier, copier_for
from .file_queues import run_by_file
from .pipeline import (
    FilePipeline,
    PieceCrc,
    byte_view,
    copy_and_checksum,
    interleave,
    join_piece_crcs,
)
from .segments import Segment, cut, extent_spans, interior
from .staging import AlignedBuffer, io_session, usable_cores

DIRECT_MIN = 1 << 20  # a host extent this large is written from its own memory when aligned



class FileLayout(Protocol):
    """What the writer needs of a planned data file (``format.layout.FilePlan`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...  # a multiple of ALIGNMENT; the gaps between extents are zeros

    @property
    def extents(self) -> tuple[Extent, ...]: ...  # sorted by offset


@dataclass
class _OpenFile:
    path: str
    plan: FileLayout
    handle: Any
    device_crcs: dict[int, int] = field(default_factory=dict)  # extent index -> CRC (device)
    pieces: list[PieceCrc] = field(default_factory=list)  # host CRCs of pieces, any order
    whole: bool = True  # every block of the file (gaps zeroed); else only the extents' blocks


class FileWriter(FilePipeline):
    """Writes planned data files; returns the CRC32C of every extent. Calls the backend in the
    documented order (open, pwrite..., sync, close; close also after an error)."""

    def write(self, path: str, plan: FileLayout, sources: Sequence[torch.Tensor]) -> list[int]:
        """Write ``plan``'s extents of ``sources`` (flat uint8 tensors, by storage) to ``path``
        and fsync it."""
        return self.write_files([path], [plan], sources)[0]

    def write_files(self, paths: Sequence[str], plans: Sequence[FileLayout],
                    sources: Sequence[torch.Tensor], create: bool = True) -> list[list[int]]:
        """Write every file of ``plans`` (to ``paths``) concurrently and fsync them; return the
        extents' CRC32C, file by file. ``create=False``: the files exist (other ranks write
        other parts of them); only the planned extents' blocks are written."""
        files: list[_OpenFile] = []
        try:
            for path, plan in zip(paths, plans, strict=True):
                with stage("open + preallocate"):
                    files.append(_OpenFile(path, plan, self.backend.open(
                        path, write=True, size=plan.size, create=create), whole=create))
            device = [f for f in files if self._from_device(f, sources)]
            for f in device:
                self._write_from_device(f, sources)
            staged = [f for f in files if f not in device]
            if staged:
                self._write_staged(staged, sources)
            self._sync(files)
            return [_extent_crcs(f) for f in files]
        finally:
            for f in files:
                self.backend.close(f.handle)

    def _from_device(self, f: _OpenFile, sources: Sequence[torch.Tensor]) -> bool:
        return self.backend.accepts_device and all(
            sources[e.storage].is_cuda for e in f.plan.extents)

    def _write_from_device(self, f: _OpenFile, sources: Sequence[torch.Tensor]) -> None:
        extents = f.plan.extents
        pieces = [sources[e.storage][e.start : e.start + e.length] for e in extents]
        with stage("checksum (device)", sum(e.length for e in extents)):
            f.device_crcs = dict(enumerate(device_crc32c_many(pieces)))  # one stream sync
        for e, piece in zip(extents, pieces, strict=True):
            with stage("write (from device)", e.length):
                self.backend.pwrite(f.handle, piece, e.offset)
            if self.progress is not None:
                self.progress(e.length)

    def _write_staged(self, files: list[_OpenFile], sources: Sequence[torch.Tensor]) -> None:
        assert self.ring is not None
        hosts = [s.numpy() if not s.is_cuda else None for s in sources]
        copier = copier_for([sources[e.storage] for f in files for e in f.plan.extents])
        if copier is not None:
            for f in files:
                _checksum_on_device(f, sources)
        per_file = [[(f, seg) for seg in self._segments(f, hosts)] for f in files]
        what = f"writing {files[0].path}"
        if copier is None:  # host bytes: every thread keeps to a file of its own
            with _checksum_threads(self.threads) as checksums:
                run_by_file(self.pool, self.threads, per_file,
                            lambda r: self._write_host(r[0], r[1], hosts, sources, checksums),
                            self.timeout_s, what)
            return
        # CUDA bytes: the submitting thread queues each buffer's copies as far ahead as the
        # ring holds, so requests are submitted in order (interleaved over the files)
        self.run_requests(interleave(per_file),
                          lambda r: self._submit(r[0], r[1], sources, hosts, copier), what)

    def _write_host(self, f: _OpenFile, seg: Segment, hosts: Sequence[np.ndarray | None],
                    sources: Sequence[torch.Tensor], checksums: ThreadPoolExecutor | None) -> None:
        """One request of host bytes, on the calling I/O thread (a direct request's checksum on
        a thread of ``checksums`` meanwhile)."""
        if seg.direct:
            self._write_direct(f, seg, hosts, sources, checksums)
            return
        with stage("wait for a staging buffer"):
            buf = self.ring.acquire()  # type: ignore[union-attr]
        self._write_buffer(buf, f, seg, hosts, [])

    def _segments(self, f: _OpenFile, hosts: Sequence[np.ndarray | None]) -> list[Segment]:
        align = self.backend.host_alignment
        # CUDA extents checksummed on the device go straight from device memory where the
        # backend takes it (kvikio), also in a file that holds host bytes too (a torch.save
        # file's glue): their whole blocks directly, the last partial block staged
        on_device = ({f.plan.extents[k] for k in f.device_crcs} if self.backend.accepts_device
                     else set())

        def direct_bytes(e: Extent) -> int:
            if e.length < DIRECT_MIN:
                return 0
            src = hosts[e.storage]
            head, n = interior(e)
            if src is None:
                return n if e in on_device and not head else 0
            if align is None:
                return 0
            return n if (src.ctypes.data + e.start + head) % align == 0 else 0

        spans = [(0, f.plan.size)] if f.whole else extent_spans(f.plan.extents)
        return cut(f.plan.extents, spans, self.ring.block_bytes, direct_bytes)  # type: ignore

    def _submit(self, f: _OpenFile, seg: Segment, sources: Sequence[torch.Tensor],
                hosts: Sequence[np.ndarray | None], copier: StreamCopier | None) -> Future[None]:
        if seg.direct:
            return self.pool.submit(self._write_direct, f, seg, hosts, sources)

        def queue_d2h(buf: AlignedBuffer) -> list[Any]:
            """The buffer's device-to-host copies, queued now: as many buffers ahead of the
            writes as the ring holds."""
            if copier is None:
                return []
            with stage("queue D2H", seg.nbytes):
                for k, lo, hi in seg.pieces:
                    e = f.plan.extents[k]
                    if sources[e.storage].is_cuda:
                        at = e.start + lo - e.offset
                        copier.copy(buf.tensor[lo - seg.lo : hi - seg.lo],
                                    sources[e.storage][at : at + hi - lo])
                return copier.record()

        return self.submit_staged(self._write_buffer, f, seg, hosts, prepare=queue_d2h)

    def _write_direct(self, f: _OpenFile, seg: Segment, hosts: Sequence[np.ndarray | None],
                      sources: Sequence[torch.Tensor],
                      checksums: ThreadPoolExecutor | None = None) -> None:
        (k, lo, hi), = seg.pieces
        e = f.plan.extents[k]
        src = hosts[e.storage]
        at = e.start + lo - e.offset
        if src is None:  # CUDA memory to the backend; its CRC32C came from the device
            with stage("write (from device)", hi - lo):
                self.backend.pwrite(f.handle, sources[e.storage][at : at + hi - lo], lo)
            if self.progress is not None:
                self.progress(hi - lo)
            return
        data = src[at : at + hi - lo]
        # the checksum beside the write where a core is free for it: a tmpfs write, CPU-bound,
        # then takes max(copy, CRC) instead of their sum (1 I/O thread on 2 cores, paired with
        # the aligned writer: 0.93 of it against 0.83 with the CRC first, bench/results/
        # 2026-12-04-cpu-issue44-c/overlap-tmpfs-1thread.txt)
        crc = (checksums.submit(_checksum, data) if checksums is not None
               else _done(_checksum(data)))
        with stage("write (from the tensor)", hi - lo):
            self.backend.pwrite(f.handle, data.data, lo)
        f.pieces.append((k, lo, hi - lo, crc.result()))  # list.append: atomic under the GIL
        if self.progress is not None:
            self.progress(hi - lo)

    def _write_buffer(self, buf: AlignedBuffer, f: _OpenFile, seg: Segment,
                      hosts: Sequence[np.ndarray | None], events: list[Any]) -> None:
        try:
            if events:
                with stage("wait D2H", seg.nbytes):
                    StreamCopier.wait_events(events)
            out = buf.array
            cursor = seg.lo
            for k, lo, hi in seg.pieces:
                out[cursor - seg.lo : lo - seg.lo] = 0
                e = f.plan.extents[k]
                src = hosts[e.storage]
                if src is not None or k not in f.device_crcs:
                    at = e.start + lo - e.offset
                    piece = out[lo - seg.lo : hi - seg.lo]
                    if src is None:  # a CUDA piece already copied in: checksum only
                        crc = copy_and_checksum(piece, None)
                    else:
                        crc = copy_and_checksum(src[at : at + hi - lo], piece, True,
                                                "copy to staging")
                    f.pieces.append((k, lo, hi - lo, crc))
                cursor = hi
            out[cursor - seg.lo : seg.nbytes] = 0
            with stage("write", seg.nbytes):
                self.backend.pwrite(f.handle, buf.view[: seg.nbytes], seg.lo)
            if self.progress is not None:
                self.progress(seg.nbytes)
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]

    def _sync(self, files: list[_OpenFile]) -> None:
        """fsync every file, concurrently: the data is durable before the manifest is written."""
        with stage("fsync"):
            self.sync_all([f.handle for f in files], f"fsync of {files[0].path}")


@contextmanager
def _checksum_threads(io_threads: int) -> Iterator[ThreadPoolExecutor | None]:
    """Threads that checksum direct requests beside their writes, where the cores leave one
    free per I/O thread; else None (each I/O thread checksums first, then writes: with the
    cores busy, the extra threads only competed, 0.67 of the limit against 0.71 on 4 I/O
    threads over 2 cores, tmpfs)."""
    if usable_cores() < 2 * io_threads:
        yield None
        return
    with ThreadPoolExecutor(io_threads, thread_name_prefix="gds_persist-crc") as pool:
        yield pool


def _checksum(data: np.ndarray) -> int:
    with stage("checksum", data.nbytes):
        return crc32c(data)


def _done(value: int) -> Future[int]:
    done: Future[int] = Future()
    done.set_result(value)
    return done


def _checksum_on_device(f: _OpenFile, sources: Sequence[torch.Tensor]) -> None:
    cuda = [k for k, e in enumerate(f.plan.extents) if sources[e.storage].is_cuda]
    pieces = []
    for k in cuda:
        e = f.plan.extents[k]
        pieces.append(sources[e.storage][e.start : e.start + e.length])
    with stage("checksum (device)", sum(p.numel() for p in pieces)):
        crcs = device_crc32c_or_none(pieces) if pieces else []
    if crcs is not None:  # else the staged copies are checksummed on the host
        f.device_crcs = dict(zip(cuda, crcs, strict=True))


def _extent_crcs(f: _OpenFile) -> list[int]:
    """Each extent's CRC32C: from the device, or joined from its pieces in file order."""
    joined = join_piece_crcs(f.pieces)
    return [f.device_crcs[k] if k in f.device_crcs else joined.get(k, 0)
            for k in range(len(f.plan.extents))]


def write_plan(
    backend: Backend,
    directory: str,
    files: Sequence[FileLayout],
    storages: Sequence[torch.UntypedStorage],
    cfg: Settings,
    progress: Callable[[int], None] | None = None,
    create: bool = True,
) -> list[Extent]:
    """Write every planned file into ``directory`` from ``storages`` (indexed by the extents'
    ``storage``); return the sealed extents (with their CRC32C), file by file.
    ``create=False``: see :meth:`FileWriter.write_files`."""
    sources = [byte_view(s) for s in storages]
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        writer = FileWriter(backend, ring, pool, cfg.io_timeout_s, progress)
        crcs = writer.write_files([os.path.join(directory, f.name) for f in files], files,
                                  sources, create)
    sealed: list[Extent] = []
    for f, file_crcs in zip(files, crcs, strict=True):
        sealed += [replace(e, crc32c=c) for e, c in zip(f.extents, file_crcs, strict=True)]
    return sealed


def write_at(backend: Backend, path: str, offset: int, data: bytes) -> None:
    """Write ``data`` into the existing file ``path`` at the aligned ``offset`` as its last
    bytes (the file ends right after them), and fsync it: the tail of a file whose contents
    depend on what was written before (a torch.save archive's checksums and directory)."""
    end = offset + len(data)
    with AlignedBuffer(max(align_up(len(data)), ALIGNMENT), pin=False) as buf:
        buf.array[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        buf.array[len(data):] = 0
        handle = backend.open(path, write=True, create=False)
        try:
            with stage("write (tail)", len(data)):
                backend.pwrite(handle, buf.view[: align_up(len(data))], offset)
            backend.set_size(handle, end)
            with stage("fsync"):
                backend.sync(handle)
        finally:
            backend.close(handle)

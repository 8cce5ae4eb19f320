"""Writing units (format version 4): extents whose place in a file is known only once written.

A version-4 save cuts every storage into *units* (canonical byte ranges, one extent each;
:mod:`gds_persist.saving.units`) and hands each data file a list of them. Every unit is one job on
the I/O threads, doing its whole share of the work in one pass over the bytes while they are in
cache:

1. **hash** (incremental saves): BLAKE3-128 of its bytes (CUDA units were hashed on the device
   up front, in one batch: ``kernels/blake3.cu``); then ``decide(unit, hash)`` says whether
   identical bytes already live in a base checkpoint - if so nothing is written and nothing is
   copied off the GPU. A hash-ahead thread hashes host units from the back of the queue
   meanwhile (the likely-unchanged ones, queued last), so that work overlaps the writes of the
   changed units at the front instead of following them;
2. **checksum**: CRC32C of the (decoded) bytes;
3. **compress** (``compress=True``): one blosc2 chunk (:mod:`gds_persist.format.codec`), kept
   only when it saves at least one 4096-byte block, else the bytes are stored raw;
4. **place and write**: the unit takes the next 4096-aligned offset of its file (under a lock, as
   results arrive, so variable-length encoded units pack without a precomputed layout) and is
   written: raw host bytes straight from the tensor's memory where its address is aligned (the
   last partial block through a staging buffer), everything else from a staging buffer, zero
   padded to the block.

CUDA units are copied into a staging buffer by their own job (side stream, waited for by that
job only), so copies, checksums, compression and writes of different units overlap. Every job
takes at most one staging buffer, inside the job, and frees it before it ends: no job waits for a
buffer that a queued job holds. With a backend that accepts device memory and no compression,
CUDA units go from device memory to the file directly (CRC32C on the device).

Files are created with room for all their units (so a full disk fails first) and trimmed to what
was written before the fsync. File sizes and extents come back to the caller, who writes them
into the manifest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format import ALIGNMENT, CODEC_BLOSC2, Extent, align_up, codec, crc32c
from ..format.hashing import content_hash
from ..stages import stage
from .crc import device_crc32c_many
from .cuda_copy import copier_for
from .file_queues import run_by_file
from .hashing import hash_pieces
from .pipeline import FilePipeline, interleave
from .staging import AlignedBuffer
from .writer import DIRECT_MIN

Decide = Callable[[int, str], bool]  # (unit index, its BLAKE3-128) -> True: refer, write nothing
BATCH_BELOW = 1 << 20  # units smaller than this share a staging buffer and one write
HASH_AHEAD_THREADS = 1  # 1 and 2 measured the same on 2 cores: the I/O threads hash too


@dataclass(frozen=True)
class Unit:
    """Bytes ``[start, start + length)`` of ``sources[storage]``, stored as one extent."""

    storage: int
    start: int
    length: int
    typesize: int = 1  # the element size of the storage's dtype (the codec's type size)


@dataclass
class _File:
    index: int
    path: str
    units: list[int]
    handle: Any = None
    size_hint: int = 0
    next_offset: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def allocate(self, nbytes: int) -> int:
        with self.lock:
            offset = self.next_offset
            self.next_offset += align_up(nbytes, ALIGNMENT)
            return offset


@dataclass
class UnitResults:
    """What :meth:`UnitWriter.write_files` did: per file its final size; per unit written, its
    sealed extent (``file``: the file's index in the call); per unit hashed, its BLAKE3-128;
    the units ``decide`` referred elsewhere."""

    sizes: list[int]
    extents: dict[int, Extent]
    hashes: dict[int, str]
    referred: set[int]


@dataclass
class UnitWriter(FilePipeline):
    """Writes units into data files (backend calls per file: open, pwrite..., set_size, sync,
    close; close also after an error)."""

    compress: bool = field(default=False, kw_only=True)
    hashes: bool = field(default=False, kw_only=True)  # compute every unit's BLAKE3-128
    decide: Decide | None = field(default=None, kw_only=True)
    codec_threads: int = field(default=1, kw_only=True)  # blosc2's threads per unit

    def write_files(self, paths: Sequence[str], files: Sequence[Sequence[int]],
                    units: Sequence[Unit], sources: Sequence[torch.Tensor],
                    known: dict[int, str] | None = None) -> UnitResults:
        """Write ``units[k]`` for every ``k`` of ``files[i]`` into ``paths[i]`` (``sources``:
        flat uint8 tensors by storage); ``known``: hashes already computed."""
        assert self.ring is not None and self.ring.block_bytes >= align_up(
            max((u.length for u in units), default=0))
        self._units = units
        self._sources = sources
        self._hosts = [s.numpy() if not s.is_cuda else None for s in sources]
        self._results = UnitResults([], {}, dict(known or {}), set())
        self._copier = copier_for(list(sources))
        opened: list[_File] = []
        try:
            for i, (path, members) in enumerate(zip(paths, files, strict=True)):
                f = _File(i, path, list(members))
                f.size_hint = sum(align_up(units[k].length) for k in members)
                with stage("open + preallocate"):
                    f.handle = self.backend.open(path, write=True, size=f.size_hint)
                opened.append(f)
            self._hash_cuda_units(opened)
            for f in opened:  # units referred elsewhere after the device hash: nothing to do
                f.units = [k for k in f.units if k not in self._results.referred]
            self._run(opened)
            self._finish(opened)
            self._results.sizes = [f.next_offset for f in opened]
            return self._results
        finally:
            for f in opened:
                self.backend.close(f.handle)

    # ------------------------------------------------------------------ hashing, deciding

    def _hash_cuda_units(self, files: list[_File]) -> None:
        if not self.hashes:
            return
        todo = [k for f in files for k in f.units
                if self._sources[self._units[k].storage].is_cuda and k not in self._results.hashes]
        pieces = [self._piece(k) for k in todo]
        for k, h in zip(todo, hash_pieces(pieces), strict=True):
            self._results.hashes[k] = h
        for f in files:
            for k in f.units:
                h = self._results.hashes.get(k, "")
                if (h and self._sources[self._units[k].storage].is_cuda
                        and self.decide is not None and self.decide(k, h)):
                    self._results.referred.add(k)

    def _piece(self, k: int) -> torch.Tensor:
        u = self._units[k]
        return self._sources[u.storage][u.start : u.start + u.length]

    # ------------------------------------------------------------------ the jobs

    def _run(self, files: list[_File]) -> None:
        """Every file's units, each file's in its given order, every I/O thread keeping to a file
        of its own (:mod:`.file_queues`); small units are batched (:meth:`_batches`)."""
        device_write = self._device_write_ok(files)
        per_file = [[(f, ks) for ks in ([[k] for k in f.units] if device_write
                                        else self._batches(f))] for f in files]
        if device_write:
            firsts = [ks[0] for queue in per_file for _, ks in queue]
            self._device_crcs = dict(zip(firsts, device_crc32c_many(
                [self._piece(k) for k in firsts]) if firsts else [], strict=True))
        ahead = self._start_hashing_ahead(
            [k for _, ks in interleave(per_file) for k in ks])
        try:
            run_by_file(self.pool, self.threads, per_file,
                        lambda job: self._run_job(*job, device_write), self.timeout_s,
                        f"writing {files[0].path if files else ''}")
        finally:
            ahead.stop()

    def _run_job(self, f: _File, ks: list[int], device_write: bool) -> None:
        """The job that writes units ``ks``: straight from the device, one unit, or a batch."""
        if device_write:
            self._from_device(f, ks[0])
        elif len(ks) == 1 and self._units[ks[0]].length >= BATCH_BELOW:
            self._job(f, ks[0])
        else:
            self._batch(f, ks)

    def _start_hashing_ahead(self, queue: list[int]) -> _HashAhead:
        """Hash the host units at the back of the job queue while the I/O threads work on its
        front: an incremental save puts the units that change first, and their writes leave the
        CPU idle; hashing the rest (mostly referred, never written) meanwhile takes it off the
        end of the save."""
        todo = [k for k in queue if self._hosts[self._units[k].storage] is not None
                and k not in self._results.hashes] if self.hashes else []
        return _HashAhead(todo, HASH_AHEAD_THREADS, self._hash_if_new)

    def _hash_if_new(self, k: int) -> bool:
        """Hash host unit ``k`` unless that is done; False if it was."""
        if k in self._results.hashes:
            return False
        u = self._units[k]
        host = self._hosts[u.storage]
        assert host is not None
        with stage("hash (ahead)", u.length):
            h = content_hash(host[u.start : u.start + u.length])
        self._results.hashes.setdefault(k, h)  # atomic under the GIL; an I/O thread may race
        return True

    def _batches(self, f: _File) -> list[list[int]]:
        """``f``'s units in order, runs of small ones (under ``BATCH_BELOW``) grouped into
        batches that fill at most one staging buffer: one job and one write each, instead of a
        4 KiB O_DIRECT write per step counter or bias (measured: ~280 such writes made a
        383 MB compressed save spend 3.5x its bytes' time in pwrite)."""
        out: list[list[int]] = []
        room = 0
        for k in f.units:
            n = align_up(self._units[k].length)
            if self._units[k].length >= BATCH_BELOW:
                out.append([k])
                room = 0
            elif out and room >= n and out[-1] and self._units[out[-1][0]].length < BATCH_BELOW:
                out[-1].append(k)
                room -= n
            else:
                out.append([k])
                room = self.ring.block_bytes - n  # type: ignore[union-attr]
        return out

    def _batch(self, f: _File, ks: list[int]) -> None:
        """Small units ``ks`` packed into one staging buffer, each at its own aligned place, and
        written with one call (each still its own extent)."""
        buf = self.ring.acquire()  # type: ignore[union-attr]
        try:
            placed: list[tuple[int, int, int, tuple[int, int] | None]] = []
            cursor = 0
            for k in ks:
                u = self._units[k]
                slot = buf.array[cursor : cursor + u.length]
                if self._sources[u.storage].is_cuda:
                    assert self._copier is not None
                    with stage("copy to staging (D2H)", u.length):
                        self._copier.copy_and_wait(buf.tensor[cursor : cursor + u.length],
                                                   self._piece(k))
                    data = slot
                else:
                    host = self._hosts[u.storage]
                    assert host is not None
                    data = host[u.start : u.start + u.length]
                    if self._referred(k, data):
                        continue
                crc, encoded = self._encode(k, data)
                out = data if encoded is None else np.frombuffer(encoded, dtype=np.uint8)
                if out.ctypes.data != slot.ctypes.data:
                    with stage("copy to staging", out.nbytes):
                        np.copyto(buf.array[cursor : cursor + out.nbytes], out)
                end = align_up(cursor + out.nbytes, ALIGNMENT)
                buf.array[cursor + out.nbytes : end] = 0
                stored = None
                if encoded is not None:
                    with stage("checksum (stored)", len(encoded)):
                        stored = (len(encoded), crc32c(out))
                placed.append((k, cursor, crc, stored))
                cursor = end
            if not cursor:
                return
            offset = f.allocate(cursor)
            with stage("write", cursor):
                self.backend.pwrite(f.handle, buf.view[:cursor], offset)
            for k, at, crc, stored in placed:
                self._seal(f, k, offset + at, crc, stored)
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]

    def _referred(self, k: int, data: np.ndarray) -> bool:
        """Host unit ``k``: hash it if needed, and whether ``decide`` refers it elsewhere."""
        if self.hashes and k not in self._results.hashes:
            with stage("hash", data.nbytes):
                self._results.hashes[k] = content_hash(data)  # dict writes: atomic under the GIL
        if self.decide is not None and self.decide(k, self._results.hashes.get(k, "")):
            self._results.referred.add(k)
            return True
        return False

    def _encode(self, k: int, data: np.ndarray) -> tuple[int, bytes | None]:
        """CRC32C of unit ``k``'s bytes and, when compressing and worth it, its encoded form."""
        u = self._units[k]
        with stage("checksum", u.length):
            crc = crc32c(data)
        if self.compress and u.length >= codec.COMPRESS_MIN:
            with stage("compress", u.length):
                candidate = codec.encode(data, u.typesize, self.codec_threads)
            if codec.worth_storing(u.length, len(candidate)):
                return crc, candidate
        return crc, None

    def _device_write_ok(self, files: list[_File]) -> bool:
        return (self.backend.accepts_device and not self.compress and all(
            self._sources[self._units[k].storage].is_cuda for f in files for k in f.units))

    def _from_device(self, f: _File, k: int) -> None:
        u = self._units[k]
        offset = f.allocate(u.length)
        with stage("write (from device)", u.length):
            self.backend.pwrite(f.handle, self._piece(k), offset)
        self._seal(f, k, offset, self._device_crcs[k], None)

    def _job(self, f: _File, k: int) -> None:
        u = self._units[k]
        if self._sources[u.storage].is_cuda:
            buf = self.ring.acquire()  # type: ignore[union-attr]
            try:
                assert self._copier is not None
                with stage("copy to staging (D2H)", u.length):
                    self._copier.copy_and_wait(buf.tensor[: u.length], self._piece(k))
                self._store(f, k, buf.array[: u.length], buf)
            finally:
                self.ring.release(buf)  # type: ignore[union-attr]
            return
        host = self._hosts[u.storage]
        assert host is not None
        data = host[u.start : u.start + u.length]
        if self._referred(k, data):
            return
        self._store(f, k, data, None)

    def _store(self, f: _File, k: int, data: np.ndarray, buf: AlignedBuffer | None) -> None:
        """Checksum, maybe compress, place and write one unit's bytes ``data`` (which live in
        ``buf`` when given, else in the tensor's own memory)."""
        u = self._units[k]
        crc, encoded = self._encode(k, data)
        if encoded is not None:
            with stage("checksum (stored)", len(encoded)):
                stored_crc = crc32c(encoded)
            offset = f.allocate(len(encoded))
            self._write_staged(f, np.frombuffer(encoded, dtype=np.uint8), offset, buf)
            self._seal(f, k, offset, crc, (len(encoded), stored_crc))
            return
        offset = f.allocate(u.length)
        align = self.backend.host_alignment
        direct = 0
        if (buf is None and align is not None and u.length >= DIRECT_MIN
                and data.ctypes.data % align == 0):
            direct = u.length - u.length % ALIGNMENT
        if direct:
            with stage("write (from the tensor)", direct):
                self.backend.pwrite(f.handle, data[:direct].data, offset)
        if direct < u.length:
            self._write_staged(f, data[direct:], offset + direct, buf)
        self._seal(f, k, offset, crc, None)

    def _write_staged(self, f: _File, data: np.ndarray, offset: int,
                      buf: AlignedBuffer | None) -> None:
        """Write ``data`` at ``offset`` through a staging buffer (``buf`` if given: ``data`` may
        already be in it), zero-padded to the next block."""
        own = buf is None
        if own:
            with stage("wait for a staging buffer"):
                buf = self.ring.acquire()  # type: ignore[union-attr]
        assert buf is not None
        try:
            n = data.nbytes
            out = buf.array
            if not (data.ctypes.data == out.ctypes.data):
                with stage("copy to staging", n):
                    np.copyto(out[:n], data)
            padded = align_up(n, ALIGNMENT)
            out[n:padded] = 0
            with stage("write", padded):
                self.backend.pwrite(f.handle, buf.view[:padded], offset)
        finally:
            if own:
                self.ring.release(buf)  # type: ignore[union-attr]

    def _seal(self, f: _File, k: int, offset: int, crc: int,
              stored: tuple[int, int] | None) -> None:
        u = self._units[k]
        h = self._results.hashes.get(k, "")
        if stored is None:
            e = Extent(u.storage, u.start, u.length, f.index, offset, crc, blake3=h)
        else:
            e = Extent(u.storage, u.start, u.length, f.index, offset, crc, CODEC_BLOSC2,
                       stored[0], stored[1], h)
        self._results.extents[k] = e
        if self.progress is not None:
            self.progress(align_up(e.stored_length))

    # ------------------------------------------------------------------ end of the files

    def _finish(self, files: list[_File]) -> None:
        """Trim every file to what was written, then fsync them all concurrently."""
        for f in files:
            if f.next_offset != f.size_hint:
                self.backend.set_size(f.handle, f.next_offset)
        with stage("fsync"):
            self.sync_all([f.handle for f in files],
                          f"fsync of {files[0].path if files else 'no file'}")


class _HashAhead:
    """Threads calling ``hash_unit`` on ``todo`` from its end backwards until it returns False
    (the unit was already hashed: they met the I/O threads coming from the front) or they are
    stopped. A failure here is ignored: the I/O thread that reaches the unit hashes it again and
    reports it."""

    def __init__(self, todo: list[int], threads: int, hash_unit: Callable[[int], bool]):
        self._hash_unit = hash_unit
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(todo[::-1][j::threads],),
                                          name="gds_persist-hash-ahead", daemon=True)
                         for j in range(threads if todo else 0)]
        for t in self._threads:
            t.start()

    def _run(self, ks: list[int]) -> None:
        try:
            for k in ks:
                if self._stopped.is_set() or not self._hash_unit(k):
                    return
        except Exception:  # noqa: BLE001, S110 - the I/O thread hashes it again and reports
            pass

    def stop(self) -> None:
        """Stop and wait: no thread reads the sources once the save returns."""
        self._stopped.set()
        for t in self._threads:
            t.join()


def codec_threads() -> int:
    """blosc2 threads per compressed unit: one (blosc2 releases the GIL, see
    :mod:`gds_persist.format.codec`, so the I/O threads are the parallelism)."""
    return 1

"""``save(state, "x.pt", format="torch")``: one file that stock ``torch.load`` reads, written by
the engine.

The state is pickled as ``torch.save`` pickles it (:mod:`gds_persist.format.torch_pickle`) and
laid out as its zip archive with every storage at a 4096-aligned offset
(:mod:`gds_persist.format.torch_archive`); the storages and the small zip pieces between them
(*glue*) are then one data file's extents, written like any checkpoint's - O_DIRECT from the
bounded staging ring (or straight from tensor memory), CUDA storages through pinned buffers or,
with kvikio, from device memory - each extent's CRC32C computed on the way. The tail (the
checksums record with those CRC32C, the zip directory) is written last, and the file is
committed atomically: written inside the save's temporary directory, fsynced, renamed over the
path, the directory fsynced (:func:`gds_persist.transfer.commit.seal_file`).

What the state may hold: what ``torch.load(weights_only=True)`` reads back (tensors, containers,
``OrderedDict`` metadata, Python scalars and strings, and classes allowed with
``torch.serialization.add_safe_globals``), checked on the pickle before a byte is written;
``allow_pickle=True`` allows any picklable object (such a file loads with
``weights_only=False``, trusted files only).
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ReplicationError
from ..format import Extent, StorageRecord, align_up, joined_crcs
from ..format.layout import FilePlan
from ..format.records import Wire
from ..format.torch_archive import ArchiveLayout, archive_folder, plan_archive
from ..format.torch_pickle import StorageEntry, pickle_state, replica_digest, unpickle
from ..progress import ByteCounter
from ..results import DistributedSaveInfo, SaveInfo
from ..stages import stage
from ..state.flatten import Flattened
from ..transfer.commit import Temporary, begin_file, file_in, seal_file, writer_record
from ..transfer.writer import write_at, write_plan
from .as_saved import refuse_changed
from .options import SaveRequest
from .sequence import Layout, Run
from .units import backend_for, with_fallback


@dataclass
class PickledState:
    """A state pickled for a torch.save file: ``data.pkl`` and its storages, in key order.
    The storages' bytes may be taken from a snapshot (:meth:`flattened`, :meth:`over`) while the
    pickle keeps the live tensors' devices."""

    data: bytes
    entries: list[StorageEntry]
    crc_at_save: list[int | None] | None = None  # as Flattened.crc_at_save, one per entry

    @classmethod
    def of(cls, state: Any, allow_pickle: bool) -> PickledState:
        """``state`` pickled (itself if it is one), refused unless torch.load(weights_only=True)
        reads it back or ``allow_pickle``."""
        if isinstance(state, PickledState):
            return state
        with stage("pickle"):
            data, entries = pickle_state(state)
            check_loadable(data, allow_pickle)
        return cls(data, entries)

    def flattened(self) -> Flattened:
        """The storages as a :class:`Flattened` (its tree: this object), for the snapshot
        machinery of the background writers, which copies ``storage_objects``."""
        return Flattened(self, [], [StorageRecord(e.storage.nbytes(), e.location)
                                    for e in self.entries], [e.storage for e in self.entries],
                         self.crc_at_save)

    @staticmethod
    def over(flat: Flattened) -> PickledState:
        """The pickled state of :meth:`flattened` ``flat``, its bytes from ``flat``'s storages
        (a snapshot's host copies)."""
        pickled = flat.tree
        assert isinstance(pickled, PickledState)
        return PickledState(pickled.data, [replace(e, storage=s) for e, s in
                                           zip(pickled.entries, flat.storage_objects, strict=True)],
                            flat.crc_at_save)


@dataclass(frozen=True)
class Facts(Wire):
    digest: str  # of this rank's pickle (:func:`replica_digest`; '' on one process)


@dataclass(frozen=True)
class Report(Wire):
    """A rank's range of the file, written: its pieces of each storage (with their CRC32C)."""

    pieces: list[Extent]
    bytes: int
    backend: str
    reason: str
    seconds: float


class TorchFileLayout(Layout[Facts, Report]):
    """One torch.save file of ``state``, written by one process or by the ranks of a group, each
    a contiguous aligned byte range of it (FastPersist's write parallelism, one file).

    Every rank holds the same replicated state and pickles it alike: the pickles must be
    identical but for the GPU ordinals of their locations, and every rank lays out rank 0's pickle
    over its own storages. Rank 0 begins (a temporary directory), creates the file at its full
    size and leaves a token beside it; the ranks that see the token share the file's filesystem
    and write (others, on another node without it, have nothing to write). Rank 0 seals: it joins
    the pieces' CRC32C per storage, checks them against the state at ``save``, writes the tail
    (the checksums record, the zip directory) and renames the file into place.
    """

    facts_type, report_type = Facts, Report

    def __init__(self, state: Any, path: str, request: SaveRequest):
        if isinstance(state, Flattened):  # a snapshot of a pickled state (a background writer)
            if not isinstance(state.tree, PickledState):
                raise TypeError("format='torch' pickles the state itself: pass the state dict, "
                                "not a flattened one")
            state = PickledState.over(state)
        self.state, self.path, self.request = state, path, request
        self.writers: list[int] = [0]

    def prepare(self, run: Run) -> Facts:
        self.pickled = PickledState.of(self.state, self.request.allow_pickle)
        return Facts(replica_digest(self.pickled.data) if run.comm.size > 1 else "")

    def begin(self, run: Run) -> Temporary:
        return begin_file(self.path, run.cfg.io_timeout_s)

    def plan(self, run: Run, facts: list[Facts]) -> None:
        _check_identical([f.digest for f in facts], run.what, run.intact)
        own = self.pickled
        data = (own.data if run.comm.size == 1 else
                run.comm.broadcast_bytes(own.data if run.comm.rank == 0 else None, 0,
                                         "pickle of " + self.path))
        self.layout, self.file, self.sources = archive_plan(self.path,
                                                            PickledState(data, own.entries))
        run.needs = f"this file needs about {self.file.size} bytes; "
        self.size = self.layout.tail_offset  # until rank 0 knows the tail
        self.directory = run.first.tmp
        if run.comm.size > 1:  # rank 0 makes the file at its full size and a token beside it
            run.agree("start", lambda: self._start(run) if run.tmp is not None else None)
            sees = run.agree("find", lambda: _sees(self.directory, run.first.save_id))
            self.writers = [r for r, seen in enumerate(sees) if seen]

    def _start(self, run: Run) -> None:
        be, _ = backend_for(run.cfg, self.directory, [e.storage for e in self.pickled.entries])
        be.close(be.open(os.path.join(self.directory, self.file.name), write=True,
                         size=self.file.size))
        with open(os.path.join(self.directory, TOKEN), "w") as f:
            f.write(run.first.save_id)

    def write(self, run: Run) -> Report:
        t0 = time.perf_counter()
        if run.comm.rank not in self.writers:
            return Report([], 0, "none", "this rank does not see the file's filesystem: nothing "
                          "to write", 0.0)
        k = self.writers.index(run.comm.rank)
        lo, hi = (_cut(self.file.size, len(self.writers), j) for j in (k, k + 1))
        mine = replace(self.file, extents=tuple(_clip(e, lo, hi) for e in self.file.extents
                                                if e.offset < hi and e.offset + e.length > lo))
        be, reason = backend_for(run.cfg, self.directory,
                                 [e.storage for e in self.pickled.entries])
        self.backend = be  # rank 0 writes the tail with it
        counter = ByteCounter(self.request.progress, hi - lo)
        # alone, the writer creates the file and writes all of it, gaps included, in large
        # requests; with others, only its extents' blocks of the file rank 0 made
        sealed = write_plan(be, self.directory, [mine], self.sources, run.cfg, counter.hook,
                            create=run.comm.size == 1)
        counter.finish()
        storages = len(self.pickled.entries)
        return Report([e for e in sealed if e.storage < storages], hi - lo, be.name,
                      with_fallback(be, reason), time.perf_counter() - t0)

    def seal(self, run: Run, reports: list[Report]) -> bytes:
        entries = self.pickled.entries
        joined = joined_crcs([(e.storage, e.start, e.length, e.crc32c)
                              for r in reports for e in r.pieces],
                             [e.storage.nbytes() for e in entries])
        crcs = [0 if c is None else c for c in joined]  # None only where a storage is empty
        refuse_changed(self.pickled.crc_at_save, crcs, lambda k: f"data/{entries[k].key}",
                       self.path)
        return self.layout.tail(crcs, writer_record(reports[0].backend, reports[0].reason,
                                                    world_size=run.comm.size))

    def commit(self, run: Run, sealed: Any) -> None:
        assert isinstance(run.tmp, Temporary)
        write_at(self.backend, file_in(run.tmp), self.layout.tail_offset, sealed)
        self.size = self.layout.tail_offset + len(sealed)
        seal_file(run.tmp, run.cfg.io_timeout_s)
        run.tmp = None  # committed and renamed: nothing to finish or abort

    def info(self, run: Run) -> SaveInfo:
        mine, name = run.reports[run.comm.rank], os.path.basename(self.path)
        payload = sum(e.storage.nbytes() for e in self.pickled.entries)
        common = dict(path=self.path, backend=mine.backend, reason=mine.reason,
                      bytes_written=self.size, payload_bytes=payload,
                      seconds=time.perf_counter() - run.t0, tensors=0,
                      storages=len(self.pickled.entries), files=[name])
        if not self.request.data_parallel:
            return SaveInfo(**common)
        return DistributedSaveInfo(**common, rank=run.comm.rank, world_size=run.comm.size,
                                   writers=self.writers, rank_bytes=mine.bytes,
                                   rank_files=[name] if mine.bytes else [],
                                   rank_write_seconds=mine.seconds)


TOKEN = ".writers"  # in the temporary directory: who sees it shares the file's filesystem


def _check_identical(digests: list[str], what: str, intact: str) -> None:
    bad = {r: "its state pickles differently from rank 0's" for r, d in enumerate(digests)
           if d != digests[0]}
    if bad:
        raise ReplicationError(
            f"{what}: format='torch' with a process group writes one file of the replicated "
            f"state, but ranks {sorted(bad)} hold a different state (keys, shapes, dtypes or "
            "Python values); save a file per rank instead" + intact,
            failed_ranks=bad, phase="prepare")


def _sees(tmp_dir: str, save_id: str) -> bool:
    try:
        with open(os.path.join(tmp_dir, TOKEN)) as f:
            return f.read() == save_id
    except OSError:
        return False


def _cut(size: int, parts: int, k: int) -> int:
    return min(size, align_up(size * k // parts)) if k < parts else size


def _clip(e: Extent, lo: int, hi: int) -> Extent:
    start, end = max(e.offset, lo), min(e.offset + e.length, hi)
    return replace(e, start=e.start + start - e.offset, length=end - start, offset=start)


def check_loadable(data: bytes, allow_pickle: bool) -> None:
    """Refuse (before writing) a state whose file ``torch.load(weights_only=True)`` would not
    read, unless ``allow_pickle``."""
    if allow_pickle:
        return
    try:
        unpickle(data, lambda key, dtype, nbytes, location: torch.UntypedStorage(
            nbytes, device="meta"), weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(
            f"the state holds objects torch.load(weights_only=True) does not read "
            f"({str(e).splitlines()[0]}); keep only tensors, containers and plain values in it, "
            "allow the class with torch.serialization.add_safe_globals([...]), or pass "
            "allow_pickle=True (the file then loads with weights_only=False: trusted files "
            "only)") from None


def archive_plan(path: str, pickled: PickledState
                 ) -> tuple[ArchiveLayout, FilePlan, list[torch.UntypedStorage]]:
    """The archive of ``pickled`` at ``path``: its layout, and the data file it makes."""
    layout = plan_archive(archive_folder(os.path.basename(path)), pickled.data,
                          [e.storage.nbytes() for e in pickled.entries])
    return (layout, *file_plan(os.path.basename(path), layout, pickled.entries))


def file_plan(name: str, layout: ArchiveLayout,
              entries: list[StorageEntry]) -> tuple[FilePlan, list[torch.UntypedStorage]]:
    """The archive as one data file's extents: the storages (``storage`` = key) at their data
    offsets, then the glue pieces (numbered after them) between; and the sources of both."""
    extents = [Extent(k, 0, rec.size, 0, rec.data)
               for k, rec in enumerate(layout.storages) if rec.size]
    sources = [e.storage for e in entries]
    for offset, glue in layout.glue():
        extents.append(Extent(len(sources), 0, len(glue), 0, offset))
        sources.append(torch.frombuffer(bytearray(glue), dtype=torch.uint8).untyped_storage())
    extents.sort(key=lambda e: e.offset)
    return FilePlan(name, align_up(layout.tail_offset), tuple(extents)), sources

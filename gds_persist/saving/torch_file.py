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

from ..format import Extent, StorageRecord, align_up
from ..format.layout import FilePlan
from ..format.torch_archive import ArchiveLayout, archive_folder, plan_archive
from ..format.torch_pickle import StorageEntry, pickle_state, unpickle
from ..progress import ByteCounter
from ..results import SaveInfo
from ..stages import stage
from ..state.flatten import Flattened
from ..transfer.commit import aborted_on_error, begin_file, file_in, seal_file, writer_record
from ..transfer.writer import write_at, write_plan
from .as_saved import refuse_changed
from .options import SaveRequest
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


def save_torch_file(state: Any, path: str, options: SaveRequest, t0: float) -> SaveInfo:
    """Write ``state`` (or a :class:`PickledState`) as the torch.save file ``path``."""
    pickled = PickledState.of(state, options.allow_pickle)
    cfg, entries = options.cfg, pickled.entries
    layout, plan, sources = archive_plan(path, pickled)
    tmp = begin_file(path, cfg.io_timeout_s)
    needs = f"this file needs about {plan.size} bytes; "
    with aborted_on_error(tmp, path, needs):
        be, reason = backend_for(cfg, tmp.dir, [e.storage for e in entries])
        counter = ByteCounter(options.progress, plan.size)
        sealed = write_plan(be, tmp.dir, [plan], sources, cfg, counter.hook)
        reason = with_fallback(be, reason)
        crcs = storage_crcs(layout, sealed)
        refuse_changed(pickled.crc_at_save, crcs, lambda k: f"data/{entries[k].key}", path)
        tail = layout.tail(crcs, writer_record(be.name, reason))
        write_at(be, file_in(tmp), layout.tail_offset, tail)
        counter.finish()
    with stage("commit (rename)"):
        seal_file(tmp, cfg.io_timeout_s)
    payload = sum(e.storage.nbytes() for e in entries)
    return SaveInfo(tmp.path, be.name, reason, layout.tail_offset + len(tail), payload,
                    time.perf_counter() - t0, 0, len(entries), [os.path.basename(path)])


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


def storage_crcs(layout: ArchiveLayout, sealed: list[Extent]) -> list[int]:
    """Each storage's CRC32C, from the written extents (0 for an empty storage)."""
    crcs = [0] * len(layout.storages)
    for e in sealed:
        if e.storage < len(crcs):
            crcs[e.storage] = e.crc32c
    return crcs

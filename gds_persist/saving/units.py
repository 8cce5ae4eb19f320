"""The version-4 write of a save's files (format version 4): units cut and spread over the data
files, then one directory's files written through the unit writer.

**Units.** Every storage (or, in a data-parallel save, every piece of one that a rank writes) is
cut into units of at most :data:`~gds_persist.format.codec.UNIT_BYTES`, starting at the piece's
first byte. The cut depends only on the storage sizes (and the data-parallel plan, itself a pure
function of sizes and ranks), so the same key path is cut the same way in every checkpoint of a
run, whatever was written or referred before. Each unit is one extent: hashed (BLAKE3-128),
checksummed, maybe compressed, and placed at the next aligned offset as it is written
(:mod:`gds_persist.transfer.unit_writer`); units that a base holds are referred to instead
(:mod:`.incremental`).

**One directory's write** (:func:`choose`, then :func:`write_directory`), the same for a
single-process save and for each directory a rank of a data-parallel save writes into: choose the
backend (:func:`backend_for`, which plain saves use too), then the compression (``compression=``,
:mod:`.compression`), then write every file's units, the likely changed ones first, and check that
none was lost.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends import choose_backend
from ..backends.base import Backend
from ..errors import CheckpointError
from ..format import DTYPES, Extent, codec
from ..format.records import TensorRecord
from ..settings import Settings
from ..stages import stage
from ..stores import is_url
from ..stores.io import writer_for
from ..transfer.pipeline import byte_view
from ..transfer.staging import io_session
from ..transfer.unit_writer import Unit, UnitResults, UnitWriter, codec_threads
from .compression import choose as choose_compression
from .incremental import BaseIndex, Candidate, References

Piece = tuple[int, int, int]  # (storage, start, length)


def cut_units(pieces: Sequence[Piece], typesizes: Sequence[int],
              unit_bytes: int | None = None) -> list[Unit]:
    """Each ``(storage, start, length)`` piece cut into units of at most ``unit_bytes``
    (default :data:`~gds_persist.format.codec.UNIT_BYTES`)."""
    unit_bytes = unit_bytes or codec.UNIT_BYTES
    units = []
    for storage, start, length in pieces:
        for lo in range(start, start + length, unit_bytes):
            units.append(Unit(storage, lo, min(unit_bytes, start + length - lo),
                              typesizes[storage]))
    return units


def typesizes(tensors: Sequence[TensorRecord], n_storages: int) -> list[int]:
    """The element size of each storage's first tensor (1 where no tensor uses it)."""
    out = [0] * n_storages
    for t in tensors:
        if not out[t.storage]:
            out[t.storage] = DTYPES[t.dtype].itemsize
    return [s or 1 for s in out]




# --- one directory's write ---------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """How one directory's units are written, and why."""

    backend: Backend
    reason: str  # why this backend
    compress: bool
    compression_reason: str


def backend_for(cfg: Settings, directory: str,
                storages: Sequence[torch.UntypedStorage]) -> tuple[Backend, str]:
    """The backend that writes ``storages`` into ``directory`` (``cfg.backend``; a URL: the
    object store's uploads), and why."""
    if is_url(directory):
        return writer_for(cfg, directory)
    with stage("choose backend"):
        return choose_backend(cfg.backend, directory, any(s.is_cuda for s in storages),
                              cfg.io_threads, cfg.block_bytes)


def choose(cfg: Settings, directory: str, units: Sequence[Unit],
           storages: Sequence[torch.UntypedStorage]) -> Choice:
    """The backend for ``directory``, then whether to encode ``units`` (``cfg.compression``: a
    sample of them may be timed on that backend)."""
    be, reason = backend_for(cfg, directory, storages)
    sources = [byte_view(s) for s in storages]
    with stage("choose compression"):
        compress, why = choose_compression(cfg.compression, be, directory, units, sources, cfg)
    return Choice(be, reason, compress, why)


def with_fallback(be: Backend, reason: str) -> str:
    """``reason`` and, where kvikio switched to POSIX I/O mid-save, why."""
    fallback = getattr(be, "fallback_reason", None)
    return f"{reason}; {fallback}" if fallback else reason


@dataclass
class Written:
    """What :func:`write_units` wrote into ``directory``."""

    sizes: list[int]  # per file
    extents: list[Extent]  # written ones (``file``: the index in the call's file list)
    referred: list[tuple[int, Candidate]]  # (storage, candidate) of units not written
    hashes: int  # units hashed


def write_directory(choice: Choice, directory: str, names: Sequence[str],
                    files: Sequence[Sequence[int]], units: Sequence[Unit],
                    storages: Sequence[torch.UntypedStorage], cfg: Settings, *,
                    base: BaseIndex | None, keys: dict[int, str], hashes: bool,
                    progress: Callable[[int], None] | None = None) -> tuple[References, Written]:
    """Write ``units`` of ``storages`` into the files ``names`` of ``directory`` (``files``: unit
    indices per file), as ``choice`` says; units ``base`` holds (by key path, from ``keys``:
    storage -> key path) are referred to, not written. Within each file the units that likely
    changed go first. Raises unless every unit was written or referred to."""
    refs = References(base, keys, units)
    files = [sorted(f, key=lambda k: not refs.likely_changed(k)) for f in files]
    written = write_units(choice.backend, directory, names, files, units, storages, cfg,
                          compress=choice.compress, hashes=hashes, refs=refs, progress=progress)
    check_written(units, written)
    return refs, written


def write_units(backend: Backend, directory: str, names: Sequence[str],
                files: Sequence[Sequence[int]], units: Sequence[Unit],
                storages: Sequence[torch.UntypedStorage], cfg: Settings, *, compress: bool,
                hashes: bool, refs: References | None,
                progress: Callable[[int], None] | None = None) -> Written:
    """Write ``units`` (by ``files``: unit indices per file ``names[i]``) of ``storages`` into
    ``directory`` through the unit writer; units ``refs`` finds in the base are not written."""
    sources = [byte_view(s) for s in storages]
    block = max(cfg.block_bytes, codec.UNIT_BYTES)
    count = max(2, cfg.staging_bytes // block)
    with io_session(count, block, cfg.io_timeout_s, cfg.io_threads) as (ring, pool):
        writer = UnitWriter(backend, ring, pool, cfg.io_timeout_s, progress, compress=compress,
                            hashes=hashes, decide=refs.decide if refs is not None else None,
                            codec_threads=codec_threads())
        results: UnitResults = writer.write_files(
            [os.path.join(directory, n) for n in names], files, units, sources)
    written = [results.extents[k] for k in sorted(results.extents)]
    referred = ([(units[k].storage, refs.matched[k]) for k in sorted(results.referred)]
                if refs is not None else [])
    return Written(results.sizes, written, referred, len(results.hashes))


def check_written(units: Sequence[Unit], w: Written) -> None:
    """Every unit was written or referred to (a bug otherwise: never commit a gap)."""
    if len(w.extents) + len(w.referred) != len(units):
        raise CheckpointError(
            f"internal error: {len(units)} units but {len(w.extents)} written and "
            f"{len(w.referred)} referred; nothing was committed")


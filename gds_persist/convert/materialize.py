"""``materialize``: a standalone copy of a checkpoint, holding every byte it refers to.

An incremental checkpoint (format version 4) refers to bytes in its base checkpoints; a copy made
by :func:`materialize` holds all of them in its own data file, byte for byte as stored (encoded
extents stay encoded, checksums and content hashes stay), and refers to nothing: it survives the
deletion of its bases and can be moved anywhere. Every stored byte is checked against its
recorded CRC32C as it is copied. The copy is written like a save: into a temporary directory,
fsynced, then renamed into place.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

from .. import settings
from ..backends.posix import pwrite_all
from ..errors import ChecksumError
from ..format import (
    ALIGNMENT,
    DataFile,
    Extent,
    Manifest,
    align_up,
    crc32c,
    data_file_name,
    storage_descriptions,
)
from ..format.records import Wire
from ..progress import ByteCounter, ProgressCallback
from ..results import ExportInfo
from ..saving.manifest_builder import Part, build_manifest
from ..saving.sequence import Layout, Run, run_save
from ..stages import stage
from ..stores import refuse_url
from ..transfer.opened import OpenCheckpoint, opened

COPY_CHUNK = 16 << 20


def materialize(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                progress: ProgressCallback | None = None) -> ExportInfo:
    """Write a standalone copy of the checkpoint at ``path``: an incremental checkpoint's bytes
    held by its bases are copied in, so the copy needs none of them.

    Parameters:
        path: a committed checkpoint.
        out: the directory to write (replaced atomically if it exists; not ``path``).
        progress: ``progress(done_bytes, total_bytes)``, called as data is copied.

    Returns:
        :class:`~gds_persist.results.ExportInfo` of the copy.

    Raises:
        ChecksumError: a stored byte does not match its checksum (names the tensor).
        ReferencedCheckpointError: a base is missing or was replaced.
        ValueError: ``out`` is ``path``.
    """
    path, out = os.fspath(path), os.fspath(out)
    refuse_url(path, "materialize")
    refuse_url(out, "materialize")
    if os.path.abspath(path) == os.path.abspath(out):
        raise ValueError(f"materialize {path} onto itself: give another output directory")
    cfg = settings.current()
    absolute = os.path.abspath(out)
    return opened(path, lambda ck: run_save(_Copy(ck, path, progress), absolute, cfg=cfg,
                                            what=f"materialize of {path} to {out}"))


@dataclass(frozen=True)
class _Copied(Wire):
    extents: list[Extent]  # where the copy holds each stored extent
    size: int  # of the one data file


class _Copy(Layout[Any, _Copied]):
    """materialize's layout on the save sequence: every stored extent of an open checkpoint,
    checked, into one data file; the manifest as it was, its references resolved."""

    facts_type, report_type = None, _Copied

    def __init__(self, ck: OpenCheckpoint, path: str, progress: ProgressCallback | None):
        self.ck, self.path, self.progress = ck, path, progress

    def write(self, run: Run) -> _Copied:
        assert run.tmp is not None
        m, ck = self.ck.manifest, self.ck
        ck.open_files(range(len(m.files)))
        describe = storage_descriptions(m)
        self.counter = ByteCounter(self.progress,
                                   sum(align_up(e.stored_length) for e in m.extents))
        fd = os.open(os.path.join(run.tmp.dir, data_file_name(0)),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        extents: list[Extent] = []
        offset = 0
        try:
            for e in sorted(m.extents, key=lambda e: (e.file, e.offset)):
                with stage("copy extent", e.stored_length):
                    _copy_extent(ck, e, fd, offset, describe, self.counter)
                extents.append(replace(e, file=0, offset=offset))
                offset = align_up(offset + e.stored_length, ALIGNMENT)
            os.ftruncate(fd, offset)
            with stage("fsync"):
                os.fsync(fd)
        finally:
            os.close(fd)
        return _Copied(extents, offset)

    def seal(self, run: Run, reports: list[_Copied]) -> Manifest:
        m, copied = self.ck.manifest, reports[0]
        writer = {**m.writer, "materialized_from": os.path.abspath(self.path)}
        return build_manifest(Part(m.tree, m.tensors, m.storages),
                              [DataFile(data_file_name(0), copied.size)], copied.extents, writer,
                              sections=m.sections)

    def info(self, run: Run) -> ExportInfo:
        self.counter.finish()
        m = self.ck.manifest
        notes = [f"{m.referenced_bytes} bytes copied from base checkpoints "
                 f"({', '.join(b.name for b in m.bases)})"] if m.bases else []
        notes.append(f"{time.perf_counter() - run.t0:.2f} s")
        return ExportInfo(run.path, "gds_persist", len(m.tensors), run.reports[0].size, notes)


def _copy_extent(ck: OpenCheckpoint, e: Extent, fd: int, offset: int, describe: Any,
                 counter: ByteCounter) -> None:
    """Copy the stored bytes of ``e`` to ``offset`` of ``fd`` (zero-padded), checking them."""
    src = ck.fd(e.file)
    n = e.stored_length
    crc = 0
    for lo in range(0, n, COPY_CHUNK):
        want = min(COPY_CHUNK, n - lo)
        data = os.pread(src, want, e.offset + lo)
        if len(data) != want:
            raise ChecksumError(f"{describe(e.storage)}: {ck.file_path(e.file)} ends inside the "
                                f"extent at offset {e.offset}; the data file is truncated")
        crc = crc32c(data, crc)
        pwrite_all(fd, data, offset + lo)
        counter.add(want)
    pad = align_up(n, ALIGNMENT) - n
    if pad:
        pwrite_all(fd, bytes(pad), offset + n)
    if crc != e.stored_checksum:
        raise ChecksumError(
            f"checksum mismatch in {describe(e.storage)}: file {ck.file_path(e.file)}, offset "
            f"{e.offset}, {n} stored bytes: recorded {e.stored_checksum:08x}, read {crc:08x}; "
            "nothing was materialized")

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
from dataclasses import replace
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
from ..progress import ByteCounter, ProgressCallback
from ..results import ExportInfo
from ..stages import stage
from ..transfer.commit import aborted_on_error, begin, seal
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
    if os.path.abspath(path) == os.path.abspath(out):
        raise ValueError(f"materialize {path} onto itself: give another output directory")
    cfg = settings.current()
    t0 = time.perf_counter()

    def copy(ck: OpenCheckpoint) -> ExportInfo:
        m = ck.manifest
        ck.open_files(range(len(m.files)))
        describe = storage_descriptions(m)
        counter = ByteCounter(progress, sum(align_up(e.stored_length) for e in m.extents))
        tmp = begin(out, cfg.io_timeout_s)
        with aborted_on_error(tmp):
            name = data_file_name(0)
            fd = os.open(os.path.join(tmp.dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644)
            extents: list[Extent] = []
            offset = 0
            try:
                for e in sorted(m.extents, key=lambda e: (e.file, e.offset)):
                    with stage("copy extent", e.stored_length):
                        _copy_extent(ck, e, fd, offset, describe, counter)
                    extents.append(replace(e, file=0, offset=offset))
                    offset = align_up(offset + e.stored_length, ALIGNMENT)
                os.ftruncate(fd, offset)
                with stage("fsync"):
                    os.fsync(fd)
            finally:
                os.close(fd)
            writer = dict(m.writer)
            writer["materialized_from"] = os.path.abspath(path)
            manifest = Manifest([DataFile(name, offset)], m.storages, m.tensors, extents, m.tree,
                                writer, sections=m.sections)
            seal(tmp, manifest, cfg.io_timeout_s)
        counter.finish()
        notes = [f"{m.referenced_bytes} bytes copied from base checkpoints "
                 f"({', '.join(b.name for b in m.bases)})"] if m.bases else []
        notes.append(f"{time.perf_counter() - t0:.2f} s")
        return ExportInfo(out, "gds_persist", len(m.tensors), offset, notes)

    return opened(path, copy)


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

"""``verify``: re-read every extent of a checkpoint and check its CRC32C, keeping no data.

A stock ``torch.save`` file records no CRC32C, but torch's zip writer records a CRC-32 per
record (unless ``set_crc32_options(False)``): those are checked instead (``torch.load`` checks
neither). A safetensors file records nothing to check: the report says ``checksum="none"``.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from .. import settings
from ..errors import ChecksumError
from ..format import Extent, align_up, storage_descriptions
from ..progress import ByteCounter, ProgressCallback
from ..results import VerifyReport
from ..stores.opened import opened
from ..transfer.opened import OpenCheckpoint, OpenFile
from ..transfer.reader import checksum_mismatch
from .extents import read_extents


def verify(
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    progress: ProgressCallback | None = None,
    data_dirs: Any = None,
) -> VerifyReport:
    """Re-read every extent and check its CRC32C without keeping the data; reports all mismatches.

    Extents of an incremental checkpoint that live in its base checkpoints are checked like its
    own (the bases are identified first); encoded extents are checked twice: the stored bytes
    against ``stored_crc32c``, then the decoded bytes against ``crc32c``. A ``torch.save`` file
    gds_persist did not write is checked against its zip CRC-32s.

    Parameters:
        path: a checkpoint directory, or a ``torch.save`` / safetensors file.
        backend: the I/O backend, as for :func:`gds_persist.load`.
        progress: ``progress(done_bytes, total_bytes)``, called as data is read.
        data_dirs: as for :func:`gds_persist.load`.

    Returns:
        :class:`~gds_persist.results.VerifyReport`: what was checked and every mismatch
        (``report.ok``), not raised.

    Raises:
        ManifestError, TruncatedError, NotCommittedError: what stops the check.
    """
    path = os.path.expanduser(os.fspath(path))
    cfg = settings.current(backend=backend)

    def check(ck: OpenCheckpoint) -> VerifyReport:
        if not ck.verifiable:
            return _verify_stock(ck, progress)
        m = ck.manifest
        ck.open_files(range(len(m.files)))  # every file, also one that holds no extent
        describe = storage_descriptions(m)
        errors: list[ChecksumError] = []

        def collect(file: str, e: Extent, actual: int) -> None:
            if actual != e.crc32c:
                errors.append(checksum_mismatch(describe(e.storage), file, e, actual))

        counter = ByteCounter(progress, sum(align_up(e.stored_length) for e in m.extents))
        read_extents(ck, m.extents, None, cfg, describe=describe, on_checksum=collect,
                     on_error=errors.append, progress=counter.hook)
        counter.finish()
        return VerifyReport(
            path, len(m.files), len(m.extents), sum(e.length for e in m.extents), errors,
            referenced_bytes=m.referenced_bytes,
            encoded_extents=sum(1 for e in m.extents if e.encoded),
        )

    return opened(path, check, data_dirs)


CHUNK = 16 << 20


def _verify_stock(ck: OpenCheckpoint, progress: ProgressCallback | None) -> VerifyReport:
    """A file gds_persist did not write: its storages against their zip CRC-32, read in order
    (no engine: the CRC-32 of pieces cannot be joined here); a stock safetensors model
    directory records none."""
    m = ck.manifest
    if not isinstance(ck, OpenFile):
        return VerifyReport(ck.path, len(m.files), 0, 0, [], checksum="none")
    describe = storage_descriptions(m)
    extents = [e for e in m.extents if e.storage in ck.zip_crc32]
    counter = ByteCounter(progress, sum(e.length for e in extents))
    errors: list[ChecksumError] = []
    for e in extents:
        crc = 0
        for lo in range(0, e.length, CHUNK):
            crc = zlib.crc32(os.pread(ck.fd(0), min(CHUNK, e.length - lo), e.offset + lo), crc)
            counter.add(min(CHUNK, e.length - lo))
        if crc != ck.zip_crc32[e.storage]:
            errors.append(ChecksumError(
                f"zip CRC-32 mismatch in {describe(e.storage)}: file {ck.path}, offset "
                f"{e.offset}, {e.length} bytes: recorded {ck.zip_crc32[e.storage]:08x}, read "
                f"{crc:08x}; the file is corrupted"))
    counter.finish()
    checked = "zip crc-32" if extents else "none"
    return VerifyReport(ck.path, 1, len(extents), sum(e.length for e in extents), errors,
                        checksum=checked)

"""``verify``: re-read every extent of a checkpoint and check its CRC32C, keeping no data."""

from __future__ import annotations

import os
from typing import Any

from .. import settings
from ..errors import ChecksumError
from ..format import Extent, align_up, storage_descriptions
from ..progress import ByteCounter, ProgressCallback
from ..results import VerifyReport
from ..transfer.opened import OpenCheckpoint, opened
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
    against ``stored_crc32c``, then the decoded bytes against ``crc32c``.

    Raises for problems that stop the check (bad manifest, missing or truncated file).
    ``data_dirs`` as for :func:`load`.
    """
    path = os.fspath(path)
    cfg = settings.current(backend=backend)

    def check(ck: OpenCheckpoint) -> VerifyReport:
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

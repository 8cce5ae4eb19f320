"""The commit of a single file: it appears whole at its path, or not at all.

:class:`AtomicFile` writes through a temporary sibling ``.NAME.tmp-<id>``, then fsyncs it,
renames it into place and fsyncs the directory (the checkpoint directory's counterpart is
:mod:`gds_persist.transfer.commit`). Used for the files :func:`gds_persist.export_checkpoint`
writes (``torch.save``, safetensors).
"""

from __future__ import annotations

import os
import uuid

from .commit import fsync_path


class AtomicFile:
    """Write ``path`` through a temporary sibling that is fsynced and renamed into place.

    As a context manager it yields the descriptor of the temporary file and commits when the
    block ends normally, else removes the temporary file (a failed commit removes it too)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        base = os.path.basename(self.path)
        self.tmp = os.path.join(os.path.dirname(self.path), f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.path)
        fsync_path(os.path.dirname(self.path))

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise

"""POSIX backends: ``direct`` (O_DIRECT, bypasses the page cache) and ``buffered`` (plain writes).

Both write the same bytes at the same offsets, so their files are identical. ``direct`` needs
page-aligned buffers, offsets and lengths (the staging ring provides them) and a filesystem that
accepts O_DIRECT (tmpfs does not; :func:`supports_o_direct` probes it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import Any

from ..errors import BackendError, DiskFullError
from ..transfer.staging import AlignedBuffer
from .base import Backend

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class PosixBackend(Backend):
    extra_flags = 0

    def open(self, path: str, *, write: bool, size: int = 0) -> int:
        return open_fd(path, write, size, self.extra_flags)

    def pwrite(self, handle: int, buf: memoryview, offset: int) -> None:
        pwrite_all(handle, buf, offset)

    def pread(self, handle: int, buf: memoryview, offset: int) -> int:
        return pread_all(handle, memoryview(buf).cast("B"), offset)

    def sync(self, handle: int) -> None:
        os.fsync(handle)

    def close(self, handle: int) -> None:
        os.close(handle)


class DirectBackend(PosixBackend):
    """O_DIRECT writes/reads of large aligned blocks from page-aligned (pinned) staging buffers."""

    name = "direct"
    extra_flags = _O_DIRECT


class BufferedBackend(PosixBackend):
    """Plain POSIX I/O through the page cache, fsynced; for filesystems without O_DIRECT."""

    name = "buffered"


def open_fd(path: str, write: bool, size: int, flags: int = 0) -> int:
    """Open a data file for reading, or create it (never over an existing one) and reserve
    ``size`` bytes for writing; ``flags`` e.g. O_DIRECT."""
    if not write:
        return os.open(path, os.O_RDONLY | flags)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
    try:
        if size:
            _preallocate(fd, path, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (any buffer) at ``offset``, resuming after short writes."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskFullError(
                    errno.ENOSPC, f"disk full writing {view.nbytes} bytes at offset {offset}"
                ) from e
            raise
        view, offset = view[n:], offset + n


def pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; bytes read."""
    total = 0
    while total < view.nbytes:
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def _preallocate(fd: int, path: str, size: int) -> None:
    """Reserve the whole file up front, so a full disk fails before any data moves."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(
                errno.ENOSPC,
                f"not enough space for {path}: {size} bytes needed; free space or choose another "
                "directory",
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def supports_o_direct(directory: str) -> tuple[bool, str]:
    """Probe whether ``directory``'s filesystem accepts an aligned O_DIRECT write."""
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"

    probe = os.path.join(directory, f".o_direct_probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
    except OSError as e:
        # Some filesystems (ramfs) create the file and only then refuse O_DIRECT: remove it.
        with contextlib.suppress(OSError):
            os.unlink(probe)
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # a read-only checkpoint
            readable = _o_direct_read_probe(directory)
            if readable:
                return True, readable
        return False, f"open(O_DIRECT) failed on {directory}: {os.strerror(e.errno or 0)}"
    try:
        with AlignedBuffer(4096, pin=False) as buf:
            os.pwrite(fd, buf.view, 0)
        return True, f"{directory} accepts O_DIRECT"
    except OSError as e:
        return False, f"aligned O_DIRECT write failed on {directory}: {os.strerror(e.errno or 0)}"
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):  # the directory was removed meanwhile
            os.unlink(probe)


def _o_direct_read_probe(directory: str) -> str | None:
    """For a directory we may not write to: can its files be read with O_DIRECT?"""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | _O_DIRECT)
        except OSError:
            return None
        try:
            with AlignedBuffer(4096, pin=False) as buf:
                os.preadv(fd, [buf.view], 0)
            return f"{directory} is read-only but accepts O_DIRECT reads"
        except OSError:
            return None
        finally:
            os.close(fd)
    return None


def require_o_direct(directory: str) -> None:
    ok, why = supports_o_direct(directory)
    if not ok:
        raise BackendError(
            f"backend 'direct' cannot be used: {why}; use backend='buffered' (or 'auto', which "
            "falls back by itself)"
        )

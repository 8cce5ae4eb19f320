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
from .base import Backend
from .buffers import AlignedBuffer
from .mounts import filesystem_key

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class PosixBackend(Backend):
    extra_flags = 0

    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> int:
        return open_fd(path, write, size, self.extra_flags, create)

    def pwrite(self, handle: int, buf: memoryview, offset: int) -> None:
        pwrite_all(handle, buf, offset)

    def pread(self, handle: int, buf: memoryview, offset: int) -> int:
        return pread_all(handle, memoryview(buf).cast("B"), offset)

    def sync(self, handle: int) -> None:
        os.fsync(handle)

    def close(self, handle: int) -> None:
        os.close(handle)


class DirectBackend(PosixBackend):
    """O_DIRECT writes/reads of large aligned blocks from page-aligned (pinned) staging buffers,
    or from a tensor's own memory where its address meets ``host_alignment`` (probed per
    filesystem: :func:`o_direct_host_alignment`)."""

    name = "direct"
    extra_flags = _O_DIRECT

    def __init__(self, host_alignment: int = 4096):
        self.host_alignment = host_alignment


class BufferedBackend(PosixBackend):
    """Plain POSIX I/O through the page cache, fsynced; for filesystems without O_DIRECT.
    Reads go without read-ahead (:func:`open_buffered_for_reading`)."""

    name = "buffered"
    host_alignment = 1

    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> int:
        if not write:
            return open_buffered_for_reading(path)
        return super().open(path, write=write, size=size, create=create)


def open_buffered_for_reading(path: str) -> int:
    """A buffered read descriptor with read-ahead off (``POSIX_FADV_RANDOM``): a load's requests
    are large and several run at once, so the kernel's read-ahead only adds reads of its own
    (an earlier attempt at issue 26 found buffered loads faster without it on the virtio disk;
    bench/results/2026-12-02-cpu-fadvise-random-ab.txt measures it)."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def open_fd(path: str, write: bool, size: int, flags: int = 0, create: bool = True) -> int:
    """Open a data file for reading, or create it (never over an existing one) and reserve
    ``size`` bytes for writing; ``create=False``: open an existing one for writing (no
    truncation, no reservation); ``flags`` e.g. O_DIRECT."""
    if not write:
        return os.open(path, os.O_RDONLY | flags)
    if not create:
        return os.open(path, os.O_WRONLY | flags)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
    try:
        if size:
            _preallocate(fd, path, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def zero_pad_end(path: str, fd: int, direct: bool, end: int, alignment: int = 4096) -> None:
    """Make the file at least ``end`` rounded up to ``alignment`` bytes long, writing zeros after
    ``end`` (the padding the plan leaves after the file's last extent), then nothing else.

    A writer that sends exact extent lengths (kvikio from device memory) leaves the file ending
    at ``end`` where nothing reserved its full size (tmpfs, which is not preallocated); the
    manifest records the aligned size. Zeros are written, never ``ftruncate``: a rank writing
    part of a shared file must not cut another rank's bytes. ``fd`` serves unless it is O_DIRECT
    (``direct``), which takes no unaligned write; then ``path`` is opened for this one write.
    """
    target = -(-end // alignment) * alignment
    if target == end or os.fstat(fd).st_size >= target:
        return
    out = os.open(path, os.O_WRONLY) if direct else fd
    try:
        pwrite_all(out, bytes(target - end), end)
    finally:
        if out != fd:
            os.close(out)


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
    """Reserve the whole file up front, so a full disk fails before any data moves.

    On a memory-backed filesystem (tmpfs) reserving means allocating and zeroing every page, a
    pass over the whole file that the writes then repeat (measured: it cost more than the writes
    themselves); there the free space is checked instead, and a write that still meets a full
    filesystem fails the save with :class:`DiskFullError` as well.
    """
    try:
        if _memory_backed(fd):
            st = os.fstatvfs(fd)
            if st.f_blocks and st.f_bavail * st.f_frsize < size:  # f_blocks 0: no size limit
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return
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


_MEMORY_FILESYSTEMS = ("tmpfs",)
_fstype: dict[int, str] = {}  # st_dev -> filesystem type


def filesystem_type(fd: int) -> str:
    """The type of the filesystem holding open file ``fd`` (from /proc/self/mountinfo; "" when
    unknown), cached per device."""
    dev = os.fstat(fd).st_dev
    if dev not in _fstype:
        wanted = f"{os.major(dev)}:{os.minor(dev)}"
        found = ""
        with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) > 2 and fields[2] == wanted and right:
                    found = right.split()[0]
                    break
        _fstype[dev] = found
    return _fstype[dev]


def _memory_backed(fd: int) -> bool:
    return filesystem_type(fd) in _MEMORY_FILESYSTEMS


def memory_backed(directory: str) -> bool:
    """Whether ``directory`` is on a memory-backed filesystem (tmpfs)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _memory_backed(fd)
    finally:
        os.close(fd)


# filesystems (st_dev, mounts.filesystem_key) whose O_DIRECT write probe succeeded: a load or
# save there does not write a probe file again (one on the virtio disk took up to 0.2 s)
_accepts_o_direct: set[tuple[int, str]] = set()


def supports_o_direct(directory: str) -> tuple[bool, str]:
    """Whether ``directory``'s filesystem accepts an aligned O_DIRECT write: probed with a real
    one, once per filesystem where it succeeds (a refusal may be the directory's own, as a
    read-only checkpoint's, and is probed again)."""
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return _probe_o_direct(directory)  # says why
    key = (dev, filesystem_key(dev))
    if key in _accepts_o_direct:
        return True, _ACCEPTS.format(directory)
    ok, why = _probe_o_direct(directory)
    if why == _ACCEPTS.format(directory):  # written, not only read
        _accepts_o_direct.add(key)
    return ok, why


_ACCEPTS = "{} accepts O_DIRECT"  # what a probe that wrote says


def _probe_o_direct(directory: str) -> tuple[bool, str]:
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
        return True, _ACCEPTS.format(directory)
    except OSError as e:
        return False, f"aligned O_DIRECT write failed on {directory}: {os.strerror(e.errno or 0)}"
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):  # the directory was removed meanwhile
            os.unlink(probe)


_HOST_OFFSETS = (64, 512)  # torch aligns host allocations to 64 bytes; block devices to 512
_host_alignment: dict[int, int] = {}  # st_dev -> probed alignment


def o_direct_host_alignment(directory: str) -> int:
    """The smallest memory address alignment (64, 512 or 4096) that O_DIRECT writes on
    ``directory``'s filesystem accept, probed once per filesystem with a real write (4096 where
    nothing can be written there, e.g. a read-only checkpoint)."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return 4096
    if dev not in _host_alignment:
        probed = _probe_host_alignment(directory)
        if probed is None:  # nothing could be written there (now): not the filesystem's answer
            return 4096
        _host_alignment[dev] = probed
    return _host_alignment[dev]


def _probe_host_alignment(directory: str) -> int | None:
    probe = os.path.join(directory, f".o_direct_probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
    except OSError:
        return None
    try:
        with AlignedBuffer(8192, pin=False) as buf:
            for offset in _HOST_OFFSETS:
                try:
                    os.pwrite(fd, buf.view[offset : offset + 4096], 0)
                    return offset
                except OSError:
                    continue
        return 4096
    finally:
        os.close(fd)
        # a cleaner may have removed the directory, the probe with it: a load's probe in a data
        # directory that a newer save removed failed the load (tests/test_concurrency.py's
        # harness, data-dirs mode, seed 2295578827)
        with contextlib.suppress(FileNotFoundError):
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

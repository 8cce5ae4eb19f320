"""Advisory locks (``flock``) on small lock files: how one process proves to another that it is
alive, and how commits of one path take turns.

* A save holds an exclusive lock on ``.NAME.tmp-<id>.lock`` for its whole life; a data-parallel
  rank holds a shared lock on its data directory's ``.<stripe>.lock``. The kernel drops a lock
  when its holder dies (SIGKILL included), so "the lock can be taken" proves the owner is gone:
  only then is what it left removed.
* Commits of one path take turns on ``.NAME.commit.lock`` (:mod:`.commit`).

A lock file may be deleted, but only by a process holding its exclusive lock. Whoever acquires a
lock then checks that its descriptor is still the file linked at that path (same inode, not
unlinked) and otherwise opens the path again; so a lock acquired and checked is the one lock of
that path, and nobody ever holds a lock on a file a cleaner just deleted without noticing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass

from ..errors import CheckpointTimeout

STALE_UNLOCKED_S = 3600.0  # a leftover with no lock file is removed once untouched this long


@dataclass
class FileLock:
    """A lock acquired on ``path`` (descriptor ``fd``); :meth:`release` exactly once."""

    path: str
    fd: int
    exclusive: bool = True

    def release(self, remove: bool = False) -> bool:
        """Drop the lock; ``remove``: delete the lock file first (a shared holder only if it can
        take the lock exclusively, i.e. it is the last holder). True if it deleted it.

        (Linux converts a lock by dropping it first, so of holders that all try, the last one
        to try gets the exclusive lock.)"""
        if self.fd < 0:
            return False
        try:
            if remove and (self.exclusive or _try_flock(self.fd, fcntl.LOCK_EX)):
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                return True
            return False
        finally:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _try_flock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def _still_linked(fd: int, path: str) -> bool:
    mine = os.fstat(fd)
    if mine.st_nlink == 0:
        return False
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def holder_of(path: str) -> str:
    """Who last took the exclusive lock on ``path`` (``pid N on HOST``), for error messages."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(200).strip()
    except OSError:
        text = ""
    return text or "an unknown process"


def _sign(fd: int) -> None:
    """Write who holds the lock into the lock file (diagnostics only)."""
    note = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, note, 0)


def acquire(path: str, *, timeout_s: float, what: str, shared: bool = False) -> FileLock:
    """Take the lock of ``path`` (creating the file), waiting at most ``timeout_s``; raises
    :class:`CheckpointTimeout` naming ``what`` and the holder when the wait runs out."""
    lock = _acquire(path, timeout_s, what, shared, False)
    assert lock is not None
    return lock


def acquire_new(path: str, *, timeout_s: float, what: str) -> FileLock | None:
    """Create ``path`` (it must not exist: a fresh owner lock with a unique name) and take its
    exclusive lock; None if a cleaner removed it before it could be locked (pick another
    name)."""
    return _acquire(path, timeout_s, what, False, True)


def _acquire(path: str, timeout_s: float, what: str, shared: bool,
             create_new: bool) -> FileLock | None:
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    how = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if create_new else 0)
    while True:
        fd = os.open(path, flags, 0o644)
        try:
            while not _try_flock(fd, how):
                if time.monotonic() >= deadline:
                    raise CheckpointTimeout(
                        f"{what}: waited {timeout_s:.0f} s for the lock {path}, held by "
                        f"{holder_of(path)}; that process is still alive (a lock is released "
                        "when its holder exits or dies). Wait for it, stop it, or raise "
                        "io_timeout_s if its storage is just slow"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            if _still_linked(fd, path):
                if not shared:
                    _sign(fd)
                return FileLock(path, fd, not shared)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # deleted by its previous holder in between: open the path again
        if create_new:
            return None


def try_acquire(path: str) -> FileLock | None:
    """The exclusive lock of an existing ``path`` if nobody holds it now (its owner is gone),
    else None (held, or the file is gone)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_EX) and _still_linked(fd, path):
            return FileLock(path, fd, True)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def untouched_for(path: str, seconds: float) -> bool:
    """Whether neither ``path`` nor anything directly in it changed for ``seconds`` (a leftover
    without a lock file is removed only then: a live writer of an older version touches it)."""
    now = time.time()
    try:
        latest = os.lstat(path).st_mtime
        if os.path.isdir(path) and not os.path.islink(path):
            with os.scandir(path) as it:
                for entry in it:
                    try:
                        latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
                    except FileNotFoundError:
                        continue
    except FileNotFoundError:
        return False
    return now - latest >= seconds

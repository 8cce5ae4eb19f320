"""Last stage of a save: make the checkpoint durable and visible atomically.

The save sequence (:mod:`gds_persist.saving.sequence`) begins every save here and ends it here::

    tmp = begin(path)              # refuse what is not a checkpoint; temporary directory + lock
    ...write the data files into tmp.dir...
    seal(tmp, manifest)            # manifest written and fsynced, then committed
    # on any failure before that: abort(tmp) - the temporary directory goes, nothing else

So a save writes everything into a temporary sibling directory ``.NAME.tmp-<id>``;
:func:`commit` (the end of :func:`seal`) fsyncs it and swaps it into place. With an existing
checkpoint at the path, the swap is one ``renameat2(RENAME_EXCHANGE)``, so at every instant the
path holds either the old or the new complete checkpoint. Killed anywhere before that, the old
checkpoint is untouched and only a temporary directory is left, which :func:`load` refuses and a
later save of that path removes.

Several processes, one path (``docs/FORMAT.md``, "Several processes, one path"):

* **Saves run at once and the last to commit wins.** Each save owns its temporary directory by
  an exclusive ``flock`` on ``.NAME.tmp-<id>.lock``, created and locked before the directory and
  held until the save has committed or given up (then both are removed). A save removes another
  save's leftovers only when it can take their lock - their owner has exited or died - so it
  never deletes a live save's files. (A temporary without a lock file comes from an older
  gds_persist; it is removed once untouched for :data:`~.locks.STALE_UNLOCKED_S`.)
* **Commits take turns** on ``.NAME.commit.lock`` (exclusive, held for the swap and the fsync of
  the parent; waiting is bounded by ``io_timeout_s``, then :class:`CheckpointTimeout` names the
  holder). So the two-rename fallback (no ``RENAME_EXCHANGE`` on the filesystem) cannot
  interleave with another commit, and commits are ordered: the checkpoint at the path is the one
  whose commit came last, complete; every save that returned did commit, none is lost silently.
* The replaced checkpoint is removed after the lock is released; a reader that opened it first
  keeps reading it (``gds_persist.transfer.opened``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._version import __version__
from ..errors import (
    CheckpointError,
    CheckpointPermissionError,
    NotACheckpointDirectoryError,
    UnsupportedURLError,
)
from ..format import MANIFEST_NAME, Manifest, dump_manifest, parse_manifest
from .locks import (
    STALE_UNLOCKED_S,
    FileLock,
    acquire,
    acquire_new,
    try_acquire,
    untouched_for,
)

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"
LOCK_SUFFIX = ".lock"
_COMMIT_LOCK = ".commit.lock"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
DEFAULT_TIMEOUT_S = 600.0
# False: always the two-rename fallback, as on filesystems without RENAME_EXCHANGE (the tests
# run that path this way; it is also an escape hatch should a filesystem's exchange misbehave).
USE_RENAME_EXCHANGE = True


# a URL (scheme://...): never a local path here; gds_persist.stores routes URLs to their store
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# what os.path.abspath makes of one ("s3://b/x" -> "$PWD/s3:/b/x"), seen relative to $PWD
_MANGLED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def refuse_url(path: str) -> None:
    """The last guard before a local directory is made or opened: a URL that reached the local
    commit or reader (an entry point that did not route it to its store) is refused, never made
    into a folder such as ``./s3:/bucket/x``."""
    try:
        relative = os.path.relpath(path)
    except (OSError, ValueError):  # no working directory (removed): nothing made from it
        relative = ""
    if URL.match(path) or _MANGLED_URL.match(relative):
        raise UnsupportedURLError(
            f"{path} is a URL, not a local path; save, load, verify, inspect and the "
            "Checkpointer take s3:// URLs (docs/OBJECT_STORE.md, \"URLs\")")


def is_temporary(path: str) -> bool:
    name = os.path.basename(os.path.normpath(path))
    return name.startswith(".") and (_TMP_MARK in name or _OLD_MARK in name)


def commit_lock_path(path: str) -> str:
    """The lock file commits of ``path`` take turns on (it exists only during a commit)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{_COMMIT_LOCK}")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: str) -> bool:
    """Remove a directory tree; True once it is gone. Tolerates entries vanishing and appearing
    (another cleaner, a reader's short-lived probe file) by trying again a few times."""
    for attempt in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return True
        time.sleep(0.01 * (attempt + 1))
    return False


def check_replaceable(path: str, replace: bool = True) -> None:
    """Refuse to replace anything at ``path`` that is not a gds_persist checkpoint (an empty
    directory is taken); ``replace=False``: refuse a checkpoint there too."""
    if not os.path.lexists(path):
        return
    entries: list[str] = []
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            entries = sorted(os.listdir(path))
        except FileNotFoundError:  # replaced or removed by another process just now
            return
        if not entries:
            return
        if MANIFEST_NAME in entries:
            if replace:
                return
            # its first words are FileSystemWriter's (PyTorch's DCP test_overwrite matches them)
            raise CheckpointError(
                f"Checkpoint already exists and overwrite=False: {path} already holds a "
                "checkpoint and this save was asked not to replace one; choose another path, "
                "remove it, or pass overwrite=True (replaced atomically once the new checkpoint "
                "is complete)"
            )
    held = (f"a directory holding {', '.join(repr(e) for e in entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}" if entries else "a file or link")
    raise CheckpointError(
        f"{path} exists and is not a gds_persist checkpoint; refusing to replace it ({held}): "
        "a save replaces the whole directory at the path atomically, which would delete what "
        "is there. Save into a new or empty directory (e.g. a subdirectory of it), or remove "
        "it yourself"
    )


@dataclass
class Temporary:
    """The temporary directory of one save of ``path`` and the lock that proves it is alive.

    ``dir`` is ``.NAME.tmp-<id>``; after :meth:`swap_in` it holds the replaced checkpoint (or
    nothing). Finish with :func:`commit` or :func:`abort`; dropped unfinished (a failed DCP
    save), the lock is released when the object is collected and a later save cleans up.
    """

    path: str
    dir: str
    ident: str
    lock: FileLock
    _commit_lock: FileLock | None = field(default=None, repr=False)
    _parked: str | None = field(default=None, repr=False)  # two-rename fallback: old checkpoint
    # what may be replaced at ``path`` (checked under the commit lock); a model directory's
    # save replaces a Hugging Face model directory, not only a checkpoint
    replaceable: Callable[[str, bool], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _close_quietly, self.lock)

    def swap_in(self, timeout_s: float = DEFAULT_TIMEOUT_S, replace: bool = True) -> None:
        """Put the fsynced ``dir`` at ``path`` under the commit lock, which stays held until
        :meth:`finish` (a data-parallel save removes stale data directories under it);
        ``replace=False``: only where no checkpoint is (checked under the lock)."""
        fsync_path(self.dir)
        path, parent = self.path, os.path.dirname(self.path)
        lock = acquire(commit_lock_path(path), timeout_s=timeout_s,
                       what=f"committing {path} (another process is committing it)")
        try:
            (self.replaceable or check_replaceable)(path, replace)
            if os.path.lexists(path) and _exchange(self.dir, path):
                pass  # self.dir now holds the previous checkpoint
            elif os.path.lexists(path):  # no exchange: two renames, old kept until the new is in
                old = os.path.join(parent, os.path.basename(self.dir).replace(_TMP_MARK,
                                                                              _OLD_MARK, 1))
                os.rename(path, old)
                try:
                    os.rename(self.dir, path)
                except BaseException:
                    os.rename(old, path)  # put the previous checkpoint back before reporting
                    raise
                self._parked = old
            else:
                os.rename(self.dir, path)
            fsync_path(parent)
        except BaseException:
            lock.release(remove=True)
            raise
        self._commit_lock = lock

    def finish(self) -> None:
        """After :meth:`swap_in` (or instead of it: an abort): release the commit lock, remove
        the replaced checkpoint (or the unfinished one) and this save's lock. Never raises for
        a cleanup that fails: what is left is removed by a later save."""
        if self._commit_lock is not None:
            lock, self._commit_lock = self._commit_lock, None
            lock.release(remove=True)
        gone = remove_tree(self.dir)
        if self._parked is not None:
            gone = remove_tree(self._parked) and gone
        self.lock.release(remove=gone)  # kept (unlocked) if something is left: a later save
        self._finalizer.detach()         # sees a dead owner and removes it


def _close_quietly(lock: FileLock) -> None:
    try:
        lock.release()
    except OSError:
        pass


def make_temporary(path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Temporary:
    """Remove leftovers of dead saves of ``path``, then create this save's lock and temporary
    directory (in that order: a temporary directory never exists without its lock file)."""
    refuse_url(path)
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    with _parent_errors(path, parent):
        os.makedirs(parent, exist_ok=True)
        remove_stale_temporaries(parent, name, timeout_s)
        while True:
            ident = uuid.uuid4().hex[:12]
            tmp = os.path.join(parent, f".{name}{_TMP_MARK}{ident}")
            lock = acquire_new(tmp + LOCK_SUFFIX, timeout_s=timeout_s, what=f"saving {path}")
            if lock is not None:
                break
    try:
        os.mkdir(tmp)
    except BaseException:
        lock.release(remove=True)
        raise
    return Temporary(path, tmp, ident, lock)


@contextlib.contextmanager
def _parent_errors(path: str, parent: str) -> Iterator[None]:
    """The filesystem's refusals to make a save's directory, as errors that name the save and
    the fix (and are still the ``OSError`` subclass the filesystem raised)."""
    try:
        yield
    except PermissionError as e:
        raise CheckpointPermissionError(
            errno.EACCES, f"cannot save {path}: this process may not create files in {parent} "
            f"({e.strerror}: {e.filename}); save elsewhere or make {parent} writable") from e
    except (FileExistsError, NotADirectoryError) as e:  # makedirs met a file on the way
        raise NotACheckpointDirectoryError(
            errno.ENOTDIR, f"cannot save {path}: {e.filename} is a file, not a directory; "
            "save elsewhere or move the file") from e


def remove_stale_temporaries(parent: str, name: str,
                             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Remove what dead saves of ``name`` left behind: only its own marked siblings, and only
    those whose owner lock can be taken (owner gone). Returns the removed entries.

    A save killed in the two-rename fallback between its renames left the path empty and the
    previous checkpoint parked at ``.NAME.old-<id>``: that is put back first.
    """
    tmp_prefix, old_prefix = f".{name}{_TMP_MARK}", f".{name}{_OLD_MARK}"
    path = os.path.join(parent, name)
    entries = os.listdir(parent)
    removed = []
    for entry in entries:
        if not (entry.startswith(tmp_prefix) and entry.endswith(LOCK_SUFFIX)):
            continue
        lock = try_acquire(os.path.join(parent, entry))
        if lock is None:  # alive (or just finished)
            continue
        gone = False
        try:
            ident = entry[len(tmp_prefix):-len(LOCK_SUFFIX)]
            old = os.path.join(parent, old_prefix + ident)
            if os.path.isdir(old) and not os.path.lexists(path):
                _put_back(old, path, timeout_s)
            gone = remove_tree(os.path.join(parent, tmp_prefix + ident)) and remove_tree(old)
            removed.append(entry)
        finally:
            lock.release(remove=gone)
    commit_lock = try_acquire(commit_lock_path(path))  # left by a save killed mid-commit
    if commit_lock is not None:
        commit_lock.release(remove=True)
    for entry in entries:  # no lock file: an older gds_persist's; remove it only when untouched
        if entry.endswith(LOCK_SUFFIX) or not entry.startswith((tmp_prefix, old_prefix)):
            continue
        full = os.path.join(parent, entry)
        ident = entry[len(tmp_prefix if entry.startswith(tmp_prefix) else old_prefix):]
        if os.path.lexists(os.path.join(parent, tmp_prefix + ident + LOCK_SUFFIX)):
            continue
        if untouched_for(full, STALE_UNLOCKED_S) and remove_tree(full):
            removed.append(entry)
    return removed


def _put_back(old: str, path: str, timeout_s: float) -> None:
    lock = acquire(commit_lock_path(path), timeout_s=timeout_s, what=f"restoring {path}")
    try:
        if not os.path.lexists(path):
            os.rename(old, path)
            fsync_path(os.path.dirname(path))
    finally:
        lock.release(remove=True)


def write_manifest(directory: str, data: bytes) -> None:
    """Write and fsync the manifest: the last file of a save, the seal over the data files."""
    fd = os.open(
        os.path.join(directory, MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False where the kernel or filesystem cannot."""
    if not USE_RENAME_EXCHANGE:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def commit(tmp: Temporary, timeout_s: float = DEFAULT_TIMEOUT_S, replace: bool = True) -> None:
    """Publish the fully written ``tmp`` directory at its path (taking turns with other commits
    of that path, waiting at most ``timeout_s``; ``replace=False``: refuse if a checkpoint is
    there); on failure the previous checkpoint is intact and ``tmp`` is removed."""
    try:
        tmp.swap_in(timeout_s, replace)
    except BaseException:
        tmp.finish()
        raise
    tmp.finish()


def abort(tmp: Temporary) -> None:
    """Give up a save: remove its temporary directory and release its lock."""
    tmp.finish()


# --- the commit sequence, as every save runs it -------------------------------------------------

def begin(path: str, timeout_s: float = DEFAULT_TIMEOUT_S, replace: bool = True) -> Temporary:
    """Start a save of ``path``: refuse to replace what is not a checkpoint (``replace=False``:
    any checkpoint too), then make this save's temporary directory."""
    check_replaceable(path, replace)
    return make_temporary(path, timeout_s)


def seal(tmp: Temporary, manifest: Manifest, timeout_s: float = DEFAULT_TIMEOUT_S,
         replace: bool = True, *, check: bool = False, keep_lock: bool = False) -> None:
    """Seal the data files written into ``tmp`` with ``manifest`` (written and fsynced last) and
    commit them at its path; on failure ``tmp`` is given up and the previous checkpoint is intact.

    ``check``: parse the dumped manifest back first (never commit garbage; a data-parallel save
    assembles it from every rank's report). ``keep_lock``: hold the commit lock until
    ``tmp.finish()`` (a data-parallel save removes stale data directories under it)."""
    try:
        raw = dump_manifest(manifest)
        if check:
            parse_manifest(raw, f"the manifest being written for {tmp.path}")
        write_manifest(tmp.dir, raw)
        if keep_lock:
            tmp.swap_in(timeout_s, replace)
            return
    except BaseException:
        abort(tmp)
        raise
    commit(tmp, timeout_s, replace)  # gives ``tmp`` up itself on failure




def writer_record(backend: str, reason: str, world_size: int = 1, host: str | None = None,
                  **more: Any) -> dict[str, Any]:
    """The manifest's ``writer`` record (for humans and bug reports): the backend and why, the
    versions, the host (default: this one) and the world size, then ``more``."""
    return {"backend": backend, "reason": reason, "gds_persist": __version__,
            "torch": torch.__version__, "host": host if host is not None else socket.gethostname(),
            "world_size": world_size, **more}


# --- the commit of a single file (a torch.save archive) ---------------------------------------

def begin_file(path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Temporary:
    """Start a save of the single file ``path``: it is written as ``<temporary>/NAME`` and
    renamed over ``path`` by :func:`seal_file` (the same owner lock and leftover cleanup as a
    directory save). A directory at ``path`` is refused, never replaced."""
    _refuse_directory(path)
    return make_temporary(path, timeout_s)


def file_in(tmp: Temporary) -> str:
    """Where the file of a single-file save is written before its commit."""
    return os.path.join(tmp.dir, os.path.basename(tmp.path))


def seal_file(tmp: Temporary, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Publish the written and fsynced :func:`file_in` at its path: one rename (an existing file
    is replaced atomically), under the path's commit lock, then the directory fsynced; on
    failure the temporary is given up and whatever was at the path is intact."""
    try:
        lock = acquire(commit_lock_path(tmp.path), timeout_s=timeout_s,
                       what=f"committing {tmp.path} (another process is committing it)")
        try:
            _refuse_directory(tmp.path)
            os.rename(file_in(tmp), tmp.path)
            fsync_path(os.path.dirname(tmp.path))
        finally:
            lock.release(remove=True)
    finally:
        tmp.finish()


def _refuse_directory(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        raise CheckpointError(
            f"{path} is a directory; a format='torch' save writes one file there and would have "
            "to delete it: choose another path (such as a name ending in .pt), or remove it")

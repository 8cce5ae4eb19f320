"""Last stage of a save: make the checkpoint durable and visible atomically.

A save writes everything into a temporary sibling directory ``.NAME.tmp-<id>``; :func:`commit`
fsyncs it and swaps it into place. With an existing checkpoint at the path, the swap is one
``renameat2(RENAME_EXCHANGE)``, so at every instant the path holds either the old or the new
complete checkpoint. Killed anywhere before that, the old checkpoint is untouched and only a
temporary directory is left, which :func:`load` refuses and the next save of that path removes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid

from ..errors import CheckpointError
from ..format import MANIFEST_NAME

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def is_temporary(path: str) -> bool:
    name = os.path.basename(os.path.normpath(path))
    return name.startswith(".") and (_TMP_MARK in name or _OLD_MARK in name)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(path: str) -> None:
    """Refuse to replace anything at ``path`` that is not a gds_persist checkpoint."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = os.listdir(path)
        if not entries or MANIFEST_NAME in entries:
            return
    raise CheckpointError(
        f"{path} exists and is not a gds_persist checkpoint; refusing to replace it. Choose "
        "another path or remove it yourself"
    )


def make_temporary(path: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(parent, name)
    tmp = os.path.join(parent, f".{name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    return tmp


def remove_stale_temporaries(parent: str, name: str) -> None:
    """Remove what interrupted saves of ``name`` left behind (only its own marked siblings)."""
    for entry in os.listdir(parent):
        if entry.startswith(f".{name}{_TMP_MARK}") or entry.startswith(f".{name}{_OLD_MARK}"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


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


def commit(tmp: str, path: str) -> None:
    """Publish the fully written, fsynced ``tmp`` directory at ``path``."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_path(tmp)
    if os.path.lexists(path) and _exchange(tmp, path):
        fsync_path(parent)
        shutil.rmtree(tmp)  # now holds the previous checkpoint
        return
    if os.path.lexists(path):  # no exchange available: two renames, old kept until the new is in
        old = os.path.join(parent, os.path.basename(tmp).replace(_TMP_MARK, _OLD_MARK, 1))
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)  # put the previous checkpoint back before reporting
            raise
        fsync_path(parent)
        shutil.rmtree(old)
        return
    os.rename(tmp, path)
    fsync_path(parent)


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)

"""Reading a checkpoint held in an object store, through the same reader interface as a
directory (:class:`gds_persist.transfer.opened.OpenCheckpoint`): the manifest object, then the
data objects it names (their sizes checked before any byte is read), read by ranged GETs.

An object store has no descriptor to hold: a checkpoint replaced while it is read has its
previous objects removed by the save that replaced it. Such a read fails naming the object
(HTTP 404) and the load can be run again; it never returns bytes of two checkpoints (each
extent's CRC32C is checked, and the objects of one save live under a prefix of its own).

:func:`open_checkpoint` and :func:`opened` are the entry of every reader: a URL here, a local
path on to :mod:`gds_persist.transfer.opened`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..errors import CheckpointReplacedError, ManifestError, NotCommittedError, TruncatedError
from ..format import MANIFEST_NAME, Manifest
from ..transfer import opened as local
from ..transfer.opened import OpenCheckpoint
from .commit import SAVE_MARK, object_path, read_manifest
from .urls import Location, is_url, parse, resolve, store_for

T = TypeVar("T")


class ObjectCheckpoint(OpenCheckpoint):
    """A committed checkpoint in an object store: its validated manifest; data files are the
    objects it names."""

    def __init__(self, loc: Location, raw: bytes, manifest: Manifest):  # noqa: D107
        # no descriptors: OpenCheckpoint's own set-up would hold the directory's
        self.loc, self.path, self.manifest = loc, loc.url, manifest
        self.digest = hashlib.sha256(raw).hexdigest()
        self.roots: dict[str, str] = {}
        self._fds: dict[Any, int] = {}
        self._sizes: dict[int, int] = {}
        self._finalizer = lambda: None  # type: ignore[assignment]

    def close(self) -> None:
        """Nothing is held."""

    def set_data_dirs(self, data_dirs: Any) -> None:
        if data_dirs is not None:
            raise ValueError(f"{self.path}: data_dirs= applies to local checkpoints only")

    def replaced(self) -> str:
        now = read_manifest(self.loc)
        if now is None:
            return "removed"
        return "" if hashlib.sha256(now[0]).hexdigest() == self.digest else "replaced"

    def file_path(self, index: int) -> str:
        return object_path(self.path, self.manifest, self.manifest.files[index].name)

    def fd(self, index: int) -> int:
        raise ManifestError(f"{self.file_path(index)} is an object, it has no descriptor")

    def source(self, index: int) -> str:
        return self.file_path(index)

    def open_files(self, indices: Iterable[int]) -> None:
        """Check that data objects ``indices`` are there and whole."""
        store = store_for(self.loc)
        for index in sorted(set(indices) - self._sizes.keys()):
            f = self.manifest.files[index]
            if f.base or f.dir:
                raise ManifestError(f"{self.path}: data file {f.name} lives outside the "
                                    "checkpoint's objects; an object-store checkpoint holds its "
                                    "own data only")
            url = self.file_path(index)
            size = store.size(parse(url).key)
            if size is None:
                why = self.replaced()
                if why:
                    raise CheckpointReplacedError(local.replaced_message(self.path, why))
                raise TruncatedError(f"data object {url} is missing; the checkpoint is "
                                     "incomplete")
            if size < f.size:
                raise TruncatedError(f"data object {url} is {size} bytes but the manifest "
                                     f"records {f.size}: restore it or use an earlier checkpoint")
            self._sizes[index] = size


def open_object_checkpoint(url: str) -> ObjectCheckpoint:
    loc = parse(url)
    if loc.name.startswith(SAVE_MARK):
        raise NotCommittedError(f"{url} is the data prefix of a save, not a checkpoint; load the "
                                "checkpoint URL itself")
    found = read_manifest(loc)
    if found is None:
        raise NotCommittedError(
            f"{url} holds no {MANIFEST_NAME}: it is not a committed gds_persist checkpoint (an "
            "interrupted save leaves only .save-* objects, which the next save removes)")
    return ObjectCheckpoint(loc, *found)


def open_checkpoint(path: str | os.PathLike[str], data_dirs: Any = None) -> OpenCheckpoint:
    """The checkpoint at ``path`` held open: a URL of a store, or a local path
    (:func:`gds_persist.transfer.opened.open_checkpoint`)."""
    if is_url(path):
        ck = open_object_checkpoint(resolve(path))
        ck.set_data_dirs(data_dirs)
        return ck
    return local.open_checkpoint(_local(path), data_dirs)


def opened(path: str | os.PathLike[str], use: Callable[[OpenCheckpoint], T],
           data_dirs: Any = None) -> T:
    """``use(checkpoint)`` on the checkpoint at ``path`` (a URL or a local path), as
    :func:`gds_persist.transfer.opened.opened`."""
    if is_url(path):
        ck = open_checkpoint(path, data_dirs)
        try:
            return use(ck)
        finally:
            ck.close()
    return local.opened(_local(path), use, data_dirs)


def _local(path: str | os.PathLike[str]) -> str:
    """A local path as given (relative stays relative: messages name what the user typed);
    a ``file://`` URL as its path."""
    text = os.fspath(path)
    return resolve(text) if "://" in text else text

"""Objects through the backend interface (:mod:`gds_persist.backends.base`), so the one writer
and the one reader (:mod:`gds_persist.transfer.writer`, :mod:`gds_persist.transfer.reader`)
move their bytes: a save's data file is one object, a load's extents are ranged reads.

Writing: the writer hands in its staging buffers, one request of ``block_bytes`` each at
``k * block_bytes``, from its I/O threads at once: each becomes part ``k + 1`` of a multipart
upload, uploaded from the buffer while the next ones fill (bounded memory: the staging ring).
An object of one block or less is one PUT at ``sync``. ``sync`` completes the upload: only then
does the object exist, whole. ``close`` without ``sync`` aborts it.

Reading: each request is one ranged GET read straight into the buffer given, a staging buffer
or (``host_alignment`` 1: any address) the destination tensor's own memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from .. import settings
from ..backends.base import Backend
from ..errors import ObjectStoreError
from .base import ObjectStore
from .urls import parse, store_for

PART_MIN = 8 << 20  # block_bytes of an object-store save: above every store's smallest part


@dataclass
class _Upload:
    store: ObjectStore
    key: str
    size: int
    part: int
    small: bytearray | None = None  # one PUT at sync (an object of one part)
    upload: str = ""
    tags: list[tuple[int, str]] = field(default_factory=list)
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Object:
    store: ObjectStore
    key: str


class ObjectWriter(Backend):
    """Writes each data file as one object (see the module docstring)."""

    name = "s3"
    host_alignment = None  # only staging buffers: every request is one whole part

    def __init__(self, part_bytes: int):
        self.part = part_bytes

    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> _Upload:
        if not (write and create):
            raise ObjectStoreError(f"{path}: an object is written whole by one process, never "
                                   "in parts by several (docs/OBJECT_STORE.md, \"Limits\")", path)
        loc = parse(path)
        store = store_for(loc)
        up = _Upload(store, loc.key, size, self.part)
        if size <= self.part:
            up.small = bytearray(size)
        else:
            up.upload = store.start_upload(loc.key)
        return up

    def pwrite(self, handle: _Upload, buf: Any, offset: int) -> None:
        view = memoryview(buf).cast("B")
        if handle.small is not None:
            handle.small[offset: offset + view.nbytes] = view
            return
        if offset % handle.part or (view.nbytes != handle.part
                                    and offset + view.nbytes != handle.size):
            raise ObjectStoreError(f"{handle.store.url(handle.key)}: a write of {view.nbytes} "
                                   f"bytes at {offset} is not one whole part of {handle.part}")
        tag = handle.store.upload_part(handle.key, handle.upload, offset // handle.part + 1, view)
        with handle.lock:
            handle.tags.append((offset // handle.part + 1, tag))

    def pread(self, handle: Any, buf: Any, offset: int) -> int:
        raise NotImplementedError("ObjectWriter only writes")

    def set_size(self, handle: _Upload, size: int) -> None:
        if size != handle.size:
            raise ObjectStoreError(f"{handle.store.url(handle.key)}: an object's size is fixed "
                                   "when it is written (encoded units are not stored in objects)")

    def sync(self, handle: _Upload) -> None:
        if handle.small is not None:
            handle.store.put(handle.key, memoryview(handle.small))
        else:
            handle.store.finish_upload(handle.key, handle.upload, handle.tags)
        handle.done = True

    def close(self, handle: _Upload) -> None:
        if not handle.done and handle.upload:
            try:
                handle.store.abort_upload(handle.key, handle.upload)
            except ObjectStoreError:
                pass  # a later save's sweep gives it up (stale_uploads)


class ObjectReader(Backend):
    """Ranged reads of objects (see the module docstring)."""

    name = "s3"
    host_alignment = 1  # into the destination's own memory wherever it is
    whole_requests = True  # extents under a request are read in windows with their neighbours

    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> _Object:
        loc = parse(path)
        return _Object(store_for(loc), loc.key)

    def pwrite(self, handle: Any, buf: Any, offset: int) -> None:
        raise NotImplementedError("ObjectReader only reads")

    def pread(self, handle: _Object, buf: Any, offset: int) -> int:
        return handle.store.read_into(handle.key, offset, memoryview(buf).cast("B"))

    def sync(self, handle: Any) -> None:
        pass

    def close(self, handle: Any) -> None:
        pass


def object_settings(cfg: settings.Settings) -> settings.Settings:
    """``cfg`` for a save to an object store: requests of at least :data:`PART_MIN` (each is one
    part of a multipart upload) and a ring of at least two of them."""
    block = max(cfg.block_bytes, PART_MIN)
    return replace(cfg, block_bytes=block, staging_bytes=max(cfg.staging_bytes, 2 * block))


def writer_for(cfg: settings.Settings, url: str) -> tuple[Backend, str]:
    """The backend that writes the data objects under ``url`` and why."""
    return ObjectWriter(cfg.block_bytes), (f"multipart uploads of {parse(url).scheme}:// "
                                           f"objects, parts of {cfg.block_bytes >> 20} MiB")


def reader_for(url: str) -> tuple[Backend, str]:
    """The backend that reads the objects of ``url`` and why (a load's ``LoadInfo.reason``)."""
    return ObjectReader(), f"ranged reads of {parse(url).scheme}:// objects"

"""The one small interface every I/O backend implements.

Only backends touch file descriptors. Call order, made by :mod:`gds_persist.transfer.writer` and
:mod:`gds_persist.transfer.reader`:

Save (one data file)::

    h = backend.open(path, write=True, size=n)  # creates, preallocates n bytes (ENOSPC here);
                                                 # create=False: writes into an existing file
                                                 # (ranks writing parts of one file)
    backend.pwrite(h, buf, offset)               # any number, from several threads at once
    backend.set_size(h, m)                       # only when fewer bytes were written than
                                                 # reserved (encoded or referred units)
    backend.sync(h)                              # data durable (fsync) before the manifest
    backend.close(h)                             # always, also after an error

Load::

    h = backend.open(path, write=False)          # path: /proc/self/fd/N of the file the load
                                                 # holds open (gds_persist.transfer.opened)
    backend.pread(h, buf, offset)                # any number, from several threads at once
    backend.close(h)

``offset`` and ``len(buf)`` are multiples of ``alignment``; host buffers are page-aligned
(:mod:`gds_persist.backends.buffers`, handed out by the staging ring of
:mod:`gds_persist.transfer.staging`). Backends that accept device memory
(``accepts_device``) also take CUDA tensors for ``buf``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any


class Backend(ABC):
    name: str = ""
    alignment: int = 4096
    accepts_device: bool = False  # True: pwrite/pread take CUDA tensors directly (no host bounce)
    # The address alignment host memory given to pwrite/pread needs (offsets and lengths always
    # need ``alignment``); None: hand it only staging buffers, never a tensor's own memory.
    host_alignment: int | None = 4096
    # A backend that times a load's first requests to choose how to read the rest: how many
    # more it times, and the bytes each should hold (the reader sends those first, cut to that)
    probe_requests: int = 0
    probe_bytes: int = 0
    # True: each request costs a round trip (an object store's ranged GET), so a reader reads an
    # extent into its destination directly only when it fills whole requests, and stages
    # smaller ones with their neighbours, a window per request
    whole_requests: bool = False

    @abstractmethod
    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> Any: ...

    @abstractmethod
    def pwrite(self, handle: Any, buf: Any, offset: int) -> None: ...

    @abstractmethod
    def pread(self, handle: Any, buf: Any, offset: int) -> int: ...

    def set_size(self, handle: Any, size: int) -> None:
        """Make the file ``size`` bytes long (trims a file created with a larger reservation);
        the default leaves it as it is (longer files are valid checkpoints)."""
        fd = handle if isinstance(handle, int) else getattr(handle, "fd", None)
        if isinstance(fd, int):
            os.ftruncate(fd, size)

    @abstractmethod
    def sync(self, handle: Any) -> None: ...

    @abstractmethod
    def close(self, handle: Any) -> None: ...

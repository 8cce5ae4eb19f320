"""How much of a load's files the page cache already holds (``mincore``), asked before ``auto``
reads them with O_DIRECT.

O_DIRECT goes to the drive even for pages the cache holds; a buffered read of them is a memory
copy. On the development VM's virtio disk, 1 GiB loads of a checkpoint whose files were in the
page cache took 1.23 s with ``auto`` (O_DIRECT: its measuring rounds see the drive, not the
cache) against 0.87 s through the page cache, and ``load(into=)`` 0.84 against 0.33 s (medians
of 4 ABBA pairs, bench/results/2026-12-04-cpu-issue44-loads/candidates-disk-warm.txt). The
question costs one ``mmap`` + ``mincore`` per file (no byte is read: nothing is faulted in).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np


@cache
def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def resident_bytes(paths: Sequence[str]) -> tuple[int, int] | None:
    """``(bytes in the page cache, bytes)`` of the files ``paths``; None where the system
    cannot say (no ``mincore``, a file that cannot be mapped)."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
                if libc.mincore(addr, size, vec.ctypes.data) != 0:
                    return None
                resident += int(np.count_nonzero(vec & 1)) * page
                total += size
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return min(resident, total), total

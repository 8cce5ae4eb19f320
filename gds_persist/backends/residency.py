"""How much of a load's files the page cache already holds, asked before ``auto`` reads them
with O_DIRECT.

O_DIRECT goes to the drive even for pages the cache holds; a buffered read of them is a memory
copy. On the development VM's virtio disk, 1 GiB loads of a checkpoint whose files were in the
page cache took 1.23 s with ``auto`` (O_DIRECT: its measuring rounds see the drive, not the
cache) against 0.87 s through the page cache, and ``load(into=)`` 0.84 against 0.33 s (medians
of 4 ABBA pairs, bench/results/2026-12-04-cpu-issue44-loads/candidates-disk-warm.txt).

The question is asked before every load from a drive, so it must cost nothing beside the read:
``cachestat`` (Linux 6.5+) counts a file's cached pages in the kernel in one call, 0.1 ms for a
1 GiB file held whole; ``mincore`` over a mapping of the file, the fallback, took 9-14 ms
(bench/results/2026-12-05-cpu-issue44-g/residency.txt). Neither reads or faults in a byte.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
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
    libc.syscall.restype = ctypes.c_long
    return libc


def resident_bytes(paths: Sequence[str]) -> tuple[int, int] | None:
    """``(bytes in the page cache, bytes)`` of the files ``paths``; None where the system
    cannot say (neither ``cachestat`` nor ``mincore``, a file that cannot be mapped)."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            held = _cachestat_bytes(libc, fd)
            if held is None:
                held = _mincore_bytes(libc, fd, size)
            if held is None:
                return None
            resident += min(held, size)
            total += size
        finally:
            os.close(fd)
    return resident, total


class _Range(ctypes.Structure):  # struct cachestat_range
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end


class _CacheStat(ctypes.Structure):  # struct cachestat
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


CACHESTAT = 451  # the syscall's number on every architecture (numbers from 424 on are shared)
_cachestat_missing = False  # set once the kernel says it has no cachestat


def _cachestat_bytes(libc: Any, fd: int) -> int | None:
    """Bytes of ``fd`` in the page cache by ``cachestat`` (pages still being read in count,
    where ``mincore`` counts only those read); None where it cannot say (a kernel before 6.5,
    a seccomp filter, a filesystem it does not serve)."""
    global _cachestat_missing
    if _cachestat_missing or not sys.platform.startswith("linux"):
        return None
    stat = _CacheStat()
    if libc.syscall(CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
        _cachestat_missing = ctypes.get_errno() == errno.ENOSYS
        return None
    return int(stat.nr_cache) * mmap.PAGESIZE


def _mincore_bytes(libc: Any, fd: int, size: int) -> int | None:
    """Bytes of ``fd`` (``size`` long) in the page cache by ``mincore`` over a mapping of it."""
    page = mmap.PAGESIZE
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
        if libc.mincore(addr, size, vec.ctypes.data) != 0:
            return None
        return int(np.count_nonzero(vec & 1)) * page
    finally:
        libc.munmap(addr, size)

"""1 GiB of distinct page-aligned bytes written to tmpfs from 4 threads, one file each, two ways:
O_DIRECT ``pwrite`` of 16 MiB (the aligned writer's way), and copied into a shared mapping of the
file (with and without ``MADV_POPULATE_WRITE``): whether a save could checksum while copying
into the page cache itself. Alternated 5 times; GB/s median, then per round.

    python bench/results/2026-12-04-cpu-issue44-c/write_paths.py /dev/shm/DIR
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

N, THREADS, UNIT = 1 << 30, 4, 16 << 20
PER = N // THREADS
MADV_POPULATE_WRITE = 23


def by_pwrite(memory: mmap.mmap, directory: str) -> Callable[[int], None]:
    def one(k: int) -> None:
        fd = os.open(f"{directory}/f{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        view = memoryview(memory)
        for u in range(k * PER, (k + 1) * PER, UNIT):
            os.pwrite(fd, view[u : u + UNIT], u - k * PER)
        os.fsync(fd)
        os.close(fd)
        view.release()
    return one


def by_mapping(source: np.ndarray, directory: str, populate: bool) -> Callable[[int], None]:
    def one(k: int) -> None:
        fd = os.open(f"{directory}/f{k}", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, PER)
        m = mmap.mmap(fd, PER, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if populate:
            m.madvise(MADV_POPULATE_WRITE)
        dst = np.frombuffer(m, dtype=np.uint8)
        for u in range(0, PER, UNIT):
            np.copyto(dst[u : u + UNIT], source[k * PER + u : k * PER + u + UNIT])
        del dst
        m.close()
        os.fsync(fd)
        os.close(fd)
    return one


def timed(fn: Callable[[int], None], directory: str) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(fn, range(THREADS)))
    seconds = time.perf_counter() - t0
    for k in range(THREADS):
        os.unlink(f"{directory}/f{k}")
    return seconds


def main(directory: str) -> None:
    memory = mmap.mmap(-1, N)
    source = np.frombuffer(memory, dtype=np.uint8)
    source[:] = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
    ways = {"pwrite": by_pwrite(memory, directory),
            "mapping": by_mapping(source, directory, False),
            "mapping-populate": by_mapping(source, directory, True)}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(5):
        for w, fn in ways.items():
            seconds[w].append(timed(fn, directory))
    for w, v in seconds.items():
        rates = " ".join(f"{N / x / 1e9:.2f}" for x in v)
        print(f"{w:17} {N / statistics.median(v) / 1e9:.2f} GB/s ({rates})")


if __name__ == "__main__":
    main(sys.argv[1])

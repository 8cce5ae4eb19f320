"""What asking the page cache costs: ``cachestat`` against ``mincore`` over a mapping, on one
file with none of it cached and with all of it cached; medians of 7 calls.

    PYTHONPATH=. python bench/results/2026-12-05-cpu-issue44-g/residency.py FILE
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

from bench import machine
from gds_persist.backends import residency


def median_ms(fn: Callable[[], object]) -> tuple[float, object]:
    times, value = [], None
    for _ in range(7):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, value


def both(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        libc = residency._libc()
        kernel = median_ms(lambda: residency._cachestat_bytes(libc, fd))
        mapped = median_ms(lambda: residency._mincore_bytes(libc, fd, size))
    finally:
        os.close(fd)
    return (f"cachestat {kernel[0]:.2f} ms ({kernel[1]} B cached), "
            f"mincore {mapped[0]:.2f} ms ({mapped[1]} B cached)")


def main(path: str) -> None:
    print(f"{path}: {os.path.getsize(path)} B")
    machine.drop_page_cache([path], "per-file")
    print("none cached:", both(path))
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    print("all cached: ", both(path))


if __name__ == "__main__":
    main(sys.argv[1])

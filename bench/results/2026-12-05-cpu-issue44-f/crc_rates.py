"""The host CRC32C packages side by side: 1 GiB from DRAM (cold) and 1 MiB from the cache (hot),
one core, and whether two threads checksum in parallel (the GIL released).

    .venv/bin/python bench/results/2026-12-05-cpu-issue44-f/crc_rates.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import awscrt.checksums
import crc32c
import numpy as np

GiB, MiB = 1 << 30, 1 << 20
PACKAGES = {"crc32c (SSE4.2)": crc32c.crc32c, "awscrt (VPCLMULQDQ)": awscrt.checksums.crc32c}


def rate(fn, buf: np.ndarray, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn(buf, 0)
    return repeat * buf.nbytes / (time.perf_counter() - start) / 1e9


def two_threads(fn, buf: np.ndarray) -> float:
    """Time of two threads each checksumming ``buf``, over the time of one doing it."""
    start = time.perf_counter()
    fn(buf, 0)
    one = time.perf_counter() - start
    threads = [threading.Thread(target=fn, args=(buf, 0)) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / one


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    cold = np.random.default_rng(0).integers(0, 256, GiB, dtype=np.uint8)
    hot = cold[:MiB].copy()
    assert len({fn(cold, 0) for fn in PACKAGES.values()}) == 1  # the same CRC
    for name, fn in PACKAGES.items():
        colds = [rate(fn, cold, 1) for _ in range(rounds)]
        hots = [rate(fn, hot, 500) for _ in range(rounds)]
        print(f"{name:22s} cold {statistics.median(colds):5.1f} GB/s ({min(colds):.1f}-"
              f"{max(colds):.1f}), hot {statistics.median(hots):5.1f} GB/s; two threads take "
              f"{two_threads(fn, cold):.2f}x one's time for 2x the bytes")


if __name__ == "__main__":
    main()

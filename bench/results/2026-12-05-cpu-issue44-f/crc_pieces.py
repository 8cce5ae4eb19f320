"""Where the CRC32C goes in a CPU-bound write: 1 GiB of distinct page-aligned bytes written by 4
threads, one file each, O_DIRECT 16 MiB requests, fsynced (the aligned writer), against the same
with each request's CRC32C taken first on its thread (the checksummed writer, with either
package), and with the CRC and the write alternating over 2, 4 or 8 MiB pieces of each request
(the piece still in the cache when the kernel copies it). Arms shuffled each round, a pause
before each; medians, and each arm's time over the plain writer's.

    .venv/bin/python bench/results/2026-12-05-cpu-issue44-f/crc_pieces.py DIR [ROUNDS] [PAUSE_S]
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import awscrt.checksums
import crc32c
import numpy as np

MiB = 1 << 20
SIZE, JOBS, REQUEST = 1 << 30, 4, 16 * MiB
PART = SIZE // JOBS
ARMS = {  # name: (piece bytes, CRC function or None)
    "plain": (REQUEST, None),
    "crc32c 16M": (REQUEST, crc32c.crc32c),
    "awscrt 16M": (REQUEST, awscrt.checksums.crc32c),
    "awscrt 8M": (8 * MiB, awscrt.checksums.crc32c),
    "awscrt 4M": (4 * MiB, awscrt.checksums.crc32c),
    "awscrt 2M": (2 * MiB, awscrt.checksums.crc32c),
}


def write_part(directory: str, memory: mmap.mmap, k: int, piece: int, crc) -> None:
    fd = os.open(os.path.join(directory, f"part{k}"),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view, data = memoryview(memory), np.frombuffer(memory, dtype=np.uint8)
        for at in range(0, PART, piece):
            lo = k * PART + at
            if crc is not None:
                crc(data[lo : lo + piece], 0)
            os.pwrite(fd, view[lo : lo + piece], at)
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(directory: str, memory: mmap.mmap, piece: int, crc, pause_s: float) -> float:
    for k in range(JOBS):
        if os.path.exists(path := os.path.join(directory, f"part{k}")):
            os.unlink(path)
    time.sleep(pause_s)
    start = time.perf_counter()
    with ThreadPoolExecutor(JOBS) as pool:
        list(pool.map(lambda k: write_part(directory, memory, k, piece, crc), range(JOBS)))
    return time.perf_counter() - start


def main() -> None:
    directory = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    pause_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    os.makedirs(directory, exist_ok=True)
    memory = mmap.mmap(-1, SIZE)
    np.frombuffer(memory, dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, SIZE, dtype=np.uint8)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(rounds):
        for name in random.sample(list(ARMS), len(ARMS)):
            times[name].append(timed(directory, memory, *ARMS[name], pause_s))
    plain = statistics.median(times["plain"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:12s} {median:.3f} s  {SIZE / median / 1e9:.2f} GB/s  "
              f"plain / this {plain / median:.2f}")


if __name__ == "__main__":
    main()

"""Issue 44: does this VM's disk care where O_DIRECT writes come from?

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44/distinct_vs_reused.py \
        [--dir bench/out] [--mib 256] [--rounds 6]

4 threads, one file each (reserved as the engine reserves them), 16 MiB O_DIRECT pwrites, fsync:
``distinct`` writes each file's own distinct pages (the aligned-writer limit, a save without a
staging copy), ``reused`` writes the same bytes count from one 32 MiB buffer per thread used
again and again (what fio does), ``copy+reused`` copies the distinct bytes into that buffer
first, then writes it (a staged save without its checksum). Rounds in ABC/CBA order.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gds_persist.backends.posix import open_fd

BLOCK = 16 << 20
MODES = ("distinct", "reused", "copy+reused")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="bench/out")
    p.add_argument("--mib", type=int, default=256, help="per thread (4 threads)")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    n = a.mib << 20
    rng = np.random.default_rng(0)
    data = [mmap.mmap(-1, n) for _ in range(4)]
    for m in data:
        np.frombuffer(m, dtype=np.uint8)[:] = rng.integers(0, 256, n, dtype=np.uint8)
    rings = [mmap.mmap(-1, 2 * BLOCK) for _ in range(4)]
    for m in rings:
        np.frombuffer(m, dtype=np.uint8)[:] = 7
    os.makedirs(a.dir, exist_ok=True)

    def run(mode: str) -> float:
        def one(k: int) -> None:
            src, ring = memoryview(data[k]), memoryview(rings[k])
            path = os.path.join(a.dir, f"distinct-vs-reused.{k}")
            fd = open_fd(path, True, n, os.O_DIRECT)
            try:
                for i, at in enumerate(range(0, n, BLOCK)):
                    buf = ring[(i % 2) * BLOCK : (i % 2 + 1) * BLOCK]
                    if mode == "distinct":
                        buf = src[at : at + BLOCK]
                    elif mode == "copy+reused":
                        buf[:] = src[at : at + BLOCK]
                    os.pwrite(fd, buf, at)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)

        os.sync()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(4)))
        return 4 * n / (time.perf_counter() - t0) / 1e9

    got: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            got[mode].append(run(mode))
    for mode, v in got.items():
        print(f"{mode:12} median {statistics.median(v):5.2f} GB/s  "
              + " ".join(f"{x:5.2f}" for x in v))


if __name__ == "__main__":
    main()

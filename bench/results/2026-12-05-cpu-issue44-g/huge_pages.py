"""O_DIRECT rates of one drive from four kinds of page-aligned memory: a shared anonymous
mapping (what ``bench_limit.py``'s aligned writer uses), a private one (the engine's staging
buffers), a private one with ``MADV_HUGEPAGE`` (2 MiB transparent huge pages: physically
contiguous), and a torch tensor's memory. 1 GiB written (4 threads, one file each, 16 MiB
requests, fsynced) and read back cold the same way; fresh memory each round, kinds shuffled,
the best of 2 transfers per round; medians over rounds.

    PYTHONPATH=. python bench/results/2026-12-05-cpu-issue44-g/huge_pages.py DIR ROUNDS
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from bench import machine

SIZE, BLOCK, THREADS, PAGE = 1 << 30, 16 << 20, 4, 4096
KINDS = ("shared", "private", "huge pages", "torch")


def memory(kind: str) -> tuple[Any, memoryview]:
    if kind == "torch":
        t = torch.full((SIZE + PAGE,), 7, dtype=torch.uint8)
        at = (-t.data_ptr()) % PAGE
        return t, memoryview(t.numpy())[at : at + SIZE]
    flags = mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    m = mmap.mmap(-1, SIZE, flags=flags)
    if kind == "huge pages":
        m.madvise(mmap.MADV_HUGEPAGE)
    np.frombuffer(m, dtype=np.uint8)[:] = 7
    return m, memoryview(m)


def transfer(directory: str, view: memoryview, write: bool) -> float:
    part = SIZE // THREADS

    def one(k: int) -> None:
        path = os.path.join(directory, f"hp.{k}")
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        try:
            for at in range(k * part, (k + 1) * part, BLOCK):
                piece = view[at : at + BLOCK]
                if write:
                    os.pwrite(fd, piece, at - k * part)
                else:
                    os.preadv(fd, [piece], at - k * part)
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, range(THREADS)))
    return SIZE / (time.perf_counter() - t0) / 1e9


def one_round(directory: str, kind: str) -> tuple[float, float]:
    owner, view = memory(kind)
    files = [os.path.join(directory, f"hp.{k}") for k in range(THREADS)]
    writes, reads = [], []
    for _ in range(2):
        os.sync()
        time.sleep(1)
        writes.append(transfer(directory, view, True))
        machine.drop_page_cache(files, "per-file")
        time.sleep(1)
        reads.append(transfer(directory, view, False))
    view.release()
    if isinstance(owner, mmap.mmap):
        owner.close()
    return max(writes), max(reads)


def main(directory: str, rounds: int) -> None:
    os.makedirs(directory, exist_ok=True)
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in random.sample(KINDS, len(KINDS)):
            got[kind].append(one_round(directory, kind))
    print(f"{directory}: 1 GiB, {THREADS} threads, {BLOCK >> 20} MiB O_DIRECT requests; "
          f"GB/s, median of {rounds} rounds (each round's value)")
    for kind, v in got.items():
        w, r = [x[0] for x in v], [x[1] for x in v]
        print(f"  {kind:10}  write {statistics.median(w):.2f} ({', '.join(f'{x:.2f}' for x in w)})"
              f"  read {statistics.median(r):.2f} ({', '.join(f'{x:.2f}' for x in r)})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

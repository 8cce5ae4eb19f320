"""Does O_DIRECT's rate depend on which memory the buffers landed in? Sets of four identical
16 MiB anonymous private buffers (as the staging ring's), each set reading a 1 GiB file with
O_DIRECT on 4 threads (one contiguous quarter each) and writing 1 GiB from them (fsynced), in
rotated rounds; prints each set's rates and its medians.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/memory_draw.py FILE SETS ROUNDS
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench import machine

B = 16 << 20


def buffers() -> list[mmap.mmap]:
    out = []
    for _ in range(4):
        m = mmap.mmap(-1, B, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(b"\1" * B)
        out.append(m)
    return out


def transfer(path: str, bufs: list[mmap.mmap], per: int, write: bool) -> None:
    def one(i: int) -> None:
        target = f"{path}.w{i}" if write else path
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        fd = os.open(target, flags | os.O_DIRECT, 0o644)
        view = memoryview(bufs[i])
        try:
            for a in range(0, per, B):
                if write:
                    os.pwrite(fd, view, a)
                else:
                    os.preadv(fd, [view], i * per + a)
            if write:
                os.fsync(fd)
        finally:
            view.release()
            os.close(fd)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(4)))


def main() -> None:
    path, sets, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    per = os.path.getsize(path) // 4 // B * B
    pool = [buffers() for _ in range(sets)]
    rates: dict[int, dict[str, list[float]]] = {k: {"read": [], "write": []} for k in range(sets)}
    for r in range(rounds):
        for k in [(r + j) % sets for j in range(sets)]:
            machine.drop_page_cache([path], "per-file")
            t0 = time.perf_counter()
            transfer(path, pool[k], per, False)
            t1 = time.perf_counter()
            transfer(path, pool[k], per, True)
            t2 = time.perf_counter()
            rates[k]["read"].append(4 * per / (t1 - t0) / 1e9)
            rates[k]["write"].append(4 * per / (t2 - t1) / 1e9)
        print(f"round {r}: " + "  ".join(
            f"set {k} r {rates[k]['read'][-1]:.2f} w {rates[k]['write'][-1]:.2f}"
            for k in range(sets)), flush=True)
    for k in range(sets):
        print(f"set {k}: read median {statistics.median(rates[k]['read']):.2f} GB/s "
              f"({', '.join(f'{x:.2f}' for x in rates[k]['read'])}); write median "
              f"{statistics.median(rates[k]['write']):.2f} GB/s "
              f"({', '.join(f'{x:.2f}' for x in rates[k]['write'])})")
    for i in range(4):
        try:
            os.unlink(f"{path}.w{i}")
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    main()

"""What faulting in fresh memory costs with and without transparent huge pages: 1 GiB of
anonymous memory (``MADV_HUGEPAGE`` or not) touched once per 4 KiB page, each in a fresh
process, alternating, after a pause. On this VM freed guest memory goes back to the host
(virtio_balloon), and a huge page needs a whole 2 MiB block the host may have to supply again.

    python bench/results/2026-12-05-cpu-issue44-h/thp_touch.py [ROUNDS]
"""

from __future__ import annotations

import mmap
import statistics
import subprocess
import sys
import time

SIZE = 1 << 30


def touch(kind: str) -> float:
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "huge":
        m.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    for off in range(0, SIZE, mmap.PAGESIZE):
        m[off] = 1
    return time.perf_counter() - t0


def main(rounds: int) -> None:
    times: dict[str, list[float]] = {"huge": [], "base": []}
    for _ in range(rounds):
        for kind in times:
            time.sleep(3)
            out = subprocess.run([sys.executable, __file__, "--one", kind], check=True,
                                 capture_output=True, text=True).stdout
            times[kind].append(float(out))
    for kind, ts in times.items():
        print(f"{kind:5s} pages: median {statistics.median(ts):.3f} s, "
              f"rounds {', '.join(f'{t:.3f}' for t in ts)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(touch(sys.argv[2]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)

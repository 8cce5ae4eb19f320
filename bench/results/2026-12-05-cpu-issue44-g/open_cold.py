"""Seconds to open a torch.save file gds_persist wrote, cold (its page cache dropped, 0.5 s
pause) and warm; medians of R rounds. The local headers checked on a thread (where the tree has
that) are waited for after the clock stops, as a load waits for them after its read.

    PYTHONPATH=TREE python bench/results/2026-12-05-cpu-issue44-g/open_cold.py FILE R
"""

from __future__ import annotations

import statistics
import sys
import time

from bench import machine
from gds_persist.transfer.opened import open_file


def once(path: str, cold: bool) -> float:
    if cold:
        machine.drop_page_cache([path], "per-file")
        time.sleep(0.5)
    t0 = time.perf_counter()
    ck = open_file(path)
    seconds = time.perf_counter() - t0
    getattr(ck, "check_layout", lambda: None)()
    ck.close()
    return seconds


def main(path: str, rounds: int) -> None:
    for cold in (True, False):
        times = [once(path, cold) for _ in range(rounds)]
        print(f"{'cold' if cold else 'warm'}: open {statistics.median(times) * 1e3:.1f} ms "
              f"(median of {rounds}; {', '.join(f'{t * 1e3:.1f}' for t in times)})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

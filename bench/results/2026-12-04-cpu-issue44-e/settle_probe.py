"""torch.load of one 1 GiB file, four in a row, with no pause and with a 3 s pause before each
(its page cache dropped first every time), twice each way.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/settle_probe.py FILE
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from bench import machine


def main() -> None:
    pt = sys.argv[1]
    for settle in (0, 3, 0, 3):
        ts = []
        for _ in range(4):
            gc.collect()
            machine.drop_page_cache([pt], "per-file")
            time.sleep(settle)
            t = time.perf_counter()
            x = torch.load(pt, weights_only=True)
            ts.append(time.perf_counter() - t)
            del x
        print("settle", settle, " ".join(f"{t:.2f}" for t in ts))


if __name__ == "__main__":
    main()

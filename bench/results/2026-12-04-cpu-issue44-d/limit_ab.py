"""The save with each layout against the aligned writer, rotated per round, in one process.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-d/limit_ab.py DIR ROUNDS

``bench/bench_limit.py``'s aligned writer and ``gds_persist.save`` of the same 1 GiB state
(``bench/state.py``, seed 0, as ``bench_limit`` saves it), the save once with the committed
layout (``phased``: large host tensors at their memory's phase) and once with every extent at
a block boundary (``aligned``, so O_DIRECT on a 512-byte filesystem stages every byte). Prints
each time and, per arm, the median over rounds of save time / aligned-writer time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import gds_persist
from bench.bench_limit import AlignedLimit
from bench.state import iter_tensors, make_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_ab import patched  # noqa: E402


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    sd = make_state_dict(1 << 30, seed=0)
    limit = AlignedLimit(work, [t for _, t in iter_tensors(sd)], 4)
    target = os.path.join(work, "ck")

    def run(arm: str) -> float:
        os.sync()
        if arm == "limit":
            s = limit.write().seconds
            limit.cleanup()
            return s
        patched(arm)
        t0 = time.perf_counter()
        gds_persist.save(sd, target)
        s = time.perf_counter() - t0
        shutil.rmtree(target)
        return s

    arms = ("limit", "phased", "aligned")
    for arm in arms:  # warm-up, not kept
        run(arm)
    got: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        order = arms[r % 3:] + arms[: r % 3]
        for arm in order:
            got[arm].append(run(arm))
        print(f"round {r} ({' '.join(order)}): " + "  ".join(
            f"{a} {limit.nbytes / got[a][-1] / 1e9:.2f} GB/s" for a in arms), flush=True)
    for arm in arms[1:]:
        ratios = [lim / s for lim, s in zip(got["limit"], got[arm], strict=True)]
        print(f"{arm}: save / limit per round " + ", ".join(f"{x:.2f}" for x in ratios)
              + f" (median {statistics.median(ratios):.2f})")
    limit.close()


if __name__ == "__main__":
    main()

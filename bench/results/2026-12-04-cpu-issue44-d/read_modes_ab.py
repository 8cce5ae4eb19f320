"""Loads of one gds_persist torch file with each backend, rotated per round, against torch.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-d/read_modes_ab.py DIR ROUNDS

A 1 GiB GPT-like state saved once with ``save(format="torch")``; every load reads that same
file, evicted first (posix_fadvise DONTNEED). ``into``: restore into live tensors (touched,
allocated after other frees, so O_DIRECT at 512 bytes reaches few of them) with ``backend=``
auto, direct, buffered, against ``torch.load(mmap=True)`` + copy. ``plain``: the same backends
against ``torch.load``. Prints each round and, per arm, the median time and the median over
rounds of torch's time / the arm's (> 1: faster than torch).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

import gds_persist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_ab import copy_into, evict, fresh_state  # noqa: E402

ARMS = ("auto", "direct", "buffered", "torch")


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    pt = os.path.join(work, "gds.pt")
    gds_persist.save(fresh_state(), pt, format="torch")
    os.sync()
    gc.collect()
    live = {k: torch.empty_like(t).fill_(0)
            for k, t in torch.load(pt, weights_only=True, mmap=True).items()}
    gc.collect()

    def run(kind: str, arm: str) -> float:
        evict([pt])
        gc.collect()
        t0 = time.perf_counter()
        if arm == "torch" and kind == "into":
            copy_into(live, torch.load(pt, weights_only=True, mmap=True))
        elif arm == "torch":
            torch.load(pt, weights_only=True)
        else:
            gds_persist.load(pt, into=live if kind == "into" else None, backend=arm)
        return time.perf_counter() - t0

    for kind in ("into", "plain"):
        got: dict[str, list[float]] = {a: [] for a in ARMS}
        for r in range(rounds):
            order = ARMS[r % 4:] + ARMS[: r % 4]
            for arm in order:
                got[arm].append(run(kind, arm))
            print(f"{kind} round {r} ({' '.join(order)}): " + "  ".join(
                f"{a} {got[a][-1]:.3f}" for a in ARMS), flush=True)
        for arm in ARMS[:-1]:
            speed = [t / s for s, t in zip(got[arm], got["torch"], strict=True)]
            print(f"{kind} {arm:8s} median {statistics.median(got[arm]):.3f} s; torch's time / "
                  f"its, median {statistics.median(speed):.2f}x (faster in "
                  f"{sum(x > 1 for x in speed)} of {len(speed)})")
        print(f"{kind} torch    median {statistics.median(got['torch']):.3f} s", flush=True)


if __name__ == "__main__":
    main()

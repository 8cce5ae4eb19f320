"""The bounce-buffer read trial against the library as it is, cold disk, one process.

Needs ``bounce_trial.patch`` (here) applied: it adds ``adaptive.BOUNCE``, which this script
switches per load (off: the library as it is). Each round runs, in order (reversed every other
round): load(into=) off / on, torch.load(mmap=True) + copy_ into the same live tensors, plain
load off / on, torch.load; every checkpoint file is evicted from the page cache first
(posix_fadvise DONTNEED). Prints medians and the per-round ratios.

    git apply bench/results/2026-12-04-cpu-issue44-c/bounce_trial.patch
    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-c/bounce_ab.py bench/out 6
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch

import gds_persist
from bench.state import iter_tensors, make_state_dict
from gds_persist.backends import adaptive

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "2026-12-04-cpu-issue44-loads"))
from paired_loads import evict  # noqa: E402  (the same eviction as the paired loads)


def main(directory: str, rounds: int) -> None:
    sd = {k: v for k, v in iter_tensors(make_state_dict(1 << 30, seed=0)) if "lm_head" not in k}
    ck, pt = os.path.join(directory, "abck"), os.path.join(directory, "ab.pt")
    shutil.rmtree(ck, ignore_errors=True)
    gds_persist.save(sd, ck)
    torch.save(sd, pt)
    os.sync()
    live = {k: v.clone() for k, v in sd.items()}

    def timed(path: str, load: Callable[[], object]) -> float:
        evict([path])
        t0 = time.perf_counter()
        kept = [load()]  # freed after the clock stops
        seconds = time.perf_counter() - t0
        kept.clear()
        gc.collect()
        return seconds

    def gds(into: bool, bounce: bool) -> float:
        adaptive.BOUNCE = bounce  # type: ignore[attr-defined]
        return timed(ck, lambda: gds_persist.load(ck, into=live if into else None))

    def mmap_copy() -> object:
        loaded = torch.load(pt, mmap=True, weights_only=True)
        for k, v in loaded.items():
            live[k].copy_(v)
        return loaded

    tests: dict[str, Callable[[], float]] = {
        "into old": lambda: gds(True, False), "into new": lambda: gds(True, True),
        "mmap+copy": lambda: timed(pt, mmap_copy),
        "plain old": lambda: gds(False, False), "plain new": lambda: gds(False, True),
        "torch.load": lambda: timed(pt, lambda: torch.load(pt, weights_only=True))}
    for fn in tests.values():  # warm-up, not kept
        fn()
    res: dict[str, list[float]] = {k: [] for k in tests}
    for r in range(rounds):
        for k in (list(tests) if r % 2 == 0 else list(tests)[::-1]):
            res[k].append(tests[k]())
    for k, v in res.items():
        print(f"{k:11} median {statistics.median(v):.3f} s")
    for a, b in (("into new", "into old"), ("into new", "mmap+copy"), ("into old", "mmap+copy"),
                 ("plain new", "plain old"), ("plain new", "torch.load"),
                 ("plain old", "torch.load")):
        ratios = [y / x for x, y in zip(res[a], res[b], strict=True)]
        print(f"{a} vs {b} ({b} time / {a} time): {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")
    shutil.rmtree(ck)
    os.unlink(pt)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

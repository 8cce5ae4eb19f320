"""A load of a torch.save file with its pickle run once (before the read) against twice (the
weights-only check, then the rebuild after the read), in shuffled rounds beside the directory
format and ``torch.load(mmap=True)`` + copy (bench/bench_loads.py's rounds).

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/one_unpickle_ab.py DIR ROUNDS SETTLE
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

import gds_persist
from bench import bench_loads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import prepared  # noqa: E402

from gds_persist.loading import single_file

_once = single_file.unpickles_before_reading


def main() -> None:
    work, rounds, settle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    state, paths, live = prepared(work)

    def pt(once: bool, into: bool) -> Callable[[], Any]:
        def go() -> None:
            single_file.unpickles_before_reading = _once if once else (lambda *a: False)
            try:
                gds_persist.load(paths["pt"], into=live if into else None)
            finally:
                single_file.unpickles_before_reading = _once
        return go

    arms: dict[str, Callable[[], Any]] = {
        "pt into once": pt(True, True), "pt into twice": pt(False, True),
        "pt load once": pt(True, False), "pt load twice": pt(False, False),
        "dir into": lambda: gds_persist.load(paths["dir"], into=live),
        "pt mmap+copy": lambda: bench_loads.copy_into(
            live, torch.load(paths["pt"], weights_only=True, mmap=True)),
    }
    times, _ = bench_loads.run_rounds(arms, paths, rounds, "per-file", settle)
    for a, b in (("pt into once", "pt into twice"), ("pt load once", "pt load twice"),
                 ("pt into once", "pt mmap+copy"), ("pt into twice", "pt mmap+copy")):
        r = bench_loads.ratios(times, a, b)
        print(f"{b} / {a}: median {statistics.median(r):.3f} (> 1 in {sum(x > 1 for x in r)} "
              f"of {len(r)}); medians {statistics.median(times[a]):.3f} s, "
              f"{statistics.median(times[b]):.3f} s")


if __name__ == "__main__":
    main()

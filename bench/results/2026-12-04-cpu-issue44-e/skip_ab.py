"""A restore in place of one gds torch.save file with extents up to 64 KiB apart read in shared
requests (``reader.SKIP_BYTES``, the bytes between them skipped) against one request set per
extent (0), beside the directory format; shuffled rounds (bench/bench_loads.py's), no pause.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/skip_ab.py DIR ROUNDS
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import gds_persist
from bench import bench_loads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import prepared  # noqa: E402

from gds_persist.transfer import reader


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    state, paths, live = prepared(work)

    skip = reader.SKIP_BYTES

    def arm(path: str, shared: bool) -> Callable[[], Any]:
        def go() -> None:
            reader.SKIP_BYTES = skip if shared else 0
            try:
                gds_persist.load(path, into=live)
            finally:
                reader.SKIP_BYTES = skip
        return go

    arms = {"pt apart": arm(paths["pt"], False), "pt shared": arm(paths["pt"], True),
            "dir apart": arm(paths["dir"], False), "dir shared": arm(paths["dir"], True)}
    times, _ = bench_loads.run_rounds(arms, paths, rounds, "per-file", 0.0)
    for f in ("pt", "dir"):
        r = bench_loads.ratios(times, f"{f} shared", f"{f} apart")
        print(f"{f}: apart / shared median {statistics.median(r):.2f} (> 1 in "
              f"{sum(x > 1 for x in r)} of {len(r)}); medians "
              f"{statistics.median(times[f + ' shared']):.3f} s shared, "
              f"{statistics.median(times[f + ' apart']):.3f} s apart")


if __name__ == "__main__":
    main()

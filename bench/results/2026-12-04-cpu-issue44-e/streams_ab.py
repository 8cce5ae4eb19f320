"""A restore in place of one torch.save file with its long requests issued as the reader does
(by offset) against interleaved from ``io_threads`` contiguous parts of the file (each thread
then tends to read one region, as the directory format's one file per thread), beside the
directory format; shuffled rounds (bench/bench_loads.py's), no pause.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/streams_ab.py DIR ROUNDS
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

from gds_persist.transfer import pipeline, reader, segments

_by_offset = reader.short_first


def _in_parts(requests: Any, segment: Callable[[Any], Any]) -> list[Any]:
    ordered = _by_offset(requests, segment)
    short = [r for r in ordered if segment(r).nbytes < segments.SHORT_BYTES]
    long = [r for r in ordered if segment(r).nbytes >= segments.SHORT_BYTES]
    parts = gds_persist.settings.current().io_threads
    per = -(-len(long) // parts)
    return short + pipeline.interleave(long[k : k + per] for k in range(0, len(long), per))


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    state, paths, live = prepared(work)

    def arm(path: str, parts: bool) -> Callable[[], Any]:
        def go() -> None:
            reader.short_first = _in_parts if parts else _by_offset
            try:
                gds_persist.load(path, into=live)
            finally:
                reader.short_first = _by_offset
        return go

    arms = {"pt by-offset": arm(paths["pt"], False), "pt in-parts": arm(paths["pt"], True),
            "dir by-offset": arm(paths["dir"], False), "dir in-parts": arm(paths["dir"], True)}
    times, _ = bench_loads.run_rounds(arms, paths, rounds, "per-file", 0.0)
    for f in ("pt", "dir"):
        r = bench_loads.ratios(times, f"{f} in-parts", f"{f} by-offset")
        print(f"{f}: by-offset / in-parts median {statistics.median(r):.2f} (> 1 in "
              f"{sum(x > 1 for x in r)} of {len(r)}); medians "
              f"{statistics.median(times[f + ' in-parts']):.3f} s in parts, "
              f"{statistics.median(times[f + ' by-offset']):.3f} s by offset")


if __name__ == "__main__":
    main()

"""Opening a torch.save file cold: its local headers (one per record) read on threads against
one after the other, and whole restores in place with each, in shuffled rounds.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/header_reads_ab.py DIR ROUNDS

One 1 GiB gds torch file (``save(format="torch")``, 560 storages) and a stock torch.save file of
the same state; each arm drops the file's page cache first, then ``open_file`` (the index and
manifest, no data) or ``load(into=)``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

import gds_persist
from bench import bench_loads
from gds_persist.transfer import opened

_threaded = opened._pread_many


def _one_by_one(fd: int, offsets: Sequence[int], n: int) -> list[bytes]:
    return [os.pread(fd, n, at) for at in offsets]


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    state = bench_loads.flat_state(1 << 30)
    paths = {"pt": os.path.join(work, "gds.pt"), "stock": os.path.join(work, "stock.pt")}
    gds_persist.save(state, paths["pt"], format="torch")
    torch.save(state, paths["stock"])
    live = {k: torch.zeros_like(t) for k, t in state.items()}

    def arm(path: str, threaded: bool, into: bool) -> Callable[[], Any]:
        def go() -> None:
            opened._pread_many = _threaded if threaded else _one_by_one
            try:
                if into:
                    gds_persist.load(path, into=live)
                else:
                    opened.open_file(path).close()
            finally:
                opened._pread_many = _threaded
        return go

    arms = {f"{f} {what} {how}": arm(paths[f], how == "threads", what == "into")
            for f in paths for what in ("open", "into") for how in ("threads", "serial")}
    times, _ = bench_loads.run_rounds(arms, paths, rounds, "per-file", 0.0)
    for f in paths:
        for what in ("open", "into"):
            a, b = f"{f} {what} threads", f"{f} {what} serial"
            r = bench_loads.ratios(times, a, b)
            print(f"{f} {what}: serial / threads median {statistics.median(r):.2f} (> 1 in "
                  f"{sum(x > 1 for x in r)} of {len(r)}); medians {statistics.median(times[a]):.3f}"
                  f" s threads, {statistics.median(times[b]):.3f} s serial")


if __name__ == "__main__":
    main()

"""Restore in place of one directory checkpoint: the default beside variants, and the bound.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/into_variants.py DIR ROUNDS

Each file evicted before each arm, no pause (bench/bench_loads.py's ``run_rounds``; the
recorded output ran with its first form, e948c5e, whose arms were rotated, not shuffled): the
aligned reader of the checkpoint's files (``bound``), ``load(into=)`` as users call it
(``auto``), with ``backend=`` direct and buffered, with 8 I/O threads, with a 256 MiB staging
ring, without checksums, and ``torch.load(mmap=True)`` + copy of the same state saved as a
gds torch file.
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


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    state, paths, live = prepared(work)
    s = gds_persist.settings.current()
    reader = bench_loads.AlignedReader(s.io_threads, s.block_bytes, True)
    ck = paths["dir"]

    def into(verify: bool = True, backend: str | None = None, **kw: Any) -> Callable[[], Any]:
        def go() -> None:
            with gds_persist.settings.set(**kw):
                gds_persist.load(ck, into=live, backend=backend, verify=verify)
        return go

    arms: dict[str, Callable[[], Any]] = {
        "dir bound": lambda: reader.read(bench_loads.files_under(ck)),
        "dir auto": into(),
        "dir direct": into(backend="direct"),
        "dir buffered": into(backend="buffered"),
        "dir threads8": into(io_threads=8),
        "dir ring256": into(staging_bytes=256 << 20),
        "dir noverify": into(verify=False),
        "pt mmap+copy": lambda: bench_loads.copy_into(
            live, torch.load(paths["pt"], weights_only=True, mmap=True)),
    }
    times, _ = bench_loads.run_rounds(arms, paths, rounds, "per-file", settle_s=0.0)
    for n, secs in times.items():
        near = statistics.median(bench_loads.ratios(times, n, "dir bound"))
        mm = statistics.median(bench_loads.ratios(times, n, "pt mmap+copy"))
        print(f"{n:14s} median {statistics.median(secs):.3f} s; bound's time / its {near:.2f}; "
              f"mmap+copy's time / its {mm:.2f}")


if __name__ == "__main__":
    main()

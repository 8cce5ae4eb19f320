"""Loads of a stock torch.save file (records 64-byte aligned, not 4096) with the reader's direct
interior against the reader that stages every extent off a block boundary, rotated per round.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-d/foreign_ab.py DIR ROUNDS

Arms: ``interior`` (the committed reader: an extent's aligned interior read straight into its
destination where the memory there meets the backend's alignment), ``staged`` (the reader
before: extents off a block boundary staged whole), ``torch`` (``torch.load``). The file is
evicted before every load (posix_fadvise DONTNEED). Prints each time and the median over rounds
of each arm's time / torch.load's.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

import gds_persist
from gds_persist.format import ALIGNMENT
from gds_persist.transfer import reader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_ab import evict, fresh_state  # noqa: E402

COMMITTED_CUT = reader.cut


def staged_off_block(extents: Any, spans: Any, block_bytes: int, direct_bytes: Any = None) -> Any:
    """The cut as it was: only extents at a block boundary may move directly."""
    def aligned_only(e: Any) -> int:
        return 0 if e.offset % ALIGNMENT or direct_bytes is None else direct_bytes(e)
    return COMMITTED_CUT(extents, spans, block_bytes, aligned_only)


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "stock.pt")
    torch.save(fresh_state(), path)
    os.sync()

    def run(arm: str) -> float:
        reader.cut = staged_off_block if arm == "staged" else COMMITTED_CUT  # type: ignore
        evict([path])
        gc.collect()
        t0 = time.perf_counter()
        if arm == "torch":
            torch.load(path, weights_only=True)
        else:
            gds_persist.load(path)
        return time.perf_counter() - t0

    arms = ("interior", "staged", "torch")
    got: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        order = arms[r % 3:] + arms[: r % 3]
        for arm in order:
            got[arm].append(run(arm))
        print(f"round {r} ({' '.join(order)}): " + "  ".join(
            f"{a} {got[a][-1]:.3f} s" for a in arms), flush=True)
    for arm in arms[:2]:
        ratios = [t / b for t, b in zip(got[arm], got["torch"], strict=True)]
        print(f"{arm}: time / torch.load's per round " + ", ".join(f"{x:.2f}" for x in ratios)
              + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()

"""The dropped trial: live destinations that O_DIRECT cannot reach read buffered, in place.

Needs ``unreachable_buffered_trial.patch`` applied (it adds ``direct_alignment`` to the auto
backend). Restores a 1 GiB GPT-like state into fresh tensors (about half at another phase than
the saved ones), cold, ABBA over: the rule on, the rule off (staged through O_DIRECT), and
``torch.load(mmap=True)`` + copy.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-d/unreachable_ab.py DIR PAIRS
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch

import gds_persist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_ab import copy_into, evict, fresh_state  # noqa: E402

from gds_persist.backends import adaptive


def main() -> None:
    d, pairs = sys.argv[1], int(sys.argv[2])
    flat = fresh_state()
    shutil.rmtree(d, ignore_errors=True)
    gds_persist.save(flat, d)
    tp = d + ".pt"
    torch.save(flat, tp)
    os.sync()
    live = {k: torch.empty_like(t).fill_(0) for k, t in flat.items()}
    del flat
    gc.collect()
    original = adaptive.AdaptiveReadBackend.__init__

    def rule_off(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        self.host_alignment = self.direct_alignment

    def gds(rule: bool) -> float:
        adaptive.AdaptiveReadBackend.__init__ = original if rule else rule_off  # type: ignore
        evict([d])
        t0 = time.perf_counter()
        gds_persist.load(d, into=live)
        return time.perf_counter() - t0

    def mmap_copy() -> float:
        evict([tp])
        t0 = time.perf_counter()
        copy_into(live, torch.load(tp, weights_only=True, mmap=True))
        return time.perf_counter() - t0

    runs: dict[str, list[float]] = {"on": [], "off": [], "mm": []}
    arms = {"on": lambda: gds(True), "off": lambda: gds(False), "mm": mmap_copy}
    for p in range(pairs):
        order = list(arms) if p % 2 == 0 else list(reversed(arms))
        got = {name: arms[name]() for name in order}
        for name, t in got.items():
            runs[name].append(t)
        print(f"pair {p}: rule on {got['on']:.3f}  off {got['off']:.3f}  mmap+copy "
              f"{got['mm']:.3f}  on/off {got['off'] / got['on']:.2f}x  vs mm "
              f"{got['mm'] / got['on']:.2f}x", flush=True)
    print("median on", statistics.median(runs["on"]), "off", statistics.median(runs["off"]),
          "mm", statistics.median(runs["mm"]))
    print("speedup rule (off/on per pair) median",
          statistics.median([b / a for a, b in zip(runs["on"], runs["off"], strict=True)]))
    print("vs mmap+copy (mm/on per pair) median",
          statistics.median([b / a for a, b in zip(runs["on"], runs["mm"], strict=True)]))


if __name__ == "__main__":
    main()

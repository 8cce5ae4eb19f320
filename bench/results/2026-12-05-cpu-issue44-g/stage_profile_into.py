"""Stage profile of restores in place (``load(into=)``) of the directory and the torch.save
container of a 1 GiB GPT-like state, cold (page cache dropped, 3 s pause), shuffled, one untimed
round; the medians per stage.

    PYTHONPATH=TREE python bench/results/2026-12-05-cpu-issue44-g/stage_profile_into.py WORKDIR R
"""

from __future__ import annotations

import collections
import gc
import os
import random
import statistics
import sys
import time

import torch

import gds_persist
from bench import machine
from bench.bench_loads import flat_state, save_both
from gds_persist.stages import profiling


def main(workdir: str, rounds: int) -> None:
    paths = {"dir": os.path.join(workdir, "ck"), "pt": os.path.join(workdir, "gds.pt")}
    if not os.path.exists(paths["pt"]):
        os.makedirs(workdir, exist_ok=True)
        save_both(flat_state(1 << 30), workdir)
    live = {k: torch.zeros_like(t)
            for k, t in torch.load(paths["pt"], weights_only=True, mmap=True).items()}
    stages: dict[str, dict[str, list[tuple[float, float, int]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    walls: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(rounds + 1):
        for arm in random.sample(["dir", "pt"], 2):
            gc.collect()
            machine.drop_page_cache([paths[arm]], "per-file")
            time.sleep(3)
            with profiling() as prof:
                t0 = time.perf_counter()
                gds_persist.load(paths[arm], into=live)
                wall = time.perf_counter() - t0
            if not r:
                continue
            walls[arm].append(wall)
            for name, s in prof.stages.items():
                stages[arm][name].append((s.seconds, s.cpu_seconds, s.calls))
    for arm in ("dir", "pt"):
        print(f"into({arm}): wall median {statistics.median(walls[arm]):.3f} s "
              f"(rounds {', '.join(f'{w:.3f}' for w in walls[arm])})")
        for name, v in sorted(stages[arm].items(),
                              key=lambda kv: -statistics.median(x[0] for x in kv[1])):
            print(f"  {name:34} thread-s {statistics.median(x[0] for x in v):.4f}  "
                  f"cpu-s {statistics.median(x[1] for x in v):.4f}  "
                  f"calls {statistics.median(x[2] for x in v):.0f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Plain loads of one 1 GiB GPT-like state into fresh tensors: ``gds_persist.load`` of the
directory (``load(dir)``) and of the torch.save container (``load(pt)``) beside ``torch.load`` of
that container, in rounds; each arm after its file's page cache is dropped and a 3 s pause,
shuffled every round, one untimed round first. Prints each arm's times as JSON. Run by
``fresh_ab.sh`` in fresh processes, alternating two trees.

    PYTHONPATH=TREE python bench/results/2026-12-05-cpu-issue44-h/fresh_ab.py WORKDIR ROUNDS
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time

import torch

import gds_persist
from bench import machine
from bench.bench_loads import flat_state, save_both


def main(workdir: str, rounds: int) -> None:
    paths = {"dir": os.path.join(workdir, "ck"), "pt": os.path.join(workdir, "gds.pt")}
    if not os.path.exists(paths["pt"]):
        os.makedirs(workdir, exist_ok=True)
        save_both(flat_state(1 << 30), workdir)
    arms = {"load(dir)": lambda: gds_persist.load(paths["dir"]),
            "load(pt)": lambda: gds_persist.load(paths["pt"]),
            "torch.load": lambda: torch.load(paths["pt"], weights_only=True)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 1):
        for arm in random.sample(list(arms), len(arms)):
            gc.collect()
            machine.drop_page_cache([paths["dir" if "dir" in arm else "pt"]], "per-file")
            time.sleep(3)
            t0 = time.perf_counter()
            got = arms[arm]()
            if r:
                times[arm].append(time.perf_counter() - t0)
            del got
    print(json.dumps(times))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Loads of one 1 GiB GPT-like state, in rounds: restore in place of the directory (``into(dir)``)
and of the torch.save container (``into(pt)``), a plain load of each (``load(dir)``,
``load(pt)``), and ``torch.load(mmap=True)`` + copy (``mmap+copy``); each arm after its file's
page cache is dropped and a 3 s pause, shuffled every round, one untimed round first. Prints
each arm's times as JSON. Run by ``loads_ab.sh`` in fresh processes, alternating two trees.

    PYTHONPATH=TREE python bench/results/2026-12-05-cpu-issue44-g/loads_ab.py WORKDIR ROUNDS
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
    live = {k: torch.zeros_like(t)
            for k, t in torch.load(paths["pt"], weights_only=True, mmap=True).items()}

    def mmap_copy() -> None:
        got = torch.load(paths["pt"], weights_only=True, mmap=True)
        for k, t in live.items():
            t.copy_(got[k])

    arms = {"into(dir)": lambda: gds_persist.load(paths["dir"], into=live),
            "into(pt)": lambda: gds_persist.load(paths["pt"], into=live),
            "load(dir)": lambda: gds_persist.load(paths["dir"]),
            "load(pt)": lambda: gds_persist.load(paths["pt"]),
            "mmap+copy": mmap_copy}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 1):
        for arm in random.sample(list(arms), len(arms)):
            gc.collect()
            machine.drop_page_cache([paths["pt" if "pt" in arm or "mmap" in arm else "dir"]],
                                    "per-file")
            time.sleep(3)
            t0 = time.perf_counter()
            arms[arm]()
            if r:
                times[arm].append(time.perf_counter() - t0)
    print(json.dumps(times))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

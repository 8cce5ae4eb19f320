"""CPU seconds (user + system, getrusage) and wall time of plain loads of the 1 GiB state that
fresh_ab.py saved (``load(dir)``, ``load(pt)``), cold, ROUNDS each, shuffled, a 3 s pause first.
Run with PYTHONPATH=TREE to measure that tree; prints JSON.

    PYTHONPATH=TREE python bench/results/2026-12-05-cpu-issue44-h/load_cpu.py WORKDIR ROUNDS
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import sys
import time

import gds_persist
from bench import machine


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(workdir: str, rounds: int) -> None:
    paths = {"load(dir)": os.path.join(workdir, "ck"), "load(pt)": os.path.join(workdir, "gds.pt")}
    out: dict[str, dict[str, list[float]]] = {a: {"wall": [], "cpu": []} for a in paths}
    for arm in random.sample(list(paths) * rounds, len(paths) * rounds):
        gc.collect()
        machine.drop_page_cache([paths[arm]], "per-file")
        time.sleep(3)
        c0, t0 = cpu_seconds(), time.perf_counter()
        got = gds_persist.load(paths[arm])
        out[arm]["wall"].append(round(time.perf_counter() - t0, 3))
        out[arm]["cpu"].append(round(cpu_seconds() - c0, 3))
        del got
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

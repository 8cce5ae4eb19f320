"""How fine a per-repetition comparison of loads this machine can resolve (issue 26).

    python bench/read_mode_placebo.py [--size 2GiB] [--runs 8] [--dir DIR ...] [--json OUT]

Issue 26 asks that an ``auto`` load take at most 5% longer than the faster of a ``direct`` and
a ``buffered`` load in every repetition of ``make bench``. This measures what that comparison
resolves here: for each directory (default: bench/out on the disk and /dev/shm/bench) one
checkpoint of a GPT-like state (bench/state.py) is saved, then ``--runs`` times, in a shuffled
order, four cold plain loads of it: ``auto`` (as a user's load runs: the filesystem's history
kept), ``direct``, ``buffered`` and ``direct`` again, the **placebo**: the same method as one of
the two it is compared with. Per run it prints ``auto / min(direct, buffered)`` and
``placebo / min(direct, buffered)``; where the placebo exceeds 1.05 in some runs, a load that
reads exactly as the faster mode does would miss the target in those runs too: the target then
measures the machine's spread, not the load. The page cache is dropped before every load
(tmpfs pages cannot be dropped).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gds_persist  # noqa: E402
from bench import machine  # noqa: E402
from bench.bench_io import work_directory  # noqa: E402
from bench.read_mode_predictor import build_parser, run_dirs  # noqa: E402
from bench.state import make_state_dict  # noqa: E402

LOADS = ("auto", "direct", "buffered", "placebo")  # the placebo is a second direct load
TARGET = 1.05


def timed_load(path: str, load: str) -> float:
    machine.drop_page_cache([path])
    t0 = time.perf_counter()
    state = gds_persist.load(path, backend="direct" if load == "placebo" else load)
    seconds = time.perf_counter() - t0
    del state
    gc.collect()
    return seconds


def one_run(path: str, r: int) -> dict[str, Any]:
    order = list(LOADS)
    random.Random(r).shuffle(order)  # seeded: the same orders in every run of the script
    seconds = {load: timed_load(path, load) for load in order}
    faster = min(seconds["direct"], seconds["buffered"])
    run = {"order": order, "seconds": seconds, "auto_ratio": seconds["auto"] / faster,
           "placebo_ratio": seconds["placebo"] / faster}
    print(f"  {path} run {r + 1}: " + ", ".join(f"{k} {s:.2f}s" for k, s in seconds.items())
          + f"; auto {run['auto_ratio']:.3f}, placebo {run['placebo_ratio']:.3f}",
          file=sys.stderr, flush=True)
    return run


def measure_dir(directory: str, args: argparse.Namespace) -> dict[str, Any]:
    with work_directory(directory, "placebo-") as workdir:
        path = os.path.join(workdir, "ck")
        gds_persist.save(make_state_dict(args.size, seed=0), path)
        gc.collect()
        timed_load(path, "auto")  # untimed: the process's first large allocations
        runs = [one_run(path, r) for r in range(args.runs)]
    return {"directory": directory, "fstype": machine.mount_of(directory)["fstype"],
            "runs": runs}


def report_lines(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    lines = [f"{result['directory']} ({result['fstype']}), {len(runs)} runs, seconds:",
             f"  {'run':>3}  {'auto':>6}  {'direct':>6}  {'buffered':>8}  {'placebo':>7}  "
             f"{'auto / faster':>13}  {'placebo / faster':>16}"]
    for k, r in enumerate(runs, 1):
        s = r["seconds"]
        lines.append(f"  {k:>3}  {s['auto']:>6.2f}  {s['direct']:>6.2f}  {s['buffered']:>8.2f}  "
                     f"{s['placebo']:>7.2f}  {r['auto_ratio']:>13.3f}  {r['placebo_ratio']:>16.3f}")
    for name in ("auto", "placebo"):
        ratios = [r[f"{name}_ratio"] for r in runs]
        over = sum(x > TARGET for x in ratios)
        lines.append(f"  {name} / the faster of direct and buffered: median "
                     f"{statistics.median(ratios):.3f}, over {TARGET} in {over} of {len(runs)}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser("read_mode_placebo.py", __doc__, runs=8).parse_args(argv)
    return run_dirs(args, "read-mode placebo", measure_dir, report_lines)


if __name__ == "__main__":
    main()

"""Where a restore in place spends its time: variants of a buffered restore beside mmap + copy.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-e/restore_probe.py DIR ROUNDS

One 1 GiB gds torch file (``save(format="torch")``), evicted before every load; each arm
restores it into the same live tensors, arms rotated per round. Prints wall and CPU seconds
(user + system of this process) per arm, and medians.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

import gds_persist
from gds_persist.backends import posix

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "2026-12-04-cpu-issue44-d"))
from phase_ab import copy_into, evict, fresh_state  # noqa: E402

_random_advice = posix.open_buffered_for_reading


def _normal_advice(path: str) -> int:
    return os.open(path, os.O_RDONLY)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    work, rounds = sys.argv[1], int(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    pt = os.path.join(work, "gds.pt")
    gds_persist.save(fresh_state(), pt, format="torch")
    os.sync()
    gc.collect()
    live = {k: torch.empty_like(t).fill_(0)
            for k, t in torch.load(pt, weights_only=True, mmap=True).items()}
    gc.collect()

    def ours(verify: bool = True, threads: int | None = None, normal: bool = False,
             backend: str = "buffered") -> Callable[[], None]:
        def go() -> None:
            posix.open_buffered_for_reading = _normal_advice if normal else _random_advice
            kw = {} if threads is None else {"io_threads": threads}
            try:
                with gds_persist.settings.set(**kw):
                    gds_persist.load(pt, into=live, backend=backend, verify=verify)
            finally:
                posix.open_buffered_for_reading = _random_advice
        return go

    arms: dict[str, Callable[[], None]] = {
        "mmap+copy": lambda: copy_into(live, torch.load(pt, weights_only=True, mmap=True)),
        "buffered": ours(),
        "no-verify": ours(verify=False),
        "threads2": ours(threads=2),
        "threads8": ours(threads=8),
        "readahead": ours(normal=True),
        "auto": ours(backend="auto"),
    }
    only = os.environ.get("ARMS")
    names = only.split(",") if only else list(arms)
    wall: dict[str, list[float]] = {a: [] for a in names}
    cpu: dict[str, list[float]] = {a: [] for a in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for arm in order:
            evict([pt])
            gc.collect()
            c0, t0 = _cpu(), time.perf_counter()
            arms[arm]()
            wall[arm].append(time.perf_counter() - t0)
            cpu[arm].append(_cpu() - c0)
        print(f"round {r}: " + "  ".join(f"{a} {wall[a][-1]:.3f}/{cpu[a][-1]:.2f}"
                                         for a in names), flush=True)
    base = wall["mmap+copy"]
    for a in names:
        ratio = [b / w for b, w in zip(base, wall[a], strict=True)]
        print(f"{a:10s} wall median {statistics.median(wall[a]):.3f} s, CPU "
              f"{statistics.median(cpu[a]):.2f} s; mmap+copy's time / its "
              f"{statistics.median(ratio):.2f}x (faster in {sum(x > 1 for x in ratio)} of "
              f"{len(ratio)})")


if __name__ == "__main__":
    main()

"""What recording content hashes would cost every plain save (issue 19): host BLAKE3 of a state's
bytes against the durable save's own time, with and without ``content_hash=True``.

    python bench/bench_hash_cost.py [--size 1GiB] [--runs 3] [--dirs .bench-hash,/dev/shm/bh]
                                    [--json OUT]

A synthetic fp32 state of ``--size`` (tensors of 64 MiB) on the host; per run, interleaved, on
each of ``--dirs``: ``blake3 1 thread`` (the ``blake3`` binding, one call per tensor),
``blake3 AUTO threads`` (``max_threads=blake3.AUTO``: the binding's own thread pool),
``save`` (``gds_persist.save``, durable, the plain version 1-3 path) and ``save content_hash``
(``content_hash=True``: the version-4 unit path that hashes every 16 MiB unit on the I/O threads
and records the hashes). Medians and ranges; the hash-only rows do no I/O (timed once per run).
Every save includes fsync; checkpoints are removed after each run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TENSOR_BYTES = 64 << 20


def parse(argv: list[str] | None) -> argparse.Namespace:
    from bench.bench_io import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default="1GiB")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dirs", default=".bench-hash,/dev/shm/bench-hash",
                   help="comma-separated directories to save into (each emptied after a run)")
    p.add_argument("--json", default=None, metavar="FILE")
    return p.parse_args(argv)


def make_state(size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n, rest = divmod(size, TENSOR_BYTES)
    sizes = [TENSOR_BYTES] * n + ([rest] if rest else [])
    return {f"layer{i}.weight": torch.randn(b // 4, generator=g) for i, b in enumerate(sizes)}


def _timed(run: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _blake3(state: dict[str, Any], threads: int) -> None:
    import blake3

    for t in state.values():
        blake3.blake3(memoryview(t.numpy()).cast("B"), max_threads=threads).digest(16)


def one_run(state: dict[str, Any], dirs: list[str]) -> dict[str, float]:
    import blake3

    import gds_persist

    got = {"blake3 1 thread": _timed(lambda: _blake3(state, 1)),
           "blake3 AUTO threads": _timed(lambda: _blake3(state, blake3.blake3.AUTO))}
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        for label, hashes in (("save", None), ("save content_hash", True)):
            path = os.path.join(d, label.replace(" ", "-"))
            options = gds_persist.SaveOptions(content_hash=hashes)
            got[f"{d}: {label}"] = _timed(lambda p=path, o=options: gds_persist.save(state, p,
                                                                                     options=o))
            shutil.rmtree(path)
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.report import to_json

    args = parse(argv)
    dirs = [d for d in args.dirs.split(",") if d]
    state = make_state(args.size)
    runs = [one_run(state, dirs) for _ in range(args.runs)]
    record: dict[str, Any] = {"size": args.size, "runs": runs, "medians": {}}
    print(f"bench_hash_cost: {args.size / 2**30:.2f} GiB fp32 state, {args.runs} runs, "
          f"{os.cpu_count()} CPUs; seconds (median [min-max]) and GB/s of the state's bytes")
    for key in runs[0]:
        values = [r[key] for r in runs]
        med = record["medians"][key] = statistics.median(values)
        print(f"  {key:<48} {med:7.3f} s [{min(values):.3f}-{max(values):.3f}] "
              f"{args.size / med / 1e9:6.2f} GB/s")
    for d in dirs:
        extra = [r[f"{d}: save content_hash"] / r[f"{d}: save"] for r in runs]
        record["medians"][f"{d}: content_hash / plain"] = statistics.median(extra)
        print(f"  {d}: save content_hash / save, paired per run: median "
              f"{statistics.median(extra):.2f} [{min(extra):.2f}-{max(extra):.2f}]")
    if args.json:
        to_json(record, args.json)
    return record


if __name__ == "__main__":
    main()

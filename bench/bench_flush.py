"""The flush (gds_persist/training/tier/flush.py) against a save of the live state, to the same
durable directory: what writing the durable level from a verified local copy costs.

One process (no process group): the state's share (the whole state) is committed once in a
node-local level on tmpfs; then, in interleaved pairs (ABAB, their order alternating), A =
``flush_step`` of that share (each extent's CRC32C checked against the manifest, then the file
copied through the engine's writer, fsync and commit included) and B = ``gds_persist.save`` of
the state itself (fsync and commit included), each to a fresh step directory of ``--dest``.
Prints and writes (``--out``) every pair and the medians.

    python -m bench.bench_flush --mib 256 --pairs 5 --dest bench/out/flush --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import gds_persist
from gds_persist.parallel.distributed import SoloComm
from gds_persist.state.flatten import flatten
from gds_persist.training.tier import flush, shares


def _state(mib: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn((mib << 20) // 4 - 4096, generator=g)
    return {"w": big, "small": {str(i): torch.randn(1024, generator=g) for i in range(16)}}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dest", required=True, help="the durable directory (disk or tmpfs)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    state = _state(args.mib)
    flat = flatten(state)
    level = tempfile.mkdtemp(prefix="gds_persist-bench-flush-", dir="/dev/shm")
    share = os.path.join(level, "rank-00000", "step-00000001")
    plan = shares.plan_shares([s.nbytes for s in flat.storages], ["bench"])
    shares.save_share(SoloComm(), share, flat, plan, None, 1)
    os.makedirs(args.dest, exist_ok=True)
    pairs = []
    try:
        for i in range(args.pairs):
            target = os.path.join(args.dest, f"step-{i:08d}")
            runs = {"flush": lambda t=target: flush.flush_step(SoloComm(), [share], t + "-f", 1),
                    "save": lambda t=target: gds_persist.save(state, t + "-s")}
            order = ["flush", "save"] if i % 2 == 0 else ["save", "flush"]
            got = {name: _timed(runs[name]) for name in order}
            for suffix in ("-f", "-s"):
                shutil.rmtree(target + suffix)
            pairs.append({"order": order, **got, "ratio": got["flush"] / got["save"]})
            print(f"pair {i}: flush {got['flush']:.3f} s, save {got['save']:.3f} s, "
                  f"flush/save {got['flush'] / got['save']:.2f}", flush=True)
    finally:
        shutil.rmtree(level, ignore_errors=True)
    nbytes = sum(s.nbytes for s in flat.storages)
    summary = {"dest": os.path.abspath(args.dest), "bytes": nbytes, "pairs": pairs,
               "median_flush_s": statistics.median(p["flush"] for p in pairs),
               "median_save_s": statistics.median(p["save"] for p in pairs),
               "median_ratio": statistics.median(p["ratio"] for p in pairs)}
    print(f"median: flush {summary['median_flush_s']:.3f} s "
          f"({nbytes / summary['median_flush_s'] / 1e9:.2f} GB/s), save "
          f"{summary['median_save_s']:.3f} s, flush/save {summary['median_ratio']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

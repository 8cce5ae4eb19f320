"""Where a gds_persist save and load spend their time: the stage profile of one state dict
(save, cold load of fresh tensors, cold restore in place into live ones: ``load(into=)``).

    python bench/profile_stages.py [--size 2GiB] [--dir DIR] [--device cpu|cuda] [--runs 3]
                                   [--backend direct] [--io-threads N] [--json OUT]

Saves and (cold) loads the benchmark's GPT-style state dict ``--runs`` times with
:func:`gds_persist.stages.profiling` on, and prints for each operation its wall time and rate and,
per stage (flatten, copy into staging or D2H, checksum, write/read syscalls, fsync, commit,
destination allocation, ...): the thread-seconds (wall) and CPU seconds spent in it, the share of
the wall time, the bytes it moved, the threads that ran it, the bound it implies (its CPU time
spread over the cores its threads could use, or its wall time over its threads, whichever is
longer) and the minor page faults taken inside it. Stages run concurrently, so their seconds may
add up to more than the wall time; the bulk stage with the lowest bound limits the operation.
The figures of the median run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

import gds_persist  # noqa: E402
from bench import machine  # noqa: E402
from bench.bench_io import parse_size  # noqa: E402
from bench.state import make_state_dict, summarize  # noqa: E402
from gds_persist.stages import StageProfile, profiling  # noqa: E402

OPS = ("save", "load", "load into")  # "load into": load(into=) of live tensors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="profile_stages.py",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"),
                   help="state dict size (default 2GiB)")
    p.add_argument("--dir", default=None,
                   help="directory on the drive under test, e.g. /dev/shm/x for RAM (default "
                        "bench/out/ in the repository)")
    p.add_argument("--device", default="cpu", help="where the state dict lives: cpu or cuda")
    p.add_argument("--runs", type=int, default=3, help="save+load repetitions (default 3)")
    p.add_argument("--backend", default=None, help="gds_persist backend (default: the setting)")
    p.add_argument("--io-threads", type=int, default=None, help="io_threads (default: setting)")
    p.add_argument("--block-bytes", type=parse_size, default=None, help="block_bytes")
    p.add_argument("--staging-bytes", type=parse_size, default=None, help="staging_bytes")
    p.add_argument("--cache-drop", choices=machine.CACHE_MODES, default="auto",
                   help="how the page cache is emptied before each load (see bench_io.py)")
    p.add_argument("--json", dest="json_out", default=None, help="write the profile here")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    given = {"backend": args.backend, "io_threads": args.io_threads,
             "block_bytes": args.block_bytes, "staging_bytes": args.staging_bytes}
    return {k: v for k, v in given.items() if v is not None}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile_once(state: Any, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One profiled save and one profiled cold load; returns both profiles and wall times."""
    out: dict[str, Any] = {}
    _sync(args.device)
    with profiling() as prof:
        t0 = time.perf_counter()
        info = gds_persist.save(state, path)
        out["save"] = (time.perf_counter() - t0, prof, info.backend, info.reason)
    machine.drop_page_cache([path], args.cache_drop)
    with profiling() as prof:
        t0 = time.perf_counter()
        loaded = gds_persist.load(path)
        _sync(args.device)
        out["load"] = (time.perf_counter() - t0, prof, None, None)
    del loaded
    live = tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t,
                    state)  # a live state of other values, its memory touched
    machine.drop_page_cache([path], args.cache_drop)
    with profiling() as prof:
        t0 = time.perf_counter()
        gds_persist.load(path, into=live)
        _sync(args.device)
        out["load into"] = (time.perf_counter() - t0, prof, None, None)
    del live
    shutil.rmtree(path)
    return out


def _rows(profiles: list[StageProfile], walls: list[float], cores: int) -> list[dict[str, Any]]:
    names = list(dict.fromkeys(n for p in profiles for n in p.stages))
    wall = statistics.median(walls)
    rows = []
    for name in names:
        runs = [p.stages[name] for p in profiles if name in p.stages]
        pick = sorted(runs, key=lambda t: t.seconds)[len(runs) // 2]  # the median run's totals
        rows.append({
            "stage": name, "thread_s": pick.seconds, "cpu_s": pick.cpu_seconds,
            "share": pick.seconds / wall if wall else 0.0, "bytes": pick.nbytes,
            "threads": len(pick.threads), "bound_gbps": pick.bound_gbps(cores),
            "calls": pick.calls, "faults": pick.faults,
        })
    rows.sort(key=lambda r: -r["thread_s"])
    return rows


def report_lines(op: str, walls: list[float], nbytes: int, rows: list[dict[str, Any]],
                 note: str) -> list[str]:
    wall = statistics.median(walls)
    lines = [f"{op}: {wall:.3f} s median wall ({nbytes / wall / 1e9:.2f} GB/s of payload; "
             f"runs {', '.join(f'{w:.3f}' for w in walls)}){note}",
             f"  {'stage':34s} {'thread-s':>9s} {'cpu-s':>7s} {'% wall':>7s} {'MiB':>8s} "
             f"{'threads':>7s} {'bound GB/s':>10s} {'calls':>6s} {'faults':>8s}"]
    for r in rows:
        bound = f"{r['bound_gbps']:.2f}" if r["bytes"] else "-"
        lines.append(f"  {r['stage']:34s} {r['thread_s']:9.3f} {r['cpu_s']:7.3f} "
                     f"{100 * r['share']:6.1f}% {r['bytes'] / 2**20:8.1f} {r['threads']:7d} "
                     f"{bound:>10s} {r['calls']:6d} {r['faults']:8d}")
    limited = [r for r in rows if r["bound_gbps"] and r["bytes"] >= nbytes / 10]  # bulk stages
    if limited:
        worst = min(limited, key=lambda r: r["bound_gbps"])
        lines.append(f"  lowest bound: {worst['stage']} ({worst['bound_gbps']:.2f} GB/s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parent = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="profile-", dir=parent)
    cores = len(os.sched_getaffinity(0))
    record: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()},
                              "machine": machine.describe(workdir), "cores": cores}
    try:
        with gds_persist.settings.set(**_settings(args)):
            state = make_state_dict(args.size, device=args.device)
            nbytes = summarize(state).payload_bytes
            runs = [profile_once(state, os.path.join(workdir, "ckpt"), args)
                    for _ in range(args.runs)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    fstype = record["machine"]["filesystem"]["fstype"]
    print(f"gds_persist stage profile: {nbytes / 2**30:.2f} GiB on {args.device}, "
          f"{args.runs} run(s), {cores} cores, directory {parent} ({fstype}), "
          f"settings {gds_persist.settings.current()}")
    for op in OPS:
        walls = [r[op][0] for r in runs]
        rows = _rows([r[op][1] for r in runs], walls, cores)
        note = f"; backend {runs[0][op][2]}: {runs[0][op][3]}" if runs[0][op][2] else ""
        print("\n".join(report_lines(op, walls, nbytes, rows, note)))
        record[op] = {"walls": walls, "payload_bytes": nbytes, "stages": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"JSON written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

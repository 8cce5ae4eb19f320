"""Data-parallel checkpoint benchmark: N local ranks (gloo) save one replicated state together.

    python bench/bench_parallel.py                      # 1, 2 and 4 ranks, 1 GiB checkpoint
    python bench/bench_parallel.py --size 4GiB --ranks 1,2,4,8 --runs 5 --json out.json

For each rank count N it reports, against the drive's limit measured in the same run:

* save: aggregate GB/s (checkpoint bytes / time until the last rank returned, commit included,
  everything fsynced) and each rank's own write GB/s (its bytes / its write phase);
* load: aggregate GB/s of every load strategy (``allgather`` and ``broadcast``: replicated data
  read once in total and shared over the group; ``read_all``: every rank reads everything), the
  bytes actually read by all ranks together, and the page cache dropped first where we are root.

The drive limit comes from the main benchmark's probe (``bench/drive.py``): fio when installed,
else a plain aligned O_DIRECT stream from Python, labelled as such. Figures are medians of
``--runs`` with min-max; runs are interleaved across strategies. One spawn of ``max(ranks)``
processes serves every N (subgroups), so the run is short.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository, for ``import gds_persist``
sys.path.insert(1, HERE)  # for ``import drive`` (the main benchmark's drive probe), if present

STRATEGIES = ("allgather", "broadcast", "read_all")


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    t = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * units[unit])
    return int(float(t))


# --- the state ------------------------------------------------------------------------------

def make_state(nbytes: int) -> dict[str, Any]:
    """A GPT-like mixed-precision Adam state of about ``nbytes``, identical in every process
    (a fixed byte pattern: no time spent generating random numbers)."""
    import torch

    from gds_persist.advice.scale import bytes_split, gpt_param_numels, gpt_shape

    params = max(nbytes / 14, 2e5)
    layers, hidden = gpt_shape(params, vocab=8192, seq=1024)
    layers = max(2, min(layers, 12))
    numels = gpt_param_numels(layers, hidden, vocab=8192, seq=1024)
    scale = params / sum(n for _, n in numels)
    pattern = torch.arange(1 << 20, dtype=torch.int64).mul_(2654435761).remainder_(251)
    pattern = pattern.to(torch.uint8)

    def filled(numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        raw = t.view(torch.uint8)
        for lo in range(0, raw.numel(), pattern.numel()):
            n = min(pattern.numel(), raw.numel() - lo)
            raw[lo : lo + n] = pattern[:n]
        return t

    _, states = bytes_split(14)
    model, optimizer = {}, {"state": {}, "param_groups": [{"lr": 1e-4, "params": []}]}
    for i, (name, numel) in enumerate(numels):
        n = max(1, int(numel * scale))
        model[name] = filled(n, torch.bfloat16)
        optimizer["state"][i] = {"step": torch.tensor(100.0),
                                 **{k: filled(n, torch.float32)
                                    for k in ("master", "exp_avg", "exp_avg_sq")[: len(states)]}}
        optimizer["param_groups"][0]["params"].append(i)
    return {"model": model, "optimizer": optimizer, "step": 100}


# --- the drive limit ----------------------------------------------------------------------------

def drive_limit(directory: str, nbytes: int) -> dict[str, Any]:
    """Sequential write (fsynced) and read GB/s of the drive under ``directory``, measured by
    the main benchmark's probe (fio when installed, else a labelled plain O_DIRECT stream)."""
    try:
        from bench.drive import DriveProbe
    except ImportError:  # run as a script: bench/ itself is on sys.path
        from drive import DriveProbe

    probe = DriveProbe(directory, max(nbytes, 64 << 20))
    try:
        drop_cache()
        w = probe.write()
        drop_cache()
        r = probe.read()
    finally:
        probe.cleanup()
    return {"tool": w.tool if w.tool != r.tool else probe.tool,
            "write_gbps": w.nbytes / w.seconds / 1e9, "read_gbps": r.nbytes / r.seconds / 1e9,
            "notes": list(probe.notes)}


def drop_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --- the ranks ----------------------------------------------------------------------------------

def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return -1


def worker(rank: int, world: int, init: str, args: dict[str, Any], out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    import gds_persist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args["timeout_s"]))
    groups = {world: dist.group.WORLD}
    for k in args["ranks"]:
        if k < world:
            groups[k] = dist.new_group(list(range(k)))
    state = make_state(args["size"])
    directory = args["dir"]
    for run in range(args["runs"]):
        for n in args["ranks"]:
            path = os.path.join(directory, f"ckpt-{n}")
            dist.barrier()
            if rank < n:
                t0 = time.perf_counter()
                info = gds_persist.save(state, path, process_group=groups[n])
                wall = time.perf_counter() - t0
                out.put(("save", run, n, rank, {
                    "wall_s": wall, "bytes": info.bytes_written, "rank_bytes": info.rank_bytes,
                    "rank_write_s": info.rank_write_seconds, "backend": info.backend,
                    "balance": info.writer_balance, "placement": info.placement}))
            dist.barrier()
            if n == 1:
                continue
            for strategy in args["strategies"]:
                if rank == 0:
                    out.put(("cache", run, n, rank, drop_cache()))
                dist.barrier()
                if rank < n:
                    before = _rchar()
                    t0 = time.perf_counter()
                    gds_persist.load(path, process_group=groups[n],
                                     options=gds_persist.LoadOptions(strategy=strategy))
                    wall = time.perf_counter() - t0
                    out.put((f"load {strategy}", run, n, rank,
                             {"wall_s": wall, "read_bytes": _rchar() - before}))
                dist.barrier()
            if rank == 0:  # one process without a process group: the baseline for loads
                drop_cache()
                t0 = time.perf_counter()
                gds_persist.load(path)
                out.put(("load, no group", run, n, rank, {"wall_s": time.perf_counter() - t0}))
            dist.barrier()
    out.put(("done", 0, 0, rank, None))
    out.close()
    out.join_thread()  # flush the queue before leaving without interpreter teardown
    os._exit(0)


def run_ranks(args: argparse.Namespace, directory: str) -> list[tuple[str, int, int, int, Any]]:
    import multiprocessing as mp

    world = max(args.ranks)
    ctx = mp.get_context("spawn")
    init = os.path.join(directory, ".rendezvous")
    out = ctx.Queue()
    spec = {"ranks": args.ranks, "runs": args.runs, "size": args.size, "dir": directory,
            "strategies": args.strategies, "timeout_s": args.timeout}
    procs = [ctx.Process(target=worker, args=(r, world, init, spec, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    records, done = [], 0
    deadline = time.monotonic() + args.timeout
    try:
        while done < world:
            try:
                item = out.get(timeout=5)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError("a benchmark rank died or hung; see its output "
                                       "above") from None
                continue
            if item[0] == "done":
                done += 1
            else:
                records.append(item)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return records


# --- report -------------------------------------------------------------------------------------

def summarize(records: list[tuple[str, int, int, int, Any]],
              drive: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    kinds = sorted({(k, n) for k, _, n, _, _ in records if k not in ("cache",)},
                   key=lambda kn: (kn[1], kn[0] != "save", kn[0]))
    for kind, n in kinds:
        runs: dict[int, list[dict[str, Any]]] = {}
        for k, run, nn, _, value in records:
            if k == kind and nn == n:
                runs.setdefault(run, []).append(value)
        save_bytes = [v for k, _, nn, _, v in records if k == "save" and nn == n]
        total = save_bytes[0]["bytes"] if save_bytes else 0
        agg = [total / max(v["wall_s"] for v in vals) / 1e9 for vals in runs.values()]
        row: dict[str, Any] = {
            "method": kind if kind != "load, no group" else f"load 1 proc ({n}-rank save)",
            "ranks": n if kind != "load, no group" else 1,
            "gbps": statistics.median(agg), "gbps_min": min(agg), "gbps_max": max(agg),
            "runs": len(agg), "bytes": total,
        }
        limit = drive["write_gbps"] if kind == "save" else drive["read_gbps"]
        row["of_drive"] = row["gbps"] / limit if limit else None
        if kind == "save":
            per_rank = [v["rank_bytes"] / v["rank_write_s"] / 1e9
                        for vals in runs.values() for v in vals if v["rank_write_s"] > 0]
            row["rank_gbps"] = (min(per_rank), statistics.median(per_rank), max(per_rank)) \
                if per_rank else None
            row["balance"] = save_bytes[0]["balance"]
            row["backend"] = save_bytes[0]["backend"]
            row["placement"] = save_bytes[0]["placement"]
        if kind.startswith("load ") and "read_bytes" in runs[min(runs)][0]:
            row["read_bytes_total"] = statistics.median(
                sum(v["read_bytes"] for v in vals) for vals in runs.values())
        rows.append(row)
    return rows


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def print_report(record: dict[str, Any]) -> None:
    m, d = record["machine"], record["drive"]
    print(f"gds_persist data-parallel benchmark - {m['host']}: {m['cpu']}, {m['cores']} cores, "
          f"{m['memory_gib']:.0f} GiB; {m['fs']} at {m['dir']}; {m['gpu']}")
    print(f"checkpoint {_bytes(record['bytes'])} replicated on every rank; gloo over "
          f"127.0.0.1; {record['runs']} runs; page cache dropped before loads: "
          f"{'yes' if record['cache_dropped'] else 'no (not root)'}")
    print(f"drive limit ({d['tool']}): write {d['write_gbps']:.2f} GB/s, read "
          f"{d['read_gbps']:.2f} GB/s" + (f"; {'; '.join(d['notes'])}" if d["notes"] else ""))
    header = (f"{'method':<26} {'ranks':>5} {'GB/s':>7} {'min-max':>13} {'x drive':>8} "
              f"{'per-rank GB/s min/med/max':>27} {'read total':>11}")
    print(header)
    print("-" * len(header))
    for r in record["rows"]:
        per = ("{:.2f}/{:.2f}/{:.2f}".format(*r["rank_gbps"]) if r.get("rank_gbps") else "")
        read = _bytes(r["read_bytes_total"]) if r.get("read_bytes_total") else ""
        name = r["method"] if r["method"] != "save" else "save (all write)"
        print(f"{name:<26} {r['ranks']:>5} {r['gbps']:>7.2f} "
              f"{r['gbps_min']:>6.2f}-{r['gbps_max']:<6.2f} {r['of_drive'] or 0:>8.2f} "
              f"{per:>27} {read:>11}")
    print("save: checkpoint bytes / wall time until the last rank returned (fsync and commit "
          "included); per-rank: a rank's bytes / its write phase. load: bytes / slowest rank; "
          "'read total': bytes all ranks read (replicated data once vs. once per rank).")


def machine(directory: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f
                        if ln.startswith("model name")), cpu)
    except OSError:
        pass
    fs = "?"
    try:
        best = ""
        real = os.path.realpath(directory)
        with open("/proc/mounts") as f:
            for line in f:
                dev, point, kind = line.split()[:3]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fs = point, f"{kind} ({dev})"
    except OSError:
        pass
    import torch

    gpu = (f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available()
           else "no GPU (gloo on CPU)")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem,
            "fs": fs, "dir": directory, "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"),
                   help="checkpoint size (default 1GiB); every rank holds a replica")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to run (default 1,2,4)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"load strategies to measure (default {','.join(STRATEGIES)})")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory "
                   "under bench/out)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    args = p.parse_args(argv)
    args.ranks = sorted({int(x) for x in args.ranks.split(",")})
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown or min(args.ranks) < 1:
        p.error(f"unknown strategies {sorted(unknown)} or a rank count below 1")
    base = args.dir or os.path.join(HERE, "out")
    os.makedirs(base, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="bench-parallel-", dir=base)
    try:
        before = drive_limit(directory, min(args.size, 1 << 30))
        records = run_ranks(args, directory)
        after = drive_limit(directory, min(args.size, 1 << 30))
        drive = {"tool": before["tool"], "notes": before["notes"],
                 "write_gbps": statistics.median([before["write_gbps"], after["write_gbps"]]),
                 "read_gbps": statistics.median([before["read_gbps"], after["read_gbps"]]),
                 "runs": [before, after]}
        rows = summarize(records, drive)
        record = {"machine": machine(directory), "drive": drive, "rows": rows,
                  "bytes": rows[0]["bytes"] if rows else 0, "runs": args.runs,
                  "cache_dropped": any(v for k, *_, v in records if k == "cache"),
                  "args": {k: v for k, v in vars(args).items()}}
        print_report(record)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DCP with several ranks: FileSystemWriter against gds_persist's DCP backend, with and without
byte-range balancing of replicated tensors. Measures bytes written per rank (the imbalance DCP's
whole-item deduplication leaves) and durable save / cold load throughput.

    python bench/bench_dcp.py                      # 2 ranks (gloo, CPU), 512 MiB, 3 runs
    python bench/bench_dcp.py --ranks 4 --size 2GiB --dir /mnt/nvme/tmp --json out.json

Every rank holds the same GPT-style state dict (data-parallel replicas, as under DDP), so every
tensor is a replicated DCP item. DCP's planner gives each replicated item, whole, to one rank;
with one dominant tensor (the tied embedding) that rank writes most of the bytes.
``GdsPersistWriter(balance=True)`` splits large replicated items across ranks by byte range.

Throughput = payload bytes / wall time of the slowest rank (barrier to barrier), fsync included;
loads are cold (page cache emptied as in bench_io.py). On one drive shared by all ranks the
balance matters when a single writer cannot saturate the drive (or each rank has its own drive);
the bytes-per-rank columns show the imbalance on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import machine  # noqa: E402
from bench.bench_io import parse_size  # noqa: E402
from bench.methods import _empty_like  # noqa: E402
from bench.report import save_json  # noqa: E402
from bench.state import make_state_dict, summarize  # noqa: E402
from gds_persist.progress import cli_progress  # noqa: E402

METHODS = {
    "dcp-fs": "DCP FileSystemWriter",
    "dcp-gds": "DCP GdsPersistWriter (DCP's whole-item assignment)",
    "dcp-gds-balanced": "DCP GdsPersistWriter (byte-range balanced)",
}


def _writer(key: str, path: str, threads: int) -> Any:
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistWriter

    if key == "dcp-fs":
        return dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
    return GdsPersistWriter(path, balance=key == "dcp-gds-balanced")


def _reader(key: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistReader

    return dcp.FileSystemReader(path) if key == "dcp-fs" else GdsPersistReader(path)


def rank_bytes_on_disk(key: str, path: str, world: int) -> list[int]:
    """Bytes each rank wrote, from the files it left."""
    out = [0] * world
    for name in os.listdir(path):
        size = os.path.getsize(os.path.join(path, name))
        if key == "dcp-fs" and name.startswith("__") and name.endswith(".distcp"):
            out[int(name[2:].split("_")[0])] += size
        elif key != "dcp-fs" and name.startswith("rank"):
            out[int(name[4:9])] += size
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, workdir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    sd = make_state_dict(args.size, dtype=args.dtype, seed=args.seed, device=torch.device("cpu"))
    if args.dominant:  # one replicated item of that fraction of the payload (a flat buffer)
        g = torch.Generator().manual_seed(args.seed + 1)
        extra = int(args.dominant / (1 - args.dominant) * summarize(sd).payload_bytes) // 4
        sd["flat_buffer"] = torch.rand(extra, generator=g)
    payload = summarize(sd).payload_bytes
    target = _empty_like(sd)
    bar = cli_progress("bench_dcp") if rank == 0 else None
    steps, done = args.runs * len(args.methods) * 2, 0
    series: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in args.methods}
    per_rank: dict[str, list[int]] = {}
    for rep in range(args.runs):
        order = args.methods[rep % len(args.methods) :] + args.methods[: rep % len(args.methods)]
        for key in order:
            path = os.path.join(workdir, key)
            if rank == 0:
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=_writer(key, path, args.threads))
            dist.barrier()
            series[key]["save"].append(time.perf_counter() - t0)
            if rank == 0:
                per_rank[key] = rank_bytes_on_disk(key, path, world)
                machine.drop_page_cache([path], args.cache_drop)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=_reader(key, path))
            dist.barrier()
            series[key]["load"].append(time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(path)
                done += 2
                if bar is not None:
                    bar(done * payload, steps * payload)
    if bar is not None:
        bar.close()
    if rank == 0:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({"payload_bytes": payload, "series": series, "rank_bytes": per_rank}, f)
    dist.barrier()
    dist.destroy_process_group()


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def report(
    result: dict[str, Any], world: int, facts: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    payload = result["payload_bytes"]
    lines = [
        "gds_persist DCP benchmark (several ranks)",
        f"  CPU        {facts['cpu']}; {facts['cores']['usable']} usable cores",
        f"  directory  {args.dir or 'bench/out'} on {facts['filesystem'].get('fstype', '?')}",
        f"  ranks      {world} (gloo on 127.0.0.1), every rank holds the same state dict",
        f"  state      {payload / 2**20:.2f} MiB payload per replica (GPT-style"
        + (f", plus one flat buffer of {args.dominant:.0%}" if args.dominant else "")
        + f"); {args.runs} runs, interleaved",
        "",
        f"{'method':<52} {'save GB/s':>9} {'load GB/s':>9}  "
        f"{'bytes per rank (MiB)':<28} {'max/mean':>8}",
        "-" * 112,
    ]
    for key in args.methods:
        s, ld = result["series"][key]["save"], result["series"][key]["load"]
        per_rank = result["rank_bytes"][key]
        mean = sum(per_rank) / len(per_rank)
        shown = ", ".join(f"{b / 2**20:.1f}" for b in per_rank)
        save_gbps, load_gbps = payload / median(s) / 1e9, payload / median(ld) / 1e9
        lines.append(
            f"{METHODS[key]:<52} {save_gbps:9.2f} {load_gbps:9.2f}  "
            f"{shown:<28} {max(per_rank) / mean if mean else 0:8.2f}"
        )
    lines += [
        "",
        "GB/s = payload bytes / median seconds of the slowest rank (barrier to barrier); "
        "saves include fsync; loads cold.",
        "max/mean = bytes written by the busiest rank / the mean over ranks (1.00 = even).",
    ]
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="mixed", choices=("mixed", "fp32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="directory on the drive under test")
    p.add_argument("--threads", type=int, default=1, help="FileSystemWriter thread_count")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument(
        "--dominant",
        type=float,
        default=0.0,
        help="add one replicated flat buffer holding this fraction of the payload "
        "(e.g. 0.5): the case where DCP's whole-item assignment is unbalanced",
    )
    p.add_argument("--cache-drop", default="auto", choices=("auto", "global", "per-file"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if not 0 <= args.dominant < 1:
        p.error("--dominant must be in [0, 1)")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")

    import torch.multiprocessing as mp

    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-dcp-", dir=base)
    try:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args.ranks, port, args, workdir), nprocs=args.ranks, join=True)
        with open(os.path.join(workdir, "result.json")) as f:
            result = json.load(f)
        facts = machine.describe(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(report(result, args.ranks, facts, args)))
    record = {
        "schema": "gds_persist-bench-dcp/1",
        "ranks": args.ranks,
        "runs": args.runs,
        "methods": {k: METHODS[k] for k in args.methods},
        **result,
    }
    return save_json(record, args.json)


if __name__ == "__main__":
    main()

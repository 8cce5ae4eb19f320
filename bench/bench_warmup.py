"""Start-up cost: the first save of a process against the next ones, with and without warm-up.

    python bench/bench_warmup.py [--device cpu|cuda] [--size 1GiB] [--saves 3] [--rounds 2]
                                 [--backends auto,kvikio] [--dir DIR] [--json OUT]

Every measurement is a fresh Python process (the first save of a process is the point): it builds
a synthetic GPT-style state of ``--size`` on ``--device`` (not timed; on a GPU that also creates
the CUDA context, as a trainer has before its first checkpoint), then

* ``cold``: saves it ``--saves`` times (each durable, each to a new directory, removed after);
* ``warm``: calls ``gds_persist.warmup(dir)`` first (timed on its own), then the same saves.

Variants and backends are interleaved over ``--rounds``. Each process gets an empty cupy kernel
cache (``CUPY_CACHE_DIR``) unless ``--kernel-cache shared``, so a cold first save includes the
NVRTC compile as on a machine's first run. Reported: the warm-up's seconds, the first save's GB/s,
the median of the later saves' GB/s, and first/next. Every figure includes fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("cold", "warm")
RESULT = "RESULT "


def parse(argv: list[str] | None) -> argparse.Namespace:
    from bench.bench_io import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    p.add_argument("--size", type=parse_size, default="1GiB")
    p.add_argument("--saves", type=int, default=3, help="saves per process (at least 2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backends", default="auto", help="comma-separated gds_persist backends")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir in .)")
    p.add_argument("--kernel-cache", choices=("fresh", "shared"), default="fresh")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.saves < 2:
        p.error("--saves must be at least 2 (a first save and a next one)")
    return args


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: build the state, optionally warm up, then save ``--saves`` times."""
    import torch

    import gds_persist
    from bench.state import make_state_dict
    from gds_persist.state.flatten import flatten

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sd = make_state_dict(args.size, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    payload = sum(s.nbytes for s in flatten(sd).storages)
    out: dict[str, Any] = {"variant": args.child, "backend": args.backend, "device": device,
                           "payload_bytes": payload, "saves": []}
    if args.child == "warm":
        t0 = time.perf_counter()
        report = gds_persist.warmup(args.dir, backend=args.backend)
        out["warmup_s"] = time.perf_counter() - t0
        out["warmup"] = {k: v for k, (v, _) in report.steps.items()}
    for i in range(args.saves):
        path = os.path.join(args.dir, f"save-{os.getpid()}-{i}")
        t0 = time.perf_counter()
        info = gds_persist.save(sd, path, backend=args.backend)
        seconds = time.perf_counter() - t0
        shutil.rmtree(path)
        out["saves"].append({"seconds": seconds, "gbps": payload / seconds / 1e9,
                             "backend": info.backend, "reason": info.reason})
    return out


def run_child(args: argparse.Namespace, variant: str, backend: str, root: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--backend", backend,
           "--size", str(args.size), "--saves", str(args.saves), "--dir", root]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="cupy-cache-", dir=root) as cache:
        if args.kernel_cache == "fresh":
            env["CUPY_CACHE_DIR"] = cache
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"variant": variant, "backend": backend, "failed": " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    return result


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["backend"], r["variant"]) for r in runs},
                  key=lambda k: (k[0], VARIANTS.index(k[1])))
    for backend, variant in keys:
        mine = [r for r in runs if (r["backend"], r["variant"]) == (backend, variant)]
        ok = [r for r in mine if "failed" not in r]
        row: dict[str, Any] = {"backend": backend, "variant": variant, "processes": len(ok),
                               "failed": [r["failed"] for r in mine if "failed" in r]}
        if ok:
            first = statistics.median(r["saves"][0]["gbps"] for r in ok)
            nxt = statistics.median(s["gbps"] for r in ok for s in r["saves"][1:])
            row.update(first_gbps=first, next_gbps=nxt, first_over_next=first / nxt,
                       used=sorted({s["backend"] for r in ok for s in r["saves"]}))
            if variant == "warm":
                row["warmup_s"] = statistics.median(r["warmup_s"] for r in ok)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'backend':<9} {'variant':<8} {'warm-up s':>9} {'first GB/s':>10} "
             f"{'next GB/s':>9} {'first/next':>10}  backend used"]
    for r in rows:
        if "first_gbps" not in r:
            lines.append(f"{r['backend']:<9} {r['variant']:<8} FAILED: {'; '.join(r['failed'])}")
            continue
        warm = f"{r['warmup_s']:.2f}" if "warmup_s" in r else "-"
        lines.append(f"{r['backend']:<9} {r['variant']:<8} {warm:>9} {r['first_gbps']:>10.2f} "
                     f"{r['next_gbps']:>9.2f} {r['first_over_next']:>10.2f}  "
                     f"{','.join(r['used'])}")
    lines.append("(first: the first save of a fresh process; next: the median of its later "
                 "saves; warm-up: gds_persist.warmup() before the first save, not in it; GB/s of "
                 "payload, every save durable)")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.child:
        result = child(args)
        print(RESULT + json.dumps(result), flush=True)
        return result
    from bench import machine

    base = os.path.abspath(args.dir or ".")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench_warmup-", dir=base)
    try:
        backends = [b for b in args.backends.split(",") if b]
        runs = []
        for r in range(args.rounds):
            order = [(b, v) for b in backends for v in VARIANTS]
            if r % 2:
                order.reverse()  # neither variant always runs first
            for backend, variant in order:
                runs.append(run_child(args, variant, backend, root))
        facts = machine.describe(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(runs)
    device = next((r["device"] for r in runs if "device" in r), args.device or "?")
    lines = [
        "gds_persist warm-up benchmark: the first save of a process against the next ones",
        f"  machine  {facts['cpu']}; GPU {machine.gpu_line(facts['gpu'])}",
        f"  state    {args.size / 2**20:.0f} MiB on {device}; {args.saves} saves per process; "
        f"{args.rounds} round(s); kernel cache {args.kernel_cache}; dir {base} "
        f"({facts['filesystem'].get('fstype', '?')})",
        "",
        *table(rows),
    ]
    print("\n".join(lines))
    record = {"schema": "gds_persist-bench-warmup/1", "device": device, "size": args.size,
              "saves": args.saves, "rounds": args.rounds, "kernel_cache": args.kernel_cache,
              "machine": facts, "rows": rows, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    record = main()
    if not record.get("variant") and any(r["failed"] for r in record["rows"]):
        sys.exit(1)

"""``gds-persist plan``: predicted checkpoint time, single writer vs data-parallel partitioned.

    gds-persist plan --params 13e9 --dp 64 --gpus-per-node 8 --drives-per-node 8 --drive-gbps 3
    gds-persist plan --params 13e9 --sweep --iteration-s 50     # 8..1024 GPUs, strong scaling

The balance comes from the real scheduler run on a GPT-like state dict of that size (see
``gds_persist.advice.scale`` for the model and its assumptions).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from ...advice.scale import Prediction, Scenario, predict

DEFAULT_SWEEP = "8,16,32,64,128,256,512,1024"


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(float(text)) if kind is int else kind(text)
        if not value > 0 or (kind is int and float(text) != value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
        return value

    parse.__name__ = kind.__name__
    return parse


HELP = "predict data-parallel checkpoint time: single writer vs partitioned"
DESCRIPTION = __doc__
FORMATTER = argparse.RawDescriptionHelpFormatter


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=_positive(float), required=True,
                   help="model parameters, e.g. 13e9")
    p.add_argument("--bytes-per-param", type=_positive(int), default=14,
                   help="checkpoint bytes per parameter (default 14: mixed-precision Adam)")
    p.add_argument("--dp", type=_positive(int), default=8,
                   help="data-parallel degree = GPUs (default 8)")
    p.add_argument("--gpus-per-node", type=_positive(int), default=8)
    p.add_argument("--drives-per-node", type=_positive(int), default=8,
                   help="NVMe drives per node, no RAID")
    p.add_argument("--drive-gbps", type=_positive(float), default=3.0,
                   help="write GB/s of one drive")
    p.add_argument("--node-gbps", type=_positive(float), default=None,
                   help="cap on one node's total write GB/s (PCIe/host limit); default none")
    p.add_argument("--writers-per-node", type=_positive(int), default=None,
                   help="writing ranks per node (default: every rank)")
    p.add_argument("--iteration-s", type=_positive(float), default=None,
                   help="training iteration time in seconds at --dp GPUs; with it, each time "
                        "is also shown as a share of an iteration (without it, no share is "
                        "shown: none is assumed)")
    p.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="GPUS",
                   help=f"table over data-parallel degrees (default {DEFAULT_SWEEP})")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="sweep: strong = fixed global batch, iteration time ~ 1/GPUs (default); "
                        "weak = constant iteration time")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")


def _scenario(args: argparse.Namespace) -> Scenario:
    # the model's fractions divide by iteration_s; without --iteration-s none is printed
    return Scenario(params=args.params, dp=args.dp, bytes_per_param=args.bytes_per_param,
                    gpus_per_node=args.gpus_per_node, drives_per_node=args.drives_per_node,
                    drive_gbps=args.drive_gbps, node_gbps=args.node_gbps,
                    writers_per_node=args.writers_per_node, iteration_s=args.iteration_s or 1.0)


def _as_dict(p: Prediction, timed: bool) -> dict[str, object]:
    """The prediction as JSON; ``timed``: --iteration-s was given (else the iteration time and
    the shares of it are null)."""
    return {**asdict(p.scenario), "nodes": p.nodes, "writers": p.writers,
            "checkpoint_bytes": p.checkpoint_bytes, "writer_balance": p.writer_balance,
            "node_balance": p.node_balance, "single_writer_s": p.single_s,
            "partitioned_s": p.partitioned_s, "speedup": p.speedup,
            "single_writer_fraction_of_iteration": p.single_fraction if timed else None,
            "partitioned_fraction_of_iteration": p.partitioned_fraction if timed else None,
            **({} if timed else {"iteration_s": None})}


NO_ITERATION = ("(give --iteration-s, the seconds of one training iteration, to see these "
                "times as a share of an iteration)")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 10 else f"{100 * x:.0f}%"


def run(args: argparse.Namespace) -> int:
    base = _scenario(args)
    timed = args.iteration_s is not None
    if args.sweep is None:
        p = predict(base)
        if args.json:
            print(json.dumps(_as_dict(p, timed), indent=1))
            return 0
        s = base
        print(f"{s.params:.3g} parameters x {s.bytes_per_param} B/param: checkpoint "
              f"{p.checkpoint_bytes / 1e9:.1f} GB (GPT-like state dict, aligned extents)")
        print(f"{s.dp} data-parallel GPUs on {p.nodes} node(s) of {s.gpus_per_node}, "
              f"{s.drives_per_node} drives/node at {s.drive_gbps:g} GB/s"
              + (f", node cap {s.node_gbps:g} GB/s" if s.node_gbps else ""))
        print(f"plan: {p.writers} writers; bytes per writer max/mean {p.writer_balance:.4f}; "
              f"per node max/mean {p.node_balance:.4f}")
        single = f"  {'single writer (one rank, one drive)':<40} {p.single_s:10.3f} s"
        part = f"  {f'partitioned ({p.writers} writers)':<40} {p.partitioned_s:10.3f} s"
        if timed:
            single += f" = {_pct(p.single_fraction):>7} of a {s.iteration_s:g} s iteration"
            part += f" = {_pct(p.partitioned_fraction):>7} of the iteration"
        print(single)
        print(part)
        print(f"  speed-up {p.speedup:.1f}x")
        if not timed:
            print(NO_ITERATION)
        return 0
    try:
        gpus = [int(g) for g in args.sweep.split(",") if g.strip()]
    except ValueError:
        gpus = []
    if not gpus or min(gpus) < 1:
        print(f"gds-persist plan: --sweep wants a comma-separated list of GPU counts, not "
              f"{args.sweep!r}", file=sys.stderr)
        return 2
    rows = []
    for g in gpus:
        iteration = base.iteration_s * (base.dp / g if args.scaling == "strong" else 1.0)
        rows.append(predict(replace(base, dp=g, iteration_s=iteration)))
    if args.json:
        print(json.dumps([_as_dict(p, timed) for p in rows], indent=1))
        return 0
    s = base
    size = rows[0].checkpoint_bytes / 1e9
    print(f"{s.params:.3g} parameters x {s.bytes_per_param} B = {size:.1f} GB "
          f"checkpoint; {s.gpus_per_node} GPUs and {s.drives_per_node} drives of "
          f"{s.drive_gbps:g} GB/s per node"
          + (f"; {args.scaling} scaling from {s.iteration_s:g} s per iteration at {s.dp} GPUs"
             if timed else ""))
    pct = f" {'%iter':>7}" if timed else ""
    header = (f"{'GPUs':>6} {'nodes':>6} {'writers':>8} {'balance':>8}"
              + (f" {'iter s':>8}" if timed else "")
              + f" {'single s':>9}{pct} {'part. s':>8}{pct} {'speed-up':>9}")
    print(header)
    print("-" * len(header))
    for p in rows:
        single = f" {_pct(p.single_fraction):>7}" if timed else ""
        part = f" {_pct(p.partitioned_fraction):>7}" if timed else ""
        print(f"{p.scenario.dp:>6} {p.nodes:>6} {p.writers:>8} {p.writer_balance:>8.4f}"
              + (f" {p.scenario.iteration_s:>8.3g}" if timed else "")
              + f" {p.single_s:>9.2f}{single} {p.partitioned_s:>8.3f}{part} {p.speedup:>8.0f}x")
    if not timed:
        print(NO_ITERATION)
    return 0

"""``gds-persist advise``: optimal checkpoint interval (Young/Daly) and the work at risk."""

from __future__ import annotations

import argparse
import json

from ..training.interval import advise, describe, parse_duration

HELP = "optimal checkpoint interval (Young/Daly) from checkpoint cost and MTBF"
DESCRIPTION = ("From the time one checkpoint stalls training and the mean time between "
               "failures, print the optimal checkpoint interval (Young, Daly), the expected work "
               "lost per failure and the wasted fraction of wall time; with an iteration time, "
               "also what checkpointing every iteration costs. Durations: 90, 90s, 5m, 24h, 7d.")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", help="seconds one checkpoint stalls training (e.g. a blocking save)")
    p.add_argument("--mtbf", required=True, help="mean time between failures (e.g. 24h)")
    p.add_argument("--restart", default="0", help="time to restart after a failure (default 0)")
    p.add_argument("--iteration-time", help="seconds per training iteration")
    p.add_argument("--per-iteration-cost",
                   help="stall per checkpoint when checkpointing every iteration with overlap "
                   "(default: --cost)")
    p.add_argument("--from-bench", metavar="JSON",
                   help="take the iteration time and costs from `bench/bench_train.py --json`: "
                   "--cost = blocking torch.save's overhead, --per-iteration-cost = the "
                   "gds_persist mode's overhead")
    p.add_argument("--mode", default="gds_fence", help="bench mode for --from-bench "
                   "(gds_fence, gds_snapshot or gds_auto; default gds_fence)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


def _from_bench(path: str, mode: str) -> tuple[float, float, float]:
    with open(path) as f:
        results = json.load(f)["results"]
    try:
        iteration = results["none"]["median_s"]
        blocking = max(results["torch_save"]["overhead_s"], 0.0)
        overlapped = max(results[mode]["overhead_s"], 0.0)
    except KeyError as e:
        raise SystemExit(f"gds-persist advise: {path} has no result {e} (run bench_train.py "
                         "with that mode)") from None
    return iteration, blocking, overlapped


def run(args: argparse.Namespace) -> int:
    iteration = parse_duration(args.iteration_time) if args.iteration_time else None
    per_iteration = parse_duration(args.per_iteration_cost) if args.per_iteration_cost else None
    cost = parse_duration(args.cost) if args.cost else None
    if args.from_bench:
        b_iter, b_cost, b_per = _from_bench(args.from_bench, args.mode)
        iteration = iteration or b_iter
        cost = b_cost if cost is None else cost
        per_iteration = b_per if per_iteration is None else per_iteration
    if cost is None:
        raise SystemExit("gds-persist advise: give --cost (or --from-bench)")
    a = advise(cost, parse_duration(args.mtbf), restart_s=parse_duration(args.restart),
               iteration_s=iteration, per_iteration_cost_s=per_iteration)
    if args.json:
        print(json.dumps(a.to_dict(), indent=1))
    else:
        print("\n".join(describe(a)))
    return 0

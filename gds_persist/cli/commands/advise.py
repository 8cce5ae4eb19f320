"""``gds-persist advise``: optimal checkpoint intervals (Young/Daly) and the work at risk.

One level (the drive):

    gds-persist advise --cost 2.5 --mtbf 24h --iteration-time 1.2 --per-iteration-cost 0.02

Two levels, memory tier (+ replicas) and drive, with the drive's wear:

    gds-persist advise --iteration-time 1 --checkpoint-size 182GB \\
        --process-mtbf 8h --node-mtbf 1d --replica-loss-mtbf 30d \\
        --memory-cost 0.05 --replica-cost 0.2 --drive-gbps 3 --drive-dwpd 1 --drive-capacity 3.84TB

Any number of levels, nearest first, then the durable level (the Checkpointer's root):

    gds-persist advise --iteration-time 1 --params 13e9 --nodes 8 \\
        --process-mtbf 6h --node-mtbf 1d --reboot-mtbf 3d --replica-loss-mtbf 30d \\
        --level tmpfs:0.2:20s --level nvme:0.5:1m:drive:1 --durable 0:10m:30m \\
        --drive-dwpd 1 --drive-capacity 3.84TB

Durations: 90, 90s, 5m, 24h, 7d. Sizes: 182e9, 182GB, 1.5TiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace

from ... import settings
from ...advice.interval import advise, describe
from ...advice.levels import Failures, Tier, advise_levels, describe_levels, tier_bytes_per_node
from ...advice.multilevel import FIX, Level, LevelFailures, advise_multilevel, describe_multilevel
from ...advice.units import parse_duration, parse_size
from ...advice.wear import Endurance, endurance
from ...backends import choose_backend
from ...backends.write_rate import PROBE_BYTES, PROBE_RUNS, write_rate

HELP = ("checkpoint intervals (Young/Daly): one level, memory_every and drive_every, or every "
        "level's (--level, --durable), with wear")
_INTRO = ("From the time one checkpoint stalls training and the mean time between failures, "
          "print the optimal checkpoint interval (Young, Daly), the expected work lost per "
          "failure and the wasted fraction of wall time; with an iteration time, also what "
          "checkpointing every iteration costs. With failure rates per level (--process-mtbf, "
          "--node-mtbf, --replica-loss-mtbf), recommend the Checkpointer's memory_every and "
          "drive_every instead (Young/Daly per level); with --level and --durable, every level's "
          "interval. With the checkpoint's size and the "
          "drive's rating, either advice reports the drive's writes per day against its "
          "endurance and keeps within it.")
DESCRIPTION = textwrap.fill(_INTRO, 90, break_on_hyphens=False) + "\n" + __doc__.split("\n", 1)[1]
FORMATTER = argparse.RawDescriptionHelpFormatter
_MEASURED = f"{PROBE_BYTES >> 20} MiB, {PROBE_RUNS} runs, the save's backend, fsynced"
LEVEL_MTBFS = ("process_mtbf", "node_mtbf", "replica_loss_mtbf")
WEAR_ONLY = ("warranty_years", "wear_share", "write_amplification")  # need an endurance rating
LEVEL_ONLY = ("replicas", *(f"{k}_{t}" for t in ("memory", "replica", "drive")
                            for k in ("restore", "measure")),
              *(f"{t}_{k}" for t in ("memory", "replica", "drive") for k in ("cost", "gbps")))


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", help="seconds one checkpoint stalls training (e.g. a blocking save)")
    p.add_argument("--mtbf", help="mean time between failures (e.g. 24h)")
    p.add_argument("--restart", default="0", help="time to restart after a failure (default 0)")
    p.add_argument("--iteration-time", help="seconds per training iteration")
    p.add_argument("--per-iteration-cost",
                   help="stall per checkpoint when checkpointing every iteration with overlap "
                   "(default: --cost)")
    p.add_argument("--from-bench", metavar="JSON",
                   help="take the iteration time and costs from the training benchmark's "
                   "--json (docs/TRAINING.md, \"Benchmark\"): "
                   "--cost = blocking torch.save's overhead, --per-iteration-cost = the "
                   "gds_persist mode's overhead")
    p.add_argument("--mode", default="gds_fence", help="bench mode for --from-bench "
                   "(gds_fence, gds_snapshot or gds_auto; default gds_fence)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    _level_arguments(p.add_argument_group(
        "memory tier and drive: memory_every and drive_every (Young/Daly per level)"))
    _multi_arguments(p.add_argument_group(
        "any number of levels: node-local levels nearest first, then the durable level "
        "(the MTBFs above, and --reboot-mtbf)"))
    _wear_arguments(p.add_argument_group(
        "the checkpoint's size and the drive's wear, for either advice (endurance: "
        "--drive-tbw, or --drive-dwpd with --drive-capacity)"))


def _level_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--process-mtbf", help="MTBF of process failures (crash, OOM, hang): the "
                   "node's memory recovers them")
    g.add_argument("--node-mtbf", help="MTBF of losing one node: a peer's replica recovers it "
                   "(the drive with --replicas 0)")
    g.add_argument("--replica-loss-mtbf", help="MTBF of losing a node with its replicas "
                   "(correlated failures, power, the whole job): only the drive recovers it")
    g.add_argument("--replicas", type=int, help="replicas of each rank's bytes on other nodes "
                   "(default 1)")
    for tier, what in (("memory", "the node's memory commit"),
                       ("replica", "copying to the replicas"), ("drive", "the drive's commit")):
        g.add_argument(f"--{tier}-cost", help=f"seconds {what} stalls training (measured, e.g. "
                       "bench_train's overhead); or:")
        g.add_argument(f"--{tier}-gbps", type=float, help=f"GB/s of {what}: stall = a node's "
                       "bytes / rate (blocking, an upper bound on an overlapped save's stall)")
        if tier != "replica":
            g.add_argument(f"--measure-{tier}", metavar="DIR", help=f"or: measure the durable "
                           f"write rate into DIR ({_MEASURED}) and use it as --{tier}-gbps")
        g.add_argument(f"--restore-{tier}", help=f"time to restore from {tier} after a "
                       "failure (default 0)")


def _multi_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--level", action="append", metavar="NAME:STALL:RESTORE[:KIND[:COPIES]]",
                   help="a node-local level, nearest first (repeat it): the seconds one "
                   "checkpoint stalls training, the restore time, KIND memory (tmpfs, RAM: the "
                   "default) or drive (the node's NVMe: wear), COPIES on other nodes (default "
                   "1), e.g. --level tmpfs:0.2:20s --level nvme:0.5:1m:drive:1")
    g.add_argument("--durable", metavar="STALL:RESTORE:FLUSH[:KIND]",
                   help="the durable level, last: its stall (about 0: flushed in the "
                   "background), restore time, the flush time (its shortest interval), KIND "
                   "store (an object store or shared directory: the default) or drive (a "
                   "local drive: wear), e.g. --durable 0:10m:30m")
    g.add_argument("--reboot-mtbf", help="MTBF of every node restarting (memory lost, drives "
                   "kept): the nearest drive-backed level recovers it")


def _wear_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--checkpoint-size", help="bytes of the whole checkpoint (e.g. 182GB)")
    g.add_argument("--params", type=float, help="or: model parameters (e.g. 13e9), times "
                   "--bytes-per-param")
    g.add_argument("--bytes-per-param", type=float, default=14.0,
                   help="checkpoint bytes per parameter (default 14: mixed-precision Adam)")
    g.add_argument("--nodes", type=int, default=1, help="nodes the checkpoint is split over, "
                   "data-parallel (default 1)")
    g.add_argument("--drives-per-node", type=int, default=1, help="drives each node writes its "
                   "share to (default 1)")
    g.add_argument("--drive-tbw", type=float, help="rated terabytes written over the warranty")
    g.add_argument("--drive-dwpd", type=float, help="rated drive writes per day")
    g.add_argument("--drive-capacity", help="the drive's capacity, for --drive-dwpd (e.g. 3.84TB)")
    g.add_argument("--warranty-years", type=float, help="the rating's period (default 5)")
    g.add_argument("--wear-share", type=float, help="fraction of the endurance checkpoints may "
                   "use (default 1: nothing else writes much to the drive)")
    g.add_argument("--write-amplification", type=float,
                   help="bytes the flash takes per byte written (default 1: large sequential "
                   "writes of new files)")


def _from_bench(path: str, mode: str) -> tuple[float, float, float]:
    with open(path) as f:
        results = json.load(f)["results"]
    try:
        iteration = results["none"]["median_s"]
        blocking = max(results["torch_save"]["overhead_s"], 0.0)
        overlapped = max(results[mode]["overhead_s"], 0.0)
    except KeyError as e:
        raise SystemExit(f"gds-persist advise: {path} has no result {e} (run the training "
                         "benchmark with that mode: docs/TRAINING.md, \"Benchmark\")") from None
    return iteration, blocking, overlapped


def run(args: argparse.Namespace) -> int:
    try:
        if args.level or args.durable:
            return _run_multi(args)
        if args.reboot_mtbf:
            raise ValueError(f"--reboot-mtbf belongs to the advice per level: give the levels "
                             f"(--level ..., --durable ...) too ({FIX})")
        if any(getattr(args, name) for name in LEVEL_MTBFS):
            return _run_levels(args)
        return _run_one(args)
    except ValueError as e:
        print(f"gds-persist advise: {e}", file=sys.stderr)
        return 2


def _run_one(args: argparse.Namespace) -> int:
    if args.mtbf is None:
        raise ValueError("give --mtbf (one level), or the MTBF per level: --process-mtbf, "
                         "--node-mtbf, --replica-loss-mtbf")
    stray = [f"--{n.replace('_', '-')}" for n in LEVEL_ONLY if getattr(args, n, None) is not None]
    if stray:
        raise ValueError(f"{_belong(stray)} to the two-level advice: give the MTBF per "
                         "level (--process-mtbf, --node-mtbf, --replica-loss-mtbf) instead of "
                         "--mtbf")
    iteration = parse_duration(args.iteration_time) if args.iteration_time else None
    per_iteration = parse_duration(args.per_iteration_cost) if args.per_iteration_cost else None
    cost = parse_duration(args.cost) if args.cost else None
    if args.from_bench:
        b_iter, b_cost, b_per = _from_bench(args.from_bench, args.mode)
        iteration = iteration or b_iter
        cost = b_cost if cost is None else cost
        per_iteration = b_per if per_iteration is None else per_iteration
    if cost is None:
        raise ValueError("give --cost (or --from-bench)")
    _, _, worn, budget = _sizes(args)
    a = advise(cost, parse_duration(args.mtbf), restart_s=parse_duration(args.restart),
               iteration_s=iteration, per_iteration_cost_s=per_iteration, drive_bytes=worn,
               budget=budget, wear_share=_share(args))
    return _print(args, a.to_dict(), describe(a))


def _belong(flags: list[str]) -> str:
    """``--a belongs`` / ``--a, --b belong``: the start of a message about misplaced flags."""
    return f"{', '.join(flags)} {'belongs' if len(flags) == 1 else 'belong'}"


def _print(args: argparse.Namespace, numbers: dict[str, object], lines: list[str]) -> int:
    print(json.dumps(numbers, indent=1) if args.json else "\n".join(lines))
    return 0


def _checkpoint_bytes(args: argparse.Namespace) -> float | None:
    if args.checkpoint_size is not None and args.params is not None:
        raise ValueError("give --checkpoint-size or --params, not both")
    if args.params is not None:
        if not (args.params > 0 and args.bytes_per_param > 0):
            raise ValueError("--params and --bytes-per-param must be positive")
        return float(args.params * args.bytes_per_param)
    return None if args.checkpoint_size is None else parse_size(args.checkpoint_size)


def _measured_gbps(directory: str) -> float:
    """The durable write rate into ``directory`` (GB/s), as a save there would write."""
    s = settings.current()
    try:
        backend, _ = choose_backend("auto", directory, False, s.io_threads, s.block_bytes)
        return write_rate(backend, directory, s.io_threads, s.block_bytes) / 1e9
    except OSError as e:
        raise ValueError(f"cannot measure the write rate into {directory}: {e} (give a "
                         "writable directory on the drive or tmpfs to measure)") from e


def _tier(args: argparse.Namespace, name: str, node_bytes: float | None,
          measured: dict[str, float]) -> Tier:
    """A tier's stall: given, or a node's bytes over the given or measured rate."""
    cost, gbps = getattr(args, f"{name}_cost"), getattr(args, f"{name}_gbps")
    directory = getattr(args, f"measure_{name}", None)
    restore = parse_duration(getattr(args, f"restore_{name}") or 0.0)
    given = [flag for flag, v in ((f"--{name}-cost", cost), (f"--{name}-gbps", gbps),
                                  (f"--measure-{name}", directory)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give only one of {', '.join(given)}")
    if cost is not None:
        return Tier(parse_duration(cost), restore)
    if (gbps is None and directory is None) or node_bytes is None:
        raise ValueError(f"give --{name}-cost (its measured stall), or --{name}-gbps"
                         + (f" or --measure-{name}" if name != "replica" else "")
                         + " with --checkpoint-size (or --params)")
    if directory is not None:
        gbps = measured[name] = _measured_gbps(directory)
    if not gbps > 0:
        raise ValueError(f"--{name}-gbps {gbps}: must be positive")
    return Tier(node_bytes / (gbps * 1e9), restore)


def _budget(args: argparse.Namespace) -> Endurance | None:
    if args.drive_tbw is None and args.drive_dwpd is None:
        given = [n for n in (*WEAR_ONLY, "drive_capacity") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} describes the drive's wear: give "
                             "its endurance too (--drive-tbw, or --drive-dwpd with "
                             "--drive-capacity)")
        return None
    capacity = None if args.drive_capacity is None else parse_size(args.drive_capacity)
    years = 5.0 if args.warranty_years is None else args.warranty_years
    return endurance(tbw=args.drive_tbw, dwpd=args.drive_dwpd, capacity_bytes=capacity,
                     warranty_years=years)


def _check_level_args(args: argparse.Namespace) -> None:
    mixed = [f"--{n.replace('_', '-')}" for n in ("cost", "mtbf", "per_iteration_cost",
                                                   "from_bench") if getattr(args, n)]
    if mixed:
        raise ValueError(f"{_belong(mixed)} to the one-level advice; with per-level "
                         "MTBFs give the costs per tier (--memory-cost, --replica-cost, "
                         "--drive-cost or their --*-gbps)")
    if args.iteration_time is None:
        raise ValueError("give --iteration-time: memory_every and drive_every count iterations")


def _sizes(args: argparse.Namespace) -> tuple[float | None, float | None, float | None,
                                             Endurance | None]:
    """A node's and a drive's bytes per checkpoint, what the drive's flash takes (times the
    write amplification), and the drive's endurance budget."""
    if args.nodes < 1 or args.drives_per_node < 1:
        raise ValueError("--nodes and --drives-per-node must be >= 1")
    amplification = 1.0 if args.write_amplification is None else args.write_amplification
    if not amplification >= 1:
        raise ValueError(f"--write-amplification {amplification}: must be >= 1")
    size = _checkpoint_bytes(args)
    budget = _budget(args)
    if budget is not None and size is None:
        raise ValueError("the drive's endurance needs --checkpoint-size (or --params) to "
                         "compare the writes against it")
    if size is None:
        return None, None, None, budget
    node = size / args.nodes
    drive = node / args.drives_per_node
    return node, drive, drive * amplification, budget


def _share(args: argparse.Namespace) -> float:
    return 1.0 if args.wear_share is None else float(args.wear_share)


def _run_levels(args: argparse.Namespace) -> int:
    _check_level_args(args)
    node, drive, worn, budget = _sizes(args)
    replicas = 1 if args.replicas is None else args.replicas
    mtbf = [parse_duration(getattr(args, n)) if getattr(args, n) else float("inf")
            for n in LEVEL_MTBFS]
    measured: dict[str, float] = {}  # tier -> GB/s
    a = advise_levels(
        parse_duration(args.iteration_time), _tier(args, "memory", node, measured),
        _tier(args, "drive", drive, measured), Failures(*mtbf),
        replica=(_tier(args, "replica", None if node is None else node * replicas, measured)
                 if replicas > 0 else None),
        replicas=replicas, drive_bytes=worn, budget=budget, wear_share=_share(args))
    rates = [f"measured: {getattr(args, f'measure_{t}')} takes {r:.3g} GB/s ({_MEASURED})"
             for t, r in measured.items()]
    size = _checkpoint_bytes(args)
    tier = None if size is None else tier_bytes_per_node(size, args.nodes, replicas)
    lines = describe_levels(a)
    if tier is not None:
        lines.append(f"memory tier per node: {tier / 1e9:.3g} GB = (1 + {replicas} replicas) x "
                     f"checkpoint / {args.nodes} node(s), plus manifests (each rank keeps its "
                     f"share); tmpfs room for 2 steps: {2 * tier / 1e9:.3g} GB")
    return _print(args, {**a.to_dict(), "measured_gbps": measured,
                         "memory_tier_bytes_per_node": tier}, rates + lines)


def _spec(flag: str, text: str, fields: int) -> list[str]:
    parts = text.split(":")
    if not fields <= len(parts) <= fields + (2 if flag == "--level" else 1) or not all(parts):
        form = ("NAME:STALL:RESTORE[:KIND[:COPIES]], e.g. --level nvme:0.5:1m:drive:1"
                if flag == "--level" else "STALL:RESTORE:FLUSH[:KIND], e.g. --durable 0:10m:30m")
        raise ValueError(f"{flag} {text!r}: write {form} ({FIX})")
    return parts


def _seconds(flag: str, text: str, what: str, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as e:
        raise ValueError(f"{flag} {text!r}: {what}: {e}") from None


def _levels_of(args: argparse.Namespace, node: float | None, drives: int, amplification: float
               ) -> list[Level]:
    """The levels as given: each ``--level`` spec, then ``--durable``; a drive-backed level's
    flash bytes per checkpoint from the node's share (with its copies) when the size is known."""
    if not args.durable:
        raise ValueError("give the durable level last: --durable STALL:RESTORE:FLUSH[:KIND] "
                         f"(the Checkpointer's root; e.g. --durable 0:10m:30m) ({FIX})")
    levels = []
    for text in args.level or []:
        name, stall, restore, *rest = _spec("--level", text, 3)
        copies = rest[1] if len(rest) > 1 else "1"
        if not copies.isdigit():
            raise ValueError(f"--level {text!r}: copies {copies!r} must be a whole number "
                             f">= 0 ({FIX})")
        levels.append(Level(name, _seconds("--level", text, "stall", stall),
                            _seconds("--level", text, "restore", restore),
                            rest[0] if rest else "memory", int(copies)))
    stall, restore, flush, *kind = _spec("--durable", args.durable, 3)
    levels.append(Level("durable", _seconds("--durable", args.durable, "stall", stall),
                        _seconds("--durable", args.durable, "restore", restore),
                        kind[0] if kind else "store", durable=True,
                        flush_s=_seconds("--durable", args.durable, "flush", flush)))
    if node is None:
        return levels
    return [replace(v, bytes_per_drive=(1 + v.copies) * node / drives * amplification)
            if v.kind == "drive" else v for v in levels]


def _run_multi(args: argparse.Namespace) -> int:
    mixed = [f"--{n.replace('_', '-')}" for n in ("cost", "mtbf", "per_iteration_cost",
                                                   "from_bench", *LEVEL_ONLY)
             if getattr(args, n, None) not in (None, False)]
    if mixed:
        raise ValueError(f"{_belong(mixed)} to the one- or two-level advice; with --level "
                         f"give each level's stall and restore in its spec ({FIX})")
    if args.iteration_time is None:
        raise ValueError("give --iteration-time: every level's interval counts iterations")
    node, _, _, budget = _sizes(args)
    amplification = 1.0 if args.write_amplification is None else args.write_amplification
    levels = _levels_of(args, node, args.drives_per_node, amplification)
    mtbf = [parse_duration(getattr(args, n)) if getattr(args, n) else float("inf")
            for n in ("process_mtbf", "node_mtbf", "reboot_mtbf", "replica_loss_mtbf")]
    a = advise_multilevel(parse_duration(args.iteration_time), levels, LevelFailures(*mtbf),
                          budget=budget, wear_share=_share(args))
    size = _checkpoint_bytes(args)
    held = {} if size is None else {v.name: tier_bytes_per_node(size, args.nodes, v.copies)
                                    for v in levels if not v.durable}
    lines = describe_multilevel(a)
    if held:
        lines.append("per node, one step: " + ", ".join(
            f"{n} {b / 1e9:.3g} GB" for n, b in held.items()) + " ((1 + copies) x checkpoint / "
            f"{args.nodes} node(s), plus manifests); room for 2 steps at a time")
    return _print(args, {**a.to_dict(), "bytes_per_node": held}, lines)

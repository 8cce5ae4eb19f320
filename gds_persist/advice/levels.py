"""Two checkpoint intervals, ``memory_every`` and ``drive_every``: Young/Daly per level.

Multi-level checkpointing (Moody, Bronevetsky, Mohror, de Supinski, SC'10, the SCR paper; Di,
Bouguerra, Bautista-Gomez, Cappello, IPDPS'14, for FTI's levels; Benoit, Cavelan, Le Fevre,
Robert, Sun, "Towards optimal multi-level checkpointing", IEEE Trans. Computers 66(7), 2017):
failures of class ``l`` arrive at random at rate ``lambda_l = 1 / M_l`` and are recovered from
the newest checkpoint of level ``l`` or above; level-``l`` checkpoints come every ``T_l``, nested
(every drive step is also a memory step), and stall training ``C_l`` each; a recovery at level
``l`` takes ``R_l``. To first order the fraction of wall time wasted is

    H = sum_l  C_l / T_l + lambda_l * (T_l / 2 + R_l)

which separates by level: ``T_l = sqrt(2 C_l / lambda_l) = sqrt(2 C_l M_l)``, Young's formula per
level, with the optimum ``H* = sum_l sqrt(2 lambda_l C_l) + lambda_l R_l`` (Benoit et al.'s
first-order result, which extends Young/Daly's single level). SCR's model is a Markov chain of
the same setting solved numerically; the two agree while ``C_l << T_l << M_l``.

The Checkpointer's tiers make two levels:

* ``memory_every``: the node's memory (stall ``C_memory``) plus, with ``replicas >= 1``, copies to
  peer nodes (``C_replica``). It recovers process failures (``M_process``) and, with replicas,
  node failures (``M_node``): ``C_1 = C_memory + C_replica``, ``lambda_1 = 1/M_process + 1/M_node``.
* ``drive_every``: the drive (``C_drive``). It recovers the loss of a node with its replicas
  (``M_replica_loss``: correlated failures, power, the whole job), and node failures when
  ``replicas = 0``.

Per level we take Daly's higher-order interval (:func:`.interval.daly_interval`) for ``C_l`` and
``M_l``, round it to whole iterations (the floor or the ceiling, whichever Daly's waste model
prefers), nest the levels (``drive_every`` a multiple of ``memory_every``), and keep the drive's
writes within its endurance (:func:`.wear.wear_interval`): when that floor is above the failure
optimum, wear, not failures, sets ``drive_every``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .interval import daly_interval, lost_work, waste_fraction, young_interval
from .units import format_duration
from .wear import Endurance, Wear, describe_wear, wear, wear_interval


@dataclass(frozen=True)
class Tier:
    """One place checkpoints go: its stall per checkpoint and its restore time."""

    cost_s: float
    restore_s: float = 0.0


@dataclass(frozen=True)
class Failures:
    """Mean time between failures of each class (``inf``: none)."""

    process_mtbf_s: float = math.inf  # recoverable from the node's memory
    node_mtbf_s: float = math.inf  # recoverable from a peer's replica
    replica_loss_mtbf_s: float = math.inf  # a node and its replicas: only the drive


@dataclass
class LevelPlan:
    """One level's recommended interval and what it costs."""

    every: int  # iterations
    interval_s: float
    cost_s: float
    mtbf_s: float  # of the failures this level recovers
    young_interval_s: float
    daly_interval_s: float
    waste: float  # fraction of wall time, Daly's model for this level alone
    limited_by: str  # failures | iteration | drive_every | wear


@dataclass
class LevelAdvice:
    iteration_s: float
    replicas: int
    memory: LevelPlan  # memory_every (with the replicas)
    drive: LevelPlan  # drive_every
    waste: float  # both levels (first order: the sum)
    lost_per_failure_s: dict[str, float]  # failure class -> expected work redone + restore
    recovered_from: dict[str, str]  # failure class -> memory | replica | drive
    wear_interval_s: float | None = None  # the endurance budget's shortest drive interval
    wear: Wear | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(tiers: dict[str, Tier | None], failures: Failures, iteration_s: float) -> None:
    if not (math.isfinite(iteration_s) and iteration_s > 0):
        raise ValueError(f"iteration time {iteration_s} s: must be positive (memory_every and "
                         "drive_every count iterations)")
    for name, tier in tiers.items():
        if tier is not None and not (tier.cost_s >= 0 and tier.restore_s >= 0
                                     and math.isfinite(tier.cost_s + tier.restore_s)):
            raise ValueError(f"{name} tier: checkpoint cost {tier.cost_s} s and restore "
                             f"{tier.restore_s} s must be finite and >= 0")
    for name, mtbf in asdict(failures).items():
        if not mtbf > 0:
            raise ValueError(f"{name} = {mtbf}: a mean time between failures must be positive "
                             "(leave it out for a class of failures that does not happen)")


def _best_every(target_s: float, unit_s: float, cost: float, mtbf: float, restore: float
                ) -> int:
    """Whole multiples of ``unit_s`` nearest ``target_s``: the one Daly's waste prefers (>= 1).
    The waste is unimodal in the interval, so the optimum is the floor or the ceiling."""
    low = max(1, math.floor(target_s / unit_s))
    return min((low, low + 1), key=lambda n: waste_fraction(n * unit_s, cost, mtbf, restore))


def _at_least(min_s: float, unit_s: float) -> int:
    return max(1, math.ceil(min_s / unit_s * (1 - 1e-12)))


def _rate(mtbfs: list[float]) -> float:
    return sum(1.0 / m for m in mtbfs)


CLASSES = ("process", "node", "replica_loss")


def _intervals(iteration_s: float, c1: float, m1: float, r1: float, drive: Tier, m2: float,
               floor_s: float) -> tuple[int, int, str, str]:
    """``memory_every``, ``drive_every`` and what limits each: the pair of least waste with the
    drive a multiple of the memory tier (a drive step is a memory step too) and at least
    ``floor_s`` apart (wear). Level 1's waste is flat near its optimum, so ``memory_every`` is
    searched within a factor 2 of it (and never sparser than the drive alone would be)."""
    k1_alone = _best_every(daly_interval(c1, m1), iteration_s, c1, m1, r1)
    k2_alone = max(_best_every(daly_interval(drive.cost_s, m2), iteration_s, drive.cost_s, m2,
                               drive.restore_s), _at_least(floor_s, iteration_s))
    top = min(2 * k1_alone, k2_alone)
    low = min(max(1, k1_alone // 2), top)
    step = max(1, (top - low) // _SEARCH)

    def waste(k1: int) -> float:
        per_drive, _ = _drive_every(k1, iteration_s, drive, m2, floor_s)
        return (waste_fraction(k1 * iteration_s, c1, m1, r1)
                + waste_fraction(k1 * per_drive * iteration_s, drive.cost_s, m2, drive.restore_s))

    k1 = min({*range(low, top + 1, step), min(k1_alone, top)}, key=waste)
    per_drive, wear_bound = _drive_every(k1, iteration_s, drive, m2, floor_s)
    limit1 = ("iteration" if k1 == 1 and daly_interval(c1, m1) < iteration_s
              else "drive_every" if k1_alone > k2_alone else "failures")
    return k1, k1 * per_drive, limit1, "wear" if wear_bound else "failures"


_SEARCH = 4096  # memory_every candidates at most


def _drive_every(k1: int, iteration_s: float, drive: Tier, m2: float, floor_s: float
                 ) -> tuple[int, bool]:
    """Memory steps per drive step with ``memory_every = k1``, and whether wear sets it."""
    unit = k1 * iteration_s
    by_failures = _best_every(daly_interval(drive.cost_s, m2), unit, drive.cost_s, m2,
                              drive.restore_s)
    by_wear = _at_least(floor_s, unit)
    return max(by_failures, by_wear), by_wear > by_failures


def _plan(every: int, iteration_s: float, cost: float, mtbf: float, restore: float, limit: str
          ) -> LevelPlan:
    t = every * iteration_s
    return LevelPlan(every, t, cost, mtbf, young_interval(cost, mtbf), daly_interval(cost, mtbf),
                     waste_fraction(t, cost, mtbf, restore), limit)


def advise_levels(iteration_s: float, memory: Tier, drive: Tier, failures: Failures, *,
                  replica: Tier | None = None, replicas: int = 1,
                  drive_bytes: float | None = None, budget: Endurance | None = None,
                  wear_share: float = 1.0) -> LevelAdvice:
    """``memory_every`` and ``drive_every`` for checkpoints stalling training ``memory.cost_s``
    (+ ``replica.cost_s`` with ``replicas >= 1``; no ``replica``: a copy that costs nothing)
    and ``drive.cost_s``, with the given failures.

    ``drive_bytes``: the bytes one drive takes per drive checkpoint (its share of the
    checkpoint, times any write amplification); with ``budget``, ``drive_every`` never writes
    more than ``wear_share`` of the drive's rated endurance."""
    if replicas < 0:
        raise ValueError(f"replicas={replicas}: must be >= 0")
    replica = (replica or Tier(0.0)) if replicas else None
    _check({"memory": memory, "replica": replica, "drive": drive}, failures, iteration_s)
    if drive_bytes is not None and not (math.isfinite(drive_bytes) and drive_bytes > 0):
        raise ValueError(f"{drive_bytes} bytes per drive checkpoint: must be positive")
    if budget is not None and drive_bytes is None:
        raise ValueError("the drive's endurance needs the checkpoint size (the bytes each "
                         "drive takes per checkpoint) to compare writes against it")
    mtbf = {name: getattr(failures, f"{name}_mtbf_s") for name in CLASSES}
    level = {"process": 1, "node": 1 if replica else 2, "replica_loss": 2}
    lam1 = _rate([mtbf[n] for n in CLASSES if level[n] == 1])
    lam2 = _rate([mtbf[n] for n in CLASSES if level[n] == 2])
    if lam1 == 0:
        raise ValueError("no failures that the memory tier recovers: give the process "
                         "failures' MTBF" + (" or the node failures'" if replica else
                                             " (or replicas >= 1 and the node failures')"))
    if lam2 == 0:
        raise ValueError("no failures that only the drive recovers: give the MTBF of losing a "
                         "node with its replicas (correlated failures, power, the whole job)")
    restore = {"process": memory.restore_s, "node": (replica or drive).restore_s,
               "replica_loss": drive.restore_s}
    c1 = memory.cost_s + (replica.cost_s if replica else 0.0)
    r1 = sum(restore[n] / mtbf[n] for n in CLASSES if level[n] == 1) / lam1
    floor_s = (wear_interval(drive_bytes, budget, wear_share)
               if budget is not None and drive_bytes is not None else None)
    k1, k2, limit1, limit2 = _intervals(iteration_s, c1, 1 / lam1, r1, drive, 1 / lam2,
                                        floor_s or 0.0)
    plans = {1: _plan(k1, iteration_s, c1, 1 / lam1, r1, limit1),
             2: _plan(k2, iteration_s, drive.cost_s, 1 / lam2, drive.restore_s, limit2)}
    lost = {n: lost_work(plans[level[n]].interval_s, plans[level[n]].cost_s,
                         plans[level[n]].mtbf_s, restore[n])
            for n in CLASSES if math.isfinite(mtbf[n])}
    where = {"process": "memory", "node": "replica" if replica else "drive",
             "replica_loss": "drive"}
    advice = LevelAdvice(iteration_s, replicas if replica else 0, plans[1], plans[2],
                         plans[1].waste + plans[2].waste, lost, {n: where[n] for n in lost},
                         floor_s)
    if drive_bytes is not None:
        advice.wear = wear(drive_bytes, plans[2].interval_s, iteration_s, budget, wear_share)
    return advice


_CLASS_NAMES = {"process": "process", "node": "node", "replica_loss": "node + replicas"}


def _level_lines(name: str, p: LevelPlan, what: str) -> list[str]:
    d = format_duration
    return [f"{name} = {p.every} iterations = {d(p.interval_s)}: stall {d(p.cost_s)} {what}, "
            f"MTBF of the failures it recovers {d(p.mtbf_s)}",
            f"  Young sqrt(2CM) {d(p.young_interval_s)}, Daly {d(p.daly_interval_s)}; "
            f"waste {100 * p.waste:.3f}% of wall time"]


def describe_levels(a: LevelAdvice) -> list[str]:
    """The advice as lines of text."""
    what = f"(memory + {a.replicas} replica(s))" if a.replicas else "(memory)"
    lines = [f"iteration {format_duration(a.iteration_s)}"]
    lines += _level_lines("memory_every", a.memory, what)
    if a.memory.limited_by != "failures":
        lines.append("  (no finer than one iteration)" if a.memory.limited_by == "iteration"
                     else "  (no sparser than drive_every: a drive step is a memory step too; "
                     "a memory tier dearer than the drive may not pay: compare the one-level "
                     "advice, --cost and --mtbf of all failures)")
    lines += _level_lines("drive_every", a.drive, "(drive)")
    lines.append("expected lost work per failure (work redone + restore):")
    lines += [f"  {_CLASS_NAMES[n]:<16} from {a.recovered_from[n]:<8} {format_duration(s)}"
              for n, s in a.lost_per_failure_s.items()]
    if a.wear is not None:
        lines += describe_wear(a.wear, a.drive.daly_interval_s, a.drive.limited_by == "wear",
                               a.wear_interval_s)
    lines.append(f"waste of both levels {100 * a.waste:.3f}% of wall time")
    return lines


TIER_SLACK = 1 << 20  # a share's manifest and lock files, generously (as the tier counts it)


def tier_bytes_per_node(checkpoint_bytes: float, nodes: int, replicas: int,
                        ranks_per_node: int = 1) -> float:
    """What the memory tier needs on each node: every rank keeps its byte-range share of the
    replicated state and each node also holds ``replicas`` copies of other nodes' shares, so
    ``(1 + replicas) x state x ranks_on_node / world`` = ``(1 + replicas) x state / nodes``, plus
    a manifest per share (``(1 + replicas) x ranks_per_node`` of them). The older step stays
    until the new one is committed everywhere: the tmpfs needs room for two steps at a time."""
    return (1 + replicas) * (checkpoint_bytes / nodes + ranks_per_node * TIER_SLACK)


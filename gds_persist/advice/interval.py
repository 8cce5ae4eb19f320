"""How often to checkpoint: Young's and Daly's optimal interval, and what it costs.

With a checkpoint that stalls training for ``C`` seconds, failures arriving at random with mean
time ``M`` between them (exponential), and ``R`` seconds to restart after one:

* Young (1974): ``T = sqrt(2 C M)``.
* Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart dumps"):
  ``T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, else ``T = M``.
* Expected wall time per second of useful work with interval ``T`` (Daly's model):
  ``M * exp(R / M) * (exp((T + C) / M) - 1) / T``; the *waste* is the fraction of wall time that
  is not useful work (checkpoint stalls, recomputed work, restarts).
* Work lost per failure: the expected time since the last completed checkpoint,
  ``M - L / (exp(L / M) - 1)`` with ``L = T + C`` (about ``L / 2`` when ``L << M``), plus ``R``.

Per-iteration checkpointing (``T`` = one iteration) is the optimum when a checkpoint costs at most
about ``t**2 / 2M`` of stall (``t`` = iteration time): far below a blocking write, within reach of
one that overlaps training and stalls only for its exposed part.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .units import format_duration
from .wear import Endurance, Wear, describe_wear, wear, wear_interval


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def waste_fraction(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0
                   ) -> float:
    """Fraction of wall time not spent on useful work, checkpointing every ``interval_s``."""
    wall_per_work = (mtbf_s * math.exp(restart_s / mtbf_s)
                     * math.expm1((interval_s + cost_s) / mtbf_s) / interval_s)
    return 1.0 - 1.0 / wall_per_work


def lost_work(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected seconds of work redone plus restart time per failure."""
    span = interval_s + cost_s
    ratio = span / mtbf_s
    since_last = span / 2.0 if ratio < 1e-6 else mtbf_s - span / math.expm1(ratio)
    return since_last + restart_s


@dataclass
class Plan:
    """Checkpointing every ``interval_s`` with a ``cost_s`` stall each time."""

    interval_s: float
    cost_s: float
    waste: float  # fraction of wall time
    lost_per_failure_s: float
    interval_iterations: float | None = None


@dataclass
class Advice:
    mtbf_s: float
    restart_s: float
    young_interval_s: float
    optimal: Plan  # Daly's interval with the given cost
    iteration_s: float | None = None
    per_iteration: Plan | None = None  # checkpoint every iteration with the overlapped cost
    per_iteration_break_even_cost_s: float | None = None  # per-iteration optimal below this cost
    daly_interval_s: float | None = None  # what failures alone set (optimal unless wear-bound)
    limited_by: str = "failures"  # failures | iteration | wear
    wear_interval_s: float | None = None  # the endurance budget's shortest interval
    wear: Wear | None = None  # the drive's writes at the optimal interval

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _plan(interval: float, cost: float, mtbf: float, restart: float, iteration: float | None
          ) -> Plan:
    return Plan(interval, cost, waste_fraction(interval, cost, mtbf, restart),
                lost_work(interval, cost, mtbf, restart),
                interval / iteration if iteration else None)


def advise(cost_s: float, mtbf_s: float, *, restart_s: float = 0.0,
           iteration_s: float | None = None, per_iteration_cost_s: float | None = None,
           drive_bytes: float | None = None, budget: Endurance | None = None,
           wear_share: float = 1.0) -> Advice:
    """The optimal interval for checkpoints stalling ``cost_s``, and, given an iteration time,
    what checkpointing every iteration with a stall of ``per_iteration_cost_s`` would waste.

    ``drive_bytes``: what one drive takes per checkpoint; with ``budget``, the interval never
    writes more than ``wear_share`` of the drive's rated endurance (:mod:`.wear`)."""
    if mtbf_s <= 0:
        raise ValueError(f"mtbf={mtbf_s} must be positive")
    if cost_s < 0 or restart_s < 0:
        raise ValueError("checkpoint cost and restart time must be >= 0")
    if budget is not None and drive_bytes is None:
        raise ValueError("the drive's endurance needs the checkpoint size (the bytes each "
                         "drive takes per checkpoint) to compare writes against it")
    daly = daly_interval(cost_s, mtbf_s) if cost_s > 0 else 0.0
    interval = max(daly, iteration_s or 0.0)  # no finer than one iteration
    floor = None if budget is None or drive_bytes is None else wear_interval(drive_bytes, budget,
                                                                             wear_share)
    limited_by = ("wear" if floor is not None and floor > interval
                  else "iteration" if interval > daly else "failures")
    interval = max(interval, floor or 0.0)
    if interval <= 0:
        raise ValueError("a checkpoint that costs nothing has no optimal interval; give "
                         "--iteration-time to checkpoint every iteration")
    a = Advice(mtbf_s, restart_s, young_interval(cost_s, mtbf_s),
               _plan(interval, cost_s, mtbf_s, restart_s, iteration_s), daly_interval_s=daly,
               limited_by=limited_by, wear_interval_s=floor)
    if drive_bytes is not None:
        a.wear = wear(drive_bytes, interval, iteration_s, budget, wear_share)
    if iteration_s:
        a.iteration_s = iteration_s
        a.per_iteration_break_even_cost_s = iteration_s**2 / (2.0 * mtbf_s)
        per_cost = cost_s if per_iteration_cost_s is None else per_iteration_cost_s
        a.per_iteration = _plan(iteration_s, per_cost, mtbf_s, restart_s, iteration_s)
    return a


def describe(a: Advice) -> list[str]:
    """The advice as lines of text."""
    o = a.optimal
    at = format_duration(o.interval_s) + (f" = {o.interval_iterations:.1f} iterations"
                                          if o.interval_iterations else "")
    lines = [
        f"MTBF {format_duration(a.mtbf_s)}, restart {format_duration(a.restart_s)}, "
        f"checkpoint stall {format_duration(o.cost_s)}",
        f"Young interval sqrt(2CM):  {format_duration(a.young_interval_s)}",
        *([f"Daly interval:             {format_duration(a.daly_interval_s or 0.0)}",
           f"Wear-limited interval:     {at}"] if a.limited_by == "wear" else
          [f"Daly interval (optimal):   {at}"]),
        f"  expected lost work per failure {format_duration(o.lost_per_failure_s)}, "
        f"waste {100 * o.waste:.3f}% of wall time",
    ]
    p = a.per_iteration
    if p is not None and a.iteration_s is not None and a.per_iteration_break_even_cost_s:
        lines += [
            f"Every iteration ({format_duration(a.iteration_s)}) with a stall of "
            f"{format_duration(p.cost_s)}:",
            f"  expected lost work per failure {format_duration(p.lost_per_failure_s)}, "
            f"waste {100 * p.waste:.3f}% of wall time",
            f"  per-iteration checkpointing is the optimum when a checkpoint stalls training at "
            f"most {format_duration(a.per_iteration_break_even_cost_s)} "
            f"({100 * a.per_iteration_break_even_cost_s / a.iteration_s:.3g}% of an iteration)",
        ]
        better = "pays off" if p.waste <= o.waste else "does not pay off"
        lines.append(f"  => per-iteration checkpointing {better} here "
                     f"({100 * p.waste:.3f}% vs {100 * o.waste:.3f}% waste)")
    if a.wear is not None:
        lines += describe_wear(a.wear, a.daly_interval_s or 0.0, a.limited_by == "wear",
                               a.wear_interval_s)
    return lines

"""Flash wear: the bytes a drive takes per day from checkpoints, against its rated endurance.

Drives rate endurance as TBW (terabytes written over the warranty, decimal TB) or DWPD (full
drive writes per day over the warranty; ``DWPD x capacity`` bytes a day). Either way the rating
is a daily budget: ``TBW / (365 x warranty years)``, or ``DWPD x capacity``. Checkpoints are large
sequential writes of whole new files, so the drive's own write amplification is near 1; a share
below 1 leaves the rest of the budget to datasets, logs and everything else on the drive.

Checkpointing every ``T`` seconds, each drive's flash taking ``b`` bytes per checkpoint (the
bytes written times the write amplification), writes ``b x 86400 / T`` bytes a day; the budget
therefore sets a shortest drive interval ``T_wear = b x 86400 / (budget x share)``.
Per-iteration checkpoints of a 13B model (14 B/param, 182 GB) to one drive at one iteration a
second write 15.7 PB a day; a 3.84 TB drive rated 1 DWPD takes 3.84 TB a day, one such checkpoint
every 68 minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .units import format_bytes, format_duration

DAY_S = 86400.0
YEAR_DAYS = 365.0


@dataclass(frozen=True)
class Endurance:
    """A drive's rated write budget."""

    bytes_per_day: float
    warranty_years: float
    rating: str  # how it was given, for the report

    @property
    def total_bytes(self) -> float:
        return self.bytes_per_day * YEAR_DAYS * self.warranty_years


def endurance(*, tbw: float | None = None, dwpd: float | None = None,
              capacity_bytes: float | None = None, warranty_years: float = 5.0) -> Endurance:
    """The daily budget from a TBW rating, or from DWPD and the drive's capacity."""
    if not (math.isfinite(warranty_years) and warranty_years > 0):
        raise ValueError(f"warranty of {warranty_years} years: must be positive")
    if (tbw is None) == (dwpd is None):
        raise ValueError("give the drive's endurance as TBW or as DWPD with its capacity, "
                         "not both and not neither")
    if tbw is not None:
        _positive(tbw, "TBW (terabytes written)")
        return Endurance(tbw * 1e12 / (YEAR_DAYS * warranty_years), warranty_years,
                         f"{tbw:g} TBW over {warranty_years:g} years")
    assert dwpd is not None
    _positive(dwpd, "DWPD (drive writes per day)")
    if capacity_bytes is None:
        raise ValueError("a DWPD rating needs the drive's capacity (e.g. --drive-capacity "
                         "3.84TB)")
    _positive(capacity_bytes, "drive capacity")
    return Endurance(dwpd * capacity_bytes, warranty_years,
                     f"{dwpd:g} DWPD x {capacity_bytes / 1e12:.3g} TB over {warranty_years:g} "
                     "years")


def _positive(value: float, what: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} = {value}: must be positive")


def writes_per_day(bytes_per_checkpoint: float, interval_s: float) -> float:
    """Bytes a drive takes per day with one checkpoint of ``bytes_per_checkpoint`` every
    ``interval_s``."""
    return bytes_per_checkpoint * DAY_S / interval_s


def wear_interval(bytes_per_checkpoint: float, budget: Endurance, share: float = 1.0) -> float:
    """The shortest interval (s) whose writes stay within ``share`` of the endurance budget."""
    if not (0 < share <= 1):
        raise ValueError(f"wear share {share}: the fraction of the drive's endurance that "
                         "checkpoints may use must be in (0, 1]")
    return bytes_per_checkpoint * DAY_S / (budget.bytes_per_day * share)


@dataclass
class Wear:
    """What one drive's checkpoint writes do to it."""

    bytes_per_checkpoint: float  # per drive, write amplification included
    interval_s: float
    bytes_per_day: float
    per_iteration_bytes_per_day: float | None = None  # drive checkpoints every iteration
    budget_bytes_per_day: float | None = None  # the rating x share
    rating: str | None = None
    fraction_of_budget: float | None = None
    lifetime_years: float | None = None  # to the rated endurance, checkpoints alone


def wear(bytes_per_checkpoint: float, interval_s: float, iteration_s: float | None,
         budget: Endurance | None, share: float = 1.0) -> Wear:
    w = Wear(bytes_per_checkpoint, interval_s, writes_per_day(bytes_per_checkpoint, interval_s))
    if iteration_s:
        w.per_iteration_bytes_per_day = writes_per_day(bytes_per_checkpoint, iteration_s)
    if budget is not None:
        w.budget_bytes_per_day = budget.bytes_per_day * share
        w.rating = budget.rating
        w.fraction_of_budget = w.bytes_per_day / w.budget_bytes_per_day
        w.lifetime_years = budget.total_bytes / w.bytes_per_day / YEAR_DAYS
    return w


def describe_wear(w: Wear, failure_interval_s: float, wear_bound: bool, floor_s: float | None
                  ) -> list[str]:
    """The drive's writes as lines of text; ``failure_interval_s``: the interval failures alone
    would set, ``wear_bound``: whether the budget's ``floor_s`` replaced it."""
    lines = [f"drive writes: {format_bytes(w.bytes_per_checkpoint)} per drive per checkpoint, "
             f"{format_bytes(w.bytes_per_day)}/day at this interval"]
    budget = w.budget_bytes_per_day
    if w.per_iteration_bytes_per_day is not None:
        lines.append(f"  a drive checkpoint every iteration would write "
                     f"{format_bytes(w.per_iteration_bytes_per_day)}/day"
                     + (f", {_times(w.per_iteration_bytes_per_day / budget)} the endurance "
                        "budget" if budget else ""))
    if budget is None or w.fraction_of_budget is None or w.lifetime_years is None:
        return lines + ["  (no endurance given: --drive-tbw, or --drive-dwpd with "
                        "--drive-capacity, checks these against the drive's rating)"]
    lines.append(f"  endurance budget {format_bytes(budget)}/day ({w.rating}): this interval "
                 f"uses {100 * w.fraction_of_budget:.1f}% of it, the rated endurance lasts "
                 f"{w.lifetime_years:.3g} years")
    if wear_bound:
        at_failures = writes_per_day(w.bytes_per_checkpoint, failure_interval_s)
        lines.append(f"  => wear, not failures, sets the drive interval: Daly's "
                     f"{format_duration(failure_interval_s)} would write "
                     f"{format_bytes(at_failures)}/day, {_times(at_failures / budget)} the budget")
    elif floor_s is not None:
        lines.append(f"  => failures set the drive interval; the budget allows one every "
                     f"{format_duration(floor_s)}")
    return lines


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"

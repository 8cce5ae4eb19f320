"""Every level's interval: Young/Daly per level for node-local levels and the durable level.

The levels go nearest first: node-local levels (tmpfs, the node's NVMe), each with ``copies`` of
a node's share on other nodes, then the durable level (the Checkpointer's root: a shared
directory or an object store), flushed in the background from the newest local copy. Each
failure class is recovered by the nearest level that holds what the failure destroyed:

* ``process`` (crash, OOM, hang): the nearest level;
* ``node`` (one node lost with its memory and drives): the nearest level with ``copies >= 1``;
* ``reboot`` (every node restarts; memory is lost, drives keep their files): the nearest
  drive-backed level;
* ``replica_loss`` (a node with the nodes holding its copies, or the whole job): only the durable
  level.

The durable level recovers every class its nearer levels do not. To first order the wasted
fraction of wall time is ``H = sum_l C_l / T_l + lambda_l (T_l / 2 + R_l)`` (Benoit et al., IEEE
TC 2017), which separates by level: ``T_l = sqrt(2 C_l M_l)`` with ``M_l = 1 / lambda_l`` the MTBF
of the classes level ``l`` recovers, and ``H* = sum_l sqrt(2 lambda_l C_l) + lambda_l R_l``. Per
level we take Daly's refinement (:func:`.interval.daly_interval`), then the floors: one iteration,
the drive's endurance for a drive-backed level (:func:`.wear.wear_interval`, its budget split
evenly between the drive-backed levels), the flush time for the durable level (a flush must end
before the next one starts, and a step is durable only ``F`` after it: ``F`` joins the work
redone). Nesting: every level's interval is a whole multiple of the nearer one's (a durable step
is flushed from a local step). A nearer level is never sparser than a farther one, and a level
that recovers no class of its own goes as often as the next one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .interval import daly_interval, lost_work, waste_fraction, young_interval
from .units import format_duration
from .wear import Endurance, Wear, describe_wear, wear, wear_interval

LOCAL_KINDS = ("memory", "drive")  # tmpfs or RAM (no wear) | the node's NVMe (wear)
DURABLE_KINDS = ("store", "drive")  # an object store or shared directory | a local drive
CLASSES = ("process", "node", "reboot", "replica_loss")
FIX = 'docs/TRAINING.md, "Choosing every level\'s interval"'


@dataclass(frozen=True)
class Level:
    """One level checkpoints go to, nearest first.

    Parameters
    ----------
    name : a label for the report.
    stall_s : seconds one checkpoint of this level stalls training (measured or given).
    restore_s : seconds a restore from this level takes.
    kind : ``memory`` or ``drive`` (node-local); ``store`` or ``drive`` (durable).
    copies : node-local levels: copies of a node's share on other nodes.
    durable : the Checkpointer's root, the last level.
    flush_s : durable level: seconds its background flush from the newest local copy takes.
    bytes_per_drive : drive-backed levels: bytes one drive's flash takes per checkpoint.
    """

    name: str
    stall_s: float
    restore_s: float = 0.0
    kind: str = "memory"
    copies: int = 0
    durable: bool = False
    flush_s: float = 0.0
    bytes_per_drive: float | None = None

    def recovers(self, failure: str) -> bool:
        """Whether a checkpoint of this level survives ``failure`` (a class of ``CLASSES``).

        Parameters
        ----------
        failure : ``process``, ``node``, ``reboot`` or ``replica_loss``.
        """
        if self.durable or failure == "process":
            return True
        return {"node": self.copies >= 1, "reboot": self.kind == "drive"}.get(failure, False)


@dataclass(frozen=True)
class LevelFailures:
    """Mean time between failures of each class, for the whole job (``inf``: none).

    Parameters
    ----------
    process_mtbf_s : a process dies (crash, OOM, hang).
    node_mtbf_s : a node is lost with its memory and drives.
    reboot_mtbf_s : every node restarts: memory lost, drives kept.
    replica_loss_mtbf_s : a node with its copy holders, or the whole job.
    """

    process_mtbf_s: float = math.inf
    node_mtbf_s: float = math.inf
    reboot_mtbf_s: float = math.inf
    replica_loss_mtbf_s: float = math.inf


@dataclass
class LevelResult:
    """One level's recommended interval, why, and what it costs."""

    name: str
    kind: str
    every: int  # iterations
    interval_s: float
    stall_s: float
    restore_s: float
    recovers: list[str]  # failure classes this level is the nearest to recover
    mtbf_s: float | None  # of those classes (None: it recovers none of its own)
    young_interval_s: float | None
    daly_interval_s: float | None
    limited_by: str  # failures | iteration | wear | flush | nearer | farther | none_of_its_own
    why: str
    waste: float  # fraction of wall time, Daly's model for this level alone
    copies: int = 0
    flush_s: float | None = None
    wear_floor_s: float | None = None
    wear: Wear | None = None


@dataclass
class MultiLevelAdvice:
    iteration_s: float
    levels: list[LevelResult]
    waste: float  # every level (first order: the sum)
    first_order_waste: float  # H* of the closed form, before rounding, floors and nesting
    lost_per_failure_s: dict[str, float] = field(default_factory=dict)
    recovered_from: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bad(text: str) -> ValueError:
    return ValueError(f"{text} ({FIX})")


def _check(iteration_s: float, levels: list[Level], failures: LevelFailures,
           budget: Endurance | None) -> None:
    if not (math.isfinite(iteration_s) and iteration_s > 0):
        raise _bad(f"iteration time {iteration_s} s: must be positive (intervals count "
                   "iterations)")
    if not levels or not levels[-1].durable or any(v.durable for v in levels[:-1]):
        raise _bad("levels go nearest first and end with the one durable level (the "
                   "Checkpointer's root): give it last, once")
    names = [v.name for v in levels]
    if len(set(names)) != len(names) or not all(names):
        raise _bad(f"level names {names}: give each level a distinct, non-empty name")
    for v in levels:
        _check_level(v, budget)
    for name, mtbf in asdict(failures).items():
        if not mtbf > 0:
            raise _bad(f"{name} = {mtbf}: a mean time between failures must be positive "
                       "(leave it out for a class of failures that does not happen)")


def _check_level(v: Level, budget: Endurance | None) -> None:
    kinds = DURABLE_KINDS if v.durable else LOCAL_KINDS
    where = "the durable level" if v.durable else f"level {v.name!r}"
    if v.kind == "store" and not v.durable:
        raise _bad(f"{where}: kind 'store' is the durable level's (an object store or shared "
                   "directory): give it as the durable level (--durable), last")
    if v.kind not in kinds:
        raise _bad(f"{where}: unknown kind {v.kind!r}; use one of {', '.join(kinds)}")
    for what, value in (("stall", v.stall_s), ("restore", v.restore_s), ("flush", v.flush_s)):
        if not (math.isfinite(value) and value >= 0):
            raise _bad(f"{where}: {what} {value} s must be finite and >= 0")
    if not (isinstance(v.copies, int) and v.copies >= 0) or (v.durable and v.copies):
        raise _bad(f"{where}: copies {v.copies!r} must be a whole number >= 0 (and 0 on the "
                   "durable level: it is shared)")
    if v.flush_s and not v.durable:
        raise _bad(f"{where}: only the durable level has a flush time")
    if v.bytes_per_drive is not None and not (v.kind == "drive" and v.bytes_per_drive > 0
                                              and math.isfinite(v.bytes_per_drive)):
        raise _bad(f"{where}: bytes per drive {v.bytes_per_drive} need a drive-backed level "
                   "and a positive size")
    if budget is not None and v.kind == "drive" and v.bytes_per_drive is None:
        raise _bad(f"{where}: the drive's endurance needs the bytes each drive takes per "
                   "checkpoint (the checkpoint's size) to compare writes against it")


def _owners(levels: list[Level], failures: LevelFailures) -> dict[str, int]:
    """Failure class (of those that happen) -> the nearest level recovering it."""
    mtbf = asdict(failures)
    return {c: next(i for i, v in enumerate(levels) if v.recovers(c))
            for c in CLASSES if math.isfinite(mtbf[f"{c}_mtbf_s"])}


@dataclass
class _Need:
    """One level's inputs to the interval search."""

    level: Level
    rate: float  # of the failures it recovers
    restart_s: float  # restore (+ the flush: a step is durable only once flushed)
    target_s: float  # Daly's interval; inf: no failures of its own
    floors: dict[str, float]  # iteration | wear | flush -> seconds

    @property
    def mtbf_s(self) -> float:
        return 1.0 / self.rate if self.rate else math.inf


def _needs(iteration_s: float, levels: list[Level], owners: dict[str, int],
           failures: LevelFailures, budget: Endurance | None, share: float) -> list[_Need]:
    mtbf = asdict(failures)
    drives = sum(v.kind == "drive" for v in levels)
    out = []
    for i, v in enumerate(levels):
        rate = sum(1.0 / mtbf[f"{c}_mtbf_s"] for c, owner in owners.items() if owner == i)
        target = (math.inf if rate == 0 else daly_interval(v.stall_s, 1 / rate) if v.stall_s
                  else 0.0)
        floors = {"iteration": iteration_s}
        if v.kind == "drive" and budget is not None and v.bytes_per_drive is not None:
            floors["wear"] = wear_interval(v.bytes_per_drive, budget, share / drives)
        if v.durable and v.flush_s:
            floors["flush"] = v.flush_s
        out.append(_Need(v, rate, v.restore_s + v.flush_s, target, floors))
    return out


def _best_multiple(target_s: float, unit_s: float, need: _Need) -> int:
    """Whole multiples of ``unit_s`` nearest ``target_s``: the one of least waste (>= 1); the
    waste is unimodal in the interval, so the optimum is the floor or the ceiling."""
    low = max(1, math.floor(target_s / unit_s * (1 + 1e-12)))
    if not need.rate:
        return low
    return min((low, low + 1), key=lambda n: waste_fraction(
        n * unit_s, need.level.stall_s, need.mtbf_s, need.restart_s))


def _at_least(min_s: float, unit_s: float) -> int:
    return max(1, math.ceil(min_s / unit_s * (1 - 1e-12)))


def _intervals(iteration_s: float, needs: list[_Need]) -> tuple[list[int], list[str]]:
    """Iterations per checkpoint of each level, nested, and what set each."""
    lows, low = [], 0.0  # a level is never more frequent than a nearer one's floors allow
    for n in needs:
        low = max(low, *n.floors.values())
        lows.append(low)
    wants = [max(n.target_s, lo) for n, lo in zip(needs, lows, strict=True)]
    caps = list(wants)  # nor sparser than a farther one
    for i in range(len(caps) - 2, -1, -1):
        caps[i] = min(caps[i], caps[i + 1])
    search = _Search(iteration_s, needs, lows, caps)
    return search.every(), [_limit(i, n, needs, lows, wants, caps)
                            for i, n in enumerate(needs)]


_SEARCH = 256  # candidate multiples per level at most


@dataclass
class _Search:
    """Whole, nested intervals: level by level, nearest first, the multiple of the nearer level's
    interval whose completion (each farther level at its own best multiple) wastes least. A
    level's waste is flat near its optimum, so moving it a little lets the farther ones nest
    close to theirs. A level with no failures of its own takes the next one's interval."""

    iteration_s: float
    needs: list[_Need]
    lows: list[float]
    caps: list[float]

    def every(self) -> list[int]:
        rated = [i for i, n in enumerate(self.needs) if n.rate or i == len(self.needs) - 1]
        chosen: list[int] = []
        for pos, i in enumerate(rated):
            unit = chosen[-1] if chosen else 1
            best = self._multiple(i, unit)
            low = _at_least(self.lows[i], unit * self.iteration_s)
            span = range(max(low, math.floor(best / 1.5)), math.ceil(best * 1.5) + 1)
            step = max(1, len(span) // _SEARCH)
            chosen.append(unit * min({best, *span[::step]}, key=lambda m: self._waste(
                rated, [*chosen, unit * m], pos + 1)))
        return self._expand(rated, chosen)

    def _multiple(self, i: int, unit: int) -> int:
        unit_s = unit * self.iteration_s
        return max(_best_multiple(self.caps[i], unit_s, self.needs[i]),
                   _at_least(self.lows[i], unit_s))

    def _expand(self, rated: list[int], chosen: list[int]) -> list[int]:
        return [chosen[next(p for p, r in enumerate(rated) if r >= i)]
                for i in range(len(self.needs))]

    def _waste(self, rated: list[int], chosen: list[int], pos: int) -> float:
        chosen = list(chosen)
        for i in rated[pos:]:
            chosen.append(chosen[-1] * self._multiple(i, chosen[-1]))
        return sum(_waste(n, k * self.iteration_s)
                   for n, k in zip(self.needs, self._expand(rated, chosen), strict=True))


def _waste(n: _Need, interval_s: float) -> float:
    """The fraction of wall time a level wastes: Daly's model, its stalls alone without
    failures of its own."""
    if not n.rate:
        return n.level.stall_s / interval_s
    return waste_fraction(interval_s, n.level.stall_s, n.mtbf_s, n.restart_s)


def _limit(i: int, n: _Need, needs: list[_Need], lows: list[float], wants: list[float],
           caps: list[float]) -> str:
    """What sets level ``i``'s interval; a nesting limit names the level it comes from."""
    if n.rate == 0:
        return f"none_of_its_own:{needs[i + 1].level.name}"
    if caps[i] < wants[i]:
        j = next(j for j in range(i + 1, len(needs)) if wants[j] == caps[i])
        return f"farther:{needs[j].level.name}"
    own = max(n.floors.items(), key=lambda kv: kv[1])
    if n.target_s >= lows[i]:
        return "failures"
    if own[1] >= lows[i]:
        return own[0]
    j = next(j for j in range(i) if max(needs[j].floors.values()) >= lows[i])
    return f"nearer:{needs[j].level.name}"


def _why(limit: str, need: _Need) -> str:
    label, _, other = limit.partition(":")
    v = need.level
    return {
        "failures": "failures: Daly's optimum for its stall and the failures it recovers, "
                    "in whole iterations nested with the other levels",
        "iteration": "one iteration: Daly's optimum is shorter",
        "wear": f"wear floor: more often would write over the drive's endurance budget "
                f"(Daly's optimum {format_duration(need.target_s)})",
        "flush": f"flush-time floor: a flush takes {format_duration(v.flush_s)} "
                 f"(Daly's optimum {format_duration(need.target_s)})",
        "nearer": f"nesting: no more often than the floor of {other}, a nearer level",
        "farther": f"nesting: no sparser than {other} (its steps are {v.name} steps too; "
                   "this level may not pay)",
        "none_of_its_own": f"nesting: recovers no failure a nearer level does not, so as often "
                           f"as {other}",
    }[label]


def advise_multilevel(iteration_s: float, levels: list[Level], failures: LevelFailures, *,
                      budget: Endurance | None = None, wear_share: float = 1.0
                      ) -> MultiLevelAdvice:
    """Every level's interval in iterations: Young/Daly per level, nested, within the drives'
    endurance and the durable level's flush time.

    Parameters
    ----------
    iteration_s : seconds per training iteration.
    levels : nearest first, ending with the durable level (``Level(durable=True)``).
    failures : the MTBF of each failure class for the whole job.
    budget : the drives' rated endurance (:func:`.wear.endurance`); split evenly between the
        drive-backed levels, which then need ``bytes_per_drive``.
    wear_share : the fraction of that endurance checkpoints may use.

    Raises
    ------
    ValueError : bad input, naming the fix.
    """
    _check(iteration_s, levels, failures, budget)
    if not 0 < wear_share <= 1:
        raise _bad(f"wear share {wear_share}: the fraction of the drive's endurance that "
                   "checkpoints may use must be in (0, 1]")
    owners = _owners(levels, failures)
    if len(levels) - 1 not in owners.values():
        raise _bad("no failure that only the durable level recovers: give the MTBF of losing "
                   "a node with its copy holders, or the whole job (--replica-loss-mtbf)")
    needs = _needs(iteration_s, levels, owners, failures, budget, wear_share)
    every, limits = _intervals(iteration_s, needs)
    results = [_result(i, n, k * iteration_s, k, limits[i], owners, levels, iteration_s,
                       budget, wear_share)
               for i, (n, k) in enumerate(zip(needs, every, strict=True))]
    mtbf = asdict(failures)
    lost = {c: lost_work(results[i].interval_s, levels[i].stall_s, mtbf[f"{c}_mtbf_s"],
                         needs[i].restart_s) for c, i in owners.items()}
    h_star = sum(math.sqrt(2 * n.rate * n.level.stall_s) + n.rate * n.restart_s for n in needs)
    return MultiLevelAdvice(iteration_s, results, sum(r.waste for r in results), h_star, lost,
                            {c: levels[i].name for c, i in owners.items()})


def _result(i: int, n: _Need, interval: float, every: int, limit: str, owners: dict[str, int],
            levels: list[Level], iteration_s: float, budget: Endurance | None, share: float
            ) -> LevelResult:
    v = n.level
    rated = n.rate > 0
    r = LevelResult(
        v.name, v.kind, every, interval, v.stall_s, v.restore_s,
        [c for c, owner in owners.items() if owner == i], n.mtbf_s if rated else None,
        young_interval(v.stall_s, n.mtbf_s) if rated else None,
        n.target_s if rated else None, limit, "",
        _waste(n, interval), v.copies, v.flush_s if v.durable else None,
        n.floors.get("wear"))
    r.why = _why(limit, n)
    r.limited_by = limit.partition(":")[0]
    if v.kind == "drive" and v.bytes_per_drive is not None:
        drives = sum(x.kind == "drive" for x in levels)
        r.wear = wear(v.bytes_per_drive, interval, iteration_s, budget, share / drives)
    return r


_CLASS_NAMES = {"process": "process", "node": "node", "reboot": "reboot",
                "replica_loss": "node + copy holders"}


def _heading(r: LevelResult) -> str:
    extra = (f"flush {format_duration(r.flush_s)}" if r.flush_s is not None
             else f"{r.copies} cop{'y' if r.copies == 1 else 'ies'}")
    return (f"{r.name} ({r.kind}, {extra}): every {r.every} iterations = "
            f"{format_duration(r.interval_s)}")


def _level_lines(r: LevelResult) -> list[str]:
    d = format_duration
    recovers = (f"recovers {', '.join(_CLASS_NAMES[c] for c in r.recovers)} (MTBF "
                f"{d(r.mtbf_s)})" if r.mtbf_s is not None else "recovers nothing of its own")
    lines = [_heading(r), f"  stall {d(r.stall_s)}, restore {d(r.restore_s)}; {recovers}"]
    if r.stall_s == 0:
        lines.append(f"  no stall: as often as its floors allow; waste {100 * r.waste:.3f}% of "
                     "wall time")
    elif r.young_interval_s is not None and r.daly_interval_s is not None:
        lines.append(f"  Young sqrt(2CM) {d(r.young_interval_s)}, Daly "
                     f"{d(r.daly_interval_s)}; waste {100 * r.waste:.3f}% of wall time")
    else:
        lines.append(f"  waste {100 * r.waste:.3f}% of wall time (its stalls)")
    lines.append(f"  why: {r.why}")
    if r.wear is not None:
        lines += ["  " + line for line in describe_wear(
            r.wear, r.daly_interval_s or 0.0, r.limited_by == "wear", r.wear_floor_s)]
    return lines


def describe_multilevel(a: MultiLevelAdvice) -> list[str]:
    """The advice as lines of text.

    Parameters
    ----------
    a : what :func:`advise_multilevel` returned.
    """
    lines = [f"iteration {format_duration(a.iteration_s)}"]
    for r in a.levels:
        lines += _level_lines(r)
    lines.append("expected lost work per failure (work redone + restore, + the flush from the "
                 "durable level):")
    lines += [f"  {_CLASS_NAMES[c]:<20} from {a.recovered_from[c]:<10} {format_duration(s)}"
              for c, s in a.lost_per_failure_s.items()]
    lines.append(f"waste of all levels {100 * a.waste:.3f}% of wall time (the first-order "
                 f"optimum before whole iterations, floors and nesting: "
                 f"{100 * a.first_order_waste:.3f}%)")
    return lines

"""For ``backend="auto"`` loads: read with O_DIRECT or through the page cache, whichever is faster
on the filesystem at hand, decided by the load's own requests (the pure part: plans, rates and
the rule; :mod:`.adaptive` is the backend that carries it out).

Which is faster depends on the machine, not on principle: on NVMe, O_DIRECT skips a memory copy
and wins; on the virtio disks of the development VMs buffered reads won by up to 1.5x in whole
loads, while a separate sample of the file (cold reads beside the load, bench/results
2026-12-01) measured both modes alike and chose O_DIRECT. So nothing is read beside the load:
its first requests, ``threads`` at a time (the load's queue depth), go in two rounds of one mode
each, every byte read once, into its destination: first the mode the recent loads did not
choose (buffered on a filesystem's first load), then the chosen one, which the rest of the load
continues without a pause (measuring costs one round in the slower mode and one wait between the
rounds; rounds ordered O_DIRECT, buffered, buffered, O_DIRECT on a first load and alternating
on later ones made 1 GiB loads 1.13-1.21x the faster mode's time on the virtio disk,
bench/results/2026-12-02-cpu-bench_io-disk-50417ca-b.txt). The measuring requests are the heads
of the load's first requests, :data:`PROBE_BYTES` each (the reader sends their tails after
them): rounds of whole 16 MiB requests cost 2 GiB loads 3-4% where buffered reads ran at half
O_DIRECT's rate (auto 1.259 s, direct 1.223 s, medians of 8 paired loads), 4 MiB heads a
quarter of that. Each load's rates give a ratio
(buffered / O_DIRECT) kept per filesystem; the rest of the load, and every load too small to
measure, reads the way the median ratio of the last :data:`HISTORY` loads says: buffered only above
:data:`BUFFERED_MARGIN` (O_DIRECT keeps the page cache clean). Memory-backed filesystems
(tmpfs) are measured too: both modes copy out of the page cache there, yet buffered loads read
1.02-1.32x faster than O_DIRECT ones in all 5 quiet 1 GiB runs of 2026-12-02 on the
development VM (bench/results/2026-12-02-cpu-bench_io-tmpfs-*). The ratios outlive the process
(:mod:`.read_history`): a restarted job's first load starts from what earlier processes measured.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from . import read_history

FRACTION = 8  # the rounds read at most 1/8 of a load
PROBE_BYTES = 4 << 20  # each measuring request's bytes (the reader cuts the load's first ones)
BUFFERED_MARGIN = 1.05  # buffered must be this much faster: O_DIRECT keeps the page cache clean
HISTORY = 5  # loads whose ratios the rule takes the median of

_ratios: dict[int, deque[float]] = {}  # st_dev -> buffered / O_DIRECT rate of recent loads
# (seeded from the on-disk history the first time this process meets the filesystem)
_lock = threading.Lock()


@dataclass(frozen=True)
class Plan:
    """The measuring rounds of one load: each round's mode, and requests per round."""

    rounds: tuple[str, ...]
    per_round: int

    @property
    def requests(self) -> int:
        return len(self.rounds) * self.per_round


NO_PLAN = Plan((), 0)


def plan(load_bytes: int, threads: int, request_bytes: int, buffered_now: bool) -> Plan:
    """The rounds of a load of ``load_bytes`` whose measuring requests hold ``request_bytes``
    each, read by ``threads`` threads, where the recent loads chose buffered reads
    (``buffered_now``) or not: the other mode first, then the chosen one; a round is
    ``threads`` requests where the load is large enough for both to stay within 1 /
    ``FRACTION`` of it, else fewer; none where not even one request per round fits."""
    rounds = ("direct", "buffered") if buffered_now else ("buffered", "direct")
    per_round = min(threads, load_bytes // (FRACTION * len(rounds) * max(request_bytes, 1)))
    return Plan(rounds, per_round) if per_round >= 1 else NO_PLAN


@dataclass(frozen=True)
class Timing:
    """One measured request: its round, mode, start and end (``time.perf_counter``), bytes."""

    round: int
    mode: str
    start: float
    end: float
    nbytes: int


def rates(timings: Sequence[Timing]) -> dict[str, float]:
    """Bytes per second of each mode: every run of consecutive rounds in one mode counts its
    bytes over its span (first start to last end; the rounds of another mode never overlap it),
    and the runs of a mode add up. A mode without bytes or time is left out."""
    runs: list[list[Timing]] = []
    for t in sorted(timings, key=lambda t: t.round):
        if runs and runs[-1][0].mode == t.mode:
            runs[-1].append(t)
        else:
            runs.append([t])
    moved: dict[str, int] = {}
    spent: dict[str, float] = {}
    for run in runs:
        mode = run[0].mode
        moved[mode] = moved.get(mode, 0) + sum(t.nbytes for t in run)
        spent[mode] = spent.get(mode, 0.0) + max(t.end for t in run) - min(t.start for t in run)
    return {m: moved[m] / spent[m] for m in moved if moved[m] and spent[m] > 0}


def ratio(measured: dict[str, float]) -> float | None:
    """Buffered rate / O_DIRECT rate, or None where a mode was not measured."""
    if "direct" in measured and "buffered" in measured:
        return measured["buffered"] / measured["direct"]
    return None


def decide(ratios: Sequence[float]) -> tuple[bool, str]:
    """``(read through the page cache?, reason)`` from the recent loads' ``ratios`` (buffered
    rate / O_DIRECT rate, oldest first): buffered where their median exceeds
    ``BUFFERED_MARGIN``, else O_DIRECT (also with nothing measured)."""
    if not ratios:
        return False, "reads via O_DIRECT: nothing measured on this filesystem yet"
    median = statistics.median(ratios)
    buffered = median > BUFFERED_MARGIN
    return buffered, (
        f"reads via {'page cache (buffered)' if buffered else 'O_DIRECT'}: buffered / O_DIRECT "
        f"read rate {median:.2f}x, median of the last {len(ratios)} measured load(s) on this "
        f"filesystem ({', '.join(f'{r:.2f}' for r in ratios)}; buffered only above "
        f"{BUFFERED_MARGIN:.2f}x)")


def collapsed(buffered_rate: float, direct_rate: float) -> bool:
    """Whether buffered reads, measured at ``buffered_rate`` later in a load that chose them,
    fell below the O_DIRECT rate its rounds measured by more than ``BUFFERED_MARGIN``."""
    return direct_rate > 0 and buffered_rate * BUFFERED_MARGIN < direct_rate


def describe_rates(measured: dict[str, float], p: Plan, request_bytes: int) -> str:
    """What this load's own rounds measured, for the reason."""
    shown = ", ".join(f"{m} {measured[m] / 1e9:.2f} GB/s" for m in ("direct", "buffered")
                      if m in measured)
    order = "".join("D" if m == "direct" else "B" for m in p.rounds)
    return (f"this load's first {p.requests} requests ({len(p.rounds)} rounds {order} of "
            f"{p.per_round} at once, at most {request_bytes / 2**20:g} MiB each) read "
            f"{shown or 'nothing measurable'}")


def _kept(dev: int) -> deque[float]:
    """This process's ratios for ``dev`` (under ``_lock``), seeded from the on-disk history."""
    if dev not in _ratios:
        _ratios[dev] = deque(read_history.load(dev), maxlen=HISTORY)
    return _ratios[dev]


def record(dev: int, value: float) -> list[float]:
    """Add one load's ratio for filesystem ``dev``, here and in the on-disk history; the recent
    ratios, oldest first."""
    with _lock:
        kept = _kept(dev)
        kept.append(value)
        out = list(kept)
    read_history.update(dev, lambda old: [*old, value][-HISTORY:])
    return out


def _replaced(ratios: list[float], old: float, new: float) -> list[float]:
    """``ratios`` with its newest entry equal to ``old`` replaced by ``new``."""
    out = list(ratios)
    for k in range(len(out) - 1, -1, -1):
        if out[k] == old:
            out[k] = new
            break
    return out


def amend(dev: int, old: float, new: float) -> None:
    """Replace a load's ratio ``old`` (the newest such entry) for ``dev`` with ``new``, here and
    on disk."""
    with _lock:
        if dev in _ratios:
            _ratios[dev] = deque(_replaced(list(_ratios[dev]), old, new), maxlen=HISTORY)
    read_history.update(dev, lambda kept: _replaced(kept, old, new))


def recent(dev: int) -> list[float]:
    """The recent loads' ratios for filesystem ``dev``, oldest first."""
    with _lock:
        return list(_kept(dev))


def forget() -> None:
    """Drop what this process holds (tests; a process whose storage changed): the next load
    starts again from the on-disk history (``GDS_PERSIST_CACHE_DIR=""``: from nothing)."""
    with _lock:
        _ratios.clear()

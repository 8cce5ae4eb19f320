"""The ``auto`` backend of loads from a filesystem that accepts O_DIRECT: every data file is
open both ways (O_DIRECT, and buffered with ``POSIX_FADV_RANDOM``: the load's own large requests
are all the read-ahead it needs, measured faster on the virtio disk), and each read request
goes one way or the other as :mod:`.read_mode` says.

The load's first requests are its measurement: they go in the rounds of
:func:`.read_mode.plan`, each request a real read of the load into its destination (the bytes
are read once, whichever way). The second round (another mode) waits until the requests of the
first are done, so that no round shares the drive with the other mode; each runs at the load's
own queue depth. Once the last round is done, this load's rates join the filesystem's recent
ones and the rule picks the way for the rest of the load (requests before that continue in the
last round's mode, the recent loads' choice). Where that is buffered, the load keeps timing its
buffered requests and goes back to O_DIRECT if a round's worth of them falls below the rate
O_DIRECT measured (:func:`.read_mode.collapsed`); not on a memory-backed filesystem, whose
files are the page cache: nothing there collapses, while a window's rate swings with the cost
of the destination's fresh pages (a tmpfs load fell back to O_DIRECT on a 1.03 GB/s window
after measuring 1.27 with it, and ended 1.13-1.23x the faster mode's time, bench/results
2026-12-02). Loads too small to measure read the way the recent loads say.
:meth:`AdaptiveReadBackend.reason` says what was measured and why.

Requests shorter than a measuring request (small tensors, the edge blocks of large ones) are
neither timed nor watched: their time is the drive's latency, not a rate; they go the way the
load goes at that moment.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import BackendError
from . import read_mode
from .base import Backend
from .posix import _O_DIRECT, open_buffered_for_reading, pread_all

BARRIER_TIMEOUT_S = 60.0  # a round waits at most this long for the other mode's requests


@dataclass(frozen=True)
class _Pair:
    direct: int
    buffered: int


class AdaptiveReadBackend(Backend):
    """Reads only (``open(write=True)`` is refused). ``name`` is the mode the load ends in."""

    def __init__(self, host_alignment: int, dev: int, load_bytes: int, threads: int,
                 block_bytes: int, watch: bool = True):
        self.host_alignment = host_alignment  # O_DIRECT's: every request may go either way
        self.dev = dev
        self.watch = watch  # time buffered requests after the rounds (not on tmpfs: below)
        self.probe_bytes = min(block_bytes, read_mode.PROBE_BYTES)
        self.plan = read_mode.plan(load_bytes, threads, self.probe_bytes,
                                   read_mode.decide(read_mode.recent(dev))[0])
        self._cond = threading.Condition()
        self._entered = 0  # requests that have begun, in order
        self._finished = 0  # measuring requests done
        self._timings: list[read_mode.Timing] = []
        self._measured: dict[str, float] = {}
        self._decision: tuple[bool, str] | None = None
        self._ratio: float | None = None  # this load's buffered / O_DIRECT, as recorded
        self._windows: dict[int, list[read_mode.Timing]] = {}  # after the rounds, buffered
        self._fell: float | None = None  # the buffered rate that sent the load back to O_DIRECT
        if not self.plan.requests:
            self._decision = read_mode.decide(read_mode.recent(dev))

    @property
    def probe_requests(self) -> int:  # type: ignore[override]
        """The measuring requests not yet begun: the reader cuts them to ``probe_bytes``."""
        with self._cond:
            return max(0, self.plan.requests - self._entered)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._decided() or "direct"

    def open(self, path: str, *, write: bool, size: int = 0, create: bool = True) -> _Pair:
        if write:
            raise BackendError("the adaptive read backend only reads; writes use 'direct'")
        direct = os.open(path, os.O_RDONLY | _O_DIRECT)
        try:
            return _Pair(direct, open_buffered_for_reading(path))
        except BaseException:
            os.close(direct)
            raise

    def pwrite(self, handle: Any, buf: memoryview, offset: int) -> None:
        raise BackendError("the adaptive read backend only reads; writes use 'direct'")

    def pread(self, handle: _Pair, buf: Any, offset: int) -> int:
        view = memoryview(buf).cast("B")
        if view.nbytes < self.probe_bytes:  # a short request: its time is its latency, not a rate
            return pread_all(handle.buffered if self._mode_now() == "buffered"
                             else handle.direct, view, offset)
        k, mode = self._enter()
        fd = handle.buffered if mode == "buffered" else handle.direct
        if k >= self.plan.requests and (mode == "direct" or not self.plan.requests
                                        or not self.watch):
            return pread_all(fd, view, offset)  # nothing to measure or watch
        start, got = time.perf_counter(), 0
        try:
            got = pread_all(fd, view, offset)
        finally:
            self._leave(read_mode.Timing(k // self.plan.per_round, mode, start,
                                         time.perf_counter(), got))
        return got

    def _decided(self) -> str | None:
        """The mode the rule chose for the rest of the load; None before it has."""
        if self._decision is None:
            return None
        return "buffered" if self._decision[0] else "direct"

    def _mode_now(self) -> str:
        with self._cond:
            decided = self._decided()
            if decided is not None:
                return decided
            r = min(self._entered // max(self.plan.per_round, 1), len(self.plan.rounds) - 1)
            return self.plan.rounds[r] if self.plan.rounds else "direct"

    def _enter(self) -> tuple[int, str]:
        """This request's index and its mode; waits where its round starts another mode until
        the requests before it are done."""
        with self._cond:
            k = self._entered
            self._entered += 1
            if k >= self.plan.requests:
                decided = self._decided()  # until the last round is in: its mode
                return k, decided if decided is not None else self.plan.rounds[-1]
            r = k // self.plan.per_round
            mode = self.plan.rounds[r]
            if r and self.plan.rounds[r - 1] != mode:
                before = r * self.plan.per_round
                self._cond.wait_for(lambda: self._finished >= before, BARRIER_TIMEOUT_S)
            return k, mode

    def _leave(self, timing: read_mode.Timing) -> None:
        with self._cond:
            if timing.round >= len(self.plan.rounds):
                self._watch(timing)
                return
            self._timings.append(timing)
            self._finished += 1
            if self._finished == self.plan.requests:
                self._decide()
            self._cond.notify_all()

    def _decide(self) -> None:
        self._measured = read_mode.rates(self._timings)
        value = self._ratio = read_mode.ratio(self._measured)
        ratios = (read_mode.record(self.dev, value) if value is not None
                  else read_mode.recent(self.dev))
        self._decision = read_mode.decide(ratios)

    def _watch(self, timing: read_mode.Timing) -> None:
        """A buffered request after the rounds: once a round's worth of them is done, their
        rate; where buffered reads fell below O_DIRECT's measured rate (by the margin: on the
        shared VM a buffered load collapsed to 0.18 GB/s after its round measured 1.31), the
        rest of the load reads with O_DIRECT, and this load's ratio says what it saw."""
        window = self._windows.setdefault(timing.round, [])
        window.append(timing)
        if len(window) < self.plan.per_round or self._fell is not None:
            return
        rate = read_mode.rates(window).get("buffered", 0.0)
        direct = self._measured.get("direct", 0.0)
        if timing.mode == "buffered" and read_mode.collapsed(rate, direct):
            self._fell = rate
            if self._ratio is not None:
                read_mode.amend(self.dev, self._ratio, rate / direct)
            self._decision = (False, f"{self._decision[1] if self._decision else ''}; then "
                                     f"buffered reads fell to {rate / 1e9:.2f} GB/s: the rest "
                                     "via O_DIRECT")

    def reason(self) -> str:
        """Why this load read the way it did (after its requests)."""
        with self._cond:
            decision = self._decision
            if decision is None:  # the load had fewer requests than its plan
                decision = read_mode.decide(read_mode.recent(self.dev))
            if not self.plan.requests:
                return f"{decision[1]} (this load is too small to measure)"
            if not self._measured:
                return f"{decision[1]} (this load ended before its measuring rounds)"
            rates = read_mode.describe_rates(self._measured, self.plan, self.probe_bytes)
            return f"{decision[1]}; {rates}"

    def sync(self, handle: Any) -> None:
        pass

    def close(self, handle: _Pair) -> None:
        try:
            os.close(handle.direct)
        finally:
            os.close(handle.buffered)

"""Where a save or a load spends its time: an opt-in stage profile.

Every stage of the data path (copy into staging, checksum, write syscalls, fsync, ...) is wrapped
in :func:`stage`. Normally that costs one global lookup; inside :func:`profiling` each stage adds
its seconds, bytes, calls and minor page faults (of the thread that ran it) to a
:class:`StageProfile`. Stages run on several threads at once, so their seconds are thread-seconds:
they can add up to more than the wall time. ``bench/profile_stages.py`` prints the profile with
the bound each stage implies.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


@dataclass
class StageTotals:
    seconds: float = 0.0  # thread-seconds spent in the stage (wall time, summed over threads)
    cpu_seconds: float = 0.0  # CPU time of those threads in the stage (less when they waited)
    nbytes: int = 0
    calls: int = 0
    faults: int = 0  # minor page faults taken by the thread while in the stage
    threads: set[int] = field(default_factory=set)  # the threads that ran it

    @property
    def gbps(self) -> float:
        """The rate one thread doing only this stage would sustain (bytes / thread-seconds)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds and self.nbytes else 0.0

    def bound_gbps(self, cores: int) -> float:
        """The fastest this stage could move its bytes: its CPU time spread over the cores its
        threads could use, and its wall time spread over its threads, whichever is longer."""
        threads = max(1, len(self.threads))
        floor = max(self.cpu_seconds / min(threads, max(1, cores)), self.seconds / threads)
        return self.nbytes / floor / 1e9 if floor and self.nbytes else 0.0


@dataclass
class StageProfile:
    """Totals per stage name, filled from any thread."""

    stages: dict[str, StageTotals] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def stage(self, name: str, nbytes: int = 0) -> Iterator[None]:
        faults0 = resource.getrusage(_RUSAGE_THREAD).ru_minflt
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            cpu = time.thread_time() - cpu0
            faults = resource.getrusage(_RUSAGE_THREAD).ru_minflt - faults0
            with self._lock:
                totals = self.stages.setdefault(name, StageTotals())
                totals.seconds += seconds
                totals.cpu_seconds += cpu
                totals.nbytes += nbytes
                totals.calls += 1
                totals.faults += faults
                totals.threads.add(threading.get_ident())


_active: StageProfile | None = None


def stage(name: str, nbytes: int = 0) -> AbstractContextManager[None]:
    """Time the enclosed work as stage ``name`` moving ``nbytes``, when a profile is active."""
    profile = _active
    return profile.stage(name, nbytes) if profile is not None else nullcontext()


@contextmanager
def profiling() -> Iterator[StageProfile]:
    """Collect a :class:`StageProfile` of everything this process does inside the block."""
    global _active
    previous, _active = _active, StageProfile()
    try:
        yield _active
    finally:
        _active = previous

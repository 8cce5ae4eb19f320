"""The Checkpointer's saves in flight: each one's :class:`SaveHandle`, the :class:`Job` its stages
pass on, the counters (:class:`CheckpointerStats`), and :class:`Pending`, the saves not yet done
with every wait on them.

A handle goes *released* (the caller's tensors may change again: copied into a snapshot, or
written) and then *done* (committed and published, or failed); a failure releases it too. A
failed save's error is raised once: by ``handle.wait()``, else by the next ``save``, ``wait`` or
``close`` (:meth:`Pending.raise_undelivered`). Every wait is bounded and, in short slices,
watches the worker threads (a dead one fails its save instead of hanging the wait).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointTimeout
from ..results import SaveInfo
from ..state.flatten import Flattened
from .background_writer import raise_first
from .snapshot import Reservation
from .streams import Events
from .tier.flush import FlushStats


@dataclass
class CheckpointerStats:
    """Counters of one Checkpointer (a copy: read ``ckpt.stats`` again for fresh values)."""

    saves: int = 0  # save() calls accepted
    committed: int = 0  # checkpoints committed and published
    failed: int = 0
    save_waits: int = 0  # save() calls that waited for a free slot (max_pending)
    save_wait_s: float = 0.0
    guard_waits: int = 0  # optimizer steps that waited for a checkpoint to release tensors
    guard_wait_s: float = 0.0
    snapshot_blocked: int = 0  # snapshots that waited for arena memory
    snapshot_blocked_s: float = 0.0
    fence_fallbacks: int = 0  # snapshot-mode saves too large for the arena, written fence-style
    # what save() did with the bytes it was given (training/capture.py): copied at once, or read
    # live later (held by a guarded optimizer, or unchanged since the last save) and checked
    copied_at_save_bytes: int = 0
    read_live_bytes: int = 0
    snapshot_bytes: int = 0  # arena capacity (0 until the first snapshot)
    snapshot_peak_bytes: int = 0  # most arena bytes ever reserved at once (<= snapshot_bytes)
    mode: str = ""  # "fence" or "snapshot": the mode in force ("auto" until the first save)
    mode_reason: str = ""  # why (mode="auto": what it saw; else "requested explicitly")
    write_s: float = 0.0  # total seconds spent in gds_persist.save by the writer
    bytes_written: int = 0
    bytes_referenced: int = 0  # incremental=True: payload bytes referred to, not written
    # the memory tier (memory_root=): steps committed to the node's memory, with their replicas
    memory_committed: int = 0
    memory_write_s: float = 0.0  # this rank's own memory commits
    replicate_s: float = 0.0  # copying to and from the replica holders
    memory_fallbacks: int = 0  # memory steps written to the drive instead (no room)
    memory_fallback_reason: str = ""
    replica_holders: list[int] = field(default_factory=list)  # ranks keeping this rank's copies
    memory_share_bytes: int = 0  # this rank's share of the last memory step (data file bytes)
    # the last ckpt.load(): where this rank's share came from, every rank's, what fell through
    restored_from: str = ""
    restore_step: int | None = None
    restore_sources: list[str] = field(default_factory=list)
    restore_skipped: list[str] = field(default_factory=list)
    restore_s: float = 0.0
    restore_bytes: dict[str, int] = field(default_factory=dict)  # source -> bytes, all ranks
    healed: int = 0  # own memory copies rewritten after a restore from replicas
    heal_s: float = 0.0
    level_commits: dict[str, int] = field(default_factory=dict)  # node-local level -> steps
    # the durable level flushed from the local copies (levels=, memory=): what was flushed,
    # what failed and why (None: the durable level is written from the state)
    durable: FlushStats | None = None
    flush_lag: str = ""  # why a due durable step waits, while it does
    flush_skipped: int = 0  # due durable steps replaced by a newer one before their flush


class SaveHandle:
    """One background save. ``done()`` / ``wait()``: committed and published (or failed);
    ``released()`` / ``wait_released()``: the tensors passed to ``save`` may change again.

    Attributes:
        step: the step saved.
        path: the checkpoint directory it commits.
        mode: ``"snapshot"`` or ``"fence"`` (also a snapshot too large for the arena).
        mode_reason: why the Checkpointer is in that mode.
        info: the :class:`~gds_persist.SaveInfo` once committed (None before, or on failure).
        error: the exception the save raised, if it failed.
        blocked_s: seconds the snapshot waited for arena memory.
    """

    def __init__(self, owner: Pending, step: int, path: str, mode: str, mode_reason: str = ""):
        self.step = step
        self.path = path
        self.mode = mode
        self.mode_reason = mode_reason
        self.info: SaveInfo | None = None
        self.error: BaseException | None = None
        self.blocked_s = 0.0
        self._owner = owner
        self._released = threading.Event()
        self._done = threading.Event()

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else "in flight"
        return f"<SaveHandle step={self.step} {self.mode} {state} {self.path}>"

    def done(self) -> bool:
        return self._done.is_set()

    def released(self) -> bool:
        return self._released.is_set()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """Block until committed and published; return the SaveInfo or raise the save's error."""
        self._owner.await_event(self._done, f"step {self.step} to be written", timeout)
        self._owner.delivered(self)
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until the tensors given to ``save`` are no longer read (copied or written)."""
        self._owner.await_event(self._released, f"step {self.step} to release its tensors",
                                timeout)

    def _finish(self, info: SaveInfo | None = None, error: BaseException | None = None) -> bool:
        if self._done.is_set():
            return False
        self.info, self.error = info, error
        self._released.set()
        self._done.set()
        return True


@dataclass
class Job:
    """One save as it passes from stage to stage (snapshot, write)."""

    handle: SaveHandle
    flat: Flattened | None  # the caller's state, flattened at save() (live tensors), or its
    # snapshot once taken (host copies; the records keep the devices they were saved from)
    events: Events  # (device, CUDA event recorded at save())
    reservation: Reservation | None = None
    remote: dict[str, Any] | None = None  # writer="process": the snapshot, described for the helper
    tiers: tuple[str, ...] = ("drive",)  # where this step goes: "memory" and/or "drive"


class Pending:
    """The saves of one Checkpointer not yet done, oldest first, and the failed ones whose error
    is not yet raised. ``check_workers`` runs between the slices of every wait (it fails the save
    of a dead worker). Waits and failures are counted into ``stats`` under ``lock`` (the
    Checkpointer's)."""

    def __init__(self, root: str, timeout_s: float, stats: CheckpointerStats,
                 lock: threading.RLock, check_workers: Callable[[], None]):
        self.root = root
        self.timeout_s = timeout_s
        self._stats, self._lock = stats, lock
        self._check_workers = check_workers
        self._pending: deque[SaveHandle] = deque()  # not done, oldest first
        self._undelivered: deque[SaveHandle] = deque()  # failed, error not yet raised

    def add(self, handle: SaveHandle) -> None:
        with self._lock:
            self._pending.append(handle)

    def handles(self) -> list[SaveHandle]:
        """The saves not yet done, oldest first."""
        with self._lock:
            while self._pending and self._pending[0].done():
                self._pending.popleft()
            return [h for h in self._pending if not h.done()]

    def await_event(self, event: threading.Event, what: str, timeout: float | None) -> None:
        """Wait for ``event`` in short slices, checking the workers; bounded by ``timeout``
        (default ``timeout_s``)."""
        if event.is_set():
            return
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not event.wait(max(0.0, min(0.25, deadline - time.monotonic()))):
            self._check_workers()
            if event.is_set():
                break
            if time.monotonic() >= deadline:
                raise CheckpointTimeout(
                    f"waited {limit:.1f} s for {what} under {self.root}: the write is still "
                    "running (slow or hung storage?); raise Checkpointer(timeout_s=...) if the "
                    "drive is just slow"
                )

    def await_all(self, timeout: float | None) -> None:
        """Wait until every save so far is done; ``timeout`` bounds the whole wait."""
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        for handle in self.handles():
            try:
                self.await_event(handle._done, "", max(0.0, deadline - time.monotonic()))
            except CheckpointTimeout:
                steps = ", ".join(str(h.step) for h in self.handles())
                raise CheckpointTimeout(
                    f"waited {limit:.1f} s for the saves of steps {steps} under {self.root}: "
                    "still running (slow or hung storage?); raise Checkpointer(timeout_s=...) "
                    "if the drive is just slow"
                ) from None

    def wait_released(self, timeout: float | None) -> None:
        """Wait until every save so far has released its tensors (counted: guard waits)."""
        t0 = time.perf_counter()
        waited = False
        for handle in self.handles():
            if not handle.released():
                waited = True
                handle.wait_released(timeout)
        if waited:
            with self._lock:
                self._stats.guard_waits += 1
                self._stats.guard_wait_s += time.perf_counter() - t0

    def wait_for_slot(self, max_pending: int) -> None:
        """Wait until fewer than ``max_pending`` saves are in flight (counted: save waits)."""
        pending = self.handles()
        if len(pending) < max_pending:
            return
        t0 = time.perf_counter()
        for handle in pending[: len(pending) - max_pending + 1]:
            self.await_event(handle._done, f"step {handle.step} to be written (max_pending="
                             f"{max_pending} saves in flight)", None)
        with self._lock:
            self._stats.save_waits += 1
            self._stats.save_wait_s += time.perf_counter() - t0

    def failed(self, handle: SaveHandle) -> None:
        """``handle`` failed (and is done): its error is raised by the next
        :meth:`raise_undelivered`, unless ``handle.wait()`` raises it first."""
        with self._lock:
            self._stats.failed += 1
            self._undelivered.append(handle)

    def delivered(self, handle: SaveHandle) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._undelivered.remove(handle)

    def raise_undelivered(self) -> None:
        """Raise the first failed save's error not yet raised, noting the later ones."""
        with self._lock:
            failed = list(self._undelivered)
            self._undelivered.clear()
        raise_first([(f"step {h.step}", h.error) for h in failed if h.error is not None])

"""The background stages of a :class:`~gds_persist.Checkpointer`: its snapshot and write
threads' jobs, failing a job whose thread died, and stopping them (the Checkpointer's
``WriterThreads`` part; the threads themselves are :mod:`.workers`)."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

from ..transfer.warmup import BackgroundWarmup
from .background_writer import Workers, add_note
from .handles import CheckpointerStats, Job, Pending
from .helper import HelperProcess
from .snapshot import ArenaOwner
from .streams import DeviceStreams, synchronize
from .tiers import Tiers

WARMUP_WAIT_S = 60.0  # longest the first write waits for the warm-up to finish


class WriterThreads:
    """What the Checkpointer's threads run; the Checkpointer sets these attributes."""

    timeout_s: float
    _lock: threading.RLock
    _stats: CheckpointerStats
    _pending: Pending
    _workers: Workers
    _streams: DeviceStreams
    _snapshots: ArenaOwner | None
    _helper: HelperProcess | None
    _warmup: BackgroundWarmup | None
    _tiers: Tiers

    # ---------------------------------------------------------------- waiting and errors

    def _check_workers(self) -> None:
        """Fail the save a dead thread was doing (a new thread takes the next ones)."""
        for job, error in self._workers.check():
            self._fail(job, error)

    def _fail(self, job: Job, error: BaseException) -> None:
        job.flat = None
        if error.__traceback__ is not None:  # drop the frames' references to the tensors
            traceback.clear_frames(error.__traceback__)
        self._free(job)
        h = job.handle
        add_note(error, f"(gds_persist.Checkpointer: the checkpoint of step {h.step} to {h.path} "
                        "failed in the background; earlier checkpoints are untouched)")
        if h._finish(error=error):
            self._pending.failed(h)

    def _free(self, job: Job) -> None:
        job.remote = None
        if job.reservation is not None and self._snapshots is not None:
            self._snapshots.free(job.reservation)
        job.reservation = None

    # ---------------------------------------------------------------- threads

    def _prepare(self, stage: str) -> None:
        """Before a job: the writer's first write waits (bounded) for the warm-up."""
        if stage == "write" and self._warmup is not None and not self._warmup.done():
            self._warmup.wait(min(WARMUP_WAIT_S, self.timeout_s))  # then write regardless

    def _in_streams(self, run: Callable[[Job], None]) -> Callable[[Job], None]:
        """``run(job)`` on the side streams of the job's devices (:mod:`.streams`)."""
        def staged(job: Job) -> None:
            with self._streams.around(job.events):
                run(job)
        return staged

    def _stop_threads(self, join_s: float) -> None:
        deadline = time.monotonic() + join_s
        self._workers.stop(deadline)
        if self._warmup is not None:  # nothing of ours runs on after close
            self._warmup.wait(max(0.0, deadline - time.monotonic()))
        if self._helper is not None and not self._workers.alive("write"):
            self._helper.stop(max(0.0, deadline - time.monotonic()))
        if self._snapshots is not None and not self._workers.any_alive():
            self._snapshots.close()

    # ---------------------------------------------------------------- the two stages

    def _snapshot(self, job: Job) -> None:
        h = job.handle
        try:
            synchronize(job.events)
            assert job.flat is not None and self._snapshots is not None
            job.reservation = self._snapshots.reserve(
                job.flat, f"writing step {h.step} from the live tensors (fence)")
            if job.reservation is None:  # larger than the whole arena
                h.mode = "fence"
                with self._lock:
                    self._stats.fence_fallbacks += 1
                self._workers.put("write", job)
                return
            h.blocked_s = job.reservation.waited_s
            if h.blocked_s:
                with self._lock:
                    self._stats.snapshot_blocked += 1
                    self._stats.snapshot_blocked_s += h.blocked_s
            if self._helper is not None:  # copy only; the helper rebuilds and writes
                f = job.flat
                offsets = self._snapshots.copy(f, job.reservation)
                job.remote = {"tree": f.tree, "tensors": f.tensors, "storages": f.storages,
                              "offsets": offsets, "arena": self._snapshots.shared,
                              "crc_at_save": f.crc_at_save}
                job.flat = None
            else:
                job.flat = self._snapshots.take(job.flat, job.reservation)
            job.events = []
            h._released.set()
            self._workers.put("write", job)
        except Exception as e:  # noqa: BLE001 - reported through the handle
            self._fail(job, e)

    def _write(self, job: Job) -> None:
        h = job.handle
        try:
            synchronize(job.events)
            info = self._tiers.write(job, h._released.set)
            job.flat = None
            self._free(job)
            h._released.set()
            if "drive" in job.tiers:
                self._tiers.publish(h)
        except Exception as e:  # noqa: BLE001 - reported through the handle
            self._fail(job, e)
            return
        if "drive" in job.tiers:
            self._tiers.committed(h.step, info)
        h._finish(info=info)

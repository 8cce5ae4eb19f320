"""Checkpointing that overlaps training: :class:`Checkpointer`.

::

    with gds_persist.Checkpointer("ckpt", keep_last=3) as ckpt:
        ckpt.guard(optimizer)                   # optimizer.step() waits for in-flight writes
        start = 0
        if ckpt.latest_step() is not None:
            state = ckpt.load()
            model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optim"])
            start = state["step"]
        for step in range(start + 1, steps + 1):
            loss_fn(model(next(batches))).backward()
            optimizer.step(); optimizer.zero_grad()
            ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                             "step": step})

``save`` returns at once; the checkpoint of step i is written while step i+1 runs forward and
backward, and the guard makes step i+1's update wait until the write no longer reads the tensors.

Modes (how long the caller's tensors are borrowed):

* ``auto`` (default): decided at the first ``save`` from the state and the machine
  (:mod:`.mode`): ``snapshot`` for state on a GPU when its pinned arena fits the host memory,
  else ``fence``. The choice and why: :attr:`Checkpointer.mode` / :attr:`~Checkpointer.mode_reason`,
  ``stats.mode`` / ``stats.mode_reason``, each handle's ``mode`` / ``mode_reason``, and an INFO log
  line on the ``gds_persist`` logger.
* ``fence``: the live tensors are written directly; no copy, no extra memory. They are
  released when the checkpoint is durable.
* ``snapshot``: a background thread copies them into a bounded host arena (pinned where CUDA
  exists) and releases them; the write follows from the copy. For updates that come before a
  write could finish. The arena never grows: a snapshot waits for memory (counted in
  :attr:`Checkpointer.stats`) and a state dict larger than the whole arena is written fence-style.

Start-up: on construction a Checkpointer starts :func:`gds_persist.warmup` in a background thread
(CUDA context and side streams, the staging ring, the backend probe and kvikio/cuFile start-up,
the device CRC kernel), so that the first checkpoint is not the slow one; the writer waits for it
(bounded) before its first write. ``warmup=False`` skips it; ``ckpt.warmup_report`` says what it
did.

Either way the caller must not change the tensors of a save until its handle is released:
``guard(optimizer)`` does it for optimizer updates; otherwise call ``handle.wait_released()``.

Threads: one writer thread (plus a snapshot thread in snapshot mode) per Checkpointer. Their bulk
work (``copy_``, CRC32C, ``pwrite``, ``fsync``) releases the GIL, but core ``save``'s Python
around it does not: a training loop that is itself mostly Python waits for it (measured in
docs/TRAINING.md). ``writer="process"`` (snapshot mode) moves the write to a helper process
(:mod:`gds_persist.training.helper`); the training process then only copies into the shared
arena. Every wait is bounded (``timeout_s``) and watches the threads and the helper: one that
dies fails the save it was doing (a new one takes the next), never hangs.

Each state dict is flattened once, by ``save`` (so a state dict a checkpoint cannot hold raises
there, naming the key), and that Flattened (or its snapshot) is what core ``save`` writes.
A background error is raised by ``handle.wait()``, else by the next ``save``/``wait``/``close``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import operator
import os
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import settings
from ..errors import (
    CheckpointError,
    CheckpointReplacedError,
    CheckpointTimeout,
    SnapshotTooLarge,
    WorkerDied,
)
from ..format import MANIFEST_NAME
from ..loading.load import load as core_load
from ..parallel.distributed import make_comm
from ..parallel.topology import node_name
from ..results import SaveInfo, WarmupReport
from ..saving.compression import check_mode as check_compression
from ..saving.save import save as core_save
from ..state.flatten import Flattened, flatten
from ..transfer.warmup import BackgroundWarmup
from . import steps as _steps
from .helper import HelperProcess
from .mode import ModeChoice, choose_mode, host_memory
from .snapshot import (
    Reservation,
    SnapshotArena,
    copy_storages,
    snapshot_nbytes,
    take_snapshot,
)
from .tier.memory import MemoryTier, job_name, lacks_room, step_bytes
from .tier.recovery import Restored, restore
from .tier.replicate import holders, transfer

log = logging.getLogger("gds_persist")

MODES = ("auto", "fence", "snapshot")
WARMUP_WAIT_S = 60.0  # longest the first write waits for the warm-up to finish
_LOAD_ATTEMPTS = 3  # load(): steps removed by another process's retention while being opened
WRITERS = ("thread", "process")


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
    # the last ckpt.load(): where this rank's bytes came from, every rank's, what fell through
    restored_from: str = ""
    restore_step: int | None = None
    restore_sources: list[str] = field(default_factory=list)
    restore_skipped: list[str] = field(default_factory=list)
    restore_s: float = 0.0


class SaveHandle:
    """One background save. ``done()`` / ``wait()``: committed and published (or failed);
    ``released()`` / ``wait_released()``: the tensors passed to ``save`` may change again."""

    def __init__(self, owner: Checkpointer, step: int, path: str, mode: str,
                 mode_reason: str = ""):
        self.step = step
        self.path = path
        self.mode = mode  # "snapshot" or "fence" (also a snapshot too large for the arena)
        self.mode_reason = mode_reason  # why the Checkpointer is in that mode
        self.info: SaveInfo | None = None
        self.error: BaseException | None = None
        self.blocked_s = 0.0  # time the snapshot waited for arena memory
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
        self._owner._await(self._done, f"step {self.step} to be written", timeout)
        self._owner._delivered(self)
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until the tensors given to ``save`` are no longer read (copied or written)."""
        self._owner._await(self._released, f"step {self.step} to release its tensors", timeout)

    def _finish(self, info: SaveInfo | None = None, error: BaseException | None = None) -> bool:
        if self._done.is_set():
            return False
        self.info, self.error = info, error
        self._released.set()
        self._done.set()
        return True


@dataclass
class _Job:
    handle: SaveHandle
    flat: Flattened | None  # the caller's state, flattened at save() (live tensors), or its
    # snapshot once taken (host copies; the records keep the devices they were saved from)
    events: list[tuple[torch.device, Any]]  # (device, CUDA event recorded at save())
    reservation: Reservation | None = None
    remote: dict[str, Any] | None = None  # writer="process": the snapshot, described for the helper
    tiers: tuple[str, ...] = ("drive",)  # where this step goes: "memory" and/or "drive"


_STOP = object()
_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


class Checkpointer:
    """Per-step checkpoints under ``root`` written in the background, with retention.

    ``keep_last``: committed checkpoints to keep (None keeps all); the newest is only removed
    once a newer one is committed. ``mode``: ``"auto"`` (default), ``"fence"`` or ``"snapshot"``
    (see the module doc). ``snapshot_bytes``: the snapshot arena's size; default twice the first
    checkpoint (``auto``: twice, else once, whatever fits the host memory).
    ``backend``, ``block_bytes``, ``staging_bytes``, ``io_threads``: passed to
    :func:`gds_persist.save` (None: the settings in force). ``process_group``: passed to
    ``save``/``load`` for data-parallel writes (use a group of its own: the writer thread runs its
    collectives); rank 0 publishes ``latest`` and applies retention, and a handle is done on every
    rank only once that is done. ``timeout_s``: bound on every wait for background work.
    ``max_pending``: saves in flight before ``save`` waits for the oldest to commit (default 2 in
    fence mode; unbounded in snapshot mode, where the arena bounds memory). ``writer``:
    ``"thread"`` (default) or ``"process"`` (snapshot mode only: a helper process writes the
    snapshots, so core ``save``'s Python takes no GIL from training). ``allow_pickle``: as
    :func:`gds_persist.save` (objects no node kind holds are stored pickled; not with a
    ``process_group``). ``warmup``: start :func:`gds_persist.warmup` for ``root`` in the
    background now (default True).

    ``incremental=True``: every checkpoint records BLAKE3-128 content hashes, and each save refers
    to the previous committed step (``save(..., base=...)``) for every unit whose bytes did not
    change - frozen weights, embeddings that rarely change - instead of writing it again.
    Retention keeps every step a kept step refers to. ``compression``: ``"none"``,
    ``"lossless"`` or ``"auto"`` as for :func:`gds_persist.save` (default: the setting).

    ``memory_root``: a node-local tmpfs directory (``/dev/shm/...``) for the memory tier
    (``docs/RECOVERY.md``): every ``memory_every`` steps each rank commits its own state there
    and copies it to ``replicas`` ranks on other nodes (default 1 where the group spans several
    nodes, else 0; the node is ``$GDS_PERSIST_NODE`` or the host name); every ``drive_every``
    steps the state goes to ``root`` as well. A step in neither tier is not written.
    ``load()`` then restores from the nearest verified copy (``restored_from``).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = 3,
                 mode: str = "auto", snapshot_bytes: int | None = None,
                 backend: str | None = None, process_group: Any = None,
                 timeout_s: float = 1800.0, max_pending: int | None = None,
                 block_bytes: int | None = None, staging_bytes: int | None = None,
                 io_threads: int | None = None, writer: str = "thread",
                 allow_pickle: bool = False, warmup: bool = True,
                 incremental: bool = False, compression: str | None = None,
                 memory_root: str | os.PathLike[str] | None = None, memory_every: int = 1,
                 drive_every: int = 1, replicas: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: valid modes are {', '.join(MODES)}")
        if writer not in WRITERS:
            raise ValueError(f"writer={writer!r}: valid writers are {', '.join(WRITERS)}")
        if writer == "process" and (mode != "snapshot" or process_group is not None):
            raise ValueError(
                "writer='process' writes snapshots from a helper process: it needs "
                "mode='snapshot' (fence mode writes the live tensors, which only this process "
                "can read) and no process_group (collectives belong to this process)"
            )
        if allow_pickle and process_group is not None:
            raise ValueError("allow_pickle=True is for single-process saves; it cannot be "
                             "combined with process_group")
        if compression is not None:
            check_compression(compression)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1 (or None to keep all)")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be at least 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        _check_tiers(memory_root, memory_every, drive_every, replicas, writer)
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self.requested_mode = mode
        self.mode = mode  # the mode in force: "auto" only until the first save decides
        self.mode_reason: str | None = None
        self.writer = writer
        self.timeout_s = float(timeout_s)
        self._max_pending = max_pending
        self.max_pending = max_pending or 2
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.loaded_step: int | None = None
        self.restored_from: str | None = None  # "memory", "replica" or "drive": the last load's
        self._save_kwargs: dict[str, Any] = {"backend": backend, "block_bytes": block_bytes,
                                             "staging_bytes": staging_bytes,
                                             "io_threads": io_threads}
        self._io_kwargs = dict(self._save_kwargs)  # memory-tier saves: plain, whole, alone
        if compression is not None:
            self._save_kwargs["compression"] = compression
        self.incremental = incremental
        if incremental:
            self._save_kwargs["content_hash"] = True
        self._load_kwargs: dict[str, Any] = {"backend": backend}
        # Ranks agree on publishing each step and on the step a load reads (SoloComm: no group).
        self._comm = make_comm(process_group, settings.current().collective_timeout_s)
        self._publisher = self._comm.rank == 0  # moves `latest` and removes old steps
        self.memory_every, self.drive_every, self._replicas = memory_every, drive_every, replicas
        self._memory = (None if memory_root is None else MemoryTier(
            os.path.join(os.path.abspath(os.fspath(memory_root)), job_name(self.root)),
            self._comm.rank))
        self._holders: list[list[int]] | None = None  # by rank: who keeps its replicas
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.RLock()
        self._stats = CheckpointerStats()
        self._pending: deque[SaveHandle] = deque()  # not done, oldest first
        self._undelivered: deque[SaveHandle] = deque()  # failed, error not yet raised
        latest = _steps.latest_step(self.root)
        self._floor = -1 if latest is None else latest  # save(step) needs step >= this
        self._base_step: int | None = latest  # incremental: the step the next save refers to
        self._rollback_to: int | None = None
        self._snapshot_bytes = snapshot_bytes
        self._arena: SnapshotArena | None = None
        self._queues: dict[str, queue.Queue[Any]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._current: dict[str, _Job] = {}
        self._death: dict[str, str] = {}  # why a thread stopped
        self._streams: dict[Any, Any] = {}
        self._closed = False  # no new saves
        self._stopping = False  # threads told to stop: dead ones are no longer replaced
        self._before_write: Callable[[int], None] | None = None  # test seam: runs in the writer
        self._helper_job_extra: dict[str, Any] = {}  # test seam: e.g. {"test_sleep_s": 5}
        self._helper = HelperProcess() if writer == "process" else None
        if self._helper is not None:
            self._helper.start()  # it imports torch while training starts
        self._warmup = BackgroundWarmup(
            self.root, backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
            io_threads=io_threads) if warmup else None
        self._queues["write"] = queue.Queue()
        self._start("write")
        if mode != "auto":
            self._use_mode(ModeChoice(mode, snapshot_bytes, "requested explicitly"))
        _live.add(self)

    # ---------------------------------------------------------------- public API

    def save(self, step: int, state_dict: Any, *, blocking: bool = False) -> SaveHandle:
        """Start saving ``state_dict`` as checkpoint ``step``; return its handle.

        Raises first any error of an earlier background save not yet raised, and TypeError (with
        the key path) for what a checkpoint cannot hold. With ``blocking=True`` it returns once
        the checkpoint is committed, raising its error.
        """
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        self._check_open()
        self._check_workers()
        self._raise_undelivered()
        if step < self._floor:
            raise ValueError(
                f"step {step} is before step {self._floor}, the newest checkpoint in {self.root} "
                "(or the one loaded): steps must not go back. To resume from an older step, "
                "ckpt.load(step=...) it first (newer checkpoints are then replaced as training "
                "proceeds), or use another root"
            )
        tiers = self._tiers(step)
        if not tiers:
            return self._skip(step)
        # TypeError naming the key, here rather than in the thread
        flat = flatten(state_dict, self.allow_pickle)
        if self.mode == "auto":
            self._use_mode(choose_mode(snapshot_nbytes(flat),
                                       any(s.is_cuda for s in flat.storage_objects),
                                       host_memory(), self._snapshot_bytes))
        self._wait_for_slot()
        if self._rollback_to is not None and self._publisher:
            # Resumed from an older step: publish it again first, so that a crash from now on
            # resumes on this timeline, not the abandoned newer checkpoints (removed after commit).
            _steps.write_latest(self.root, self._rollback_to)
        self._rollback_to = None
        mode = self.mode
        path = (_steps.step_path(self.root, step) if "drive" in tiers or self._memory is None
                else self._memory.own_step(step))
        handle = SaveHandle(self, step, path, mode, self.mode_reason or "")
        job = _Job(handle, flat, _record_events(flat), tiers=tiers)
        with self._lock:
            self._floor = step
            self._pending.append(handle)
            self._stats.saves += 1
        self._queues["snapshot" if mode == "snapshot" else "write"].put(job)
        if blocking:
            handle.wait()
        return handle

    def _tiers(self, step: int) -> tuple[str, ...]:
        if self._memory is None:
            return ("drive",)
        return tuple(t for t, every in (("memory", self.memory_every),
                                        ("drive", self.drive_every)) if step % every == 0)

    def _skip(self, step: int) -> SaveHandle:
        """A step in neither tier: nothing is written; the handle is done at once."""
        with self._lock:
            self._floor = step
        handle = SaveHandle(self, step, "", self.mode, self.mode_reason or "")
        handle._finish(info=SaveInfo(
            path="", backend="none", bytes_written=0, payload_bytes=0, seconds=0.0,
            tensors=0, storages=0, reason=f"step {step} is in neither tier (memory_every="
            f"{self.memory_every}, drive_every={self.drive_every}): not written"))
        return handle

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait until in-flight saves no longer read the tensors.

        Returns the hook's handle (``.remove()`` undoes it). The wait is bounded by ``timeout_s``
        and raises :class:`CheckpointTimeout` or :class:`WorkerDied`; a save that failed releases
        its tensors, and its error is raised by the next ``save``/``wait``, not by the step.
        """
        ref = weakref.ref(self)

        def wait_for_checkpoints(opt: Any, args: Any, kwargs: Any) -> None:
            ckpt = ref()
            if ckpt is not None:
                ckpt.wait_released()

        return optimizer.register_step_pre_hook(wait_for_checkpoints)

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until every save so far has released its tensors (what ``guard`` does)."""
        t0 = time.perf_counter()
        waited = False
        for handle in self._pending_handles():
            if not handle.released():
                waited = True
                handle.wait_released(timeout)
        if waited:
            with self._lock:
                self._stats.guard_waits += 1
                self._stats.guard_wait_s += time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed; raise the first error not yet raised.
        ``timeout`` (default ``timeout_s``) bounds the whole wait."""
        self._await_all(timeout)
        self._raise_undelivered()

    def latest_step(self) -> int | None:
        """The newest committed, published step under ``root`` (None if there is none)."""
        return _steps.latest_step(self.root)

    def steps(self) -> list[int]:
        """All committed steps under ``root``, ascending."""
        return _steps.committed_steps(self.root)

    def load(self, step: int | None = None, *, map_location: Any = None,
             verify: bool = True, into: Any = None, strict: bool = True) -> Any:
        """Load checkpoint ``step`` (default: the latest committed) after in-flight saves finish.

        Loading a step older than the latest marks a resume from it: the next ``save`` publishes
        it as ``latest`` again, and the newer checkpoints are removed once that save commits.

        Another process may save and prune under ``root`` meanwhile (a training job while this
        one evaluates): a step removed by retention while it is being opened is replaced by the
        then latest one (default ``step``; a few times at most), or raises
        :class:`CheckpointReplacedError` (an explicit ``step``). Once open, it loads whole.

        ``into``, ``strict``: restore in place into the given state's tensors, as
        :func:`gds_persist.load` (every tier). With the memory tier a copy that fails its checks
        part-way is followed by the next source, which fills the same tensors again.
        """
        if self._pending_handles():
            self.wait()
        kwargs = {**self._load_kwargs, "into": into, "strict": strict}
        if self.process_group is not None:
            kwargs["process_group"] = self.process_group
        if self._memory is not None and step is None:
            return self._restore(map_location, verify, kwargs)
        for attempt in range(_LOAD_ATTEMPTS):
            latest = self.latest_step()
            # with a process group, every rank loads the step rank 0 chose
            chosen = self._comm.broadcast_json(latest if step is None else step, 0,
                                               "checkpoint step")
            if chosen is None:
                raise CheckpointError(f"no committed checkpoint in {self.root} to load")
            path = _steps.step_path(self.root, chosen)
            try:  # every rank raises the same CheckpointReplacedError (ranks agree in load)
                state = core_load(path, map_location=map_location, verify=verify, **kwargs)
                break
            except CheckpointReplacedError:
                if step is not None or attempt == _LOAD_ATTEMPTS - 1:
                    raise
        self._loaded(chosen, latest, Restored(None, chosen, "drive", ["drive"] * self._comm.size))
        return state

    def _restore(self, map_location: Any, verify: bool, kwargs: dict[str, Any]) -> Any:
        """load() with a memory tier: the nearest verified copy of the newest step every rank
        can restore (:mod:`.recovery`)."""
        assert self._memory is not None
        alone = {k: v for k, v in kwargs.items() if k != "process_group"}

        def load_alone(path: str, drive: bool) -> Any:
            rank_local = self._comm.rank if drive and self.process_group is not None else None
            return core_load(path, map_location=map_location, verify=True,
                             rank_local=rank_local, **alone)

        def load_group(path: str) -> Any:
            return core_load(path, map_location=map_location, verify=verify, **kwargs)

        latest = self.latest_step()
        got = restore(self._comm, self._memory, self.root, load_alone, load_group)
        state, got.state = got.state, None
        self._loaded(got.step, latest, got)
        return state

    def _loaded(self, step: int, latest: int | None, got: Restored) -> None:
        with self._lock:
            self.loaded_step = step
            self._floor = step
            self._base_step = step
            self._rollback_to = step if latest is not None and step < latest else None
            self.restored_from = got.source
            s = self._stats
            s.restored_from, s.restore_step, s.restore_s = got.source, step, got.seconds
            s.restore_sources, s.restore_skipped = list(got.sources), list(got.skipped)

    @property
    def warmup_report(self) -> WarmupReport | None:
        """What the background warm-up did (None while it runs, or with ``warmup=False``)."""
        return None if self._warmup is None else self._warmup.report

    @property
    def stats(self) -> CheckpointerStats:
        with self._lock:
            s = replace(self._stats)
        if self._arena is not None:
            s.snapshot_bytes, s.snapshot_peak_bytes = self._arena.capacity, self._arena.peak_bytes
        s.mode, s.mode_reason = self.mode, self.mode_reason or ""
        return s

    def close(self, timeout: float | None = None) -> None:
        """Finish in-flight saves (bounded), stop the threads, raise any error not yet raised.
        Idempotent. ``load`` and ``latest_step`` still work afterwards."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            self._await_all(timeout)
        except BaseException:
            self._stop_threads(join_s=0.5)  # a hung write: do not wait for it a second time
            raise
        self._stop_threads(join_s=self.timeout_s)
        self._raise_undelivered()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body's exception wins; a background error is logged and attached to it
            self.close()
        except Exception as bg:  # noqa: BLE001
            log.error("gds_persist.Checkpointer(%s): %s: %s", self.root, type(bg).__name__, bg)
            _add_note(exc, f"also, while closing the Checkpointer: {type(bg).__name__}: {bg}")

    def _use_mode(self, choice: ModeChoice) -> None:
        """Put the mode in force (at construction, or at the first save for ``auto``)."""
        self.mode, self.mode_reason = choice.mode, choice.reason
        if choice.snapshot_bytes is not None:
            self._snapshot_bytes = choice.snapshot_bytes
        if self._max_pending is None:  # snapshot: the arena is the bound
            self.max_pending = 2 if choice.mode == "fence" else 1 << 30
        if choice.mode == "snapshot":
            with self._lock:
                self._queues["snapshot"] = queue.Queue()
                self._start("snapshot")
        if self.requested_mode == "auto":
            log.info("gds_persist.Checkpointer(%s): mode %s (%s)", self.root, choice.mode,
                     choice.reason)

    # ---------------------------------------------------------------- waiting and errors

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer of {self.root} is closed; create a new one")

    def _pending_handles(self) -> list[SaveHandle]:
        with self._lock:
            while self._pending and self._pending[0].done():
                self._pending.popleft()
            return [h for h in self._pending if not h.done()]

    def _await_all(self, timeout: float | None) -> None:
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        for handle in self._pending_handles():
            try:
                self._await(handle._done, "", max(0.0, deadline - time.monotonic()))
            except CheckpointTimeout:
                steps = ", ".join(str(h.step) for h in self._pending_handles())
                raise CheckpointTimeout(
                    f"waited {limit:.1f} s for the saves of steps {steps} under {self.root}: "
                    "still running (slow or hung storage?); raise Checkpointer(timeout_s=...) "
                    "if the drive is just slow"
                ) from None

    def _wait_for_slot(self) -> None:
        pending = self._pending_handles()
        if len(pending) < self.max_pending:
            return
        t0 = time.perf_counter()
        for handle in pending[: len(pending) - self.max_pending + 1]:
            self._await(handle._done, f"step {handle.step} to be written (max_pending="
                        f"{self.max_pending} saves in flight)", None)
        with self._lock:
            self._stats.save_waits += 1
            self._stats.save_wait_s += time.perf_counter() - t0

    def _await(self, event: threading.Event, what: str, timeout: float | None) -> None:
        """Wait for ``event`` in short slices, checking the threads; bounded by ``timeout``."""
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

    def _delivered(self, handle: SaveHandle) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._undelivered.remove(handle)

    def _raise_undelivered(self) -> None:
        with self._lock:
            failed = list(self._undelivered)
            self._undelivered.clear()
        if not failed:
            return
        first = failed[0].error
        assert first is not None
        if len(failed) > 1:
            later = ", ".join(f"step {h.step} ({type(h.error).__name__})" for h in failed[1:])
            _add_note(first, f"later background saves also failed: {later}")
        raise first

    def _fail(self, job: _Job, error: BaseException) -> None:
        job.flat = None
        if error.__traceback__ is not None:  # drop the frames' references to the tensors
            traceback.clear_frames(error.__traceback__)
        self._free(job)
        h = job.handle
        _add_note(error, f"(gds_persist.Checkpointer: the checkpoint of step {h.step} to {h.path} "
                         "failed in the background; earlier checkpoints are untouched)")
        if h._finish(error=error):
            with self._lock:
                self._stats.failed += 1
                self._undelivered.append(h)

    def _free(self, job: _Job) -> None:
        job.remote = None
        if job.reservation is not None and self._arena is not None:
            self._arena.free(job.reservation)
        job.reservation = None

    # ---------------------------------------------------------------- threads

    def _start(self, stage: str) -> None:
        run = self._write if stage == "write" else self._snapshot
        t = threading.Thread(target=self._loop, args=(stage, self._queues[stage], run),
                             name=f"gds_persist-{stage}", daemon=True)
        self._threads[stage] = t
        t.start()

    def _loop(self, stage: str, q: queue.Queue[Any], run: Callable[[_Job], None]) -> None:
        while True:
            job = q.get()
            if job is _STOP:
                return
            if stage == "write" and self._warmup is not None and not self._warmup.done():
                self._warmup.wait(min(WARMUP_WAIT_S, self.timeout_s))  # then write regardless
            with self._lock:
                self._current[stage] = job
            try:
                with self._device_streams(job):
                    run(job)  # reports an Exception through the job's handle
            except BaseException as e:  # noqa: BLE001 - SystemExit & co. end this thread
                self._death[stage] = f"{type(e).__name__}: {e}"
                log.error("gds_persist %s thread stopped by %s: %s", stage, type(e).__name__, e)
                return  # the job stays in _current: _check_workers fails it
            with self._lock:
                self._current.pop(stage, None)

    def _check_workers(self) -> None:
        """Fail the save a dead thread was doing, and start a new thread for the next ones."""
        dead_jobs = []
        with self._lock:
            for stage, t in list(self._threads.items()):
                if not t.is_alive() and not self._stopping:
                    job = self._current.pop(stage, None)
                    if job is not None:
                        dead_jobs.append((stage, job))
                    self._start(stage)
        for stage, job in dead_jobs:
            why = self._death.pop(stage, "see the log for why")
            self._fail(job, WorkerDied(
                f"the gds_persist {stage} thread died while saving step {job.handle.step} "
                f"({why}); that save is lost, later saves use a new thread"))

    def _stop_threads(self, join_s: float) -> None:
        with self._lock:
            self._stopping = True
        for q in self._queues.values():
            q.put(_STOP)
        deadline = time.monotonic() + join_s
        for t in self._threads.values():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._warmup is not None:  # nothing of ours runs on after close
            self._warmup.wait(max(0.0, deadline - time.monotonic()))
        if self._helper is not None and not self._threads["write"].is_alive():
            self._helper.stop(max(0.0, deadline - time.monotonic()))
        if self._arena is not None and not any(t.is_alive() for t in self._threads.values()):
            self._arena.close()

    @contextlib.contextmanager
    def _device_streams(self, job: _Job) -> Iterator[None]:
        """Run the job's copies on a side stream per device, not behind the training kernels."""
        if not job.events:
            yield
            return
        with contextlib.ExitStack() as stack:
            for device, _ in job.events:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

    # ---------------------------------------------------------------- the two stages

    def _snapshot(self, job: _Job) -> None:
        h = job.handle
        try:
            _synchronize(job)
            assert job.flat is not None
            need = snapshot_nbytes(job.flat)
            if self._arena is None:
                capacity = self._snapshot_bytes if self._snapshot_bytes else 2 * need
                self._arena = SnapshotArena(capacity, self.timeout_s,
                                            shared=self._helper is not None)
            try:
                job.reservation = self._arena.reserve(need)
            except SnapshotTooLarge as e:
                log.warning("%s; writing step %d from the live tensors (fence)", e, h.step)
                h.mode = "fence"
                with self._lock:
                    self._stats.fence_fallbacks += 1
                self._queues["write"].put(job)
                return
            h.blocked_s = job.reservation.waited_s
            if h.blocked_s:
                with self._lock:
                    self._stats.snapshot_blocked += 1
                    self._stats.snapshot_blocked_s += h.blocked_s
            if self._helper is not None:  # copy only; the helper rebuilds and writes
                f = job.flat
                offsets = copy_storages(f, self._arena, job.reservation)
                job.remote = {"tree": f.tree, "tensors": f.tensors, "storages": f.storages,
                              "offsets": offsets, "arena": self._arena.shared}
                job.flat = None
            else:
                job.flat = take_snapshot(job.flat, self._arena, job.reservation)
            job.events = []
            h._released.set()
            self._queues["write"].put(job)
        except Exception as e:  # noqa: BLE001 - reported through the handle
            self._fail(job, e)

    def _write(self, job: _Job) -> None:
        h = job.handle
        try:
            _synchronize(job)
            if self._before_write is not None:
                self._before_write(h.step)
            info = self._write_memory(job) if "memory" in job.tiers else None
            if info is None or "drive" in job.tiers:
                info = self._write_drive(job)
            job.flat = None
            self._free(job)
            h._released.set()
            if "drive" in job.tiers:
                # Every rank's save has returned; rank 0 publishes and every rank learns the
                # outcome, so no rank's handle is done before `latest` names the step.
                self._comm.agree("publish", lambda: self._publish(h),
                                 f"publishing step {h.step} under {self.root}")
        except Exception as e:  # noqa: BLE001 - reported through the handle
            self._fail(job, e)
            return
        if "drive" in job.tiers:
            with self._lock:
                self._stats.committed += 1
                self._stats.write_s += info.seconds
                self._stats.bytes_written += info.bytes_written
                self._stats.bytes_referenced += info.referenced_bytes
                self._base_step = h.step
        h._finish(info=info)

    def _write_memory(self, job: _Job) -> SaveInfo | None:
        """Commit the step to every rank's node memory and its replicas to their holders; None
        (and the step goes to the drive instead) when some node's tmpfs lacks room."""
        assert self._memory is not None and job.flat is not None
        tier, flat, step, comm = self._memory, job.flat, job.handle.step, self._comm
        facts = comm.all_gather_json({"node": node_name(), "need": step_bytes(flat),
                                      "free": tier.free_bytes()}, "memory tier room")
        nodes = [f["node"] for f in facts]
        if self._holders is None:
            count = self._replicas
            if count is None:  # default: one copy elsewhere, where there is an elsewhere
                count = min(1, len(set(nodes)) - 1)
            self._holders = holders(nodes, count)
        why = lacks_room([f["need"] for f in facts], [f["free"] for f in facts], nodes,
                         self._holders)
        if why is not None:
            log.warning("gds_persist.Checkpointer(%s): step %d goes to the drive: %s",
                        self.root, step, why)
            with self._lock:
                self._stats.memory_fallbacks += 1
                self._stats.memory_fallback_reason = why
            job.tiers = (*job.tiers, "drive") if "drive" not in job.tiers else job.tiers
            job.handle.path = _steps.step_path(self.root, step)
            return None
        t0 = time.perf_counter()
        saved: list[SaveInfo] = []
        comm.agree("memory save", lambda: saved.append(tier.save(flat, step, self._io_kwargs)),
                   f"memory-tier save of step {step} under {tier.root}")
        t1 = time.perf_counter()
        mine = self._holders[comm.rank]
        held = [r for r, hs in enumerate(self._holders) if comm.rank in hs]
        transfer(comm, {h: tier.own_step(step) for h in mine},
                 {r: tier.replica_step(r, step) for r in held}, f"replicas of step {step}")
        comm.agree("memory retention", lambda: tier.retain(step, held),
                   f"memory-tier retention after step {step} under {tier.root}")
        with self._lock:
            s = self._stats
            s.memory_committed += 1
            s.memory_write_s += t1 - t0
            s.replicate_s += time.perf_counter() - t1
            s.replica_holders = list(mine)
        return saved[0]

    def _write_drive(self, job: _Job) -> SaveInfo:
        """The step to ``root`` (the drive): one writer, or every rank 1/N with a group."""
        h = job.handle
        kwargs = dict(self._save_kwargs)
        if self.process_group is not None:
            kwargs["process_group"] = self.process_group
        base = self._base_for(h)
        if base is not None:
            kwargs["base"] = base
        if job.remote is not None:
            assert self._helper is not None
            try:
                info = self._helper.write(
                    {**job.remote, **self._helper_job_extra, "path": h.path,
                     "kwargs": kwargs}, self.timeout_s, f"writing step {h.step}")
            except TimeoutError as e:
                raise CheckpointTimeout(f"{e} (under {self.root}); raise "
                                        "Checkpointer(timeout_s=...) if the drive is slow"
                                        ) from None
        else:
            assert job.flat is not None
            info = core_save(job.flat, h.path, **kwargs)  # flattened once, at save()
        return info

    def _base_for(self, h: SaveHandle) -> str | None:
        """incremental=True: the committed step this save refers to (the last one this
        Checkpointer committed, or loaded, or found at start), if it is still there."""
        if not self.incremental or self._base_step is None:
            return None
        path = _steps.step_path(self.root, self._base_step)
        if path == h.path or not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            return None
        return path

    def _publish(self, h: SaveHandle) -> None:
        if not self._publisher:
            return
        try:
            _steps.write_latest(self.root, h.step)
            _steps.apply_retention(self.root, h.step, self.keep_last)
        except OSError as e:
            raise CheckpointError(
                f"step {h.step} was committed at {h.path}, but publishing it failed "
                f"(updating {self.root}/latest or removing old steps): {e}"
            ) from e


def _check_tiers(memory_root: Any, memory_every: int, drive_every: int, replicas: int | None,
                 writer: str) -> None:
    for name, value in (("memory_every", memory_every), ("drive_every", drive_every)):
        if operator.index(value) < 1:
            raise ValueError(f"{name}={value} must be at least 1 (a step is written to a tier "
                             "when the tier's interval divides it)")
    if replicas is not None and replicas < 0:
        raise ValueError(f"replicas={replicas} must be 0 or more")
    if memory_root is None:
        if memory_every != 1 or drive_every != 1 or replicas:
            raise ValueError("memory_every, drive_every and replicas are the memory tier's: "
                             "pass memory_root=DIR (a tmpfs such as /dev/shm/ckpt) as well")
        return
    if writer == "process":
        raise ValueError("writer='process' writes only to the drive; the memory tier "
                         "(memory_root=) needs writer='thread'")


def _record_events(flat: Flattened) -> list[tuple[torch.device, Any]]:
    """One CUDA event per device, recorded on its current stream: the tensors are final after."""
    devices = {s.device for s in flat.storage_objects if s.is_cuda}
    events = []
    for device in sorted(devices, key=str):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        events.append((device, ev))
    return events


def _synchronize(job: _Job) -> None:
    """In a worker: wait (this thread only) until the caller's kernels up to save() are done."""
    for _, ev in job.events:
        ev.synchronize()


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def _close_at_exit() -> None:
    """Interpreter exit: let in-flight checkpoints commit (bounded) rather than lose them."""
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001
            log.error("gds_persist.Checkpointer(%s) at exit: %s: %s", ckpt.root,
                      type(e).__name__, e)


# Run before concurrent.futures refuses new work at shutdown (a save uses a thread pool):
# threading's exit hooks run last-registered first, and ..save imported concurrent.futures above
# (through transfer.staging).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_at_exit)
else:  # pragma: no cover - Python without threading._register_atexit
    atexit.register(_close_at_exit)

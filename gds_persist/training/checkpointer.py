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
  exists) and releases them; the write follows from the copy, for updates that come before a
  write could finish. The arena never grows: a snapshot waits for memory (counted in ``stats``);
  a state larger than the whole arena is written fence-style.

Start-up: a new Checkpointer starts :func:`gds_persist.warmup` in a background thread (CUDA
context and side streams, staging ring, backend probe, kvikio/cuFile start-up, device CRC kernel)
so that the first checkpoint is not the slow one; the first write waits for it (bounded).
``warmup=False`` skips it; ``ckpt.warmup_report`` says what it did.

What a save holds (:mod:`.capture`): every tensor bit for bit as it was when ``save`` was
called, whatever changes it afterwards, or the save fails with TornCheckpointError naming it.

Threads: one writer thread (plus a snapshot thread in snapshot mode). Their bulk work releases
the GIL; core ``save``'s Python around it does not (docs/TRAINING.md). ``writer="process"``
(snapshot mode) writes from a helper process (:mod:`.helper`). Every wait is bounded
(``timeout_s``) and watches the threads and the helper: one that dies fails the save it was
doing (a new one takes the next), never hangs.

Each state dict is flattened once, by ``save`` (a state a checkpoint cannot hold raises there,
naming the key), and that Flattened (or its snapshot) is what core ``save`` writes. A background
error is raised by ``handle.wait()``, else by the next ``save``/``wait``/``close``.

This module is the public API and joins the parts: handles, counters and bounded waits
(:mod:`.handles`), threads (:mod:`.background_writer`), CUDA streams and events
(:mod:`.streams`), the snapshot arena (:mod:`.snapshot`), where each step goes (:mod:`.tiers`).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .. import settings
from ..errors import CheckpointError, CheckpointReplacedError
from ..loading.load import load as core_load
from ..parallel.distributed import make_comm
from ..results import WarmupReport
from ..saving.compression import check_mode as check_compression
from ..transfer.warmup import BackgroundWarmup
from . import steps as _steps
from .at_exit import before_thread_pools_stop
from .background_writer import Workers, add_note
from .capture import Capture, GuardHandle, held_by
from .handles import CheckpointerStats, Job, Pending, SaveHandle
from .helper import HelperProcess
from .mode import ModeChoice, choose_mode, host_memory
from .snapshot import ArenaOwner, snapshot_nbytes
from .streams import DeviceStreams, record_events, synchronize
from .tier.memory import MemoryTier, job_name
from .tier.reading import Request
from .tier.recovery import Restored, restore
from .tiers import Tiers, check_rank_local, check_tiers

log = logging.getLogger("gds_persist")

MODES = ("auto", "fence", "snapshot")
WARMUP_WAIT_S = 60.0  # longest the first write waits for the warm-up to finish
_LOAD_ATTEMPTS = 3  # load(): steps removed by another process's retention while being opened
WRITERS = ("thread", "process")

_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


class Checkpointer:
    """Per-step checkpoints under ``root`` written in the background, with retention.

    Guaranteed: each checkpoint holds every tensor as it was when ``save`` was called, whatever
    changes it afterwards (a forward pass, an EMA, user code), or that save fails naming the
    tensor. Cost: at ``save``, a CRC32C of the tensors the guarded optimizer holds or that did
    not change, and a copy of the others (small ones, BatchNorm statistics, a changed EMA).

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
    ``"thread"`` (default) or ``"process"`` (snapshot mode: a helper process writes).
    ``allow_pickle``: as :func:`gds_persist.save` (not with a ``process_group``). ``warmup``:
    start :func:`gds_persist.warmup` for ``root`` in the background now (default True).

    ``incremental=True``: every checkpoint records BLAKE3-128 content hashes, and each save refers
    to the previous committed step (``save(..., base=...)``) for every unit whose bytes did not
    change (frozen weights) instead of writing it again; retention keeps what kept steps need.
    ``compression``: ``"none"``,
    ``"lossless"`` or ``"auto"`` as for :func:`gds_persist.save` (default: the setting).

    ``memory_root``: a node-local tmpfs directory (``/dev/shm/...``) for the memory tier
    (``docs/RECOVERY.md``): every ``memory_every`` steps each rank commits its byte-range share
    of the replicated state there and copies it to ``replicas`` ranks on other nodes (default 1
    where the group spans several nodes, else 0; the node is ``$GDS_PERSIST_NODE`` or the host
    name), a copy bounded by ``peer_timeout_s`` per chunk; every ``drive_every`` steps the
    state goes to ``root`` too. ``load()`` restores from the nearest verified copies.
    ``rank_local``: key paths of per-rank state (ZeRO shards), as :func:`gds_persist.save`;
    needs a ``process_group``; each rank keeps its own in either tier (``docs/RECOVERY.md``).
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
                 drive_every: int = 1, replicas: int | None = None,
                 peer_timeout_s: float = 60.0, rank_local: Any = None):
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
        check_tiers(memory_root, memory_every, drive_every, replicas, writer)
        local_paths = check_rank_local(rank_local, process_group)
        self.root = os.path.abspath(os.fspath(root))
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
        save_kwargs: dict[str, Any] = {"backend": backend, "block_bytes": block_bytes,
                                       "staging_bytes": staging_bytes, "io_threads": io_threads}
        io_kwargs = dict(save_kwargs)  # memory-tier saves: plain, whole, alone
        if compression is not None:
            save_kwargs["compression"] = compression
        if incremental:
            save_kwargs["content_hash"] = True
        self._load_kwargs: dict[str, Any] = {"backend": backend}
        # Ranks agree on publishing each step and on the step a load reads (SoloComm: no group).
        self._comm = make_comm(process_group, settings.current().collective_timeout_s)
        self._publisher = self._comm.rank == 0  # moves `latest` and removes old steps
        _steps.make_root(self.root)  # a file there: NotACheckpointDirectoryError
        self._lock = threading.RLock()
        self._stats = CheckpointerStats()
        self._pending = Pending(self.root, self.timeout_s, self._stats, self._lock,
                                self._check_workers)
        latest = _steps.latest_step(self.root)
        self._floor = -1 if latest is None else latest  # save(step) needs step >= this
        self._rollback_to: int | None = None
        self._snapshot_bytes = snapshot_bytes
        self._snapshots: ArenaOwner | None = None  # snapshot mode: the arena, at the first save
        self._capture = Capture()
        self._guarded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._streams = DeviceStreams()
        self._workers = Workers(self._prepare)
        self._closed = False  # no new saves
        self._before_write: Callable[[int], None] | None = None  # test seam: runs in the writer
        self._helper = HelperProcess() if writer == "process" else None
        if self._helper is not None:
            self._helper.start()  # it imports torch while training starts
        memory = (None if memory_root is None else MemoryTier(
            os.path.join(os.path.abspath(os.fspath(memory_root)), job_name(self.root)),
            self._comm.rank))
        self._tiers = Tiers(
            self.root, self._comm, memory, memory_every=memory_every, drive_every=drive_every,
            replicas=replicas, keep_last=keep_last, save_kwargs=save_kwargs, io_kwargs=io_kwargs,
            process_group=process_group, incremental=incremental, helper=self._helper,
            timeout_s=self.timeout_s, stats=self._stats, lock=self._lock, base_step=latest,
            peer_timeout_s=peer_timeout_s, rank_local=local_paths)
        self._warmup = BackgroundWarmup(
            self.root, backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
            io_threads=io_threads) if warmup else None
        self._workers.add("write", self._in_streams(self._write))
        if mode != "auto":
            self._use_mode(ModeChoice(mode, snapshot_bytes, "requested explicitly"))
        _live.add(self)

    # the tier settings live in Tiers (one copy); set here, they apply from the next save
    keep_last = property(lambda self: self._tiers.keep_last,
                         lambda self, v: setattr(self._tiers, "keep_last", v))
    incremental = property(lambda self: self._tiers.incremental)
    memory_every = property(lambda self: self._tiers.memory_every)
    drive_every = property(lambda self: self._tiers.drive_every)

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
        if self._closed:
            raise CheckpointError(f"this Checkpointer of {self.root} is closed; create a new one")
        self._check_workers()
        self._pending.raise_undelivered()
        if step < self._floor:
            raise ValueError(
                f"step {step} is before step {self._floor}, the newest checkpoint in {self.root} "
                "(or the one loaded): steps must not go back. To resume from an older step, "
                "ckpt.load(step=...) it first (newer checkpoints are then replaced as training "
                "proceeds), or use another root"
            )
        tiers = self._tiers.of(step)
        if not tiers:
            return self._skip(step)
        # TypeError naming the key, here rather than in the thread
        flat = self._tiers.flatten(state_dict, self.allow_pickle)
        # every tensor as it is now: copied, held by a guard, or unchanged (checked at commit)
        flat, captured = self._capture(flat, held_by(self._guarded))
        if self.mode == "auto":
            self._use_mode(choose_mode(snapshot_nbytes(flat),
                                       any(s.is_cuda for s in flat.storage_objects),
                                       host_memory(), self._snapshot_bytes))
        self._pending.wait_for_slot(self.max_pending)
        if self._rollback_to is not None and self._publisher:
            # Resumed from an older step: publish it again first, so that a crash from now on
            # resumes on this timeline, not the abandoned newer checkpoints (removed after commit).
            _steps.write_latest(self.root, self._rollback_to)
        self._rollback_to = None
        mode = self.mode
        handle = SaveHandle(self._pending, step, self._tiers.path(step, tiers), mode,
                            self.mode_reason or "")
        job = Job(handle, flat, record_events(flat), tiers=tiers)
        with self._lock:
            self._floor = step
            self._pending.add(handle)
            self._stats.saves += 1
            self._stats.copied_at_save_bytes += captured.copied
            self._stats.read_live_bytes += captured.held + captured.unchanged
        self._workers.put("snapshot" if mode == "snapshot" else "write", job)
        if blocking:
            handle.wait()
        return handle

    def _skip(self, step: int) -> SaveHandle:
        """A step in neither tier: nothing is written; the handle is done at once."""
        with self._lock:
            self._floor = step
        handle = SaveHandle(self._pending, step, "", self.mode, self.mode_reason or "")
        handle._finish(info=self._tiers.skipped(step))
        return handle

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait until in-flight saves no longer read the tensors.

        Returns a handle whose ``.remove()`` undoes it (its tensors are then copied at ``save``).
        The wait is bounded by ``timeout_s`` and raises :class:`CheckpointTimeout` or
        :class:`WorkerDied`; a failed save's error is raised by the next ``save``/``wait``.
        """
        ref = weakref.ref(self)

        def wait_for_checkpoints(opt: Any, args: Any, kwargs: Any) -> None:
            ckpt = ref()
            if ckpt is not None:
                ckpt.wait_released()

        return GuardHandle(optimizer.register_step_pre_hook(wait_for_checkpoints), optimizer,
                           self._guarded)

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until saves so far and a restore's healing no longer read the tensors (guard)."""
        self._pending.wait_released(timeout)
        self._tiers.wait_heal_read(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed; raise the first error not yet raised.
        ``timeout`` (default ``timeout_s``) bounds the whole wait."""
        self._pending.await_all(timeout)
        self._pending.raise_undelivered()

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

        Another process may save and prune under ``root`` meanwhile (training while this one
        evaluates): a step removed by retention while being opened is replaced by the then
        latest (default ``step``; a few times at most), or raises CheckpointReplacedError.

        ``into``, ``strict``: restore in place into the given state's tensors, as
        :func:`gds_persist.load` (every tier). With the memory tier a copy that fails its checks
        part-way is followed by the next source, which fills the same tensors again.
        """
        if self._pending.handles():
            self.wait()
        kwargs = {**self._load_kwargs, "into": into, "strict": strict}
        if self.process_group is not None:
            kwargs["process_group"] = self.process_group
        if self._tiers.memory is not None:
            return self._restore(step, map_location, verify, kwargs)
        for attempt in range(_LOAD_ATTEMPTS):
            latest = self.latest_step()
            # with a process group, every rank loads the step rank 0 chose
            chosen = self._comm.broadcast_json(latest if step is None else step, 0,
                                               "checkpoint step")
            if chosen is None:
                raise _steps.nothing_to_load(self.root)  # also a FileNotFoundError
            path = _steps.step_path(self.root, chosen)
            try:  # every rank raises the same CheckpointReplacedError (ranks agree in load)
                state = core_load(path, map_location=map_location, verify=verify, **kwargs)
                break
            except CheckpointReplacedError:
                if step is not None or attempt == _LOAD_ATTEMPTS - 1:
                    raise
        self._loaded(chosen, latest, Restored(None, chosen, "drive", ["drive"] * self._comm.size))
        return state

    def _restore(self, step: int | None, map_location: Any, verify: bool,
                 kwargs: dict[str, Any]) -> Any:
        """load() with a memory tier: ``step`` (default the newest every rank can restore) from
        the nearest verified copies (:mod:`.tier.recovery`); a copy restored from replicas is
        rewritten into this node's memory afterwards, in the background."""
        memory = self._tiers.memory
        assert memory is not None

        def load_drive(path: str) -> tuple[Any, int]:
            state, info = core_load(path, map_location=map_location, verify=verify,
                                    return_info=True, **kwargs)
            return state, info.payload_bytes

        request = Request(kwargs["into"], kwargs["strict"], map_location,
                          {"backend": kwargs.get("backend")})
        latest, peer_s = self.latest_step(), self._tiers.peer_timeout_s
        got = restore(self._comm, memory, self.root, load_drive, request, step, peer_s,
                      self._tiers.replica_plan)
        state = self._tiers.take(got)  # and heals this node's copies from the state
        self._loaded(got.step, latest, got)
        return state

    def _loaded(self, step: int, latest: int | None, got: Restored) -> None:
        with self._lock:
            self.loaded_step = step
            self._floor = step
            self._tiers.base_step = step
            self._rollback_to = step if latest is not None and step < latest else None
            self.restored_from = got.source
            s = self._stats
            s.restored_from, s.restore_step, s.restore_s = got.source, step, got.seconds
            s.restore_sources, s.restore_skipped = list(got.sources), list(got.skipped)
            s.restore_bytes = dict(got.bytes_from)

    @property
    def warmup_report(self) -> WarmupReport | None:
        """What the background warm-up did (None while it runs, or with ``warmup=False``)."""
        return None if self._warmup is None else self._warmup.report

    @property
    def stats(self) -> CheckpointerStats:
        with self._lock:
            s = replace(self._stats)
        if self._snapshots is not None:
            s.snapshot_bytes = self._snapshots.capacity
            s.snapshot_peak_bytes = self._snapshots.peak_bytes
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
            self._pending.await_all(timeout)
        except BaseException:
            self._stop_threads(join_s=0.5)  # a hung write: do not wait for it a second time
            raise
        self._stop_threads(join_s=self.timeout_s)
        self._tiers.join_heal()
        self._pending.raise_undelivered()

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
            add_note(exc, f"also, while closing the Checkpointer: {type(bg).__name__}: {bg}")

    def _use_mode(self, choice: ModeChoice) -> None:
        """Put the mode in force (at construction, or at the first save for ``auto``)."""
        self.mode, self.mode_reason = choice.mode, choice.reason
        if choice.snapshot_bytes is not None:
            self._snapshot_bytes = choice.snapshot_bytes
        if self._max_pending is None:  # snapshot: the arena is the bound
            self.max_pending = 2 if choice.mode == "fence" else 1 << 30
        if choice.mode == "snapshot":
            requested = self._snapshot_bytes  # default: twice the first snapshot; never grows
            self._snapshots = ArenaOwner(lambda need: requested if requested else 2 * need,
                                         self.timeout_s, shared=self._helper is not None)
            self._workers.add("snapshot", self._in_streams(self._snapshot))
        if self.requested_mode == "auto":
            log.info("gds_persist.Checkpointer(%s): mode %s (%s)", self.root, choice.mode,
                     choice.reason)

    # ---------------------------------------------------------------- test seams

    @property
    def _threads(self) -> dict[str, threading.Thread]:
        return self._workers.threads

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
            if self._before_write is not None:
                self._before_write(h.step)
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


def _close_at_exit() -> None:
    """Interpreter exit: let in-flight checkpoints commit (bounded) rather than lose them."""
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001
            log.error("gds_persist.Checkpointer(%s) at exit: %s: %s", ckpt.root,
                      type(e).__name__, e)


before_thread_pools_stop(_close_at_exit)

"""Checkpointing that overlaps training: :class:`Checkpointer` (``docs/TRAINING.md``).

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

``save`` returns at once; the checkpoint of step i is written while step i+1 runs, and the guard
makes step i+1's update wait until the write no longer reads the tensors. The modes (``auto``,
``fence``, ``snapshot``), the warm-up, the threads and what a save holds are described in
``docs/TRAINING.md``. This module is the public API and joins the parts: handles, counters and
bounded waits (:mod:`.handles`), the threads' jobs (:mod:`.writer_threads`, on
:mod:`.background_writer`),
loading (:mod:`.restoring`), CUDA streams (:mod:`.streams`), the snapshot arena
(:mod:`.snapshot`), where each step goes (:mod:`.tiers`, :mod:`.options`).
"""

from __future__ import annotations

import logging
import operator
import os
import reprlib
import threading
import weakref
from dataclasses import replace
from typing import Any

import torch

from .. import settings
from ..errors import CheckpointError
from ..keywords import as_settings, removed_keywords
from ..parallel.distributed import make_comm
from ..results import WarmupReport
from ..saving.compression import check_mode as check_compression
from ..stores import is_url, resolve
from ..transfer.warmup import BackgroundWarmup
from . import steps as _steps
from .at_exit import before_thread_pools_stop
from .background_writer import Workers, add_note
from .capture import Capture, GuardHandle, held_by
from .handles import CheckpointerStats, Job, Pending, SaveHandle
from .helper import HelperProcess
from .mode import ModeChoice, choose_mode, host_memory
from .options import LocalLevel, MemoryTier, TierConfig, check_levels
from .restoring import Restoring
from .snapshot import ArenaOwner, snapshot_nbytes
from .streams import DeviceStreams, record_events
from .tiers import Tiers, check_rank_local
from .writer_threads import WriterThreads

log = logging.getLogger("gds_persist")

MODES = ("auto", "fence", "snapshot")
WRITERS = ("thread", "process")
_MEMORY = {name: f"{name} is a field of the memory tier since 0.2: use "
                 f"memory=gds_persist.MemoryTier(root=...{field})"
           for name, field in (("memory_root", ""), ("memory_every", ", every=..."),
                               ("replicas", ", replicas=..."),
                               ("peer_timeout_s", ", peer_timeout_s=..."))}

_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


class Checkpointer(WriterThreads, Restoring):
    """Per-step checkpoints under ``root``, written in the background, with retention.

    Each checkpoint holds every tensor as it was when ``save`` was called, or that save fails
    naming the tensor (``docs/TRAINING.md``). I/O tuning (``block_bytes``, ...) is the settings
    in force when a step is written: :func:`gds_persist.settings.set`, for the whole process.

    Parameters
    ----------
    root : path
        Where the step directories and ``latest`` go; created at the first ``save``. Or an
        object-store URL, ``s3://bucket/prefix`` (``docs/OBJECT_STORE.md``, "Checkpointer").
    keep_last : int or None
        Committed checkpoints kept (None: all); the newest goes only once a newer one commits.
    mode : {"auto", "fence", "snapshot"}
        Write the live tensors, or copies in a host arena; ``auto`` decides at the first save.
    snapshot_bytes : int, optional
        The snapshot arena (default: twice the first checkpoint, as the host allows).
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        Of every save and load (default: the ``backend`` setting).
    process_group : torch.distributed group, optional
        Data-parallel saves and loads (a group of its own: the writer runs its collectives).
    timeout_s : float
        Bound on every wait for background work.
    max_pending : int, optional
        Saves in flight before ``save`` waits for the oldest (default 2 in fence mode).
    writer : {"thread", "process"}
        A writer thread, or (snapshot mode) a helper process.
    allow_pickle : bool
        As :func:`gds_persist.save` (not with a ``process_group``).
    warmup : bool
        Start :func:`gds_persist.warmup` for ``root`` in the background now.
    incremental : bool
        Each save refers to the previous committed step for the bytes that did not change.
    compression : {"none", "lossless", "auto"}, optional
        As :class:`gds_persist.SaveOptions` (default: the setting).
    memory : MemoryTier, optional
        A memory tier beside the drive: the first node-local level.
    levels : list of LocalLevel, optional
        Node-local levels (tmpfs, the node's NVMe), nearest first, each with its interval and
        copies on other nodes; ``root`` is then flushed from the newest local copy in the
        background, and ``load()`` restores from the nearest verified copies.
    drive_every : int
        With node-local levels: write every ``drive_every``-th step to ``root`` too.
    rank_local : key path or list of key paths, optional
        Per-rank state (ZeRO shards), as :func:`gds_persist.save`; needs a ``process_group``.

    Raises
    ------
    ValueError, TypeError, NotACheckpointDirectoryError
        An invalid argument, a 0.1 keyword (naming its new spelling), ``root`` is a file.
    """

    @removed_keywords({**as_settings("block_bytes", "staging_bytes", "io_threads"), **_MEMORY})
    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = 3,
                 mode: str = "auto", snapshot_bytes: int | None = None,
                 backend: str | None = None, process_group: Any = None,
                 timeout_s: float = 1800.0, max_pending: int | None = None,
                 writer: str = "thread", allow_pickle: bool = False, warmup: bool = True,
                 incremental: bool = False, compression: str | None = None,
                 memory: MemoryTier | None = None, drive_every: int = 1,
                 rank_local: Any = None, levels: list[LocalLevel] | None = None):
        _check_arguments(mode, writer, process_group, allow_pickle, compression, keep_last,
                         max_pending, timeout_s)
        local_levels = check_levels(memory, levels, drive_every, writer)
        local_paths = check_rank_local(rank_local, process_group)
        self.root = resolve(root)  # a local directory, or a URL of an object store
        if is_url(self.root):
            _check_object_root(self.root, incremental, compression, rank_local)
            warmup = False  # it measures a local drive
        _steps.check_root(self.root)  # a file there: NotACheckpointDirectoryError
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
        self._backend = backend
        # Ranks agree on publishing each step and on the step a load reads (SoloComm: no group).
        self._comm = make_comm(process_group, settings.current().collective_timeout_s)
        self._publisher = self._comm.rank == 0  # moves `latest` and removes old steps
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
        self._no_last_flush = False  # closing after an exception: the flush in flight only
        self._helper = HelperProcess() if writer == "process" else None
        if self._helper is not None:
            self._helper.start()  # it imports torch while training starts
        config = TierConfig(self.root, local_levels, drive_every, keep_last, backend,
                            compression, incremental, process_group, local_paths, self.timeout_s)
        self._tiers = Tiers(config, self._comm, helper=self._helper, stats=self._stats,
                            lock=self._lock, base_step=latest)
        self._warmup = BackgroundWarmup(self.root, backend=backend) if warmup else None
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
        """Start saving ``state_dict`` as checkpoint ``step``; return its handle at once.

        Parameters
        ----------
        step : int
            The training step, >= 0 and not before the newest checkpoint (or the one loaded).
        state_dict : dict
            The state, as :func:`gds_persist.save` takes it; it is held as it is now.
        blocking : bool
            Return once the checkpoint is committed, raising its error.

        Returns
        -------
        SaveHandle
            ``wait()``, ``done()``, ``released()``, the step's ``path`` and ``info``.

        Raises
        ------
        TypeError
            A non-int ``step``, or what a checkpoint cannot hold (naming its key path).
        Any error of an earlier background save not yet raised.
        """
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            raise TypeError(f"Checkpointer.save(step={reprlib.repr(step)}, ...): step must be an "
                            f"int (the training step), not a {type(step).__name__}; the state "
                            "comes second")
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
        _steps.make_root(self.root)  # created at the first save (a file there raises)
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

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
            Its tensors are then read live by the saves instead of copied at ``save``.

        Returns
        -------
        A handle whose ``.remove()`` undoes it.

        Raises
        ------
        CheckpointTimeout, WorkerDied
            From ``optimizer.step()``: the wait (bounded by ``timeout_s``) ran out, or a thread
            died. A failed save's own error is raised by the next ``save`` / ``wait``.
        """
        ref = weakref.ref(self)

        def wait_for_checkpoints(opt: Any, args: Any, kwargs: Any) -> None:
            ckpt = ref()
            if ckpt is not None:
                ckpt.wait_released()

        return GuardHandle(optimizer.register_step_pre_hook(wait_for_checkpoints), optimizer,
                           self._guarded)

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until saves so far and a restore's healing no longer read the tensors (what
        ``guard`` waits for). ``timeout``: seconds (default ``timeout_s``)."""
        self._pending.wait_released(timeout)
        self._tiers.wait_heal_read(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed.

        Parameters
        ----------
        timeout : float, optional
            Bound on the whole wait, seconds (default ``timeout_s``).

        Raises
        ------
        The first background error not yet raised; :class:`CheckpointTimeout` past ``timeout``.
        """
        self._pending.await_all(timeout)
        self._pending.raise_undelivered()

    def flush(self, timeout: float | None = None) -> None:
        """With node-local levels: once every save so far is committed, make the newest local
        step durable now (wait for the flush in flight, then flush that step if ``root`` lacks
        it). Every rank of the process group calls it. Without levels, as :meth:`wait`.

        Parameters
        ----------
        timeout : float, optional
            Bound on each wait, seconds (default ``timeout_s``).

        Raises
        ------
        The first background error not yet raised; :class:`CheckpointTimeout` past ``timeout``.
        """
        self.wait(timeout)
        self._tiers.finish_flush(self.timeout_s if timeout is None else timeout, final=False)

    def steps(self) -> list[int]:
        """All committed steps under ``root``, ascending."""
        return _steps.committed_steps(self.root)

    def load(self, step: int | None = None, *, map_location: Any = None,
             verify: bool = True, into: Any = None, strict: bool = True) -> Any:
        """Load checkpoint ``step`` once in-flight saves are committed; return its state.

        Loading a step older than the latest marks a resume from it: the next ``save``
        publishes it as ``latest`` again, and the newer checkpoints are removed once that save
        commits. A step that another process's retention removes while it is being opened is
        replaced by the then latest (default ``step``; a few times at most).

        Parameters
        ----------
        step : int, optional
            The step (default: the latest committed; with a memory tier, the newest every rank
            can restore).
        map_location, verify, into, strict
            As :func:`gds_persist.load` (``into``: restore in place, from every tier).

        Returns
        -------
        The checkpoint's state.

        Raises
        ------
        NotCommittedError
            No committed checkpoint under ``root`` (also a ``FileNotFoundError``); nothing is
            created.
        CheckpointReplacedError
            The step was replaced or removed every time it was opened.
        """
        if self._pending.handles():
            self.wait()
        return self._load(step, map_location, verify, into, strict)

    @property
    def warmup_report(self) -> WarmupReport | None:
        """What the background warm-up did (None while it runs, or with ``warmup=False``)."""
        return None if self._warmup is None else self._warmup.report

    @property
    def stats(self) -> CheckpointerStats:
        """Counters and timings so far (saves, bytes, waits, the mode and why, restores)."""
        with self._lock:
            s = replace(self._stats)
            if s.durable is not None:  # its own copy too: the flusher updates it
                s.durable = replace(s.durable)
            s.level_commits = dict(s.level_commits)
        if self._snapshots is not None:
            s.snapshot_bytes = self._snapshots.capacity
            s.snapshot_peak_bytes = self._snapshots.peak_bytes
        s.mode, s.mode_reason = self.mode, self.mode_reason or ""
        return s

    def close(self, timeout: float | None = None) -> None:
        """Finish in-flight saves, stop the threads; idempotent (``load`` and ``latest_step``
        still work afterwards).

        Parameters
        ----------
        timeout : float, optional
            Bound on the wait for in-flight saves, seconds (default ``timeout_s``).

        Raises
        ------
        Any background error not yet raised.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            self._pending.await_all(timeout)
        except BaseException:
            self._stop_threads(join_s=0.5)  # a hung write: do not wait for it a second time
            self._tiers.stop_flusher(0.5)
            raise
        self._stop_threads(join_s=self.timeout_s)
        if self._no_last_flush:
            self._tiers.stop_flusher(self.timeout_s if timeout is None else timeout)
        else:
            self._tiers.finish_flush(self.timeout_s if timeout is None else timeout, final=True)
        self._tiers.join_heal()
        self._pending.raise_undelivered()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body's exception wins; a background error is logged and attached to it
            self._no_last_flush = True  # other ranks may not be closing: no collective now
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


def _check_arguments(mode: str, writer: str, process_group: Any, allow_pickle: bool,
                     compression: str | None, keep_last: int | None, max_pending: int | None,
                     timeout_s: float) -> None:
    """The Checkpointer's own arguments (ValueError naming the fix)."""
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


def _close_at_exit() -> None:
    """Interpreter exit: let in-flight checkpoints commit (bounded) rather than lose them."""
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001
            log.error("gds_persist.Checkpointer(%s) at exit: %s: %s", ckpt.root,
                      type(e).__name__, e)


before_thread_pools_stop(_close_at_exit)


def _check_object_root(root: str, incremental: bool, compression: str | None,
                       rank_local: Any) -> None:
    """What a Checkpointer with its root in an object store does not do (yet), refused here
    rather than at the first save."""
    given = [name for name, value in (
        ("incremental=True", incremental), ("compression", compression not in (None, "none")),
        ("rank_local", rank_local is not None)) if value]
    if given:
        raise ValueError(f"Checkpointer({root!r}) cannot take {', '.join(given)}: steps in an "
                         "object store are plain checkpoints "
                         "(docs/OBJECT_STORE.md, \"Limits\")")

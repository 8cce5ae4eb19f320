"""The one background writer of gds_persist: the threads that write checkpoints while training
goes on, for the :class:`~gds_persist.training.checkpointer.Checkpointer` and every trainer
integration (Lightning, DeepSpeed).

* :class:`Lane`: one thread running submitted calls in submission order, each with its
  ``Future`` (a commit submitted after its writes runs after them). A ``BaseException`` that
  escapes a call (``SystemExit``, ``KeyboardInterrupt``) ends the thread: that call's future
  fails with :class:`~gds_persist.errors.WorkerDied` and a new thread takes the next calls
  (none once :meth:`Lane.stop` was called), so a dead thread never hangs a wait.
* :func:`collect`: the results of submitted writes, every wait bounded in all
  (:class:`~gds_persist.errors.CheckpointTimeout` naming the writes still running), then
  :func:`raise_first`: the first error raised, the later ones logged and noted on it.
* :class:`BackgroundWriter`: a lane writing snapshots (Lightning's ``background=True``).
* :class:`Workers`: the Checkpointer's stages (``write``, ``snapshot``), a lane each.

Their owners flush at a normal interpreter exit through :mod:`.at_exit`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from ..errors import CheckpointTimeout, WorkerDied
from ..results import SaveInfo
from ..state.flatten import Flattened
from .at_exit import finish_at_exit
from .snapshot import PAGE, ArenaOwner

log = logging.getLogger("gds_persist")
T = TypeVar("T")
Write = Callable[[Flattened, str, dict[str, Any]], SaveInfo]
_Call = tuple[Future[Any], Callable[[], Any], str]


class Lane:
    """One daemon thread (``gds_persist-NAME``) running :meth:`submit`'s calls in order.
    ``prepare()`` runs before each call (it must not raise)."""

    def __init__(self, name: str, prepare: Callable[[], None] | None = None):
        self.name = name
        self._prepare = prepare
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self.thread = self._start()  # the thread now serving the lane

    def submit(self, call: Callable[[], T], what: str) -> Future[T]:
        """Queue ``call`` behind the calls before it; ``what`` names it in a WorkerDied."""
        future: Future[T] = Future()
        self._queue.put((future, call, what))
        return future

    def stop(self, deadline: float) -> None:
        """Stop the thread after the calls queued before; join it until ``deadline``
        (``time.monotonic()``)."""
        with self._lock:
            self._stopping = True
        self._queue.put(None)
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _start(self) -> threading.Thread:
        t = threading.Thread(target=self._loop, name=f"gds_persist-{self.name}", daemon=True)
        t.start()
        return t

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if not self._run(*item):
                return
            del item  # its call's arguments (a checkpoint's tensors) go now, not at the next

    def _run(self, future: Future[Any], call: Callable[[], Any], what: str) -> bool:
        """Run one call into its future; False when it ended the thread."""
        if self._prepare is not None:
            self._prepare()
        if not future.set_running_or_notify_cancel():
            return True
        try:
            future.set_result(call())
        except Exception as e:  # noqa: BLE001 - the caller collects it from the future
            future.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - SystemExit & co. end this thread
            log.error("gds_persist %s thread stopped by %s: %s", self.name, type(e).__name__, e)
            with self._lock:
                if not self._stopping:
                    self.thread = self._start()  # it takes the next calls
            future.set_exception(WorkerDied(
                f"the gds_persist {self.name} thread died while {what} ({type(e).__name__}: "
                f"{e}); that work is lost, later work runs on a new thread"))
            return False
        return True


def finished(call: Callable[[], T]) -> Future[T]:
    """``call()`` run here, as a done future: a write in the caller's thread, collected as
    background ones are."""
    future: Future[T] = Future()
    try:
        future.set_result(call())
    except BaseException as e:  # noqa: BLE001 - raised by collect(), as a background error is
        future.set_exception(e)
    return future


def collect(writes: Iterable[tuple[str, Future[T]]], timeout_s: float, knob: str) -> list[T]:
    """The result of every write (``(what, future)``, in order), waiting at most ``timeout_s``
    in all; then :func:`raise_first` of their errors. Writes still running then are one
    :class:`CheckpointTimeout` (naming ``knob``, the setting that raises the bound); they go on
    in the background and their results are dropped."""
    deadline = time.monotonic() + timeout_s
    results: list[T] = []
    errors: list[tuple[str, BaseException]] = []
    running: list[str] = []
    for what, future in writes:
        try:
            results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except BaseException as e:  # noqa: BLE001 - the first is raised, after the rest
            if future.done():
                errors.append((what, e))
            else:
                running.append(what)
    if running:
        errors.insert(0, (", ".join(running), CheckpointTimeout(
            f"{', '.join(running)}: not finished within {timeout_s:g} s (slow or hung "
            f"storage?); it goes on in the background. Raise {knob} if the storage is only "
            "slow")))
    raise_first(errors)
    return results


def raise_first(errors: Sequence[tuple[str, BaseException]]) -> None:
    """Raise the first of ``errors`` (``(what, error)``, oldest first); each later one is logged
    and noted on it, never lost silently."""
    if not errors:
        return
    first = errors[0][1]
    for what, e in errors[1:]:
        log.error("gds_persist: %s also failed: %s: %s", what, type(e).__name__, e)
    if len(errors) > 1:
        later = ", ".join(f"{what} ({type(e).__name__})" for what, e in errors[1:])
        add_note(first, f"later background writes also failed: {later}")
    raise first


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


class BackgroundWriter:
    """Writes flattened checkpoints on a :class:`Lane`, from snapshots taken before
    :meth:`submit` returns: the Checkpointer's snapshot machinery (:mod:`.snapshot`), so a
    snapshot is the same Flattened over host copies in one bounded (pinned where CUDA exists)
    arena. Each storage is copied once (views and tied weights stay one storage) and keeps the
    device it was saved from in the manifest. Unlike the Checkpointer it knows no steps,
    retention or tiers: the caller names each path and writes it its own way (``write``).

    ``capacity``: the arena's bytes; None sizes it to the first checkpoint (plus an eighth), so
    one snapshot is in flight and the next waits for its memory; it grows (after the writes in
    flight) when a later checkpoint is larger. A checkpoint larger than a given ``capacity`` is
    written from the live tensors before :meth:`submit` returns. Writes run in submission
    order; errors are raised by the next :meth:`submit` or :meth:`wait` (:func:`collect`:
    ``knob`` names the setting of ``timeout_s``). A normal interpreter exit closes it.
    """

    def __init__(self, write: Write, capacity: int | None, timeout_s: float, knob: str):
        self._write = write
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._knob = knob
        self._snapshots = ArenaOwner(
            lambda need: max(capacity or need + need // 8, PAGE), timeout_s,
            drain=self.wait if capacity is None else None)
        self._lane: Lane | None = None
        self._pending: deque[tuple[str, Future[SaveInfo]]] = deque()
        self.last_info: SaveInfo | None = None  # of the newest completed write
        finish_at_exit(self, BackgroundWriter.close, "background checkpoint writes")

    def submit(self, flat: Flattened, path: str, kwargs: dict[str, Any]) -> None:
        self._collect(block=False)
        # waits (bounded) for older writes' memory
        reservation = self._snapshots.reserve(flat, f"writing {path} from the live tensors")
        if reservation is None:
            self.wait()
            self.last_info = self._write(flat, path, kwargs)
            return
        snapshots = self._snapshots
        job = [snapshots.take(flat, reservation)]  # copies done (CUDA synchronized)

        def run() -> SaveInfo:
            try:
                return self._write(job.pop(), path, kwargs)
            finally:  # the snapshot's tensors (arena views) are gone before its memory is
                snapshots.free(reservation)

        if self._lane is None:
            self._lane = Lane("trainer")
        self._pending.append((path, self._lane.submit(run, f"writing {path}")))

    def wait(self) -> None:
        """Block until every submitted write is committed; raise the first error."""
        self._collect(block=True)

    def close(self) -> None:
        """Finish the writes (raising the first error), stop the thread, free the arena."""
        try:
            self.wait()
        finally:
            if self._lane is not None:
                self._lane.stop(time.monotonic() + self.timeout_s)
                self._lane = None
            self._snapshots.close()

    def _collect(self, block: bool) -> None:
        done = []
        while self._pending and (block or self._pending[0][1].done()):
            done.append(self._pending.popleft())
        infos = collect(done, self.timeout_s, self._knob)
        if infos:
            self.last_info = infos[-1]


class Workers:
    """The Checkpointer's stages, a :class:`Lane` each, added with :meth:`add`; ``prepare(stage)``
    runs before each job (the writer waits there for the warm-up). A job whose call raised or
    whose thread died is returned by :meth:`check` with its error, for the caller to fail."""

    def __init__(self, prepare: Callable[[str], None]):
        self._prepare = prepare
        self._lanes: dict[str, Lane] = {}
        self._runs: dict[str, Callable[[Any], None]] = {}
        self._lock = threading.Lock()
        self._failed: list[tuple[Any, BaseException]] = []

    @property
    def threads(self) -> dict[str, threading.Thread]:
        """By stage: the thread now serving it."""
        return {stage: lane.thread for stage, lane in self._lanes.items()}

    def add(self, stage: str, run: Callable[[Any], None]) -> None:
        """Start the thread of ``stage``; ``run(job)`` does each of its jobs, reporting an
        ``Exception`` through the job's handle."""
        self._runs[stage] = run
        self._lanes[stage] = Lane(stage, functools.partial(self._prepare, stage))

    def put(self, stage: str, job: Any) -> None:
        future = self._lanes[stage].submit(functools.partial(self._runs[stage], job),
                                           f"saving step {job.handle.step}")
        future.add_done_callback(functools.partial(self._done, job))

    def _done(self, job: Any, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            with self._lock:
                self._failed.append((job, error))

    def alive(self, stage: str) -> bool:
        return self._lanes[stage].thread.is_alive()

    def any_alive(self) -> bool:
        return any(lane.thread.is_alive() for lane in self._lanes.values())

    def check(self) -> list[tuple[Any, BaseException]]:
        """The jobs whose thread died (:class:`WorkerDied`) since the last check, each with its
        error (the caller fails them)."""
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def stop(self, deadline: float) -> None:
        """Stop every thread after the jobs queued before; join them until ``deadline``: the
        snapshot stage first, as it feeds the writer."""
        for lane in reversed(self._lanes.values()):
            lane.stop(deadline)

"""A background writer for the trainer integrations: :class:`BackgroundWriter`.

It writes flattened checkpoints from a thread, from snapshots taken before :meth:`submit
<BackgroundWriter.submit>` returns, with the Checkpointer's snapshot machinery
(:class:`~gds_persist.training.snapshot.ArenaOwner`). Unlike the Checkpointer it knows no steps,
retention or tiers: the caller names each path and writes it its own way (``write``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..results import SaveInfo
from ..state.flatten import Flattened
from .snapshot import PAGE, ArenaOwner

Write = Callable[[Flattened, str, dict[str, Any]], SaveInfo]


class BackgroundWriter:
    """Writes flattened checkpoints from a thread, from snapshots taken before :meth:`submit`
    returns: the Checkpointer's snapshot machinery (:mod:`gds_persist.training.snapshot`), so a
    snapshot is the same Flattened over host copies in one bounded (pinned where CUDA exists)
    arena. Each storage is copied once (views and tied weights stay one storage) and keeps the
    device it was saved from in the manifest.

    ``capacity``: the arena's bytes; None sizes it to the first checkpoint (plus an eighth), so
    one snapshot is in flight and the next waits for its memory; it grows (after the writes in
    flight) when a later checkpoint is larger. A checkpoint larger than a given ``capacity`` is
    written from the live tensors before :meth:`submit` returns. Writes run in submission
    order; an error is raised by the next :meth:`submit` or :meth:`wait`.
    """

    def __init__(self, write: Write, capacity: int | None, timeout_s: float):
        self._write = write
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._snapshots = ArenaOwner(
            lambda need: max(capacity or need + need // 8, PAGE), timeout_s,
            drain=self.wait if capacity is None else None)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[Future[SaveInfo]] = deque()
        self.last_info: SaveInfo | None = None  # of the newest completed write

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

        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gds_persist-trainer")
        self._pending.append(self._executor.submit(run))

    def wait(self) -> None:
        """Block until every submitted write is committed; raise the first error."""
        self._collect(block=True)

    def close(self) -> None:
        """Finish the writes (raising the first error), stop the thread, free the arena."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._collect(block=True)
            self._snapshots.close()

    def _collect(self, block: bool) -> None:
        error: BaseException | None = None
        while self._pending and (block or self._pending[0].done()):
            future = self._pending.popleft()
            try:
                self.last_info = future.result(timeout=self.timeout_s)
            except BaseException as e:  # noqa: BLE001 - the first is raised, after the rest
                error = error or e
        if error is not None:
            raise error

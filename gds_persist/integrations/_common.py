"""What the trainer integrations share: removing a checkpoint directory safely, and a background
writer over the Checkpointer's snapshot machinery."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointError, SnapshotTooLarge
from ..format import MANIFEST_NAME
from ..results import SaveInfo
from ..state.flatten import Flattened
from ..training.snapshot import SnapshotArena, snapshot_nbytes, take_snapshot
from ..transfer.commit import fsync_path

log = logging.getLogger("gds_persist")


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint at ``path``, whole: a symlink or file is unlinked; a gds_persist
    checkpoint directory is first renamed to a hidden ``.NAME.old-<hex>`` sibling (never a
    checkpoint, docs/FORMAT.md) and the rename made durable, so a crash mid-delete never leaves a
    half-deleted directory that looks committed. A directory that is not a checkpoint is refused.
    """
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
        return
    if not os.path.exists(path):
        return
    if not is_checkpoint_dir(path):
        raise CheckpointError(
            f"{path} is not a gds_persist checkpoint directory (no {MANIFEST_NAME}); refusing to "
            "delete it"
        )
    parent, name = os.path.split(os.path.abspath(path))
    hidden = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
    os.rename(path, hidden)
    fsync_path(parent)
    shutil.rmtree(hidden)


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
        self._arena: SnapshotArena | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[Future[SaveInfo]] = deque()
        self.last_info: SaveInfo | None = None  # of the newest completed write

    def submit(self, flat: Flattened, path: str, kwargs: dict[str, Any]) -> None:
        self._collect(block=False)
        need = snapshot_nbytes(flat)
        if self._arena is not None and self.capacity is None and need > self._arena.capacity:
            self._close_arena()  # grow: after the writes that use the old one
        if self._arena is None:
            size = self.capacity or need + need // 8
            self._arena = SnapshotArena(max(size, 4096), self.timeout_s)
        try:
            reservation = self._arena.reserve(need)  # waits (bounded) for older writes' memory
        except SnapshotTooLarge as e:
            log.warning("%s; writing %s from the live tensors", e, path)
            self.wait()
            self.last_info = self._write(flat, path, kwargs)
            return
        arena = self._arena
        job = [take_snapshot(flat, arena, reservation)]  # copies done (CUDA synchronized)

        def run() -> SaveInfo:
            try:
                return self._write(job.pop(), path, kwargs)
            finally:  # the snapshot's tensors (arena views) are gone before its memory is
                arena.free(reservation)

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
            self._close_arena()

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

    def _close_arena(self) -> None:
        self._collect(block=True)
        if self._arena is not None:
            self._arena.close()
            self._arena = None

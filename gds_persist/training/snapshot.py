"""Bounded host snapshots of a state dict, for the Checkpointer's ``snapshot`` mode.

A snapshot copies every distinct storage of a flattened state dict into one
:class:`SnapshotArena` (a single page-aligned host buffer, pinned where CUDA exists, of a fixed
capacity) and is the same :class:`~gds_persist.state.flatten.Flattened` over the copies: same
tree and tensor records (views, tied weights), and the same storage records, so each storage
keeps the device it was saved from and the checkpoint written from the snapshot is the one
``gds_persist.save`` would have written from the live tensors.

The arena never grows: a snapshot that does not fit yet waits (bounded) until earlier ones are
written and freed; one that can never fit is refused with :class:`SnapshotTooLarge`, and the
Checkpointer writes that checkpoint straight from the live tensors instead ("fence" mode).

:class:`ArenaOwner` is the one sequence both background writers run (the Checkpointer's snapshot
stage and :class:`~gds_persist.training.background_writer.BackgroundWriter`): the arena created at
the first snapshot by the writer's sizing rule, replaced by a larger one where the writer lets it
grow, a reservation (``None``, logged, for a snapshot that can never fit), the copy, the free.

SAFETY: the storages of a snapshot alias the arena. They must be dropped before their
:class:`Reservation` is freed and before the arena is closed.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, SnapshotTooLarge
from ..format import StorageRecord, TensorRecord, align_up
from ..state.flatten import Flattened
from ..transfer.pipeline import byte_view
from ..transfer.staging import AlignedBuffer

log = logging.getLogger("gds_persist")

PAGE = 4096
_ALIGN = 64  # every copied storage starts 64-byte aligned (any dtype's element size divides it)


def snapshot_nbytes(flat: Flattened) -> int:
    """Arena bytes a snapshot of ``flat`` takes (each storage 64-byte aligned, page-rounded)."""
    return align_up(sum(align_up(s.nbytes, _ALIGN) for s in flat.storages), PAGE)


@dataclass
class Reservation:
    offset: int
    nbytes: int
    waited_s: float  # how long reserve() blocked for memory (0.0 when it did not)


class SnapshotArena:
    """A fixed host buffer handed out as contiguous reservations, freed oldest first.

    Snapshots are written in the order they are taken, so a ring works: new reservations go after
    the newest live one, wrapping to the start once the oldest ones are freed. The buffer is
    created on first use (pinning it is expensive) and reused for every later snapshot.
    """

    def __init__(self, capacity: int, timeout_s: float, shared: bool = False):
        if capacity < PAGE:
            raise ValueError(f"snapshot_bytes={capacity} must be at least {PAGE}")
        self.capacity = align_up(capacity, PAGE)
        self.timeout_s = timeout_s
        self.peak_bytes = 0
        self._buffer: AlignedBuffer | SharedBuffer | None = None
        self._idle_refs = 0  # references to the buffer's memoryview when no snapshot uses it
        self._live: deque[Reservation] = deque()
        self._cond = threading.Condition()
        if shared:  # another process maps it from the start: create it now
            self._buffer = SharedBuffer(self.capacity)
            self._idle_refs = sys.getrefcount(self._buffer.view)

    @property
    def shared(self) -> tuple[int, int, int] | None:
        """(pid, fd, size) through which another process maps a shared arena, else None."""
        b = self._buffer
        return (os.getpid(), b.fd, b.nbytes) if isinstance(b, SharedBuffer) else None

    def _place(self, n: int) -> int | None:
        if not self._live:
            return 0
        first, last = self._live[0], self._live[-1]
        end = last.offset + last.nbytes
        if last.offset >= first.offset:  # live bytes are [first, end): room after, or before
            if end + n <= self.capacity:
                return end
            return 0 if n <= first.offset else None
        return end if end + n <= first.offset else None  # wrapped: room only in the gap

    def reserve(self, nbytes: int) -> Reservation:
        """Reserve ``nbytes`` (page-rounded), waiting up to ``timeout_s`` for older ones to go."""
        n = align_up(max(nbytes, 1), PAGE)
        if n > self.capacity:
            raise SnapshotTooLarge(
                f"a snapshot of this state dict needs {n} bytes but snapshot_bytes is "
                f"{self.capacity}; raise Checkpointer(snapshot_bytes=...) or use mode='fence'"
            )
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        waited = False
        with self._cond:
            while (offset := self._place(n)) is None:
                waited = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointError(
                        f"no {n} bytes of snapshot memory came free within {self.timeout_s:.0f} s "
                        "(earlier checkpoints are still being written: is the storage hung?); "
                        "raise Checkpointer(timeout_s=...) if the drive is just slow"
                    )
                self._cond.wait(min(left, 0.2))
            r = Reservation(offset, n, time.monotonic() - t0 if waited else 0.0)
            self._live.append(r)
            self.peak_bytes = max(self.peak_bytes, sum(x.nbytes for x in self._live))
            if self._buffer is None:
                self._buffer = AlignedBuffer(self.capacity)
                self._idle_refs = sys.getrefcount(self._buffer.view)
        return r

    def free(self, r: Reservation) -> None:
        with self._cond:
            self._live.remove(r)
            self._cond.notify_all()

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view (of the whole arena's storage) of bytes ``[offset, offset + nbytes)``."""
        assert self._buffer is not None
        return self._buffer.tensor[offset : offset + nbytes]

    def view(self, r: Reservation, start: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with its own storage over arena bytes ``[r.offset+start, +nbytes)``."""
        assert self._buffer is not None and start + nbytes <= r.nbytes
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(self._buffer.view, dtype=torch.uint8, count=nbytes,
                                    offset=r.offset + start)

    def close(self) -> None:
        with self._cond:
            buffer, self._buffer = self._buffer, None
            self._live.clear()
        if buffer is None:
            return
        if sys.getrefcount(buffer.view) > self._idle_refs:
            # torch.frombuffer tensors hold the memoryview: unmapping now would leave them
            # pointing at freed memory. The garbage collector unmaps it once they are gone.
            log.warning("snapshot arena still referenced by tensors at close; left to the "
                        "garbage collector")
            return
        buffer.close()


def copy_storages(flat: Flattened, arena: SnapshotArena, r: Reservation) -> list[int]:
    """Copy every storage of ``flat`` into reservation ``r``; return each one's arena offset.

    CUDA storages are copied on the current (side) stream into the (pinned) arena and
    synchronized before this returns, so the live tensors may change as soon as it has. One
    ``_foreach_copy_`` per device keeps the Python per storage (and so the GIL) small.
    """
    offsets: list[int] = []
    groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    cursor = r.offset
    for storage in flat.storage_objects:
        nbytes = storage.nbytes()
        offsets.append(cursor)
        if nbytes:
            dsts, srcs = groups.setdefault(storage.device, ([], []))
            dsts.append(arena.bytes_at(cursor, nbytes))
            srcs.append(byte_view(storage))
        cursor += align_up(nbytes, _ALIGN)
    assert cursor <= r.offset + r.nbytes
    for device, (dsts, srcs) in groups.items():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(dsts, srcs, non_blocking=device.type == "cuda")
        else:  # pragma: no cover - older torch
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return offsets


def over_copies(tree: Any, tensors: list[TensorRecord], storages: list[StorageRecord],
                views: list[torch.Tensor],
                crc_at_save: list[int | None] | None = None) -> Flattened:
    """The Flattened of a snapshot: ``views[i]`` holds the bytes of storage ``i`` (its own
    storage); the tree and records are those of the live state, so each storage keeps the
    device it was saved from, and the CRCs taken at ``save()`` still check what is written."""
    return Flattened(tree, list(tensors), list(storages), [v.untyped_storage() for v in views],
                     crc_at_save)


def take_snapshot(flat: Flattened, arena: SnapshotArena, r: Reservation) -> Flattened:
    """Copy ``flat``'s storages into ``r``; return ``flat`` over the copies."""
    offsets = copy_storages(flat, arena, r)
    views = [arena.view(r, off - r.offset, s.nbytes)
             for off, s in zip(offsets, flat.storages, strict=True)]
    return over_copies(flat.tree, flat.tensors, flat.storages, views, flat.crc_at_save)


class ArenaOwner:
    """The snapshot arena of one background writer, from its first snapshot to its close.

    ``size_for(need)``: the arena's bytes, decided when the first snapshot (``need`` bytes)
    creates it. ``drain``: with it, the arena grows: a snapshot larger than the arena first calls
    ``drain()`` (which must wait until no snapshot of the old arena is in use), then replaces the
    arena by one sized for it; without it the arena keeps its size and such a snapshot is refused.
    ``shared``: an arena the helper process maps (:class:`SharedBuffer`).
    """

    def __init__(self, size_for: Callable[[int], int], timeout_s: float, *,
                 drain: Callable[[], None] | None = None, shared: bool = False):
        self._size_for = size_for
        self._drain = drain
        self.timeout_s = timeout_s
        self._shared = shared
        self._arena: SnapshotArena | None = None
        self._newest: SnapshotArena | None = None  # kept after close, for its figures

    @property
    def capacity(self) -> int:
        """The arena's bytes (0 before the first snapshot; after close, the last arena's)."""
        return 0 if self._newest is None else self._newest.capacity

    @property
    def peak_bytes(self) -> int:
        """The most bytes the arena ever had reserved at once."""
        return 0 if self._newest is None else self._newest.peak_bytes

    @property
    def shared(self) -> tuple[int, int, int] | None:
        """(pid, fd, size) through which the helper process maps the arena (see SnapshotArena)."""
        return None if self._arena is None else self._arena.shared

    def reserve(self, flat: Flattened, instead: str) -> Reservation | None:
        """Room in the arena for a snapshot of ``flat``, waiting (bounded) for older snapshots'
        memory. None when it can never fit: logged as ``"<why>; <instead>"``, ``instead`` saying
        what the caller does then (writes from the live tensors)."""
        need = snapshot_nbytes(flat)
        if self._arena is not None and self._drain is not None and need > self._arena.capacity:
            self._drain()  # grow: after the snapshots that use the old arena
            self.close()
        if self._arena is None:
            self._arena = self._newest = SnapshotArena(self._size_for(need), self.timeout_s,
                                                       shared=self._shared)
        try:
            return self._arena.reserve(need)
        except SnapshotTooLarge as e:
            log.warning("%s; %s", e, instead)
            return None

    def take(self, flat: Flattened, r: Reservation) -> Flattened:
        """:func:`take_snapshot` into the arena: ``flat`` over host copies."""
        assert self._arena is not None
        return take_snapshot(flat, self._arena, r)

    def copy(self, flat: Flattened, r: Reservation) -> list[int]:
        """:func:`copy_storages` into the arena (for the helper process): the storages' offsets."""
        assert self._arena is not None
        return copy_storages(flat, self._arena, r)

    def free(self, r: Reservation) -> None:
        if self._arena is not None:
            self._arena.free(r)

    def close(self) -> None:
        """Free the arena's memory; a later snapshot creates a new arena."""
        if self._arena is not None:
            self._arena.close()
            self._arena = None


class SharedBuffer(AlignedBuffer):
    """``nbytes`` of page-aligned host memory another process can map: a memfd (Linux), mapped
    here and, by the helper process, through ``/proc/<pid>/fd/<fd>``. Registered with CUDA as
    pinned memory where CUDA is usable. Freed once every mapping and descriptor is gone, so a
    crash leaks nothing (unlike a file in /dev/shm)."""

    def __init__(self, nbytes: int):
        if not hasattr(os, "memfd_create"):
            raise CheckpointError("writer='process' needs Linux memfd_create; use writer='thread'")
        self.fd = os.memfd_create("gds_persist-snapshot-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            super().__init__(nbytes, fd=self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        super().close()
        os.close(self.fd)


def map_shared(pid: int, fd: int, nbytes: int) -> mmap.mmap:
    """In the helper process: map the arena ``SharedBuffer`` of process ``pid``."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(own, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(own)

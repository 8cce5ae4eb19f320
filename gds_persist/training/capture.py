"""What a save that returns early captures: every tensor as it was when ``save()`` was called.

A save that overlaps training reads the tensors after ``save()`` returned, while the next step
runs. The guard holds only the optimizer's update; a forward pass (BatchNorm's running
statistics), an EMA model, a GradScaler, another optimizer or user code may change any tensor
meanwhile. So, at ``save()``, before it returns, every storage of the state is one of:

* **held**: a storage of a guarded optimizer (its parameters and its state). The optimizer waits
  for the write (fence) or the snapshot (snapshot mode); the tensor is read live.
* **unchanged**: not held, larger than :data:`COPY_BYTES`, with the same CRC32C as at the
  previous save (a frozen base model, embeddings nobody trains): read live, not copied.
* **copied**: everything else - not held and changed since the previous save, or small (BatchNorm
  statistics, step counters, a loss scale): copied now, so later changes cannot reach the file.

The CRC32C of every storage read live is taken here too (``Flattened.crc_at_save``), and the
commit compares it with the CRC32C of the bytes actually written
(:mod:`gds_persist.saving.as_saved`): a held or unchanged tensor that was changed anyway before
the writer read it makes that save fail with :class:`~gds_persist.TornCheckpointError` naming
it, never a silent mix; an unchanged tensor that changed is copied from the next save on.
Version counters are not used: BatchNorm's kernels and writes through NumPy views do not raise
``_version``.

Cost, per save, on the training thread: one CRC32C pass over the storages read live (about
10-17 GB/s per core on the CPU) and a copy of the small and changed unguarded ones
(``bench/bench_train.py`` measures it).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..format.checksum import crc32c, crc32c_combine
from ..state.flatten import Flattened
from ..transfer.crc import device_crc32c_many
from ..transfer.pipeline import byte_view

# Unguarded storages up to this size are copied at every save: a copy costs about what its
# CRC does, and a tensor that changes now and then (a loss scale, a counter) is never refused
COPY_BYTES = 1 << 20

StorageId = tuple[str, int, int]  # device, address, bytes: one storage while it lives
# The fingerprint of 64 MB took 5.7 ms on one core of the 2-core VM (1.1% of bench_train's
# iteration with BatchNorm): pieces spread over the cores while the writer thread is idle
PIECE_BYTES = 4 << 20
MAX_THREADS = 4


def storage_id(storage: torch.UntypedStorage) -> StorageId:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


def held_by(optimizers: Iterable[Any]) -> set[StorageId]:
    """The storages of the optimizers' parameters and state tensors."""
    held: set[StorageId] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            held.update(storage_id(p.untyped_storage()) for p in group["params"])
        for state in optimizer.state.values():
            held.update(storage_id(v.untyped_storage()) for v in state.values()
                        if isinstance(v, torch.Tensor))
    return held


class GuardHandle:
    """``Checkpointer.guard``'s result: while it stands, the optimizer's tensors are held (read
    live); ``remove()`` drops the hook, and from then on ``save`` copies them."""

    def __init__(self, hook: Any, optimizer: Any, guarded: weakref.WeakSet[Any]):
        self._hook, self._optimizer, self._guarded = hook, weakref.ref(optimizer), guarded
        guarded.add(optimizer)

    def remove(self) -> None:
        self._hook.remove()
        optimizer = self._optimizer()
        if optimizer is not None:
            self._guarded.discard(optimizer)


@dataclass
class Captured:
    """What one save's capture did (bytes of storages)."""

    copied: int = 0  # copied at save()
    held: int = 0  # read live, held by a guarded optimizer, checked at the commit
    unchanged: int = 0  # read live, unchanged since the previous save, checked at the commit


class Capture:
    """The capture of one background writer: remembers each storage's CRC32C at the previous
    save, to tell unchanged storages from changed ones."""

    def __init__(self) -> None:
        self._last: dict[StorageId, int] = {}

    def __call__(self, flat: Flattened, held: set[StorageId]) -> tuple[Flattened, Captured]:
        """``flat`` with every storage that is neither held nor unchanged replaced by a copy,
        and the CRC32C of the others recorded for the check at the commit."""
        ids = [storage_id(s) for s in flat.storage_objects]
        live = [k for k, (i, s) in enumerate(zip(ids, flat.storage_objects, strict=True))
                if i in held or s.nbytes() > COPY_BYTES]
        crcs: list[int | None] = [None] * len(ids)
        for k, crc in zip(live, fingerprints([flat.storage_objects[k] for k in live]),
                          strict=True):
            crcs[k] = crc
        last, self._last = self._last, {ids[k]: c for k, c in enumerate(crcs) if c is not None}
        objects, report = list(flat.storage_objects), Captured()
        for k, (sid, storage) in enumerate(zip(ids, objects, strict=True)):
            if sid in held:
                report.held += storage.nbytes()
            elif crcs[k] is not None and last.get(sid) == crcs[k]:
                report.unchanged += storage.nbytes()
            else:  # a private copy: nothing can change it, nothing to check
                objects[k], crcs[k] = copy_of(storage), None
                report.copied += storage.nbytes()
        return replace(flat, storage_objects=objects, crc_at_save=crcs), report


def fingerprints(storages: list[torch.UntypedStorage]) -> list[int]:
    """The CRC32C of each storage's bytes now (device storages: by the CRC kernel where it
    runs, all in one batch, else through a host copy; either waits once for the device's queued
    work). Host bytes are cut in pieces of at most :data:`PIECE_BYTES`, checksummed in one batch
    per core (crc32c releases the GIL; the training thread waits for this), and joined."""
    return fingerprints_of([byte_view(s) for s in storages])


def fingerprints_of(views: list[torch.Tensor]) -> list[int]:
    """:func:`fingerprints` of flat uint8 tensors (a storage's bytes, or a tensor's)."""
    out: list[int] = [0] * len(views)
    pieces: list[tuple[int, np.ndarray]] = []  # (view, bytes), in order within a view
    for k, data in enumerate(views):
        if data.device.type == "cpu":
            host = data.numpy()
            pieces += [(k, host[at:at + PIECE_BYTES]) for at in range(0, len(host), PIECE_BYTES)]
    # every device storage in one batch: one wait per device, not one per storage (a GPT's
    # parameters and AdamW state are hundreds of storages)
    cuda = [k for k, data in enumerate(views) if data.device.type != "cpu"]
    for k, crc in zip(cuda, device_crc32c_many([views[k] for k in cuda]) if cuda else [],
                      strict=True):
        out[k] = crc
    batches = _batches([p for _, p in pieces], _pool()._max_workers)
    crcs = [c for batch in _pool().map(lambda b: [crc32c(p) for p in b], batches) for c in batch]
    first: set[int] = set()
    for (k, piece), crc in zip(pieces, crcs, strict=True):
        out[k] = crc32c_combine(out[k], crc, len(piece)) if k in first else crc
        first.add(k)
    return out


def _batches(pieces: list[np.ndarray], n: int) -> list[list[np.ndarray]]:
    """``pieces`` in ``n`` consecutive runs of about equal bytes (order kept)."""
    runs: list[list[np.ndarray]] = [[] for _ in range(n)]
    total, acc = sum(len(p) for p in pieces), 0
    for p in pieces:
        runs[min(n - 1, acc * n // max(total, 1))].append(p)
        acc += len(p)
    return [r for r in runs if r]


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, MAX_THREADS)),
                              thread_name_prefix="gds_persist-capture")


def copy_of(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A private copy on the same device (stream-ordered on a GPU: the bytes as of now)."""
    return storage.clone()


@dataclass
class HeldAtSave:
    """The tensors of a nested state that :func:`capture_nested` left live (held by a guarded
    optimizer), with their CRC32C at ``save()``: a copy made of them later is checked here."""

    paths: list[tuple[Any, ...]]
    crcs: list[int]

    def torn(self, copies: Any) -> list[str]:
        """The held tensors whose copy in ``copies`` (the same structure) is not their bytes at
        ``save()``: changed in place by code other than the optimizer's step."""
        now = fingerprints_of([_flat_bytes(_at(copies, p)) for p in self.paths])
        return ["/".join(map(str, p))
                for p, then, crc in zip(self.paths, self.crcs, now, strict=True) if then != crc]


def capture_nested(state: Any, held: set[StorageId]) -> tuple[Any, HeldAtSave]:
    """``state`` (dicts, lists and tuples of tensors and plain values) as it is now: every
    tensor not ``held`` replaced by a copy made now (buffers a forward pass updates, frozen
    weights; views of one storage stay views of one copy, so tied weights stay tied), the held
    ones left live with their CRC32C (:class:`HeldAtSave`)."""
    copies: dict[StorageId, torch.UntypedStorage] = {}
    paths: list[tuple[Any, ...]] = []

    def walk(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            sid = storage_id(obj.untyped_storage())
            if sid in held and obj.is_contiguous():
                paths.append(path)
                return obj
            if sid not in copies:
                copies[sid] = copy_of(obj.untyped_storage())
            return torch.empty(0, dtype=obj.dtype, device=obj.device).set_(
                copies[sid], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, dict):
            out = type(obj)((k, walk(v, (*path, k))) for k, v in obj.items())
            if hasattr(obj, "_metadata"):  # a module's state dict: its version record
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, (*path, k)) for k, v in enumerate(obj))
        return obj

    captured = walk(state, ())
    crcs = fingerprints_of([_flat_bytes(_at(state, p)) for p in paths])
    return captured, HeldAtSave(paths, crcs)


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)

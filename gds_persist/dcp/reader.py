"""``GdsPersistReader``: a DCP ``StorageReader`` for checkpoints written by ``GdsPersistWriter``.

DCP calls (see ``torch.distributed.checkpoint.storage.StorageReader``)::

    0) (all ranks)   reset(checkpoint_id)
    1) (all ranks)   read_metadata()              validated manifest -> DCP Metadata (no pickle)
    2) (all ranks)   set_up_storage_reader(...)
    3) (all ranks)   prepare_local_plan(plan)     unchanged
    4) (coordinator) prepare_global_plan(plans)   unchanged
    5) (all ranks)   read_data(plan, planner)     aligned reads, CRC32C verified, then copied

DCP's planner does the resharding: each read item asks for a box of a saved chunk, and the
planner's ``resolve_tensor`` gives the tensor the box goes into (for DCP's default planner, the
caller's own tensor or a view of it). Every saved chunk a rank needs is read whole (its CRC32C
covers the whole extent, so that is what can be verified), once, however many read items use
it, and its bytes land in those tensors: a whole chunk whose target is contiguous with the same
dtype is read straight into it (device memory too); any other target (a box of the chunk,
non-contiguous, another dtype, on a device) is filled piece by piece as the chunk's bytes pass
through the staging ring, so the extra memory is the ring's, never a copy of a chunk. Non-tensor
("bytes") items are read into buffers, at most ``read_budget_bytes`` at a time, for the
planner's ``load_bytes``.

Other processes may replace or remove the checkpoint meanwhile: ``read_metadata`` (or, on a rank
that did not read it, ``set_up_storage_reader``) holds the checkpoint directory and manifest
open, and ``read_data`` opens every data file this rank reads before reading any byte, then
closes everything. A rank whose manifest is not the one the coordinator's metadata came from,
or whose files are gone by ``read_data`` (the checkpoint was replaced or removed in between:
DCP cannot switch checkpoints in the middle of a load), raises
:class:`gds_persist.CheckpointReplacedError`: run ``dcp.load`` again.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import settings
from ..errors import CheckpointError, CheckpointReplacedError, ManifestError
from ..format import DTYPES, MANIFEST_NAME, Extent, Manifest
from ..format.tree import decode
from ..loading.extents import read_extents
from ..progress import ByteCounter, ProgressCallback
from ..stores import is_url
from ..stores.opened import open_checkpoint
from ..transfer.opened import OpenCheckpoint
from ..transfer.pipeline import byte_view
from ._codec import decode_metadata
from .boxes import copy_run
from .checkpoint_path import CheckpointPath
from .writer import WRITER_TAG


@dataclass(frozen=True)
class ItemRecord:
    """Where one saved DCP chunk (or bytes item) lives: ``Metadata.storage_data`` values."""

    fqn: str
    kind: str  # "tensor" | "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    extents: tuple[Extent, ...]  # ``storage`` is the manifest's storage index

    def describe(self, offsets: Sequence[int] | None) -> str:
        at = "" if not offsets else f" chunk at offsets {tuple(int(o) for o in offsets)}"
        return f"DCP item {self.fqn!r}{at}"


class _TensorSlot:
    """Stands for tensor ``index`` of the manifest while its tree is decoded."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


_ITEM_KEYS = ["fqn", "offsets", "kind", "data"]  # as GdsPersistWriter's build_manifest writes


def dcp_records(m: Manifest, where: str) -> dict[MetadataIndex, ItemRecord]:
    """Map every saved chunk's ``MetadataIndex`` to its record, from a validated manifest."""
    try:
        decoded = decode(m.tree, [_TensorSlot(i) for i in range(len(m.tensors))])
    except ValueError:  # rank-local placeholders: a gds_persist.save checkpoint
        decoded = None
    if not (isinstance(decoded, dict) and list(decoded) == ["dcp_items"]
            and isinstance(decoded["dcp_items"], list)):
        raise ManifestError(f"{where}: not a DCP checkpoint tree")
    by_storage: dict[int, list[Extent]] = {}
    for e in m.extents:
        by_storage.setdefault(e.storage, []).append(e)
    out: dict[MetadataIndex, ItemRecord] = {}
    for item in decoded["dcp_items"]:
        ok = isinstance(item, dict) and list(item) == _ITEM_KEYS
        fqn, offsets, kind, data = (item[k] for k in _ITEM_KEYS) if ok else (None,) * 4
        if not (
            ok
            and isinstance(fqn, str)
            and kind in ("tensor", "bytes")
            and isinstance(data, _TensorSlot)
            and (offsets is None or (isinstance(offsets, list)
                                     and all(type(o) is int for o in offsets)))
        ):
            raise ManifestError(f"{where}: malformed DCP item node {str(item)[:80]}")
        tensor = m.tensors[data.index]
        offs = None if offsets is None else list(offsets)
        nbytes = m.storages[tensor.storage].nbytes
        numel = 1
        for d in tensor.shape:
            numel *= d
        if numel * DTYPES[tensor.dtype].itemsize != nbytes:
            raise ManifestError(
                f"{where}: DCP item {fqn!r} has {nbytes} bytes for shape {tensor.shape}"
            )
        extents = tuple(sorted(by_storage.get(tensor.storage, []), key=lambda e: e.start))
        out[MetadataIndex(fqn, offs)] = ItemRecord(
            fqn, kind, tensor.dtype, tuple(tensor.shape), nbytes, extents
        )
    return out


class GdsPersistReader(CheckpointPath, StorageReader):
    """Read checkpoints written by :class:`GdsPersistWriter`, verifying every CRC32C:
    ``dcp.load(state_dict, storage_reader=GdsPersistReader(path))`` works unchanged, with any
    number of ranks (DCP reshards).

    Non-tensor values (DCP "bytes" items) are the planner's own serialized bytes and go to its
    ``load_bytes`` as ``FileSystemReader`` hands them (DCP's ``DefaultLoadPlanner`` unpickles
    them with ``torch.load(weights_only=False)``, so load checkpoints you trust).

    Parameters:
        path: the checkpoint directory (or pass ``checkpoint_id=`` to ``dcp.load``).
        backend: the I/O backend, as for :func:`gds_persist.load`.
        verify: False skips the checksum comparison (the bytes read are the same).
        weights_only: True refuses a "bytes" item that ``torch.load(weights_only=True)`` does
            not load (which runs no arbitrary code), naming the item and the unpickler's reason.
        read_budget_bytes: non-tensor ("bytes") items are read into buffers of at most this
            many bytes at a time.
        progress: ``progress(done_bytes, total_bytes)``, called as data is read.

    Raises:
        ChecksumError: a corrupted data file, naming the DCP item; DCP wraps it in
            ``CheckpointException`` (``exc.failures[rank][0]`` is the original).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = "",
        *,
        backend: str | None = None,
        verify: bool = True,
        weights_only: bool = False,
        read_budget_bytes: int = 256 << 20,
        progress: ProgressCallback | None = None,
    ):
        super().__init__()
        self._set_path(path)
        self.backend = backend
        self.verify = verify
        self.weights_only = weights_only
        self.read_budget_bytes = read_budget_bytes
        self.progress = progress
        self.storage_data: dict[MetadataIndex, ItemRecord] = {}
        self._ck: OpenCheckpoint | None = None  # held from read_metadata to read_data's end

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_path(checkpoint_id)
        self.storage_data = {}
        self._release()

    def _release(self) -> None:
        if self._ck is not None:
            ck, self._ck = self._ck, None
            ck.close()

    @classmethod
    def _accepts(cls, path: str) -> bool:
        if is_url(path):
            return True  # read_metadata says whether one is there
        return os.path.isfile(os.path.join(path, MANIFEST_NAME))  # a committed checkpoint

    # No **kwargs on purpose: DCP then does not retry with a "rank-local metadata" fallback
    # (which this format does not have) and reports our error as it is.
    def read_metadata(self, *args: Any) -> Metadata:
        self._release()
        ck = open_checkpoint(self.path)
        try:
            m = ck.manifest
            where = os.path.join(self.path, "manifest.json")
            if m.writer.get("writer") != WRITER_TAG or "dcp" not in m.writer:
                raise CheckpointError(
                    f"{self.path} was written by gds_persist.save, not through DCP; load it with "
                    "gds_persist.load (GdsPersistReader reads checkpoints written by "
                    "GdsPersistWriter)"
                )
            md = decode_metadata(m.writer["dcp"], where)
            records = dcp_records(m, where)
        except BaseException:
            ck.close()
            raise
        md.storage_data = records
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        self._ck = ck
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointError("GdsPersistReader got metadata it did not read")
        self.storage_data = metadata.storage_data
        if self._ck is None:  # metadata read by another reader instance
            self._hold()

    def _hold(self) -> OpenCheckpoint:
        """Open the checkpoint on a rank that did not read the metadata: it must be the one
        the metadata describes."""
        ck = open_checkpoint(self.path)
        try:
            same = dcp_records(ck.manifest, os.path.join(self.path, "manifest.json"))
        except BaseException:
            ck.close()
            raise
        if same != self.storage_data:
            ck.close()
            raise CheckpointReplacedError(
                f"{self.path} was replaced by another process's save after the coordinator "
                "read its metadata and before this rank opened it; run dcp.load again"
            )
        self._ck = ck
        return ck

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            ck = self._ck or self._hold()
            groups: dict[MetadataIndex, list[ReadItem]] = {}
            for req in plan.items:
                if req.storage_index not in self.storage_data:
                    raise CheckpointError(f"{self.path} has no saved chunk {req.storage_index}")
                groups.setdefault(req.storage_index, []).append(req)
            # every file this rank reads is open before any byte is read
            ck.open_files(e.file for k in groups for e in self.storage_data[k].extents)
            total = sum(self.storage_data[k].nbytes for k in groups)
            counter = ByteCounter(self.progress, total)
            _ReadJob(self, planner, counter, ck).run(groups)
            counter.finish()
        finally:
            self._release()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _is_whole(req: ReadItem, rec: ItemRecord) -> bool:
    return (
        req.type == LoadItemType.TENSOR
        and all(o == 0 for o in req.storage_offsets)
        and tuple(req.lengths) == rec.shape
    )


def _direct_bytes(target: torch.Tensor, rec: ItemRecord) -> torch.Tensor | None:
    """The destination's own bytes, when the chunk can be read straight into it."""
    if (
        target.dtype != DTYPES[rec.dtype]
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or tuple(target.shape) != rec.shape
        or target.device.type not in ("cpu", "cuda")
    ):
        return None
    start = target.storage_offset() * target.element_size()
    return byte_view(target.untyped_storage())[start : start + rec.nbytes]


Targets = list[tuple[ReadItem, torch.Tensor]]  # the read items of one saved chunk, resolved


class _Boxes:
    """The ``on_bytes`` hook of a streamed read: every piece of a saved chunk, as it passes
    through a staging buffer, is copied into the part of each target that it covers
    (:func:`~gds_persist.dcp.boxes.copy_run`), so the chunk is never held anywhere else. An
    element cut by a piece boundary (never, with the writer's aligned layout) is assembled
    from its fragments first."""

    def __init__(self, jobs: list[tuple[ItemRecord, Targets]]):
        self.jobs = jobs  # by the storage index the read uses
        self.fragments: dict[tuple[int, int], bytearray] = {}
        self.filled: dict[tuple[int, int], int] = {}

    def __call__(self, e: Extent, at: int, piece: memoryview) -> None:
        rec, _ = self.jobs[e.storage]
        size = DTYPES[rec.dtype].itemsize
        raw = torch.frombuffer(piece, dtype=torch.uint8) if piece.nbytes else None
        if raw is None:
            return
        head = (-at) % size
        whole = (raw.numel() - head) // size * size if raw.numel() > head else 0
        if whole:  # (a cut element shifts the rest off the dtype's alignment: copy them)
            run = raw[head : head + whole]
            self._elements(e.storage, (at + head) // size, run.clone() if head else run)
        for lo, hi in ((0, min(head, raw.numel())), (head + whole, raw.numel())):
            if lo < hi:
                self._fragment(e.storage, at + lo, raw[lo:hi], size)

    def _fragment(self, storage: int, at: int, data: torch.Tensor, size: int) -> None:
        key = (storage, at // size)
        held = self.fragments.setdefault(key, bytearray(size))
        held[at % size : at % size + data.numel()] = data.numpy().tobytes()
        self.filled[key] = self.filled.get(key, 0) + data.numel()
        if self.filled[key] == size:
            del self.fragments[key], self.filled[key]
            self._elements(storage, key[1], torch.frombuffer(held, dtype=torch.uint8))

    def _elements(self, storage: int, first: int, raw: torch.Tensor) -> None:
        rec, targets = self.jobs[storage]
        run = raw.view(DTYPES[rec.dtype])
        for req, target in targets:
            copy_run(run, first, rec.shape, req.storage_offsets, req.lengths, target)


class _ReadJob:
    def __init__(self, reader: GdsPersistReader, planner: LoadPlanner, counter: ByteCounter,
                 ck: OpenCheckpoint):
        self.r = reader
        self.planner = planner
        self.counter = counter
        self.ck = ck
        self.cfg = settings.current(backend=reader.backend)

    def run(self, groups: dict[MetadataIndex, list[ReadItem]]) -> None:
        """Whole chunks whose target can take their bytes are read straight into it; every
        other tensor chunk streams into its targets through the staging ring; bytes items are
        read into buffers (at most ``read_budget_bytes`` at a time) for the planner."""
        direct: list[tuple[ItemRecord, ReadItem, torch.Tensor, torch.Tensor]] = []
        streamed: list[tuple[ItemRecord, Targets]] = []
        stored: list[tuple[ItemRecord, list[ReadItem]]] = []
        for key, reqs in groups.items():
            rec = self.r.storage_data[key]
            if rec.kind == "bytes":
                stored.append((rec, reqs))
                continue
            targets = [(req, self._target(rec, req)) for req in reqs]
            dest = (_direct_bytes(targets[0][1], rec)
                    if len(reqs) == 1 and _is_whole(reqs[0], rec) else None)
            if dest is not None:
                direct.append((rec, reqs[0], targets[0][1], dest))
            else:
                streamed.append((rec, targets))
        if direct:
            self._read([(rec, dest) for rec, _, _, dest in direct])
        if streamed:
            self._read([(rec, None) for rec, _ in streamed], on_bytes=_Boxes(streamed))
        for _, req, target, _ in direct:
            self.planner.commit_tensor(req, target)
        for _, targets in streamed:
            for req, target in targets:
                self.planner.commit_tensor(req, target)
        self._read_bytes(stored)

    def _target(self, rec: ItemRecord, req: ReadItem) -> torch.Tensor:
        target = self.planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise CheckpointError(
                f"{rec.describe(req.storage_index.offset)}: the planner asked for a "
                f"{tuple(req.lengths)} box but resolved a {tuple(target.shape)} tensor for it"
            )
        return target

    def _read(self, jobs: Sequence[tuple[ItemRecord, torch.Tensor | None]],
              on_bytes: Any = None) -> None:
        """Read every extent of each record into its byte destination (None: only ``on_bytes``
        sees the bytes), verifying CRC32C."""
        names = [rec.describe(None) for rec, _ in jobs]
        # storage indices renumbered to the jobs, so each job's destination is its storage
        extents = [replace(e, storage=local) for local, (rec, _) in enumerate(jobs)
                   for e in rec.extents]
        dests = None if on_bytes is not None else [dest for _, dest in jobs]
        read_extents(self.ck, extents, dests, self.cfg, verify=self.r.verify,
                     describe=lambda i: names[i], on_bytes=on_bytes, progress=self.counter.hook)

    def _read_bytes(self, stored: list[tuple[ItemRecord, list[ReadItem]]]) -> None:
        batch: list[tuple[ItemRecord, list[ReadItem]]] = []
        size = 0
        for n, entry in enumerate(stored):
            batch.append(entry)
            size += entry[0].nbytes
            if n + 1 == len(stored) or size + stored[n + 1][0].nbytes > self.r.read_budget_bytes:
                bufs = [torch.empty(rec.nbytes, dtype=torch.uint8) for rec, _ in batch]
                self._read(list(zip([rec for rec, _ in batch], bufs, strict=True)))
                for (rec, reqs), buf in zip(batch, bufs, strict=True):
                    self._load_bytes(rec, reqs, buf.numpy().tobytes())
                batch, size = [], 0

    def _load_bytes(self, rec: ItemRecord, reqs: list[ReadItem], data: bytes) -> None:
        """Hand the bytes to the planner, which deserializes them (the StorageReader contract;
        DCP's DefaultLoadPlanner uses ``torch.load(weights_only=False)``). With
        ``weights_only=True`` they must first load with ``torch.load(weights_only=True)``."""
        if self.r.weights_only:
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:  # noqa: BLE001 - any refusal of the safe unpickler
                raise CheckpointError(
                    f"{rec.describe(None)} in {self.r.path} holds a pickled object that "
                    f"torch.load(weights_only=True) refuses, and this GdsPersistReader was made "
                    f"with weights_only=True; the unpickler said: {type(e).__name__}: {e}\n"
                    "Allow its classes with torch.serialization.add_safe_globals([...]), or "
                    "leave weights_only=False (the planner then unpickles it, as DCP's "
                    "FileSystemReader does) for checkpoints you trust"
                ) from e
        for req in reqs:
            self.planner.load_bytes(req, io.BytesIO(data))

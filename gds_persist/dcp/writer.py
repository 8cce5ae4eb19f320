"""``GdsPersistWriter``: a DCP ``StorageWriter`` that writes gds_persist checkpoints.

DCP calls (see ``torch.distributed.checkpoint.storage.StorageWriter``)::

    0) (all ranks)   reset(checkpoint_id)           path, fresh save id
    1) (all ranks)   set_up_storage_writer(...)      role; refuses use_collectives=False
    2) (all ranks)   prepare_local_plan(plan)        records which items this rank holds
    3) (coordinator) prepare_global_plan(plans)      creates the temporary sibling directory,
                                                      balances replicated items by byte range
    4) (all ranks)   write_data(plan, planner)       one aligned data file per rank (two when
                                                      CUDA and host items meet a kvikio backend),
                                                      CRC32C per extent, fsynced
    5) (coordinator) finish(metadata, results)       manifest (DCP metadata as JSON, no pickle),
                                                      fsync, atomic rename into place

The temporary directory's name travels to every rank inside the plan DCP scatters
(``SavePlan.storage_data``), so only the coordinator creates and renames it. If any rank fails,
DCP never calls ``finish``: the previous checkpoint at the path stays, and the temporary
directory (which ``load`` and ``GdsPersistReader`` refuse) is removed by the next save of that
path.
"""

from __future__ import annotations

import io
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import settings
from ..backends import choose_backend
from ..errors import CheckpointError
from ..format import (
    DataFile,
    Extent,
    Manifest,
    StorageRecord,
    TensorRecord,
    dtype_name,
)
from ..format import tree as _tree
from ..format.layout import layout_file
from ..keywords import as_settings, removed_keywords
from ..parallel import balancing as _balance
from ..progress import ByteCounter, ProgressCallback
from ..saving.manifest_builder import Part
from ..saving.manifest_builder import build_manifest as build_from_parts
from ..saving.sequence import Layout, Run, begin_driven, finish_driven
from ..stores import commit as objects
from ..stores import is_url
from ..stores.io import object_settings, writer_for
from ..transfer.commit import Temporary, begin, writer_record
from ..transfer.pipeline import byte_view
from ..transfer.staging import io_session
from ..transfer.writer import FileWriter
from ._codec import encode_metadata
from .checkpoint_path import CheckpointPath

WRITER_TAG = "gds_persist.dcp"


@dataclass(frozen=True)
class _Inventory:
    """``prepare_local_plan`` -> coordinator: the tensor items this rank could write."""

    tensor_items: tuple[MetadataIndex, ...]


@dataclass(frozen=True)
class _RankPlan:
    """Coordinator -> each rank (``SavePlan.storage_data``): where and which byte ranges."""

    tmp: str
    rank: int
    ranges: dict[MetadataIndex, tuple[int, int]] = field(default_factory=dict)  # partial items


@dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: one written byte range of one item."""

    kind: str  # "tensor" | "bytes"
    dtype: str  # "uint8" for bytes items
    shape: tuple[int, ...]  # the chunk's sizes; (nbytes,) for bytes items
    nbytes: int  # the whole item's bytes
    start: int
    length: int
    file: str | None  # None for an empty range
    file_size: int
    offset: int
    crc32c: int
    backend: str


def _chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    n = 1
    for s in td.chunk.sizes:
        n *= int(s)
    return n * torch.empty((), dtype=td.properties.dtype).element_size()


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's own bytes (contiguous copy first if needed)."""
    t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    start = t.storage_offset() * t.element_size()
    return byte_view(t.untyped_storage())[start : start + t.numel() * t.element_size()]


class GdsPersistWriter(CheckpointPath, StorageWriter, BlockingAsyncStager):
    """Write DCP checkpoints with gds_persist's aligned backends, CRC32C and atomic commit.

    ``dcp.save(state_dict, storage_writer=GdsPersistWriter(path))`` and ``dcp.async_save(...)``
    work unchanged; as ``FileSystemWriter``, the writer is the ``AsyncStager`` that
    ``dcp.async_save`` uses when no ``async_stager`` is given. After a save, :attr:`rank_bytes`
    (coordinator) holds the bytes each rank was given. Not supported, with a clear error:
    ``use_collectives=False`` and ``DefaultSavePlanner(enable_plan_caching=True)`` (both need
    rank-local decisions about the shared temporary directory).

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory (or ``dcp.save(..., checkpoint_id=path)``); an existing
        gds_persist checkpoint there is replaced atomically once the new one is complete
        (anything else there is refused).
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        Per rank, as in :func:`gds_persist.save`.
    balance : bool
        Split replicated items of at least ``split_min_bytes`` across the ranks holding them
        (:mod:`gds_persist.parallel.balancing`); ``False`` keeps DCP's whole-item assignment.
    split_min_bytes : int
        The smallest item ``balance`` splits.
    progress : callable, optional
        ``progress(done, total)`` with this rank's bytes.
    overwrite : bool
        ``False`` refuses to replace a checkpoint at ``path`` (checked when the save starts and
        again under the commit lock).
    thread_count : int, optional
        ``FileSystemWriter``'s name for the ``io_threads`` setting (docs/INTEGRATIONS.md,
        "FileSystemWriter's arguments").
    sync_files, single_file_per_rank : bool
        What this writer always does (an atomic commit needs fsynced files; one aligned file per
        rank is the layout); ``False`` is refused.
    cache_staged_state_dict : bool
        Keep the ``dcp.async_save`` staging copy between saves (pinned where CUDA is available).
    """

    @removed_keywords(as_settings("block_bytes", "staging_bytes", "io_threads"))
    def __init__(
        self,
        path: str | os.PathLike[str] = "",
        *,
        backend: str | None = None,
        balance: bool = True,
        split_min_bytes: int = 1 << 20,
        progress: ProgressCallback | None = None,
        overwrite: bool = True,
        thread_count: int | None = None,
        sync_files: bool = True,
        single_file_per_rank: bool = True,
        cache_staged_state_dict: bool = False,
    ):
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        _refuse_unsupported(sync_files, single_file_per_rank)
        self.overwrite = overwrite
        self._set_path(path)
        self.backend = backend
        self.balance = balance
        self.split_min_bytes = split_min_bytes
        self.io_threads = thread_count  # FileSystemWriter's name for it; None: the setting
        self.progress = progress
        self.is_coordinator = False
        self.rank_bytes: list[int] = []
        self.save_id = uuid.uuid4().hex
        self._tmp: Temporary | objects.ObjectTarget | None = None
        self._t0 = 0.0

    # -- DCP interface ------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_path(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        if self._tmp is not None:  # a save that failed before finish(): give it up
            self._tmp.finish()  # (abort's own step; an object store's prefix too)
        self._tmp = None
        self.rank_bytes = []

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self.path:
            raise CheckpointError(
                "GdsPersistWriter needs a path: GdsPersistWriter(path) or "
                "dcp.save(..., checkpoint_id=path)"
            )
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                "GdsPersistWriter does not support dcp.save(use_collectives=False): without "
                "collectives no rank can create and publish the shared temporary directory "
                "atomically; use the default use_collectives=True"
            )
        self.is_coordinator = is_coordinator
        self._t0 = time.perf_counter()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        held = tuple(i.index for i in plan.items if i.type != WriteItemType.BYTE_IO)
        return replace(plan, storage_data=_Inventory(held))

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s copy of the state on the host (``AsyncStager``); with
        ``cache_staged_state_dict`` one copy is kept and refilled, pinned only where CUDA is
        available (``BlockingAsyncStager`` pins always, which fails on a CPU-only machine)."""
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(
                state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:  # DCP's process executor pickles the writer
        return {**self.__dict__, "state_dict_cache": None}

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._run = begin_driven(_Layout(self), self.path,
                                 settings.current(backend=self.backend),
                                 f"DCP save of {self.path}")
        tmp = self._tmp = self._run.tmp
        assert tmp is not None
        try:
            assignment = self._assign(plans)
        except BaseException:
            tmp.finish()  # abort: its temporary directory or objects go
            self._tmp = None
            raise
        out = []
        for rank, (plan, (items, ranges)) in enumerate(zip(plans, assignment, strict=False)):
            out.append(replace(plan, items=items, storage_data=_RankPlan(tmp.dir, rank, ranges)))
        return out

    def _assign(
        self, plans: list[SavePlan]
    ) -> list[tuple[list[WriteItem], dict[MetadataIndex, tuple[int, int]]]]:
        world = len(plans)
        owner: dict[MetadataIndex, int] = {}
        item_of: dict[MetadataIndex, WriteItem] = {}
        order: list[MetadataIndex] = []
        for rank, plan in enumerate(plans):
            for it in plan.items:
                if it.index in owner:  # planners dedupe replicated items; refuse one that did not
                    raise CheckpointError(
                        f"DCP item {it.index.fqn!r} is planned by ranks {owner[it.index]} and "
                        f"{rank}: use a planner that deduplicates (DefaultSavePlanner does)"
                    )
                owner[it.index] = rank
                item_of[it.index] = it
                order.append(it.index)
        holders: dict[MetadataIndex, set[int]] = {k: {r} for k, r in owner.items()}
        if self.balance:
            for rank, plan in enumerate(plans):
                inv = plan.storage_data
                if isinstance(inv, _Inventory):
                    for k in inv.tensor_items:
                        if k in holders and item_of[k].type != WriteItemType.BYTE_IO:
                            holders[k].add(rank)
        sizes = [
            (_chunk_nbytes(item_of[k]) if item_of[k].type != WriteItemType.BYTE_IO else 0)
            for k in order
        ]
        pieces = _balance.balance(
            sizes, [sorted(holders[k]) for k in order], world, split_min_bytes=self.split_min_bytes
        )
        per_rank: list[tuple[list[WriteItem], dict[MetadataIndex, tuple[int, int]]]] = [
            ([], {}) for _ in range(world)
        ]
        for k, size, item_pieces in zip(order, sizes, pieces, strict=False):
            if not item_pieces:  # empty tensor or bytes item: its DCP owner writes it
                per_rank[owner[k]][0].append(item_of[k])
                continue
            for p in item_pieces:
                items, ranges = per_rank[p.rank]
                items.append(item_of[k])
                if (p.start, p.stop) != (0, size):
                    ranges[k] = (p.start, p.stop)
        self.rank_bytes = _balance.rank_bytes(pieces, world)
        return per_rank

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise CheckpointError(
                "GdsPersistWriter.write_data got a plan it did not prepare (DCP plan caching, "
                "DefaultSavePlanner(enable_plan_caching=True), is not supported)"
            )
        if not is_url(info.tmp) and not os.path.isdir(info.tmp):
            raise CheckpointError(
                f"the temporary directory {info.tmp} of this save does not exist: it was "
                "published or removed already (DCP plan caching, enable_plan_caching=True, is "
                "not supported), or ranks do not share the filesystem of the checkpoint path"
            )
        cfg = settings.current(backend=self.backend, io_threads=self.io_threads)
        sources: list[torch.Tensor] = []
        meta: list[tuple[WriteItem, str, str, tuple[int, ...], int, int, int]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            shape: tuple[int, ...]
            if item.type == WriteItemType.BYTE_IO:
                raw = bytearray(data.getbuffer() if isinstance(data, io.BytesIO) else data)
                src = (
                    torch.frombuffer(raw, dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
                kind, dtype, shape = "bytes", "uint8", (len(raw),)
            else:
                if not isinstance(data, torch.Tensor):
                    raise CheckpointError(
                        f"DCP item {item.index.fqn!r}: the planner resolved a "
                        f"{type(data).__name__} for a tensor item"
                    )
                src = _tensor_bytes(data)
                td = item.tensor_data
                assert td is not None
                kind, dtype, shape = (
                    "tensor",
                    dtype_name(td.properties.dtype),
                    tuple(int(s) for s in td.chunk.sizes),
                )
                if src.numel() != _chunk_nbytes(item):
                    raise CheckpointError(
                        f"DCP item {item.index.fqn!r}: the planner resolved {src.numel()} bytes "
                        f"for a chunk of {_chunk_nbytes(item)} bytes"
                    )
            nbytes = src.numel()
            lo, hi = info.ranges.get(item.index, (0, nbytes))
            sources.append(src)
            meta.append((item, kind, dtype, shape, nbytes, lo, hi))
        results = self._write_files(info, cfg, sources, meta)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(
        self,
        info: _RankPlan,
        cfg: settings.Settings,
        sources: list[torch.Tensor],
        meta: list[tuple[WriteItem, str, str, tuple[int, ...], int, int, int]],
    ) -> list[WriteResult]:
        wants_device = any(s.is_cuda for s in sources)
        if is_url(info.tmp):  # multipart uploads: requests of whole parts
            cfg = object_settings(cfg)
            be, reason = writer_for(cfg, info.tmp)
        else:
            be, reason = choose_backend(
                cfg.backend, info.tmp, wants_device, cfg.io_threads, cfg.block_bytes
            )
        # kvikio writes CUDA sources straight from device memory only when a file holds nothing
        # else, so CUDA and host sources go to separate files there.
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(sources):
            device_file = be.accepts_device and s.is_cuda
            name = f"rank{info.rank:05d}-{'dev' if device_file else 'host'}.bin"
            groups.setdefault(name, []).append(i)
        plans = {
            name: layout_file(name, 0, [(i, meta[i][5], meta[i][6] - meta[i][5]) for i in idx])
            for name, idx in groups.items()
        }
        counter = ByteCounter(self.progress, sum(p.size for p in plans.values()))
        placed: dict[int, tuple[str, int, int, int]] = {}  # source -> file, size, offset, crc
        with io_session(
            cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
        ) as (ring, pool):
            writer = FileWriter(be, ring, pool, cfg.io_timeout_s, counter.hook)
            for name, fplan in plans.items():
                if not fplan.extents:
                    continue
                crcs = writer.write(os.path.join(info.tmp, name), fplan, sources)
                for e, crc in zip(fplan.extents, crcs, strict=False):
                    placed[e.storage] = (name, fplan.size, e.offset, crc)
        counter.finish()
        backend = f"{be.name} ({reason})"
        results = []
        for i, (item, kind, dtype, shape, nbytes, lo, hi) in enumerate(meta):
            file, file_size, offset, crc = placed.get(i, (None, 0, 0, 0))
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=hi - lo,
                    storage_data=_Written(
                        kind,
                        dtype,
                        shape,
                        nbytes,
                        lo,
                        hi - lo,
                        file,
                        file_size,
                        offset,
                        crc,
                        backend,
                    ),
                )
            )
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._tmp is None:
            raise CheckpointError("GdsPersistWriter.finish called without prepare_global_plan")
        self._tmp = None
        finish_driven(_Layout(self, metadata), self._run, results)


class _Layout(Layout[Any, Any]):
    """The DCP writer's layout. DCP's planner and collectives drive the save sequence here:
    ``begin`` in ``prepare_global_plan`` (the coordinator), the writes in ``write_data`` (every
    rank, one or two files each), seal and commit in ``finish`` (the coordinator), once DCP has
    gathered every rank's results; if any rank fails, DCP never calls ``finish``."""

    def __init__(self, writer: GdsPersistWriter, metadata: Metadata | None = None):
        self.writer, self.metadata = writer, metadata
        self.replace = writer.overwrite

    def begin(self, run: Run) -> Temporary | objects.ObjectTarget:
        if is_url(run.path):
            return objects.begin(run.path, self.replace)
        return begin(run.path, run.cfg.io_timeout_s, replace=self.replace)

    def seal(self, run: Run, reports: list[list[WriteResult]]) -> Manifest:
        assert self.metadata is not None
        return build_manifest(self.metadata, reports, self.writer)


def _refuse_unsupported(sync_files: bool, single_file_per_rank: bool) -> None:
    if not sync_files:
        raise CheckpointError(
            "GdsPersistWriter(sync_files=False) is not supported: every data file is fsynced "
            "before the atomic commit, which is what makes the checkpoint at the path complete "
            "after a crash; leave sync_files=True (the default)"
        )
    if not single_file_per_rank:
        raise CheckpointError(
            "GdsPersistWriter(single_file_per_rank=False) is not supported: each rank writes one "
            "aligned data file (two where kvikio writes CUDA tensors) and the manifest records "
            "every item's offset and CRC32C in it; leave single_file_per_rank=True (the default)"
        )


def build_manifest(
    metadata: Metadata, results: list[list[WriteResult]], writer: GdsPersistWriter
) -> Manifest:
    """A gds_persist manifest over every rank's data files, with DCP's metadata as JSON."""
    by_index: dict[MetadataIndex, list[_Written]] = {}
    files: dict[str, int] = {}
    backends = []
    for rank, rank_results in enumerate(results):
        for wr in rank_results:
            w = wr.storage_data
            if not isinstance(w, _Written):
                raise CheckpointError(
                    f"unexpected write result for {wr.index.fqn!r}: {type(w).__name__}"
                )
            by_index.setdefault(wr.index, []).append(w)
            if w.file is not None:
                files[w.file] = max(files.get(w.file, 0), w.file_size)
        if rank_results:
            backends.append((rank, rank_results[0].storage_data.backend))
    file_names = sorted(files)
    file_index = {n: i for i, n in enumerate(file_names)}
    storages: list[StorageRecord] = []
    tensors: list[TensorRecord] = []
    extents: list[Extent] = []
    nodes: list[dict[str, Any]] = []
    for index in sorted(by_index, key=lambda k: (k.fqn, tuple(k.offset or ()))):
        pieces = sorted(by_index[index], key=lambda w: w.start)
        first = pieces[0]
        covered = 0
        shape_of_first = (first.kind, first.dtype, first.shape, first.nbytes)
        same_item = all((w.kind, w.dtype, w.shape, w.nbytes) == shape_of_first for w in pieces)
        for w in pieces:
            if w.start != covered or not same_item:
                raise CheckpointError(
                    f"DCP item {index.fqn!r}: ranks wrote overlapping or mismatched ranges"
                )
            covered += w.length
        if covered != first.nbytes:
            raise CheckpointError(
                f"DCP item {index.fqn!r}: {covered} of {first.nbytes} bytes written"
            )
        s = len(storages)
        storages.append(StorageRecord(first.nbytes, "cpu"))
        stride, acc = [], 1
        for d in reversed(first.shape):
            stride.append(acc)
            acc *= max(d, 1)
        tensors.append(TensorRecord(s, first.dtype, tuple(first.shape), tuple(reversed(stride)), 0))
        extents += [
            Extent(s, w.start, w.length, file_index[w.file], w.offset, w.crc32c)
            for w in pieces
            if w.length and w.file is not None
        ]
        offsets = None if index.offset is None else [int(o) for o in index.offset]
        nodes.append(
            _tree.mapping(
                ["fqn", "offsets", "kind", "data"],
                [
                    index.fqn,
                    None if offsets is None else _tree.sequence(offsets),
                    first.kind,
                    _tree.tensor(len(tensors) - 1),
                ],
            )
        )
    tree = _tree.mapping(["dcp_items"], [_tree.sequence(nodes)])
    info = writer_record(
        ", ".join(sorted({b.split(" ")[0] for _, b in backends})),
        "; ".join(f"rank {r}: {b}" for r, b in backends),
        len(results),
        writer=WRITER_TAG,
        rank_bytes=list(writer.rank_bytes),
        balanced=writer.balance,
        seconds=round(time.perf_counter() - writer._t0, 6) if writer._t0 else None,
        dcp=encode_metadata(metadata),
    )
    return build_from_parts(Part(tree, tensors, storages),
                            [DataFile(n, files[n]) for n in file_names], extents, info)

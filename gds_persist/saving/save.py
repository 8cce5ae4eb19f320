"""``save``: flatten -> plan -> write -> seal -> commit, on one process; with a process group (or
rank-local parts, or data directories) the data-parallel save of :mod:`.data_parallel`."""

from __future__ import annotations

import os
import time
from typing import Any

from .. import settings
from ..backends.base import Backend
from ..format import Manifest, align_up, codec, data_file_name, storage_keys
from ..format.layout import SavePlan, file_streams, plan_single_writer
from ..progress import ByteCounter, ProgressCallback
from ..results import SaveInfo
from ..stages import stage
from ..state.flatten import Flattened, flatten
from ..transfer.commit import Temporary, aborted_on_error, begin, seal, writer_record
from ..transfer.writer import write_plan
from .as_saved import refuse_torn
from .data_parallel import save_parallel
from .incremental import BaseIndex, References, describe_references, open_base
from .options import SaveRequest
from .torch_file import PickledState, save_torch_file
from .torch_file_parallel import save_torch_file_parallel
from .units import (
    Written,
    backend_for,
    choose,
    cut_units,
    manifest_files,
    spread,
    typesizes,
    with_fallback,
    write_directory,
)


def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    block_bytes: int | None = None,
    staging_bytes: int | None = None,
    io_threads: int | None = None,
    progress: ProgressCallback | None = None,
    process_group: Any = None,
    rank_local: Any = None,
    writers_per_node: int | None = None,
    data_dirs: Any = None,
    check_replicas: str = "structure",
    allow_pickle: bool = False,
    base: str | os.PathLike[str] | None = None,
    compression: str | None = None,
    content_hash: bool | None = None,
    format: str = "directory",
) -> SaveInfo:
    """Write ``state_dict`` to the checkpoint directory ``path``, durably and atomically.

    ``backend`` is ``"auto"`` (default, or ``$GDS_PERSIST_BACKEND``), ``"direct"``,
    ``"buffered"`` or ``"kvikio"``. An existing checkpoint at ``path`` is replaced only once the
    new one is complete and fsynced; if anything fails, it is left as it was.

    Several processes may save to (and load from) one ``path`` at once: each save writes its own
    temporary directory, the commits take turns (each waits at most ``io_timeout_s`` for another
    one to finish committing, then raises :class:`CheckpointTimeout` naming it), and the last
    to commit wins - the path always holds one complete checkpoint, and every save that returned
    was committed (possibly replaced since). A save never removes another live save's files;
    leftovers of killed saves are removed by a later save once their owner is gone. Loads that
    overlap a replacement read one complete checkpoint (``docs/FORMAT.md``, "Several processes,
    one path").

    ``progress(done_bytes, total_bytes)``, if given, is called as data files are written (see
    :mod:`gds_persist.progress`).

    Data-parallel (``docs/DISTRIBUTED.md``): with ``process_group`` (a ``torch.distributed`` group,
    or ``"default"``), every rank of the group calls ``save`` with its replica of the state; each
    writes a disjoint, byte-balanced share and rank 0 commits. ``rank_local`` marks key paths
    (``"optimizer"`` or ``("optimizer", "state")``, or a list of them) whose subtrees differ per
    rank (ZeRO shards): written by their owner only. ``writers_per_node`` (default: every rank)
    limits the writing ranks per node; ``data_dirs`` stripes each node's files over several
    directories (one per drive). ``check_replicas`` compares the replicated state across ranks:
    ``"structure"`` (keys, dtypes, shapes, sizes; default), ``"checksums"`` (also the bytes) or
    ``"off"``. Returns a :class:`~gds_persist.results.DistributedSaveInfo` then;
    ``progress`` then counts this rank's own bytes.

    Internally ``state_dict`` may also be a :class:`~gds_persist.state.flatten.Flattened` (what
    ``flatten`` returns): it is written as is, all of it replicated; or, with a process group,
    a :class:`~gds_persist.state.rank_local.Split` (the replicated and the rank-local part, each
    flattened). The Checkpointer flattens each state dict once, when its ``save`` is called, and
    its snapshots are Flattened records over host copies.

    Leaves beyond tensors and JSON scalars (numpy arrays and scalars, bytes, pathlib paths, enums,
    dict/list/tuple subclasses, namespaces) are stored by value (format version 3,
    docs/FORMAT.md). ``allow_pickle=True`` stores any other object pickled; ``load`` unpickles
    it only with ``torch.load(weights_only=True)`` (no code runs; allow classes with
    ``torch.serialization.add_safe_globals``). Single-process saves only: replicas of a pickle
    need not be byte-identical across ranks.

    Writing fewer bytes (format version 4, docs/FORMAT.md): ``base`` names an earlier checkpoint
    in the same parent directory; every unit of a storage (up to 16 MiB of it) whose key path,
    byte range and BLAKE3-128 content hash equal the base's is not written again - the new
    checkpoint refers to the base's bytes (or to the checkpoint the base itself refers to).
    ``content_hash`` (default: True with a base) records the hashes that let this checkpoint
    serve as a base later; a base saved without them (a plain save) holds nothing to refer to:
    every byte is written again, with an :class:`~gds_persist.UnhashedBaseWarning` and the
    same words in ``SaveInfo.reason``. (Plain saves do not hash: on the development VM that
    cost 1.4-1.5x the save's own time, ``bench/bench_hash_cost.py``.)
    ``compression``: ``"none"`` (default, or the ``compression`` setting), ``"lossless"``
    (each unit stored encoded by blosc2 bit-shuffle + LZ4 where that shrinks it) or ``"auto"``
    (only where measured to make this save faster on this drive; the reason is in
    ``SaveInfo.compression_reason``). Loads return bit-identical tensors either way.

    ``format="torch"``: ``path`` is one file in ``torch.save``'s format, which stock
    ``torch.load`` (``weights_only=True``, ``mmap=True``) reads bit-exactly and any tool that
    opens ``.pt`` / ``.ckpt`` files takes; written by the same engine (aligned O_DIRECT or
    kvikio, CRC32C of every storage in a record torch ignores, atomic), and read back, verified,
    by :func:`gds_persist.load` (:mod:`gds_persist.saving.torch_file`). With ``process_group``
    the ranks write byte ranges of the one file. The state holds what
    ``torch.load(weights_only=True)`` reads unless ``allow_pickle=True``; ``base``,
    ``compression``, ``content_hash``, ``rank_local`` and ``data_dirs`` need the directory
    format.

    Raises TypeError (naming the key path) for objects a checkpoint cannot hold,
    :class:`DiskFullError` when the filesystem is too small, :class:`BackendError` for an unusable
    backend, :class:`CheckpointTimeout` when another process's commit of ``path`` hangs,
    :class:`DistributedError` (on every rank, naming the failed rank) when a rank fails.
    """
    options = SaveRequest(
        backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
        io_threads=io_threads, progress=progress, process_group=process_group,
        rank_local=rank_local, writers_per_node=writers_per_node, data_dirs=data_dirs,
        check_replicas=check_replicas, allow_pickle=allow_pickle, base=base,
        compression=compression, content_hash=content_hash, format=format)
    if options.format == "torch":
        return _save_torch(state_dict, os.path.abspath(os.fspath(path)), options)
    if options.data_parallel:
        return save_parallel(state_dict, path, options)
    t0 = time.perf_counter()
    path = os.fspath(path)
    base_path = options.base_of(path)
    with stage("flatten"):
        flat = (state_dict if isinstance(state_dict, Flattened)
                else flatten(state_dict, options.allow_pickle))
    if options.plain:
        return _save_plain(flat, path, options, t0)
    return _save_units(flat, path, options, base_path, t0)


def _save_plain(flat: Flattened, path: str, options: SaveRequest, t0: float) -> SaveInfo:
    """A plain (version 1-3) save: raw bytes, no base, no hashes."""
    with stage("plan + temporary directory"):
        plan = plan_single_writer(*_sizes_and_streams(flat, options.cfg))
        tmp = begin(path, options.cfg.io_timeout_s)
    needs = f"this checkpoint needs {plan.total_bytes} bytes of data; "
    with aborted_on_error(tmp, path, needs):
        be, reason = backend_for(options.cfg, tmp.dir, flat.storage_objects)
        return _write_plain(tmp, plan, flat, be, reason, options, t0)


def _sizes_and_streams(flat: Flattened, cfg: settings.Settings) -> tuple[list[int], int]:
    """The storages' sizes, and over how many data files one writer spreads them."""
    sizes = [s.nbytes for s in flat.storages]
    return sizes, file_streams(sum(sizes), cfg.io_threads, cfg.block_bytes, cfg.file_streams)


def _write_plain(tmp: Temporary, plan: SavePlan, flat: Flattened, be: Backend, reason: str,
                 options: SaveRequest, t0: float,
                 compression: dict[str, Any] | None = None) -> SaveInfo:
    """Write and commit a plain (version 1-3) checkpoint: raw bytes, no base, no hashes."""
    cfg = options.cfg
    counter = ByteCounter(options.progress, plan.total_bytes)
    extents = write_plan(be, tmp.dir, plan.files, flat.storage_objects, cfg, counter.hook)
    reason = with_fallback(be, reason)
    writer = writer_record(be.name, reason)
    if compression is not None:
        writer["compression"] = compression
    refuse_torn(flat, extents, tmp.path)
    with stage("commit (manifest, fsync, rename)"):
        seal(tmp, Manifest([f.data_file for f in plan.files], flat.storages, flat.tensors,
                           extents, flat.tree, writer), cfg.io_timeout_s)
    counter.finish()
    return SaveInfo(tmp.path, be.name, reason, plan.total_bytes,
                    sum(s.nbytes for s in flat.storages), time.perf_counter() - t0,
                    len(flat.tensors), len(flat.storages), [f.name for f in plan.files],
                    compression_reason=compression["reason"] if compression else "")


def _save_units(flat: Flattened, path: str, options: SaveRequest, base: str | None,
                t0: float) -> SaveInfo:
    """A version-4 save: units hashed, referred to or written (maybe encoded) as they come.
    Where ``compression="auto"`` chose raw bytes and there is neither a base nor hashes to
    record, the plain save instead (version 1-3, the same bytes as ``compression="none"``)."""
    cfg = options.cfg
    with stage("plan + temporary directory"):
        sizes, streams = _sizes_and_streams(flat, cfg)
        units = cut_units([(i, 0, n) for i, n in enumerate(sizes) if n],
                          typesizes(flat.tensors, len(sizes)))
        names = [data_file_name(k) for k in range(streams)]
        tmp = begin(path, cfg.io_timeout_s)
    index = None
    try:
        with aborted_on_error(tmp, path):
            if base is not None:
                with stage("open the base"):
                    index = open_base(path, base)
            choice = choose(cfg, tmp.dir, units, flat.storage_objects)
            compression = {"mode": cfg.compression, "applied": choice.compress,
                           "codec": codec.DESCRIPTION if choice.compress else "none",
                           "reason": choice.compression_reason}
            if not choice.compress and not options.hashes and index is None:  # auto chose raw
                return _write_plain(tmp, plan_single_writer(sizes, streams), flat,
                                    choice.backend, choice.reason, options, t0, compression)
            counter = ByteCounter(options.progress, sum(align_up(u.length) for u in units))
            refs, written = write_directory(
                choice, tmp.dir, names, spread(units, streams), units, flat.storage_objects, cfg,
                base=index, keys=storage_keys(flat.tree, flat.tensors),
                hashes=options.hashes or index is not None, progress=counter.hook)
            reason = with_fallback(choice.backend, choice.reason)
            if index is not None and index.note:  # e.g. a base without content hashes
                reason = f"{reason}; {index.note}"
            kept = _seal_units(tmp, flat, names, written, refs, index,
                               writer_record(choice.backend.name, reason, compression=compression),
                               cfg.io_timeout_s)
            counter.finish()
    finally:
        if index is not None:
            index.close()
    return SaveInfo(
        path, choice.backend.name, reason, sum(written.sizes), sum(s.nbytes for s in flat.storages),
        time.perf_counter() - t0, len(flat.tensors), len(flat.storages), kept,
        referenced_bytes=refs.referred_bytes(),
        compression="lossless" if choice.compress else "none",
        compression_reason=choice.compression_reason,
        base=os.path.basename(base) if base is not None else None,
    )


def _seal_units(tmp: Temporary, flat: Flattened, names: list[str], written: Written,
                refs: References, index: BaseIndex | None, writer: dict[str, Any],
                timeout_s: float) -> list[str]:
    """Commit a version-4 save's files (empty ones removed: every unit referred to) with the
    references to its base; returns the names of the files kept."""
    data_files, bases, extents, kept = manifest_files(
        names, written.sizes, written.extents, written.referred, tmp.dir)
    incremental = describe_references(refs)
    if incremental:
        writer["incremental"] = incremental
    refuse_torn(flat, extents, tmp.path)
    with stage("commit (manifest, fsync, rename)"):
        manifest = Manifest(data_files, flat.storages, flat.tensors, extents, flat.tree, writer,
                            bases=bases)
        if index is not None:
            index.check_unchanged()
        seal(tmp, manifest, timeout_s)
    return kept


def _save_torch(state: Any, path: str, options: SaveRequest) -> SaveInfo:
    if isinstance(state, Flattened):  # a snapshot of a pickled state (a background writer)
        if not isinstance(state.tree, PickledState):
            raise TypeError("format='torch' pickles the state itself: pass the state dict, "
                            "not a flattened one")
        state = PickledState.over(state)
    if options.data_parallel:
        return save_torch_file_parallel(state, path, options)
    return save_torch_file(state, path, options, time.perf_counter())

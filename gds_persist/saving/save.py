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
from ..keywords import removed_keywords
from ..progress import ByteCounter, ProgressCallback
from ..results import SaveInfo
from ..stages import stage
from ..state.flatten import Flattened, flatten
from ..transfer.commit import Temporary, aborted_on_error, begin, seal, writer_record
from ..transfer.writer import write_plan
from .as_saved import refuse_torn
from .data_parallel import save_parallel
from .incremental import BaseIndex, References, describe_references, open_base
from .options import MOVED, SaveOptions, SaveRequest
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


@removed_keywords(MOVED)
def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    format: str = "directory",
    backend: str | None = None,
    process_group: Any = None,
    rank_local: Any = None,
    base: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
    options: SaveOptions | None = None,
) -> SaveInfo:
    """Write ``state_dict`` to ``path`` durably and atomically; return what was written.

    An existing checkpoint at ``path`` is replaced only once the new one is complete and
    fsynced. I/O tuning (``block_bytes``, ``staging_bytes``, ``io_threads``) is set with
    :func:`gds_persist.settings.set`. Reference: ``docs/USAGE.md``, "Reference: save".

    Parameters
    ----------
    state_dict : dict
        Tensors (any device), containers and plain values; ``rank_local`` parts per rank.
    path : str or os.PathLike
        The checkpoint directory (``format="torch"``: one file); ``~`` is expanded.
    format : {"directory", "torch"}
        A checkpoint directory, or one ``torch.save`` file that stock ``torch.load`` reads.
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        The I/O backend (default: the ``backend`` setting, ``"auto"``).
    process_group : torch.distributed group or "default", optional
        Data-parallel: every rank calls ``save`` with its replica; each writes a byte-balanced
        share and rank 0 commits (``docs/DISTRIBUTED.md``).
    rank_local : key path or list of key paths, optional
        Subtrees that differ per rank (ZeRO shards), written by their owner only.
    base : path, optional
        An earlier checkpoint in the same parent directory: units whose bytes equal the
        base's are referred to, not written again (``docs/FORMAT.md``, version 4).
    allow_pickle : bool
        Store leaves beyond tensors and plain values pickled (single process only); ``load``
        unpickles them with ``torch.load(weights_only=True)``.
    progress : callable, optional
        ``progress(done_bytes, total_bytes)``, called as data files are written.
    options : SaveOptions, optional
        The rarer options: compression, content hashes, data-parallel layout.

    Returns
    -------
    SaveInfo
        Backend and why, bytes, seconds (:class:`~gds_persist.results.DistributedSaveInfo` with
        a process group).

    Raises
    ------
    TypeError
        An object a checkpoint cannot hold (naming its key path), or a keyword of 0.1.
    DiskFullError, BackendError, CheckpointTimeout, DistributedError
        No room; an unusable backend; another process's commit of ``path`` hangs; a rank
        failed (raised on every rank, naming it).
    """
    path = os.path.expanduser(os.fspath(path))
    more = options if options is not None else SaveOptions()
    request = SaveRequest(
        backend=backend, progress=progress, process_group=process_group, rank_local=rank_local,
        writers_per_node=more.writers_per_node, data_dirs=more.data_dirs,
        check_replicas=more.check_replicas, allow_pickle=allow_pickle, base=base,
        compression=more.compression, content_hash=more.content_hash, format=format)
    if request.format == "torch":
        return _save_torch(state_dict, os.path.abspath(os.fspath(path)), request)
    if request.data_parallel:
        return save_parallel(state_dict, path, request)
    t0 = time.perf_counter()
    base_path = request.base_of(path)
    with stage("flatten"):
        flat = (state_dict if isinstance(state_dict, Flattened)
                else flatten(state_dict, request.allow_pickle))
    if request.plain:
        return _save_plain(flat, path, request, t0)
    return _save_units(flat, path, request, base_path, t0)


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

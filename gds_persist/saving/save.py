"""``save``: flatten -> plan -> write -> seal -> commit, on one process; with a process group (or
rank-local parts, or data directories) the data-parallel save of :mod:`.parallel_save`."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch

from .. import settings
from .._version import __version__
from ..backends import choose_backend
from ..errors import DiskFullError
from ..format import Extent, Manifest, align_up, codec, data_file_name, dump_manifest, storage_keys
from ..format.layout import SavePlan, file_streams, plan_single_writer
from ..progress import ByteCounter, ProgressCallback
from ..results import SaveInfo
from ..stages import stage
from ..state.flatten import Flattened, flatten
from ..transfer.commit import (
    Temporary,
    abort,
    check_replaceable,
    commit,
    make_temporary,
    write_manifest,
)
from ..transfer.pipeline import byte_view
from ..transfer.writer import write_plan
from .compression import choose as choose_compression
from .data_parallel import save_parallel
from .incremental import References, check_base_path, describe_references, open_base
from .units import check_written, cut_units, manifest_files, spread, typesizes, write_units


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
    ``flatten`` returns): it is written as is, all of it replicated. The Checkpointer flattens
    each state dict once, when its ``save`` is called, and its snapshots are Flattened records
    over host copies.

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

    Raises TypeError (naming the key path) for objects a checkpoint cannot hold,
    :class:`DiskFullError` when the filesystem is too small, :class:`BackendError` for an unusable
    backend, :class:`CheckpointTimeout` when another process's commit of ``path`` hangs,
    :class:`DistributedError` (on every rank, naming the failed rank) when a rank fails.
    """
    if process_group is not None or rank_local is not None or data_dirs is not None:
        if allow_pickle:
            raise ValueError("allow_pickle=True is for single-process saves; it cannot be "
                             "combined with process_group, rank_local or data_dirs")
        return save_parallel(
            state_dict,
            path,
            process_group=process_group,
            rank_local=rank_local,
            writers_per_node=writers_per_node,
            data_dirs=data_dirs,
            check_replicas=check_replicas,
            backend=backend,
            block_bytes=block_bytes,
            staging_bytes=staging_bytes,
            io_threads=io_threads,
            progress=progress,
            base=base,
            compression=compression,
            content_hash=content_hash,
        )
    t0 = time.perf_counter()
    cfg = settings.current(
        backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
        io_threads=io_threads, compression=compression,
    )
    if base is not None:
        check_base_path(os.fspath(path), os.fspath(base))
    with stage("flatten"):
        flat = (state_dict if isinstance(state_dict, Flattened)
                else flatten(state_dict, allow_pickle))
    hashes = content_hash if content_hash is not None else base is not None
    if base is None and not hashes and cfg.compression == "none":
        return _save_single(flat, os.fspath(path), cfg, progress, t0)
    return _save_units(flat, os.fspath(path), cfg, progress, t0,
                       os.fspath(base) if base is not None else None, hashes)


def _save_single(
    flat: Flattened,
    path: str,
    cfg: settings.Settings,
    progress: ProgressCallback | None,
    t0: float,
) -> SaveInfo:
    with stage("plan + temporary directory"):
        sizes = [s.nbytes for s in flat.storages]
        streams = file_streams(sum(sizes), cfg.io_threads, cfg.block_bytes, cfg.file_streams)
        plan = plan_single_writer(sizes, streams)
        check_replaceable(path)
        tmp = make_temporary(path, cfg.io_timeout_s)
    with _aborted_on_error(tmp, path, f"this checkpoint needs {plan.total_bytes} bytes of data; "):
        with stage("choose backend"):
            be, reason = choose_backend(
                cfg.backend,
                tmp.dir,
                any(s.is_cuda for s in flat.storage_objects),
                cfg.io_threads,
                cfg.block_bytes,
            )
        return _write_plain(tmp, plan, flat, be, reason, cfg, progress, t0)


def _write_plain(tmp: Temporary, plan: SavePlan, flat: Flattened, be: Any, reason: str,
                 cfg: settings.Settings, progress: ProgressCallback | None, t0: float,
                 compression: dict[str, Any] | None = None) -> SaveInfo:
    """Write and commit a plain (version 1-3) checkpoint: raw bytes, no base, no hashes."""
    counter = ByteCounter(progress, plan.total_bytes)
    extents = write_plan(be, tmp.dir, plan.files, flat.storage_objects, cfg, counter.hook)
    writer = _writer_info(be, _with_fallback(be, reason))
    if compression is not None:
        writer["compression"] = compression
    with stage("commit (manifest, fsync, rename)"):
        _commit_single(tmp, plan, flat, extents, writer, cfg.io_timeout_s)
    counter.finish()
    return SaveInfo(tmp.path, be.name, writer["reason"], plan.total_bytes,
                    sum(s.nbytes for s in flat.storages), time.perf_counter() - t0,
                    len(flat.tensors), len(flat.storages), [f.name for f in plan.files],
                    compression_reason=compression["reason"] if compression else "")


def _save_units(flat: Flattened, path: str, cfg: settings.Settings,
                progress: ProgressCallback | None, t0: float, base: str | None,
                hashes: bool) -> SaveInfo:
    """A version-4 save: units hashed, referred to or written (maybe encoded) as they come.
    Where ``compression="auto"`` chose raw bytes and there is neither a base nor hashes to
    record, the plain save instead (version 1-3, the same bytes as ``compression="none"``)."""
    with stage("plan + temporary directory"):
        sizes = [s.nbytes for s in flat.storages]
        units = cut_units([(i, 0, n) for i, n in enumerate(sizes) if n],
                          typesizes(flat.tensors, len(sizes)))
        streams = file_streams(sum(sizes), cfg.io_threads, cfg.block_bytes, cfg.file_streams)
        names = [data_file_name(k) for k in range(streams)]
        check_replaceable(path)
        tmp = make_temporary(path, cfg.io_timeout_s)
    index = None
    try:
        with _aborted_on_error(tmp, path, ""):
            if base is not None:
                with stage("open the base"):
                    index = open_base(path, base)
            with stage("choose backend"):
                be, reason = choose_backend(cfg.backend, tmp.dir,
                                            any(s.is_cuda for s in flat.storage_objects),
                                            cfg.io_threads, cfg.block_bytes)
            sources = [byte_view(s) for s in flat.storage_objects]
            with stage("choose compression"):
                compress, compression_reason = choose_compression(cfg.compression, be, tmp.dir,
                                                                  units, sources, cfg)
            compression_info = {"mode": cfg.compression, "applied": compress,
                                "codec": codec.DESCRIPTION if compress else "none",
                                "reason": compression_reason}
            if not compress and not hashes and index is None:  # auto chose raw: a plain save
                return _write_plain(tmp, plan_single_writer(sizes, streams), flat, be, reason,
                                    cfg, progress, t0, compression_info)
            refs = References(index, storage_keys(flat.tree, flat.tensors), units)
            files = spread(units, streams, refs.likely_changed)
            counter = ByteCounter(progress, sum(align_up(u.length) for u in units))
            written = write_units(be, tmp.dir, names, files, units, flat.storage_objects, cfg,
                                  compress=compress, hashes=hashes or index is not None,
                                  refs=refs, progress=counter.hook)
            check_written(units, written)
            reason = _with_fallback(be, reason)
            if index is not None and index.note:  # e.g. a base without content hashes
                reason = f"{reason}; {index.note}"
            data_files, bases, extents, kept = manifest_files(
                names, written.sizes, written.extents, written.referred, tmp.dir)
            writer = _writer_info(be, reason)
            writer["compression"] = compression_info
            incremental = describe_references(refs)
            if incremental:
                writer["incremental"] = incremental
            with stage("commit (manifest, fsync, rename)"):
                manifest = Manifest(data_files, flat.storages, flat.tensors, extents, flat.tree,
                                    writer, bases=bases)
                if index is not None:
                    index.check_unchanged()
                write_manifest(tmp.dir, dump_manifest(manifest))
                commit(tmp, cfg.io_timeout_s)
            counter.finish()
    finally:
        if index is not None:
            index.close()
    payload = sum(s.nbytes for s in flat.storages)
    return SaveInfo(
        path, be.name, reason, sum(written.sizes), payload, time.perf_counter() - t0,
        len(flat.tensors), len(flat.storages), kept,
        referenced_bytes=refs.referred_bytes(),
        compression="lossless" if compress else "none",
        compression_reason=compression_reason,
        base=os.path.basename(base) if base is not None else None,
    )


@contextlib.contextmanager
def _aborted_on_error(tmp: Temporary, path: str, needs: str) -> Iterator[None]:
    """Remove the temporary directory if the body fails; a full disk becomes DiskFullError."""
    try:
        yield
    except OSError as e:
        abort(tmp)
        if e.errno == errno.ENOSPC:
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on the filesystem of {path}: {needs}free space or save "
                "elsewhere (the partial save was removed and earlier checkpoints are untouched)",
            ) from e
        raise
    except BaseException:
        abort(tmp)
        raise


def _with_fallback(be: Any, reason: str) -> str:
    if getattr(be, "fallback_reason", None):  # kvikio switched to POSIX I/O mid-save
        return f"{reason}; {be.fallback_reason}"
    return reason


def _writer_info(be: Any, reason: str) -> dict[str, Any]:
    return {"backend": be.name, "reason": reason, "gds_persist": __version__,
            "torch": torch.__version__, "host": socket.gethostname(), "world_size": 1}


def _commit_single(tmp: Temporary, plan: SavePlan, flat: Flattened, extents: list[Extent],
                   writer: dict[str, Any], timeout_s: float) -> None:
    """Seal the written files with the manifest and swap the temporary directory into place."""
    files = [f.data_file for f in plan.files]
    manifest = Manifest(files, flat.storages, flat.tensors, extents, flat.tree, writer)
    write_manifest(tmp.dir, dump_manifest(manifest))
    commit(tmp, timeout_s)

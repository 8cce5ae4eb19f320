"""Data-parallel save: every rank writes its planned share of the replicated state (and its own
rank-local state); rank 0 writes the manifest and commits. See ``docs/DISTRIBUTED.md``.

Phases, each closed by :meth:`Comm.agree`, so a failure on any rank is known to every rank, which
all raise an error naming it; no rank waits longer than ``collective_timeout_s``:

1. ``prepare``: split off rank-local parts (:mod:`gds_persist.state.rank_local`), flatten,
   describe the replicated structure, probe the node and GPU affinity; rank 0 creates the
   temporary checkpoint directory.
2. ``check``: only when the replicated structure differs between ranks - find and report where
   (:mod:`gds_persist.parallel.replicas`).
3. ``write``: plan (deterministically, identically on every rank), then write and fsync this rank's
   files into the temporary directory or its data directory; report extents and checksums.
4. ``commit``: rank 0 assembles, validates and writes the manifest, then commits atomically (the
   core's :mod:`gds_persist.transfer.commit`); every rank returns only once that is durable.
5. ``cleanup``: while rank 0 still holds the path's commit lock, one rank per node removes this
   path's data directories of saves whose owners are gone (replaced or interrupted saves), and
   every rank releases its own directory's lock.

Several saves of one path may run at once (the last to commit wins). Each rank holds a shared
``flock`` on its data directory's ``.lock`` file (created right after the directory) until the
save ended, so no other save's cleanup removes a live save's data directory (one without a lock
file yet is new: a directory without one is removed only once untouched for an hour). The
cleanup runs under the commit lock, so a directory whose lock is free belongs to a save that
committed before this one (replaced now) or never will; the committed checkpoint's own
directory is never removed.

Nothing is committed unless every rank's files are durable; the previous checkpoint at the path
stays intact on any failure.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch

from .. import settings
from .._version import __version__
from ..backends import choose_backend
from ..errors import DistributedError
from ..format import (
    STRIPE_MARK,
    DataDir,
    DataFile,
    Extent,
    Manifest,
    Section,
    StorageRecord,
    TensorRecord,
    dump_manifest,
    local_prefix,
    parse_manifest,
    storage_keys,
    stripe_dir_name,
)
from ..format import tree as _tree
from ..parallel.distributed import Comm, make_comm
from ..parallel.replicas import CHECK_REPLICAS, description_of
from ..parallel.replicas import check_replicas as check_replication
from ..parallel.schedule import DistributedPlan, RankInfo, plan_save
from ..parallel.topology import gpu_affinity, node_name
from ..progress import ByteCounter, ProgressCallback
from ..results import DistributedSaveInfo
from ..state.flatten import Flattened, flatten
from ..state.rank_local import KeyPath, normalize_paths, split_rank_local
from ..transfer.commit import (
    Temporary,
    abort,
    check_replaceable,
    fsync_path,
    make_temporary,
    remove_tree,
    write_manifest,
)
from ..transfer.locks import STALE_UNLOCKED_S, FileLock, acquire, try_acquire, untouched_for
from ..transfer.pipeline import byte_view
from ..transfer.unit_writer import Unit
from ..transfer.writer import write_plan
from .compression import choose as choose_compression
from .incremental import (
    Candidate,
    Holder,
    References,
    assemble_references,
    check_base_path,
    open_base,
)
from .units import check_written, cut_units, typesizes, write_units

STRIPE_LOCK = ".lock"  # in each data directory: held (shared) by the ranks writing into it


# --- the save ---------------------------------------------------------------------------------

@dataclass
class _Prepared:
    replicated: Flattened
    local: Flattened
    description: dict[str, Any]
    digest: str


def _prepare(state_dict: Any, paths: Sequence[KeyPath], check: str) -> _Prepared:
    if isinstance(state_dict, Flattened):  # flattened by the caller: all of it replicated
        if paths:
            raise ValueError("rank_local needs the state dict itself, not a flattened one")
        replicated, local = state_dict, flatten([])
    else:
        replicated, local = split_rank_local(state_dict, paths)
    return _Prepared(replicated, local, *description_of(replicated, check))


def _stripe_prefix(path: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path))[:100].lstrip(".-") or "ckpt"
    return f"{base}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def _extent_json(e: Extent) -> list[int]:
    return [e.storage, e.start, e.length, e.file, e.offset, e.crc32c]


def save_parallel(state_dict: Any, path: str | os.PathLike[str], *, process_group: Any = None,
                  rank_local: Any = None, writers_per_node: int | None = None,
                  data_dirs: Sequence[str | os.PathLike[str]] | None = None,
                  check_replicas: str = "structure", backend: str | None = None,
                  block_bytes: int | None = None, staging_bytes: int | None = None,
                  io_threads: int | None = None,
                  progress: ProgressCallback | None = None,
                  base: str | os.PathLike[str] | None = None, compression: str | None = None,
                  content_hash: bool | None = None) -> DistributedSaveInfo:
    """See :func:`gds_persist.save` (the data-parallel arguments). With ``base`` each rank
    refers to the base's bytes for the units of its own share; ``compression`` is decided by each
    rank for its own files."""
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    cfg = settings.current(backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
                           io_threads=io_threads, compression=compression)
    if base is not None:
        base = check_base_path(path, os.fspath(base))
    hashes = content_hash if content_hash is not None else base is not None
    units_mode = base is not None or hashes or cfg.compression != "none"
    if check_replicas not in CHECK_REPLICAS:
        raise ValueError(f"check_replicas={check_replicas!r}; valid: {', '.join(CHECK_REPLICAS)}")
    paths = normalize_paths(rank_local)
    roots = [os.path.abspath(os.fspath(d)) for d in (data_dirs or [])]
    if len(set(roots)) != len(roots):
        raise ValueError(f"data_dirs lists a directory twice: {roots}")
    comm = make_comm(process_group, cfg.collective_timeout_s)
    what = f"gds_persist save of {path} (rank {comm.rank} of {comm.size})"
    intact = f"; nothing was committed and any previous checkpoint at {path} is intact"
    phases: dict[str, float] = {}
    state: dict[str, Any] = {"tmp": None, "written": [], "dirs": [], "stripe_locks": []}
    committed = False

    def clock(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = now - since
        return now

    try:
        # 1. prepare --------------------------------------------------------------------------
        def prepare() -> dict[str, Any]:
            state["prep"] = _prepare(state_dict, paths, check_replicas)
            affinity, why = gpu_affinity()
            info: dict[str, Any] = {
                "digest": state["prep"].digest, "node": node_name(), "affinity": affinity,
                "affinity_why": why, "host": socket.gethostname(),
                "local_sizes": [s.nbytes for s in state["prep"].local.storages],
            }
            if comm.rank == 0:
                check_replaceable(path)
                state["tmp"] = make_temporary(path, cfg.io_timeout_s)
                info.update(tmp=state["tmp"].dir, save_id=uuid.uuid4().hex[:12])
            return info

        t = time.perf_counter()
        infos = comm.agree("prepare", prepare, what, intact)
        t = clock("prepare", t)
        prep: _Prepared = state["prep"]
        tmp, save_id = infos[0]["tmp"], infos[0]["save_id"]

        # 2. check replication ------------------------------------------------------------------
        check_replication(comm, prep.description, [i["digest"] for i in infos], what, intact)
        t = clock("check", t)

        # 3. plan and write ---------------------------------------------------------------------
        ranks = [RankInfo(r, i["node"], i["affinity"], tuple(i["local_sizes"]))
                 for r, i in enumerate(infos)]
        plan = plan_save([s.nbytes for s in prep.replicated.storages], ranks,
                         writers_per_node=writers_per_node, data_dirs=len(roots))
        stripe = stripe_dir_name(_stripe_prefix(path), save_id)

        def write() -> dict[str, Any]:
            counter = ByteCounter(progress, sum(plan.files[i].plan.size
                                                for i in plan.files_of(comm.rank)))
            if units_mode:
                result = _write_my_units(plan, comm.rank, prep, tmp, roots, stripe, cfg, state,
                                         path, base, hashes, counter.hook)
            else:
                result = _write_my_files(plan, comm.rank, prep, tmp, roots, stripe, cfg, state,
                                         counter.hook)
            counter.finish()
            return result

        results = comm.agree("write", write, what, intact)
        t = clock("write", t)
        if len({r["plan"] for r in results}) != 1:
            raise DistributedError(f"{what}: ranks computed different plans (different gds_persist "
                                   f"versions on different ranks?){intact}", phase="write")

        # 4. commit ------------------------------------------------------------------------------
        state["committing"] = True  # from here a failure may come after the rename: keep files

        def commit_step() -> bool:
            if comm.rank != 0:
                return True
            manifest = _assemble(plan, prep, results, infos, roots, stripe, save_id, comm.size)
            raw = dump_manifest(manifest)
            parse_manifest(raw, f"the manifest being written for {path}")  # never commit garbage
            write_manifest(tmp, raw)
            state["tmp"].swap_in(cfg.io_timeout_s)  # holds the commit lock until finish()
            return True

        comm.agree("commit", commit_step, what,
                   f"; rank 0 could not commit, so any previous checkpoint at {path} is intact")
        committed = True
        clock("commit", t)
        if roots:
            leader = comm.rank in {members[0] for members in plan.nodes}

            def cleanup() -> None:
                if leader:
                    _remove_stale_stripes(roots, _stripe_prefix(path), stripe)
                _release(state, False)  # before rank 0 releases the commit lock: so the next
                # commit's cleanup finds this (now replaceable) directory unlocked

            try:  # best effort: the checkpoint is committed whatever happens here
                comm.agree("cleanup", cleanup, what)
            except DistributedError:
                pass
    except BaseException:
        if not committed:
            _cleanup(state, comm.rank == 0)
        raise
    finally:
        _release(state, committed)

    return _save_info(path, t0, comm, plan, state["prep"], results, infos, phases, base)


def _save_info(path: str, t0: float, comm: Comm, plan: DistributedPlan, prep: _Prepared,
               results: list[dict[str, Any]], infos: list[dict[str, Any]],
               phases: dict[str, float], base: str | None) -> DistributedSaveInfo:
    """What one rank's :func:`save_parallel` returns: its own share and the totals."""
    mine = [plan.files[i].plan for i in plan.files_of(comm.rank)]
    mine_sizes = results[comm.rank].get("sizes")
    rank_bytes = (sum(mine_sizes.values()) if mine_sizes is not None
                  else sum(f.size for f in mine))
    written_total = (sum(sum(r["sizes"].values()) for r in results) if mine_sizes is not None
                     else plan.total_bytes)
    placement = plan.placement + "; " + infos[comm.rank]["affinity_why"]
    payload = (sum(s.nbytes for s in prep.replicated.storages)
               + sum(sum(i["local_sizes"]) for i in infos))
    return DistributedSaveInfo(
        path=path, backend=results[comm.rank]["backend"], reason=results[comm.rank]["reason"],
        bytes_written=written_total, payload_bytes=payload,
        seconds=time.perf_counter() - t0,
        tensors=len(prep.replicated.tensors) + sum(r["n_tensors"] for r in results),
        storages=len(prep.replicated.storages) + sum(len(i["local_sizes"]) for i in infos),
        files=[f.plan.name for f in plan.files],
        rank=comm.rank, world_size=comm.size, writers=list(plan.writers),
        rank_bytes=rank_bytes, rank_files=[f.name for f in mine],
        rank_write_seconds=results[comm.rank]["seconds"], writer_balance=plan.writer_balance,
        node_balance=plan.node_balance, nodes=len(plan.nodes), placement=placement, phases=phases,
        referenced_bytes=sum(r.get("referred_bytes", 0) for r in results),
        compression=results[comm.rank].get("compression", "none"),
        compression_reason=results[comm.rank].get("compression_reason", ""),
        base=os.path.basename(base) if base is not None else None,
    )


def _enter_directory(d: int, tmp: str, roots: Sequence[str], stripe: str,
                     state: dict[str, Any], cfg: settings.Settings) -> str:
    """Where this rank writes the files of plan directory ``d`` (-1: the temporary checkpoint
    directory); a data directory is created once and held (shared lock) until the save ends."""
    directory = tmp if d < 0 else os.path.join(roots[d], stripe)
    if d >= 0 and directory not in state["dirs"]:
        os.makedirs(directory, exist_ok=True)
        state["dirs"].append(directory)
        state["stripe_locks"].append(acquire(
            os.path.join(directory, STRIPE_LOCK), shared=True, timeout_s=cfg.io_timeout_s,
            what=f"saving into {directory}"))
    return directory


def _write_my_files(plan: DistributedPlan, rank: int, prep: _Prepared, tmp: str,
                    roots: Sequence[str], stripe: str, cfg: settings.Settings,
                    state: dict[str, Any],
                    hook: Callable[[int], None] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    replicated = len(prep.replicated.storages)
    base = plan.local_storage_base[rank]
    objects = prep.replicated.storage_objects + prep.local.storage_objects

    def compact(g: int) -> int:  # global storage index -> index into ``objects``
        return g if g < replicated else replicated + g - base

    by_dir: dict[int, list] = {}
    for i in plan.files_of(rank):
        by_dir.setdefault(plan.files[i].dir, []).append(plan.files[i].plan)
    sealed: list[Extent] = []
    backend_name, reason = "none", "this rank had nothing to write"
    wants_device = any(s.is_cuda for s in objects)
    for d, files in sorted(by_dir.items()):
        directory = _enter_directory(d, tmp, roots, stripe, state, cfg)
        local_files = [
            replace(f, extents=tuple(replace(e, storage=compact(e.storage)) for e in f.extents))
            for f in files]
        be, reason = choose_backend(cfg.backend, directory, wants_device, cfg.io_threads,
                                    cfg.block_bytes)
        backend_name = be.name
        state["written"] += [os.path.join(directory, f.name) for f in files]
        for e in write_plan(be, directory, local_files, objects, cfg, hook):
            g = e.storage if e.storage < replicated else base + e.storage - replicated
            sealed.append(replace(e, storage=g))
        if d >= 0:  # new directory entries must be durable before the commit
            for entry in (directory, roots[d], os.path.dirname(roots[d])):
                fsync_path(entry)
    local = prep.local
    return {
        "extents": [_extent_json(e) for e in sealed],
        "backend": backend_name, "reason": reason, "plan": plan.digest(),
        "seconds": time.perf_counter() - t0,
        "n_tensors": len(local.tensors),
        "local": {"tree": local.tree, "tensors": [list(astuple(t)) for t in local.tensors],
                  "storages": [[s.nbytes, s.device] for s in local.storages]},
    }


def _assemble(plan: DistributedPlan, prep: _Prepared, results: list[dict[str, Any]],
              infos: list[dict[str, Any]], roots: Sequence[str], stripe: str, save_id: str,
              world: int) -> Manifest:
    used = sorted({f.dir for f in plan.files if f.dir >= 0})
    dir_index = {d: k + 1 for k, d in enumerate(used)}
    sizes = {int(i): size for r in results for i, size in (r.get("sizes") or {}).items()}
    files = [DataFile(f.plan.name, sizes.get(i, f.plan.size), dir_index.get(f.dir, 0))
             for i, f in enumerate(plan.files)]
    dirs = [DataDir(roots[d], stripe) for d in used]
    storages = list(prep.replicated.storages)
    tensors = list(prep.replicated.tensors)
    sections = []
    has_local = _tree.has_locals(prep.replicated.tree)
    for rank, result in enumerate(results):
        local = result["local"]
        assert len(storages) == plan.local_storage_base[rank]
        t_base, s_base = len(tensors), len(storages)
        storages += [StorageRecord(n, dev) for n, dev in local["storages"]]
        for rec in local["tensors"]:
            storage, dtype, shape, stride, offset, grad, param = rec
            tensors.append(TensorRecord(storage + s_base, dtype, tuple(shape), tuple(stride),
                                        offset, grad, param))
        if has_local:
            sections.append(Section(rank, _tree.shift_tensors(local["tree"], t_base)))
    extents = sorted((Extent(*e) for r in results for e in r["extents"]),
                     key=lambda e: (e.file, e.offset))
    referred = [(storage, _candidate(c)) for r in results for storage, c in r.get("referred", [])]
    ref_files, bases, ref_extents = assemble_references(referred, len(files))
    files += ref_files
    extents += ref_extents
    hosts = sorted({i["host"] for i in infos})
    writer = {
        "backend": ",".join(sorted({r["backend"] for r in results if r["backend"] != "none"})),
        "reason": results[0]["reason"], "gds_persist": __version__, "torch": torch.__version__,
        "host": hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts", "world_size": world,
        "save_id": save_id, "plan": plan.summary(),
    }
    if "compression" in results[0]:
        writer["compression"] = {"mode": results[0]["compression_mode"],
                                 "applied": [r["compression"] for r in results],
                                 "reason": results[0]["compression_reason"]}
    if bases or any(r.get("base") for r in results):
        writer["incremental"] = {"base": results[0].get("base"),
                                 "referred_bytes": sum(r["referred_bytes"] for r in results)}
    return Manifest(files, storages, tensors, extents, prep.replicated.tree, writer,
                    dirs=dirs, sections=sections, bases=bases)


def _candidate(c: dict[str, Any]) -> Candidate:
    return Candidate(c["blake3"], Extent(*c["extent"]), Holder(c["holder"], c["sha256"]),
                     c["file"], c["size"])


def _extent_full(e: Extent) -> list[Any]:
    return [e.storage, e.start, e.length, e.file, e.offset, e.crc32c, e.codec, e.stored,
            e.stored_crc32c, e.blake3]


def _write_my_units(plan: DistributedPlan, rank: int, prep: _Prepared, tmp: str,
                    roots: Sequence[str], stripe: str, cfg: settings.Settings,
                    state: dict[str, Any], path: str, base: str | None, hashes: bool,
                    hook: Callable[[int], None] | None = None) -> dict[str, Any]:
    """:func:`_write_my_files` for a version-4 save: this rank's share cut into units, each
    hashed and referred to (``base``) or written, maybe encoded, into its planned files."""
    t0 = time.perf_counter()
    replicated = len(prep.replicated.storages)
    base_index = plan.local_storage_base[rank]
    objects = prep.replicated.storage_objects + prep.local.storage_objects
    records = list(prep.replicated.tensors) + [
        replace(t, storage=t.storage + replicated) for t in prep.local.tensors]
    sizes_of = typesizes(records, len(objects))
    keys = storage_keys(prep.replicated.tree, prep.replicated.tensors)
    keys.update({s + replicated: k for s, k in storage_keys(
        prep.local.tree, prep.local.tensors, local_prefix(rank)).items()})

    def compact(g: int) -> int:  # global storage index -> index into ``objects``
        return g if g < replicated else replicated + g - base_index

    def globalise(c: int) -> int:
        return c if c < replicated else base_index + c - replicated

    by_dir: dict[int, list[int]] = {}
    for i in plan.files_of(rank):
        by_dir.setdefault(plan.files[i].dir, []).append(i)
    index = open_base(path, base) if base is not None else None
    sealed: list[Extent] = []
    referred: list[list[Any]] = []
    sizes: dict[int, int] = {}
    referred_bytes = 0
    backend_name, reason = "none", "this rank had nothing to write"
    compress, compression_reason = False, "this rank had nothing to write"
    wants_device = any(s.is_cuda for s in objects)
    sources = [byte_view(s) for s in objects]
    try:
        for d, file_indices in sorted(by_dir.items()):
            directory = _enter_directory(d, tmp, roots, stripe, state, cfg)
            units: list[Unit] = []
            files: list[list[int]] = []
            for i in file_indices:
                pieces = [(compact(e.storage), e.start, e.length)
                          for e in plan.files[i].plan.extents]
                first = len(units)
                units += cut_units(pieces, sizes_of)
                files.append(list(range(first, len(units))))
            be, reason = choose_backend(cfg.backend, directory, wants_device, cfg.io_threads,
                                        cfg.block_bytes)
            backend_name = be.name
            compress, compression_reason = choose_compression(cfg.compression, be, directory,
                                                              units, sources, cfg)
            names = [plan.files[i].plan.name for i in file_indices]
            state["written"] += [os.path.join(directory, n) for n in names]
            # only what lives in the checkpoint directory may be referred to later
            refs = References(index if d < 0 else None, keys, units)
            files = [sorted(f, key=lambda k: not refs.likely_changed(k)) for f in files]
            w = write_units(be, directory, names, files, units, objects, cfg, compress=compress,
                            hashes=hashes, refs=refs, progress=hook)
            check_written(units, w)
            for local_file, size in enumerate(w.sizes):
                sizes[file_indices[local_file]] = size
            for e in w.extents:
                sealed.append(replace(e, storage=globalise(e.storage),
                                      file=file_indices[e.file]))
            for storage, c in w.referred:
                referred.append([globalise(storage), {
                    "blake3": c.blake3, "extent": _extent_full(c.extent), "holder": c.holder.name,
                    "sha256": c.holder.manifest_sha256, "file": c.file_name,
                    "size": c.file_size}])
            referred_bytes += refs.referred_bytes()
            if d >= 0:  # new directory entries must be durable before the commit
                for entry in (directory, roots[d], os.path.dirname(roots[d])):
                    fsync_path(entry)
        if index is not None:
            index.check_unchanged()
    finally:
        if index is not None:
            index.close()
    local = prep.local
    return {
        "extents": [_extent_full(e) for e in sealed],
        "sizes": {str(i): size for i, size in sizes.items()},
        "referred": referred, "referred_bytes": referred_bytes,
        "base": os.path.basename(base) if base is not None else None,
        "compression": "lossless" if compress else "none",
        "compression_mode": cfg.compression, "compression_reason": compression_reason,
        "backend": backend_name, "reason": reason, "plan": plan.digest(),
        "seconds": time.perf_counter() - t0,
        "n_tensors": len(local.tensors),
        "local": {"tree": local.tree, "tensors": [list(astuple(t)) for t in local.tensors],
                  "storages": [[s.nbytes, s.device] for s in local.storages]},
    }


def _release(state: dict[str, Any], committed: bool) -> None:
    """At the end of a save, failed or not: every rank releases its data directory locks, then
    rank 0 releases the commit lock and removes the replaced checkpoint."""
    locks: list[FileLock] = state["stripe_locks"]
    while locks:
        locks.pop().release()
    tmp: Temporary | None = state["tmp"]
    if committed and tmp is not None:
        tmp.finish()


def _cleanup(state: dict[str, Any], is_root: bool) -> None:
    """After a failed save: remove what this rank wrote (rank 0: the temporary directory).

    Once the commit phase began, a failure may have come after the rename (or this rank cannot
    know), so files in data directories are left alone; a later save removes them if they are
    not part of the checkpoint.
    """
    if is_root and state["tmp"]:
        abort(state["tmp"])  # never holds the new checkpoint once it was renamed into place
    if state.get("committing"):
        return
    for f in state["written"]:
        try:
            os.unlink(f)
        except OSError:
            pass
    locks: list[FileLock] = state["stripe_locks"]
    while locks:
        locks.pop().release(remove=True)  # the last holder of the directory deletes the lock
    for d in state["dirs"]:
        try:
            os.rmdir(d)  # succeeds for whichever rank of the directory cleans up last
        except OSError:
            pass


def _remove_stale_stripes(roots: Sequence[str], prefix: str, keep: str) -> list[str]:
    """After a commit, under its commit lock: remove this path's data directories other than
    ``keep`` whose lock is free (their save ended: replaced by this commit, or interrupted).
    A directory without a lock file (an older gds_persist's) goes once untouched for
    ``STALE_UNLOCKED_S``. Best effort; returns what was removed."""
    removed = []
    for root in roots:
        try:
            entries = os.listdir(root)
        except OSError:
            continue
        for entry in entries:
            full = os.path.join(root, entry)
            if not entry.startswith(prefix + STRIPE_MARK) or entry == keep:
                continue
            lock = try_acquire(os.path.join(full, STRIPE_LOCK))
            if lock is not None:  # its save ended; the lock file goes with the directory
                try:
                    if remove_tree(full):
                        removed.append(entry)
                finally:
                    lock.release()
            elif (not os.path.lexists(os.path.join(full, STRIPE_LOCK))
                  and untouched_for(full, STALE_UNLOCKED_S) and remove_tree(full)):
                removed.append(entry)
    return removed

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
   files into the temporary directory or its data directory (:mod:`.stripes`); report extents and
   checksums.
4. ``commit``: rank 0 assembles, validates and writes the manifest, then commits atomically (the
   core's :mod:`gds_persist.transfer.commit`); every rank returns only once that is durable.
5. ``cleanup``: while rank 0 still holds the path's commit lock, one rank per node removes this
   path's data directories of saves whose owners are gone (replaced or interrupted saves), and
   every rank releases its own directory's lock.

Several saves of one path may run at once (the last to commit wins); :mod:`.stripes` says how
their data directories stay apart. Nothing is committed unless every rank's files are durable;
the previous checkpoint at the path stays intact on any failure.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Any

from .. import settings
from ..errors import DistributedError
from ..format import (
    DataDir,
    DataFile,
    Extent,
    Manifest,
    Section,
    StorageRecord,
    TensorRecord,
    local_prefix,
    storage_keys,
    stripe_dir_name,
)
from ..format import tree as _tree
from ..parallel.distributed import Comm, make_comm
from ..parallel.replicas import check_replicas, description_of
from ..parallel.schedule import DistributedPlan, RankInfo, plan_save
from ..parallel.topology import gpu_affinity, node_name
from ..progress import ByteCounter
from ..results import DistributedSaveInfo
from ..state.flatten import Flattened, flatten
from ..state.rank_local import KeyPath, Split, split_rank_local
from ..transfer.commit import Temporary, abort, begin, seal, writer_record
from ..transfer.unit_writer import Unit
from ..transfer.writer import write_plan
from .as_saved import refuse_torn
from .incremental import Candidate, Holder, assemble_references, open_base
from .options import SaveRequest
from .stripes import RankFiles, remove_stale_stripes, stripe_prefix
from .units import backend_for, choose, cut_units, typesizes, write_directory

Report = dict[str, Any]  # what one rank tells the others after a phase (JSON)


@dataclass
class _Prepared:
    replicated: Flattened
    local: Flattened
    description: dict[str, Any]
    digest: str


def _prepare(state_dict: Any, paths: Sequence[KeyPath], check: str) -> _Prepared:
    if isinstance(state_dict, (Flattened, Split)):  # flattened by the caller (a Checkpointer)
        if paths:
            raise ValueError("rank_local needs the state dict itself, not a flattened one")
        replicated, local = ((state_dict.replicated, state_dict.local)
                             if isinstance(state_dict, Split) else (state_dict, flatten([])))
    else:
        replicated, local = split_rank_local(state_dict, paths)
    return _Prepared(replicated, local, *description_of(replicated, check))


def save_parallel(state_dict: Any, path: str | os.PathLike[str],
                  options: SaveRequest) -> DistributedSaveInfo:
    """See :func:`gds_persist.save` (the data-parallel arguments). With ``base`` each rank
    refers to the base's bytes for the units of its own share; ``compression`` is decided by each
    rank for its own files."""
    return _Save(os.path.abspath(os.fspath(path)), options).run(state_dict)


class _Save:
    """This rank's part in one data-parallel save of ``path``, phase by phase, and what it holds
    until the save ends: rank 0's temporary directory, this rank's files and data directories."""

    def __init__(self, path: str, options: SaveRequest):
        self.t0 = time.perf_counter()
        self.path, self.options, self.cfg = path, options, options.cfg
        self.base = options.base_of(path)
        self.comm = make_comm(options.process_group, self.cfg.collective_timeout_s)
        self.what = f"gds_persist save of {path} (rank {self.comm.rank} of {self.comm.size})"
        self.intact = f"; nothing was committed and any previous checkpoint at {path} is intact"
        self.files = RankFiles(options.roots(), self.cfg.io_timeout_s)
        self.tmp: Temporary | None = None  # rank 0's temporary checkpoint directory
        self.committing = False  # from then on a failure may come after the rename
        self.phases: dict[str, float] = {}
        self._clock = self.t0

    def run(self, state_dict: Any) -> DistributedSaveInfo:
        committed = False
        try:
            prep, infos = self.prepare(state_dict)
            self.tick("prepare")
            check_replicas(self.comm, prep.description, [i["digest"] for i in infos], self.what,
                           self.intact)  # 2. check (only where the digests differ)
            self.tick("check")
            plan, stripe, results = self.write(prep, infos)
            self.tick("write")
            self.commit(plan, prep, results, infos, stripe)
            committed = True
            self.tick("commit")
            if self.files.roots:
                self.cleanup(plan, stripe)
        except BaseException:
            if not committed:
                self.abandon()
            raise
        finally:
            self.release(committed)
        return _save_info(self.path, self.t0, self.comm, plan, prep, results, infos, self.phases,
                          self.base)

    def tick(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self._clock = now - self._clock, now

    # 1. prepare ---------------------------------------------------------------------------------
    def prepare(self, state_dict: Any) -> tuple[_Prepared, list[Report]]:
        prepared: list[_Prepared] = []

        def step() -> Report:
            prep = _prepare(state_dict, self.options.rank_local_paths(),
                            self.options.check_replicas)
            prepared.append(prep)
            affinity, why = gpu_affinity()
            info: Report = {
                "digest": prep.digest, "node": node_name(), "affinity": affinity,
                "affinity_why": why, "host": socket.gethostname(),
                "local_sizes": [s.nbytes for s in prep.local.storages],
                "local_crcs": prep.local.crc_at_save,  # checked by rank 0 before the commit
            }
            if self.comm.rank == 0:
                self.tmp = begin(self.path, self.cfg.io_timeout_s)
                info.update(tmp=self.tmp.dir, save_id=uuid.uuid4().hex[:12])
            return info

        infos = self.comm.agree("prepare", step, self.what, self.intact)
        return prepared[0], infos

    # 3. plan and write --------------------------------------------------------------------------
    def write(self, prep: _Prepared,
              infos: list[Report]) -> tuple[DistributedPlan, str, list[Report]]:
        ranks = [RankInfo(r, i["node"], i["affinity"], tuple(i["local_sizes"]))
                 for r, i in enumerate(infos)]
        plan = plan_save([s.nbytes for s in prep.replicated.storages], ranks,
                         writers_per_node=self.options.writers_per_node,
                         data_dirs=len(self.files.roots))
        tmp = infos[0]["tmp"]
        stripe = stripe_dir_name(stripe_prefix(self.path), infos[0]["save_id"])
        share = _Share(plan, self.comm.rank, prep)
        cfg, options = self.cfg, self.options

        def step() -> Report:
            counter = ByteCounter(options.progress, sum(plan.files[i].plan.size
                                                        for i in plan.files_of(self.comm.rank)))
            if options.plain:
                report = _write_my_files(share, self.files, tmp, stripe, cfg, counter.hook)
            else:
                report = _write_my_units(share, self.files, tmp, stripe, cfg, self.path,
                                         self.base, options.hashes, counter.hook)
            counter.finish()
            return report

        results = self.comm.agree("write", step, self.what, self.intact)
        if len({r["plan"] for r in results}) != 1:
            raise DistributedError(f"{self.what}: ranks computed different plans (different "
                                   f"gds_persist versions on different ranks?){self.intact}",
                                   phase="write")
        return plan, stripe, results

    # 4. commit ----------------------------------------------------------------------------------
    def commit(self, plan: DistributedPlan, prep: _Prepared, results: list[Report],
               infos: list[Report], stripe: str) -> None:
        self.committing = True

        def step() -> bool:
            if self.comm.rank == 0:
                assert self.tmp is not None
                manifest = _assemble(plan, prep, results, infos, self.files.roots, stripe,
                                     infos[0]["save_id"], self.comm.size)
                refuse_torn(prep.replicated, manifest.extents, self.path, infos)
                # the commit lock stays held until release(): cleanup() runs under it
                seal(self.tmp, manifest, self.cfg.io_timeout_s, check=True, keep_lock=True)
            return True

        self.comm.agree("commit", step, self.what, f"; rank 0 could not commit, so any previous "
                        f"checkpoint at {self.path} is intact")

    # 5. cleanup ---------------------------------------------------------------------------------
    def cleanup(self, plan: DistributedPlan, stripe: str) -> None:
        leader = self.comm.rank in {members[0] for members in plan.nodes}

        def step() -> None:
            if leader:
                remove_stale_stripes(self.files.roots, stripe_prefix(self.path), stripe)
            self.files.release()  # before rank 0 releases the commit lock: so the next
            # commit's cleanup finds this (now replaceable) directory unlocked

        try:  # best effort: the checkpoint is committed whatever happens here
            self.comm.agree("cleanup", step, self.what)
        except DistributedError:
            pass

    # the end --------------------------------------------------------------------------------------
    def release(self, committed: bool) -> None:
        """At the end of a save, failed or not: every rank releases its data directory locks,
        then rank 0 releases the commit lock and removes the replaced checkpoint."""
        self.files.release()
        if committed and self.tmp is not None:
            self.tmp.finish()

    def abandon(self) -> None:
        """After a failed save: remove what this rank wrote (rank 0: the temporary directory).

        Once the commit phase began, a failure may have come after the rename (or this rank
        cannot know), so files in data directories are left alone; a later save removes them if
        they are not part of the checkpoint.
        """
        if self.tmp is not None:
            abort(self.tmp)  # never holds the new checkpoint once it was renamed into place
        if not self.committing:
            self.files.remove()


# --- this rank's files ----------------------------------------------------------------------------

class _Share:
    """This rank's share of ``plan``: its files, by directory, and the storages they hold - the
    replicated ones, then this rank's rank-local ones (in the plan those are numbered from
    ``plan.local_storage_base[rank]``)."""

    def __init__(self, plan: DistributedPlan, rank: int, prep: _Prepared):
        self.plan, self.rank, self.prep = plan, rank, prep
        self.objects = prep.replicated.storage_objects + prep.local.storage_objects
        self.replicated = len(prep.replicated.storages)
        self.local_base = plan.local_storage_base[rank]

    def compact(self, g: int) -> int:
        """The plan's (global) storage number -> the index into ``objects``."""
        return g if g < self.replicated else self.replicated + g - self.local_base

    def globalise(self, c: int) -> int:
        return c if c < self.replicated else self.local_base + c - self.replicated

    def by_directory(self) -> list[tuple[int, list[int]]]:
        """This rank's file indices per plan directory (-1: the checkpoint directory)."""
        out: dict[int, list[int]] = {}
        for i in self.plan.files_of(self.rank):
            out.setdefault(self.plan.files[i].dir, []).append(i)
        return sorted(out.items())

    def report(self, t0: float, backend: str, reason: str, **more: Any) -> Report:
        """What every rank reports after writing its files, and ``more``."""
        local = self.prep.local
        return {
            **more, "backend": backend, "reason": reason, "plan": self.plan.digest(),
            "seconds": time.perf_counter() - t0,
            "n_tensors": len(local.tensors),
            "local": {"tree": local.tree, "tensors": [list(astuple(t)) for t in local.tensors],
                      "storages": [[s.nbytes, s.device] for s in local.storages]},
        }


def _write_my_files(share: _Share, files: RankFiles, tmp: str, stripe: str,
                    cfg: settings.Settings, hook: Callable[[int], None] | None = None) -> Report:
    """Write this rank's planned files (raw bytes, as planned) into their directories."""
    t0 = time.perf_counter()
    sealed: list[Extent] = []
    backend_name, reason = "none", "this rank had nothing to write"
    for d, file_indices in share.by_directory():
        directory = files.directory(d, tmp, stripe)
        plans = [share.plan.files[i].plan for i in file_indices]
        local_files = [
            replace(f, extents=tuple(replace(e, storage=share.compact(e.storage))
                                     for e in f.extents))
            for f in plans]
        be, reason = backend_for(cfg, directory, share.objects)
        backend_name = be.name
        files.writing(directory, [f.name for f in plans])
        for e in write_plan(be, directory, local_files, share.objects, cfg, hook):
            sealed.append(replace(e, storage=share.globalise(e.storage)))
        files.make_durable(d, directory)
    return share.report(t0, backend_name, reason, extents=[_extent_json(e) for e in sealed])


def _write_my_units(share: _Share, files: RankFiles, tmp: str, stripe: str,
                    cfg: settings.Settings, path: str, base: str | None, hashes: bool,
                    hook: Callable[[int], None] | None = None) -> Report:
    """:func:`_write_my_files` for a version-4 save: this rank's share cut into units, each
    hashed and referred to (``base``) or written, maybe encoded, into its planned files."""
    t0 = time.perf_counter()
    prep, replicated = share.prep, share.replicated
    records = list(prep.replicated.tensors) + [
        replace(t, storage=t.storage + replicated) for t in prep.local.tensors]
    sizes_of = typesizes(records, len(share.objects))
    keys = storage_keys(prep.replicated.tree, prep.replicated.tensors)
    keys.update({s + replicated: k for s, k in storage_keys(
        prep.local.tree, prep.local.tensors, local_prefix(share.rank)).items()})
    index = open_base(path, base) if base is not None else None
    sealed: list[Extent] = []
    referred: list[list[Any]] = []
    sizes: dict[int, int] = {}
    referred_bytes = 0
    backend_name, reason = "none", "this rank had nothing to write"
    compress, compression_reason = False, "this rank had nothing to write"
    try:
        for d, file_indices in share.by_directory():
            directory = files.directory(d, tmp, stripe)
            units, per_file = _cut(share, file_indices, sizes_of)
            choice = choose(cfg, directory, units, share.objects)
            backend_name, reason = choice.backend.name, choice.reason
            compress, compression_reason = choice.compress, choice.compression_reason
            names = [share.plan.files[i].plan.name for i in file_indices]
            files.writing(directory, names)
            # only what lives in the checkpoint directory may be referred to later
            refs, w = write_directory(choice, directory, names, per_file, units, share.objects,
                                      cfg, base=index if d < 0 else None, keys=keys,
                                      hashes=hashes, progress=hook)
            for local_file, size in enumerate(w.sizes):
                sizes[file_indices[local_file]] = size
            for e in w.extents:
                sealed.append(replace(e, storage=share.globalise(e.storage),
                                      file=file_indices[e.file]))
            referred += [[share.globalise(s), _candidate_json(c)] for s, c in w.referred]
            referred_bytes += refs.referred_bytes()
            files.make_durable(d, directory)
        if index is not None:
            index.check_unchanged()
    finally:
        if index is not None:
            index.close()
    return share.report(
        t0, backend_name, reason,
        extents=[_extent_full(e) for e in sealed],
        sizes={str(i): size for i, size in sizes.items()},
        referred=referred, referred_bytes=referred_bytes,
        base=os.path.basename(base) if base is not None else None,
        compression="lossless" if compress else "none",
        compression_mode=cfg.compression, compression_reason=compression_reason)


def _cut(share: _Share, file_indices: Sequence[int],
         sizes_of: Sequence[int]) -> tuple[list[Unit], list[list[int]]]:
    """The units of the planned files ``file_indices`` and, per file, the indices of its own."""
    units: list[Unit] = []
    per_file: list[list[int]] = []
    for i in file_indices:
        first = len(units)
        units += cut_units([(share.compact(e.storage), e.start, e.length)
                            for e in share.plan.files[i].plan.extents], sizes_of)
        per_file.append(list(range(first, len(units))))
    return units, per_file


# --- rank 0: the manifest out of every rank's report ---------------------------------------------

def _assemble(plan: DistributedPlan, prep: _Prepared, results: list[Report],
              infos: list[Report], roots: Sequence[str], stripe: str, save_id: str,
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
    return Manifest(files, storages, tensors, extents, prep.replicated.tree,
                    _writer(plan, results, infos, save_id, world, bool(bases)),
                    dirs=dirs, sections=sections, bases=bases)


def _writer(plan: DistributedPlan, results: list[Report], infos: list[Report], save_id: str,
            world: int, refers: bool) -> dict[str, Any]:
    """The manifest's ``writer`` record of a data-parallel save."""
    hosts = sorted({i["host"] for i in infos})
    writer = writer_record(
        ",".join(sorted({r["backend"] for r in results if r["backend"] != "none"})),
        results[0]["reason"], world, host=hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts",
        save_id=save_id, plan=plan.summary())
    if "compression" in results[0]:
        writer["compression"] = {"mode": results[0]["compression_mode"],
                                 "applied": [r["compression"] for r in results],
                                 "reason": results[0]["compression_reason"]}
    if refers or any(r.get("base") for r in results):
        writer["incremental"] = {"base": results[0].get("base"),
                                 "referred_bytes": sum(r["referred_bytes"] for r in results)}
    return writer


# --- what travels between ranks (JSON) ---------------------------------------------------------

def _extent_json(e: Extent) -> list[int]:
    return [e.storage, e.start, e.length, e.file, e.offset, e.crc32c]


def _extent_full(e: Extent) -> list[Any]:
    return [e.storage, e.start, e.length, e.file, e.offset, e.crc32c, e.codec, e.stored,
            e.stored_crc32c, e.blake3]


def _candidate_json(c: Candidate) -> dict[str, Any]:
    return {"blake3": c.blake3, "extent": _extent_full(c.extent), "holder": c.holder.name,
            "sha256": c.holder.manifest_sha256, "file": c.file_name, "size": c.file_size}


def _candidate(c: dict[str, Any]) -> Candidate:
    return Candidate(c["blake3"], Extent(*c["extent"]), Holder(c["holder"], c["sha256"]),
                     c["file"], c["size"])


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

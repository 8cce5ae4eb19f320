"""The directory format's layout: which bytes of a state go into which data file of a checkpoint
directory, and what its manifest records. One process or a data-parallel group, plain bytes
(format versions 1-3) or units (version 4: hashed, referred to a base, maybe encoded), the
replicated state and rank-local parts, data directories striped over drives: all one layout on
the save sequence (:mod:`.sequence`). See ``docs/DISTRIBUTED.md`` for the data-parallel save.

- ``prepare``: split off rank-local parts (:mod:`gds_persist.state.rank_local`), flatten,
  describe the replicated structure (with a group), probe the node and GPU affinity.
- ``plan``: one process writes every storage into a few files of about equal size (one per I/O
  stream); a group checks that its replicas agree (:mod:`gds_persist.parallel.replicas`, only
  where their digests differ), then splits the replicated bytes between the writing ranks
  (:func:`gds_persist.parallel.schedule.plan_save`), each rank-local part written by its owner.
- ``write``: this rank's files, into the temporary directory or its data directories
  (:mod:`.stripes`): raw (:func:`gds_persist.transfer.writer.write_plan`) or as units
  (:mod:`.units`).
- ``seal``: the manifest from every rank's report (:mod:`.manifest_builder`), after checking the
  written CRCs against the state at ``save`` (:mod:`.as_saved`).
- ``cleanup``: with data directories, one rank per node removes this path's data directories of
  saves whose owners are gone, while the commit lock is held.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import DistributedError
from ..format import DataDir, DataFile, Extent, codec, local_prefix, storage_keys, stripe_dir_name
from ..format.layout import file_streams, plan_single_writer
from ..format.records import Wire
from ..parallel.replicas import check_replicas, description_of
from ..parallel.schedule import DistributedPlan, PlannedFile, RankInfo, plan_save
from ..parallel.topology import gpu_affinity, node_name
from ..progress import ByteCounter
from ..results import DistributedSaveInfo, SaveInfo
from ..stages import stage
from ..state.flatten import Flattened, flatten
from ..state.rank_local import Split, split_rank_local
from ..transfer.commit import writer_record
from ..transfer.unit_writer import Unit
from ..transfer.writer import write_plan
from .as_saved import refuse_torn
from .incremental import BaseIndex, describe_references, open_base
from .manifest_builder import Part, Referral, build_manifest
from .options import SaveRequest
from .sequence import Layout, Run
from .stripes import RankFiles, remove_stale_stripes, stripe_prefix
from .units import (
    Choice,
    backend_for,
    choose,
    cut_units,
    typesizes,
    with_fallback,
    write_directory,
)

NOTHING = "this rank had nothing to write"


@dataclass(frozen=True)
class Facts(Wire):
    """What a rank tells the others in ``prepare``."""

    digest: str  # of its replicated structure ('' alone, or with check_replicas="off")
    node: str
    affinity: str | None
    affinity_why: str
    host: str
    local_sizes: list[int]
    local_crcs: list[int | None] | None  # checked by the committing rank (:mod:`.as_saved`)


@dataclass(frozen=True)
class Compression(Wire):
    mode: str
    applied: bool
    reason: str


@dataclass(frozen=True)
class Report(Wire):
    """What a rank tells the others after writing its files."""

    backend: str
    reason: str
    plan: str  # the plan's digest: every rank must have computed the same
    seconds: float
    local: Part  # its rank-local part (records and tree)
    extents: list[Extent]
    sizes: dict[str, int]  # by plan file index: the bytes written (units: after encoding)
    referred: list[Referral] = field(default_factory=list)
    referred_bytes: int = 0
    note: str = ""  # about the base (e.g. saved without content hashes)
    compression: Compression | None = None  # None: a plain save


class DirectoryLayout(Layout[Facts, Report]):
    """A checkpoint directory of ``state`` (see the module docstring)."""

    facts_type, report_type = Facts, Report

    def __init__(self, state: Any, path: str, request: SaveRequest):
        self.state, self.path, self.request = state, path, request
        self.base = request.base_of(path)
        self.shared = request.data_parallel  # a group's save, even of one rank
        self.files = RankFiles(request.roots(), request.cfg.io_timeout_s)
        self.replicated = self.local = flatten([])
        self.description: dict[str, Any] = {}
        self.facts: list[Facts] = []
        self.stripe = ""

    # prepare ----------------------------------------------------------------------------------
    def prepare(self, run: Run) -> Facts:
        with stage("flatten"):
            self.replicated, self.local = _split(self.state, self.request)
        digest = ""
        if run.comm.size > 1:  # only replicas have anything to compare
            self.description, digest = description_of(self.replicated,
                                                      self.request.check_replicas)
        affinity, why = gpu_affinity() if self.shared else (None, "one process")
        return Facts(digest, node_name(), affinity, why, socket.gethostname(),
                     [s.nbytes for s in self.local.storages], self.local.crc_at_save)

    # plan -------------------------------------------------------------------------------------
    def plan(self, run: Run, facts: list[Facts]) -> None:
        self.facts = facts
        if run.comm.size > 1:
            check_replicas(run.comm, self.description, [f.digest for f in facts], run.what,
                           run.intact)
        sizes = [s.nbytes for s in self.replicated.storages]
        if self.shared:
            ranks = [RankInfo(r, f.node, f.affinity, tuple(f.local_sizes))
                     for r, f in enumerate(facts)]
            self.layout = plan_save(sizes, ranks, writers_per_node=self.request.writers_per_node,
                                    data_dirs=len(self.files.roots))
            self.stripe = stripe_dir_name(stripe_prefix(self.path), run.first.save_id)
        else:
            cfg = self.request.cfg
            streams = file_streams(sum(sizes), cfg.io_threads, cfg.block_bytes, cfg.file_streams)
            self.layout = _one_writer(plan_single_writer(sizes, streams).files, len(sizes))
        self.share = _Share(self.layout, run.comm.rank, self.replicated, self.local)
        run.needs = f"this checkpoint needs {self.layout.total_bytes} bytes of data; "

    # write ------------------------------------------------------------------------------------
    def write(self, run: Run) -> Report:
        counter = ByteCounter(self.request.progress, sum(
            self.layout.files[i].plan.size for i in self.layout.files_of(run.comm.rank)))
        writing = _Writing(self, run.first.tmp, counter)
        for d, file_indices in self.share.by_directory():
            writing.directory(d, file_indices)
        counter.finish()
        return writing.report(run)

    # seal and commit --------------------------------------------------------------------------
    def seal(self, run: Run, reports: list[Report]) -> Any:
        if len({r.plan for r in reports}) != 1:
            raise DistributedError(f"{run.what}: ranks computed different plans (different "
                                   f"gds_persist versions on different ranks?){run.intact}",
                                   phase="write")
        files, extents = _kept_files(self.layout, reports)
        used = sorted({f.dir for f in self.layout.files if f.dir >= 0})
        manifest = build_manifest(
            Part(self.replicated.tree, self.replicated.tensors, self.replicated.storages),
            files, extents, self._writer(run, reports),
            locals_by_rank=[r.local for r in reports] if self.shared else (),
            dirs=[DataDir(self.files.roots[d], self.stripe) for d in used],
            referred=[ref for r in reports for ref in r.referred])
        refuse_torn(self.replicated, manifest.extents, self.path,
                    [(f.local_sizes, f.local_crcs) for f in self.facts])
        return manifest

    def _writer(self, run: Run, reports: list[Report]) -> dict[str, Any]:
        """The manifest's ``writer`` record: the backend and why (one process), or the plan too."""
        first = reports[0]
        reason = first.reason + (f"; {first.note}" if first.note else "")
        if self.shared:
            hosts = sorted({f.host for f in self.facts})
            writer = writer_record(
                ",".join(sorted({r.backend for r in reports if r.backend != "none"})), reason,
                run.comm.size, host=hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts",
                save_id=run.first.save_id, plan=self.layout.summary())
        else:
            writer = writer_record(first.backend, reason)
        if first.compression is not None:
            applied = [r.compression.applied for r in reports if r.compression is not None]
            writer["compression"] = {
                "mode": first.compression.mode, "applied": applied if self.shared else applied[0],
                "reason": first.compression.reason,
                **({} if self.shared else {"codec": _codec_name(applied[0])})}
        if self.base is not None:
            writer["incremental"] = describe_references_total(self.base, reports)
        return writer

    def cleanup(self, run: Run) -> None:
        if not self.files.roots:
            return
        leader = run.comm.rank in {members[0] for members in self.layout.nodes}

        def step() -> None:
            if leader:
                remove_stale_stripes(self.files.roots, stripe_prefix(self.path), self.stripe)
            self.files.release()  # before rank 0 releases the commit lock: so the next
            # commit's cleanup finds this (now replaceable) directory unlocked

        try:  # best effort: the checkpoint is committed whatever happens here
            run.agree("cleanup", step, "")
        except DistributedError:
            pass

    def abandon(self, run: Run) -> None:
        """Files in data directories go (the temporary directory goes with the sequence); once
        the commit began they may be part of the checkpoint: a later save removes them if not."""
        self.files.remove()

    def release(self, run: Run, committed: bool) -> None:
        self.files.release()

    def info(self, run: Run) -> SaveInfo:
        return _save_info(self, run)


def _split(state: Any, request: SaveRequest) -> tuple[Flattened, Flattened]:
    """The replicated and the rank-local part of ``state``, flattened (once: a Checkpointer's
    snapshot comes flattened already)."""
    paths = request.rank_local_paths()
    if isinstance(state, (Flattened, Split)):
        if paths:
            raise ValueError("rank_local needs the state dict itself, not a flattened one")
        if isinstance(state, Split):
            return state.replicated, state.local
        return state, flatten([])
    if paths or request.data_parallel:
        return split_rank_local(state, paths)
    return flatten(state, request.allow_pickle), flatten([])


def _one_writer(files: Sequence[Any], storages: int) -> DistributedPlan:
    """One process's plan: every file written by rank 0 into the checkpoint directory."""
    return DistributedPlan(1, ((0,),), (0,), tuple(PlannedFile(f, 0, -1, "shared")
                                                   for f in files),
                           storages, (storages,), "one process")


class _Share:
    """This rank's share of ``plan``: its files, by directory, and the storages they hold - the
    replicated ones, then this rank's rank-local ones (in the plan those are numbered from
    ``plan.local_storage_base[rank]``)."""

    def __init__(self, plan: DistributedPlan, rank: int, replicated: Flattened,
                 local: Flattened):
        self.plan, self.rank, self.local = plan, rank, local
        self.objects = replicated.storage_objects + local.storage_objects
        self.replicated = len(replicated.storages)
        self.local_base = plan.local_storage_base[rank]
        self.state = replicated

    @functools.cached_property
    def keys(self) -> dict[int, str]:
        """Every storage's key path (units refer to a base's bytes by it)."""
        keys = storage_keys(self.state.tree, self.state.tensors)
        keys.update({s + self.replicated: k for s, k in storage_keys(
            self.local.tree, self.local.tensors, local_prefix(self.rank)).items()})
        return keys

    @property
    def numbered_alike(self) -> bool:
        """No rank-local storages here: the plan's numbers are the indices into ``objects``."""
        return not self.local.storages

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

    def units(self, file_indices: Sequence[int]) -> tuple[list[Unit], list[list[int]]]:
        """The units of the planned files ``file_indices`` and, per file, the indices of its
        own."""
        records = list(self.state.tensors) + [
            replace(t, storage=t.storage + self.replicated) for t in self.local.tensors]
        sizes_of = typesizes(records, len(self.objects))
        units: list[Unit] = []
        per_file: list[list[int]] = []
        for i in file_indices:
            first = len(units)
            units += cut_units([(self.compact(e.storage), e.start, e.length)
                                for e in self.plan.files[i].plan.extents], sizes_of)
            per_file.append(list(range(first, len(units))))
        return units, per_file


class _Writing:
    """One rank writing its files, directory by directory, and what it wrote."""

    def __init__(self, layout: DirectoryLayout, tmp: str, counter: ByteCounter):
        self.layout, self.tmp, self.counter = layout, tmp, counter
        self.share, self.request = layout.share, layout.request
        self.t0 = time.perf_counter()
        self.extents: list[Extent] = []
        self.sizes: dict[str, int] = {}
        self.referred: list[Referral] = []
        self.referred_bytes = 0
        self.backend, self.reason, self.note = "none", NOTHING, ""
        self.compression: Compression | None = None
        self.index: BaseIndex | None = None

    def directory(self, d: int, file_indices: list[int]) -> None:
        directory = self.layout.files.directory(d, self.tmp, self.layout.stripe)
        names = [self.share.plan.files[i].plan.name for i in file_indices]
        self.layout.files.writing(directory, names)
        if self.request.plain:
            self._raw(directory, file_indices)
        else:
            self._units(d, directory, names, file_indices)
        self.layout.files.make_durable(d, directory)

    def _raw(self, directory: str, file_indices: list[int], choice: Choice | None = None) -> None:
        share, cfg = self.share, self.request.cfg
        plans = [share.plan.files[i].plan for i in file_indices]
        local_files = plans if share.numbered_alike else [
            replace(f, extents=tuple(replace(e, storage=share.compact(e.storage))
                                     for e in f.extents)) for f in plans]
        if choice is None:
            be, reason = backend_for(cfg, directory, share.objects)
        else:
            be, reason = choice.backend, choice.reason
        written = write_plan(be, directory, local_files, share.objects, cfg, self.counter.hook)
        self.extents += written if share.numbered_alike else [
            replace(e, storage=share.globalise(e.storage)) for e in written]
        self.sizes.update({str(i): f.size for i, f in zip(file_indices, plans, strict=True)})
        self.backend, self.reason = be.name, with_fallback(be, reason)

    def _units(self, d: int, directory: str, names: list[str], file_indices: list[int]) -> None:
        share, cfg, layout = self.share, self.request.cfg, self.layout
        units, per_file = share.units(file_indices)
        choice = choose(cfg, directory, units, share.objects)
        self.compression = Compression(cfg.compression, choice.compress, choice.compression_reason)
        if not (choice.compress or self.request.hashes or layout.base or layout.shared):
            self._raw(directory, file_indices, choice)  # auto chose raw: a plain save
            self.compression = Compression(cfg.compression, False, choice.compression_reason)
            return
        if layout.base is not None and self.index is None:
            self.index = open_base(layout.path, layout.base)
        try:
            # only what lives in the checkpoint directory may be referred to later
            refs, w = write_directory(choice, directory, names, per_file, units, share.objects,
                                      cfg, base=self.index if d < 0 else None, keys=share.keys,
                                      hashes=self.request.hashes or self.index is not None,
                                      progress=self.counter.hook)
        except BaseException:
            self._close_base()
            raise
        self.sizes.update({str(file_indices[k]): size for k, size in enumerate(w.sizes)})
        self.extents += [replace(e, storage=share.globalise(e.storage), file=file_indices[e.file])
                         for e in w.extents]
        self.referred += [Referral(share.globalise(s), c) for s, c in w.referred]
        self.referred_bytes += refs.referred_bytes()
        self.note = describe_references(refs).get("note", "") or self.note
        self.backend, self.reason = choice.backend.name, with_fallback(choice.backend,
                                                                        choice.reason)

    def _close_base(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None

    def report(self, run: Run) -> Report:
        if self.index is not None:
            try:
                self.index.check_unchanged()
            finally:
                self._close_base()
        local = self.share.local
        return Report(self.backend, self.reason,
                      self.share.plan.digest() if run.comm.size > 1 else "",
                      time.perf_counter() - self.t0,
                      Part(local.tree, list(local.tensors), list(local.storages)),
                      self.extents, self.sizes, self.referred, self.referred_bytes,
                      self.note, self.compression)


def _kept_files(plan: DistributedPlan, reports: list[Report]) -> tuple[list[DataFile],
                                                                      list[Extent]]:
    """The data files that hold bytes (one every unit of which a base holds was written empty
    and is left out) and the extents, renumbered to match."""
    used = sorted({f.dir for f in plan.files if f.dir >= 0})
    dir_index = {d: k + 1 for k, d in enumerate(used)}
    sizes = {int(i): size for r in reports for i, size in r.sizes.items()}
    keep = [i for i, f in enumerate(plan.files) if sizes.get(i, f.plan.size)]
    renumber = {old: new for new, old in enumerate(keep)}
    files = [DataFile(plan.files[i].plan.name, sizes.get(i, plan.files[i].plan.size),
                      dir_index.get(plan.files[i].dir, 0)) for i in keep]
    extents = [e for r in reports for e in r.extents]
    if len(keep) < len(plan.files):  # some file was all references: number the rest anew
        extents = [replace(e, file=renumber[e.file]) for e in extents]
    return files, extents


def _codec_name(applied: bool) -> str:
    return codec.DESCRIPTION if applied else "none"


def describe_references_total(base: str, reports: list[Report]) -> dict[str, Any]:
    """The manifest's ``writer["incremental"]``, over every rank."""
    note = next((r.note for r in reports if r.note), "")
    return {"base": os.path.basename(base),
            "referred_bytes": sum(r.referred_bytes for r in reports),
            **({"note": note} if note else {})}


def _save_info(layout: DirectoryLayout, run: Run) -> SaveInfo:
    """What this rank's save returns: :class:`SaveInfo` alone, its share and the totals with a
    group."""
    plan, reports, comm = layout.layout, run.reports, run.comm
    mine = reports[comm.rank]
    kept = [n for n in (plan.files[int(i)].plan.name for i, s in sorted(
        ((int(i), s) for r in reports for i, s in r.sizes.items())) if s)]
    common = dict(
        path=layout.path if layout.shared else run.path, backend=mine.backend,
        reason=mine.reason + (f"; {mine.note}" if mine.note else ""),
        bytes_written=sum(s for r in reports for s in r.sizes.values()),
        payload_bytes=(sum(s.nbytes for s in layout.replicated.storages)
                       + sum(sum(f.local_sizes) for f in layout.facts)),
        seconds=time.perf_counter() - run.t0,
        tensors=len(layout.replicated.tensors) + sum(len(r.local.tensors) for r in reports),
        storages=len(layout.replicated.storages) + sum(len(f.local_sizes) for f in layout.facts),
        files=kept,
        referenced_bytes=sum(r.referred_bytes for r in reports),
        compression="lossless" if mine.compression and mine.compression.applied else "none",
        compression_reason=mine.compression.reason if mine.compression else "",
        base=os.path.basename(layout.base) if layout.base is not None else None)
    if not layout.shared:
        return SaveInfo(**common)
    own = [plan.files[i].plan for i in plan.files_of(comm.rank)]
    return DistributedSaveInfo(
        **common, rank=comm.rank, world_size=comm.size, writers=list(plan.writers),
        rank_bytes=sum(mine.sizes.values()), rank_files=[f.name for f in own],
        rank_write_seconds=mine.seconds, writer_balance=plan.writer_balance,
        node_balance=plan.node_balance, nodes=len(plan.nodes),
        placement=plan.placement + "; " + layout.facts[comm.rank].affinity_why,
        phases=dict(run.phases))

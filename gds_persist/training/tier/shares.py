"""The memory tier's commit of one step: each rank keeps only its byte-range share.

Data-parallel replicas hold identical state, so the tier splits it as the drive save does
(:func:`gds_persist.parallel.schedule.plan_save`: the storages laid end to end, cut into one
aligned, contiguous byte range per rank). Rank ``r`` writes its range into its node's memory as
``rank-r/step-N/`` = the data file ``data-r<r>-00000.bin`` and the manifest of the *whole* step
(every rank's extents, each with its CRC32C); the other ranks' data files are not there. So a
node holds ``ranks_on_node / world`` of the state, plus its replicas' shares
(:func:`share_bytes`), and the ranks of the step together hold it once.

A share directory is committed atomically like any checkpoint (temporary directory, fsynced,
renamed); the manifest is built from every rank's sealed extents, byte for byte the same on every
rank, so each share's reader can check it holds the step the others hold. It is not a complete
checkpoint on its own: :mod:`.reading` restores a step from all shares together.

With ``rank_local`` (per-rank state: ZeRO shards) the shares split the replicated part, whose
tree holds the placeholders, and each rank's own part is a plain checkpoint of its own in its
share directory, ``rank-r/step-N/local/``: copied to the share's replicas with it, restored by
that rank only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from ... import settings
from ...errors import CheckpointError, ReplicationError, TornCheckpointError
from ...format import DataFile, Extent, Manifest, storage_keys
from ...format.records import Wire
from ...parallel.distributed import Comm
from ...parallel.schedule import DistributedPlan, RankInfo, plan_save
from ...results import SaveInfo
from ...saving.as_saved import SHOWN, refuse_torn
from ...saving.manifest_builder import Part, build_manifest
from ...saving.save import save as core_save
from ...saving.sequence import Layout, Run, run_save
from ...saving.units import backend_for
from ...state.flatten import Flattened
from ...transfer.commit import writer_record
from ...transfer.writer import write_plan

SHARES_MARK = "memory-shares"  # the manifests' writer record says how the step is held
MANIFEST_SLACK = 1 << 20  # manifest, lock files, a partial last page: per share, generously
LOCAL_DIR = "local"  # a share directory's rank-local part: a checkpoint of its own


def plan_shares(sizes: list[int], nodes: list[str]) -> DistributedPlan:
    """Who keeps which bytes of the step: the drive save's split, every rank a writer."""
    return plan_save(sizes, [RankInfo(r, n) for r, n in enumerate(nodes)])


def share_bytes(plan: DistributedPlan) -> list[int]:
    """By rank: what its share directory takes in memory, at most."""
    return [n + MANIFEST_SLACK for n in plan.bytes_per_rank]


def local_bytes(local: Flattened | None) -> int:
    """What a rank's rank-local part takes in memory, at most (0: none)."""
    return 0 if local is None else sum(s.nbytes for s in local.storages) + MANIFEST_SLACK


def save_local(share_dir: str, local: Flattened, backend: str | None) -> int:
    """Write a rank's rank-local part into its (uncommitted) share directory; bytes written."""
    with settings.in_this_thread(io_threads=settings.current().memory_io_threads):
        return core_save(local, os.path.join(share_dir, LOCAL_DIR),
                         backend=backend).bytes_written


def structure_digest(flat: Flattened) -> str:
    """The replicated structure (tree, tensor records, storage sizes): equal on every rank
    whose shares make one state."""
    # vars(), not astuple(): its deep copy of 209 records held the GIL 3.6 ms (now 0.8) every
    # memory step, time the training thread waits for (the same text: the fields are flat)
    text = json.dumps([flat.tree, [list(vars(t).values()) for t in flat.tensors],
                       [s.nbytes for s in flat.storages]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_structure(digests: list[str], step: int) -> None:
    """Shares of one state need the same state on every rank (as the drive's split does)."""
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise CheckpointError(
            f"step {step}: the memory tier keeps each rank's byte-range share of the replicated "
            f"state, but the state of ranks {differ} differs in structure from rank 0's (keys, "
            "shapes, dtypes or sizes); save the same replicated state on every rank of the "
            "Checkpointer's process_group, or give each replica group its own Checkpointer")


@dataclass(frozen=True)
class ShareReport(Wire):
    """What a rank tells the others once its share is written and fsynced."""

    extents: list[Extent]
    backend: str
    reason: str
    local_written: int  # bytes of its rank-local part


class ShareLayout(Layout[Any, ShareReport]):
    """The memory tier's layout on the save sequence: each rank writes its byte-range share of
    ``flat`` (and its rank-local part beside it) into a directory of its own, and every rank
    seals its directory with the same manifest of the whole step."""

    facts_type = None  # nothing to exchange before writing: the plan is the tier's
    report_type = ShareReport
    every_rank_commits = True

    def __init__(self, flat: Flattened, plan: DistributedPlan, backend: str | None,
                 local: Flattened | None):
        self.flat, self.layout, self.backend, self.local = flat, plan, backend, local

    def write(self, run: Run) -> ShareReport:
        assert run.tmp is not None
        self.mine = [self.layout.files[i].plan for i in self.layout.files_of(run.comm.rank)]
        be, reason = backend_for(run.cfg, run.tmp.dir, self.flat.storage_objects)
        sealed = (write_plan(be, run.tmp.dir, self.mine, self.flat.storage_objects, run.cfg)
                  if self.mine else [])
        written = (0 if self.local is None else
                   save_local(run.tmp.dir, self.local, self.backend))
        if not self.mine:
            be_name, reason = "none", "this rank had nothing to write"
        else:
            be_name = be.name
        return ShareReport(sealed, be_name, reason, written)

    def seal(self, run: Run, reports: list[ShareReport]) -> Manifest:
        """The whole step's manifest, the same bytes on every rank (no host, no timing in it)."""
        writer = writer_record("memory", "the memory tier: each rank holds its own data file",
                               run.comm.size, host="", layout=SHARES_MARK,
                               shares={str(f.rank): i for i, f in enumerate(self.layout.files)})
        manifest = build_manifest(
            Part(self.flat.tree, list(self.flat.tensors), list(self.flat.storages)),
            [DataFile(f.plan.name, f.plan.size) for f in self.layout.files],
            [e for r in reports for e in r.extents], writer)
        try:
            refuse_torn(self.flat, manifest.extents, run.path)  # every rank: all the extents
        except TornCheckpointError as e:
            _refuse_other_replicas(e, self.flat, reports, run.comm.rank, run.path)
            raise
        return manifest

    def info(self, run: Run) -> SaveInfo:
        mine = run.reports[run.comm.rank]
        return SaveInfo(path=run.path, backend=mine.backend, reason=mine.reason,
                        bytes_written=sum(f.size for f in self.mine) + mine.local_written,
                        payload_bytes=sum(e.length for f in self.mine for e in f.extents),
                        seconds=time.perf_counter() - run.t0, tensors=len(self.flat.tensors),
                        storages=len(self.flat.storages), files=[f.name for f in self.mine])


def _refuse_other_replicas(torn: TornCheckpointError, flat: Flattened,
                           reports: list[ShareReport], rank: int, path: str) -> None:
    """Where a storage that differs from this rank's bytes at ``save()`` was written (in part)
    by another rank, this rank's own tensor is not in the file: the replicas held different
    bytes at ``save()`` (each rank's check passes on what it wrote). Raise that instead of
    :class:`TornCheckpointError`."""
    keys = storage_keys(flat.tree, flat.tensors)
    by = {r: {keys.get(e.storage, f"storage {e.storage}") for e in rep.extents}
          for r, rep in enumerate(reports) if r != rank}
    others = {name: [r for r, names in by.items() if name in names] for name in torn.tensors}
    written_elsewhere = {n: rs for n, rs in others.items() if rs}
    if written_elsewhere:
        said = "; ".join(f"{n} (written by rank {', '.join(map(str, rs))})"
                         for n, rs in list(written_elsewhere.items())[:SHOWN])
        raise ReplicationError(
            f"{path}: the replicated state differs between ranks: {said} held other bytes on "
            f"rank {rank} at save(). The memory tier keeps one copy of the replicated state, "
            "each rank writing a share, so every rank of the Checkpointer's process_group must "
            "hold bit-identical replicated state (rank-local state goes in rank_local=); nothing "
            "was committed and earlier checkpoints are intact",
            failed_ranks={rank: "its replicated state differs"}) from torn


def save_share(comm: Comm, path: str, flat: Flattened, plan: DistributedPlan,
               backend: str | None, step: int, local: Flattened | None = None) -> SaveInfo:
    """Every rank: commit its share of ``flat`` at ``path`` (its own ``rank-R/step-N``), with
    its rank-local part ``local`` beside it. A failure anywhere raises on every rank; what was
    committed stays (the previous step is kept until every rank holds the new one)."""
    # tmpfs writes are copies, off the training thread's path: the tier's own thread count
    cfg = settings.current(backend=backend, io_threads=settings.current().memory_io_threads)
    return run_save(ShareLayout(flat, plan, backend, local), path, comm, cfg=cfg,
                    what=f"memory-tier save of step {step} at {path}")


def share_files(m: Manifest) -> dict[int, int]:
    """A share manifest's data file, by the rank that holds it (empty: not a share manifest)."""
    if m.writer.get("layout") != SHARES_MARK:
        return {}
    return {int(r): int(i) for r, i in m.writer.get("shares", {}).items()}

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
from typing import Any

from ... import settings
from ...errors import CheckpointError
from ...format import DataFile, Extent, Manifest
from ...parallel.distributed import Comm
from ...parallel.schedule import DistributedPlan, RankInfo, plan_save
from ...results import SaveInfo
from ...saving.as_saved import refuse_torn
from ...saving.save import save as core_save
from ...saving.units import backend_for
from ...state.flatten import Flattened
from ...transfer.commit import abort, begin, seal, writer_record
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


def save_share(comm: Comm, path: str, flat: Flattened, plan: DistributedPlan,
               backend: str | None, step: int, local: Flattened | None = None) -> SaveInfo:
    """Every rank: commit its share of ``flat`` at ``path`` (its own ``rank-R/step-N``), with
    its rank-local part ``local`` beside it.
    Two agreed phases: write and fsync the share, then seal every rank's directory with the
    manifest of the whole step. A failure anywhere raises on every rank; what was committed
    stays (the previous step is kept until every rank holds the new one)."""
    t0 = time.perf_counter()
    # tmpfs writes are copies, off the training thread's path: the tier's own thread count
    cfg = settings.current(backend=backend, io_threads=settings.current().memory_io_threads)
    mine = [plan.files[i].plan for i in plan.files_of(comm.rank)]
    what = f"memory-tier save of step {step} at {path}"
    held: dict[str, Any] = {}

    def write() -> list[list[int]]:
        tmp = held["tmp"] = begin(path, cfg.io_timeout_s)
        be, reason = backend_for(cfg, tmp.dir, flat.storage_objects)
        held["backend"] = (be.name, reason)
        sealed = write_plan(be, tmp.dir, mine, flat.storage_objects, cfg) if mine else []
        if local is not None:
            held["local_written"] = save_local(tmp.dir, local, backend)
        return [[e.storage, e.start, e.length, e.file, e.offset, e.crc32c] for e in sealed]

    try:
        reports = comm.agree("memory share write", write, what)
        manifest = _manifest(plan, flat, reports, comm.size)
        def check_and_seal() -> None:
            refuse_torn(flat, manifest.extents, path)  # every rank: all the extents
            seal(held.pop("tmp"), manifest, cfg.io_timeout_s, check=True)

        comm.agree("memory share seal", check_and_seal, what)
    finally:
        if "tmp" in held:
            abort(held["tmp"])
    name, reason = held.get("backend", ("none", "this rank had nothing to write"))
    written = sum(f.size for f in mine) + held.get("local_written", 0)
    return SaveInfo(path=path, backend=name, reason=reason, bytes_written=written,
                    payload_bytes=sum(e.length for f in mine for e in f.extents),
                    seconds=time.perf_counter() - t0, tensors=len(flat.tensors),
                    storages=len(flat.storages), files=[f.name for f in mine])


def _manifest(plan: DistributedPlan, flat: Flattened, reports: list[Any],
              world: int) -> Manifest:
    """The whole step's manifest, the same bytes on every rank (no host, no timing in it)."""
    extents = sorted((Extent(*e) for r in reports for e in r),
                     key=lambda e: (e.file, e.offset))
    files = [DataFile(f.plan.name, f.plan.size) for f in plan.files]
    writer = writer_record("memory", "the memory tier: each rank holds its own data file",
                           world, host="", layout=SHARES_MARK,
                           shares={str(f.rank): i for i, f in enumerate(plan.files)})
    return Manifest(files, list(flat.storages), list(flat.tensors), extents, flat.tree, writer)


def share_files(m: Manifest) -> dict[int, int]:
    """A share manifest's data file, by the rank that holds it (empty: not a share manifest)."""
    if m.writer.get("layout") != SHARES_MARK:
        return {}
    return {int(r): int(i) for r, i in m.writer.get("shares", {}).items()}

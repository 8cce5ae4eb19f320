"""``save(state, "x.pt", format="torch", process_group=pg)``: the ranks of a data-parallel group
write byte ranges of the one torch.save file (FastPersist's write parallelism, one file).

Every rank holds the same replicated state and pickles it alike, so every rank computes the
same archive layout (:mod:`gds_persist.saving.torch_file`). Phases, each one
:meth:`~gds_persist.parallel.distributed.Comm.agree`, so a failure anywhere is raised on every
rank, naming it, and nothing is committed:

1. ``prepare``: every rank pickles its replica; the pickles must be identical but for the GPU
   ordinals of their locations (:func:`~gds_persist.format.torch_pickle.replica_digest`); every
   rank then lays out rank 0's pickle (broadcast) over its own storages.
   ``start``: rank 0 starts the save (temporary directory), creates the file at its full size
   and leaves a token in the directory.
2. ``find``: the ranks that see the token share the filesystem of the file and write; the others
   (another node without that filesystem) have nothing to write.
3. ``write``: the file up to its tail is cut into one contiguous aligned range per writer
   (balanced by bytes); each writes the storage bytes and glue of its range into the existing
   file and fsyncs it, and reports the CRC32C of its pieces of every storage.
4. ``commit``: rank 0 joins the pieces' CRC32C per storage, writes the tail, renames the file
   into place.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace
from typing import Any

from ..errors import ReplicationError
from ..format import Extent, align_up, joined_crcs
from ..format.layout import FilePlan
from ..format.torch_pickle import replica_digest
from ..parallel.distributed import Comm, make_comm
from ..progress import ByteCounter
from ..results import DistributedSaveInfo
from ..transfer.commit import Temporary, abort, begin_file, file_in, seal_file, writer_record
from ..transfer.writer import write_at, write_plan
from .as_saved import refuse_changed
from .options import SaveRequest
from .torch_file import PickledState, archive_plan
from .units import backend_for, with_fallback

TOKEN = ".writers"  # in the temporary directory: who sees it shares the file's filesystem


def save_torch_file_parallel(state: Any, path: str, options: SaveRequest) -> DistributedSaveInfo:
    """See the module docstring; every rank of ``options.process_group`` calls it."""
    t0 = time.perf_counter()
    cfg = options.cfg
    comm = make_comm(options.process_group, cfg.collective_timeout_s)
    what = f"gds_persist save of {path} (rank {comm.rank} of {comm.size})"
    intact = f"; nothing was committed and whatever was at {path} is intact"
    held: dict[str, Any] = {}
    try:
        digests = comm.agree("prepare", lambda: _prepare(state, options, held), what, intact)
        _check_identical(digests, what, intact)
        _lay_out(held, path, comm)
        infos = comm.agree("start", lambda: _start(held, path, options, comm.rank), what,
                           intact)
        held["file"] = os.path.join(infos[0]["tmp"], os.path.basename(path))
        save_id = infos[0]["save_id"]
        sees = comm.agree("find", lambda: _sees(infos[0]["tmp"], save_id), what, intact)
        writers = [r for r, seen in enumerate(sees) if seen]
        reports = comm.agree("write", lambda: _write_share(held, writers, comm.rank, options),
                             what, intact)
        comm.agree("commit", lambda: _commit(held, reports, comm, cfg.io_timeout_s), what,
                   f"; rank 0 could not commit, so whatever was at {path} is intact")
    except BaseException:
        if held.get("tmp") is not None:
            abort(held["tmp"])
        raise
    mine = reports[comm.rank]
    return DistributedSaveInfo(
        path=path, backend=mine["backend"], reason=mine["reason"],
        bytes_written=held["size"], payload_bytes=held["payload"],
        seconds=time.perf_counter() - t0, tensors=0, storages=len(held["entries"]),
        files=[os.path.basename(path)], rank=comm.rank, world_size=comm.size, writers=writers,
        rank_bytes=mine["bytes"], rank_files=[os.path.basename(path)] if mine["bytes"] else [],
        rank_write_seconds=mine["seconds"])


def _prepare(state: Any, options: SaveRequest, held: dict[str, Any]) -> str:
    """This rank's pickle of its replica; what must equal rank 0's (:func:`replica_digest`)."""
    held["pickled"] = PickledState.of(state, options.allow_pickle)
    return replica_digest(held["pickled"].data)


def _lay_out(held: dict[str, Any], path: str, comm: Comm) -> None:
    """Every rank lays out rank 0's pickle over its own storages: one layout for all (the
    replicas' pickles differ at most in their GPU ordinals, which changes their lengths)."""
    own: PickledState = held["pickled"]
    data = comm.broadcast_bytes(own.data if comm.rank == 0 else None, 0, "pickle of " + path)
    layout, plan, sources = archive_plan(path, PickledState(data, own.entries))
    held.update(layout=layout, plan=plan, sources=sources, entries=own.entries,
                payload=sum(e.storage.nbytes() for e in own.entries), path=path,
                crc_at_save=own.crc_at_save, keys=[e.key for e in own.entries])


def _start(held: dict[str, Any], path: str, options: SaveRequest,
           rank: int) -> dict[str, Any]:
    """Rank 0 starts the save: the temporary directory, the file at its full size, a token."""
    if rank != 0:
        return {"tmp": "", "save_id": ""}
    tmp: Temporary = begin_file(path, options.cfg.io_timeout_s)
    held["tmp"] = tmp
    be, _ = backend_for(options.cfg, tmp.dir, [e.storage for e in held["entries"]])
    be.close(be.open(file_in(tmp), write=True, size=held["plan"].size))
    save_id = uuid.uuid4().hex
    with open(os.path.join(tmp.dir, TOKEN), "w") as f:
        f.write(save_id)
    return {"tmp": tmp.dir, "save_id": save_id}


def _check_identical(digests: list[str], what: str, intact: str) -> None:
    bad = {r: "its state pickles differently from rank 0's" for r, d in enumerate(digests)
           if d != digests[0]}
    if bad:
        raise ReplicationError(
            f"{what}: format='torch' with a process group writes one file of the replicated "
            f"state, but ranks {sorted(bad)} hold a different state (keys, shapes, dtypes or "
            "Python values); save a file per rank instead" + intact,
            failed_ranks=bad, phase="prepare")


def _sees(tmp_dir: str, save_id: str) -> bool:
    try:
        with open(os.path.join(tmp_dir, TOKEN)) as f:
            return f.read() == save_id
    except OSError:
        return False


def _write_share(held: dict[str, Any], writers: list[int], rank: int,
                 options: SaveRequest) -> dict[str, Any]:
    """This rank's range of the file, written; the CRC32C of its pieces of each storage."""
    t0 = time.perf_counter()
    layout, plan = held["layout"], held["plan"]
    held["size"] = layout.tail_offset  # until the tail is known (rank 0 adds it)
    if rank not in writers:
        return {"pieces": [], "bytes": 0, "backend": "none", "seconds": 0.0,
                "reason": "this rank does not see the file's filesystem: nothing to write"}
    k = writers.index(rank)
    lo, hi = (_cut(plan.size, len(writers), j) for j in (k, k + 1))
    mine = FilePlan(plan.name, plan.size, tuple(_clip(e, lo, hi) for e in plan.extents
                                                if e.offset < hi and e.offset + e.length > lo))
    directory = os.path.dirname(held["file"])
    be, reason = backend_for(options.cfg, directory, [e.storage for e in held["entries"]])
    held["backend"] = be  # rank 0 writes the tail with it
    counter = ByteCounter(options.progress, hi - lo)
    sealed = write_plan(be, directory, [mine], held["sources"], options.cfg, counter.hook,
                        create=False)
    counter.finish()
    storages = len(held["entries"])
    return {"pieces": [[e.storage, e.start, e.length, e.crc32c] for e in sealed
                       if e.storage < storages],
            "bytes": hi - lo, "backend": be.name, "reason": with_fallback(be, reason),
            "seconds": time.perf_counter() - t0}


def _cut(size: int, parts: int, k: int) -> int:
    return min(size, align_up(size * k // parts)) if k < parts else size


def _clip(e: Extent, lo: int, hi: int) -> Extent:
    start, end = max(e.offset, lo), min(e.offset + e.length, hi)
    return replace(e, start=e.start + start - e.offset, length=end - start, offset=start)


def _commit(held: dict[str, Any], reports: list[dict[str, Any]], comm: Comm,
            timeout_s: float) -> None:
    if comm.rank != 0:
        return
    layout, tmp = held["layout"], held["tmp"]
    sizes = [e.storage.nbytes() for e in held["entries"]]
    joined = joined_crcs([tuple(p) for r in reports for p in r["pieces"]], sizes)
    crcs = [0 if c is None else c for c in joined]  # None only where a storage has no bytes
    refuse_changed(held["crc_at_save"], crcs, lambda k: f"data/{held['keys'][k]}", held["path"])
    tail = layout.tail(crcs, writer_record(reports[0]["backend"], reports[0]["reason"],
                                           world_size=comm.size))
    write_at(held["backend"], file_in(tmp), layout.tail_offset, tail)
    held["size"] = layout.tail_offset + len(tail)
    seal_file(tmp, timeout_s)
    held["tmp"] = None  # committed: nothing to abort

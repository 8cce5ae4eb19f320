"""Gang tasks of tests/test_flush.py (module-level so spawn can pickle them): each rank a node
of its own (``GDS_PERSIST_NODE``), its local levels' share directories its own."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from _dist_tasks import make_state, mismatches

import gds_persist
from gds_persist import settings
from gds_persist.parallel.distributed import make_comm
from gds_persist.state.flatten import flatten
from gds_persist.training.tier import flush, shares

TIMEOUT_S = 60.0


def share_dir(level: str, rank: int, step: int) -> str:
    return os.path.join(level, "job", f"rank-{rank:05d}", f"step-{step:08d}")


def commit_shares(ctx: Any, levels: list[str], step: int) -> list[str]:
    """This rank's share of ``make_state(step)`` committed in every level (as the tier does);
    its copies, nearest first."""
    os.environ["GDS_PERSIST_NODE"] = f"node-{ctx.rank}"
    comm = make_comm(ctx.group(2), TIMEOUT_S)
    flat = flatten(make_state(step))
    nodes = [n for n in comm.all_gather_json(os.environ["GDS_PERSIST_NODE"], "nodes")]
    plan = shares.plan_shares([s.nbytes for s in flat.storages], nodes)
    dirs = [share_dir(level, ctx.rank, step) for level in levels]
    for d in dirs:
        shares.save_share(comm, d, flat, plan, None, step)
    return dirs


def flush_step(ctx: Any, share_dirs: list[list[str]], durable: str, step: int,
               kill_at_first_bytes: int = 0, **config: Any) -> dict[str, Any]:
    """:func:`flush.flush_step` on both ranks, each from its copies (``share_dirs``, by rank):
    its SaveInfo, or the error it raised.
    ``kill_at_first_bytes``: rank 0 SIGKILLs that process (the store's endpoint) once its
    first bytes are copied."""
    comm = make_comm(ctx.group(2), TIMEOUT_S)
    progress = None
    if kill_at_first_bytes and ctx.rank == 0:
        fired = threading.Event()

        def progress(n: int) -> None:
            if not fired.is_set():
                fired.set()
                os.kill(kill_at_first_bytes, signal.SIGKILL)
    try:
        with settings.set(object_attempts=2, **config):
            info = flush.flush_step(comm, share_dirs[ctx.rank], durable, step,
                                    progress=progress)
    except gds_persist.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"reason": info.reason, "files": info.files, "bytes": info.bytes_written}


def load_check(ctx: Any, durable: str, step: int, world: int) -> list[str] | None:
    """``durable`` loaded by a group of the first ``world`` ranks, against ``make_state(step)``."""
    group = ctx.group(world)
    if group is None:
        return None
    return mismatches(gds_persist.load(durable, process_group=group), make_state(step))


class Flushing:
    """A :class:`flush.Flusher` per worker, made and closed by tasks."""

    flusher: flush.Flusher | None = None
    stats = flush.FlushStats()
    lock = threading.Lock()


def open_flusher(ctx: Any, root: str, keep_last: int | None) -> bool:
    Flushing.stats, Flushing.lock = flush.FlushStats(), threading.Lock()
    Flushing.flusher = flush.Flusher(root, Flushing.stats, Flushing.lock, keep_last=keep_last,
                                     process_group="default", timeout_s=TIMEOUT_S)
    return Flushing.flusher.idle


def flush_in_background(ctx: Any, step: int, share_dirs: list[list[str]]) -> dict[str, Any]:
    """Start a flush (each rank from its copies), note that it runs in the background, wait
    for it: the stats after."""
    f = Flushing.flusher
    assert f is not None
    f.start(step, share_dirs[ctx.rank])
    busy = not f.idle  # cleared by start itself: the caller never starts a second one
    assert f.join(TIMEOUT_S), "the flush did not end in time"
    with Flushing.lock:
        return {"busy_after_start": busy, **vars(Flushing.stats)}


def close_flusher(ctx: Any) -> bool:
    assert Flushing.flusher is not None
    closed = Flushing.flusher.close(TIMEOUT_S)
    Flushing.flusher = None
    return closed


def publish(ctx: Any, root: str, step: int, keep_last: int | None) -> list[int]:
    return flush.publish(make_comm(ctx.group(2), TIMEOUT_S), root, step, keep_last)

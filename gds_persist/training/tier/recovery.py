"""Restore of a Checkpointer with a memory tier: each rank's bytes from the nearest complete,
verified copy - its node's memory, else a peer's replica (sent over the process group), else
the drive - at the newest step that every rank can restore.

The ranks first gather what each holds (:meth:`MemoryTier.inventory` and the drive's committed
steps); :func:`candidates` lists, newest first, the steps for which every rank has some copy.
Each candidate is tried in rounds that every rank takes part in: own memory copy (loaded with every
extent's CRC32C checked), then for the ranks still without a state a replica, copied back into
their memory directory (so the tier heals) and loaded the same way, then the drive (the ranks load
it together when all need it, else each alone). A copy that is missing, half-written (never
committed, so never listed) or corrupt falls through to the next source; a step some rank cannot
restore at all falls through to the next older candidate. A state is only returned once every
rank has one of the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from ...parallel.distributed import Comm
from .. import steps as _steps
from .memory import MemoryTier
from .replicate import transfer

SOURCES = ("memory", "replica", "drive")
LoadAlone = Callable[[str, bool], Any]  # (path, is the drive) -> state, this rank alone
LoadGroup = Callable[[str], Any]  # path -> state, every rank together


@dataclass
class Restored:
    state: Any
    step: int
    source: str  # where this rank's bytes came from: one of SOURCES
    sources: list[str]  # every rank's, by rank
    skipped: list[str] = field(default_factory=list)  # copies that were tried and failed, why
    seconds: float = 0.0


def _has_copy(invs: list[dict[str, Any]], drive: list[int], rank: int, step: int) -> bool:
    return (step in invs[rank]["own"] or step in drive
            or holder_of(invs, rank, step) is not None)


def holder_of(invs: list[dict[str, Any]], rank: int, step: int) -> int | None:
    """The first other rank after ``rank`` (cyclically) that holds a replica of its ``step``."""
    n = len(invs)
    for k in range(1, n):
        h = (rank + k) % n
        if step in invs[h]["replicas"].get(str(rank), []):
            return h
    return None


def candidates(invs: list[dict[str, Any]], drive: list[int]) -> list[int]:
    """The steps every rank has some copy of (own, a replica, the drive), newest first."""
    steps = set(drive)
    for inv in invs:
        steps.update(inv["own"])
        for held in inv["replicas"].values():
            steps.update(held)
    return sorted((s for s in steps if all(_has_copy(invs, drive, r, s)
                                           for r in range(len(invs)))), reverse=True)


def restore(comm: Comm, tier: MemoryTier, drive_root: str, load_alone: LoadAlone,
            load_group: LoadGroup) -> Restored:
    """Every rank calls it; returns this rank's state of the newest step all ranks restore."""
    t0 = time.perf_counter()
    mine = {**tier.inventory(), "drive": _steps.committed_steps(drive_root)}
    invs = comm.all_gather_json(mine, "memory tier inventory")
    drive = sorted(set.intersection(*(set(inv["drive"]) for inv in invs)))  # seen by every rank
    skipped: list[str] = []
    for step in candidates(invs, drive):
        state, source = _attempt(comm, tier, drive_root, invs, drive, step, load_alone,
                                 load_group, skipped)
        sources = comm.all_gather_json(source, f"restore of step {step}")
        if all(sources):
            return Restored(state, step, source or "", sources, skipped,
                            time.perf_counter() - t0)
        lost = [r for r, s in enumerate(sources) if not s]
        skipped.append(f"step {step}: no verified copy for ranks {lost}")
        del state
    raise CheckpointError(
        f"no step under {tier.root} (memory tier, every rank's node) or {drive_root} (drive) can "
        f"be restored by every rank; tried: {'; '.join(skipped) or 'nothing committed'}")


def _try(load: Callable[[], Any], what: str, skipped: list[str]) -> Any:
    try:
        return load()
    except (CheckpointError, OSError) as e:  # corrupt, truncated, half there: the next source
        skipped.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None


def _attempt(comm: Comm, tier: MemoryTier, drive_root: str, invs: list[dict[str, Any]],
             drive: list[int], step: int, load_alone: LoadAlone, load_group: LoadGroup,
             skipped: list[str]) -> tuple[Any, str | None]:
    """One round per source; every rank takes part in each (same collectives, same order)."""
    rank = comm.rank
    where = f"step {step} of rank {rank}"
    state, source = None, None
    if step in invs[rank]["own"]:
        state = _try(lambda: load_alone(tier.own_step(step), False), f"memory copy of {where}",
                     skipped)
        source = "memory" if state is not None else None
    need = comm.all_gather_json(state is None, f"replicas for step {step}")
    if any(need):
        via = {r: holder_of(invs, r, step) for r, n in enumerate(need) if n}
        outgoing = {r: tier.replica_step(r, step) for r, h in via.items() if h == rank}
        incoming = {h: tier.own_step(step) for r, h in via.items() if r == rank and h is not None}
        got = transfer(comm, outgoing, incoming, f"replica of step {step} back to its rank")
        if got:
            state = _try(lambda: load_alone(tier.own_step(step), False),
                         f"replica of {where} (from rank {got[0]})", skipped)
            source = "replica" if state is not None else None
    need = comm.all_gather_json(state is None, f"drive for step {step}")
    if not any(need) or step not in drive:
        return state, source
    path = _steps.step_path(drive_root, step)
    if all(need):  # the ranks read it once in total and share it
        state = _try(lambda: load_group(path), f"drive copy of step {step}", skipped)
    elif need[rank]:
        state = _try(lambda: load_alone(path, True), f"drive copy of {where}", skipped)
    return state, (source if not need[rank] else "drive" if state is not None else None)

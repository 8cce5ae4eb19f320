"""Restore of a Checkpointer with a memory tier: the newest step (or the one asked for) that the
ranks can restore, from the nearest verified copies - the shares in their nodes' memory, else
replicas of the missing shares on other nodes, else the drive.

The ranks first gather what each holds (:meth:`MemoryTier.inventory`, the *holdings*: which
rank's node holds a copy of which rank's share of which step, and the drive's committed steps);
:func:`candidates` lists, newest first, the steps every share of which some node holds, or that
the drive holds. For a step, every share gets one copy to read (:func:`assign`: its owner's
own, else the first replica after it); the ranks read and exchange them (:mod:`.reading`). A copy
that fails (missing, cut short, corrupt) is replaced by the next copy of that share and the
step is read again; a step whose shares cannot all be read is taken from the drive if it is
there (all ranks read it once together), else the next older candidate is tried. A state is only
returned once every rank has the same step, whole.
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
from .reading import Heal, Request, Source, read_step

SOURCES = ("memory", "replica", "drive")
LoadDrive = Callable[[str], tuple[Any, int]]  # path -> (state, payload bytes), ranks together
Inventory = list[dict[str, Any]]


@dataclass
class Restored:
    state: Any
    step: int
    source: str  # where this rank's share came from: one of SOURCES
    sources: list[str]  # every rank's, by rank
    skipped: list[str] = field(default_factory=list)  # copies that were tried and failed, why
    seconds: float = 0.0
    bytes_from: dict[str, int] = field(default_factory=dict)  # source -> bytes, all ranks
    heal: Heal | None = None  # this rank's own copy to rewrite (it came from a replica)


def holders_of(invs: Inventory, share: int, step: int) -> list[int]:
    """The ranks whose nodes hold a copy of rank ``share``'s share of ``step``: its own first,
    then the replica holders after it (cyclically)."""
    n = len(invs)
    own = [share] if step in invs[share]["own"] else []
    return own + [h for h in ((share + k) % n for k in range(1, n))
                  if step in invs[h]["replicas"].get(str(share), [])]


def holder_of(invs: Inventory, rank: int, step: int) -> int | None:
    """The first other rank (cyclically after ``rank``) holding a replica of its ``step``."""
    found = [h for h in holders_of(invs, rank, step) if h != rank]
    return found[0] if found else None


def in_memory(invs: Inventory, step: int) -> bool:
    return all(holders_of(invs, r, step) for r in range(len(invs)))


def candidates(invs: Inventory, drive: list[int]) -> list[int]:
    """The steps whose every share some node holds, or that the drive holds; newest first."""
    steps = set(drive)
    for inv in invs:
        steps.update(inv["own"])
        for held in inv["replicas"].values():
            steps.update(held)
    return sorted((s for s in steps if s in drive or in_memory(invs, s)), reverse=True)


def assign(invs: Inventory, step: int, bad: set[tuple[int, int]],
           tier: MemoryTier) -> dict[int, Source] | None:
    """One copy per share, the first that has not failed (None: some share has none left).
    The same on every rank but for ``path``, which is right on the holder."""
    out = {}
    for share in range(len(invs)):
        left = [h for h in holders_of(invs, share, step) if (share, h) not in bad]
        if not left:
            return None
        h = left[0]
        out[share] = Source(share, h, tier.own_step(step) if h == share
                            else tier.replica_step(share, step))
    return out


def restore(comm: Comm, tier: MemoryTier, drive_root: str, load_drive: LoadDrive,
            req: Request, step: int | None = None) -> Restored:
    """Every rank calls it; returns this rank's state of the newest step the ranks restore
    (``step``: that step only, from whichever tier holds it)."""
    t0 = time.perf_counter()
    mine = {**tier.inventory(), "drive": _steps.committed_steps(drive_root)}
    invs = comm.all_gather_json(mine, "memory tier inventory")
    drive = sorted(set.intersection(*(set(inv["drive"]) for inv in invs)))  # seen by every rank
    skipped: list[str] = []
    tried = [step] if step is not None else candidates(invs, drive)
    for s in tried:
        got = _from_memory(comm, tier, invs, s, req, skipped) if in_memory(invs, s) else None
        if got is None and s in drive:
            got = _from_drive(comm, drive_root, s, load_drive, skipped)
        if got is not None:
            got.skipped, got.seconds = skipped, time.perf_counter() - t0
            return got
        if not in_memory(invs, s) and s not in drive:
            skipped.append(f"step {s}: neither the memory tier nor the drive holds it whole")
    where = f"step {step}" if step is not None else "no step"
    raise CheckpointError(
        f"{where} under {tier.root} (memory tier, every rank's node) or {drive_root} (drive) can "
        f"be restored by every rank; tried: {'; '.join(skipped) or 'nothing committed'}")


def _from_memory(comm: Comm, tier: MemoryTier, invs: Inventory, step: int, req: Request,
                 skipped: list[str]) -> Restored | None:
    """Read the step's shares, another copy of a share after each failed one."""
    bad: set[tuple[int, int]] = set()
    while (chosen := assign(invs, step, bad, tier)) is not None:
        out = read_step(comm, step, chosen, req, tier.own_step(step))
        if not out.failures:
            sources = [chosen[r].kind for r in range(comm.size)]
            bytes_from: dict[str, int] = {}
            for k, n in out.share_bytes.items():
                bytes_from[chosen[k].kind] = bytes_from.get(chosen[k].kind, 0) + n
            return Restored(out.state, step, sources[comm.rank], sources,
                            bytes_from=bytes_from, heal=out.heal)
        for k, why in sorted(out.failures.items()):
            src = chosen[k]
            bad.add((k, src.holder))
            where = "memory copy" if src.kind == "memory" else f"replica on rank {src.holder}"
            skipped.append(f"{where} of step {step} of rank {k}: {why}")
    skipped.append(f"step {step}: some rank's share has no verified copy in any node's memory")
    return None


def _from_drive(comm: Comm, drive_root: str, step: int, load_drive: LoadDrive,
                skipped: list[str]) -> Restored | None:
    """Every rank reads the step from the drive together (each 1/N, then exchanged)."""
    try:
        state, payload = load_drive(_steps.step_path(drive_root, step))
    except (CheckpointError, OSError) as e:  # raised alike on every rank (the load agrees)
        text = str(e).splitlines()[0] if str(e) else ""
        skipped.append(f"drive copy of step {step}: {type(e).__name__}: {text}")
        return None
    return Restored(state, step, "drive", ["drive"] * comm.size, bytes_from={"drive": payload})

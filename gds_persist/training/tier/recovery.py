"""Restore of a Checkpointer with a memory tier: the newest step (or the one asked for) that the
ranks can restore, from the nearest verified copies - the shares in their nodes' memory, else
replicas of the missing shares on other nodes, else the drive.

The ranks first gather what each holds (:meth:`MemoryStore.inventory` and its node, the
*holdings*: which node holds a copy of which rank's share of which step, and the drive's
committed steps); :func:`candidates` lists, newest first, the steps every share of which some
node holds, or that the drive holds. For a step, :func:`plan_step` has every rank read the
shares its node holds and names, for each share a node lacks, the rank that sends it to each of
that node's ranks (:mod:`.reading`). A copy that fails (missing, cut short, corrupt) is left
out of the next plan and the step is read again; a step whose shares cannot all be read is
taken from the drive if it is there (all ranks read it once together), else the next older
candidate is tried. A state is only
returned once every rank has the same step, whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import CheckpointError
from ...parallel.distributed import Comm
from ...parallel.topology import node_name
from .. import steps as _steps
from .memory import MemoryStore, RankInventory
from .reading import Heal, Plan, Request, Source, read_step

SOURCES = ("memory", "replica", "drive")
LoadDrive = Callable[[str], tuple[Any, int]]  # path -> (state, payload bytes), ranks together
Inventory = list[RankInventory]
Holders = Callable[[list[str]], list[list[int]]]  # nodes by rank -> each rank's replica holders


@dataclass
class Restored:
    state: Any
    step: int
    source: str  # where this rank's share came from: one of SOURCES
    sources: list[str]  # every rank's, by rank
    skipped: list[str] = field(default_factory=list)  # copies that were tried and failed, why
    seconds: float = 0.0
    bytes_from: dict[str, int] = field(default_factory=dict)  # source -> bytes, all ranks
    heals: list[Heal] = field(default_factory=list)  # this rank's copies its node lacked


def copies(invs: Inventory, share: int, step: int, node: str) -> list[str]:
    """The kinds of copy of rank ``share``'s share of ``step`` in node ``node``'s memory, the
    nearest first: its owner's own ("memory", on the owner's node), then a replica."""
    out = []
    if invs[share].node == node and step in invs[share].own:
        out.append("memory")
    if any(inv.node == node and step in inv.replicas.get(str(share), []) for inv in invs):
        out.append("replica")
    return out


def holder_of(invs: Inventory, rank: int, step: int) -> int | None:
    """The first other rank (cyclically after ``rank``) holding a replica of its ``step``."""
    n = len(invs)
    found = [h for h in ((rank + k) % n for k in range(1, n))
             if step in invs[h].replicas.get(str(rank), [])]
    return found[0] if found else None


def in_memory(invs: Inventory, step: int) -> bool:
    """Some node holds a copy of every rank's share of ``step``."""
    nodes = {inv.node for inv in invs}
    return all(any(copies(invs, k, step, n) for n in nodes) for k in range(len(invs)))


def candidates(invs: Inventory, drive: list[int]) -> list[int]:
    """The steps whose every share some node holds, or that the drive holds; newest first."""
    steps = set(drive)
    for inv in invs:
        steps.update(inv.own)
        for held in inv.replicas.values():
            steps.update(held)
    return sorted((s for s in steps if s in drive or in_memory(invs, s)), reverse=True)


def plan_step(invs: Inventory, step: int, bad: set[tuple[int, str, str]],
              tier: MemoryStore) -> Plan | None:
    """Every rank reads the shares its node holds (the nearest copy that has not failed); the
    shares a node lacks are sent to each of its ranks by a rank of a node that has them, the
    least loaded first. None: some share has no copy left on any node. The same on every
    rank but for the paths, which are right on their node."""
    world = len(invs)
    reads: list[dict[int, Source]] = []
    for r in range(world):
        node, mine = invs[r].node, {}
        for k in range(world):
            kinds = [kind for kind in copies(invs, k, step, node) if (k, node, kind) not in bad]
            if kinds:
                path = (_steps.step_path(tier.rank_dir(k), step) if kinds[0] == "memory"
                        else tier.replica_step(k, step))
                mine[k] = Source(k, node, kinds[0], path)
        reads.append(mine)
    load = [0] * world
    sends = []
    for r in range(world):
        for k in range(world):
            if k in reads[r]:
                continue
            senders = [s for s in range(world) if k in reads[s]]
            if not senders:
                return None
            s = min(senders, key=lambda c: (load[c], (c - r) % world))
            load[s] += 1
            sends.append((k, s, r))
    return Plan(reads, sends)


def restore(comm: Comm, tier: MemoryStore, drive_root: str, load_drive: LoadDrive,
            req: Request, step: int | None = None, peer_timeout_s: float | None = None,
            holders: Holders | None = None) -> Restored:
    """Every rank calls it; returns this rank's state of the newest step the ranks restore
    (``step``: that step only, from whichever tier holds it). ``holders(nodes)``: by rank, the
    ranks keeping its replicas (the copies this rank rewrites when its node lacked them)."""
    t0 = time.perf_counter()
    mine = replace(tier.inventory(), node=node_name(),
                   drive=_steps.committed_steps(drive_root))
    invs = [RankInventory.from_wire(inv)
            for inv in comm.all_gather_json(mine.to_wire(), "memory tier inventory")]
    drive = sorted(set.intersection(*(set(inv.drive) for inv in invs)))  # seen by every rank
    skipped: list[str] = []
    tried = [step] if step is not None else candidates(invs, drive)
    for s in tried:
        keep = _keeps(comm.rank, tier, s, [inv.node for inv in invs], holders)
        got = (_from_memory(comm, tier, invs, s, req, skipped, peer_timeout_s, keep)
               if in_memory(invs, s) else None)
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


def _keeps(rank: int, tier: MemoryStore, step: int, nodes: list[str],
           holders: Holders | None) -> dict[int, Source]:
    """The copies of ``step`` this rank keeps: its own share, and the replicas it holds."""
    node = nodes[rank]
    out = {rank: Source(rank, node, "memory", tier.own_step(step))}
    for k, hs in enumerate(holders(nodes) if holders is not None else []):
        if rank in hs and k != rank:
            out[k] = Source(k, node, "replica", tier.replica_step(k, step))
    return out


def _from_memory(comm: Comm, tier: MemoryStore, invs: Inventory, step: int, req: Request,
                 skipped: list[str], peer_timeout_s: float | None,
                 keep: dict[int, Source]) -> Restored | None:
    """Read the step's shares; after a failed copy, plan again without it."""
    bad: set[tuple[int, str, str]] = set()
    while (plan := plan_step(invs, step, bad, tier)) is not None:
        out = read_step(comm, step, plan, req, keep, peer_timeout_s)
        if not out.failures:
            sources = [reads[r].kind if r in reads else "replica"
                       for r, reads in enumerate(plan.reads)]
            return Restored(out.state, step, sources[comm.rank], sources,
                            bytes_from=out.bytes_from, heals=out.heals)
        for (k, node, kind), why in sorted(out.failures.items()):
            bad.add((k, node, kind))
            skipped.append(f"{kind} copy of step {step} of rank {k}: {why} (node {node})")
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

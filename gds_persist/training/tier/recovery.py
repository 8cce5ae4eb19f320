"""Restore of a Checkpointer with node-local levels: the newest step (or the one asked for)
that the ranks can restore, share by share from the nearest verified copy - the node's own
(nearest level first), a peer node's copy, the durable level - else the durable level whole.

The ranks first gather what each holds (every level's :meth:`MemoryStore.inventory` and its
node: which node holds a copy of which rank's share of which step, and the drive's committed
steps); :func:`candidates` lists, newest first, the steps every share of which some node holds,
or that the durable level holds. For a step, :func:`plan_step` has every rank read the shares
its node holds and names, for each share a node lacks, the rank that sends it to each of that
node's ranks (:mod:`.reading`); a share no node holds is read once from the durable level's
step (a flushed step holds every share's file and the same manifest) and sent on. A copy that
fails (missing, cut short, corrupt) is left out of the next plan and the step is read again; a
step whose shares cannot all be read is taken from the durable level whole if it is there (all
ranks read it once together: a fresh job at another world size does this), else the next older
candidate is tried. A state is only returned once every rank has the same step, whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from ...parallel.distributed import Comm
from ...parallel.topology import node_name
from .. import steps as _steps
from .memory import MemoryStore, RankInventory
from .reading import Heal, Plan, Request, Source, read_step

LoadDrive = Callable[[str], tuple[Any, int]]  # path -> (state, payload bytes), ranks together
Inventory = list[RankInventory]
Holders = Callable[[list[str]], list[list[int]]]  # nodes by rank -> each rank's replica holders
DURABLE = "durable"  # the kind of a share read from the durable level's step


@dataclass(frozen=True)
class LevelView:
    """A node-local level as a restore sees it: its name and this rank's store of it."""

    name: str
    store: MemoryStore

    @property
    def replica_kind(self) -> str:
        return "replica" if self.name == "memory" else f"{self.name} replica"


@dataclass
class Restored:
    state: Any
    step: int
    source: str  # where this rank's share came from: a level's name, a replica, "drive"
    sources: list[str]  # every rank's, by rank
    skipped: list[str] = field(default_factory=list)  # copies that were tried and failed, why
    seconds: float = 0.0
    bytes_from: dict[str, int] = field(default_factory=dict)  # source -> bytes, all ranks
    heals: list[Heal] = field(default_factory=list)  # this rank's copies its node lacked


def copies(invs: Inventory, share: int, step: int, node: str,
           levels: list[LevelView]) -> list[tuple[str, str]]:
    """The copies of rank ``share``'s share of ``step`` in node ``node``'s levels, nearest
    first (by level, its owner's own before a replica): (kind, path on that node)."""
    out = []
    for i, level in enumerate(levels):
        if invs[share].node == node and step in invs[share].levels[i].own:
            out.append((level.name, _steps.step_path(level.store.rank_dir(share), step)))
        if any(inv.node == node and step in inv.levels[i].replicas.get(str(share), [])
               for inv in invs):
            out.append((level.replica_kind, level.store.replica_step(share, step)))
    return out


def held_shares(invs: Inventory, step: int, levels: list[LevelView]) -> set[int]:
    """The shares of ``step`` some node holds a copy of, in any level."""
    nodes = {inv.node for inv in invs}
    return {k for k in range(len(invs)) if any(copies(invs, k, step, n, levels) for n in nodes)}


def in_memory(invs: Inventory, step: int, levels: list[LevelView]) -> bool:
    """Some node holds a copy of every rank's share of ``step``."""
    return len(held_shares(invs, step, levels)) == len(invs)


def candidates(invs: Inventory, drive: list[int], levels: list[LevelView]) -> list[int]:
    """The steps whose every share some node holds, or that the drive holds; newest first."""
    steps = set(drive)
    for inv in invs:
        for held in inv.levels:
            steps.update(held.own)
            for got in held.replicas.values():
                steps.update(got)
    return sorted((s for s in steps if s in drive or in_memory(invs, s, levels)), reverse=True)


def plan_step(invs: Inventory, step: int, bad: set[tuple[int, str, str]],
              levels: list[LevelView], durable: str | None = None) -> Plan | None:
    """Every rank reads the shares its node holds (the nearest copy that has not failed); a
    share no node holds is read from the durable level's step ``durable`` (a path every rank
    sees) by the least loaded rank; the shares a node lacks are sent to each of its ranks by
    a rank that has them, the least loaded first. None: some share has no copy left. The same
    on every rank but for the node-local paths, which are right on their node."""
    world = len(invs)
    reads: list[dict[int, Source]] = []
    for r in range(world):
        node, mine = invs[r].node, {}
        for k in range(world):
            found = [(kind, path) for kind, path in copies(invs, k, step, node, levels)
                     if (k, node, kind) not in bad]
            if found:
                mine[k] = Source(k, node, *found[0])
        reads.append(mine)
    load = [len(m) for m in reads]
    for k in range(world):
        if any(k in m for m in reads):
            continue
        if durable is None or any(key[0] == k and key[2] == DURABLE for key in bad):
            return None
        r = min(range(world), key=lambda c: (load[c], (c - k) % world))
        reads[r][k] = Source(k, invs[r].node, DURABLE, durable)
        load[r] += 1
    load = [0] * world
    sends = []
    for r in range(world):
        for k in range(world):
            if k in reads[r]:
                continue
            senders = [s for s in range(world) if k in reads[s]]
            s = min(senders, key=lambda c: (load[c], (c - r) % world))
            load[s] += 1
            sends.append((k, s, r))
    return Plan(reads, sends)


def restore(comm: Comm, levels: list[LevelView], drive_root: str, load_drive: LoadDrive,
            req: Request, step: int | None = None, peer_timeout_s: float | None = None,
            holders: Holders | None = None) -> Restored:
    """Every rank calls it; returns this rank's state of the newest step the ranks restore
    (``step``: that step only, from whichever level holds it). ``holders(nodes)``: by rank, the
    ranks keeping its replicas in the nearest level (the copies this rank rewrites when its
    node lacked them)."""
    t0 = time.perf_counter()
    mine = RankInventory([level.store.inventory() for level in levels], node_name(),
                         _steps.committed_steps(drive_root))
    invs = [RankInventory.from_wire(inv)
            for inv in comm.all_gather_json(mine.to_wire(), "memory tier inventory")]
    drive = sorted(set.intersection(*(set(inv.drive) for inv in invs)))  # seen by every rank
    skipped: list[str] = []
    tried = [step] if step is not None else candidates(invs, drive, levels)
    for s in tried:
        keep = _keeps(comm.rank, levels[0], s, [inv.node for inv in invs], holders)
        durable = _steps.step_path(drive_root, s) if s in drive else None
        got = (_from_levels(comm, levels, invs, s, req, skipped, peer_timeout_s, keep, durable)
               if held_shares(invs, s, levels) and (durable or in_memory(invs, s, levels))
               else None)
        if got is None and s in drive:
            got = _from_drive(comm, drive_root, s, load_drive, skipped)
        if got is not None:
            got.skipped, got.seconds = skipped, time.perf_counter() - t0
            return got
        if not in_memory(invs, s, levels) and s not in drive:
            skipped.append(f"step {s}: neither the node-local levels nor the drive hold it "
                           "whole")
    where = f"step {step}" if step is not None else "no step"
    roots = ", ".join(level.store.root for level in levels)
    tried_text = "; ".join(skipped) or "nothing committed"
    raise CheckpointError(
        f"{where} under {roots} (node-local levels, every rank's node) or {drive_root} "
        f"(drive) can be restored by every rank; tried: {tried_text}")


def _keeps(rank: int, level: LevelView, step: int, nodes: list[str],
           holders: Holders | None) -> dict[int, Source]:
    """The copies of ``step`` this rank keeps in the nearest level: its own share, and the
    replicas it holds."""
    node, tier = nodes[rank], level.store
    out = {rank: Source(rank, node, level.name, tier.own_step(step))}
    for k, hs in enumerate(holders(nodes) if holders is not None else []):
        if rank in hs and k != rank:
            out[k] = Source(k, node, level.replica_kind, tier.replica_step(k, step))
    return out


def _from_levels(comm: Comm, levels: list[LevelView], invs: Inventory, step: int,
                 req: Request, skipped: list[str], peer_timeout_s: float | None,
                 keep: dict[int, Source], durable: str | None) -> Restored | None:
    """Read the step's shares; after a failed copy, plan again without it."""
    bad: set[tuple[int, str, str]] = set()
    while (plan := plan_step(invs, step, bad, levels, durable)) is not None:
        out = read_step(comm, step, plan, req, keep, peer_timeout_s)
        if not out.failures:
            sources = [reads[r].kind if r in reads else _sender_kind(plan, r)
                       for r, reads in enumerate(plan.reads)]
            return Restored(out.state, step, sources[comm.rank], sources,
                            bytes_from=out.bytes_from, heals=out.heals)
        for (k, node, kind), why in sorted(out.failures.items()):
            bad.add((k, node, kind))
            skipped.append(f"{kind} copy of step {step} of rank {k}: {why} (node {node})")
    skipped.append(f"step {step}: some rank's share has no verified copy in any node-local "
                   "level" + (" or the durable level" if durable else ""))
    return None


def _sender_kind(plan: Plan, rank: int) -> str:
    """Where the share of a rank that did not read it itself came from: the durable level, or
    a peer's copy ("replica")."""
    kinds = {reads[rank].kind for reads in plan.reads if rank in reads}
    return DURABLE if kinds == {DURABLE} else "replica"


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

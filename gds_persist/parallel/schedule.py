"""The data-parallel write scheduler: which rank writes which bytes, into which file. Pure data.

Data-parallel replicas hold identical state, so N writers can each write 1/N of it. The scheduler
splits by **byte ranges**, not whole tensors: the replicated storages are laid end to end, each at
the next ``ALIGNMENT``-aligned position (exactly the single-writer file layout), and that stream is
cut at aligned positions into one contiguous range per writer. A range maps back to whole storages
plus at most two partial ones, each cut at an aligned offset of its storage, so

* one dominant tensor (an embedding) is shared by as many writers as its size calls for;
* every writer's file is its range, byte for byte: every extent stays aligned, and the file sizes
  differ from the ideal share by less than one ``ALIGNMENT`` block;
* the plan is a function of the sizes and the topology only: deterministic, identical on every
  rank, and testable for any world size without processes.

Rank-local storages (e.g. ZeRO optimizer shards) are written by their owner into its own file;
the replicated shares are *water-filled* around them, so writers with more local bytes get fewer
replicated ones. Nothing here does I/O or calls ``torch.distributed``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..format import local_file_name, rank_data_file_name
from ..format.layout import FilePlan, Piece, layout_file, padded_total, split_stream


@dataclass(frozen=True)
class RankInfo:
    """What the scheduler knows about one rank (gathered from every rank before planning)."""

    rank: int
    node: str  # ranks with the same node share the node's drives (hostname, or GDS_PERSIST_NODE)
    affinity: str | None = None  # CPU socket / PCIe root of its GPU (NVML); None when unknown
    local_sizes: tuple[int, ...] = ()  # bytes of each of its rank-local storages


@dataclass(frozen=True)
class PlannedFile:
    plan: FilePlan  # extents carry global storage and file indices
    rank: int  # the rank that writes it
    dir: int  # index into the save's data directories; -1: the checkpoint directory
    kind: str  # "shared" (a share of the replicated state) or "local" (rank-local state)


@dataclass(frozen=True)
class DistributedPlan:
    """Every file of a data-parallel save, who writes it and where. Global storage numbering:
    replicated storages ``0..replicated_storages-1``, then each rank's local ones in rank order
    (``local_storage_base[r]`` is rank ``r``'s first)."""

    world_size: int
    nodes: tuple[tuple[int, ...], ...]  # the ranks of each node; nodes ordered by first rank
    writers: tuple[int, ...]  # ranks that write shares of the replicated state
    files: tuple[PlannedFile, ...]
    replicated_storages: int
    local_storage_base: tuple[int, ...]
    placement: str  # how the writers were chosen, for ``info``

    def files_of(self, rank: int) -> list[int]:
        return [i for i, f in enumerate(self.files) if f.rank == rank]

    @property
    def bytes_per_rank(self) -> tuple[int, ...]:
        out = [0] * self.world_size
        for f in self.files:
            out[f.rank] += f.plan.size
        return tuple(out)

    @property
    def total_bytes(self) -> int:
        return sum(f.plan.size for f in self.files)

    @property
    def writer_balance(self) -> float:
        """max/mean of the bytes each writer writes (1.0 is perfect)."""
        per_rank = self.bytes_per_rank
        return _balance([per_rank[r] for r in self.writers])

    @property
    def bytes_per_node(self) -> tuple[int, ...]:
        per_rank = self.bytes_per_rank
        return tuple(sum(per_rank[r] for r in ranks) for ranks in self.nodes)

    @property
    def node_balance(self) -> float:
        return _balance(self.bytes_per_node)

    def digest(self) -> str:
        """A short fingerprint, compared across ranks to prove they planned the same thing."""
        text = json.dumps([{"name": f.plan.name, "size": f.plan.size, "rank": f.rank,
                            "dir": f.dir, "extents": [e.to_wire() for e in f.plan.extents]}
                           for f in self.files])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, object]:
        per_rank = self.bytes_per_rank
        return {
            "world_size": self.world_size,
            "nodes": len(self.nodes),
            "writers": list(self.writers),
            "placement": self.placement,
            "bytes_per_rank": list(per_rank),
            "writer_balance": round(self.writer_balance, 6),
            "node_balance": round(self.node_balance, 6),
        }


def _balance(values: Sequence[int]) -> float:
    values = list(values)
    if not values or not sum(values):
        return 1.0
    return max(values) / (sum(values) / len(values))


def balanced_targets(total: int, preloaded: Sequence[int]) -> list[int]:
    """Split ``total`` bytes over parts that already carry ``preloaded`` bytes, so that the
    parts' totals are as equal as possible (water-filling). Integers; sums to ``total``."""
    n = len(preloaded)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (preloaded[i], i))
    level_sum = total
    k = 0
    for k in range(1, n + 1):
        level_sum += preloaded[order[k - 1]]
        if k == n or level_sum <= preloaded[order[k]] * k:
            break
    base, remainder = divmod(level_sum, k)
    targets = [0] * n
    for j, i in enumerate(order[:k]):
        targets[i] = base - preloaded[i] + (1 if j < remainder else 0)
    return targets


def node_order(ranks: Sequence[RankInfo]) -> tuple[tuple[int, ...], ...]:
    nodes: dict[str, list[int]] = {}
    for info in sorted(ranks, key=lambda r: r.rank):
        nodes.setdefault(info.node, []).append(info.rank)
    return tuple(tuple(v) for v in nodes.values())


def choose_writers(ranks: Sequence[RankInfo],
                   writers_per_node: int | None) -> tuple[tuple[int, ...], str]:
    """Which ranks write replicated bytes: every rank (``None``), or ``k`` per node spread over
    the node's affinity groups (sockets / PCIe roots) when every rank's is known, else evenly
    over its local ranks (GPUs are usually numbered socket by socket)."""
    if writers_per_node is not None and writers_per_node < 1:
        raise ValueError(f"writers_per_node={writers_per_node} must be at least 1 "
                         "(or None: every rank)")
    by_rank = {r.rank: r for r in ranks}
    chosen: list[int] = []
    how = set()
    for members in node_order(ranks):
        n = len(members)
        k = n if writers_per_node is None else min(writers_per_node, n)
        if k == n:
            chosen += members
            how.add("every rank writes" if writers_per_node is None
                    else "every rank of the node writes")
            continue
        affinities = [by_rank[r].affinity for r in members]
        if all(a is not None for a in affinities) and len(set(affinities)) > 1:
            groups: dict[str, list[int]] = {}
            for r in members:
                groups.setdefault(by_rank[r].affinity, []).append(r)  # type: ignore[arg-type]
            queues = list(groups.values())
            picked: list[int] = []
            while len(picked) < k:
                for q in queues:
                    if q and len(picked) < k:
                        picked.append(q.pop(0))
            chosen += sorted(picked)
            how.add(f"{k} per node, spread over {len(queues)} GPU affinity groups (NVML)")
        else:
            chosen += [members[(i * n) // k] for i in range(k)]
            how.add(f"{k} per node, evenly spaced by local rank (GPU affinity unknown)")
    return tuple(sorted(chosen)), "; ".join(sorted(how))


def plan_save(replicated_sizes: Sequence[int], ranks: Sequence[RankInfo], *,
              writers_per_node: int | None = None, data_dirs: int = 0) -> DistributedPlan:
    """Plan a data-parallel save.

    ``replicated_sizes``: bytes of each replicated storage (identical on every rank).
    ``ranks``: one :class:`RankInfo` per rank ``0..N-1``. ``data_dirs``: how many data
    directories each node stripes over (0: everything in the checkpoint directory); a node's
    ``j``-th writer writes into directory ``j % data_dirs``.
    """
    ranks = sorted(ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(len(ranks))) or not ranks:
        raise ValueError("ranks must describe ranks 0..N-1 exactly once")
    world = len(ranks)
    nodes = node_order(ranks)
    writers, placement = choose_writers(ranks, writers_per_node)

    replicated = len(replicated_sizes)
    bases, next_base = [], replicated
    for info in ranks:
        bases.append(next_base)
        next_base += len(info.local_sizes)

    # Each rank's drive: writers by their order among the node's writers, others by local rank.
    dir_of: dict[int, int] = {}
    for members in nodes:
        node_writers = [r for r in members if r in writers]
        others = [r for r in members if r not in writers]
        for j, r in enumerate(node_writers + others):
            dir_of[r] = j % data_dirs if data_dirs else -1

    local_bytes = {info.rank: padded_total(info.local_sizes) for info in ranks}
    targets = balanced_targets(padded_total(replicated_sizes), [local_bytes[r] for r in writers])
    shares = split_stream(replicated_sizes, targets)

    files: list[PlannedFile] = []
    for writer, pieces in zip(writers, shares, strict=True):
        if pieces:
            plan = layout_file(rank_data_file_name(writer), len(files), pieces)
            files.append(PlannedFile(plan, writer, dir_of[writer], "shared"))
    for info in ranks:
        pieces = [(bases[info.rank] + i, 0, n) for i, n in enumerate(info.local_sizes) if n]
        if pieces:
            plan = layout_file(local_file_name(info.rank), len(files), pieces)
            files.append(PlannedFile(plan, info.rank, dir_of[info.rank], "local"))
    return DistributedPlan(world, nodes, writers, tuple(files), replicated, tuple(bases), placement)


def plan_reads(lengths: Sequence[int], readers: int) -> list[list[Piece]]:
    """Split extents (by ``lengths``, in file order) over ``readers`` ranks for a load: equal
    contiguous byte ranges, extents cut at aligned offsets so every read stays aligned."""
    return split_stream(lengths, balanced_targets(padded_total(lengths), [0] * readers))

"""Byte-range balancing of DCP write items across ranks. Pure data, no I/O, no processes.

DCP's planner deduplicates replicated items by giving each one, whole, to one rank (the least
loaded so far, in item order). With one dominant replicated tensor (an embedding, a flat
optimizer buffer) one rank writes almost everything while the others idle. DCP's storage
interface lets the coordinator rewrite the per-rank plans in ``prepare_global_plan``, and every
rank that holds a replicated item can ``resolve_data`` it, so :class:`GdsPersistWriter` splits
large replicated items into 4096-aligned byte ranges written by several ranks, each range with
its own CRC32C extent.

:func:`balance` works on sizes only: ``holders[i]`` is the set of ranks that can write item ``i``
(one rank for a shard, all data-parallel ranks for a replicated tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 4096


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of item ``item`` are written by ``rank``."""

    item: int
    rank: int
    start: int
    stop: int


def _water_fill(
    size: int, holders: list[int], loads: list[int], align: int
) -> list[tuple[int, int]]:
    """Shares ``(rank, bytes)`` of ``size`` that bring the least-loaded holders to one level."""
    order = sorted(holders, key=lambda r: (loads[r], r))
    level = 0.0
    k = len(order)
    for n in range(1, len(order) + 1):
        level = (size + sum(loads[r] for r in order[:n])) / n
        if n == len(order) or level <= loads[order[n]]:
            k = n
            break
    chosen = sorted(order[:k])
    shares: list[tuple[int, int]] = []
    cum_float = 0.0
    prev = 0
    for i, r in enumerate(chosen):
        cum_float += max(0.0, level - loads[r])
        end = (
            size if i == len(chosen) - 1 else min(size, max(prev, round(cum_float / align) * align))
        )
        if end > prev:
            shares.append((r, end - prev))
        prev = end
    return shares


def balance(
    sizes: Sequence[int],
    holders: Sequence[Sequence[int]],
    world_size: int,
    *,
    split_min_bytes: int = 1 << 20,
    align: int = ALIGN,
) -> list[list[Piece]]:
    """Assign every item's bytes to ranks that hold it, minimising the largest per-rank total.
    Items held by one rank go to it; the others, largest first, are water-filled over their
    holders in byte ranges, or given whole to the least-loaded holder when small.

    Parameters:
        sizes: each item's bytes.
        holders: for each item, the ranks that can write it.
        world_size: the number of ranks.
        split_min_bytes: smaller items are never split.
        align: split points are multiples of this.

    Returns:
        Per item, its :class:`Piece` s in byte order (an empty item gets none).

    Raises:
        ValueError: lengths differ, a holder outside ``0..world_size-1``, a negative size.
    """
    if len(sizes) != len(holders):
        raise ValueError("sizes and holders must have the same length")
    loads = [0] * world_size
    out: list[list[Piece]] = [[] for _ in sizes]
    flexible = []
    for i, (size, hs) in enumerate(zip(sizes, holders, strict=False)):
        hs = sorted(set(hs))
        if not hs or any(r < 0 or r >= world_size for r in hs):
            raise ValueError(f"item {i} has holders {hs} outside 0..{world_size - 1}")
        if size < 0:
            raise ValueError(f"item {i} has a negative size")
        if len(hs) == 1:
            loads[hs[0]] += size
            if size:
                out[i].append(Piece(i, hs[0], 0, size))
        else:
            flexible.append((size, i, hs))
    for size, i, hs in sorted(flexible, key=lambda x: (-x[0], x[1])):
        if size == 0:
            continue
        if size >= split_min_bytes and size > align:
            start = 0
            for r, n in _water_fill(size, hs, loads, align):
                out[i].append(Piece(i, r, start, start + n))
                loads[r] += n
                start += n
        else:
            r = min(hs, key=lambda h: (loads[h], h))
            out[i].append(Piece(i, r, 0, size))
            loads[r] += size
    return out


def rank_bytes(pieces: Sequence[Sequence[Piece]], world_size: int) -> list[int]:
    """Bytes each rank writes under an assignment.

    Parameters:
        pieces: what :func:`balance` returned.
        world_size: the number of ranks.
    """
    totals = [0] * world_size
    for item in pieces:
        for p in item:
            totals[p.rank] += p.stop - p.start
    return totals

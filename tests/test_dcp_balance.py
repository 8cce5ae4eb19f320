"""The byte-range balancer of the DCP writer: pure data, tested for 1..1024 ranks, no processes."""

from __future__ import annotations

import random

import pytest

from gds_persist.parallel.balancing import ALIGN, balance, rank_bytes


def check_cover(sizes, holders, pieces):
    for i, (size, hs, ps) in enumerate(zip(sizes, holders, pieces, strict=False)):
        pos = 0
        for p in ps:
            assert p.item == i and p.start == pos and p.stop > p.start
            assert p.rank in hs, f"item {i} given to rank {p.rank}, not a holder"
            if p.stop != size:
                assert p.stop % ALIGN == 0
            pos = p.stop
        assert pos == size


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64, 1024])
def test_one_dominant_replicated_tensor_is_spread_evenly(world):
    sizes = [1 << 30] + [4096] * 10
    holders = [list(range(world))] * len(sizes)
    pieces = balance(sizes, holders, world)
    check_cover(sizes, holders, pieces)
    loads = rank_bytes(pieces, world)
    assert sum(loads) == sum(sizes)
    assert max(loads) <= sum(sizes) / world + ALIGN * 2 + 4096 * 10


def test_sharded_items_stay_with_their_rank_and_replicated_ones_fill_the_gaps():
    sizes = [8 << 20, 2 << 20, 6 << 20]
    holders = [[0], [1], [0, 1]]
    pieces = balance(sizes, holders, 2)
    check_cover(sizes, holders, pieces)
    assert rank_bytes(pieces, 2) == [8 << 20, 8 << 20]


def test_small_items_are_not_split():
    sizes = [100_000, 50_000]
    pieces = balance(sizes, [[0, 1], [0, 1]], 2, split_min_bytes=1 << 20)
    assert [len(p) for p in pieces] == [1, 1]
    assert {p[0].rank for p in pieces} == {0, 1}


def test_random_instances_are_covered_and_near_optimal():
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 40)
        n = rng.randint(0, 60)
        sizes = [rng.choice([0, 1, 4095, 4097, rng.randint(1, 1 << 26)]) for _ in range(n)]
        holders = []
        for _ in range(n):
            k = rng.randint(1, world)
            holders.append(rng.sample(range(world), k))
        pieces = balance(sizes, holders, world, split_min_bytes=1 << 16)
        check_cover(sizes, holders, pieces)
        loads = rank_bytes(pieces, world)
        assert sum(loads) == sum(sizes)
        if all(len(h) == world for h in holders):  # fully replicated: close to perfect
            assert max(loads) <= sum(sizes) / world + (1 << 16) + ALIGN * world


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="holders"):
        balance([10], [[3]], 2)
    with pytest.raises(ValueError, match="same length"):
        balance([10, 20], [[0]], 1)

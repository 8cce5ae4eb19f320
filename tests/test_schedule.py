"""The data-parallel write scheduler, with no processes: 1..1024 ranks, realistic state dicts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gds_persist.advice.scale import gpt_storage_sizes
from gds_persist.format import (
    ALIGNMENT,
    Manifest,
    StorageRecord,
    align_up,
    dump_manifest,
    parse_manifest,
)
from gds_persist.format.layout import split_stream
from gds_persist.parallel.schedule import (
    RankInfo,
    balanced_targets,
    choose_writers,
    plan_reads,
    plan_save,
)

WORLD_SIZES = [1, 2, 3, 4, 7, 8, 13, 64, 100, 128, 256, 1000, 1024]
GPUS_PER_NODE = 8


def _tiny_tensors_and_embedding() -> list[int]:
    rng = random.Random(7)
    return [50304 * 2048 * 4] + [rng.randrange(1, 4000) for _ in range(5000)]


STATES = {
    # GPT-2-small-like with mixed-precision Adam: embedding ~31% of the bytes, ~740 storages
    "gpt-125M": gpt_storage_sizes(125e6),
    # GPT-3-1.3B-like: ~1460 storages, 18 GB
    "gpt-1.3B": gpt_storage_sizes(1.3e9),
    # one dominant embedding and thousands of tiny tensors (norms, biases, Adam steps)
    "embedding+5000-tiny": _tiny_tensors_and_embedding(),
}


def _ranks(world: int, per_node: int = GPUS_PER_NODE, affinity: bool = False,
           local: list[int] | None = None) -> list[RankInfo]:
    return [RankInfo(r, f"node{r // per_node}",
                     f"numa{(r % per_node) * 2 // per_node}" if affinity else None,
                     tuple(n for n in local[r:r + 1] if n) if local else ())
            for r in range(world)]


def _check_plan_is_valid(sizes: list[int], plan) -> None:  # noqa: ANN001
    """Every extent aligned and inside its file, files contiguous, every byte covered exactly
    once: checked by the format's own manifest validator."""
    storages = [StorageRecord(n, "cpu") for n in sizes]
    extents = []
    for index, f in enumerate(plan.files):
        offset = 0
        for e in f.plan.extents:
            assert e.file == index and e.offset == offset and e.start % ALIGNMENT == 0
            offset = align_up(offset + e.length)
        assert offset == f.plan.size  # no holes: a writer's file is its range, byte for byte
        extents += f.plan.extents
    m = Manifest([f.plan.data_file for f in plan.files], storages, [], extents, None, {})
    parse_manifest(dump_manifest(m), "planned manifest")


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_writer_gets_an_equal_aligned_share(state: str, world: int) -> None:
    sizes = STATES[state]
    plan = plan_save(sizes, _ranks(world))
    assert plan.writers == tuple(range(world))
    assert plan.writer_balance <= 1.01, plan.bytes_per_rank
    if world % GPUS_PER_NODE == 0:
        assert plan.node_balance <= 1.01
    assert plan.total_bytes == sum(align_up(n) for n in sizes)
    per_writer = plan.bytes_per_rank
    ideal = plan.total_bytes / world
    assert all(abs(b - ideal) <= ALIGNMENT for b in per_writer)
    if world in (1, 7, 64, 1024):  # the full validation costs a JSON round trip
        _check_plan_is_valid(sizes, plan)


def test_a_dominant_tensor_is_split_across_writers() -> None:
    sizes = STATES["embedding+5000-tiny"]
    plan = plan_save(sizes, _ranks(64))
    holders = {f.rank for f in plan.files for e in f.plan.extents if e.storage == 0}
    assert len(holders) >= 60  # whole-tensor assignment would leave 63 ranks nearly idle


@pytest.mark.parametrize("world", [1, 3, 64, 1024])
def test_plan_is_deterministic(world: int) -> None:
    sizes = STATES["gpt-125M"]
    ranks = _ranks(world)
    shuffled = ranks[:]
    random.Random(world).shuffle(shuffled)
    a, b = plan_save(sizes, ranks), plan_save(sizes, shuffled)
    assert a == b and a.digest() == b.digest()


def test_writers_per_node_spread_over_affinity_groups() -> None:
    ranks = _ranks(32, affinity=True)  # 4 nodes; local ranks 0-3 on numa0, 4-7 on numa1
    writers, how = choose_writers(ranks, 2)
    assert writers == (0, 4, 8, 12, 16, 20, 24, 28) and "affinity groups" in how
    writers, _ = choose_writers(ranks, 4)
    assert writers[:4] == (0, 1, 4, 5)
    writers, how = choose_writers(_ranks(32), 2)  # affinity unknown: evenly spaced
    assert writers[:2] == (0, 4) and "evenly spaced" in how
    writers, _ = choose_writers(_ranks(32), 4)
    assert writers[:4] == (0, 2, 4, 6)
    assert choose_writers(_ranks(32), 100)[0] == tuple(range(32))
    with pytest.raises(ValueError, match="at least 1"):
        choose_writers(ranks, 0)


def test_k_writers_per_node_balance_nodes_and_drives() -> None:
    sizes = STATES["gpt-1.3B"]
    plan = plan_save(sizes, _ranks(1024), writers_per_node=2, data_dirs=2)
    assert len(plan.writers) == 256 and len(plan.nodes) == 128
    assert plan.writer_balance <= 1.01 and plan.node_balance <= 1.01
    for f in plan.files:  # each node's two writers on its two drives
        assert f.dir == (0 if f.rank % 8 == 0 else 1)
    idle = set(range(1024)) - set(plan.writers)
    assert all(plan.bytes_per_rank[r] == 0 for r in idle)


def test_node_membership_comes_from_the_ranks_not_a_constant() -> None:
    ranks = [RankInfo(r, "a" if r in (0, 3, 5) else "b") for r in range(6)]
    plan = plan_save([1 << 20], ranks, writers_per_node=1)
    assert plan.nodes == ((0, 3, 5), (1, 2, 4)) and plan.writers == (0, 1)


def test_data_dirs_round_robin_per_node() -> None:
    plan = plan_save([1 << 24], _ranks(16), data_dirs=3)
    assert [f.dir for f in plan.files] == [r % 8 % 3 for r in range(16)]
    assert {f.dir for f in plan_save([1 << 24], _ranks(4)).files} == {-1}


def test_rank_local_bytes_are_water_filled() -> None:
    local = [8 << 20, 0, 2 << 20, 0]
    sizes = [16 << 20]
    plan = plan_save(sizes, _ranks(4, local=local))
    per_rank = plan.bytes_per_rank
    assert sum(per_rank) == (16 << 20) + (10 << 20)
    # rank 0 already writes 8 MiB of its own: it gets no replicated bytes; the rest level out
    assert per_rank[0] == 8 << 20
    assert max(per_rank[1:]) - min(per_rank[1:]) <= ALIGNMENT
    local_files = [f for f in plan.files if f.kind == "local"]
    assert [(f.rank, f.plan.name) for f in local_files] == [
        (0, "local-r00000-00000.bin"), (2, "local-r00002-00000.bin")]
    assert plan.local_storage_base == (1, 2, 2, 3)
    assert [e.storage for f in local_files for e in f.plan.extents] == [1, 2]


def test_empty_and_zero_size_state() -> None:
    assert plan_save([], _ranks(4)).files == ()
    plan = plan_save([0, 0, 5, 0], _ranks(3))
    assert [len(f.plan.extents) for f in plan.files] == [1]
    with pytest.raises(ValueError, match="ranks 0..N-1"):
        plan_save([1], [RankInfo(1, "n")])


@given(st.integers(0, 1 << 40), st.lists(st.integers(0, 1 << 40), min_size=1, max_size=50))
def test_balanced_targets(total: int, preloaded: list[int]) -> None:
    targets = balanced_targets(total, preloaded)
    assert sum(targets) == total and min(targets) >= 0
    finals = [t + p for t, p in zip(targets, preloaded, strict=True)]
    level = max(f for f, t in zip(finals, targets, strict=True) if t > 0) if total else 0
    for f, t in zip(finals, targets, strict=True):
        if t > 0:
            assert f >= level - 1  # everyone who got bytes ends within one byte of the level
        else:
            assert f >= level - 1 or total == 0


@settings(max_examples=200)
@given(st.lists(st.integers(0, 40000), max_size=40), st.integers(1, 40))
def test_split_stream_covers_everything_exactly(sizes: list[int], parts: int) -> None:
    shares = split_stream(sizes, balanced_targets(sum(align_up(n) for n in sizes), [0] * parts))
    assert len(shares) == parts
    covered: dict[int, list[tuple[int, int]]] = {}
    for pieces in shares:
        for index, start, length in pieces:
            assert start % ALIGNMENT == 0 and length > 0
            covered.setdefault(index, []).append((start, length))
    for index, n in enumerate(sizes):
        position = 0
        for start, length in sorted(covered.get(index, [])):
            assert start == position
            position += length
        assert position == n


def test_read_plan_is_balanced_and_aligned() -> None:
    lengths = STATES["gpt-125M"]
    for readers in (1, 2, 3, 7, 64):
        parts = plan_reads(lengths, readers)
        loads = [sum(align_up(n) for _, _, n in p) for p in parts]
        assert max(loads) - min(loads) <= 2 * ALIGNMENT
        assert all(s % ALIGNMENT == 0 for p in parts for _, s, _ in p)

"""Data-parallel save and load with real gloo process groups (4 spawned processes, reused).

Save with 1..4 ranks, load with 1 (no process group, in this process), 2 and 3 ranks, every load
strategy: bit-exact, tied weights still tied. Rank-local parts come back to their rank. A rank that
fails mid-save makes every rank raise, naming it; nothing is committed; the previous checkpoint is
intact. Replicas that differ are reported. A rank that never joins cannot make another hang.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import _dist_tasks as tasks
import pytest
import torch
from _gang import Gang

import gds_persist
from gds_persist import LoadOptions, SaveOptions

pytestmark = pytest.mark.slow
WORLD = 4
STRATEGIES = ("allgather", "broadcast", "read_all")


@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(WORLD, timeout_s=60) as g:
        yield g


@pytest.fixture(scope="module")
def saved(gang: Gang, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same replicated state saved by 1, 2, 3 and 4 ranks."""
    root = tmp_path_factory.mktemp("dp")
    out = {}
    for n in range(1, WORLD + 1):
        path = root / f"saved-by-{n}"
        infos = [i for i in gang.run(tasks.save, n, str(path)) if i is not None]
        assert len(infos) == n and {i["type"] for i in infos} == {"DistributedSaveInfo"}
        assert infos[0]["writers"] == list(range(n))
        files = sorted(f for i in infos for f in i["rank_files"])
        assert files == [f"data-r{r:05d}-00000.bin" for r in range(n)]
        out[n] = path
    return out


def _data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.name != "manifest.json")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_single_process_without_group_loads_any_world_size(saved: dict[int, Path], n: int) -> None:
    m = gds_persist.read_manifest(saved[n])
    assert m.version == 1  # replicated-only saves stay readable by version-1 readers
    assert m.writer["world_size"] == n and len(m.files) == n
    assert tasks.check_loaded(gds_persist.load(saved[n])) == []
    assert gds_persist.verify(saved[n]).ok


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_any_world_size_loads_any_world_size(gang: Gang, saved: dict[int, Path], n: int) -> None:
    for m in (1, 2, 3):
        for strategy in STRATEGIES:
            results = [r for r in gang.run(tasks.load_check, m, str(saved[n]), strategy) if r]
            assert len(results) == m
            for rank, r in enumerate(results):
                assert r["problems"] == [], (n, m, strategy, rank)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restore_in_place_with_a_process_group(gang: Gang, saved: dict[int, Path],
                                               strategy: str) -> None:
    """Each rank reads its share straight into its live tensors and the exchange lands there
    too: same objects, same addresses, saved bytes, ties and views intact."""
    for n, m in ((2, 3), (3, 2)):
        results = [r for r in gang.run(tasks.load_into_check, m, str(saved[n]), strategy)
                   if r is not None]
        assert results == [[]] * m, (n, m, strategy, results)


def test_replicated_data_is_read_once_in_total(gang: Gang, saved: dict[int, Path]) -> None:
    path = saved[2]
    data = _data_bytes(path)
    manifest = (path / "manifest.json").stat().st_size
    shared = [r["read"] for r in gang.run(tasks.load_check, 3, str(path), "allgather") if r]
    every = [r["read"] for r in gang.run(tasks.load_check, 3, str(path), "read_all") if r]
    assert sum(shared) <= data + 3 * manifest + 3 * 4096, (shared, data)
    assert max(shared) < 0.6 * data  # each rank read about a third
    assert sum(every) >= 3 * data  # every rank read everything itself


def test_rank_local_parts_return_to_their_rank(gang: Gang, tmp_path: Path) -> None:
    path = tmp_path / "zero"
    infos = gang.run(tasks.save, WORLD, str(path), with_local=True)
    assert sorted(f for i in infos for f in i["rank_files"] if f.startswith("local")) == [
        f"local-r{r:05d}-00000.bin" for r in range(WORLD)]
    m = gds_persist.read_manifest(path)
    assert m.version == 2 and [s.rank for s in m.sections] == list(range(WORLD))
    for strategy in ("allgather", "read_all"):
        results = gang.run(tasks.load_check, WORLD, str(path), strategy, "own")
        assert [r["problems"] for r in results] == [[]] * WORLD
    # one process, no group: every rank's parts, by rank; or one chosen rank's
    everything = gds_persist.load(path)
    assert tasks.check_loaded(everything, {r: tasks.make_local(r) for r in range(WORLD)}) == []
    assert tasks.check_loaded(gds_persist.load(path, options=gds_persist.LoadOptions(rank_local=2)),
                              tasks.make_local(2)) == []
    # another world size cannot guess who gets which shard, and says what to do
    errors = [e for e in gang.run(tasks.load_expect_error, 2, str(path)) if e]
    assert all(e["type"] == "ManifestError" and "rank_local='all'" in e["message"] for e in errors)
    results = [r for r in gang.run(tasks.load_check, 3, str(path), "broadcast", "all") if r]
    assert [r["problems"] for r in results] == [[]] * 3


def test_rank_failing_mid_save_fails_every_rank_and_keeps_previous(gang: Gang,
                                                                   tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    gang.run(tasks.save, WORLD, str(path))  # the previous checkpoint
    before = (path / "manifest.json").read_bytes()
    dirs = [tmp_path / f"nvme{i}" for i in range(WORLD)]
    for d in dirs:
        d.mkdir()
    (tmp_path / "nvme2" / "ckpt-dir").write_text("rank 2's drive is not a directory")
    roots = [str(d) for d in dirs[:2]] + [str(tmp_path / "nvme2" / "ckpt-dir"), str(dirs[3])]
    results = gang.run(tasks.save_expect_error, WORLD, str(path), "none",
                       options=SaveOptions(data_dirs=roots))
    for rank, r in enumerate(results):
        assert r["type"] == "DistributedError", (rank, r)
        assert "CheckpointError" in r["mro"]
        assert r["failed_ranks"] == [2]
        assert "phase 'write'" in r["message"] and "rank 2 raised" in r["message"]
        assert "Error" in r["message"].split("rank 2 raised", 1)[1]  # the cause, by type
        assert "intact" in r["message"]
        assert r["seconds"] < 30
    assert (path / "manifest.json").read_bytes() == before
    assert tasks.check_loaded(gds_persist.load(path)) == []
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []  # no temporary left
    for d in (dirs[0], dirs[1], dirs[3]):
        assert os.listdir(d) == []  # what the other ranks wrote was removed


@pytest.mark.parametrize("kind,check,detail", [
    ("shape", "structure", "['model']['qkv']: shape [64, 100] (rank 0: [64, 99])"),
    ("key", "structure", "['optimizer']: keys differ from rank 0's (extra: ['extra']"),
    ("values", "checksums", "['model']['ids']: same shape and dtype, different values"),
])
def test_differing_replicas_are_reported(gang: Gang, tmp_path: Path, kind: str, check: str,
                                         detail: str) -> None:
    path = tmp_path / "ckpt"
    results = gang.run(tasks.save_expect_error, WORLD, str(path), kind,
                       options=SaveOptions(check_replicas=check))
    bad = {"shape": 1, "key": 2, "values": 3}[kind]
    for r in results:
        assert r["type"] == "ReplicationError" and "DistributedError" in r["mro"]
        assert r["failed_ranks"] == [bad]
        assert (f"rank {bad}: tensor {detail}" in r["message"]
                or f"rank {bad}: {detail}" in r["message"]), r["message"]
    assert not path.exists()


def test_differing_values_pass_a_structure_check(gang: Gang, tmp_path: Path) -> None:
    """Documented: only check_replicas='checksums' compares the bytes themselves."""
    results = gang.run(tasks.save_expect_error, WORLD, str(tmp_path / "c"), "values")
    assert [r["type"] for r in results] == [None] * WORLD


def test_writers_per_node_and_data_dirs(gang: Gang, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    infos = gang.run(tasks.save_as_nodes, str(path), 2, options=SaveOptions(
        writers_per_node=1, data_dirs=[str(r) for r in roots]))
    assert infos[0]["writers"] == [0, 2]  # one per node, from hostnames (here GDS_PERSIST_NODE)
    assert [bool(i["rank_files"]) for i in infos] == [True, False, True, False]
    assert "1 per node" in infos[0]["placement"] and "NVML" in infos[0]["placement"]
    m = gds_persist.read_manifest(path)
    assert m.version == 2 and [d.root for d in m.dirs] == [str(roots[0])]
    assert os.listdir(path) == ["manifest.json"]
    assert tasks.check_loaded(gds_persist.load(path)) == []
    results = gang.run(tasks.load_check, 3, str(path), "allgather")
    assert [r["problems"] for r in results if r] == [[]] * 3
    # every rank writes, over both directories; the replaced checkpoint's stripe is removed
    gang.run(tasks.save_as_nodes, str(path), 2,
             options=SaveOptions(data_dirs=[str(r) for r in roots]))
    m = gds_persist.read_manifest(path)
    assert [d.root for d in m.dirs] == [str(r) for r in roots]
    assert [len(os.listdir(r)) for r in roots] == [1, 1]
    moved = tmp_path / "moved"
    os.rename(roots[1], moved)
    with pytest.raises(gds_persist.TruncatedError, match="missing"):
        gds_persist.load(path)
    out = gds_persist.load(path,
                           options=gds_persist.LoadOptions(data_dirs={str(roots[1]): str(moved)}))
    assert tasks.check_loaded(out) == []
    assert gds_persist.verify(path, data_dirs=[str(roots[0]), str(moved)]).ok


def test_corrupted_shared_extent_fails_every_rank(gang: Gang, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    gang.run(tasks.save, 2, str(path))
    m = gds_persist.read_manifest(path)
    big = max(m.extents, key=lambda e: e.length)  # the embedding, split across ranks on load
    with open(path / m.files[big.file].name, "r+b") as f:
        f.seek(big.offset + big.length - 3)
        byte = f.read(1)
        f.seek(big.offset + big.length - 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    for strategy in ("allgather", "broadcast"):
        errors = [e for e in gang.run(tasks.load_expect_error, 3, str(path),
                                      options=LoadOptions(strategy=strategy)) if e]
        assert len(errors) == 3
        for e in errors:
            assert e["type"] == "ChecksumError", e
            assert "['model']['wte']" in e["message"] and f"offset {big.offset}" in e["message"]
    errors = [e for e in gang.run(tasks.load_expect_error, 3, str(path),
                                  options=LoadOptions(strategy="read_all")) if e]
    assert all("ChecksumError" in e["message"] and "['model']['wte']" in e["message"]
               for e in errors)


def test_manifest_records_the_plan(saved: dict[int, Path]) -> None:
    raw = json.loads((saved[4] / "manifest.json").read_text())
    plan = raw["body"]["writer"]["plan"]
    assert plan["world_size"] == 4 and plan["writers"] == [0, 1, 2, 3]
    assert plan["writer_balance"] < 1.1  # a ~0.5 MB state over 4 ranks: within a block each


def test_zero_optimizer_shards_resume_exactly(gang: Gang, tmp_path: Path) -> None:
    """docs/DISTRIBUTED.md's ZeRO example, run: resuming from the checkpoint is bit-exact."""
    results = [r for r in gang.run(tasks.zero_resume, str(tmp_path / "zero")) if r]
    assert all(r["shard_back"] and r["same"] for r in results), results
    assert sum(r["own_shard_tensors"] for r in results) == 4  # 4 parameters, sharded by rank
    m = gds_persist.read_manifest(tmp_path / "zero")
    assert [s.rank for s in m.sections] == [0, 1]


# --- issue 13: incremental and compressed data-parallel saves -------------------------------

@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_incremental_data_parallel_save(gang: Gang, tmp_path: Path, compression: str) -> None:
    """Each rank refers to the base for the unchanged units of its own share; every load
    strategy gets the exact state back (encoded extents are read whole by every rank)."""
    first = [i for i in gang.run(tasks.save_incremental, 3, str(tmp_path / "s1"), None, False,
                                 with_local=True, compression=compression) if i]
    assert len(first) == 3 and all(i["referenced"] == 0 for i in first)
    second = [i for i in gang.run(tasks.save_incremental, 3, str(tmp_path / "s2"),
                                  str(tmp_path / "s1"), True, with_local=True,
                                  compression=compression) if i]
    referenced = second[0]["referenced"]
    assert all(i["referenced"] == referenced for i in second)
    assert second[0]["payload"] - referenced < 40_000  # qkv, one exp_avg, rank 1's shard
    m = gds_persist.read_manifest(tmp_path / "s2")
    assert m.version == 4 and [b.name for b in m.bases] == ["s1"]
    assert m.referenced_bytes == referenced
    if compression == "lossless":
        assert any(e.encoded for e in m.extents)
    whole = gds_persist.load(tmp_path / "s2")
    assert tasks.mismatches(whole["model"], tasks.modified_state()["model"]) == []
    assert gds_persist.verify(tmp_path / "s2").ok
    for strategy in STRATEGIES:
        for problems in gang.run(tasks.load_modified, 3, str(tmp_path / "s2"), strategy):
            assert problems in (None, []), (strategy, problems)


def test_a_rank_that_never_joins_cannot_hang_the_others(gang: Gang, tmp_path: Path) -> None:
    """Last: leaves the group broken (rank 0 gave up on a collective the others never made)."""
    path = tmp_path / "ckpt"
    result = gang.run(tasks.hang_one, str(path), 2.0)[0]
    gang.broken = True
    assert result["type"] == "CollectiveTimeoutError", result
    assert "phase 'prepare'" in result["message"] and "collective_timeout_s" in result["message"]
    assert "intact" in result["message"]
    assert 2.0 <= result["seconds"] < 20
    assert not path.exists() and [e for e in os.listdir(tmp_path) if e.startswith(".")] == []


def test_torch_is_cpu_here() -> None:
    """The gang uses gloo on CPU; NCCL paths are exercised only on GPU machines."""
    assert torch.distributed.is_available()


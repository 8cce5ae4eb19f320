"""The memory tier of Checkpointer (docs/RECOVERY.md): node memory, replicas on peer nodes, the
drive as the last resort.

The fault tests run a real job: 4 processes in a gloo group acting as 2 nodes x 2 ranks
(``GDS_PERSIST_NODE``, a memory_root per node), training deterministically
(tests/tier_worker.py), killed with SIGKILL, their node memory deleted or corrupted, and started
again the way an elastic launcher restarts a job. Every restore is compared bit for bit with the
uninterrupted run, on every rank, at the same step (no lost, no mixed state).
``GDS_PERSIST_TIER_RUNS`` sets how many runs each fault test makes (default 1; the issue's
target is 3: ``GDS_PERSIST_TIER_RUNS=3``).
"""

from __future__ import annotations

import functools
import glob
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import gds_persist
from gds_persist import MemoryTier
from gds_persist.training.tier import recovery, replicate, shares
from gds_persist.training.tier.memory import (
    Holdings,
    MemoryStore,
    RankInventory,
    job_name,
    lacks_room,
)
from tests.forkserver import ForkServer
from tests.tier_worker import Job, reference, reference_tensors

RUNS = int(os.environ.get("GDS_PERSIST_TIER_RUNS", "1"))
REF = reference(40)


def _mem(job: Job, rank: int) -> str:
    return os.path.join(job.memory_root(rank), job_name(os.path.join(job.base, "drive")))


def _check_restored(results: list[dict], sources: list[str], step: int | None = None) -> int:
    """Every rank restored the same step, bit for bit as the uninterrupted run, from where
    ``sources`` says; and trained on to the uninterrupted result."""
    steps = {r["restore_step"] for r in results}
    assert len(steps) == 1, f"ranks restored different steps: {steps}"
    got = steps.pop()
    assert step is None or got == step
    assert [r["restored_from"] for r in results] == sources, [r["restore_skipped"]
                                                              for r in results]
    assert all(r["restore_sources"] == sources for r in results)
    for r in results:
        if r["restored"] != REF[got]:
            expected = reference_tensors(got)
            differ = sorted(k for k, v in r["restored_tensors"].items() if expected.get(k) != v)
            alike = [o["rank"] for o in results if o["restored"] == r["restored"]]
            raise AssertionError(
                f"rank {r['rank']}: state of step {got} differs from the uninterrupted run's "
                f"in tensors {differ}; ranks {alike} restored the same state; "
                f"stages {r['restore_stages']}; skipped {r['restore_skipped']}; "
                f"bytes {r['restore_bytes']}; steps trained otherwise than the uninterrupted "
                f"run: {_trained_otherwise(r['base']) or 'none'}")
    print(f"restored step {got}: ranks' shares from {sources}, bytes by source "
          f"{results[0]['restore_bytes']}, skipped {results[0]['restore_skipped']}")
    return got


def _trained_otherwise(base: str) -> list[str]:
    """Each incarnation's ranks' training steps (their logs' digests) unlike the uninterrupted
    run's: where a wrong state came from, if it was trained, not restored, wrong."""
    wrong = []
    for path in sorted(glob.glob(os.path.join(base, "log-*.txt"))):
        with open(path) as f:
            for line in f:
                if line.startswith("changed while saved "):
                    wrong.append(f"{os.path.basename(path)}: {line.strip()}")
                if line.startswith("trained "):
                    _, step, got = line.split()
                    if got != REF[int(step)]:
                        wrong.append(f"{os.path.basename(path)} step {step}")
    return wrong


def _finished(results: list[dict], stop: int) -> None:
    wrong = [r["rank"] for r in results if r["final"] != REF[stop]]
    where = [r.get("restored_from") for r in results]
    assert not wrong, (f"ranks {wrong} trained on to another state of step {stop} than the "
                       f"uninterrupted run's (restored from {where}); steps trained otherwise: "
                       f"{_trained_otherwise(results[0]['base'])}")


# ---------------------------------------------------------------- pure rules


def test_holders_spread_copies_over_other_nodes():
    for nodes, count in ((["a", "a", "b", "b"], 1), (["a", "b", "c"] * 3, 2), (["x"] * 3, 0)):
        plan = replicate.holders(nodes, count)
        loads = [sum(r in hs for hs in plan) for r in range(len(nodes))]
        assert max(loads) - min(loads) <= 1  # evenly spread
        for r, hs in enumerate(plan):
            assert len(hs) == count and len({nodes[h] for h in hs} | {nodes[r]}) == count + 1
    with pytest.raises(gds_persist.CheckpointError, match="replicas=1 .* need 2 nodes.*spans 1"):
        replicate.holders(["a", "a"], 1)


def test_lacks_room_counts_a_nodes_ranks_and_replicas_together():
    nodes, plan = ["a", "a", "b", "b"], replicate.holders(["a", "a", "b", "b"], 1)
    assert lacks_room([10] * 4, [40] * 4, nodes, plan) is None  # 2 own + 2 replicas per node
    why = lacks_room([10] * 4, [40, 40, 39, 39], nodes, plan)
    assert why is not None and "node 'b'" in why and "remount" in why


def test_shares_split_the_state_once_over_the_ranks():
    """(1 + replicas) x state x ranks_on_node / world per node, plus a manifest per share."""
    sizes = [100 << 20, 3 << 20, 5000, 1 << 20]
    nodes = ["a", "a", "b", "b"]
    plan = shares.plan_shares(sizes, nodes)
    per_rank = plan.bytes_per_rank
    total = sum((n + 4095) // 4096 * 4096 for n in sizes)
    assert sum(per_rank) == total and max(per_rank) - min(per_rank) <= 4096
    need = shares.share_bytes(plan)
    holders = replicate.holders(nodes, 1)
    room = 2 * total * 2 // 4 + 4 * shares.MANIFEST_SLACK  # the formula, per node
    assert lacks_room(need, [room] * 4, nodes, holders) is None
    assert lacks_room(need, [room - 4096] * 4, nodes, holders) is not None
    with pytest.raises(gds_persist.CheckpointError, match="ranks \\[2\\] differs in structure"):
        shares.check_same_structure(["x", "x", "y", "x"], 7)


def test_candidates_need_a_copy_of_every_share():
    invs = [RankInventory([Holdings([5, 6], {"1": [6]})], "a"),
            RankInventory([Holdings([], {"0": [5]})], "b")]
    levels = [recovery.LevelView("memory", MemoryStore("/m", 0))]
    assert recovery.candidates(invs, [4], levels) == [6, 4]  # rank 1's share of 6 on node a only
    assert recovery.candidates(invs, [], levels) == [6]
    plan = recovery.plan_step(invs, 6, set(), levels)
    assert plan is not None
    assert [(s.node, s.kind) for s in plan.reads[0].values()] == [("a", "memory"), ("a", "replica")]
    assert plan.reads[1] == {} and plan.sends == [(0, 0, 1), (1, 0, 1)]  # node b has nothing
    assert recovery.plan_step(invs, 6, {(1, "a", "replica")}, levels) is None  # its only copy
    # with the durable level's step, the share no node holds any more is read from it, once
    plan = recovery.plan_step(invs, 6, {(1, "a", "replica")}, levels, "/d/step-00000006")
    assert plan is not None and plan.reads[1] == {1: recovery.Source(1, "b", "durable",
                                                                      "/d/step-00000006")}
    assert plan.sends == [(1, 1, 0), (0, 0, 1)]


def test_plan_reads_what_each_node_holds_and_sends_only_what_it_lacks():
    nodes = ["a", "a", "b", "b"]
    holders = replicate.holders(nodes, 1)
    invs = [RankInventory([Holdings([3], {})], n) for n in nodes]
    for r, hs in enumerate(holders):
        for h in hs:
            invs[h].levels[0].replicas[str(r)] = [3]
    levels = [recovery.LevelView("memory", MemoryStore("/m", 0))]
    plan = recovery.plan_step(invs, 3, set(), levels)
    assert plan is not None and plan.sends == []  # 2 nodes, 1 replica: each holds every share
    assert all(sorted(reads) == [0, 1, 2, 3] for reads in plan.reads)
    lost = [RankInventory([Holdings([], {})], "b") if inv.node == "b" else inv for inv in invs]
    plan = recovery.plan_step(lost, 3, set(), levels)  # node b's memory lost
    assert plan is not None and all(not plan.reads[r] for r in (2, 3))
    assert sorted((k, dst) for k, _, dst in plan.sends) == [(k, d) for k in range(4)
                                                            for d in (2, 3)]
    sent_by = [sum(src == r for _, src, _ in plan.sends) for r in (0, 1)]
    assert sent_by == [4, 4]  # spread over the senders


# ---------------------------------------------------------------- one process


def _state(step: int) -> dict:
    return {"w": torch.arange(5000, dtype=torch.float32) * step, "step": step}


def test_tiers_by_interval_and_restore_from_memory(tmp_path):
    """Memory every 2nd step; a durable step every 3rd, flushed from the newest memory step
    then (step 3: step 2's copy; step 6: its own), in the background, the last one at close."""
    root, mem = tmp_path / "drive", tmp_path / "mem"
    with gds_persist.Checkpointer(root, memory=MemoryTier(mem, every=2), drive_every=3,
                                  warmup=False) as ckpt:
        handles = [ckpt.save(s, _state(s)) for s in range(1, 8)]
        ckpt.wait()
        assert ckpt.stats.memory_committed == 3 and ckpt.stats.committed == 0
    durable = ckpt.stats.durable
    assert durable is not None and durable.flushed == 2 and durable.failures == 0, durable
    assert [h.info.backend for h in handles][0] == "none"  # step 1: in no level
    assert "in no level" in handles[0].info.reason and handles[0].done()
    assert "flushed from step 2's local copies" in handles[2].info.reason
    assert ckpt.steps() == [2, 6]
    tier = MemoryStore(os.path.join(mem, job_name(str(root))), 0)
    assert tier.inventory() == Holdings([6], {})  # only the latest step is kept
    with gds_persist.Checkpointer(root, memory=MemoryTier(mem), warmup=False) as again:
        got = again.load()
        assert again.restored_from == "memory" and again.stats.restore_step == 6
        assert torch.equal(got["w"], _state(6)["w"])
        assert again.load(step=2)["step"] == 2 and again.restored_from == "drive"
        assert again.load(step=6)["step"] == 6 and again.restored_from == "memory"
        with pytest.raises(gds_persist.CheckpointError, match="step 5 under .* tried: step 5"):
            again.load(step=5)  # in no level


def test_corrupt_memory_copy_falls_through_to_the_durable_level(tmp_path):
    root, mem = tmp_path / "drive", tmp_path / "mem"
    with gds_persist.Checkpointer(root, memory=MemoryTier(mem), warmup=False) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    data = glob.glob(os.path.join(mem, "*", "rank-00000", "step-00000002", "data-*"))[0]
    with open(data, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00\xff")
    with gds_persist.Checkpointer(root, memory=MemoryTier(mem), warmup=False) as again:
        got = again.load()
    # the share is read again from the durable level's step (flushed: it holds that share)
    assert again.restored_from == "durable" and torch.equal(got["w"], _state(2)["w"])
    assert again.stats.restore_bytes == {"durable": 20000}
    assert "ChecksumError" in again.stats.restore_skipped[0]


@pytest.mark.parametrize("memory", [False, True])
def test_load_into_fills_the_callers_tensors_on_either_tier(tmp_path, memory):
    tier = {"memory": MemoryTier(tmp_path / "mem")} if memory else {}
    with gds_persist.Checkpointer(tmp_path / "drive", warmup=False, **tier) as ckpt:
        ckpt.save(3, _state(3))
    live = {"w": torch.zeros(5000), "step": 0}
    with gds_persist.Checkpointer(tmp_path / "drive", warmup=False, **tier) as again:
        got = again.load(into=live)
        assert again.restored_from == ("memory" if memory else "drive")
        assert got["w"] is live["w"] and torch.equal(live["w"], _state(3)["w"])
        assert got["step"] == 3
        with pytest.raises(gds_persist.CheckpointError, match="StateMismatchError|shape"):
            again.load(into={"w": torch.zeros(7), "step": 0})


def test_no_room_falls_back_to_the_drive_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(shares, "MANIFEST_SLACK", 1 << 62)  # more than any tmpfs holds
    root, mem = tmp_path / "drive", tmp_path / "mem"
    with gds_persist.Checkpointer(root, memory=MemoryTier(mem), drive_every=5,
                                  warmup=False) as ckpt:
        h = ckpt.save(1, _state(1), blocking=True)
    stats = ckpt.stats
    assert stats.memory_fallbacks == 1 and "free but its ranks' shares" in (
        stats.memory_fallback_reason)
    assert ckpt.steps() == [1] and h.path == os.path.join(root, "step-00000001")


def test_memory_tier_writes_on_its_own_thread_count(tmp_path, monkeypatch):
    """The tier's tmpfs writes are copies, each thread a core taken from training: one I/O
    thread unless ``memory_io_threads`` says otherwise; the drive's writes keep io_threads."""
    from gds_persist.backends import posix

    root, mem = tmp_path / "drive", tmp_path / "mem"
    seen: dict[str, set[str]] = {"memory": set(), "drive": set()}
    real = posix.PosixBackend.pwrite

    def spy(self, handle, buf, offset):
        where = "memory" if os.readlink(f"/proc/self/fd/{handle}").startswith(str(mem)) else "drive"
        seen[where].add(threading.current_thread().name)
        real(self, handle, buf, offset)

    monkeypatch.setattr(posix.PosixBackend, "pwrite", spy)
    state = {"w": torch.arange(64 << 11, dtype=torch.float32)}  # 512 KiB: 64 blocks of 8 KiB
    io = {"block_bytes": 8192, "staging_bytes": 8 * 8192, "io_threads": 4}
    with gds_persist.settings.set(**io), gds_persist.Checkpointer(
            root, memory=MemoryTier(mem), drive_every=2, warmup=False) as ckpt:
        ckpt.save(1, state, blocking=True)
        ckpt.save(2, state, blocking=True)
    assert len(seen["memory"]) == 1 and 1 <= len(seen["drive"]) <= 4, seen
    seen["memory"].clear()
    with gds_persist.settings.set(memory_io_threads=3, **io), gds_persist.Checkpointer(
            root, memory=MemoryTier(mem), warmup=False) as ckpt:
        ckpt.save(3, state, blocking=True)
    assert 1 <= len(seen["memory"]) <= 3, seen
    assert all(name.startswith("gds_persist-io") for names in seen.values() for name in names)


def test_tier_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"MemoryTier\(every=0\) must be at least 1"):
        MemoryTier(tmp_path / "m", every=0)
    with pytest.raises(ValueError, match=r"MemoryTier\(replicas=-1\) must be 0 or more"):
        MemoryTier(tmp_path / "m", replicas=-1)
    with pytest.raises(TypeError, match=r"memory= takes gds_persist.MemoryTier\(root=...\), "
                                        "not a str"):
        gds_persist.Checkpointer(tmp_path, memory=str(tmp_path / "m"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pass levels=\[gds_persist.LocalLevel\(root=DIR\)\]"):
        gds_persist.Checkpointer(tmp_path, drive_every=10)
    with pytest.raises(ValueError, match="needs writer='thread'"):
        gds_persist.Checkpointer(tmp_path, memory=MemoryTier(tmp_path / "m"), mode="snapshot",
                                 writer="process")
    with pytest.raises(ValueError, match="rank_local= marks state .* needs the ranks' "
                                         "process_group="):
        gds_persist.Checkpointer(tmp_path, memory=MemoryTier(tmp_path / "m"), rank_local="shard")
    with pytest.raises(ValueError, match="overlap"):
        gds_persist.Checkpointer(tmp_path, rank_local=["optim", ("optim", "state")])


# ---------------------------------------------------------------- 4 processes, 2 nodes


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """The ranks' processes, forked from a server that has imported torch (tests/forkserver.py):
    a fresh interpreter spends seconds of CPU on that import, 4 ranks x 2-3 jobs a test."""
    with ForkServer() as server:
        yield server


@pytest.fixture
def job(forks: ForkServer) -> Callable[..., Job]:
    return functools.partial(Job, forks=forks)


@pytest.mark.parametrize("run", range(RUNS))
def test_sigkill_of_one_rank_resumes_from_memory(tmp_path, run, job):
    kill_after = random.randint(4, 9)
    job(str(tmp_path), resume=False, stop=40).kill_at(rank=1, step=kill_after)
    results = job(str(tmp_path), resume=True, stop=kill_after + 4).wait()
    got = _check_restored(results, ["memory"] * 4)
    assert got >= kill_after - 2  # max_pending=2: older saves had committed everywhere
    _finished(results, kill_after + 4)


def _tree_bytes(directory: str) -> int:
    """What the files under ``directory`` take (holes not counted)."""
    return sum(os.stat(os.path.join(base, n)).st_blocks * 512
               for base, _, names in os.walk(directory) for n in names)


def test_each_node_holds_its_ranks_shares_once_with_replicas(job):
    """2 nodes x 2 ranks, replicas=1: each node's tier holds about the state once (its two
    ranks' halves + the other node's halves), where every rank kept it whole before."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as base:  # tmpfs, as the tier is meant
        first = job(base, resume=False, stop=3, drive_every=3)
        results = first.wait()
        drive = os.path.join(base, "drive", "step-00000003")
        state = sum(os.path.getsize(os.path.join(drive, n)) for n in os.listdir(drive)
                    if n.startswith("data-"))
        per_node = [_tree_bytes(first.memory_root(r)) for r in (0, 2)]
        print(f"state {state} B; tier per node {per_node} B = "
              f"{[round(n / state, 3) for n in per_node]} x state")
        assert all(n <= 1.1 * state for n in per_node), (per_node, state)
        assert sum(r["share_bytes"] for r in results) <= state + 4 * 4096


@pytest.mark.parametrize("run", range(RUNS))
def test_node_loss_resumes_from_replicas(tmp_path, run, job):
    first = job(str(tmp_path), resume=False, stop=6)
    assert [r["holders"] for r in first.wait()] == [[2], [3], [0], [1]]
    shutil.rmtree(first.memory_root(2))  # node n1's memory: ranks 2 and 3
    results = job(str(tmp_path), resume=True, stop=8, into=True).wait()  # in place
    _check_restored(results, ["memory", "memory", "replica", "replica"], step=6)
    assert [r["healed"] for r in results] == [0, 0, 2, 2]  # own copies + replicas, rewritten
    assert results[0]["restore_bytes"]["replica"] > 0
    _finished(results, 8)


@pytest.mark.parametrize("run", range(RUNS))
def test_node_and_its_replicas_lost_resumes_from_the_drive(tmp_path, run, job):
    first = job(str(tmp_path), resume=False, stop=7, drive_every=2)
    first.wait()
    shutil.rmtree(first.memory_root(2))
    for r in (2, 3):  # their copies on node n0
        shutil.rmtree(os.path.join(_mem(first, 0), f"replica-{r:05d}"))
    results = job(str(tmp_path), resume=True, stop=9).wait()
    _check_restored(results, ["drive"] * 4, step=6)  # the newest step on the drive
    _finished(results, 9)


def _flip_a_byte(step_dir: str) -> None:
    """Flip one bit of a random payload byte (inside an extent, not in alignment padding)."""
    manifest = gds_persist.read_manifest(step_dir)
    here = [e for e in manifest.extents  # a share directory holds its own data file only
            if e.length and os.path.exists(os.path.join(step_dir, manifest.files[e.file].name))]
    e = random.choice(here)
    with open(os.path.join(step_dir, manifest.files[e.file].name), "r+b") as f:
        f.seek(e.offset + random.randrange(e.length))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("run", range(RUNS))
def test_corrupt_or_truncated_memory_copy_is_skipped(tmp_path, run, job):
    first = job(str(tmp_path), resume=False, stop=6)
    first.wait()
    _flip_a_byte(os.path.join(_mem(first, 0), "rank-00000", "step-00000006"))
    data = glob.glob(os.path.join(_mem(first, 3), "rank-00003", "step-00000006", "data-*"))[0]
    os.truncate(data, os.path.getsize(data) // 2)  # rank 3's copy cut short
    results = job(str(tmp_path), resume=True, stop=7, into=True).wait()  # refilled in place
    _check_restored(results, ["replica", "memory", "memory", "replica"], step=6)
    skipped = results[0]["restore_skipped"]
    assert all(r["restore_skipped"] == skipped for r in results)  # every rank knows
    assert any("memory copy of step 6 of rank 0: ChecksumError" in s for s in skipped)
    assert any("memory copy of step 6 of rank 3: TruncatedError" in s for s in skipped)
    _finished(results, 7)


@pytest.mark.parametrize("run", range(RUNS))
def test_kill_during_replication_leaves_a_restorable_state(tmp_path, run, job):
    running = job(str(tmp_path), resume=False, stop=9, kill_in_replication=[2, 5],
                  peer_timeout_s=10)
    running.procs[2].wait(timeout=180)
    assert running.procs[2].returncode == -9 and "saved 5" in running.log(2)
    t0 = time.monotonic()  # rank 0 copies to and from rank 2: it finds it lost, by name
    while "PeerLostError" not in running.log(0) and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    print(f"rank 0 named its lost peer after {time.monotonic() - t0:.1f} s")
    log = running.log(0)
    assert "PeerLostError" in log and "lost rank 2" in log, log[-3000:]
    running.kill()
    left = glob.glob(os.path.join(_mem(running, 2), "replica-*", ".step-00000005.tmp-*"))
    assert left, "the kill should have left a half-copied replica"  # which is never listed
    results = job(str(tmp_path), resume=True, stop=9).wait()
    got = _check_restored(results, ["memory"] * 4)
    assert got in (4, 5)
    _finished(results, 9)
    for r in (0, 2):  # the leftovers are gone once their owner is
        assert not glob.glob(os.path.join(_mem(running, r), "replica-*", ".step-*"))


# ---------------------------------------------------------------- rank-local parts (ZeRO shards)


def _shards_ok(results: list[dict]) -> None:
    assert all(r["shard_ok"] for r in results), [r.get("shard_ok") for r in results]


@pytest.mark.parametrize("run", range(RUNS))
def test_rank_local_parts_stay_per_rank_through_memory_and_node_loss(tmp_path, run, job):
    """Each rank's own shard sits beside its share (and its replica); after a node loss its
    ranks get theirs from the replica holders, in place, and heal their own copies."""
    first = job(str(tmp_path), resume=False, stop=6, rank_local=True)
    first.wait()
    own = os.path.join(_mem(first, 2), "rank-00002", "step-00000006", "local")
    assert gds_persist.verify(own).ok  # a checkpoint of its own, in the share directory
    assert os.path.isdir(os.path.join(_mem(first, 0), "replica-00002", "step-00000006",
                                      "local"))  # copied with the share
    again = job(str(tmp_path), resume=True, stop=7, rank_local=True)
    results = again.wait()
    _check_restored(results, ["memory"] * 4, step=6)
    _shards_ok(results)
    shutil.rmtree(first.memory_root(2))  # node n1: ranks 2 and 3, and the replicas it held
    results = job(str(tmp_path), resume=True, stop=9, into=True, rank_local=True).wait()
    _check_restored(results, ["memory", "memory", "replica", "replica"], step=7)
    _shards_ok(results)
    assert [r["healed"] for r in results] == [0, 0, 1, 1]  # own copies, with their shards
    _finished(results, 9)


@pytest.mark.parametrize("run", range(RUNS))
def test_corrupt_rank_local_part_is_skipped_for_the_replica(tmp_path, run, job):
    first = job(str(tmp_path), resume=False, stop=5, rank_local=True)
    first.wait()
    _flip_a_byte(os.path.join(_mem(first, 0), "rank-00000", "step-00000005", "local"))
    results = job(str(tmp_path), resume=True, stop=6, rank_local=True).wait()
    _check_restored(results, ["replica", "memory", "memory", "memory"], step=5)
    _shards_ok(results)
    assert any("memory copy of step 5 of rank 0: ChecksumError" in s
               for s in results[0]["restore_skipped"])
    _finished(results, 6)


def test_rank_local_parts_from_the_drive(tmp_path, job):
    """Both nodes' memory lost: every rank gets its own shard from the drive."""
    first = job(str(tmp_path), resume=False, stop=4, drive_every=2, rank_local=True)
    first.wait()
    for r in (0, 2):
        shutil.rmtree(first.memory_root(r))
    manifest = gds_persist.read_manifest(os.path.join(tmp_path, "drive", "step-00000004"))
    assert sorted(sec.rank for sec in manifest.sections) == [0, 1, 2, 3]
    results = job(str(tmp_path), resume=True, stop=5, rank_local=True, into=True).wait()
    _check_restored(results, ["drive"] * 4, step=4)
    _shards_ok(results)
    _finished(results, 5)

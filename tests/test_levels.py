"""Node-local levels with copies on peer nodes, the durable level flushed from them in the
background, and restore from the nearest copy (docs/RECOVERY.md).

A real job: 4 processes in a gloo group acting as 2 nodes x 2 ranks (``GDS_PERSIST_NODE``),
each node with its own directories: level 0 in memory (a tmpfs under /dev/shm), level 1 on the
disk (standing in for the node's NVMe); the durable level is a shared directory or an S3 store
over HTTP (bench/s3_server.py). The ranks train deterministically (tests/tier_worker.py), are
SIGKILLed, lose their node's directories, and are started again; every restore is compared bit
for bit with the uninterrupted run at the same step, and prints where every byte came from.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import gds_persist
from gds_persist.training.tier.memory import job_name
from tests.forkserver import ForkServer
from tests.test_memory_tier import _check_restored, _finished, _flip_a_byte
from tests.tier_worker import Job, digest, reference

REF = reference(20)
LEVELS = [(1, 1), (2, 1)]  # (every, copies): memory every step, the disk every 2nd
DRIVE_EVERY = 4


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    with ForkServer() as server:
        yield server


@pytest.fixture
def base(tmp_path) -> Iterator[tuple[str, str]]:
    """Level 0's directories in memory (a tmpfs), the rest on the disk under ``tmp_path``."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        yield os.path.join(shm, "mem"), str(tmp_path)


@pytest.fixture
def job(forks: ForkServer, base: tuple[str, str]) -> Callable[..., Job]:
    memory, disk = base
    return functools.partial(Job, disk, memory=memory, forks=forks, levels=LEVELS,
                             drive_every=DRIVE_EVERY)


def _dir(job: Job, level: int, rank: int) -> str:
    """Rank ``rank``'s node's directory of ``level`` for this job."""
    return os.path.join(job.level_root(level, rank), job_name(job.drive))


def _lose_node(job: Job, node_rank: int) -> None:
    """Every node-local directory of ``node_rank``'s node, gone (as with the node)."""
    for level in range(len(LEVELS)):
        shutil.rmtree(job.level_root(level, node_rank))


def test_a_lost_node_restores_from_its_peers_copies(job):
    first = job(resume=False, stop=7)
    flushed = [r["flush"] for r in first.wait()]
    assert all(f["flushed"] >= 1 and f["failures"] == 0 for f in flushed), flushed
    _lose_node(first, 2)  # node n1: ranks 2 and 3
    results = job(resume=True, stop=9, into=True).wait()
    _check_restored(results, ["memory", "memory", "replica", "replica"], step=7)
    got = results[0]["restore_bytes"]
    assert got["memory"] > 0 and got["replica"] > 0 and "durable" not in got, got
    _finished(results, 9)


def test_a_node_and_the_copies_of_its_ranks_restore_only_their_shares_from_durable(job):
    first = job(resume=False, stop=8, flush=True)
    first.wait()
    assert gds_persist.Checkpointer(first.drive, warmup=False).latest_step() == 8
    _lose_node(first, 2)
    for level in range(len(LEVELS)):  # and the copies of ranks 2 and 3 that node n0 kept
        for r in (2, 3):
            shutil.rmtree(os.path.join(_dir(first, level, 0), f"replica-{r:05d}"))
    results = job(resume=True, stop=10).wait()
    _check_restored(results, ["memory", "memory", "durable", "durable"], step=8)
    got, total = results[0]["restore_bytes"], _state_bytes(first.drive, 8)
    print(f"bytes by source {got}; the state {total} B")
    # ranks 0 and 1 each read shares 0 and 1 from node n0; shares 2 and 3 came from the
    # durable level once each (then sent): only what no node held
    assert got["durable"] + got["memory"] // 2 == total and got["durable"] < total / 2 + 4096, got
    _finished(results, 10)


def _state_bytes(drive: str, step: int) -> int:
    manifest = gds_persist.read_manifest(os.path.join(drive, f"step-{step:08d}"))
    return sum(e.length for e in manifest.extents)


def test_a_reboot_of_every_node_restores_from_the_disk_level(job):
    """Every tmpfs gone (the nodes rebooted), the disk level kept: every share from it, the
    step of the disk level's interval (not the newer tmpfs steps)."""
    first = job(resume=False, stop=7)
    first.wait()
    for rank in (0, 2):
        shutil.rmtree(first.level_root(0, rank))
    results = job(resume=True, stop=8).wait()
    _check_restored(results, ["local"] * 4, step=6)
    assert set(results[0]["restore_bytes"]) == {"local", "local replica"}  # nothing sent
    _finished(results, 8)


def test_a_flipped_byte_in_a_local_copy_is_caught_and_the_next_copy_used(job):
    first = job(resume=False, stop=8)
    first.wait()
    _flip_a_byte(os.path.join(_dir(first, 0, 0), "rank-00000", "step-00000008"))
    results = job(resume=True, stop=9).wait()
    _check_restored(results, ["local", "memory", "memory", "memory"], step=8)
    skipped = results[0]["restore_skipped"]
    assert any("memory copy of step 8 of rank 0: ChecksumError" in s for s in skipped), skipped
    _finished(results, 9)


def test_a_fresh_job_at_another_world_size_restores_from_the_durable_level_alone(job, tmp_path):
    first = job(resume=False, stop=8, flush=True)
    first.wait()
    with gds_persist.Checkpointer(first.drive, warmup=False, levels=[
            gds_persist.LocalLevel(tmp_path / "fresh-node")]) as fresh:  # one process, no copies
        state = fresh.load()
        assert fresh.restored_from == "drive" and fresh.stats.restore_step == 8
    assert digest(state) == REF[8]
    assert digest(gds_persist.load(os.path.join(first.drive, "step-00000008"))) == REF[8]


def test_retention_keeps_a_committed_step_on_every_level(job):
    """Each level's directories keep their newest committed step and the durable level its
    keep_last; a job SIGKILLed at a random step leaves every level with a whole step."""
    first = job(resume=False, stop=9, flush=True)
    first.wait()
    for rank in range(4):
        for level, (every, _) in enumerate(LEVELS):
            newest = 9 // every * every
            own = gds_persist.Checkpointer(os.path.join(_dir(first, level, rank),
                                                        f"rank-{rank:05d}"), warmup=False)
            assert own.steps() == [newest], (level, rank, own.steps())
    durable = gds_persist.Checkpointer(first.drive, warmup=False).steps()
    assert durable[-1] == 9 and len(durable) == 2, durable  # keep_last=2 (8, or 4 if skipped)
    killed = job(resume=True, stop=40)
    killed.kill_at(rank=0, step=14)
    assert gds_persist.Checkpointer(first.drive, warmup=False).steps()[-1] >= 9
    results = job(resume=True, stop=16).wait()
    got = _check_restored(results, [results[0]["restored_from"]] * 4)
    assert got >= 12 and results[0]["restored_from"] == "memory"
    _finished(results, 16)


# ---------------------------------------------------------------- the durable level in S3


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    pytest.importorskip("moto", reason="the S3 server needs moto[server] (the test extra)")
    from bench.s3_server import S3Server

    with S3Server("levels", gate=True) as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env.items():
            mp.setenv(k, v)
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        yield server


def test_the_store_failing_mid_flush_leaves_the_previous_durable_step(job, s3, monkeypatch):
    """The endpoint dies during the first flush of step 8 or later: that flush fails (bounded
    retries) while the ranks train on, nothing of it is committed, and once the store is back
    the next flush commits; every durable step is whole and exact."""
    monkeypatch.setenv("GDS_PERSIST_OBJECT_ATTEMPTS", "2")
    url = f"s3://levels/run-{time.time_ns()}"
    go = os.path.join(job.args[0], "go")
    running = job(resume=False, stop=13, drive=url, flush=True, hold=[10, go],
                  kill_in_flush=[s3.relay.pid, 8])
    deadline = time.monotonic() + 120
    while "holding: " not in running.log(0) and time.monotonic() < deadline:
        time.sleep(0.05)  # before step 10 every rank flushes step 9 itself, then holds
    held = re.search(r"holding: flushed (\w+) failed (\d+)\n", running.log(0))
    assert held, running.log(0)[-3000:]
    assert s3.relay.poll() is not None, "the relay was not killed during a flush"
    assert held.group(1) == "4" and int(held.group(2)) >= 1, held.group(0)  # nothing after 4
    s3.relay = None
    s3.start_relay()  # the store is back: the next flush commits
    open(go, "w").close()
    results = running.wait()
    flush = results[0]["flush"]
    print(f"rank 0's flushes: {flush}")
    assert flush["failures"] >= 1 and flush["failed_step"] in (8, 9), flush
    assert all(r["flush"]["last_step"] == 13 for r in results), running.log(0)[-4000:]
    steps = gds_persist.Checkpointer(url, warmup=False).steps()
    assert steps[-1] == 13 and len(steps) == 2, steps  # keep_last=2
    for step in steps:  # every step listed is whole and exact
        assert digest(gds_persist.load(f"{url}/step-{step:08d}")) == REF[step]
    _finished(results, 13)


# ---------------------------------------------------------------- one process


def test_flush_now_and_no_last_flush_after_an_exception(tmp_path):
    """``ckpt.flush()`` makes the newest local step durable at once; a ``with`` body that
    raises closes without the last flush (other ranks may not be closing), the flush in flight
    only."""
    def levels() -> dict:
        return {"levels": [gds_persist.LocalLevel(tmp_path / "shm", every=1),
                           gds_persist.LocalLevel(tmp_path / "nvme", every=2)],
                "drive_every": 100, "warmup": False}

    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with gds_persist.Checkpointer(tmp_path / "durable", **levels()) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, {**state, "step": step})
        ckpt.flush()
        assert ckpt.steps() == [3] and ckpt.stats.durable.last_step == 3
        assert ckpt.stats.level_commits == {"local1": 3, "local2": 1}  # two on the disk
    with pytest.raises(RuntimeError, match="the body failed"):
        with gds_persist.Checkpointer(tmp_path / "durable", **levels()) as again:
            again.save(4, {**state, "step": 4}, blocking=True)
            raise RuntimeError("the body failed")
    assert again.steps() == [3]  # step 4 stays local: it was not due
    with gds_persist.Checkpointer(tmp_path / "durable", **levels()) as third:
        assert third.load()["step"] == 4 and third.restored_from == "local1"


def test_a_step_no_level_has_room_for_waits_for_the_flush_and_stays_latest(tmp_path, monkeypatch):
    """Step 5 finds no room in any level and goes to the durable level from the state: the
    flush in flight ends first and the queued older step is dropped, so no flush publishes an
    older step after it (whose retention would remove step 5)."""
    from gds_persist.training import tiers

    real = tiers.lacks_room
    full = {"step": None}
    monkeypatch.setattr(tiers, "lacks_room", lambda *a: (
        "no room (this test)" if full["step"] else real(*a)))
    state = {"w": torch.arange(200_000, dtype=torch.float32)}
    with gds_persist.Checkpointer(tmp_path / "durable", warmup=False, drive_every=2, levels=[
            gds_persist.LocalLevel(tmp_path / "shm")]) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {**state, "step": step})
        ckpt.wait()
        full["step"] = 5
        h = ckpt.save(5, {**state, "step": 5}, blocking=True)
        full["step"] = None
        assert h.path == str(tmp_path / "durable" / "step-00000005")
        assert ckpt.latest_step() == 5 and ckpt.stats.memory_fallbacks == 1
    assert ckpt.latest_step() == 5 and 5 in ckpt.steps()
    assert gds_persist.load(h.path)["step"] == 5

"""The flush (gds_persist/training/tier/flush.py): a step committed as byte-range shares in
node-local levels, written to the durable level from the newest verified local copy.

Real components only: 2 gloo ranks (a :class:`_gang.Gang`), each a node of its own
(``GDS_PERSIST_NODE``) with two local levels of its own under /dev/shm; the durable level a
directory, or an object store (moto's server behind bench/s3_server.py's relay, killed
mid-flush). Every durable step is loaded whole with plain ``gds_persist.load`` and compared bit
for bit with the state its shares were saved from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import flush_tasks as tasks
import pytest
from _dist_tasks import make_state, mismatches
from _gang import Gang

import gds_persist
from bench.s3_server import S3Server
from gds_persist.format import MANIFEST_NAME
from gds_persist.parallel.distributed import SoloComm
from gds_persist.state.flatten import flatten
from gds_persist.training import steps
from gds_persist.training.tier import flush, shares
from gds_persist.training.tier.shares import share_files
from tests.forkserver import ForkServer
from tests.helpers import flip_byte, s3_server

BUCKET = "flush"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server(BUCKET, gate=True) as server:
        yield server


@pytest.fixture(scope="module")
def gang(s3: S3Server) -> Iterator[Gang]:
    with Gang(2, timeout_s=60, env=s3.env) as g:
        yield g


@pytest.fixture(scope="module")
def levels() -> Iterator[list[str]]:
    """Two node-local levels (nearest first), on tmpfs."""
    base = tempfile.mkdtemp(prefix="gds_persist-flush-", dir="/dev/shm")
    yield [os.path.join(base, "near"), os.path.join(base, "far")]
    shutil.rmtree(base, ignore_errors=True)


def _commit(gang: Gang, levels: list[str], step: int) -> list[list[str]]:
    """Every rank's copies of its share of step ``step``, by rank."""
    return gang.run(tasks.commit_shares, levels, step)


def _flush(gang: Gang, dirs: list[list[str]], durable: str, step: int,
           **kw: object) -> list[dict]:
    return gang.run(tasks.flush_step, dirs, durable, step, **kw)


def _flip(share_dir: str, rank: int) -> None:
    """One byte flipped inside the first extent of ``rank``'s data file in ``share_dir``."""
    m = gds_persist.read_manifest(share_dir)
    index = share_files(m)[rank]
    e = next(e for e in m.extents if e.file == index and e.length)
    flip_byte(os.path.join(share_dir, m.files[index].name), e.offset + e.length // 2)


def _loads_exactly(path: str, step: int) -> None:
    assert mismatches(gds_persist.load(path), make_state(step)) == []


def test_a_flushed_step_is_every_share_and_loads_whole(gang: Gang, levels: list[str],
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    root = str(tmp_path_factory.mktemp("durable"))
    dirs = _commit(gang, levels, 1)
    durable = steps.step_path(root, 1)
    got = _flush(gang, dirs, durable, 1)
    assert [g["reason"].rsplit("; copied from ", 1)[1] for g in got] == [d[0] for d in dirs]
    m = gds_persist.read_manifest(durable)
    assert sorted(os.listdir(durable)) == sorted([MANIFEST_NAME, *(f.name for f in m.files)])
    assert len(m.files) == 2 and [g["files"] for g in got] == [[m.files[0].name],
                                                                [m.files[1].name]]
    for rank, d in enumerate(dirs):  # the same manifest bytes; each data file byte for byte
        with open(os.path.join(d[0], MANIFEST_NAME), "rb") as a, \
                open(os.path.join(durable, MANIFEST_NAME), "rb") as b:
            assert a.read() == b.read()
        name = m.files[share_files(m)[rank]].name
        with open(os.path.join(d[0], name), "rb") as a, open(os.path.join(durable, name),
                                                             "rb") as b:
            assert a.read() == b.read()
    _loads_exactly(durable, 1)  # one process, no group
    assert gang.run(tasks.load_check, durable, 1, 2) == [[], []]  # a group of both ranks
    assert gang.run(tasks.load_check, durable, 1, 1) == [[], None]  # another world size


def test_a_flipped_byte_in_the_nearest_copy_is_caught_and_the_next_used(
        gang: Gang, levels: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = str(tmp_path_factory.mktemp("durable"))
    dirs = _commit(gang, levels, 2)
    _flip(dirs[1][0], 1)
    got = _flush(gang, dirs, steps.step_path(root, 2), 2)
    assert got[0]["reason"].endswith(f"copied from {dirs[0][0]}")
    assert f"copied from {dirs[1][1]}; passed over {dirs[1][0]}: CRC32C mismatch" \
        in got[1]["reason"]
    _loads_exactly(steps.step_path(root, 2), 2)


def test_no_verified_copy_fails_every_rank_and_keeps_the_previous_step(
        gang: Gang, levels: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = str(tmp_path_factory.mktemp("durable"))
    dirs = _commit(gang, levels, 3)
    assert "error" not in _flush(gang, dirs, steps.step_path(root, 3), 3)[0]
    dirs = _commit(gang, levels, 4)
    for d in dirs[1]:
        _flip(d, 1)
    got = _flush(gang, dirs, steps.step_path(root, 4), 4)
    for g in got:  # every rank: rank 1's copies, each named with why
        assert "CheckpointError" in g["error"] and "rank 1's share of step 4" in g["error"]
        assert all(f"{d}: CRC32C mismatch" in g["error"] for d in dirs[1]), g["error"]
    assert os.listdir(root) == ["step-00000003"]  # nothing of step 4, not even a temporary
    _loads_exactly(steps.step_path(root, 3), 3)


def _keys(prefix: str) -> list[str]:
    got = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


def test_the_store_failing_mid_flush_commits_nothing_and_the_next_flush_does(
        gang: Gang, levels: list[str], s3: S3Server) -> None:
    root = f"s3://{BUCKET}/run"
    dirs = _commit(gang, levels, 5)
    _flip(dirs[0][0], 0)  # its object is written, found wrong, and replaced by the next copy's
    got = _flush(gang, dirs, f"{root}/step-00000005", 5)
    assert [g.get("error") for g in got] == [None, None]
    assert f"copied from {dirs[0][1]}; passed over {dirs[0][0]}: CRC32C" in got[0]["reason"]
    assert gang.run(tasks.publish, root, 5, 1) == [[], []]
    durable, local = (gds_persist.read_manifest(p) for p in (f"{root}/step-00000005",
                                                            dirs[0][0]))
    objects = durable.writer.pop("objects")  # the one field a store's commit adds
    assert durable == local and len(_keys(f"run/step-00000005/{objects}/")) == 2
    _loads_exactly(f"{root}/step-00000005", 5)
    assert gang.run(tasks.load_check, f"{root}/step-00000005", 5, 2) == [[], []]

    dirs = _commit(gang, levels, 6)
    assert s3.relay is not None
    got = _flush(gang, dirs, f"{root}/step-00000006", 6, kill_at_first_bytes=s3.relay.pid)
    assert all("ObjectStoreError" in g.get("error", "") for g in got), got
    s3.kill_relay()
    s3.start_relay()
    assert steps.committed_steps(root) == [5] and steps.read_latest(root) == 5
    _loads_exactly(f"{root}/step-00000005", 5)

    # the next flush commits, and its sweep takes what the cut one left
    got = _flush(gang, dirs, f"{root}/step-00000006", 6, object_grace_s=0)
    assert [g.get("error") for g in got] == [None, None]
    assert gang.run(tasks.publish, root, 6, 1) == [[5], [5]]  # every rank learns it
    assert steps.committed_steps(root) == [6] and steps.read_latest(root) == 6
    objects = gds_persist.read_manifest(f"{root}/step-00000006").writer["objects"]
    assert [k for k in _keys("run/") if f"/{objects}/" not in k] == \
        ["run/latest", "run/step-00000006/manifest.json"]
    _loads_exactly(f"{root}/step-00000006", 6)


def test_the_flusher_flushes_in_the_background_and_retention_waits_for_the_commit(
        gang: Gang, levels: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = str(tmp_path_factory.mktemp("durable"))
    assert gang.run(tasks.open_flusher, root, 2) == [True, True]
    try:
        for step in (7, 8, 9):
            dirs = _commit(gang, levels, step)
            got = _run_flush(gang, step, dirs)
            assert [(g["flushed"], g["last_step"], g["failures"], g["busy_after_start"])
                    for g in got] == [(step - 6, step, 0, True)] * 2
            assert all(g["bytes_written"] > 0 for g in got)
        assert steps.committed_steps(root) == [8, 9] and steps.read_latest(root) == 9

        dirs = _commit(gang, levels, 10)  # every copy of rank 0's share corrupt
        for d in dirs[0]:
            _flip(d, 0)
        got = _run_flush(gang, 10, dirs)
        assert [(g["flushed"], g["last_step"], g["failures"], g["failed_step"])
                for g in got] == [(3, 9, 1, 10)] * 2
        assert all("rank 0's share of step 10" in g["last_error"] for g in got)
        assert steps.committed_steps(root) == [8, 9] and steps.read_latest(root) == 9

        dirs = _commit(gang, levels, 11)  # the caller's next chance: the flush goes on
        assert [g["flushed"] for g in _run_flush(gang, 11, dirs)] == [4, 4]
        assert steps.committed_steps(root) == [9, 11] and steps.read_latest(root) == 11
        _loads_exactly(steps.step_path(root, 11), 11)
    finally:
        assert gang.run(tasks.close_flusher) == [True, True]



def _run_flush(gang: Gang, step: int, dirs: list[list[str]]) -> list[dict]:
    return gang.run(tasks.flush_in_background, step, dirs)


def _solo_share(levels: list[str], step: int) -> str:
    """A one-process job's share of ``make_state(step)`` (the whole state), committed."""
    flat = flatten(make_state(step))
    d = os.path.join(levels[0], "solo", f"step-{step:08d}")
    shares.save_share(SoloComm(), d, flat,
                      shares.plan_shares([s.nbytes for s in flat.storages], ["solo"]), None, step)
    return d


def test_one_process_killed_mid_flush_then_its_flusher_commits(
        levels: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without a process group (a SoloComm): a flush SIGKILLed mid-way leaves no step and the
    previous one intact; the Flusher's next flush commits, removes what the dead one left, and
    a copy failing alone raises its CheckpointError into the stats, not into the caller."""
    root = str(tmp_path_factory.mktemp("durable"))
    stats, lock = flush.FlushStats(), threading.Lock()
    flusher = flush.Flusher(root, stats, lock, keep_last=1)
    try:
        flusher.start(1, [_solo_share(levels, 1)])
        assert flusher.join(60) and (stats.flushed, stats.last_step) == (1, 1), stats

        d2 = _solo_share(levels, 2)
        with ForkServer() as forks:
            dead = forks.spawn(os.path.join(os.path.dirname(__file__), "flush_worker.py"),
                               [d2, steps.step_path(root, 2), "2"])
            assert dead.wait(timeout=60) == -signal.SIGKILL
        left = [n for n in os.listdir(root) if n.startswith(".step-00000002.tmp-")]
        assert left, os.listdir(root)  # it died with its temporary directory begun
        assert steps.committed_steps(root) == [1]
        _loads_exactly(steps.step_path(root, 1), 1)

        flusher.start(2, [d2])
        assert flusher.join(60) and (stats.flushed, stats.failures) == (2, 0), stats
        assert sorted(os.listdir(root)) == ["latest", "step-00000002"]  # the dead one's gone
        _loads_exactly(steps.step_path(root, 2), 2)

        d3 = _solo_share(levels, 3)
        _flip(d3, 0)
        gone = os.path.join(levels[1], "solo", "step-00000003")  # a level that lost it
        flusher.start(3, [gone, d3])
        assert flusher.join(60) and (stats.failures, stats.failed_step) == (1, 3)
        assert stats.last_error.startswith("CheckpointError: no local copy of rank 0's share")
        assert f"{gone}: no committed manifest" in stats.last_error
        assert f"{d3}: CRC32C mismatch" in stats.last_error
        assert steps.committed_steps(root) == [2] and steps.read_latest(root) == 2
    finally:
        assert flusher.close(60)


def test_the_flush_benchmark_runs(tmp_path: Path) -> None:
    """bench/bench_flush.py at a tiny size, so it cannot rot."""
    from bench import bench_flush

    out = tmp_path / "r.json"
    bench_flush.main(["--mib", "1", "--pairs", "2", "--dest", str(tmp_path / "d"),
                      "--out", str(out)])
    got = json.loads(out.read_text())
    assert [p["order"] for p in got["pairs"]] == [["flush", "save"], ["save", "flush"]]
    assert got["median_ratio"] > 0

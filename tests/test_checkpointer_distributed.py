"""Checkpointer with a real gloo process group (2 spawned ranks): every rank writes its share of
each step through gds_persist.save(process_group=...), rank 0 alone publishes `latest` and applies
retention, and every rank loads the latest step back bit-exact with tied storages tied."""

from __future__ import annotations

from collections.abc import Iterator

import ckpt_dist_tasks as tasks
import pytest
from _gang import Gang

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    g = Gang(2, timeout_s=60)
    yield g
    g.close()


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_checkpointer_with_a_process_group(gang, tmp_path, mode):
    results = gang.run(tasks.checkpoint_steps, str(tmp_path / "ckpt"), 4, mode)
    assert [r["publisher"] for r in results] == [True, False]
    for r in results:
        assert r["latest"] == 4 and r["steps"] == [3, 4], r
        assert r["loaded_step"] == 4 and r["same"] and r["tied"], r
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000004\n"


def test_a_rank_local_tensor_changed_before_its_write_fails_the_save_on_every_rank(
        gang, tmp_path):
    for r in gang.run(tasks.edited_after_save, str(tmp_path / "ckpt")):
        assert r["error"].startswith("DistributedError"), r
        assert "raised TornCheckpointError" in r["error"], r
        assert "rank 1's rank-local storage 0 changed after save()" in r["error"], r
        assert r["latest"] == 1, r


def test_replicas_that_differ_are_refused_as_such_by_the_memory_tier(gang, tmp_path):
    results = gang.run(tasks.diverged_replicas, str(tmp_path / "ckpt"), str(tmp_path / "mem"))
    for r in results:
        assert r["error"].startswith("DistributedError"), r
        assert "raised ReplicationError" in r["error"], r
        assert "the replicated state differs between ranks: ['w'] (written by rank" in r["error"]
        assert "changed after save()" not in r["error"], r
        assert r["steps"] == [], r

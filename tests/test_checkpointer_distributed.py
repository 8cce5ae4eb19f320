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

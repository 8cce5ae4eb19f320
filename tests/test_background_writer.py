"""The one background writer (gds_persist/training/background_writer.py) that the Checkpointer,
Lightning and DeepSpeed write on: calls in order on one thread, a dead thread replaced, every
result collected within one bound, the first error raised and the later ones never lost."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist.training.background_writer import Lane, collect

REPO = str(Path(__file__).resolve().parent.parent)
L = pytest.importorskip("lightning.pytorch")
from gds_persist.integrations.lightning import GdsPersistCheckpointIO  # noqa: E402


def test_two_failed_writes_raise_the_first_and_keep_the_second(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    io = GdsPersistCheckpointIO(background=True)
    for name in ("first", "second"):  # directories that are not checkpoints: each save fails
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("not a checkpoint")
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / name)
    with caplog.at_level(logging.ERROR, logger="gds_persist"), \
            pytest.raises(gds_persist.CheckpointError, match=r"first is not a gds_persist") as e:
        io.wait()
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert f"later background writes also failed: {tmp_path / 'second'} (" in notes, notes
    logged = [r.getMessage() for r in caplog.records]
    assert any("second also failed" in m and "not a gds_persist" in m for m in logged), logged
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "ok.ckpt")  # the writer goes on
    io.teardown()
    assert io.last_info is not None and io.last_info.path == str(tmp_path / "ok.ckpt")


def test_a_lane_keeps_order_and_replaces_a_dead_thread() -> None:
    lane = Lane("test")
    ran: list[int] = []

    def call(i: int) -> Any:
        def run() -> int:
            if i == 2:
                raise SystemExit("simulated death of the thread")
            ran.append(i)
            return i
        return run

    futures = [(f"call {i}", lane.submit(call(i), f"running call {i}")) for i in range(5)]
    first_thread = lane.thread
    with pytest.raises(gds_persist.WorkerDied, match=r"gds_persist test thread died while "
                                                     r"running call 2 \(SystemExit: simulated"):
        collect(futures, 10.0, "timeout_s")
    assert ran == [0, 1, 3, 4]  # in order; the calls after the death ran on a new thread
    assert [f.result() for _, f in futures if not f.exception()] == [0, 1, 3, 4]
    assert lane.thread is not first_thread and lane.thread.name == "gds_persist-test"
    lane.stop(deadline=time.monotonic() + 10)
    assert not lane.thread.is_alive()


def test_collect_bounds_the_whole_wait_and_names_what_still_runs() -> None:
    lane = Lane("test")
    gate = threading.Event()
    writes = [(name, lane.submit(gate.wait, name)) for name in ("a.pt", "b.pt")]
    done: Future[int] = Future()
    done.set_result(7)
    with pytest.raises(gds_persist.CheckpointTimeout,
                       match=r"a.pt, b.pt: not finished within 0.2 s.*Raise f\(timeout_s=\.\.\.\)"):
        collect([("done.pt", done), *writes], 0.2, "f(timeout_s=...)")
    gate.set()
    assert collect(writes, 10.0, "timeout_s") == [True, True]  # they went on
    lane.stop(deadline=time.monotonic() + 10)


EXIT_WITH_A_WRITE_QUEUED = """
import sys, time, torch, gds_persist
from gds_persist.state.flatten import flatten
from gds_persist.training.background_writer import BackgroundWriter
def slow_save(flat, path, kwargs):
    time.sleep(0.3)  # still writing when the script ends
    return gds_persist.save(flat, path, **kwargs)
writer = BackgroundWriter(slow_save, None, 60.0, "timeout_s")
writer.submit(flatten({"w": torch.arange(10.0), "step": 2}), sys.argv[1], {})
"""


@pytest.mark.slow
def test_a_write_queued_at_a_normal_exit_is_finished(tmp_path: Path) -> None:
    """Lightning's background=True as a script ends, without teardown: the writer's thread is a
    daemon, so the write is finished by the exit hook (training/at_exit.py) or lost. A fresh
    interpreter: the exit is what is tested (a fork server would cost one as well)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-W", "error", "-c", EXIT_WITH_A_WRITE_QUEUED,
                        str(tmp_path / "ck")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert gds_persist.load(tmp_path / "ck")["step"] == 2


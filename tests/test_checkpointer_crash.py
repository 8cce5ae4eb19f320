"""Crash safety: a training process checkpointing every iteration is killed with SIGKILL at random
instants; after every kill the latest committed checkpoint loads, verifies, equals the
uninterrupted run's state at that step, and resuming from it reaches the uninterrupted result.

Each trial restarts training from what the previous kill left (leftover temporaries included).
``GDS_PERSIST_CRASH_TRIALS`` sets the number of kills (default 6; the full suite uses >= 20:
``GDS_PERSIST_CRASH_TRIALS=20 make test``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import gds_persist
from gds_persist import Checkpointer
from gds_persist.format import MANIFEST_NAME
from gds_persist.steps import parse_step, read_latest, step_name
from tests.ckpt_train import assert_identical, make, one_thread, reference, restore, state, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "ckpt_train.py")
TOTAL = 40
TRIALS = int(os.environ.get("GDS_PERSIST_CRASH_TRIALS", "6"))


def check_after_kill(root: str, ref: list) -> int | None:
    for name in os.listdir(root):  # never a half-written or half-deleted directory that looks done
        if parse_step(name) is not None:
            assert os.path.isfile(os.path.join(root, name, MANIFEST_NAME)), name
    pointed = read_latest(root)
    latest = Checkpointer(root).latest_step()
    if pointed is not None:
        assert latest == pointed  # `latest` names a committed step
    if latest is None:
        return None
    path = os.path.join(root, step_name(latest))
    assert gds_persist.verify(path).ok
    loaded = gds_persist.load(path)
    assert loaded["step"] == latest
    assert_identical(loaded, ref[latest], f"checkpoint {latest}")
    with one_thread():
        model, opt = make()
        restore(model, opt, loaded)
        train(model, opt, latest, TOTAL)
    assert_identical(state(model, opt, TOTAL), ref[TOTAL], f"resumed from {latest}")
    return latest


@pytest.fixture(scope="module")
def zygote():
    """A process that has imported torch and forks training processes on request."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, SCRIPT, "--zygote"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()  # it holds no state worth an orderly exit
        proc.wait(timeout=60)
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_sigkill_at_random_instants(tmp_path, zygote, mode):
    ref = reference(TOTAL)
    rng = random.Random(f"{mode}-{os.getpid()}-{time.time()}")
    root = str(tmp_path / "ckpt")
    trials = max(1, TRIALS // 2) if mode == "snapshot" else TRIALS  # snapshot: half as many
    outcomes = []
    for _ in range(trials):
        if Checkpointer(root).latest_step() == TOTAL:
            shutil.rmtree(root)  # the previous trial finished: start over
        zygote.stdin.write(f"{root} {TOTAL} {mode}\n")
        zygote.stdin.flush()
        line = zygote.stdout.readline().split()  # "started <step> <pid>": training begins
        assert line[0] == "started", line
        time.sleep(rng.uniform(0.0, 0.8))
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line[2]), signal.SIGKILL)
        end = zygote.stdout.readline().split()  # "exit <pid> <status>"
        assert end[:2] == ["exit", line[2]], end
        latest = check_after_kill(root, ref)
        outcomes.append((int(line[1]), latest, os.waitstatus_to_exitcode(int(end[2]))))
    print(f"{mode}: (resumed from, latest after the kill, exit code) per trial: {outcomes}")
    # the kills landed in the middle of training, not only before or after it
    assert any(code == -signal.SIGKILL and latest not in (None, TOTAL)
               for _, latest, code in outcomes), outcomes


EXIT_WITHOUT_CLOSE = """
import sys, time, torch, gds_persist
for mode in ("fence", "snapshot"):
    ckpt = gds_persist.Checkpointer(f"{sys.argv[1]}/{mode}", mode=mode)
    ckpt._before_write = lambda step: time.sleep(0.3)  # still writing when the script ends
    ckpt.save(1, {"w": torch.arange(1000.0), "step": 1})
"""


@pytest.mark.slow
def test_unclosed_checkpointer_finishes_its_saves_at_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr
    for mode in ("fence", "snapshot"):
        root = str(tmp_path / mode)
        assert read_latest(root) == 1
        assert gds_persist.load(os.path.join(root, step_name(1)))["step"] == 1

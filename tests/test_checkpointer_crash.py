"""Crash safety: a training process checkpointing every iteration is killed with SIGKILL at random
instants; after every kill the latest committed checkpoint loads, verifies, equals the
uninterrupted run's state at that step, and resuming from it reaches the uninterrupted result.

Each trial restarts training from what the previous kill left (leftover temporaries included).
``GDS_PERSIST_CRASH_TRIALS`` sets the number of kills in fence mode (default 6; the full suite uses
>= 20: ``GDS_PERSIST_CRASH_TRIALS=20 make test``), half as many in snapshot mode and a third with
the helper-process writer.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import gds_persist
from gds_persist.format import MANIFEST_NAME
from gds_persist.training.steps import latest_step, parse_step, read_latest, step_name
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
    latest = latest_step(root)
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


class Zygote:
    """A process that has imported torch and forks training processes on request; its output is
    read by a thread, so that no read here can hang (a stuck trial fails with a transcript)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--zygote"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lines: queue.Queue[list[str]] = queue.Queue()
        self.transcript: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self.next(300) == ["ready"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def next(self, timeout: float = 60.0) -> list[str]:
        try:
            words = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output from the training process in {timeout} s; "
                                 f"transcript: {self.transcript[-20:]}") from None
        self.transcript.append(" ".join(words))
        assert words and words[0] != "eof", f"zygote ended; transcript: {self.transcript[-20:]}"
        return words

    def run(self, root: str, mode: str) -> None:
        self.transcript.append(f"> run {root} {TOTAL} {mode}")
        self.proc.stdin.write(f"{root} {TOTAL} {mode}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()  # it holds no state worth an orderly exit
        self.proc.wait(timeout=60)
        self._reader.join(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode,share", [("fence", 1), ("snapshot", 2), ("snapshot+process", 3)])
def test_sigkill_at_random_instants(tmp_path, zygote, mode, share):
    ref = reference(TOTAL)
    rng = random.Random(f"{mode}-{os.getpid()}-{time.time()}")
    root = str(tmp_path / "ckpt")
    trials = max(2, TRIALS // share)  # fewer in the snapshot modes
    outcomes = []
    for _ in range(trials):
        previous = latest_step(root)
        if previous is not None and previous >= TOTAL - 3:
            shutil.rmtree(root)  # near the end: start over, so kills land all along the run
        zygote.run(root, mode)
        words = zygote.next()  # "started <step> <pid>": training begins
        assert words[0] == "started", zygote.transcript[-20:]
        start, pid = int(words[1]), int(words[2])
        # Kill at a random instant within a random step: after save(k) returned, somewhere in
        # k's write / commit / publish / retention, or in step k+1's compute.
        target = rng.randint(start + 1, TOTAL)
        t_prev, step_s = time.monotonic(), 0.01
        while True:
            words = zygote.next()
            if words[0] != "step":  # the child ended before the target: its "exit" line
                break
            now = time.monotonic()
            step_s, t_prev = now - t_prev, now
            if int(words[1]) >= target:
                break
        if words[0] == "step":
            time.sleep(rng.uniform(0.0, 2.0 * step_s + 0.02))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while words[0] != "exit":  # skip the steps printed before the kill
                words = zygote.next()
        assert words[:2] == ["exit", str(pid)], zygote.transcript[-20:]
        if mode.endswith("+process"):  # the helper process died with the trainer: nothing moves
            before = sorted(os.listdir(root)) if os.path.isdir(root) else []
            time.sleep(0.3)
            assert (sorted(os.listdir(root)) if os.path.isdir(root) else []) == before
        latest = check_after_kill(root, ref)
        outcomes.append((start, latest, os.waitstatus_to_exitcode(int(words[2]))))
    print(f"{mode}: (resumed from, latest after the kill, exit code) per trial: {outcomes}")
    # the kills landed in the middle of training, not only before or after it
    assert any(code == -signal.SIGKILL and latest not in (None, TOTAL)
               for _, latest, code in outcomes), outcomes


EXIT_WITHOUT_CLOSE = """
import sys, time, torch, gds_persist
for mode, writer in (("fence", "thread"), ("snapshot", "thread"), ("snapshot", "process")):
    ckpt = gds_persist.Checkpointer(f"{sys.argv[1]}/{mode}-{writer}", mode=mode, writer=writer)
    ckpt._before_write = lambda step: time.sleep(0.3)  # still writing when the script ends
    ckpt.save(1, {"w": torch.arange(1000.0), "step": 1})
"""


@pytest.mark.slow
def test_unclosed_checkpointer_finishes_its_saves_at_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr
    for mode in ("fence-thread", "snapshot-thread", "snapshot-process"):
        root = str(tmp_path / mode)
        assert read_latest(root) == 1
        assert gds_persist.load(os.path.join(root, step_name(1)))["step"] == 1

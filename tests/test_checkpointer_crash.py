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
import functools
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

import gds_persist
from gds_persist.format import MANIFEST_NAME
from gds_persist.training.steps import latest_step, parse_step, read_latest, step_name
from tests.ckpt_train import assert_identical, make, one_thread, reference, restore, state, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "ckpt_train.py")
TOTAL = 40
TRIALS = int(os.environ.get("GDS_PERSIST_CRASH_TRIALS", "6"))
MAX_EXTRA_TRIALS = 6  # placed kills beyond TRIALS until one landed mid-training


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

    def poll(self, timeout: float) -> list[str] | None:
        """The next line, or None if none came within ``timeout`` seconds."""
        try:
            words = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
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


def poll_until(zygote: Zygote, done: Callable[[list[str]], bool], timeout: float) -> list[str]:
    """The child's next line for which ``done(line)``, or its "exit" line (it ended first);
    ``done`` is also asked between lines (``[]``: none came) so that it can watch the root."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        words = zygote.poll(0.02)
        if words is not None and words[0] == "exit":
            return words
        if done(words or []):
            return words or ["step", "?"]
    raise AssertionError(f"nothing to kill at in {timeout} s; transcript: "
                         f"{zygote.transcript[-20:]}")


def one_trial(zygote: Zygote, root: str, mode: str, rng: random.Random,
              placed: bool) -> tuple[int, int | None, int]:
    """Start training from what the last kill left and kill it at a random instant: after
    save(k) returned for a random step k, somewhere in k's write / commit / publish /
    retention or in step k+1's compute. ``placed``: only once a step of this run is committed
    (so the kill lands mid-training with something to resume from, however slow the first
    save is: a helper process starting on a loaded machine). Returns (resumed from, latest
    after the kill, exit code)."""
    previous = latest_step(root)
    if previous is not None and previous >= TOTAL - 3:
        shutil.rmtree(root)  # near the end: start over, so kills land all along the run
    zygote.run(root, mode)
    words = zygote.next()  # "started <step> <pid>": training begins
    assert words[0] == "started", zygote.transcript[-20:]
    start, pid = int(words[1]), int(words[2])
    # placed: early in the run, so that it is still training once the first commit is in
    target = rng.randint(start + 1, max(start + 1, (start + TOTAL) // 2) if placed else TOTAL)
    seen = {"step": start, "at": time.monotonic(), "step_s": 0.01}

    def reached(line: list[str]) -> bool:
        if line[:1] == ["step"]:
            now = time.monotonic()
            seen.update(step=int(line[1]), at=now, step_s=now - seen["at"])
        committed = (latest_step(root) or 0) > start
        return seen["step"] >= target and (committed or not placed)

    words = poll_until(zygote, reached, 300.0)
    if words[0] != "exit":
        time.sleep(rng.uniform(0.0, 2.0 * seen["step_s"] + 0.02))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while words[0] != "exit":  # skip the steps printed before the kill
            words = zygote.next()
    assert words[:2] == ["exit", str(pid)], zygote.transcript[-20:]
    if mode.endswith("+process"):  # the helper process died with the trainer: nothing moves
        before = sorted(os.listdir(root)) if os.path.isdir(root) else []
        time.sleep(0.3)
        assert (sorted(os.listdir(root)) if os.path.isdir(root) else []) == before
    return start, check_after_kill(root, ref_states(TOTAL)), os.waitstatus_to_exitcode(
        int(words[2]))


@functools.cache
def ref_states(total: int) -> list:
    return reference(total)


def mid_training(outcome: tuple[int, int | None, int]) -> bool:
    """A kill that landed while training ran, with a committed step to resume from."""
    _, latest, code = outcome
    return code == -signal.SIGKILL and latest not in (None, TOTAL)


@pytest.mark.slow
@pytest.mark.parametrize("mode,share", [("fence", 1), ("snapshot", 2), ("snapshot+process", 3)])
def test_sigkill_at_random_instants(tmp_path, zygote, mode, share, test_seed):
    """Kills alternate between anywhere (before the first commit included) and placed after a
    commit of the run; trials go on past the planned number until a kill has landed
    mid-training (bounded: MAX_EXTRA_TRIALS more), never retried into green."""
    rng = random.Random(test_seed)  # the seed is printed; GDS_PERSIST_TEST_SEED replays it
    root = str(tmp_path / "ckpt")
    trials = max(2, TRIALS // share)  # fewer in the snapshot modes
    outcomes: list[tuple[int, int | None, int]] = []
    while len(outcomes) < trials or not any(map(mid_training, outcomes)):
        assert len(outcomes) < trials + MAX_EXTRA_TRIALS, (
            f"seed {test_seed}: no kill landed mid-training with a committed step in "
            f"{len(outcomes)} trials: {outcomes}; transcript: {zygote.transcript[-20:]}")
        outcomes.append(one_trial(zygote, root, mode, rng, placed=len(outcomes) % 2 == 1))
    print(f"{mode} (seed {test_seed}): (resumed from, latest after the kill, exit code) per "
          f"trial: {outcomes}")


EXIT_WITHOUT_CLOSE = """
import sys, time, torch, gds_persist
class Slow(gds_persist.Checkpointer):
    def _write(self, job):
        time.sleep(0.3)  # still writing when the script ends
        super()._write(job)
for mode, writer in (("fence", "thread"), ("snapshot", "thread"), ("snapshot", "process")):
    ckpt = Slow(f"{sys.argv[1]}/{mode}-{writer}", mode=mode, writer=writer)
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

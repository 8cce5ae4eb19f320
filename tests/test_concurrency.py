"""Several processes, one checkpoint path (issue 11; docs/FORMAT.md, "Several processes, one
path"): saves are never lost, loads are never falsely "corrupt".

Real processes on real files: ``tests/_contender.py`` is the other process (it saves, deletes,
and - forked children - holds owner, commit and data-directory locks until released or
SIGKILLed); the loads that must survive it run here, and it acts from inside them (the
``progress`` callback runs once the load holds its files). ``tests/contention.py`` is the
harness with several savers and loaders; a short version of it runs here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist import (
    Checkpointer,
    CheckpointReplacedError,
    CheckpointTimeout,
    NotCommittedError,
    TruncatedError,
)
from gds_persist.cli import main as cli_main
from gds_persist.transfer.opened import open_checkpoint
from tests import contention
from tests.helpers import open_fds

REPO = Path(__file__).resolve().parent.parent


class Contender:
    """The other process (tests/_contender.py), driven line by line."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GDS_PERSIST_")}
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "_contender.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert json.loads(self._line())["ok"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the contender died: {self.proc.poll()}"
        return line

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        out = json.loads(self._line())
        assert out["ok"], out["error"]
        return out

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.reply()

    def close(self) -> None:
        self.send("exit")
        self.proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def other() -> Iterator[Contender]:
    c = Contender()
    yield c
    c.close()


def state(tag: int, numel: int = 4096) -> dict[str, Any]:
    return {"tag": tag, "w": torch.full((numel,), float(tag)),
            "i": torch.full((7,), tag, dtype=torch.int64)}


def tag_of(sd: dict[str, Any]) -> int:
    tags = {sd["tag"], *sd["w"].unique().tolist(), *sd["i"].unique().tolist()}
    assert len(tags) == 1, f"a mixed state: {tags}"
    return int(sd["tag"])


@pytest.fixture
def small_blocks() -> Iterator[None]:
    """Reads in 8 KiB blocks: the progress callback runs with most of each file still unread."""
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=16384):
        yield


def acting_once(action: Any) -> Any:
    """A progress callback that runs ``action`` once, at the first bytes read."""
    done = []

    def progress(_done: int, _total: int) -> None:
        if not done:
            done.append(True)
            action()

    return progress


# --- loads while another process replaces or removes the checkpoint ---------------------------

@pytest.mark.parametrize("how", ["replace", "replace-without-exchange", "remove"])
def test_load_and_verify_hold_the_checkpoint_they_opened(other: Contender, tmp_path: Path,
                                                         how: str, small_blocks: None) -> None:
    path = tmp_path / "ck"
    gds_persist.save(state(1, 100_000), path)

    def act() -> None:
        if how == "remove":
            other("rmtree", path=str(path))
        else:
            other("save", path=str(path), tag=2, no_exchange=how != "replace")

    got = gds_persist.load(path, progress=acting_once(act))
    assert tag_of(got) == 1 and got["w"].numel() == 100_000  # the whole old one, verified
    if how == "remove":
        assert not path.exists()
        gds_persist.save(state(1, 100_000), path)
        report = gds_persist.verify(path, progress=acting_once(act))
        assert report.ok and report.bytes_checked >= 400_000
        return
    assert tag_of(gds_persist.load(path)) == 2
    report = gds_persist.verify(path, progress=acting_once(
        lambda: other("save", path=str(path), tag=3, numel=10)))
    assert report.ok and report.bytes_checked == 4096 * 4 + 56  # tag 2's bytes, not tag 3's
    assert tag_of(gds_persist.load(path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_replaced_between_opening_directory_and_files(other: Contender, tmp_path: Path) -> None:
    """The one window: the directory is open, its files are not yet. The file is gone because
    the path now holds another checkpoint - that is said, never "truncated"; load retries."""
    path = tmp_path / "ck"
    gds_persist.save(state(1), path)
    ck = open_checkpoint(path)
    try:
        other("save", path=str(path), tag=2)
        with pytest.raises(CheckpointReplacedError, match=r"replaced by another process's save"):
            ck.open_files(range(len(ck.manifest.files)))
    finally:
        ck.close()
    ck = open_checkpoint(path)
    try:
        other("rmtree", path=str(path))
        with pytest.raises(CheckpointReplacedError, match=r"removed by another process"):
            ck.open_files([0])
    finally:
        ck.close()
    gds_persist.save(state(3), path)
    os.unlink(path / "data-00000.bin")  # really missing, same directory: still "truncated"
    with pytest.raises(TruncatedError, match=r"data-00000.bin is missing"):
        gds_persist.load(path)


class ActingMapping(dict):  # type: ignore[type-arg]
    """An empty ``data_dirs`` mapping that runs ``action`` the first time a reader consults it:
    right after the checkpoint directory and manifest were opened, before any data file."""

    def __init__(self, action: Any) -> None:
        super().__init__()
        self.action = action

    def items(self) -> Any:
        action, self.action = self.action, None
        if action is not None:
            action()
        return super().items()


def test_load_and_verify_retry_a_checkpoint_replaced_while_opening(other: Contender,
                                                                  tmp_path: Path) -> None:
    path = tmp_path / "ck"
    gds_persist.save(state(1), path)
    replace = ActingMapping(lambda: other("save", path=str(path), tag=2))
    # opened again: the new one
    assert tag_of(gds_persist.load(path, options=gds_persist.LoadOptions(data_dirs=replace))) == 2
    replace = ActingMapping(lambda: other("save", path=str(path), tag=3, numel=10))
    report = gds_persist.verify(path, data_dirs=replace)
    assert report.ok and report.bytes_checked == 40 + 56
    remove = ActingMapping(lambda: other("rmtree", path=str(path)))
    with pytest.raises(CheckpointReplacedError, match=r"removed by another process"):
        gds_persist.load(path, options=gds_persist.LoadOptions(data_dirs=remove))
    gds_persist.save(state(4), path)
    remove = ActingMapping(lambda: other("rmtree", path=str(path)))
    with pytest.raises(CheckpointReplacedError, match=r"removed by another process"):
        gds_persist.verify(path, data_dirs=remove)


def test_cli_verify_and_inspect_while_another_process_replaces(tmp_path: Path,
                                                              capsys: Any) -> None:
    path = tmp_path / "ck"
    gds_persist.save(state(0, 50_000), path)
    script = ("import sys, torch, gds_persist\n"
              "for k in range(1, 7):\n"
              "    gds_persist.save({'tag': k, 'w': torch.full((50_000,), float(k)),\n"
              "                      'i': torch.full((7,), k)}, sys.argv[1])\n")
    saver = subprocess.Popen([sys.executable, "-c", script, str(path)])
    runs = 0
    try:
        while saver.poll() is None or runs < 2:
            assert cli_main(["verify", str(path)]) == 0
            assert cli_main(["inspect", str(path)]) == 0
            runs += 1
    finally:
        assert saver.wait(timeout=120) == 0
    assert "OK:" in capsys.readouterr().out
    assert tag_of(gds_persist.load(path)) == 6 and sorted(os.listdir(tmp_path)) == ["ck"]


def test_export_holds_the_checkpoint(other: Contender, tmp_path: Path,
                                     small_blocks: None) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "ck"
    gds_persist.save(state(1, 100_000), path)
    gds_persist.export_checkpoint(path, tmp_path / "out.safetensors", progress=acting_once(
        lambda: other("save", path=str(path), tag=2)))
    assert load_file(tmp_path / "out.safetensors")["w"].unique().tolist() == [1.0]


# --- saves of one path from several processes --------------------------------------------------

def test_a_save_never_removes_a_live_save_and_removes_a_dead_one(other: Contender,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "ck"
    held = other("hold_temporary", path=str(path))
    live = [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    assert len(live) == 2  # the directory and its lock file
    gds_persist.save(state(1), path)  # finds a live save's temporary: leaves it
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", *live])
    assert (tmp_path / sorted(live)[0] / "data-00000.bin").exists()
    os.kill(held["pid"], signal.SIGKILL)  # the owner dies: its lock goes with it
    assert other("reap", pid=held["pid"])["signal"] == signal.SIGKILL
    gds_persist.save(state(2), path)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and tag_of(gds_persist.load(path)) == 2


def test_sigkill_of_a_saver_in_its_commit(other: Contender, tmp_path: Path) -> None:
    """A saver killed while holding the path's commit lock: the next save proceeds at once,
    and until then the old checkpoint still loads."""
    path = tmp_path / "ck"
    gds_persist.save(state(1), path)
    held = other("hold_commit_lock", path=str(path))
    with gds_persist.settings.set(io_timeout_s=1):  # alive: a bounded wait, naming it
        with pytest.raises(CheckpointTimeout, match=rf"held by pid {held['pid']} on .*alive"):
            gds_persist.save(state(2), path)
    assert sorted(os.listdir(tmp_path)) == [".ck.commit.lock", "ck"]  # nothing of ours left
    assert tag_of(gds_persist.load(path)) == 1
    os.kill(held["pid"], signal.SIGKILL)
    other("reap", pid=held["pid"])
    assert tag_of(gds_persist.load(path)) == 1
    t0 = time.monotonic()
    gds_persist.save(state(3), path)
    assert time.monotonic() - t0 < 10
    assert tag_of(gds_persist.load(path)) == 3 and sorted(os.listdir(tmp_path)) == ["ck"]


def test_saver_killed_between_the_two_renames_is_repaired(tmp_path: Path) -> None:
    """Without RENAME_EXCHANGE a commit parks the old checkpoint at .NAME.old-<id> for a moment.
    Killed right there (left: that, the new one complete in .NAME.tmp-<id>, an unheld lock),
    the next save puts the old one back first and then replaces it as usual."""
    path = tmp_path / "ck"
    gds_persist.save(state(1), path)
    gds_persist.save(state(2), tmp_path / "new")
    (tmp_path / ".ck.tmp-0123456789ab.lock").write_text("pid 1 on a dead host\n")
    os.rename(path, tmp_path / ".ck.old-0123456789ab")
    os.rename(tmp_path / "new", tmp_path / ".ck.tmp-0123456789ab")
    with pytest.raises(NotCommittedError, match=r"ck does not exist"):
        gds_persist.load(path)
    gds_persist.save(state(3), path)
    assert tag_of(gds_persist.load(path)) == 3 and sorted(os.listdir(tmp_path)) == ["ck"]


def test_concurrent_saves_take_turns_and_the_last_commit_wins(tmp_path: Path) -> None:
    """Two processes save one path over and over, with and without RENAME_EXCHANGE: no save
    fails, every load meanwhile is whole, the path ends as one of the last saves."""
    path = tmp_path / "ck"
    gds_persist.save(state(0), path)
    script = ("import sys, torch, gds_persist\n"
              "from gds_persist.transfer import commit\n"
              "who = int(sys.argv[2]); commit.USE_RENAME_EXCHANGE = who == 1\n"
              "for k in range(5):\n"
              "    t = who * 100 + k\n"
              "    gds_persist.save({'tag': t, 'w': torch.full((50_000,), float(t)),\n"
              "                      'i': torch.full((7,), t)}, sys.argv[1])\n")
    savers = [subprocess.Popen([sys.executable, "-c", script, str(path), str(who)])
              for who in (1, 2)]
    loads = 0
    while any(s.poll() is None for s in savers) or loads < 3:
        tag_of(gds_persist.load(path))
        loads += 1
    assert [s.wait(timeout=120) for s in savers] == [0, 0]
    assert tag_of(gds_persist.load(path)) in (104, 204)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# --- the Checkpointer: `latest`, and retention removing what a reader loads ----------------------

def test_retention_removing_the_step_being_loaded(other: Contender, tmp_path: Path,
                                                  small_blocks: None) -> None:
    root = tmp_path / "run"
    other("ckpt_save", root=str(root), step=1, tag=1, numel=100_000)
    live = other("hold_temporary", path=str(root / "step-00000009"))  # another save, running
    held = sorted(n for n in os.listdir(root) if n.startswith(".step-00000009.tmp-"))

    def next_step() -> None:
        other("ckpt_save", root=str(root), step=2, tag=2, numel=100_000)
        assert not (root / "step-00000001").exists()  # retention (keep_last=1) removed it

    got = gds_persist.load(root / "step-00000001", progress=acting_once(next_step))
    assert tag_of(got) == 1
    with Checkpointer(root, keep_last=None) as ckpt:
        assert ckpt.latest_step() == 2 and tag_of(ckpt.load()) == 2
        with pytest.raises(NotCommittedError, match=r"step-00000001 does not exist"):
            ckpt.load(step=1)
    assert sorted(n for n in os.listdir(root) if n.startswith(".step-00000009")) == held
    (root / ".latest.tmp-fresh").write_text("another publisher's, in flight\n")
    other("ckpt_save", root=str(root), step=3, tag=3)
    assert (root / ".latest.tmp-fresh").exists()  # not removed while it may be in use
    other("release", pid=live["pid"])


# --- the DCP reader -----------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_reader_holds_the_checkpoint(other: Contender, tmp_path: Path,
                                         small_blocks: None) -> None:
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

    path = tmp_path / "ck"
    dcp.save({"w": torch.full((100_000,), 1.0)}, storage_writer=GdsPersistWriter(path),
             no_dist=True)
    target = {"w": torch.zeros(100_000)}
    before = open_fds()
    reader = GdsPersistReader(path, progress=acting_once(
        lambda: other("save", path=str(path), tag=2)))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert target["w"].unique().tolist() == [1.0]
    assert open_fds() - before == set(), "the reader kept descriptors open"
    # a rank that opens the path after the coordinator read the metadata of another checkpoint
    dcp.save({"w": torch.full((100_000,), 3.0)}, storage_writer=GdsPersistWriter(path),
             no_dist=True)
    coordinator = GdsPersistReader(path)
    metadata = coordinator.read_metadata()
    dcp.save({"w": torch.full((100_000,), 4.0)}, storage_writer=GdsPersistWriter(path),
             no_dist=True)
    rank = GdsPersistReader(path)
    with pytest.raises(CheckpointReplacedError, match=r"after the coordinator read its metadata"):
        rank.set_up_storage_reader(metadata, False)
    coordinator.reset()
    assert open_fds() - before == set()


# --- data-parallel saves: data directories of live saves are left alone ------------------------

def test_stale_stripe_removal_respects_live_owners(other: Contender, tmp_path: Path,
                                                   small_blocks: None) -> None:
    from gds_persist.saving.stripes import stripe_prefix

    path, roots = tmp_path / "ck", [tmp_path / "nvme0", tmp_path / "nvme1"]
    for r in roots:
        r.mkdir()
    gds_persist.save(state(1, 100_000), path, options=gds_persist.SaveOptions(data_dirs=roots))
    live = roots[0] / f"{stripe_prefix(str(path))}.gds-0123456789ab"
    held = other("hold_stripe", dir=str(live))  # a rank of another save, writing
    gds_persist.save(state(2, 100_000), path,
                     options=gds_persist.SaveOptions(data_dirs=roots))  # commits, cleans up
    used = {os.path.join(d.root, d.name) for d in gds_persist.read_manifest(path).dirs}
    on_disk = {str(r / e) for r in roots for e in os.listdir(r)}
    assert on_disk == used | {str(live)}  # the replaced one went, the live one stayed
    assert (live / "data-r00000-00000.bin").exists()
    os.kill(held["pid"], signal.SIGKILL)
    other("reap", pid=held["pid"])
    got = gds_persist.load(path, progress=acting_once(  # and a load holds its stripes
        lambda: other("save", path=str(path), tag=3, numel=100_000,
                      data_dirs=[str(r) for r in roots])))
    assert tag_of(got) == 2
    used = {os.path.join(d.root, d.name) for d in gds_persist.read_manifest(path).dirs}
    assert {str(r / e) for r in roots for e in os.listdir(r)} == used  # the dead one went too


# --- descriptors ---------------------------------------------------------------------------------

def test_no_fd_leak_when_replaced_or_missing(other: Contender, tmp_path: Path,
                                             small_blocks: None) -> None:
    path = tmp_path / "ck"
    gds_persist.save(state(1), path)
    gds_persist.load(path)  # lazy imports, first ring
    before = open_fds()
    gds_persist.load(path, progress=acting_once(lambda: other("save", path=str(path), tag=2)),)
    ck = open_checkpoint(path)
    other("save", path=str(path), tag=3)
    with pytest.raises(CheckpointReplacedError):
        ck.open_files([0])
    ck.close()
    shutil.rmtree(path)
    gds_persist.save(state(4), path)
    os.unlink(path / "data-00000.bin")
    with pytest.raises(TruncatedError):
        gds_persist.load(path)
    with pytest.raises(TruncatedError):
        gds_persist.verify(path)
    assert open_fds() - before == set(), "descriptors left open"


# --- the harness, short ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", pytest.param("data-dirs", marks=pytest.mark.slow)])
def test_contention_harness_short(tmp_path: Path, mode: str) -> None:
    """3 savers x 2 saves and 2 loaders on one path: nothing lost, nothing falsely corrupt."""
    result = contention.run_once(mode, savers=3, saves=2, loaders=2, mib=1, work=str(tmp_path),
                                 gap_s=0.05)
    assert contention.problems(result) == [], (contention.summary(result), result["samples"])
    assert result["counts"]["saves"] == 6
    assert result["counts"]["loads"] > 0

"""The read-mode history on disk (``gds_persist/backends/read_history.py``): a new process starts
from the ratios earlier processes measured on the filesystem; processes that record at once lose
nothing; a cache that is malformed, unwritable or switched off never fails a load.

Every test has its own empty ``GDS_PERSIST_CACHE_DIR`` (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends import read_history, read_mode
from gds_persist.backends.posix import supports_o_direct
from tests.helpers import assert_tree_equal, evict_page_cache, random_tensor

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _python(code: str) -> str:
    """``code`` run in a fresh interpreter (this test's environment); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    ok, why = supports_o_direct(str(tmp_path))
    if not ok:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({why}): auto loads do not measure there")
    sd = {"big": random_tensor(torch.uint8, 24 * MiB + 77, seed=21)}
    gds_persist.save(sd, tmp_path / "ck")
    return tmp_path / "ck", sd


def _load(path: Path) -> gds_persist.LoadInfo:
    """A load that measures its read modes: from the drive, not the page cache (an earlier
    load's buffered reads may have left the whole file there)."""
    evict_page_cache(path)
    with gds_persist.settings.set(block_bytes=MiB, staging_bytes=8 * MiB):
        _, info = gds_persist.load_with_info(path)
    return info


def test_a_new_process_starts_from_the_history_of_earlier_ones(tmp_path: Path) -> None:
    """Two loads here, then one in a fresh process: its rule takes the median of all three."""
    path, sd = _checkpoint(tmp_path)
    dev = os.stat(path).st_dev
    _load(path)
    _load(path)
    kept = read_mode.recent(dev)
    assert len(kept) == 2
    assert read_history.load(dev) == kept  # on disk, as measured
    out = _python(
        "import json, gds_persist\n"
        "from gds_persist.backends import read_mode\n"
        "from tests.helpers import evict_page_cache\n"
        f"evict_page_cache({str(path)!r})\n"
        f"with gds_persist.settings.set(block_bytes={MiB}, staging_bytes={8 * MiB}):\n"
        f"    s, info = gds_persist.load_with_info({str(path)!r})\n"
        f"print(json.dumps([info.reason, read_mode.recent({dev})]))\n")
    reason, after = json.loads(out)
    assert "median of the last 3 measured load(s)" in reason, reason
    assert after[:2] == kept and len(after) == 3
    assert read_history.load(dev) == after
    state, _ = gds_persist.load_with_info(path)
    assert_tree_equal(state, sd)


def test_processes_recording_at_once_lose_nothing() -> None:
    """4 processes, 25 updates each, every one adding a ratio: all 100 are in the file."""
    dev = os.stat(REPO).st_dev
    code = ("from gds_persist.backends import read_history\n"
            "for k in range(25):\n"
            f"    read_history.update({dev}, lambda old: [*old, 1.0 + k / 100])\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    assert [p.wait(120) for p in procs] == [0] * 4
    kept = read_history.load(dev)
    assert len(kept) == 100 and sorted(kept) == sorted([1.0 + k / 100 for k in range(25)] * 4)


def test_the_history_stays_bounded_and_named_by_filesystem(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    for k in range(read_mode.HISTORY + 3):
        read_mode.record(dev, 1.0 + k)
    assert read_history.load(dev) == [1.0 + k for k in range(3, read_mode.HISTORY + 3)]
    key = read_history.filesystem_key(dev)
    assert not key.startswith("device ")  # found in /proc/self/mountinfo: type, source, mount
    table = json.loads((Path(read_history.cache_dir()) / read_history.FILE_NAME).read_text())
    assert list(table) == [key]
    read_mode.amend(dev, 1.0 + read_mode.HISTORY + 2, 0.5)  # a buffered load that fell back
    assert read_history.load(dev)[-1] == 0.5 and read_mode.recent(dev)[-1] == 0.5


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"%s": "x"}', '{"%s": [-1, "a"]}'])
def test_a_malformed_history_reads_as_empty_and_is_rewritten(tmp_path: Path,
                                                             content: str) -> None:
    path, sd = _checkpoint(tmp_path)
    dev = os.stat(path).st_dev
    file = Path(read_history.cache_dir()) / read_history.FILE_NAME
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(content.replace("%s", read_history.filesystem_key(dev)))
    assert read_history.load(dev) == []
    info = _load(path)
    assert "median of the last 1 measured load(s)" in info.reason
    assert len(read_history.load(dev)) == 1


def test_an_unwritable_or_disabled_cache_never_fails_a_load(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path, sd = _checkpoint(tmp_path)
    dev = os.stat(path).st_dev
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(read_history.CACHE_ENV, str(blocker / "cache"))  # under a file: ENOTDIR
    assert "median of the last 1" in _load(path).reason
    assert read_history.load(dev) == []
    monkeypatch.setenv(read_history.CACHE_ENV, "")  # switched off: nothing kept on disk
    assert read_history.cache_dir() is None
    read_mode.forget()
    assert "median of the last 1" in _load(path).reason
    assert read_history.load(dev) == [] and len(read_mode.recent(dev)) == 1


def test_the_default_place_is_the_users_cache(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.delenv(read_history.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert read_history.cache_dir() == str(tmp_path / "xdg" / "gds_persist")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert read_history.cache_dir() == str(tmp_path / "home" / ".cache" / "gds_persist")

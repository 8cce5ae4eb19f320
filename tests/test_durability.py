"""Durability and atomicity: what a killed save leaves, what load refuses, what stays open."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist import ChecksumError, DiskFullError, NotCommittedError, TruncatedError
from gds_persist.cli import main as cli_main
from gds_persist.format import MANIFEST_NAME
from tests.helpers import BackendCase, assert_tree_equal, flip_byte, open_fds

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    for name in list(env):
        if name.startswith("GDS_PERSIST_"):
            del env[name]
    return env


# --- uncommitted directories ----------------------------------------------------------------

@pytest.mark.parametrize("mark", [".tmp-", ".old-"])
def test_load_refuses_a_temporary_directory(tmp_path: Path, mark: str) -> None:
    """Even a complete-looking temporary directory is not a committed checkpoint."""
    gds_persist.save({"w": torch.ones(3)}, tmp_path / "ck")
    tmp = tmp_path / f".ck{mark}0123456789ab"
    shutil.copytree(tmp_path / "ck", tmp)
    for call in (gds_persist.load, gds_persist.verify, gds_persist.read_manifest):
        with pytest.raises(NotCommittedError, match=r"temporary directory of an interrupted"):
            call(tmp)


def test_load_refuses_a_directory_without_manifest(tmp_path: Path) -> None:
    gds_persist.save({"w": torch.ones(3)}, tmp_path / "ck")
    os.unlink(tmp_path / "ck" / MANIFEST_NAME)
    with pytest.raises(NotCommittedError, match=r"ck has no manifest.json: it is not a committed"):
        gds_persist.load(tmp_path / "ck")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotCommittedError, match=r"empty has no manifest.json"):
        gds_persist.verify(tmp_path / "empty")
    with pytest.raises(NotCommittedError, match=r"nowhere does not exist"):
        gds_persist.load(tmp_path / "nowhere")


def test_next_save_removes_stale_temporaries_of_its_own_path_only(tmp_path: Path) -> None:
    """Dead owners only: a lock file nobody holds, or (an older gds_persist's leftover, with no
    lock file) untouched for an hour; a fresh lockless one may be a live older-version save."""
    hours_ago = time.time() - 2 * 3600
    for name in (".ck.tmp-deadbeef0001", ".ck.old-deadbeef0002", ".other.tmp-deadbeef0003",
                 ".ck.tmp-deadbeef0004", ".ck.tmp-feedbeef0005"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data-00000.bin").write_bytes(b"partial")
        if name.endswith(("1", "2", "3")):
            for p in (tmp_path / name / "data-00000.bin", tmp_path / name):
                os.utime(p, (hours_ago, hours_ago))
    (tmp_path / ".ck.tmp-deadbeef0004.lock").write_text("pid 1 on a host long gone\n")
    gds_persist.save({"w": torch.ones(3)}, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == [".ck.tmp-feedbeef0005", ".other.tmp-deadbeef0003",
                                            "ck"]
    assert (tmp_path / ".other.tmp-deadbeef0003" / "data-00000.bin").exists()


def test_replacing_keeps_nothing_extra(tmp_path: Path) -> None:
    for step in range(3):
        gds_persist.save({"step": step, "w": torch.full((5,), step)}, tmp_path / "ck")
        assert sorted(os.listdir(tmp_path)) == ["ck"]
        assert gds_persist.load(tmp_path / "ck")["step"] == step


# --- killed at random instants --------------------------------------------------------------

# A pre-fork server: imports torch once, then forks one saver per trial, which the test
# SIGKILLs. Each saver saves to PATH forever, printing each step once it is committed. A line
# is one write(2): print() writes the text and the newline apart where stdout is unbuffered
# (PYTHONUNBUFFERED=1), and a kill between the two once ran the step into the server's
# "reaped" line ('4072reaped 9', seed 2110751601, a fresh clone's `make test`, 2026-12-02).
_SERVER = textwrap.dedent("""
    import os, sys, torch, gds_persist
    def say(*words):
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())
    for line in sys.stdin:
        path, step = line.split()
        step = int(step)
        pid = os.fork()
        if pid == 0:
            try:
                say("pid", os.getpid())
                while True:
                    sd = {"step": step, "big": torch.full((1 << 19,), float(step)),
                          "small": [torch.full((n,), step, dtype=torch.int64)
                                    for n in (1, 511, 4097)]}
                    sd["tied"] = sd["big"][7:9]
                    with gds_persist.settings.set(block_bytes=256 << 10, staging_bytes="1MiB",
                                                  io_threads=2):
                        gds_persist.save(sd, path)
                    say(step)
                    step += 1
            finally:
                os._exit(1)
        say("reaped", os.waitpid(pid, 0)[1])
""")


def _check_consistent(path: Path) -> int:
    assert gds_persist.verify(path).ok
    sd = gds_persist.load(path)
    step = sd["step"]
    assert torch.equal(sd["big"], torch.full((1 << 19,), float(step)))
    for t, n in zip(sd["small"], (1, 511, 4097), strict=True):
        assert torch.equal(t, torch.full((n,), step, dtype=torch.int64))
    assert sd["tied"].untyped_storage().data_ptr() == sd["big"].untyped_storage().data_ptr()
    return step


def _kill_one_saver(server: subprocess.Popen[str], path: Path, first: int,
                    delay: float) -> list[int]:
    """Start a saver, SIGKILL it after ``delay`` seconds; return the steps it committed."""
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(f"{path} {first}\n")
    server.stdin.flush()
    kind, pid = server.stdout.readline().split()
    assert kind == "pid"
    time.sleep(delay)
    os.kill(int(pid), signal.SIGKILL)
    reported = []
    for line in server.stdout:
        if line.startswith("reaped"):
            assert int(line.split()[1]) == signal.SIGKILL, "the saver died of something else"
            return reported
        reported.append(int(line))
    raise AssertionError(f"the server died: {server.wait()}")


@pytest.mark.slow
def test_sigkill_at_random_instants_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    path = tmp_path / "ck"
    previous: int | None = None  # the step of the checkpoint at path before this trial
    saves_seen = 0
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    try:
        for trial in range(8):
            first = trial * 1000
            reported = _kill_one_saver(server, path, first, rng.uniform(0.0, 1.0))
            saves_seen += len(reported)
            if not path.exists():
                assert previous is None and not reported, "a committed checkpoint vanished"
            else:
                step = _check_consistent(path)
                # the last save it reported, or one committed just before it could say so
                allowed = {reported[-1], reported[-1] + 1} if reported else {previous, first}
                assert step in allowed, f"trial {trial}: found step {step}, allowed {allowed}"
                previous = step
            leftovers = sorted(n for n in os.listdir(tmp_path) if n != "ck")
            gds_persist.save({"step": -1}, tmp_path / "other")  # another path: leaves ours alone
            assert sorted(n for n in os.listdir(tmp_path) if n not in ("ck", "other")) == leftovers
            shutil.rmtree(tmp_path / "other")
    finally:
        server.kill()
        server.communicate(timeout=30)
    assert saves_seen > 0, "the kills all came before any save finished: the test proved little"

    # the next save of the path removes what the killed saves left behind
    gds_persist.save({"step": 7}, path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert gds_persist.load(path) == {"step": 7}


# --- no descriptor outlives a call ----------------------------------------------------------

def _no_new_fds(fn: Any, *args: Any, **kwargs: Any) -> Any:
    before = open_fds()
    try:
        return fn(*args, **kwargs)
    finally:
        leaked = open_fds() - before
        assert not leaked, f"{getattr(fn, '__name__', fn)} left descriptors open: {leaked}"


def test_no_fd_leak_on_success(backend: BackendCase, tmp_path: Path) -> None:
    sd = {"w": torch.randn(50_000, device=backend.device), "i": torch.arange(3)}
    gds_persist.save(sd, tmp_path / "warm", backend=backend.name)  # lazy imports, first ring
    gds_persist.load(tmp_path / "warm", backend=backend.name)
    for i in range(3):
        with gds_persist.settings.set(block_bytes=8192, staging_bytes=16384):
            _no_new_fds(gds_persist.save, sd, tmp_path / "ck", backend=backend.name)
        got = _no_new_fds(gds_persist.load, tmp_path / "ck", backend=backend.name)
        assert_tree_equal(got, sd)
        assert _no_new_fds(gds_persist.verify, tmp_path / "ck", backend=backend.name).ok
        _no_new_fds(gds_persist.read_manifest, tmp_path / "ck")
        assert _no_new_fds(cli_main, ["verify", str(tmp_path / "ck")]) == 0
        assert i == 0 or sorted(os.listdir(tmp_path)) == ["ck", "warm"]


def test_no_fd_leak_on_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = {"a": torch.randn(3000), "b": torch.randn(3000)}
    gds_persist.save(sd, tmp_path / "ck")
    gds_persist.load(tmp_path / "ck")
    data = tmp_path / "ck" / "data-00000.bin"

    with pytest.raises(TypeError, match="cannot checkpoint"):
        _no_new_fds(gds_persist.save, {"x": object()}, tmp_path / "bad")
    flip_byte(data, 100)
    with pytest.raises(ChecksumError, match=r"\['a'\]"):
        _no_new_fds(gds_persist.load, tmp_path / "ck")
    assert not _no_new_fds(gds_persist.verify, tmp_path / "ck").ok
    assert _no_new_fds(cli_main, ["verify", str(tmp_path / "ck")]) == 1
    os.truncate(data, 4096)
    with pytest.raises(TruncatedError, match="truncated"):
        _no_new_fds(gds_persist.load, tmp_path / "ck", backend="direct")
    with pytest.raises(ValueError, match="at least two blocks"):
        _no_new_fds(gds_persist.settings.set, staging_bytes=4096, block_bytes=4096)
    capsys.readouterr()


def test_no_fd_leak_when_the_disk_is_full(small_tmpfs: Path) -> None:
    gds_persist.save({"w": torch.ones(10)}, small_tmpfs / "warm")
    for backend in ("buffered", "direct"):
        with pytest.raises(DiskFullError, match="no space left"):
            _no_new_fds(gds_persist.save, {"w": torch.zeros(3 << 20)}, small_tmpfs / "ck",
                        backend=backend)
    assert os.listdir(small_tmpfs) == ["warm"]


# --- the GPU stack is never imported by accident --------------------------------------------

def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=_env(), cwd=cwd, timeout=120)


def test_import_and_cpu_use_without_kvikio_or_cupy(tmp_path: Path) -> None:
    """With kvikio and cupy unimportable, ``import gds_persist`` and CPU save/load/verify work
    and never even try to import them; asking for the kvikio backend names the extra."""
    ck, ck2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    r = _run(f"""
        import sys

        GPU_STACK = ("kvikio", "cupy", "cupy_backends")
        tried = []

        class Blocker:  # makes the GPU stack unimportable, and records every attempt
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in GPU_STACK:
                    tried.append(name)
                    raise ImportError(f"{{name}} is blocked by the test")
                return None

        sys.meta_path.insert(0, Blocker())
        import torch, gds_persist, gds_persist.cli
        sd = {{"w": torch.arange(10.0)}}
        info = gds_persist.save(sd, {ck!r})
        assert torch.equal(gds_persist.load({ck!r})["w"], sd["w"])
        assert gds_persist.verify({ck!r}).ok
        print("backend", info.backend)
        print("tried", tried)
        print("loaded", [m for m in sys.modules if m.split(".")[0] in GPU_STACK])
        try:
            gds_persist.save(sd, {ck2!r}, backend="kvikio")
        except gds_persist.BackendError as e:
            print("error", e)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] in ("backend direct", "backend buffered")
    assert lines[1] == "tried []", "gds_persist tried to import the GPU stack on a CPU path"
    assert lines[2] == "loaded []"
    assert lines[3].startswith("error backend 'kvikio' needs kvikio, which is not importable")
    assert "pip install 'gds_persist[gpu]'" in lines[3]
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the refused kvikio save left something"
    assert not (tmp_path / "cufile.log").exists()


# --- an I/O error in the middle of a save or load -------------------------------------------
# EIO cannot be provoked on demand here, so a real DirectBackend is wrapped to fail its Nth call.

class _FailingDirect:
    """The real O_DIRECT backend, except that call number ``fail_at`` of ``method`` raises EIO."""

    def __init__(self, method: str, fail_at: int) -> None:
        from gds_persist.backends import DirectBackend

        self._real = DirectBackend()
        self._method, self._fail_at, self.calls = method, fail_at, 0
        self.name, self.accepts_device = "direct", False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._real, name)
        if name != self._method:
            return real

        def call(*args: Any) -> Any:
            self.calls += 1
            if self.calls == self._fail_at:
                raise OSError(5, "Input/output error (injected)")
            return real(*args)

        return call


def _inject(monkeypatch: pytest.MonkeyPatch, module: str, backend: _FailingDirect) -> None:
    import importlib

    monkeypatch.setattr(importlib.import_module(module), "choose_backend",
                        lambda *a, **k: (backend, "fault injection"))


def _ring_intact() -> None:
    from gds_persist.transfer import staging

    (ring,) = staging._idle_rings
    assert ring._free.qsize() == ring.count, "a staging buffer was not returned to the ring"


@pytest.mark.parametrize("fail_at", [1, 3, 9])
def test_write_error_mid_save_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            fail_at: int) -> None:
    path = tmp_path / "ck"
    old = {"w": torch.full((100,), 1.0)}
    gds_persist.save(old, path)
    new = {"w": torch.randn(40_000), "v": torch.randn(3)}  # 40 blocks of 4 KiB
    faulty = _FailingDirect("pwrite", fail_at)
    _inject(monkeypatch, "gds_persist.saving.units", faulty)
    before = open_fds()
    with pytest.raises(OSError, match=r"Input/output error \(injected\)"):
        with gds_persist.settings.set(block_bytes=4096, staging_bytes=3 * 4096, io_threads=2):
            gds_persist.save(new, path)
    assert open_fds() == before, "descriptors left open after a failed save"
    assert faulty.calls >= fail_at
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the temporary directory must be removed"
    _ring_intact()
    monkeypatch.undo()
    assert_tree_equal(gds_persist.load(path), old)


@pytest.mark.parametrize("fail_at", [1, 3, 9])
def test_write_error_mid_torch_file_save_loses_nothing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       fail_at: int) -> None:
    """The one-file format fails the same way: the file at the path is the old one, whole."""
    path = tmp_path / "x.pt"
    old = {"w": torch.full((100,), 1.0)}
    gds_persist.save(old, path, format="torch")
    faulty = _FailingDirect("pwrite", fail_at)
    _inject(monkeypatch, "gds_persist.saving.units", faulty)
    before = open_fds()
    with pytest.raises(OSError, match=r"Input/output error \(injected\)"):
        with gds_persist.settings.set(block_bytes=4096, staging_bytes=3 * 4096, io_threads=2):
            gds_persist.save({"w": torch.randn(40_000), "v": torch.randn(3)}, path, format="torch")
    assert open_fds() == before, "descriptors left open after a failed save"
    assert sorted(os.listdir(tmp_path)) == ["x.pt"], "the temporary directory must be removed"
    _ring_intact()
    monkeypatch.undo()
    assert_tree_equal(torch.load(path, weights_only=True), old)
    assert_tree_equal(gds_persist.load(path), old)


@pytest.mark.parametrize("fail_at", [1, 4])
def test_read_error_mid_load_is_raised_and_cleaned_up(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      fail_at: int) -> None:
    path = tmp_path / "ck"
    sd = {"w": torch.randn(40_000)}
    gds_persist.save(sd, path)
    faulty = _FailingDirect("pread", fail_at)
    with gds_persist.settings.set(block_bytes=4096, staging_bytes=3 * 4096, io_timeout_s=20):
        gds_persist.load(path)  # warm: lazy imports, the ring
        _inject(monkeypatch, "gds_persist.loading.extents", faulty)
        before = open_fds()
        with pytest.raises(OSError, match=r"Input/output error \(injected\)"):
            gds_persist.load(path)
        assert open_fds() == before
        _ring_intact()
        monkeypatch.undo()
        assert_tree_equal(gds_persist.load(path), sd)
    # the failed load's traceback still pins a staging buffer: a save that replaces the ring
    # (other sizes) must still work (it raised BufferError from the ring's cleanup)
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=16384):
        gds_persist.save(sd, tmp_path / "after")
    assert_tree_equal(gds_persist.load(tmp_path / "after"), sd)


def test_concurrent_saves_and_loads_of_different_paths(tmp_path: Path) -> None:
    """Saves and loads from several threads at once (e.g. an async checkpoint thread)."""
    from concurrent.futures import ThreadPoolExecutor

    def work(i: int) -> None:
        sd = {"i": i, "w": torch.full((5000 + i,), float(i))}
        ring = {"block_bytes": 4096 * (1 + i % 2), "staging_bytes": 4096 * (2 + i % 2) * 2}
        for _ in range(3):
            with gds_persist.settings.in_this_thread(**ring):  # each thread its own ring
                gds_persist.save(sd, tmp_path / f"ck{i}")
            assert_tree_equal(gds_persist.load(tmp_path / f"ck{i}"), sd)

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(work, i) for i in range(4)]:
            f.result(timeout=120)
    assert sorted(os.listdir(tmp_path)) == [f"ck{i}" for i in range(4)]


class _HangingDirect(_FailingDirect):
    """The real O_DIRECT backend whose ``pwrite`` calls do not return (a hung drive) until
    released. They block after the real write, as a request stuck in the drive would: inside the
    call, never touching the descriptor again."""

    def __init__(self) -> None:
        super().__init__("pwrite", 0)
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._real, name)
        if name != "pwrite":
            return real

        def stuck(*args: Any) -> Any:
            result = real(*args)
            self.release.wait(30)
            return result

        return stuck


def test_hung_storage_fails_within_the_timeout(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that never returns must not hang save(): it fails after io_timeout_s, not after
    the write finally returns, and the previous checkpoint stays loadable."""
    path = tmp_path / "ck"
    old = {"w": torch.full((100,), 1.0)}
    gds_persist.save(old, path)
    hung = _HangingDirect()
    _inject(monkeypatch, "gds_persist.saving.units", hung)
    t0 = time.monotonic()
    try:
        with pytest.raises(gds_persist.CheckpointError, match="within 1 s"):
            _save_with_timeout({"w": torch.randn(40_000)}, path)
        waited = time.monotonic() - t0
    finally:
        hung.release.set()  # let the stuck threads finish
    # bounded by the timeout (1 s for the stuck block, 1 s for draining), far below the 30 s hang
    assert waited < 15, f"save waited {waited:.1f} s for a hung write"
    monkeypatch.undo()
    assert_tree_equal(gds_persist.load(path), old)


def _save_with_timeout(sd: Any, path: Path) -> None:
    with gds_persist.settings.set(io_timeout_s=1):
        with gds_persist.settings.set(block_bytes=4096, staging_bytes=3 * 4096, io_threads=2):
            gds_persist.save(sd, path)


# --- the aligned end of a file written with exact lengths ----------------------------------

@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("place", ["disk", "tmpfs"])
def test_zero_pad_end_makes_the_aligned_end_and_keeps_every_byte(
        tmp_path: Path, direct: bool, place: str) -> None:
    """kvikio writes device extents with exact lengths; on tmpfs nothing reserves the file, so
    the padding after its last extent is written as zeros before the fsync (the manifest
    records the aligned size). It never shrinks a file nor touches bytes beyond the padding."""
    from gds_persist.backends.posix import _O_DIRECT, supports_o_direct, zero_pad_end

    where = tmp_path if place == "disk" else Path("/dev/shm")
    if place == "tmpfs" and not os.access(where, os.W_OK):
        pytest.skip("no writable /dev/shm")
    if direct and not supports_o_direct(str(where))[0]:
        pytest.skip(f"{where} takes no O_DIRECT")
    path = where / f"pad-{os.getpid()}-{direct}.bin"
    data = bytes(random.Random(1).randrange(256) for _ in range(5000))
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_WRONLY | (_O_DIRECT if direct else 0))
        try:
            zero_pad_end(str(path), fd, direct, 5000)
            assert path.read_bytes() == data + bytes(8192 - 5000)
            zero_pad_end(str(path), fd, direct, 3000)  # an earlier end: nothing to do
            zero_pad_end(str(path), fd, direct, 8192)  # already aligned
            assert path.read_bytes() == data + bytes(8192 - 5000)
        finally:
            os.close(fd)
        tail = b"\xff" * 4096  # another rank's bytes after the padding: left as they are
        with open(path, "r+b") as f:
            f.seek(8192)
            f.write(tail)
        fd = os.open(path, os.O_WRONLY | (_O_DIRECT if direct else 0))
        try:
            zero_pad_end(str(path), fd, direct, 9000)
        finally:
            os.close(fd)
        assert path.read_bytes() == data + bytes(8192 - 5000) + tail
    finally:
        path.unlink()

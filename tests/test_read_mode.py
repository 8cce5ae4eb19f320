"""``backend="auto"`` loads: the read mode decided by the load's own requests.

The pure parts (the measuring plan, the rates of its rounds, the rule on recent loads' ratios)
on inputs like those recorded in bench/results (issue 26's runs: a separate sample measured 1.02
vs 1.03 GB/s and chose O_DIRECT while whole buffered loads ran 1.46x faster); then real files:
both modes land the right bytes, nothing is read twice, later loads keep measuring and the
recent loads' median decides."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends import read_mode
from gds_persist.backends.adaptive import AdaptiveReadBackend
from gds_persist.backends.posix import supports_o_direct
from gds_persist.backends.read_mode import Plan, Timing, decide, plan, rates, ratio
from gds_persist.loading import extents as extents_module
from gds_persist.transfer.staging import AlignedBuffer
from tests.helpers import assert_tree_equal, random_tensor

GB = 1e9
MiB = 1 << 20


# ------------------------------------------------------------------ the rule, recorded inputs

def test_a_tie_keeps_o_direct() -> None:
    """Issue 26's sample: 1.02 GB/s O_DIRECT vs 1.03 buffered is within the margin."""
    buffered, reason = decide([1.03 / 1.02])
    assert not buffered
    assert reason.startswith("reads via O_DIRECT: buffered / O_DIRECT read rate 1.01x, median "
                             "of the last 1 measured load(s)")


def test_buffered_clearly_ahead_is_taken() -> None:
    """Issue 26's disk: buffered whole loads 1.52 GB/s against 1.04 with O_DIRECT."""
    buffered, reason = decide([1.52 / 1.04])
    assert buffered
    assert "reads via page cache (buffered)" in reason and "only above 1.05x" in reason


@pytest.mark.parametrize(("ratios", "buffered"), [
    ([0.80, 0.85, 1.40], False),  # one lucky load among O_DIRECT wins: the median holds
    ([1.30, 0.90, 1.40], True),  # one unlucky load among buffered wins
    ([1.05, 1.05], False),  # exactly the margin: O_DIRECT
    ([], False)])  # nothing measured yet
def test_the_median_of_recent_loads_decides(ratios: list[float], buffered: bool) -> None:
    assert decide(ratios)[0] is buffered


@pytest.mark.parametrize(("load", "buffered_now", "expected"), [
    (1 << 30, False, Plan(("buffered", "direct"), 4)),  # the other mode first, 4 at once
    (1 << 30, True, Plan(("direct", "buffered"), 4)),  # then the chosen one, which goes on
    (512 * MiB, False, Plan(("buffered", "direct"), 2)),  # fewer at once: within 1/8
    (256 * MiB, True, Plan(("direct", "buffered"), 1)),
    (128 * MiB, False, read_mode.NO_PLAN)])  # not even one request a round
def test_plan(load: int, buffered_now: bool, expected: Plan) -> None:
    got = plan(load, threads=4, request_bytes=16 * MiB, buffered_now=buffered_now)
    assert got == expected
    assert got.requests * 16 * MiB <= load // read_mode.FRACTION


def test_rates_of_rounds() -> None:
    """Recorded from a 1 GiB load (4 x 16 MiB at once): a run of two buffered rounds counts its
    bytes over its whole span; the two O_DIRECT rounds add up."""
    r = 16 * MiB
    timings = [Timing(0, "direct", 0.00, 0.060, r), Timing(0, "direct", 0.00, 0.064, r),
               Timing(1, "buffered", 0.064, 0.080, r), Timing(2, "buffered", 0.080, 0.096, r),
               Timing(3, "direct", 0.096, 0.158, r), Timing(3, "direct", 0.098, 0.160, r)]
    got = rates(timings)
    assert got["direct"] == pytest.approx(4 * r / (0.064 + 0.064))
    assert got["buffered"] == pytest.approx(2 * r / 0.032)
    assert ratio(got) == pytest.approx(2.0)
    assert ratio(rates(timings[:2])) is None  # one mode only: no ratio
    assert rates([Timing(0, "direct", 1.0, 1.0, r)]) == {}  # no time: not a rate


@pytest.mark.parametrize(("later_gbps", "ends_in"), [(0.19, "direct"), (1.20, "buffered")])
def test_a_buffered_load_that_collapses_goes_back_to_o_direct(later_gbps: float,
                                                              ends_in: str) -> None:
    """Recorded on the shared VM (bench/results/2026-12-02-cpu-bench_io-disk-cc1fe0e.txt, run
    3): the rounds read O_DIRECT 0.67 GB/s, buffered 1.31, and the buffered load then ran at
    0.18 GB/s. Fed those timings, the backend goes back to O_DIRECT after one round's worth of
    slow buffered requests and this load's ratio says so; a buffered rate that holds stays."""
    dev, r = 12345, 16 * MiB  # a filesystem key of this test's own
    for _ in range(4):
        read_mode.record(dev, 2.0)
    be = AdaptiveReadBackend(4096, dev, 1 << 30, threads=4, block_bytes=16 * MiB)
    assert be.plan == Plan(("direct", "buffered"), 4)  # buffered chosen: O_DIRECT first
    span_d, span_b = 4 * r / 0.67e9, 4 * r / 1.31e9
    for _ in range(4):
        be._leave(Timing(0, "direct", 0.0, span_d, r))
    for _ in range(4):
        be._leave(Timing(1, "buffered", span_d, span_d + span_b, r))
    assert be.name == "buffered"
    t0, span = span_d + span_b, 4 * r / (later_gbps * 1e9)
    for _ in range(4):
        be._leave(Timing(2, "buffered", t0, t0 + span, r))
    assert be.name == ends_in
    if ends_in == "direct":
        assert "then buffered reads fell to 0.19 GB/s: the rest via O_DIRECT" in be.reason()
        assert read_mode.recent(dev)[-1] == pytest.approx(0.19 / 0.67, rel=1e-3)
    else:
        assert read_mode.recent(dev)[-1] == pytest.approx(1.31 / 0.67, rel=1e-3)
    assert read_mode.collapsed(0.60e9, 0.67e9) and not read_mode.collapsed(0.66e9, 0.67e9)
    assert not read_mode.collapsed(0.1e9, 0.0)  # nothing measured with O_DIRECT


# ------------------------------------------------------------------ real files

def _on_o_direct_disk(path: Path) -> None:
    ok, why = supports_o_direct(str(path))
    if not ok:
        pytest.skip(f"{path} refuses O_DIRECT ({why})")


def _write(path: Path, nbytes: int) -> bytes:
    data = os.urandom(nbytes)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    return data


def test_every_request_lands_its_bytes_either_way(tmp_path: Path) -> None:
    """The backend alone, 4 threads reading a file once in 1 MiB requests: every request of the
    plan is timed in its round's mode, the bytes are the file's, the rounds made a decision."""
    _on_o_direct_disk(tmp_path)
    path = tmp_path / "data.bin"
    data = _write(path, 32 * MiB)
    be = AdaptiveReadBackend(4096, os.stat(path).st_dev, 32 * MiB, threads=4, block_bytes=MiB)
    assert be.plan == Plan(("buffered", "direct"), 2)  # nothing chosen yet: O_DIRECT
    handle = be.open(str(path), write=False)
    offsets = list(range(0, 32 * MiB, MiB))
    got = bytearray(32 * MiB)
    lock = threading.Lock()

    def worker() -> None:
        with AlignedBuffer(MiB, pin=False) as buf:
            while True:
                with lock:
                    if not offsets:
                        return
                    offset = offsets.pop(0)
                assert be.pread(handle, buf.view, offset) == MiB
                got[offset : offset + MiB] = buf.view

    try:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        be.close(handle)
    assert bytes(got) == data
    modes = [t.mode for t in sorted(be._timings, key=lambda t: t.round)]
    assert modes == ["buffered"] * 2 + ["direct"] * 2
    first_direct = min(t.start for t in be._timings if t.mode == "direct")
    assert all(t.end <= first_direct for t in be._timings if t.mode == "buffered")  # apart
    assert len(read_mode.recent(be.dev)) == 1  # this load's ratio is kept
    assert ("this load's first 4 requests (2 rounds BD of 2 at once, at most 1 MiB each) read "
            "direct") in be.reason()
    with pytest.raises(gds_persist.BackendError, match="only reads"):
        be.open(str(path), write=True)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("history", [[], [3.0] * 4, [0.3] * 4],
                         ids=["first", "buffered-before", "direct-before"])
def test_auto_load_measures_on_its_own_requests(tmp_path: Path, history: list[float]) -> None:
    """A real load: the right bytes in both modes, no byte read beside the load (the process's
    read count grows by the load's bytes and the manifest only), and the mode it ends in is
    what the median of the recent loads' ratios, its own included, says (or O_DIRECT, where
    buffered reads it chose fell behind later in the load)."""
    _on_o_direct_disk(tmp_path)
    sd = {"a": random_tensor(torch.float32, 5 * MiB, seed=3),  # 20 MiB, read straight in
          "small": [random_tensor(torch.int64, 1000 + k, seed=k) for k in range(40)],
          "b": random_tensor(torch.uint8, 12 * MiB + 123, seed=4)}
    gds_persist.save(sd, tmp_path / "ck")
    dev = os.stat(tmp_path / "ck").st_dev
    for value in history:
        read_mode.record(dev, value)
    with gds_persist.settings.set(block_bytes=MiB, staging_bytes=8 * MiB):
        before = _rchar()
        state, info = gds_persist.load_with_info(tmp_path / "ck", backend="auto")
        read = _rchar() - before
    assert_tree_equal(state, sd)
    assert info.payload_bytes <= read <= info.bytes_read + MiB  # nothing read twice
    ratios = read_mode.recent(dev)
    assert len(ratios) == len(history) + 1
    buffered, _ = decide(ratios)
    fell = "then buffered reads fell to" in info.reason  # slower later in the load: O_DIRECT
    assert info.backend == ("buffered" if buffered and not fell else "direct")
    # 4 I/O threads, ~33 MiB in 1 MiB requests: 2 at once in rounds within 1/8 of it; the
    # mode the recent loads did not choose goes first
    order = "DB" if decide(history)[0] else "BD"
    assert (f"this load's first 4 requests (2 rounds {order} of 2 at once, at most 1 MiB "
            "each)") in info.reason
    assert "median of the last" in info.reason


def test_measuring_requests_are_cut_to_the_probe_size(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A load in 4 MiB requests times only the heads of its first requests (PROBE_BYTES, cut
    here from 4 MiB to 1 MiB to keep the file small): every timed request holds at most the
    probe, the tails and the rest follow, and every byte is read once, into its place."""
    _on_o_direct_disk(tmp_path)
    monkeypatch.setattr(read_mode, "PROBE_BYTES", MiB)
    sd = {"a": random_tensor(torch.float32, 6 * MiB, seed=3),  # 24 MiB, read straight in
          "small": [random_tensor(torch.int64, 1000 + k, seed=k) for k in range(40)],
          "b": random_tensor(torch.uint8, 14 * MiB + 123, seed=4)}
    gds_persist.save(sd, tmp_path / "ck")
    backends: list[object] = []
    chosen = extents_module._read_backend

    def keep(*args: object, **kwargs: object) -> object:  # the real backend, kept to look at
        got = chosen(*args, **kwargs)  # type: ignore[arg-type]
        backends.append(got[0])
        return got

    monkeypatch.setattr(extents_module, "_read_backend", keep)
    with gds_persist.settings.set(block_bytes=4 * MiB, staging_bytes=16 * MiB):
        before = _rchar()
        state, info = gds_persist.load_with_info(tmp_path / "ck", backend="auto")
        read = _rchar() - before
    assert_tree_equal(state, sd)
    assert info.payload_bytes <= read <= info.bytes_read + MiB  # nothing read twice
    (be,) = backends
    assert isinstance(be, AdaptiveReadBackend) and be.plan.requests == 4  # 2 rounds of 2
    sizes = [t.nbytes for t in be._timings]
    assert len(sizes) == 4 and max(sizes) == MiB, sizes  # heads of 4 MiB requests
    assert "(2 rounds BD of 2 at once, at most 1 MiB each)" in info.reason


def test_small_load_reads_as_recent_loads_say(tmp_path: Path) -> None:
    _on_o_direct_disk(tmp_path)
    sd = {"w": random_tensor(torch.uint8, 3 * MiB, seed=1)}
    gds_persist.save(sd, tmp_path / "ck")
    state, info = gds_persist.load_with_info(tmp_path / "ck")  # 16 MiB requests
    assert_tree_equal(state, sd)
    assert info.backend == "direct" and "too small to measure" in info.reason
    assert "nothing measured on this filesystem yet" in info.reason
    read_mode.record(os.stat(tmp_path / "ck").st_dev, 2.0)
    state, info = gds_persist.load_with_info(tmp_path / "ck")
    assert_tree_equal(state, sd)
    assert info.backend == "buffered" and "read rate 2.00x" in info.reason
    _, explicit = gds_persist.load_with_info(tmp_path / "ck", backend="direct")
    assert (explicit.backend, explicit.reason) == ("direct", "requested explicitly")


def _shm() -> Path:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    return Path("/dev/shm")


def test_tmpfs_loads_are_measured_too(tmp_path: Path) -> None:
    # both modes copy out of the page cache there, yet buffered ran 1.02-1.32x faster on the VM
    shm = _shm() / f"gds-read-mode-{os.getpid()}"
    sd = {"big": random_tensor(torch.uint8, 40 * MiB, seed=5)}
    try:
        gds_persist.save(sd, shm)
        dev = os.stat(shm).st_dev
        before = len(read_mode.recent(dev))
        with gds_persist.settings.set(block_bytes=MiB, staging_bytes=8 * MiB):
            state, info = gds_persist.load_with_info(shm, backend="auto")
        assert_tree_equal(state, sd)
        assert info.backend in ("direct", "buffered")
        assert "buffered / O_DIRECT read rate" in info.reason, info.reason
        assert len(read_mode.recent(dev)) == min(before + 1, read_mode.HISTORY)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_tmpfs_loads_are_not_watched_for_a_collapse(tmp_path: Path) -> None:
    """On tmpfs the files are the page cache: a slow window after the rounds (the cost of fresh
    destination pages) must not send a buffered load back to O_DIRECT; on a drive it does."""
    from gds_persist.backends import choose_backend
    from gds_persist.backends.posix import memory_backed

    if memory_backed(str(tmp_path)):
        pytest.skip(f"{tmp_path} is memory-backed: no drive to compare tmpfs with")
    shm = _shm() / f"gds-read-watch-{os.getpid()}"
    shm.mkdir()
    try:
        for directory, watched in ((shm, False), (tmp_path, True)):
            (directory / "data.bin").write_bytes(b"\0" * 4096)
            fd = os.open(directory / "data.bin", os.O_RDONLY)
            try:  # out of the page cache: a cached file on a drive reads through it (residency)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if not supports_o_direct(str(directory))[0]:
                continue
            be, _ = choose_backend("auto", str(directory), False, 4, 16 * MiB,
                                   read_load=(str(directory / "data.bin"), 1 << 30))
            assert isinstance(be, AdaptiveReadBackend) and be.watch is watched
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    dev, r = 54321, 16 * MiB
    for _ in range(4):
        read_mode.record(dev, 2.0)
    be = AdaptiveReadBackend(4096, dev, 1 << 30, threads=4, block_bytes=r, watch=False)
    for k, (mode, seconds) in enumerate([("direct", 0.1), ("buffered", 0.05)]):
        for _ in range(4):
            be._leave(Timing(k, mode, 0.0, seconds, r))
    assert be.name == "buffered"
    path = tmp_path / "data.bin"
    if supports_o_direct(str(tmp_path))[0]:
        be._entered = be.plan.requests  # the rounds are done: what follows is the load's rest
        handle = be.open(str(path), write=False)
        try:
            with AlignedBuffer(4096, pin=False) as buf:
                for _ in range(8):
                    assert be.pread(handle, buf.view, 0) == 4096
        finally:
            be.close(handle)
        assert be._windows == {} and be.name == "buffered"


def test_predictor_benchmark_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/read_mode_predictor.py at a small size, so it cannot rot."""
    from bench import read_mode_predictor

    _on_o_direct_disk(tmp_path)
    record = read_mode_predictor.main(["--size", "80MiB", "--runs", "1", "--dir", str(tmp_path)])
    printed = capsys.readouterr().out
    (result,) = record["results"]
    (run,) = result["runs"]
    assert set(run["seconds"]) == set(read_mode_predictor.MODES)
    assert all(s > 0 for s in run["seconds"].values())
    assert run["chosen"] in ("direct", "buffered") and run["verdict"] in ("right", "tie", "wrong")
    assert "reads via" in run["reason"]
    assert "at most 4 MiB each" in run["reason"]  # the default probe: heads of 16 MiB requests
    assert f"{run['verdict']}" in printed and "auto load time / the faster mode's" in printed
    assert list(tmp_path.iterdir()) == []  # the checkpoint is removed


def test_placebo_benchmark_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/read_mode_placebo.py at a small size, so it cannot rot."""
    from bench import read_mode_placebo

    _on_o_direct_disk(tmp_path)
    record = read_mode_placebo.main(["--size", "80MiB", "--runs", "2", "--dir", str(tmp_path)])
    printed = capsys.readouterr().out
    (result,) = record["results"]
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        assert sorted(run["order"]) == sorted(read_mode_placebo.LOADS)
        assert all(s > 0 for s in run["seconds"].values())
        faster = min(run["seconds"]["direct"], run["seconds"]["buffered"])
        assert run["placebo_ratio"] == pytest.approx(run["seconds"]["placebo"] / faster)
    assert "placebo / the faster of direct and buffered: median" in printed
    assert list(tmp_path.iterdir()) == []  # the checkpoint is removed


def test_a_short_request_is_neither_timed_nor_counted(tmp_path: Path) -> None:
    """Requests shorter than a measuring one (the edge blocks of large tensors, small tensors)
    take no place in the rounds: their time is the drive's latency, not a rate."""
    _on_o_direct_disk(tmp_path)
    path = tmp_path / "data.bin"
    data = _write(path, 8 * MiB)
    be = AdaptiveReadBackend(4096, os.stat(path).st_dev, 32 * MiB, threads=4, block_bytes=MiB)
    handle = be.open(str(path), write=False)
    try:
        with AlignedBuffer(MiB, pin=False) as buf:
            before = be.probe_requests
            assert be.pread(handle, buf.view[:8192], 4096) == 8192
            assert bytes(buf.view[:8192]) == data[4096 : 4096 + 8192]
            assert be.probe_requests == before and not be._timings
            assert be.pread(handle, buf.view, MiB) == MiB
            assert be.probe_requests == before - 1 and len(be._timings) == 1
    finally:
        be.close(handle)

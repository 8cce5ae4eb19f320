"""The progress protocol (gds_persist.progress) through save, load, verify and the DCP writer."""

from __future__ import annotations

import io
import threading
import warnings

import pytest
import torch

import gds_persist
from gds_persist.progress import ByteCounter, ProgressBar, cli_progress


class Recorder:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.calls.append((done, total))

    def check(self, expected_total: int | None = None) -> None:
        assert self.calls, "progress was never called"
        totals = {t for _, t in self.calls}
        assert len(totals) == 1
        total = totals.pop()
        if expected_total is not None:
            assert total == expected_total
        dones = [d for d, _ in self.calls]
        assert dones == sorted(dones) and all(0 <= d <= total for d in dones)
        assert dones[-1] == total


@pytest.fixture
def small_blocks():
    with gds_persist.settings.set(block_bytes=64 << 10, staging_bytes=256 << 10):
        yield


def test_save_load_verify_report_progress(tmp_path, small_blocks):
    sd = {"a": torch.randn(200_000), "b": [torch.arange(10), 3]}
    rec = Recorder()
    info = gds_persist.save(sd, str(tmp_path / "ck"), progress=rec)
    rec.check(info.bytes_written)
    assert len(rec.calls) > 5  # one per 64 KiB block, not just the end

    rec = Recorder()
    gds_persist.load(str(tmp_path / "ck"), progress=rec)
    rec.check(info.bytes_written)
    assert len(rec.calls) > 5

    rec = Recorder()
    assert gds_persist.verify(str(tmp_path / "ck"), progress=rec).ok
    rec.check(info.bytes_written)


def test_a_failing_callback_aborts_the_save_and_keeps_nothing(tmp_path, small_blocks):
    def boom(done, total):
        if done > total // 2:
            raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        gds_persist.save({"a": torch.randn(200_000)}, str(tmp_path / "ck"), progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_dcp_writer_and_reader_report_progress(tmp_path, small_blocks):
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

    sd = {"w": torch.randn(100_000), "step": 3}
    w, r = Recorder(), Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            sd, storage_writer=GdsPersistWriter(str(tmp_path / "ck"), progress=w), no_dist=True
        )
        dcp.load(
            {"w": torch.zeros(100_000), "step": 0},
            storage_reader=GdsPersistReader(str(tmp_path / "ck"), progress=r),
            no_dist=True,
        )
    w.check()
    r.check()
    assert len(w.calls) > 3


def test_byte_counter_clamps_and_finishes():
    rec = Recorder()
    c = ByteCounter(rec, 100)
    c.add(60)
    c.add(60)
    c.finish()
    assert rec.calls == [(60, 100), (100, 100), (100, 100)]
    assert ByteCounter(None, 10).hook is None  # no listener: the core loops skip the call


def test_progress_bar_draws_bytes_rate_and_percent():
    out = io.StringIO()
    bar = ProgressBar("save", out, min_interval=0.0)
    bar(0, 4 << 20)
    bar(2 << 20, 4 << 20)
    bar(4 << 20, 4 << 20)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rsave [") and text.endswith("\n")
    assert " 50.0% 2.0 MiB/4.0 MiB" in text and "100.0% 4.0 MiB/4.0 MiB" in text and "GB/s" in text


def test_cli_progress_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert cli_progress("x", io.StringIO()) is None
    assert isinstance(cli_progress("x", Tty()), ProgressBar)

"""The Checkpointer's ``mode="auto"``: the rule (a pure function of a described state and host
memory) for every case, the reading of /proc/meminfo, and the choice recorded where users see it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.training.mode import (
    CPU_FIGURES,
    GPU_FIGURES,
    HOST_FRACTION,
    HostMemory,
    choose_mode,
    host_memory,
)

GB = 10**9
REPO = Path(__file__).resolve().parent.parent
H200 = HostMemory(120 * GB, "/proc/meminfo MemAvailable")


@pytest.mark.parametrize("available", [None, 0, GB, 10**15])
def test_cpu_only_state_is_fenced_whatever_the_memory(available: int | None) -> None:
    c = choose_mode(2 * GB, False, HostMemory(available, "described"))
    assert (c.mode, c.snapshot_bytes) == ("fence", None)
    assert c.reason.startswith("auto: CPU-only state: fence") and CPU_FIGURES in c.reason


def test_gpu_state_with_room_snapshots_two_deep() -> None:
    c = choose_mode(int(1.02 * GB), True, H200)  # the H200 training bench's checkpoint
    assert (c.mode, c.snapshot_bytes) == ("snapshot", int(2.04 * GB))
    assert "two snapshots deep" in c.reason and GPU_FIGURES in c.reason
    assert "120.00 GB available (/proc/meminfo MemAvailable)" in c.reason


@pytest.mark.parametrize("available, local, want", [
    # budget = HOST_FRACTION x available, shared by `local` arenas; need = 10 GB
    (40 * GB, 1, ("snapshot", 20 * GB)),  # 2 x 10 fits in 20
    (40 * GB - 2, 1, ("snapshot", 10 * GB)),  # 20 no longer fits: one snapshot deep
    (20 * GB, 1, ("snapshot", 10 * GB)),  # exactly fits
    (20 * GB - 2, 1, ("fence", None)),  # not even one
    (160 * GB, 8, ("snapshot", 10 * GB)),  # 8 ranks x 20 > 80; 8 x 10 fits
    (160 * GB - 16, 8, ("fence", None)),
    (None, 1, ("fence", None)),  # unknown memory: no pinning gamble
])
def test_gpu_state_against_host_memory(available: int | None, local: int,
                                       want: tuple[str, int | None]) -> None:
    assert HOST_FRACTION == 0.5
    c = choose_mode(10 * GB, True, HostMemory(available, "described", local))
    assert (c.mode, c.snapshot_bytes) == want
    if local > 1:
        assert f"x {local} processes on this node" in c.reason
    if want[0] == "fence":
        assert c.reason.endswith(": fence")
        assert "unknown" in c.reason if available is None else "does not fit" in c.reason
    elif want[1] == 10 * GB:
        assert "one snapshot deep (two do not fit)" in c.reason


def test_user_arena_size_is_kept_or_fenced() -> None:
    c = choose_mode(GB, True, H200, snapshot_bytes=5 * GB)
    assert (c.mode, c.snapshot_bytes) == ("snapshot", 5 * GB) and "deep" not in c.reason
    c = choose_mode(GB, True, H200, snapshot_bytes=GB // 2)  # could never hold one snapshot
    assert c.mode == "fence" and "snapshot_bytes is 0.50 GB" in c.reason
    c = choose_mode(GB, True, HostMemory(100 * GB, "described"), snapshot_bytes=60 * GB)
    assert c.mode == "fence" and "does not fit" in c.reason


def test_figures_quoted_are_those_of_the_docs_section_and_its_results() -> None:
    """The reason cites docs/TRAINING.md's section; the section quotes the same figures and
    names the results files that hold them."""
    text = (REPO / "docs/TRAINING.md").read_text()
    section = text.split("## Fence, snapshot, or auto (the default)")[1].split("\n## ")[0]
    for figures, results, quoted in (
            (CPU_FIGURES, "bench/results/2026-11-30-cpu-bench_train.txt", ("+2.5%", "+6.3%")),
            (GPU_FIGURES, "bench/results/2026-11-30-h200/train.txt", ("+72.6%", "+0.1%"))):
        assert figures.startswith('docs/TRAINING.md, "Fence, snapshot, or auto (the default)"')
        assert results in section, results
        assert all(q in figures and q in section and q in (REPO / results).read_text()
                   for q in quoted), (figures, quoted)


def test_host_memory_reads_meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    real = host_memory()
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert real.available_bytes is not None and real.local_processes == 1
    assert abs(real.available_bytes - kib * 1024) < 2 * GB  # the machine moves between reads
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       1000 kB\nMemAvailable:     512 kB\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_memory(str(fake)) == HostMemory(512 * 1024, f"{fake} MemAvailable", 4)
    fake.write_text("MemTotal:       1000 kB\n")
    assert host_memory(str(fake)).available_bytes is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "lots")
    missing = host_memory(str(tmp_path / "nope"))
    assert missing.available_bytes is None and "unreadable" in missing.source
    assert missing.local_processes == 1


# --- the Checkpointer records the choice ----------------------------------------------------------

def test_default_mode_is_auto_and_fences_cpu_state(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gds_persist")
    with gds_persist.Checkpointer(tmp_path / "ck") as ckpt:
        assert (ckpt.requested_mode, ckpt.mode, ckpt.mode_reason) == ("auto", "auto", None)
        assert ckpt.stats.mode == "auto"
        h = ckpt.save(1, {"w": torch.ones(1000)})
        h.wait()
        assert ckpt.mode == "fence" and ckpt.max_pending == 2
        assert ckpt.mode_reason is not None and ckpt.mode_reason.startswith("auto: CPU-only")
        assert (h.mode, h.mode_reason) == ("fence", ckpt.mode_reason)
        assert (ckpt.stats.mode, ckpt.stats.mode_reason) == ("fence", ckpt.mode_reason)
        assert "snapshot" not in ckpt._workers.threads  # no snapshot thread when fenced
        ckpt.save(2, {"w": torch.ones(1000)}).wait()
    logged = [r.getMessage() for r in caplog.records if "mode fence (auto: CPU-only" in
              r.getMessage()]
    assert len(logged) == 1  # decided once, at the first save


def test_explicit_modes_unchanged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gds_persist")
    for mode in ("fence", "snapshot"):
        with gds_persist.Checkpointer(tmp_path / mode, mode=mode) as ckpt:
            assert (ckpt.mode, ckpt.mode_reason) == (mode, "requested explicitly")
            assert ckpt.max_pending == (2 if mode == "fence" else 1 << 30)
            assert ("snapshot" in ckpt._workers.threads) == (mode == "snapshot")
            h = ckpt.save(1, {"w": torch.ones(10)})
            h.wait()
            assert (h.mode, h.mode_reason) == (mode, "requested explicitly")
    assert not [r for r in caplog.records if "mode " in r.getMessage()]  # only auto logs
    with pytest.raises(ValueError, match="valid modes are auto, fence, snapshot"):
        gds_persist.Checkpointer(tmp_path / "x", mode="eager")
    with pytest.raises(ValueError, match="writer='process'.*needs mode='snapshot'"):
        gds_persist.Checkpointer(tmp_path / "x", writer="process")  # auto is not enough


@pytest.mark.gpu
def test_gpu_state_with_room_is_snapshotted(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    memory = host_memory()
    sd = {"w": torch.randn(1 << 20, device="cuda"), "step": 3}
    with gds_persist.Checkpointer(tmp_path / "ck") as ckpt:
        h = ckpt.save(1, sd)
        h.wait()
        want = choose_mode(4 << 20, True, memory)
        assert ckpt.mode == want.mode == "snapshot", ckpt.mode_reason
        assert h.mode == "snapshot" and ckpt.stats.snapshot_bytes == want.snapshot_bytes
        got = ckpt.load()
    assert torch.equal(got["w"], sd["w"]) and got["w"].is_cuda

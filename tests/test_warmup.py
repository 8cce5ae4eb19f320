"""``gds_persist.warmup`` and the Checkpointer's background warm-up: what each step does here
(real staging ring, real O_DIRECT probe), that the ring is the one the first save uses, that
failures are reported and never raised; on a GPU every step must be done."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends import supports_o_direct
from gds_persist.transfer import staging
from gds_persist.transfer.warmup import NO_CUDA, default_device

STEPS = ["cuda", "staging", "backend", "crc_kernel", "hash_kernel"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU outcome; this has CUDA")
def test_warmup_on_cpu(tmp_path: Path) -> None:
    with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=4 << 20):
        report = gds_persist.warmup(tmp_path / "ck")
    assert list(report.steps) == STEPS and not report.failed
    outcome = {k: v for k, (v, _) in report.steps.items()}
    assert outcome["cuda"] == f"skipped: {NO_CUDA}" == outcome["crc_kernel"]
    assert outcome["hash_kernel"] == f"skipped: {NO_CUDA}"
    assert outcome["staging"] == ("done: 4 x 1048576 B staging ring (not pinned), kept for the "
                                  "next save/load")
    name = "direct" if supports_o_direct(str(tmp_path))[0] else "buffered"
    assert outcome["backend"].startswith(f"done: {name} (auto: ")
    assert "kvikio not used (no CUDA tensors)" in outcome["backend"]
    assert not (tmp_path / "ck").exists()  # probed in its parent: a warm-up creates nothing
    assert report.seconds >= sum(s for _, s in report.steps.values())
    assert str(report).startswith(f"warm-up {report.seconds:.3f} s (cuda 0.000 s: skipped")
    assert default_device() == (None, NO_CUDA)


def test_the_first_save_uses_the_warm_ring(tmp_path: Path) -> None:
    staging.release_cached()
    with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=4 << 20):
        gds_persist.warmup()
    (ring,) = staging._idle_rings
    assert (ring.count, ring.block_bytes) == (4, 1 << 20)
    with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=4 << 20):
        gds_persist.save({"w": torch.ones(1 << 18)}, tmp_path / "ck")
    assert staging._idle_rings == [ring]  # borrowed and given back, not a new one


def test_failures_are_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    report = gds_persist.warmup(tmp_path / "file" / "ck")  # cannot be a directory
    (outcome, _) = report.steps["backend"]
    assert outcome.startswith("failed: NotADirectoryError") or outcome.startswith(
        "failed: FileExistsError"), outcome
    assert set(report.failed) == {"backend"}
    assert report.steps["staging"][0].startswith("done")


def test_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_bytes=1000 .* must be a positive multiple of "
                                         "4096"), gds_persist.settings.set(block_bytes=1000):
        gds_persist.warmup(tmp_path)
    with pytest.raises(TypeError, match=r"warmup\(device='cpu'\) must be a CUDA device"):
        gds_persist.warmup(tmp_path, device="cpu")


def test_checkpointer_warms_up_in_the_background(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gds_persist")
    with gds_persist.settings.set(block_bytes="1MiB", staging_bytes="4MiB"), \
            gds_persist.Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, {"w": torch.ones(100)}).wait()
        report = ckpt.warmup_report  # the writer waited for it before the first write
        assert report is not None and not report.failed
        assert report.steps["backend"][0].startswith("done: ")
        assert "4 x 1048576 B staging ring" in report.steps["staging"][0]
    assert any(r.getMessage().startswith("gds_persist: warm-up ") for r in caplog.records)
    with gds_persist.Checkpointer(tmp_path / "cold", warmup=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(100)}).wait()
        assert ckpt.warmup_report is None


def test_closing_at_once_waits_for_the_warmup(tmp_path: Path) -> None:
    ckpt = gds_persist.Checkpointer(tmp_path / "ck")
    ckpt.close()
    assert ckpt.warmup_report is not None  # nothing of the Checkpointer runs on after close


@pytest.mark.gpu
def test_gpu_warmup_does_every_step(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    report = gds_persist.warmup(tmp_path)
    outcome = {k: v for k, (v, _) in report.steps.items()}
    assert all(v.startswith("done: ") for v in outcome.values()), outcome
    assert "(pinned)" in outcome["staging"]
    assert "checked on cuda:" in outcome["crc_kernel"]
    assert "checked on cuda:" in outcome["hash_kernel"]
    again = gds_persist.warmup(tmp_path)  # everything is warm now: the kernel is cached
    assert again.steps["crc_kernel"][1] < max(report.steps["crc_kernel"][1], 0.5)


class _ReadyKernels:
    """A device kernel set that says it is ready: _check_kernel's own steps run on the CPU."""

    what = "CRC32C"

    def status(self) -> tuple[bool, str]:
        return True, ""


def test_kernel_check_leaves_the_callers_random_stream_alone() -> None:
    """The warm-up runs beside the caller's model init: it must not draw from the global
    generator (a draw there changes the caller's initial weights from run to run)."""
    from gds_persist.format.checksum import crc32c
    from gds_persist.transfer.warmup import _check_kernel

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    host = lambda d: crc32c(d.numpy())  # noqa: E731
    out = _check_kernel(_ReadyKernels(), torch.device("cpu"), 4096, host, host)  # type: ignore[arg-type]
    assert out.startswith("done: device CRC32C kernel"), out
    assert torch.equal(torch.get_rng_state(), before)

"""Background write errors on real filesystems: a full disk (a small tmpfs) and a filesystem
remounted read-only. The error reaches the caller on the next wait()/save() with its cause, and
the checkpoints committed before stay loadable. Needs root (mount); skipped with the reason
otherwise."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import gds_persist
from gds_persist import Checkpointer, DiskFullError
from gds_persist.training.steps import step_name


def _mount(target: str, *options: str) -> str | None:
    r = subprocess.run(["mount", *options, target], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exit {r.returncode}")


@pytest.fixture
def small_fs(small_tmpfs) -> str:
    """conftest's 8 MiB tmpfs (root only; skipped with the reason otherwise): chmod does not stop
    root, a full or read-only filesystem does."""
    return str(small_tmpfs)


def sd(step: int, nbytes: int) -> dict:
    return {"w": torch.full((nbytes // 4,), float(step)), "step": step}


def test_disk_full_surfaces_on_wait_and_earlier_checkpoints_stay(small_fs):
    with Checkpointer(small_fs, keep_last=2) as ckpt:
        ckpt.save(1, sd(1, 1 << 20)).wait()
        ckpt.save(2, sd(2, 1 << 20))
        h = ckpt.save(3, sd(3, 16 << 20))  # larger than the 8 MiB filesystem
        with pytest.raises(DiskFullError, match=r"no space left.*step-00000003") as info:
            ckpt.wait()
        assert info.value.errno == errno.ENOSPC
        assert h.done() and h.error is info.value
        assert ckpt.latest_step() == 2 and ckpt.steps() == [1, 2]
        assert not [n for n in os.listdir(small_fs) if ".tmp-" in n]  # partial save removed
        for s in (1, 2):
            assert gds_persist.verify(os.path.join(small_fs, step_name(s))).ok
            assert ckpt.load(step=s)["step"] == s
        ckpt.save(3, sd(3, 1 << 20)).wait()  # room again for a normal size: it goes on
        assert ckpt.steps() == [2, 3]


def test_disk_full_surfaces_on_next_save(small_fs):
    with Checkpointer(small_fs, keep_last=1, mode="snapshot") as ckpt:
        ckpt.save(1, sd(1, 1 << 20)).wait()
        h = ckpt.save(2, sd(2, 16 << 20))
        h.wait_released(timeout=60)
        h._done.wait(60)
        with pytest.raises(DiskFullError, match="no space left"):
            ckpt.save(3, sd(3, 1024))
        assert ckpt.latest_step() == 1 and ckpt.load()["step"] == 1


def test_read_only_filesystem_surfaces_on_next_save(small_fs):
    ckpt = Checkpointer(small_fs, keep_last=1)
    try:
        ckpt.save(1, sd(1, 64 << 10)).wait()
        why = _mount(small_fs, "-o", "remount,ro")
        if why:
            pytest.skip(f"cannot remount read-only: {why}")
        h = ckpt.save(2, sd(2, 64 << 10))
        h._done.wait(60)
        with pytest.raises(OSError) as info:
            ckpt.save(3, sd(3, 64 << 10))
        assert info.value.errno == errno.EROFS and small_fs in str(info.value)
        assert ckpt.latest_step() == 1
        assert gds_persist.verify(os.path.join(small_fs, step_name(1))).ok
        assert ckpt.load()["step"] == 1
    finally:
        _mount(small_fs, "-o", "remount,rw")
        ckpt.close()

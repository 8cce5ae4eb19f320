"""``backend="auto"`` loads of files the page cache already holds read through it
(:mod:`gds_persist.backends.residency`): O_DIRECT would read them from the drive again. Real
files on the O_DIRECT disk, their pages evicted (``POSIX_FADV_DONTNEED`` after ``fsync``) or
read in; every byte is still checked."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends import read_mode
from gds_persist.backends.posix import memory_backed, supports_o_direct
from gds_persist.backends.residency import resident_bytes
from gds_persist.errors import ChecksumError
from tests.helpers import assert_tree_equal, evict_page_cache, flip_byte, random_tensor

MiB = 1 << 20


def _on_disk(path: Path) -> None:
    if not supports_o_direct(str(path))[0] or memory_backed(str(path)):
        pytest.skip(f"{path}: no O_DIRECT disk here (tmpfs files are all in the page cache)")


def _read_through(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(MiB):
            pass


def _files(ck: Path) -> list[Path]:
    return sorted(p for p in ck.rglob("*") if p.is_file())


def test_resident_bytes_follow_the_page_cache(tmp_path: Path) -> None:
    _on_disk(tmp_path)
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 * MiB + 100))
    evict_page_cache(path)
    held = resident_bytes([str(path)])
    assert held is not None and held[1] == 3 * MiB + 100 and held[0] <= MiB, held
    _read_through(path)
    assert resident_bytes([str(path)]) == (3 * MiB + 100, 3 * MiB + 100)


def test_cachestat_and_mincore_count_the_same_pages(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's count (``cachestat``) and the fallback's (``mincore`` over a mapping) agree
    on a file the cache holds none of, part of, and all of; several files add up."""
    _on_disk(tmp_path)
    from gds_persist.backends import residency

    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(8 * MiB + 100))
    small.write_bytes(os.urandom(5000))
    paths = [str(big), str(small)]
    answers = []
    for state in ("none", "part", "all"):
        for p in (big, small):
            evict_page_cache(p)
        if state == "part":  # read-ahead off: no pages still in flight when asked
            fd = os.open(big, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 3 * MiB, 0)
            os.close(fd)
        elif state == "all":
            _read_through(big)
            _read_through(small)
        kernel = residency.resident_bytes(paths)
        with monkeypatch.context() as m:
            m.setattr(residency, "_cachestat_missing", True)  # as on a kernel before 6.5
            fallback = residency.resident_bytes(paths)
        answers.append(kernel)
        assert kernel == fallback, (state, kernel, fallback)
    total = 8 * MiB + 100 + 5000
    assert answers[0] is not None and answers[0][0] <= MiB, answers
    assert answers[1] is not None and 3 * MiB <= answers[1][0] < total, answers
    assert answers[2] == (total, total), answers


def test_cachestat_answers_where_the_kernel_has_it(tmp_path: Path) -> None:
    """On Linux 6.5+ the count comes from ``cachestat`` itself, not the fallback."""
    import ctypes

    from gds_persist.backends import residency

    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if release is None or (int(release[1]), int(release[2])) < (6, 5):
        pytest.skip(f"kernel {os.uname().release} has no cachestat (Linux 6.5+)")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        held = residency._cachestat_bytes(residency._libc(), fd)
    finally:
        os.close(fd)
    assert held is not None, f"cachestat failed: errno {ctypes.get_errno()}"
    assert 0 <= held <= MiB


def test_a_cached_checkpoint_reads_through_the_page_cache_and_is_verified(
        tmp_path: Path) -> None:
    """Just saved (O_DIRECT: nothing cached), the load measures its read mode as before; with its
    files read into the page cache, it reads through it, measures and records nothing, lands the
    same bytes, and a flipped byte still fails its CRC32C."""
    _on_disk(tmp_path)
    sd = {"a": random_tensor(torch.float32, 2 * MiB, seed=1),
          "small": [random_tensor(torch.int64, 1000 + k, seed=k) for k in range(5)]}
    ck = tmp_path / "ck"
    gds_persist.save(sd, ck)
    for f in _files(ck):
        evict_page_cache(f)
    dev = os.stat(ck).st_dev
    state, info = gds_persist.load_with_info(ck, backend="auto")
    assert_tree_equal(state, sd)
    assert "page cache holds" not in info.reason, info.reason
    recorded = len(read_mode.recent(dev))
    for f in _files(ck):
        _read_through(f)
    state, info = gds_persist.load_with_info(ck, backend="auto")
    assert_tree_equal(state, sd)
    assert info.backend == "buffered"
    held = "the page cache holds 100% of the load's files: read through it"
    assert held in info.reason, info.reason
    assert len(read_mode.recent(dev)) == recorded  # a cached load says nothing of the drive
    data = max(_files(ck), key=lambda p: p.stat().st_size)
    flip_byte(data, 4096)
    _read_through(data)
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        gds_persist.load(ck, backend="auto")

"""A plain load's fresh host storages are page-aligned, so O_DIRECT reads the file straight into
them: no staging copy on filesystems that want more than torch's 64-byte alignment (ext4: 512)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends.buffers import ALIGNED_MIN, aligned_empty
from gds_persist.stages import profiling
from tests.helpers import assert_tree_equal, random_tensor


@pytest.mark.parametrize("nbytes", [0, 100, ALIGNED_MIN - 1, ALIGNED_MIN, 3 << 20,
                                    (64 << 20) + 123])
def test_aligned_empty_is_exactly_nbytes_of_memory_that_outlives_its_allocation(
        nbytes: int) -> None:
    t = aligned_empty(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    assert t.untyped_storage().nbytes() == nbytes and t.storage_offset() == 0
    if nbytes >= ALIGNED_MIN:
        assert t.data_ptr() % 4096 == 0
    t.fill_(7)
    gc.collect()
    others = [torch.full((nbytes + 4096,), 1, dtype=torch.uint8) for _ in range(3)]
    assert int(t.sum()) == 7 * nbytes and all(int(o[0]) == 1 for o in others)


def test_a_plain_load_reads_large_storages_straight_into_fresh_tensors(tmp_path: Path) -> None:
    """On ext4 (O_DIRECT wants 512-byte aligned memory) torch's allocations sat 64 bytes into a
    page and every byte of a plain load went through the staging ring."""
    sd = {"big": random_tensor(torch.float32, (4 << 20) // 4 + 1000, seed=1),
          "mid": random_tensor(torch.bfloat16, ALIGNED_MIN, seed=2),
          "small": random_tensor(torch.int64, 17, seed=3)}
    gds_persist.save(sd, tmp_path / "ck")
    with profiling() as loaded:
        got = gds_persist.load(tmp_path / "ck", backend="direct")
    assert_tree_equal(got, sd)
    large = got["big"].untyped_storage().nbytes() + got["mid"].untyped_storage().nbytes()
    assert loaded.stages["read (into the tensor)"].nbytes >= large - 2 * 4096
    assert got["big"].data_ptr() % 4096 == 0 and got["mid"].data_ptr() % 4096 == 0
    got["big"].fill_(3)  # ordinary, writable tensors
    assert torch.equal(got["big"], torch.full_like(sd["big"], 3))

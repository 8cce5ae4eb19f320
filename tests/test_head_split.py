"""A large host storage whose memory O_DIRECT cannot take from its first byte: its head is an
extent of its own, the rest is written straight from the tensor's memory (no staging copy), and
the checkpoint loads, restores in place and verifies like any other."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends import direct_write_alignment
from gds_persist.format import ALIGNMENT
from gds_persist.format.layout import HEAD_SPLIT_MIN, address_heads, layout_file
from gds_persist.stages import profiling
from tests.helpers import assert_tree_equal, random_tensor


def test_layout_splits_only_large_misaligned_host_pieces() -> None:
    heads = address_heads([64, 0, None, 64], 512)
    big = HEAD_SPLIT_MIN + 1000
    plan = layout_file("d", 0, [(0, 0, big), (1, 0, big), (2, 0, big), (3, 0, 100)], heads)
    got = [(e.storage, e.start, e.length) for e in plan.extents]
    body = HEAD_SPLIT_MIN  # whole blocks after the head
    assert got == [(0, 448, body), (1, 0, body), (2, 0, body),  # bodies first, back to back
                   (0, 0, 448), (0, 448 + body, big - 448 - body), (1, body, big - body),
                   (2, body, big - body), (3, 0, 100)]  # then heads, tails, small pieces
    assert [e.offset for e in plan.extents[:3]] == [0, body, 2 * body]
    assert all(e.offset % ALIGNMENT == 0 for e in plan.extents)
    assert plan.size % ALIGNMENT == 0 and plan.size >= plan.extents[-1].offset + 100
    # a piece that starts inside its storage (cut between files) counts from its own address
    assert address_heads([64], 512)(0, 4096) == 448
    assert layout_file("d", 0, [(0, 0, big)]).extents[0].length == big  # no heads: unchanged


def _misaligned(nbytes: int, skew: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A uint8 tensor of random bytes whose storage starts ``skew`` bytes past a page."""
    buf = mmap.mmap(-1, nbytes + 4096)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=skew)
    t.copy_(random_tensor(torch.uint8, nbytes, seed=5))
    return buf, t


def test_a_misaligned_storage_is_written_from_its_memory_and_loads(tmp_path: Path) -> None:
    align = direct_write_alignment("auto", str(tmp_path))
    if align is None:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    buf, t = _misaligned(3 * HEAD_SPLIT_MIN + 777, 8)  # 8: misaligned for any O_DIRECT
    sd = {"big": t, "small": random_tensor(torch.float32, 33, seed=1)}
    with profiling() as saved:
        gds_persist.save(sd, tmp_path / "ck")
    m = gds_persist.read_manifest(tmp_path / "ck")
    big = [e for e in m.extents if m.storages[e.storage].nbytes == t.numel()]
    head = align - 8
    body = (t.numel() - head) // ALIGNMENT * ALIGNMENT
    assert sorted((e.start, e.length) for e in big) == [
        (0, head), (head, body), (head + body, t.numel() - head - body)]
    assert saved.stages["write (from the tensor)"].nbytes >= t.numel() - 2 * ALIGNMENT
    assert_tree_equal(gds_persist.load(tmp_path / "ck"), sd)
    live = {"big": torch.zeros_like(t), "small": torch.zeros(33)}
    gds_persist.load(tmp_path / "ck", into=live)
    assert_tree_equal(live, sd)
    assert gds_persist.verify(tmp_path / "ck").ok
    del t, sd
    buf.close()


def test_units_and_buffered_saves_are_not_split(tmp_path: Path) -> None:
    buf, t = _misaligned(HEAD_SPLIT_MIN + 99, 8)
    gds_persist.save({"t": t}, tmp_path / "b", backend="buffered")
    gds_persist.save({"t": t}, tmp_path / "h", options=gds_persist.SaveOptions(content_hash=True))
    for name in ("b", "h"):
        assert len(gds_persist.read_manifest(tmp_path / name).extents) == 1, name
    assert direct_write_alignment("buffered", str(tmp_path)) is None
    del t
    buf.close()

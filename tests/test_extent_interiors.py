"""An extent off a block boundary (a torch.save file's record: 64 bytes apart) moves its
aligned interior straight between the file and its tensor's memory where the backend takes that
address; only the blocks holding its head and tail go through a staging buffer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gds_persist
from gds_persist import ChecksumError
from gds_persist.format import ALIGNMENT, Extent, align_up
from gds_persist.stages import profiling
from gds_persist.transfer.segments import cut, extent_spans, interior
from gds_persist.transfer.writer import DIRECT_MIN
from tests.helpers import assert_tree_equal, count_pieces, flip_byte, random_tensor


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 6 * ALIGNMENT + 7), min_size=1, max_size=12),
       gaps=st.lists(st.integers(0, 2 * ALIGNMENT).map(lambda n: 64 * (n // 64)), min_size=12,
                     max_size=12),
       blocks=st.integers(1, 4), direct=st.lists(st.booleans(), min_size=12, max_size=12))
def test_cut_moves_only_whole_interior_blocks_directly(lengths: list[int], gaps: list[int],
                                                       blocks: int, direct: list[bool]) -> None:
    """Extents at any 64-byte offsets: every wanted byte is in exactly one request, requests are
    block-aligned, and a direct request lies inside its extent's interior."""
    extents, offset = [], 0
    for i, n in enumerate(lengths):
        offset += gaps[i]
        extents.append(Extent(i, 0, n, 0, offset))
        offset += n

    def direct_bytes(e: Extent) -> int:
        return interior(e)[1] if direct[e.storage] else 0

    seen = {i: 0 for i in range(len(extents))}
    spans = extent_spans(extents)
    for seg in cut(extents, spans, blocks * ALIGNMENT, direct_bytes):
        assert seg.lo % ALIGNMENT == 0 and seg.hi % ALIGNMENT == 0
        assert any(lo <= seg.lo and seg.hi <= hi for lo, hi in spans)
        count_pieces(seg, extents, seen)
        if seg.direct:
            ((k, lo, hi),) = seg.pieces
            head, n = interior(extents[k])
            start = extents[k].offset + head
            assert (lo, hi) == (seg.lo, seg.hi) and start <= lo and hi <= start + n
    assert seen == {i: e.length for i, e in enumerate(extents)}
    assert sum(interior(e)[1] for e in extents) <= sum(e.length for e in extents)
    assert all(interior(e)[0] == align_up(e.offset) - e.offset for e in extents)


def _state() -> dict[str, Any]:
    return {"big": random_tensor(torch.float32, (3 * DIRECT_MIN) // 4 + 1001, seed=1),
            "odd": random_tensor(torch.bfloat16, DIRECT_MIN + 12345, seed=2),
            "small": random_tensor(torch.int64, 17, seed=3)}


def test_a_torch_save_file_is_read_into_its_tensors_past_the_edge_blocks(shm_dir: Path) -> None:
    sd = _state()
    torch.save(sd, shm_dir / "stock.pt")
    with profiling() as loaded:
        got = gds_persist.load(shm_dir / "stock.pt", backend="direct")
    assert_tree_equal(got, sd)
    large = sum(t.untyped_storage().nbytes() for t in sd.values()
                if t.untyped_storage().nbytes() >= DIRECT_MIN)
    assert loaded.stages["read (into the tensor)"].nbytes >= large - 2 * 2 * ALIGNMENT
    into = {k: torch.zeros_like(t) for k, t in sd.items()}
    gds_persist.load(shm_dir / "stock.pt", into=into, backend="direct")
    assert_tree_equal(into, sd)


@pytest.mark.parametrize("where", ["head", "interior", "tail"])
def test_a_flipped_byte_anywhere_in_an_unaligned_extent_names_the_tensor(shm_dir: Path,
                                                                         where: str) -> None:
    """A gds_persist safetensors file packs its tensors back to back (off block boundaries)
    and records each one's CRC32C: a flip in the staged edge blocks and in the interior read
    straight into the tensor alike is caught."""
    sd = _state()
    path = shm_dir / "ck.safetensors"
    gds_persist.save(sd, path, format="safetensors")
    m = gds_persist.read_manifest(path)
    e = next(e for e in m.extents if e.length >= DIRECT_MIN and e.offset % ALIGNMENT)
    with profiling() as clean:
        assert_tree_equal(gds_persist.load(path, backend="direct"), sd)
    assert clean.stages["read (into the tensor)"].nbytes >= interior(e)[1]
    head, n = interior(e)
    at = {"head": e.offset, "interior": e.offset + head + n // 2,
          "tail": e.offset + e.length - 1}[where]
    flip_byte(path / m.files[e.file].name, at)  # a directory holding model.safetensors
    with pytest.raises(ChecksumError, match=r"\['odd'\].*offset"):
        gds_persist.load(path, backend="direct")

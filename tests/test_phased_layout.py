"""Format version 5: a large host tensor lies in its data file at the offset within a block that
its memory has within a page, so its aligned interior moves by O_DIRECT between the file and its
own memory (no staging copy) where the filesystem wants more than torch's 64-byte alignment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gds_persist
from gds_persist import ChecksumError, ManifestError
from gds_persist.backends.posix import o_direct_host_alignment
from gds_persist.format import ALIGNMENT
from gds_persist.format.layout import plan_single_writer
from gds_persist.stages import profiling
from gds_persist.transfer.segments import cut, interior
from gds_persist.transfer.writer import DIRECT_MIN
from tests.helpers import assert_tree_equal, flip_byte, random_tensor, rewrite_manifest

phases_st = st.lists(st.integers(0, ALIGNMENT // 64 - 1).map(lambda k: 64 * k), min_size=12,
                     max_size=12)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 6 * ALIGNMENT + 7), min_size=1, max_size=12),
       phases=phases_st, files=st.integers(1, 3), blocks=st.integers(1, 4),
       direct=st.lists(st.booleans(), min_size=12, max_size=12))
def test_phased_plan_tiles_each_file_and_moves_only_interiors_directly(
        lengths: list[int], phases: list[int], files: int, blocks: int,
        direct: list[bool]) -> None:
    plan = plan_single_writer(lengths, files, phases[: len(lengths)])
    covered = {i: 0 for i in range(len(lengths))}
    for f in plan.files:
        assert f.size % ALIGNMENT == 0
        end = 0
        for e in f.extents:
            assert e.offset % ALIGNMENT == (phases[e.storage] + e.start) % ALIGNMENT
            assert e.offset >= end and e.offset - end < 2 * ALIGNMENT  # at most a block apart
            end = e.offset + e.length
            covered[e.storage] += e.length
        assert end <= f.size

        def direct_bytes(e: Any) -> int:
            return interior(e)[1] if direct[e.storage] else 0

        cursor, seen = 0, {k: 0 for k in range(len(f.extents))}
        for seg in cut(f.extents, [(0, f.size)], blocks * ALIGNMENT, direct_bytes):
            assert seg.lo == cursor and seg.lo % ALIGNMENT == 0 and seg.hi % ALIGNMENT == 0
            cursor = seg.hi
            for k, lo, hi in seg.pieces:
                e = f.extents[k]
                assert seg.lo <= lo < hi <= seg.hi and e.offset <= lo and hi <= e.offset + e.length
                seen[k] += hi - lo
            if seg.direct:
                ((k, lo, hi),) = seg.pieces
                head, n = interior(f.extents[k])
                start = f.extents[k].offset + head
                assert (lo, hi) == (seg.lo, seg.hi) and start <= lo and hi <= start + n
        assert cursor == f.size
        assert seen == {k: e.length for k, e in enumerate(f.extents)}
    assert covered == dict(enumerate(lengths))


def _needs_page_alignment(path: Path) -> None:
    if o_direct_host_alignment(str(path)) <= 64:
        pytest.skip(f"O_DIRECT on {path}'s filesystem takes torch's 64-byte aligned memory as "
                    "it is: no staging copy to avoid")


def _state() -> dict[str, torch.Tensor]:
    return {"big": random_tensor(torch.float32, (3 * DIRECT_MIN) // 4 + 1001, seed=1),
            "odd": random_tensor(torch.bfloat16, DIRECT_MIN + 12345, seed=2),
            "small": random_tensor(torch.int64, 17, seed=3)}


def _large(sd: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in sd.values() if t.untyped_storage().nbytes() >= DIRECT_MIN]


def test_a_save_writes_large_tensors_from_their_own_memory_and_loads_read_them_back_so(
        tmp_path: Path) -> None:
    _needs_page_alignment(tmp_path)
    sd = _state()
    large = _large(sd)
    edges = 2 * ALIGNMENT * len(large)  # the head and tail block of each
    with profiling() as saved:
        gds_persist.save(sd, tmp_path / "ck")
    m = gds_persist.read_manifest(tmp_path / "ck")
    assert m.version == 5
    storages = [t.untyped_storage() for t in sd.values()]
    for e in m.extents:
        s = storages[e.storage]
        assert e.offset % ALIGNMENT == (s.data_ptr() % ALIGNMENT if s.nbytes() >= DIRECT_MIN
                                        else 0)
    payload = sum(t.untyped_storage().nbytes() for t in large)
    assert saved.stages["write (from the tensor)"].nbytes >= payload - edges
    assert saved.stages["copy to staging"].nbytes <= edges + sd["small"].nbytes

    into = {k: _at_phase(t, t.data_ptr() % ALIGNMENT) for k, t in sd.items()}
    with profiling() as restored:
        gds_persist.load(tmp_path / "ck", into=into, backend="direct")
    assert _same_bytes(into, sd)
    assert restored.stages["read (into the tensor)"].nbytes >= payload - edges
    with profiling() as loaded:
        got = gds_persist.load(tmp_path / "ck", backend="direct")
    assert_tree_equal(got, sd)
    if all(got[k].data_ptr() % ALIGNMENT == t.data_ptr() % ALIGNMENT for k, t in sd.items()):
        assert loaded.stages["read (into the tensor)"].nbytes >= payload - edges


def _at_phase(t: torch.Tensor, phase: int) -> torch.Tensor:
    """An empty tensor like ``t`` whose memory starts ``phase`` bytes into a page."""
    n = t.untyped_storage().nbytes()
    room = torch.empty(n + ALIGNMENT, dtype=torch.uint8)
    skip = (phase - room.data_ptr()) % ALIGNMENT
    return room[skip : skip + n].view(t.dtype)


def _same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8))
               for k, t in want.items())


def test_a_destination_at_another_phase_is_filled_through_staging(tmp_path: Path) -> None:
    sd = _state()
    gds_persist.save(sd, tmp_path / "ck")
    shifted = {k: _at_phase(t, (t.data_ptr() + 32) % ALIGNMENT) for k, t in sd.items()}
    with profiling() as restored:
        gds_persist.load(tmp_path / "ck", into=shifted, backend="direct")
    assert _same_bytes(shifted, sd)
    if o_direct_host_alignment(str(tmp_path)) > 64:  # O_DIRECT cannot reach these addresses
        assert "read (into the tensor)" not in restored.stages


@pytest.mark.parametrize("where", ["head", "interior", "tail"])
def test_a_flipped_byte_anywhere_in_a_phased_extent_names_the_tensor(tmp_path: Path,
                                                                      where: str) -> None:
    sd = _state()
    gds_persist.save(sd, tmp_path / "ck")
    m = gds_persist.read_manifest(tmp_path / "ck")
    (e,) = [e for e in m.extents if e.storage == 0]
    head, n = interior(e)
    at = {"head": e.offset, "interior": e.offset + head + n // 2,
          "tail": e.offset + e.length - 1}[where]
    flip_byte(tmp_path / "ck" / m.files[e.file].name, at)
    with pytest.raises(ChecksumError, match=r"\['big'\].*offset"):
        gds_persist.load(tmp_path / "ck")


def test_a_reader_that_predates_version_5_says_upgrade(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_persist.format import manifest

    gds_persist.save(_state(), tmp_path / "ck")
    assert gds_persist.read_manifest(tmp_path / "ck").version == 5
    monkeypatch.setattr(manifest, "READABLE_VERSIONS", (1, 2, 3, 4))  # a gds_persist from before
    with pytest.raises(ManifestError, match=r"format version 5 is not supported by this "
                                            r"gds_persist .*upgrade gds_persist to read it"):
        gds_persist.load(tmp_path / "ck")


def _unaligned_extent(body: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in body["extents"] if e["offset"] % ALIGNMENT)


def test_an_unaligned_extent_is_refused_below_version_5(tmp_path: Path) -> None:
    gds_persist.save(_state(), tmp_path / "ck")
    rewrite_manifest(tmp_path / "ck", lambda doc: doc.update(version=4), whole=True)
    with pytest.raises(ManifestError, match=r"offset \d+ is not 4096-aligned"):
        gds_persist.load(tmp_path / "ck")


def test_an_encoded_extent_off_a_block_boundary_is_refused(tmp_path: Path) -> None:
    gds_persist.save(_state(), tmp_path / "ck")
    rewrite_manifest(tmp_path / "ck", lambda body: _unaligned_extent(body).update(
        codec="blosc2"))
    with pytest.raises(ManifestError, match=r"offset \d+ is not 4096-aligned"):
        gds_persist.load(tmp_path / "ck")


def test_a_save_without_large_host_tensors_stays_version_1(tmp_path: Path) -> None:
    gds_persist.save({"small": torch.arange(1000)}, tmp_path / "ck")
    assert gds_persist.read_manifest(tmp_path / "ck").version == 1

"""The write/read pipeline: how files are cut into requests, direct requests to and from a
tensor's own memory, checksums joined from pieces, page-aligned load destinations."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gds_persist
from gds_persist import ChecksumError
from gds_persist.backends.posix import filesystem_type, o_direct_host_alignment
from gds_persist.format import ALIGNMENT, Extent, align_up
from gds_persist.stages import profiling
from gds_persist.transfer.reader import DIRECT_MIN
from gds_persist.transfer.segments import cut, extent_spans, split_head
from tests.helpers import assert_tree_equal, count_pieces, evict_page_cache, random_tensor

REPO = Path(__file__).resolve().parent.parent


def _layout(lengths: list[int]) -> tuple[list[Extent], int]:
    extents, offset = [], 0
    for i, n in enumerate(lengths):
        extents.append(Extent(i, 0, n, 0, offset))
        offset = align_up(offset + n)
    return extents, offset


lengths_st = st.lists(st.integers(1, 5 * ALIGNMENT + 7), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, blocks=st.integers(1, 4), direct=st.lists(st.booleans(), min_size=12,
                                                                       max_size=12))
def test_write_cut_covers_the_file_once_in_aligned_requests(lengths, blocks, direct):
    extents, size = _layout(lengths)
    block = blocks * ALIGNMENT

    def direct_bytes(e: Extent) -> int:
        return e.length - e.length % ALIGNMENT if direct[e.storage] else 0

    segments = cut(extents, [(0, size)], block, direct_bytes)
    cursor, seen = 0, {i: 0 for i in range(len(extents))}
    for seg in segments:
        assert seg.lo == cursor and seg.lo % ALIGNMENT == 0 and 0 < seg.nbytes <= block
        cursor = seg.hi
        count_pieces(seg, extents, seen)
        if seg.direct:
            ((k, lo, hi),) = seg.pieces
            assert (lo, hi) == (seg.lo, seg.hi) and hi <= extents[k].offset + direct_bytes(
                extents[k])
    assert cursor == size
    assert seen == {i: e.length for i, e in enumerate(extents)}


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, pick=st.lists(st.booleans(), min_size=12, max_size=12))
def test_read_cut_covers_exactly_the_wanted_extents(lengths, pick):
    extents, _ = _layout(lengths)
    wanted = [e for e in extents if pick[e.storage]] or extents[:1]
    segments = cut(wanted, extent_spans(wanted), 2 * ALIGNMENT)
    got: dict[int, int] = {}
    for seg in segments:
        assert seg.lo % ALIGNMENT == 0 and seg.hi % ALIGNMENT == 0
        for k, lo, hi in seg.pieces:
            got[wanted[k].storage] = got.get(wanted[k].storage, 0) + hi - lo
    assert got == {e.storage: e.length for e in wanted}
    read = sum(seg.nbytes for seg in segments)
    assert read == sum(align_up(e.length) for e in wanted)  # nothing between them is read


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, blocks=st.integers(1, 4), head=st.integers(1, 4),
       direct=st.lists(st.booleans(), min_size=12, max_size=12))
def test_split_head_keeps_every_piece_once(lengths, blocks, head, direct):
    """A request cut into its head (a probe) and tail moves the same bytes as the request."""
    extents, size = _layout(lengths)

    def direct_bytes(e: Extent) -> int:
        return e.length - e.length % ALIGNMENT if direct[e.storage] else 0

    for seg in cut(extents, [(0, size)], blocks * ALIGNMENT, direct_bytes):
        first, rest = split_head(seg, head * ALIGNMENT)
        if rest is None:
            assert first == seg and seg.nbytes <= head * ALIGNMENT
            continue
        assert (first.lo, first.hi, rest.lo, rest.hi) == (seg.lo, seg.lo + head * ALIGNMENT,
                                                          seg.lo + head * ALIGNMENT, seg.hi)
        assert first.direct == rest.direct == seg.direct
        moved = [(k, lo, hi) for part in (first, rest) for k, lo, hi in part.pieces]
        assert all(part.lo <= lo < hi <= part.hi for part in (first, rest)
                   for _, lo, hi in part.pieces)
        joined: dict[int, int] = {}
        for k, lo, hi in moved:
            joined[k] = joined.get(k, 0) + hi - lo
        assert joined == {k: hi - lo for k, lo, hi in seg.pieces}


def _big_state() -> dict[str, torch.Tensor]:
    base = random_tensor(torch.float32, (3 * DIRECT_MIN) // 4 + 1001, seed=7)
    return {
        "exact": random_tensor(torch.uint8, DIRECT_MIN, seed=1),
        "odd": random_tensor(torch.bfloat16, DIRECT_MIN // 2 + 12345, seed=2),
        "view": base[1001:],  # starts 4004 bytes into its storage
        "base": base,
        "small": random_tensor(torch.int64, 17, seed=3),
    }


def _data(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "manifest.json"}


def test_direct_requests_write_and_read_tensor_memory_and_match_staged_files(
        shm_dir: Path, tmp_path: Path) -> None:
    sd = _big_state()
    with profiling() as saved:
        gds_persist.save(sd, shm_dir / "ck", backend="direct")
    assert saved.stages["write (from the tensor)"].nbytes >= 2 * DIRECT_MIN
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=16384, io_threads=3):
        gds_persist.save(sd, tmp_path / "staged", backend="buffered")
    assert _data(shm_dir / "ck") == _data(tmp_path / "staged")  # byte-identical files
    with profiling() as loaded:
        got = gds_persist.load(shm_dir / "ck", backend="direct")
    assert loaded.stages["read (into the tensor)"].nbytes >= 2 * DIRECT_MIN
    assert_tree_equal(got, sd)
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()


def test_a_flipped_byte_inside_a_direct_request_names_the_tensor(shm_dir: Path) -> None:
    sd = _big_state()
    gds_persist.save(sd, shm_dir / "ck", backend="direct")
    m = gds_persist.read_manifest(shm_dir / "ck")
    (rec,) = [e for e in m.extents if m.storages[e.storage].nbytes == DIRECT_MIN]
    data = shm_dir / "ck" / m.files[rec.file].name
    with open(data, "r+b") as f:
        f.seek(rec.offset + DIRECT_MIN // 2)
        byte = f.read(1)
        f.seek(rec.offset + DIRECT_MIN // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match=r"\['exact'\].*offset"):
        gds_persist.load(shm_dir / "ck", backend="direct")
    report = gds_persist.verify(shm_dir / "ck")
    assert len(report.errors) == 1 and "['exact']" in str(report.errors[0])


def test_an_extent_cut_into_many_requests_joins_its_checksum(tmp_path: Path) -> None:
    """Many small blocks per extent, several I/O threads: the joined CRC32C equals the CRC of
    the whole extent (what another reader, or an older gds_persist, computes)."""
    from gds_persist.format import crc32c

    t = random_tensor(torch.uint8, 40 * ALIGNMENT + 99, seed=9)
    with gds_persist.settings.set(block_bytes=ALIGNMENT, staging_bytes=3 * ALIGNMENT, io_threads=4):
        gds_persist.save({"t": t}, tmp_path / "ck")
    (e,) = gds_persist.read_manifest(tmp_path / "ck").extents
    assert e.crc32c == crc32c(t.numpy())


def test_filesystem_type_and_host_alignment_probes(tmp_path: Path, shm_dir: Path) -> None:
    fd = os.open(shm_dir, os.O_RDONLY)
    try:
        assert filesystem_type(fd) == "tmpfs"
    finally:
        os.close(fd)
    assert o_direct_host_alignment(str(shm_dir)) == 64
    assert o_direct_host_alignment(str(tmp_path)) in (64, 512, 4096)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".o_direct_probe")]


REMOVED_DURING_PROBE = """
import os, shutil, sys
from gds_persist.backends import posix
directory, other = sys.argv[1:]
fired = []
def cleaner(event, args):  # a newer save removes the directory, the probe file with it
    if event == "os.remove" and ".o_direct_probe" in str(args[0]) and not fired:
        fired.append(args[0])
        shutil.rmtree(directory)
sys.addaudithook(cleaner)
first = posix.o_direct_host_alignment(directory)
print(first, bool(fired), os.path.exists(directory), posix.o_direct_host_alignment(other))
"""


def test_host_alignment_probe_survives_its_directory_being_removed(shm_dir: Path) -> None:
    """A load's alignment probe in a data directory that a newer save removes meanwhile gives
    its answer; it failed the load with FileNotFoundError (the contention harness, data-dirs
    mode, seed 2295578827). The removal is placed exactly: an audit hook removes the directory
    when the probe is about to be unlinked."""
    directory, other = shm_dir / "stripe", shm_dir / "other"
    directory.mkdir()
    other.mkdir()
    out = subprocess.run([sys.executable, "-c", REMOVED_DURING_PROBE, str(directory), str(other)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["64", "True", "False", "64"]  # tmpfs takes 64-byte buffers


def test_o_direct_is_probed_once_per_filesystem(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves and loads on a filesystem that took an O_DIRECT write once do not write a probe
    file again (one took up to 0.2 s on the virtio disk); a directory that cannot be probed
    says why, and is not remembered."""
    from gds_persist.backends import posix

    if not posix.supports_o_direct(str(tmp_path))[0]:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    monkeypatch.setattr(posix, "_accepts_o_direct", set())
    probes: list[str] = []
    real = posix._probe_o_direct
    monkeypatch.setattr(posix, "_probe_o_direct", lambda d: probes.append(d) or real(d))
    sd = {"w": random_tensor(torch.float32, 1 << 16, seed=4)}
    for k in range(3):
        gds_persist.save(sd, tmp_path / f"ck{k}", backend="auto")
        assert_tree_equal(gds_persist.load(tmp_path / f"ck{k}", backend="auto"), sd)
    assert len(probes) == 1, probes
    gone = tmp_path / "missing"
    ok, why = posix.supports_o_direct(str(gone))
    assert not ok and str(gone) in why and "No such file or directory" in why
    assert len(posix._accepts_o_direct) == 1


@pytest.mark.parametrize("streams", [1, 3])
def test_one_writer_spreads_a_save_over_file_streams(tmp_path: Path, streams: int) -> None:
    """``file_streams`` data files, written at once, balanced within a block; the checkpoint loads
    the same, and one stream is the single-file layout (a storage cut between files is joined)."""
    from gds_persist.format.layout import file_streams

    sd = {"a": random_tensor(torch.float32, 300_000, seed=1),
          "b": random_tensor(torch.uint8, 77_777, seed=2),
          "c": random_tensor(torch.bfloat16, 5, seed=3)}
    with gds_persist.settings.set(file_streams=streams):
        with gds_persist.settings.set(block_bytes=8192, staging_bytes=32768):
            info = gds_persist.save(sd, tmp_path / "ck")
    assert len(info.files) == streams
    sizes = [os.path.getsize(tmp_path / "ck" / name) for name in info.files]
    assert max(sizes) - min(sizes) <= 2 * 4096
    assert_tree_equal(gds_persist.load(tmp_path / "ck"), sd)
    assert gds_persist.verify(tmp_path / "ck").ok
    assert file_streams(2 << 30, io_threads=4, block_bytes=16 << 20) == 4
    assert file_streams(100 << 20, io_threads=4, block_bytes=16 << 20) == 1
    assert file_streams(100 << 20, io_threads=4, block_bytes=16 << 20, setting=2) == 2


def test_auto_load_reads_the_way_that_measured_faster_and_says_so(tmp_path: Path) -> None:
    """``backend="auto"`` loads measure O_DIRECT against buffered reads on their own first
    requests, every load again, and report the rates; an explicit backend is not
    second-guessed (tests/test_read_mode.py has the rule and its rounds)."""
    from gds_persist.backends import read_mode
    from gds_persist.backends.posix import memory_backed

    if memory_backed(str(tmp_path)):
        pytest.skip(f"{tmp_path} is memory-backed: tests/test_read_mode.py measures tmpfs")
    sd = {"big": random_tensor(torch.uint8, (40 << 20) + 12345, seed=11)}  # 1 file
    gds_persist.save(sd, tmp_path / "ck")
    dev = os.stat(tmp_path / "ck").st_dev
    with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=8 << 20):
        state, info = gds_persist.load_with_info(tmp_path / "ck")
        assert_tree_equal(state, sd)
        assert info.backend in ("direct", "buffered")
        assert "this load's first" in info.reason and "GB/s" in info.reason
        assert info.payload_bytes == sd["big"].numel() and info.bytes_read >= info.payload_bytes
        assert len(read_mode.recent(dev)) == 1
        evict_page_cache(tmp_path / "ck")  # else buffered reads may have left it all cached
        _, again = gds_persist.load_with_info(tmp_path / "ck")
        assert len(read_mode.recent(dev)) == 2  # later loads keep measuring
        assert "median of the last 2 measured load(s)" in again.reason
    _, explicit = gds_persist.load_with_info(tmp_path / "ck", backend="direct")
    assert (explicit.backend, explicit.reason) == ("direct", "requested explicitly")


@pytest.mark.parametrize("spare_core", [True, False])
def test_direct_requests_checksum_beside_the_write_where_a_core_is_free(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch, spare_core: bool) -> None:
    """With a free core per I/O thread (1 I/O thread here) a direct request's CRC32C runs on a
    checksum thread while the write runs; with the cores taken (as many I/O threads as cores)
    on the I/O thread first. Either way the checkpoint verifies and loads back exactly."""
    from gds_persist.transfer import writer
    from gds_persist.transfer.staging import usable_cores

    ran_on: list[str] = []
    real = writer._checksum

    def recorded(data):  # type: ignore[no-untyped-def]
        ran_on.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(writer, "_checksum", recorded)
    io_threads = 1 if spare_core else usable_cores()
    if spare_core and usable_cores() < 2:
        pytest.skip("one usable core: no core is free for a checksum thread")
    sd = _big_state()
    with gds_persist.settings.set(io_threads=io_threads):
        gds_persist.save(sd, shm_dir / "ck", backend="direct")
    assert ran_on  # the large tensors went as direct requests
    on_checksum_threads = {name.startswith("gds_persist-crc") for name in ran_on}
    assert on_checksum_threads == {spare_core}, ran_on
    assert gds_persist.verify(shm_dir / "ck").ok
    assert_tree_equal(gds_persist.load(shm_dir / "ck"), sd)

"""Stage 2 of a save: the layout of data files, i.e. where every byte goes. Pure data, no I/O.

A :class:`SavePlan` lists data files and, for each, the extents it holds at aligned offsets.
The single-writer plan lays storages out in order, each at the next aligned offset. The
data-parallel scheduler (``gds_persist.parallel.schedule``) produces the same structure for many
writers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import ALIGNMENT, DataFile, Extent, align_up, data_file_name

Piece = tuple[int, int, int]  # (item index, start byte within the item, length)


@dataclass(frozen=True)
class FilePlan:
    name: str
    size: int  # a multiple of ALIGNMENT; the gaps between extents are zeros
    extents: tuple[Extent, ...]  # sorted by offset, crc32c still 0

    @property
    def data_file(self) -> DataFile:
        return DataFile(self.name, self.size)


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def layout_file(name: str, file_index: int, pieces: Sequence[tuple[int, int, int]]) -> FilePlan:
    """Place ``(storage, start, length)`` pieces one after another at aligned offsets."""
    extents = []
    offset = 0
    for storage, start, length in pieces:
        if length == 0:
            continue
        extents.append(Extent(storage, start, length, file_index, offset))
        offset = align_up(offset + length, ALIGNMENT)
    return FilePlan(name, offset, tuple(extents))


def padded_total(sizes: Sequence[int]) -> int:
    return sum(align_up(n) for n in sizes)


def split_stream(sizes: Sequence[int], targets: Sequence[int],
                 alignment: int = ALIGNMENT) -> list[list[Piece]]:
    """Cut the aligned stream of ``sizes`` into ``len(targets)`` contiguous parts of about
    ``targets[k]`` bytes each (cuts rounded to ``alignment``); return each part's pieces."""
    stream = padded_total(sizes)
    cuts = [0]
    cumulative = 0
    for t in targets[:-1]:
        cumulative += t
        cut = (cumulative + alignment // 2) // alignment * alignment
        cuts.append(min(max(cut, cuts[-1]), stream))
    cuts.append(stream)
    parts: list[list[Piece]] = [[] for _ in targets]
    part = 0
    position = 0
    for index, n in enumerate(sizes):
        lo_item = position
        hi_item = position = position + align_up(n, alignment)
        if hi_item == lo_item:
            continue
        while cuts[part + 1] <= lo_item:  # parts that end before this item
            part += 1
        k = part
        while k < len(targets) and cuts[k] < hi_item:
            start = max(cuts[k], lo_item) - lo_item
            end = min(cuts[k + 1] - lo_item, n)  # cuts are aligned, so start < n when start < end
            if end > start:
                parts[k].append((index, start, end - start))
            k += 1
    return parts


def plan_single_writer(storage_sizes: Sequence[int], files: int = 1) -> SavePlan:
    """Every storage, in order, into ``files`` data files of about equal size, written at once
    (a storage may be cut at an aligned boundary between two files). One file holds every
    storage whole, exactly as before ``files`` existed."""
    if files <= 1:
        pieces = [(i, 0, n) for i, n in enumerate(storage_sizes)]
        return SavePlan((layout_file(data_file_name(0), 0, pieces),))
    total = padded_total(storage_sizes)
    targets = [total // files + (1 if k < total % files else 0) for k in range(files)]
    parts = split_stream(storage_sizes, targets)
    return SavePlan(tuple(layout_file(data_file_name(k), k, part) for k, part in enumerate(parts)))


def file_streams(total_bytes: int, io_threads: int, block_bytes: int, setting: int = 0) -> int:
    """How many data files a single writer spreads ``total_bytes`` over: ``setting`` when
    positive, else one per I/O thread as long as each gets at least ``STREAM_MIN_BYTES`` and
    ``STREAM_MIN_BLOCKS`` blocks (small checkpoints stay one file).

    Why several: writes to one file serialize in the kernel on some filesystems (tmpfs takes the
    inode lock for every write; ext4 takes it exclusively for direct writes into preallocated,
    unwritten blocks), so one file caps a save at one stream's speed however many I/O threads
    there are, as fio with one job shows against fio with several.
    """
    if setting > 0:
        return setting
    per_stream = max(STREAM_MIN_BYTES, STREAM_MIN_BLOCKS * block_bytes)
    return max(1, min(io_threads, total_bytes // per_stream))


STREAM_MIN_BYTES = 64 << 20
STREAM_MIN_BLOCKS = 4

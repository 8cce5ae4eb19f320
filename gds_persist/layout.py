"""Stage 2 of a save: the layout of data files, i.e. where every byte goes. Pure data, no I/O.

A :class:`SavePlan` lists data files and, for each, the extents it holds at aligned offsets.
The single-writer plan lays storages out in order, each at the next aligned offset. The
data-parallel scheduler (``gds_persist.schedule``) produces the same structure for many writers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .format import ALIGNMENT, DataFile, Extent, align_up, data_file_name


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


def plan_single_writer(storage_sizes: Sequence[int]) -> SavePlan:
    """Every storage, whole, into one data file, in order."""
    pieces = [(i, 0, n) for i, n in enumerate(storage_sizes)]
    return SavePlan((layout_file(data_file_name(0), 0, pieces),))

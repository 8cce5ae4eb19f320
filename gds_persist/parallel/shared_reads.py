"""A shared read: the replicated bytes of a checkpoint read once in total by the ranks of a group.

The replicated extents are laid end to end in file order and cut into one contiguous, aligned
byte range per rank (:func:`gds_persist.parallel.schedule.plan_reads`); each rank reads its
range, checksumming as it goes, and the bytes then travel over the process group
(:mod:`gds_persist.parallel.exchange`). A range may cut an extent, so ranks exchange the CRC32C
of their pieces and every rank checks each whole extent
(:func:`gds_persist.format.checksum.crc32c_combine`): a corrupted extent raises the same
:class:`ChecksumError` on every rank. Encoded extents cannot be cut; they are not shared.
"""

from __future__ import annotations

from ..format import Extent, Manifest, crc32c_combine
from ..transfer.opened import OpenCheckpoint
from ..transfer.reader import Describe, checksum_mismatch
from .schedule import plan_reads


def shared_pieces(m: Manifest, replicated: set[int],
                  readers: int) -> tuple[list[Extent], list[list[Extent]]]:
    """The replicated extents in file order, and each of ``readers`` ranks' aligned pieces of
    them."""
    shared = sorted((e for e in m.extents if e.storage in replicated and not e.encoded),
                    key=lambda e: (e.file, e.offset))
    parts = plan_reads([e.length for e in shared], readers)
    by_rank = []
    for part in parts:
        sub = []
        for k, start, length in part:
            e = shared[k]
            sub.append(Extent(e.storage, e.start + start, length, e.file, e.offset + start, 0))
        by_rank.append(sub)
    return shared, by_rank


def check_joined(ck: OpenCheckpoint, shared: list[Extent], crcs: list[list[list[int]]],
                 describe: Describe) -> None:
    """Every rank: join the CRCs of the pieces all ranks read (``[file, offset, length, crc]``
    by rank) into each whole extent's CRC and compare it with the recorded one."""
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for rank_crcs in crcs:
        for file, offset, length, crc in rank_crcs:
            pieces.setdefault(file, []).append((offset, length, crc))
    for lst in pieces.values():
        lst.sort()
    cursor: dict[int, int] = {f: 0 for f in pieces}
    for e in shared:
        lst = pieces.get(e.file, [])
        k = cursor.get(e.file, 0)
        crc, end = 0, e.offset
        while k < len(lst) and lst[k][0] < e.offset + e.length:
            offset, length, piece_crc = lst[k]
            if offset != end:
                break
            crc = crc32c_combine(crc, piece_crc, length) if end > e.offset else piece_crc
            end += length
            k += 1
        cursor[e.file] = k
        if end != e.offset + e.length or crc != e.crc32c:
            raise checksum_mismatch(describe(e.storage), ck.file_path(e.file), e, crc)

"""Short requests (small tensors, the edge blocks of large ones) go before the long ones: one
issued behind long requests waits out their queue on the device while it holds an I/O
thread."""

from __future__ import annotations

from gds_persist.transfer.segments import SHORT_BYTES, Segment, short_first


def _seg(lo: int, nbytes: int) -> Segment:
    return Segment(lo, lo + nbytes, ())


def test_short_requests_go_first_each_kind_in_its_order() -> None:
    segs = [_seg(0, 4096), _seg(4096, SHORT_BYTES), _seg(SHORT_BYTES + 4096, 8192),
            _seg(SHORT_BYTES + 12288, 16 * SHORT_BYTES), _seg(17 * SHORT_BYTES + 12288, 4096)]
    got = short_first(segs, lambda s: s)
    assert [s.lo for s in got] == [0, SHORT_BYTES + 4096, 17 * SHORT_BYTES + 12288, 4096,
                                   SHORT_BYTES + 12288]
    assert short_first([], lambda s: s) == []

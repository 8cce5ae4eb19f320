"""For ``backend="auto"`` loads: read with O_DIRECT or through the page cache, whichever is faster
on the filesystem at hand, by measurement.

Which is faster depends on the machine, not on principle: on NVMe, O_DIRECT skips a memory copy
and wins; on the virtio disks of the development VMs, buffered reads with the kernel's readahead
were faster than any O_DIRECT read (fio's included). So the first large load from a filesystem in
a process reads two samples of the checkpoint's own data file, one each way, both cold (their
pages are dropped from the cache first), and the rest of that load and every later load from the
same filesystem use the faster way; the measured rates are in the reason.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from ..transfer.staging import AlignedBuffer
from .posix import _O_DIRECT, pread_all

SAMPLE_BYTES = 32 << 20  # read each way
REQUEST_BYTES = 4 << 20
MIN_FILE_BYTES = 2 * SAMPLE_BYTES  # smaller files: not worth measuring (direct, as before)
BUFFERED_MARGIN = 1.15  # buffered must be this much faster: O_DIRECT keeps the page cache clean

_choices: dict[int, tuple[bool, str]] = {}  # st_dev -> (buffered?, reason)


def measured_read_mode(path: str, size: int, name: str,
                       threads: int) -> tuple[bool, str] | None:
    """Whether reads from ``path``'s filesystem should go through the page cache, and why,
    measured once per filesystem on ``path`` (data file ``name`` of ``size`` bytes, or a
    descriptor of it under /proc/self/fd); None when the file
    is too small to measure and nothing was measured on that filesystem before."""
    dev = os.stat(path).st_dev
    if dev in _choices:
        return _choices[dev]
    if size < MIN_FILE_BYTES:
        return None
    with AlignedBuffer(REQUEST_BYTES * threads, pin=False) as buf:
        buf.array.fill(0)  # fault the buffer in first, or the first sample pays for it
        direct = _rate(path, 0, buf, threads, _O_DIRECT)  # the first and the last samples
        buffered = _rate(path, size - SAMPLE_BYTES, buf, threads, 0)
    use_buffered = buffered > BUFFERED_MARGIN * direct
    choice = "page cache (buffered)" if use_buffered else "O_DIRECT"
    reason = (f"reads via {choice}: measured on this filesystem {direct / 1e9:.2f} GB/s with "
              f"O_DIRECT vs {buffered / 1e9:.2f} GB/s buffered ({SAMPLE_BYTES >> 20} MiB cold "
              f"each, {name})")
    _choices[dev] = (use_buffered, reason)
    return _choices[dev]


def _rate(path: str, start: int, buf: AlignedBuffer, threads: int, flags: int) -> float:
    """Bytes per second of a cold read of ``SAMPLE_BYTES`` at ``start`` with ``threads``."""
    start -= start % REQUEST_BYTES
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.posix_fadvise(fd, start, SAMPLE_BYTES, os.POSIX_FADV_DONTNEED)  # cold, both ways
        # requests k and k + threads may share a buffer at once: the bytes are thrown away
        views = [buf.view[k * REQUEST_BYTES : (k + 1) * REQUEST_BYTES] for k in range(threads)]
        offsets = range(start, start + SAMPLE_BYTES, REQUEST_BYTES)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(lambda k: pread_all(fd, views[k % threads], offsets[k]),
                                range(len(offsets))))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return done / seconds if seconds > 0 else 0.0


def forget() -> None:
    """Drop the measured choices (tests; a process whose storage changed)."""
    _choices.clear()

"""For ``backend="auto"`` loads: read with O_DIRECT or through the page cache, whichever is faster
on the filesystem at hand, by measurement.

Which is faster depends on the machine, not on principle: on NVMe, O_DIRECT skips a memory copy
and wins; on the virtio disks of the development VMs either mode won by up to 1.7x over a 2 GiB
load depending on what else ran on the two CPUs (buffered reads cost a copy per byte). So the
first large load from a filesystem in a process samples the checkpoint's own largest data file
the way the load reads it - requests of ``block_bytes``, ``io_threads`` consecutive ones at once,
cold (their pages dropped first) - in four rounds ordered O_DIRECT, buffered, buffered, O_DIRECT
(a load that other processes put on the machine meanwhile weighs on both modes alike), and
:func:`decide` takes the page cache only where it won **both** pairs of rounds by
:data:`BUFFERED_MARGIN`; a single 32 MiB pair, as before, flipped between runs
(bench/results/2026-12-01-cpu-read-mode-predictor.txt). On a memory-backed filesystem (tmpfs)
nothing is sampled: there O_DIRECT reads are the same copy out of the page cache as buffered ones.
The rest of that load and every later load from the same filesystem use the choice; the
measured rates are in the reason.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .buffers import AlignedBuffer
from .posix import _O_DIRECT, filesystem_type, pread_all

ROUNDS = ("direct", "buffered", "buffered", "direct")  # ABBA: drift weighs on both modes alike
MIN_REQUEST_BYTES = 1 << 20
SAMPLE_FRACTION = 4  # the rounds read at most 1/4 of the file (smaller requests on small files)
MIN_FILE_BYTES = 64 << 20  # smaller files: not worth measuring (direct, as before)
BUFFERED_MARGIN = 1.15  # buffered must be this much faster: O_DIRECT keeps the page cache clean
MEMORY_FILESYSTEMS = ("tmpfs",)

_choices: dict[int, tuple[bool, str]] = {}  # st_dev -> (buffered?, reason)


@dataclass(frozen=True)
class ReadSample:
    """What sampling a filesystem found: each round's mode and rate (bytes/s), in order."""

    rounds: tuple[tuple[str, float], ...]
    request_bytes: int
    threads: int
    name: str = ""  # the data file sampled
    fstype: str = ""  # set where nothing was sampled because the filesystem is memory-backed


def decide(sample: ReadSample) -> tuple[bool, str]:
    """``(read through the page cache?, reason)`` from ``sample``: buffered only where it beat
    O_DIRECT by ``BUFFERED_MARGIN`` in every pair of rounds, else O_DIRECT."""
    if sample.fstype in MEMORY_FILESYSTEMS:
        return False, (f"reads via O_DIRECT, not measured: on {sample.fstype} O_DIRECT and "
                       "buffered reads are the same copy out of the page cache")
    direct = [rate for mode, rate in sample.rounds if mode == "direct"]
    buffered = [rate for mode, rate in sample.rounds if mode == "buffered"]
    pairs = list(zip(direct, buffered, strict=True))
    use_buffered = bool(pairs) and all(b > BUFFERED_MARGIN * d for d, b in pairs)
    choice = "page cache (buffered)" if use_buffered else "O_DIRECT"
    return use_buffered, (
        f"reads via {choice}: measured on this filesystem {_mean(direct) / 1e9:.2f} GB/s with "
        f"O_DIRECT vs {_mean(buffered) / 1e9:.2f} GB/s buffered ({len(pairs)} cold rounds each, "
        f"{sample.threads} x {sample.request_bytes >> 20} MiB requests at once, {sample.name}; "
        f"buffered wins only by {BUFFERED_MARGIN:.2f}x in every round pair)")


def _mean(rates: list[float]) -> float:
    """The rate of all rounds together (each moved the same bytes): the harmonic mean."""
    return len(rates) / sum(1 / r for r in rates) if rates and all(rates) else 0.0


def measured_read_mode(path: str, size: int, name: str, threads: int,
                       block_bytes: int = 16 << 20) -> tuple[bool, str] | None:
    """Whether reads from ``path``'s filesystem should go through the page cache, and why,
    measured once per filesystem on ``path`` (data file ``name`` of ``size`` bytes, or a
    descriptor of it under /proc/self/fd) as a load with ``threads`` I/O threads and
    ``block_bytes`` requests reads it; None when the file is too small to measure and nothing
    was measured on that filesystem before."""
    dev = os.stat(path).st_dev
    if dev in _choices:
        return _choices[dev]
    fstype = _fstype(path)
    if fstype in MEMORY_FILESYSTEMS:
        sample = ReadSample((), 0, threads, name, fstype)
    elif size < MIN_FILE_BYTES:
        return None
    else:
        sample = _sample(path, size, name, threads, block_bytes)
    _choices[dev] = decide(sample)
    return _choices[dev]


def _fstype(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return filesystem_type(fd)
    finally:
        os.close(fd)


def request_bytes(size: int, threads: int, block_bytes: int) -> int:
    """The sample's request size: the load's ``block_bytes`` where the file is large enough for
    the rounds to read at most ``1 / SAMPLE_FRACTION`` of it, else smaller (>= 1 MiB)."""
    fit = size // (SAMPLE_FRACTION * len(ROUNDS) * threads) // 4096 * 4096
    return max(MIN_REQUEST_BYTES, min(block_bytes, fit))


def _sample(path: str, size: int, name: str, threads: int, block_bytes: int) -> ReadSample:
    request = request_bytes(size, threads, block_bytes)
    span = size // len(ROUNDS) // 4096 * 4096  # round k reads from k * span: unread bytes
    with AlignedBuffer(request * threads, pin=False) as buf, ThreadPoolExecutor(threads) as pool:
        buf.array.fill(0)  # fault the buffer in first, or the first round pays for it
        views = [buf.view[k * request : (k + 1) * request] for k in range(threads)]
        rounds = tuple((mode, _rate(path, k * span, views, pool, mode))
                       for k, mode in enumerate(ROUNDS))
    return ReadSample(rounds, request, threads, name)


def _rate(path: str, start: int, views: list[memoryview], pool: ThreadPoolExecutor,
          mode: str) -> float:
    """Bytes per second of one cold round: one request per view at once from ``start``."""
    request = views[0].nbytes
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if mode == "direct" else 0))
    try:
        os.posix_fadvise(fd, start, request * len(views), os.POSIX_FADV_DONTNEED)  # cold
        t0 = time.perf_counter()
        done = sum(pool.map(lambda k: pread_all(fd, views[k], start + k * request),
                            range(len(views))))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return done / seconds if seconds > 0 and done else 0.0


def forget() -> None:
    """Drop the measured choices (tests; a process whose storage changed)."""
    _choices.clear()

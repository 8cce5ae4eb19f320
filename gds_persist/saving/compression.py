"""``compression=``: whether a save stores its units encoded by the lossless codec
(:mod:`gds_persist.format.codec`), and why.

* ``"none"``: raw bytes (the default);
* ``"lossless"``: every unit of at least ``COMPRESS_MIN`` bytes that the codec shrinks by a whole
  block is stored encoded;
* ``"auto"``: encode only where it makes this save faster on the drive it meets. A sample of the
  state (``SAMPLE_UNITS`` slices, ``SAMPLE_BYTES`` in all, at evenly spaced byte positions) goes
  through the CPU work an encoded unit costs the writer - compress, CRC32C of the raw and of the
  stored bytes, the copy into a staging buffer - on as many threads as the writer runs at once
  (the I/O threads, at most one per usable core), timed on the wall clock, giving the ratio
  ``r`` and the rate ``C``; the drive's durable write rate ``D`` is measured with the
  save's backend (:mod:`gds_persist.backends.write_rate`, once per filesystem per process).
  Compressing and writing overlap, so a compressed save moves payload at about ``min(C, r * D)``
  against ``D`` raw: ``auto`` compresses when that is at least ``AUTO_GAIN`` times ``D``, and
  the reason (recorded in the manifest's ``writer`` and in :class:`~gds_persist.SaveInfo`) gives
  the figures either way. Once the fastest ``C`` seen in this process is below ``D`` times
  ``AUTO_GAIN``, later saves to that drive skip the sample. On a memory-backed filesystem
  (tmpfs) a raw write is one memory copy, which no codec outruns (measured: every codec tried
  was slower than writing raw to /dev/shm), so ``auto`` stores raw there without measuring.
  A save that stores raw bytes, has no base and records no hashes is a plain save (format
  version 1-3), the same bytes as ``"none"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..backends.base import Backend
from ..backends.posix import memory_backed
from ..backends.write_rate import write_rate
from ..errors import BackendError
from ..format import ALIGNMENT, align_up, codec, crc32c
from ..settings import COMPRESSIONS, Settings
from ..stages import stage
from ..transfer.staging import usable_cores
from ..transfer.unit_writer import Unit, codec_threads

SAMPLE_BYTES = 8 << 20  # timed per save: ~3-4 ms on two cores
SAMPLE_UNITS = 8
AUTO_GAIN = 1.05  # compress only when the model predicts at least this speed-up


def check_mode(mode: str) -> str:
    if mode not in COMPRESSIONS:
        raise ValueError(f"compression={mode!r}: valid values are {', '.join(COMPRESSIONS)}")
    return mode


def choose(mode: str, backend: Backend, directory: str, units: Sequence[Unit],
           sources: Sequence[torch.Tensor], cfg: Settings) -> tuple[bool, str]:
    """Whether to encode this save's units, and why."""
    check_mode(mode)
    if mode == "none":
        return False, "compression='none'"
    ok, why = codec.available()
    if mode == "lossless":
        if not ok:
            raise BackendError(f"compression='lossless' needs the codec: {why}")
        return True, f"compression='lossless' (requested): {codec.DESCRIPTION}"
    if not ok:
        return False, f"compression='auto': not compressing, the codec is unusable: {why}"
    if memory_backed(directory):
        return False, ("compression='auto': not compressing: a memory-backed filesystem (tmpfs), "
                       "where writing raw bytes is one memory copy, which the codec (a pass "
                       "over the bytes and a copy of what it keeps) cannot outrun")
    sample = _sample(units, sources)
    if not sample:
        return False, (f"compression='auto': not compressing, no unit of at least "
                       f"{codec.COMPRESS_MIN} bytes")
    threads = max(1, min(cfg.io_threads, usable_cores()))
    with stage("drive write rate"):
        drive = write_rate(backend, directory, cfg.io_threads, cfg.block_bytes)
    best = _best_rate.get(threads)
    if best is not None and best < AUTO_GAIN * drive:
        return False, (f"compression='auto': not compressing: the codec's pipeline never ran "
                       f"faster than {best / 1e9:.2f} GB/s in this process ({threads} threads, "
                       f"{codec.DESCRIPTION}), less than {AUTO_GAIN} x the {drive / 1e9:.2f} "
                       f"GB/s this drive took ({backend.name}, measured); not sampled again")
    rate, ratio = _timed_sample(sample, threads)
    _best_rate[threads] = max(best or 0.0, rate)
    gain = predicted_gain(rate, ratio, drive)
    figures = (f"a {sum(a.nbytes for a, _ in sample) / 1e6:.0f} MB sample compressed "
               f"{ratio:.3f}x, the encoded unit's CPU work (compress, CRC32C of raw and stored "
               f"bytes, staging copy) ran at {rate / 1e9:.2f} GB/s ({threads} threads, "
               f"{codec.DESCRIPTION}); "
               f"this drive took {drive / 1e9:.2f} GB/s ({backend.name}, measured): expect "
               f"{gain:.2f}x the uncompressed save rate")
    if gain >= AUTO_GAIN:
        return True, f"compression='auto': compressing: {figures}"
    return False, f"compression='auto': not compressing (pays from {AUTO_GAIN}x): {figures}"


def predicted_gain(rate: float, ratio: float, drive: float) -> float:
    """The compressed save's payload rate over the raw one's: compressing at ``rate`` overlaps
    writing ``1 / ratio`` of the bytes at ``drive``, so payload moves at ``min(rate, ratio *
    drive)`` against ``drive``."""
    return min(rate, ratio * drive) / drive


_best_rate: dict[int, float] = {}  # codec threads -> fastest sampled pipeline rate (bytes/s)


def _timed_sample(sample: Sequence[tuple[np.ndarray, int]], threads: int) -> tuple[float, float]:
    """(rate in bytes/s, ratio) of the CPU work the writer does per encoded unit, on ``sample``,
    run on ``threads`` threads at once as the writer's I/O threads would."""
    scratch = [np.empty(a.nbytes + ALIGNMENT, dtype=np.uint8) for a, _ in sample]

    def unit(i: int) -> tuple[int, int]:
        data, typesize = sample[i]
        crc32c(data)
        encoded = codec.encode(data, typesize, codec_threads())
        keep = codec.worth_storing(data.nbytes, len(encoded))
        out = np.frombuffer(encoded, dtype=np.uint8) if keep else data
        if keep:
            crc32c(out)
        np.copyto(scratch[i][: out.nbytes], out)
        return align_up(data.nbytes, ALIGNMENT), align_up(out.nbytes, ALIGNMENT)

    with stage("compression sample", sum(a.nbytes for a, _ in sample)):
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            sizes = list(pool.map(unit, range(len(sample))))
            seconds = max(time.perf_counter() - t0, 1e-9)
    raw, stored = sum(r for r, _ in sizes), sum(s for _, s in sizes)
    return sum(a.nbytes for a, _ in sample) / seconds, raw / stored


def forget() -> None:
    """Drop the fastest sampled rates (tests; a machine whose load changed)."""
    _best_rate.clear()


def _sample(units: Sequence[Unit], sources: Sequence[torch.Tensor]) -> list[tuple[np.ndarray,
                                                                                  int]]:
    """Slices of ``SAMPLE_BYTES / SAMPLE_UNITS`` from the large units at evenly spaced byte
    positions of the state (so each kind of tensor weighs by its size; host copies of CUDA
    ones)."""
    large = [u for u in units if u.length >= codec.COMPRESS_MIN]
    if not large:
        return []
    total = sum(u.length for u in large)
    piece_bytes = max(codec.COMPRESS_MIN, SAMPLE_BYTES // SAMPLE_UNITS)
    out = []
    k, before = 0, 0  # large[k] starts at byte ``before`` of the large units laid end to end
    for j in range(SAMPLE_UNITS):
        at = total * j // SAMPLE_UNITS
        while before + large[k].length <= at:
            before += large[k].length
            k += 1
        u = large[k]
        lo = u.start + min(at - before, max(0, u.length - piece_bytes))
        n = min(piece_bytes, u.start + u.length - lo)
        piece = sources[u.storage][lo : lo + n]
        out.append((piece.cpu().numpy() if piece.is_cuda else piece.numpy(), u.typesize))
    return out

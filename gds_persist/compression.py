"""``compression=``: whether a save stores its units encoded by the lossless codec
(:mod:`gds_persist.format.codec`), and why.

* ``"none"``: raw bytes (the default);
* ``"lossless"``: every unit of at least ``COMPRESS_MIN`` bytes that the codec shrinks by a whole
  block is stored encoded;
* ``"auto"``: encode only where it makes this save faster on the drive it meets. A sample of the
  state (up to ``SAMPLE_BYTES``, spread over its large units) is compressed and timed with the
  threads the writer would use, giving the ratio ``r`` and the compress rate ``C``; the drive's
  durable write rate ``D`` is measured with the save's backend (:mod:`gds_persist.backends.
  write_rate`, once per filesystem per process). Compressing and writing overlap, so a
  compressed save moves payload at about ``min(C, r * D)`` against ``D`` raw: ``auto``
  compresses when that is at least ``AUTO_GAIN`` times ``D``, and the reason (recorded in the
  manifest's ``writer`` and in :class:`~gds_persist.SaveInfo`) gives the figures either way.
  On a memory-backed filesystem (tmpfs) ``D`` is far above any codec's rate, so ``auto`` stores
  raw there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from .backends.base import Backend
from .backends.write_rate import write_rate
from .errors import BackendError
from .format import ALIGNMENT, align_up, codec
from .settings import COMPRESSIONS, Settings
from .stages import stage
from .transfer.unit_writer import Unit, codec_threads

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
    sample = _sample(units, sources)
    if not sample:
        return False, (f"compression='auto': not compressing, no unit of at least "
                       f"{codec.COMPRESS_MIN} bytes")
    threads = codec_threads()
    with stage("compression sample", sum(a.nbytes for a, _ in sample)):
        raw = stored = 0
        t0 = time.perf_counter()
        for data, typesize in sample:
            encoded = codec.encode(data, typesize, threads)
            raw += align_up(data.nbytes, ALIGNMENT)
            stored += (align_up(len(encoded), ALIGNMENT)
                       if codec.worth_storing(data.nbytes, len(encoded))
                       else align_up(data.nbytes, ALIGNMENT))
        seconds = max(time.perf_counter() - t0, 1e-9)
    ratio = raw / stored
    rate = sum(a.nbytes for a, _ in sample) / seconds
    with stage("drive write rate"):
        drive = write_rate(backend, directory, cfg.io_threads, cfg.block_bytes)
    gain = min(rate, ratio * drive) / drive
    figures = (f"a {sum(a.nbytes for a, _ in sample) / 1e6:.0f} MB sample compressed "
               f"{ratio:.3f}x at {rate / 1e9:.2f} GB/s ({threads} threads, {codec.DESCRIPTION}); "
               f"this drive took {drive / 1e9:.2f} GB/s ({backend.name}, measured): expect "
               f"{gain:.2f}x the uncompressed save rate")
    if gain >= AUTO_GAIN:
        return True, f"compression='auto': compressing: {figures}"
    return False, f"compression='auto': not compressing (pays from {AUTO_GAIN}x): {figures}"


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

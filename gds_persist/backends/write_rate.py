"""How fast the drive under a directory takes durable writes: a short measurement, once per
filesystem and backend per process, for ``compression="auto"``
(:mod:`gds_persist.saving.compression`).

It writes ``PROBE_BYTES`` of incompressible bytes in ``block_bytes`` requests from the I/O
threads with the save's own backend, fsyncs, and removes the file; the best of ``PROBE_RUNS``
runs is the rate (other load only ever makes a run slower, and a high drive rate biases ``auto``
towards not compressing). It is not fio: it is what this writer meets on this drive right now.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .base import Backend
from .buffers import AlignedBuffer

PROBE_BYTES = 64 << 20
PROBE_RUNS = 2
_cache: dict[tuple[int, str], float] = {}
_lock = threading.Lock()


def write_rate(backend: Backend, directory: str, io_threads: int, block_bytes: int,
               nbytes: int = PROBE_BYTES) -> float:
    """Durable write rate (bytes per second) of ``backend`` into ``directory``; cached per
    filesystem and backend for the life of the process."""
    key = (os.stat(directory).st_dev, backend.name)
    with _lock:
        if key in _cache:
            return _cache[key]
    block = min(block_bytes, nbytes)
    blocks = max(1, nbytes // block)
    best = 0.0
    with AlignedBuffer(block, pin=False) as buf:
        buf.array[:] = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
        with ThreadPoolExecutor(max(1, io_threads)) as pool:
            for _ in range(PROBE_RUNS):
                path = os.path.join(directory, f".gds-write-probe-{uuid.uuid4().hex[:12]}")
                handle = backend.open(path, write=True, size=blocks * block)
                try:
                    t0 = time.perf_counter()
                    list(pool.map(backend.pwrite, [handle] * blocks, [buf.view] * blocks,
                                  [i * block for i in range(blocks)]))
                    backend.sync(handle)
                    seconds = time.perf_counter() - t0
                finally:
                    backend.close(handle)
                    os.unlink(path)
                best = max(best, blocks * block / seconds)
    with _lock:
        _cache[key] = best
    return best


def forget() -> None:
    """Drop the cached rates (tests; a drive that changed speed)."""
    with _lock:
        _cache.clear()

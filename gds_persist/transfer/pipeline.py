"""What the writer and the reader of data files share: bounded waits on I/O futures and the I/O
resources of a pipeline."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..backends.base import Backend
from ..errors import CheckpointError
from .staging import StagingRing

T = TypeVar("T")


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def result_within(fut: Future[T], timeout_s: float, what: str) -> T:
    """``fut``'s result, waiting at most ``timeout_s``; :class:`CheckpointError` naming ``what``
    when it does not come."""
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise CheckpointError(
            f"{what} did not finish within {timeout_s:.0f} s (hung storage?); "
            "raise io_timeout_s if the drive is just slow"
        ) from None


def wait_all(futures: deque[Future[None]], timeout_s: float, what: str) -> None:
    while futures:
        result_within(futures.popleft(), timeout_s, what)


def drain_quietly(futures: deque[Future[Any]], timeout_s: float) -> bool:
    """After an error: cancel queued I/O and let running I/O finish (within ``timeout_s`` in
    all) before its buffers and descriptor go away. False if some I/O is still stuck.

    Cancelling matters: a queued write that ran after its descriptor was closed could hit
    another file that reused the descriptor number.
    """
    for fut in futures:
        fut.cancel()
    deadline = time.monotonic() + timeout_s
    for fut in futures:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return False
        except BaseException:  # noqa: BLE001 - the first error is already being raised
            pass
    return True


@dataclass
class FilePipeline:
    """The resources one data file's writer or reader runs on."""

    backend: Backend
    ring: StagingRing | None  # None: device transfers only
    pool: ThreadPoolExecutor  # the I/O threads
    timeout_s: float  # the bound on every wait for I/O
    progress: Callable[[int], None] | None = None  # bytes of each block done (from any thread)

    def sync_all(self, handles: list[Any], what: str) -> None:
        """fsync every file, concurrently: the data is durable before the manifest is written."""
        syncs = deque(self.pool.submit(self.backend.sync, h) for h in handles)
        try:
            wait_all(syncs, self.timeout_s, what)
        except BaseException:
            drain_quietly(syncs, self.timeout_s)
            raise

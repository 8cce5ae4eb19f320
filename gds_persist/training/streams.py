"""CUDA streams and events of the Checkpointer's workers.

``save`` records one event per device on the caller's current stream (:func:`record_events`):
the tensors are final once it has completed. A worker waits for those events, in its own thread
only (:func:`synchronize`), and runs its copies on a side stream per device
(:class:`DeviceStreams`), so that they neither wait behind the training kernels nor hold them up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..state.flatten import Flattened

Events = list[tuple[torch.device, Any]]  # (device, CUDA event recorded at save())


def record_events(flat: Flattened) -> Events:
    """One CUDA event per device, recorded on its current stream: the tensors are final after."""
    devices = {s.device for s in flat.storage_objects if s.is_cuda}
    events = []
    for device in sorted(devices, key=str):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        events.append((device, ev))
    return events


def synchronize(events: Events) -> None:
    """In a worker: wait (this thread only) until the caller's kernels up to save() are done."""
    for _, ev in events:
        ev.synchronize()


class DeviceStreams:
    """One side stream per device, created on first use and kept for the Checkpointer's life."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    @contextlib.contextmanager
    def around(self, events: Events) -> Iterator[None]:
        """Run the block on the side streams of the devices of ``events`` (none: as it is)."""
        if not events:
            yield
            return
        with contextlib.ExitStack() as stack:
            for device, _ in events:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

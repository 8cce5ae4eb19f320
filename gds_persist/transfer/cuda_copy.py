"""Device <-> pinned-host copies for the staged path, on a side CUDA stream with events.

Save (``direct``/``buffered`` backends with CUDA tensors): the submitting thread queues the
device-to-host copies of each staging buffer on a side stream (``cudaMemcpyAsync`` into the
page-locked ring) and records an event; the I/O thread that writes the buffer waits for that event
only. So the PCIe copies run as many buffers ahead of the drive as the ring holds.

Load: each I/O thread reads a pinned buffer, queues its host-to-device copies on the side stream
and waits for them (:meth:`StreamCopier.copy_and_wait`, safe from several threads) before the
buffer goes back to the ring; the CRCs are then computed on the device, in one batch.

The training stream is never made to wait: the side stream waits on an event recorded on the
caller's current stream when the copier starts (so it sees every byte produced before the save
or load was called), and work queued on the current stream afterwards is not held up by the
copies. CPU tensors are copied synchronously, exactly as before.
"""

from __future__ import annotations

import threading

import torch


class StreamCopier:
    """Queues copies between CUDA tensors and pinned host buffers on one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._dirty: set[torch.device] = set()
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))  # everything queued so far
                stream.wait_event(ready)  # the side stream waits; the training stream does not
                self._streams[device] = stream
            return stream

    def copy_and_wait(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the side stream, returning once it is done; safe to call from
        several threads at once (each waits for its own copy only)."""
        if not (src.is_cuda or dst.is_cuda):
            dst.copy_(src)
            return
        stream = self._stream(src.device if src.is_cuda else dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, queued on the side stream when either side is on a GPU.

        SAFETY: both tensors must stay alive and unmodified until :meth:`wait` returns.
        """
        if not (src.is_cuda or dst.is_cuda):
            dst.copy_(src)
            return
        device = src.device if src.is_cuda else dst.device
        with torch.cuda.stream(self._stream(device)):
            dst.copy_(src, non_blocking=True)
        self._dirty.add(device)

    def record(self) -> list[torch.cuda.Event]:
        """Events that complete once every copy queued so far has (wait on them from any
        thread with :meth:`wait_events`)."""
        events = []
        for device in self._dirty:
            event = torch.cuda.Event()
            event.record(self._streams[device])
            events.append(event)
        self._dirty.clear()
        return events

    @staticmethod
    def wait_events(events: list[torch.cuda.Event]) -> None:
        """Block the calling thread (only) until ``events`` have completed."""
        for event in events:
            event.synchronize()

    def wait(self) -> None:
        """Block the calling thread (only) until every copy queued so far has completed."""
        self.wait_events(self.record())


def copier_for(tensors: list[torch.Tensor]) -> StreamCopier | None:
    """A copier when any of ``tensors`` lives on a GPU, else None (plain synchronous copies)."""
    return StreamCopier() if any(t.is_cuda for t in tensors) else None

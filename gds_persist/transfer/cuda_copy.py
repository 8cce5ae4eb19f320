"""Device <-> pinned-host copies for the staged path, on a side CUDA stream with events.

Save (``direct``/``buffered`` backends with CUDA tensors): while the I/O threads write the
staging buffers filled before, the filling thread queues the device-to-host copies of the next
buffer on a side stream (``cudaMemcpyAsync`` into the page-locked ring), records an event and
waits for that event only when the buffer's bytes are needed (CRC, then the O_DIRECT write).
So the PCIe copy of buffer k+1 runs while the drive writes buffers <= k (double buffering or
deeper, as deep as the ring).

Load mirrors it: O_DIRECT reads fill pinned buffers in the I/O threads; the consuming thread
queues each buffer's host-to-device copies on the side stream, checksums the same host bytes
meanwhile, and waits for the copy's event before the buffer goes back to the ring.

The training stream is never made to wait: the side stream waits on an event recorded on the
caller's current stream when the copier starts (so it sees every byte produced before the save
or load was called), and work queued on the current stream afterwards is not held up by the
copies. CPU tensors are copied synchronously, exactly as before.
"""

from __future__ import annotations

import torch


class StreamCopier:
    """Queues copies between CUDA tensors and pinned host buffers on one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._dirty: set[torch.device] = set()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # everything queued so far
            stream.wait_event(ready)  # the side stream waits; the training stream does not
            self._streams[device] = stream
        return stream

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

    def wait(self) -> None:
        """Block the calling thread (only) until every copy queued so far has completed."""
        events = []
        for device in self._dirty:
            event = torch.cuda.Event()
            event.record(self._streams[device])
            events.append(event)
        self._dirty.clear()
        for event in events:
            event.synchronize()


def copier_for(tensors: list[torch.Tensor]) -> StreamCopier | None:
    """A copier when any of ``tensors`` lives on a GPU, else None (plain synchronous copies)."""
    return StreamCopier() if any(t.is_cuda for t in tensors) else None

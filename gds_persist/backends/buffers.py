"""Page-aligned host memory: anonymous (or a shared file mapping), pinned where CUDA is usable.

Buffers are anonymous ``mmap`` regions (page-aligned, as O_DIRECT requires). Where CUDA is
usable they are also registered with ``cudaHostRegister`` so device<->host copies are DMA at full
PCIe speed (pinned memory). Backends probe and bounce through them; the staging ring of
:mod:`gds_persist.transfer.staging` is a bounded set of them.
"""

from __future__ import annotations

import mmap
import warnings

import torch


def _cuda_usable() -> bool:
    return torch.cuda.is_available()


class AlignedBuffer:
    """``nbytes`` of page-aligned host memory, exposed as a memoryview and a uint8 tensor:
    anonymous memory, or (``fd``) a shared mapping of that file (the caller keeps the fd).

    SAFETY: ``view`` and ``tensor`` alias the mapping; do not use them after :meth:`close`.
    """

    def __init__(self, nbytes: int, pin: bool | None = None, *, fd: int = -1):
        self.nbytes = nbytes
        flags = mmap.MAP_SHARED if fd >= 0 else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._mmap = mmap.mmap(fd, nbytes, flags=flags)
        self.view = memoryview(self._mmap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about writability we do have
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.array = self.tensor.numpy()  # numpy copies release the GIL and use one core
        self.pinned = False
        if pin if pin is not None else _cuda_usable():
            self._pin()

    def _pin(self) -> None:
        """Register with CUDA; unpinned memory still works, only slower, so never fail here."""
        try:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        except RuntimeError:  # e.g. CUDA cannot be initialised in a forked child
            return
        self.pinned = int(rc) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor, self.array
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # A slice of this buffer is still referenced, typically by the traceback of a failed
            # I/O call; the mapping is freed with that last reference instead of now.
            pass

    def __enter__(self) -> AlignedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

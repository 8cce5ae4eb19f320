"""A state dict as one ``torch.save`` file, written atomically.

``torch.save`` pickles a complete object graph, so it cannot stream: the caller holds the whole
state dict in memory. The bytes go through a 16 MiB buffer to a temporary sibling that is
fsynced and renamed into place (:class:`gds_persist.transfer.atomic_file.AtomicFile`), counted
for progress as they are written. Used by :func:`gds_persist.export_checkpoint` and
:func:`gds_persist.dcp.format_utils.dcp_to_torch_save`.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from ..progress import ByteCounter
from ..transfer.atomic_file import AtomicFile


def save_torch_file(state: Any, out: str, counter: ByteCounter) -> None:
    """Write ``state`` to ``out`` with ``torch.save``; ``out`` appears whole or not at all."""
    with AtomicFile(out) as fd:
        with _CountingFile(fd, counter) as raw, io.BufferedWriter(raw, 16 << 20) as buffered:
            torch.save(state, buffered)


class _CountingFile(io.RawIOBase):
    """A write-only file object over a descriptor that reports bytes to a counter."""

    def __init__(self, fd: int, counter: ByteCounter):
        self.fd = fd
        self.counter = counter

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = os.write(self.fd, b)
        self.counter.add(n)
        return n

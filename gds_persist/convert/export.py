"""``export_checkpoint``: a gds_persist checkpoint as one ``torch.save`` or safetensors file.

The torch export loads the state dict whole and writes it as a torch.save file through the engine
(:class:`gds_persist.saving.torch_file.TorchFileLayout`: torch.load reads it, gds_persist
verifies it); the safetensors export streams the data
from the checkpoint's files to its final offsets in the output (memory use:
:mod:`gds_persist.convert`). A checkpoint written through DCP is consolidated first
(:mod:`gds_persist.dcp.consolidate`).
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import torch

from .. import settings
from ..backends.posix import pwrite_all
from ..format import DTYPES, Extent, full_tree, leaves
from ..format.tree import path_str, tensor_key_paths, walk
from ..loading.destinations import contiguous, tensor_leaves
from ..loading.extents import read_extents
from ..loading.load import load, read_manifest
from ..progress import ByteCounter, ProgressCallback
from ..results import ExportInfo
from ..saving.options import SaveRequest
from ..saving.sequence import run_save
from ..saving.torch_file import TorchFileLayout
from ..state.flatten import flatten, rebuild_tensor
from ..stores import refuse_url
from ..transfer.atomic_file import AtomicFile
from ..transfer.opened import OpenCheckpoint, opened
from . import FORMATS
from .safetensors import META_KEY, StEntry, plan_safetensors, st_header


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str | None = None,
    sep: str = ".",
    backend: str | None = None,
    progress: ProgressCallback | None = None,
) -> ExportInfo:
    """Write the checkpoint at ``path`` to the one file ``out``, every CRC32C verified. A
    checkpoint written through DCP (:class:`gds_persist.dcp.GdsPersistWriter`) is consolidated
    into one full state dict first (DCP's own planner; in memory). Memory use:
    :mod:`gds_persist.convert`; what safetensors cannot hold:
    :mod:`gds_persist.convert.safetensors`.

    Parameters:
        path: a committed gds_persist checkpoint.
        out: the file to write (replaced atomically; none is left on error).
        to: ``"torch"`` (``torch.load(out, weights_only=True)`` reads it), ``"safetensors"``
            (``safetensors.torch.load_file`` reads it), or None: from the suffix of ``out``.
        sep: joins nested keys into safetensors' flat names.
        backend: the I/O backend, as for :func:`gds_persist.load`.
        progress: ``progress(done_bytes, total_bytes)``, called as data is written.

    Returns:
        :class:`~gds_persist.results.ExportInfo`: where, which format, tensors, bytes, notes.

    Raises:
        ChecksumError: stored bytes do not match their checksum (no output file is left).
        NotCommittedError: no committed checkpoint at ``path``.
        ValueError: an unknown ``to``, or a suffix that names no format.
    """
    path, out = os.fspath(path), os.fspath(out)
    refuse_url(path, "export_checkpoint")
    refuse_url(out, "export_checkpoint")
    to = _infer_format(out, to)
    m = read_manifest(path)
    # imported here, not at the top: the DCP package imports torch.distributed.checkpoint
    from ..dcp.consolidate import consolidate, is_dcp

    if is_dcp(m):
        counter = ByteCounter(progress, 2 * m.total_bytes)
        state = consolidate(path, backend)
        counter.add(m.total_bytes)
        notes = ["DCP checkpoint consolidated into one full state dict (in memory)"]
        if to == "torch":
            return _export_torch(state, out, backend, counter, notes)
        return _export_safetensors_from_memory(state, out, sep, counter, notes)
    payload = sum(s.nbytes for s in m.storages)
    if to == "torch":
        counter = ByteCounter(progress, m.total_bytes + payload)
        state = load(path, map_location="cpu", backend=backend,
                     progress=_adding_to(counter) if progress is not None else None)
        notes = ["a torch.save file's pickle cannot stream: the state dict was loaded whole"]
        unsafe = sorted({x for _, n in walk(full_tree(m)) if (x := leaves.needs_safe_globals(n))})
        if unsafe:  # numpy arrays, paths, namespaces: objects to torch.save's pickle
            notes.append(f"it holds {', '.join(unsafe)} leaves: torch.load(OUT, weights_only=True) "
                         "needs their classes allowed (torch.serialization.add_safe_globals)")
        return _export_torch(state, out, backend, counter, notes)
    return opened(path, lambda ck: _SafetensorsExport(ck, out, sep, backend, progress).run())


def _infer_format(out: str, to: str | None) -> str:
    if to is None:
        to = "safetensors" if out.endswith(".safetensors") else "torch"
    if to not in FORMATS:
        raise ValueError(f"unknown export format {to!r}; valid: {', '.join(FORMATS)}")
    return to


def _adding_to(counter: ByteCounter) -> ProgressCallback:
    """A progress callback of one stage that adds its bytes to ``counter`` (of all stages)."""
    last = [0]

    def add(done: int, total: int) -> None:
        counter.add(done - last[0])
        last[0] = done

    return add


def _export_torch(state: Any, out: str, backend: str | None, counter: ByteCounter,
                  notes: list[str]) -> ExportInfo:
    """Write ``state`` as a torch.save file through the engine (any leaf the checkpoint held is
    kept, as torch.save keeps it: ``allow_pickle``)."""
    options = SaveRequest(backend=backend, progress=_adding_to(counter), allow_pickle=True,
                          format="torch")
    path = os.path.abspath(out)
    run_save(TorchFileLayout(state, path, options), path, cfg=options.cfg)
    counter.finish()
    n = sum(1 for _ in tensor_leaves(state))
    return ExportInfo(out, "torch", n, os.path.getsize(out), notes)


def _write_contiguous(fd: int, t: torch.Tensor, e: StEntry, data_start: int,
                      counter: ByteCounter) -> None:
    """Write tensor ``t`` of entry ``e`` as its contiguous bytes where the file holds them."""
    if e.nbytes:
        pwrite_all(fd, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(),
                   data_start + e.begin)
    counter.add(e.nbytes)


class _SafetensorsExport:
    def __init__(
        self,
        ck: OpenCheckpoint,
        out: str,
        sep: str,
        backend: str | None,
        progress: ProgressCallback | None,
    ):
        m = ck.manifest
        self.ck, self.path, self.m, self.out, self.sep = ck, ck.path, m, out, sep
        tree = full_tree(m)  # rank-local parts: {rank: part}
        self.entries, self.metadata = plan_safetensors(tree, m.tensors, sep)
        self.header = st_header(self.entries, self.metadata)
        self.cfg = settings.current(backend=backend)
        self.counter = ByteCounter(progress, sum(e.nbytes for e in self.entries))
        self.paths = tensor_key_paths(tree)
        # streamed storages: (storage bytes lo, hi, offset in the output) of each tensor
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}
        self.fd = -1
        self.data_start = 0

    def describe(self, storage: int) -> str:
        names = [path_str(self.paths[e.index]) for e in self.entries if e.record.storage == storage]
        return "tensor " + (
            ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") or f"storage #{storage}"
        )

    def run(self) -> ExportInfo:
        self.ck.open_files(range(len(self.m.files)))  # all held before a byte is read or written
        self.data_start = len(self.header)
        notes: list[str] = []
        with AtomicFile(self.out) as fd:
            self.fd = fd
            try:  # reserve the space up front: a full disk fails before any data moves
                os.posix_fallocate(
                    self.fd, 0, self.data_start + sum(e.nbytes for e in self.entries)
                )
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            pwrite_all(self.fd, self.header, 0)
            by_storage: dict[int, list[StEntry]] = {}
            for e in self.entries:
                by_storage.setdefault(e.record.storage, []).append(e)
            copied = []
            for storage, entries in by_storage.items():
                if all(contiguous(e.record) for e in entries):
                    ranges = self.ranges[storage] = []
                    for e in entries:
                        lo = e.record.storage_offset * DTYPES[e.record.dtype].itemsize
                        ranges.append((lo, lo + e.nbytes, self.data_start + e.begin))
                else:
                    notes.append(
                        f"{self.describe(storage)}: non-contiguous view(s) "
                        "written as contiguous copies"
                    )
                    copied.append((storage, entries))
            streamed = [e for e in self.m.extents if e.storage in self.ranges]
            read_extents(self.ck, streamed, None, self.cfg, describe=self.describe,
                         on_bytes=self._stream_piece)
            for storage, entries in copied:
                self._copy_storage(storage, entries)
        self.counter.finish()
        if self.metadata and json.loads(self.metadata[META_KEY])["tied"]:
            notes.append("tied tensors written as separate copies (safetensors cannot alias)")
        return ExportInfo(
            self.out, "safetensors", len(self.entries), os.path.getsize(self.out), notes
        )

    def _stream_piece(self, e: Extent, start: int, piece: memoryview) -> None:
        """Bytes ``[start, start + len(piece))`` of storage ``e.storage``, read and about to be
        checksummed: write them wherever the safetensors file holds them."""
        stop = start + piece.nbytes
        for lo, hi, out_off in self.ranges[e.storage]:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                pwrite_all(self.fd, piece[a - start : b - start], out_off + a - lo)
                self.counter.add(b - a)

    def _copy_storage(self, storage: int, entries: list[StEntry]) -> None:
        """Read one storage whole (bounded by that storage), then write its tensors as
        contiguous copies."""
        data = torch.empty(self.m.storages[storage].nbytes, dtype=torch.uint8)
        dests: list[torch.Tensor | None] = [None] * len(self.m.storages)
        dests[storage] = data
        extents = [e for e in self.m.extents if e.storage == storage]
        read_extents(self.ck, extents, dests, self.cfg, describe=self.describe)
        untyped = data.untyped_storage()
        for e in entries:
            _write_contiguous(self.fd, rebuild_tensor(e.record, untyped), e, self.data_start,
                              self.counter)


def _export_safetensors_from_memory(
    state: Any, out: str, sep: str, counter: ByteCounter, notes: list[str]
) -> ExportInfo:
    flat = flatten(state)
    entries, metadata = plan_safetensors(flat.tree, flat.tensors, sep)
    header = st_header(entries, metadata)
    with AtomicFile(out) as fd:
        pwrite_all(fd, header, 0)
        for e in entries:
            t = rebuild_tensor(e.record, flat.storage_objects[e.record.storage])
            _write_contiguous(fd, t, e, len(header), counter)
    counter.finish()
    return ExportInfo(out, "safetensors", len(entries), os.path.getsize(out), notes)

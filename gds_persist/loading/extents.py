"""The one read loop of every reader of checkpoints (load, verify, export, the DCP reader).

:func:`read_extents` reads extents of a checkpoint held open (:mod:`gds_persist.transfer.opened`)
into destination buffers or through hooks only, the files of each directory concurrently, with
the backend chosen for that directory. Tensor bytes are raw; nothing is unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from .. import settings
from ..backends import Backend, choose_backend, read_reason
from ..backends.posix import DirectBackend
from ..errors import BackendError
from ..format import Extent, align_up, storage_descriptions
from ..stages import stage
from ..stores import is_url
from ..stores.io import reader_for
from ..transfer.opened import OpenCheckpoint
from ..transfer.reader import Describe, Dests, FileReader, OnBytes, OnChecksum, OnError
from ..transfer.staging import io_session


def read_extents(ck: OpenCheckpoint, extents: Sequence[Extent], dests: Dests | None,
                 cfg: settings.Settings, *, verify: bool = True,
                 describe: Describe | None = None, on_checksum: OnChecksum | None = None,
                 on_bytes: OnBytes | None = None, on_error: OnError | None = None,
                 progress: Callable[[int], None] | None = None) -> list[tuple[str, str]]:
    """Read ``extents`` of the open checkpoint ``ck`` into ``dests`` (flat uint8 tensors by
    storage; None: only the hooks see the bytes), the files of each directory concurrently, with
    the backend ``cfg`` chooses for that directory. Every file needed is opened (and its size
    checked) before any byte is read; a caller that must agree on them first opens them itself
    (:meth:`OpenCheckpoint.open_files`). The checksum and byte hooks are those of
    :class:`~gds_persist.transfer.reader.FileReader`; ``describe`` defaults to the key paths of
    each storage's tensors. Returns the backend and the reason for its choice of every
    directory read."""
    by_file: dict[int, list[Extent]] = {}
    for e in extents:
        by_file.setdefault(e.file, []).append(e)
    if not by_file:
        return []
    ck.open_files(by_file)
    describe = describe or storage_descriptions(ck.manifest)
    wants_device = any(d is not None and d.is_cuda for d in dests or ())
    by_dir: dict[str, list[int]] = {}
    for index in sorted(by_file):
        by_dir.setdefault(os.path.dirname(ck.file_path(index)), []).append(index)
    chosen = []
    ck.start_layout_check()
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        for directory, indices in by_dir.items():
            load_bytes = sum(align_up(e.stored_length) for i in indices for e in by_file[i])
            with stage("choose backend"):
                backend, reason = _read_backend(cfg, directory, wants_device,
                                                ([ck.source(i) for i in indices], load_bytes))
            reader = FileReader(backend, ring, pool, cfg.io_timeout_s, verify=verify,
                                describe=describe, on_checksum=on_checksum, on_bytes=on_bytes,
                                on_error=on_error, progress=progress)
            reader.read_files([(ck.file_path(i), by_file[i], ck.source(i)) for i in indices],
                              dests)
            chosen.append((backend.name, read_reason(backend, reason)))  # what it measured
    ck.check_layout()  # a torch.save file's local headers, read meanwhile
    return chosen


def _read_backend(cfg: settings.Settings, directory: str, wants_device: bool,
                  load: tuple[list[str], int]) -> tuple[Backend, str]:
    if is_url(directory):
        return reader_for(directory)
    try:
        return choose_backend(cfg.backend, directory, wants_device, cfg.io_threads,
                              cfg.block_bytes, read_load=load)
    except BackendError:
        # The O_DIRECT probe needs the directory; the files are held open even when another
        # process removed it (the checkpoint was replaced meanwhile): read them as asked.
        if cfg.backend == "direct" and not os.path.isdir(directory):
            return DirectBackend(), "requested explicitly (the directory is gone; files held)"
        raise

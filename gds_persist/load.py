"""``load`` and ``verify``: manifest -> read plan -> read extents -> verify -> rebuild -> unflatten.

Nothing is unpickled: the manifest is JSON, validated before use; tensor bytes are raw.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from . import settings
from .backends import choose_backend
from .errors import ChecksumError, NotCommittedError
from .flatten import rebuild_tensor
from .format import (
    MANIFEST_NAME,
    Extent,
    Manifest,
    data_file_path,
    parse_manifest,
    storage_descriptions,
)
from .format.tree import decode
from .progress import ByteCounter, ProgressCallback
from .results import VerifyReport
from .transfer.commit import is_temporary
from .transfer.reader import FileReader, check_file, checksum_mismatch
from .transfer.staging import io_session

MapLocation = None | str | torch.device | dict[str, str] | Callable[..., Any]


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the committed checkpoint at ``path``."""
    path = os.fspath(path)
    if is_temporary(path):
        raise NotCommittedError(
            f"{path} is the temporary directory of an interrupted or running save, not a "
            "committed checkpoint; load the checkpoint path itself"
        )
    manifest_path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        why = "does not exist" if not os.path.exists(path) else "has no manifest.json"
        raise NotCommittedError(
            f"{path} {why}: it is not a committed gds_persist checkpoint (an interrupted save "
            "leaves only a hidden .NAME.tmp-* sibling)"
        ) from None
    return parse_manifest(raw, manifest_path)


def _target_device(saved: str, map_location: MapLocation) -> torch.device:
    if map_location is None or callable(map_location):
        target = saved if map_location is None else "cpu"  # callables see CPU storages first
    elif isinstance(map_location, dict):
        target = map_location.get(saved, saved)
    else:
        target = str(map_location)
    device = torch.device(target)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"the checkpoint holds tensors saved on {saved} but CUDA is not available; pass "
            "map_location='cpu' (or a dict/callable) to load them elsewhere"
        )
    return device


def _read_all(
    path: str,
    m: Manifest,
    dests: list[torch.Tensor] | None,
    verify: bool,
    backend: str | None,
    errors: list[ChecksumError] | None = None,
    progress: ProgressCallback | None = None,
    roots: dict[str, str] | None = None,
) -> str:
    cfg = settings.current(backend=backend)
    wants_device = dests is not None and any(d.is_cuda for d in dests)
    be, reason = choose_backend(cfg.backend, path, wants_device, cfg.io_threads, cfg.block_bytes)
    describe = storage_descriptions(m)
    counter = ByteCounter(progress, m.total_bytes)
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        on_checksum = None
        if errors is not None:  # collect every mismatch instead of raising the first

            def on_checksum(path: str, e: Extent, actual: int) -> None:
                if actual != e.crc32c:
                    errors.append(checksum_mismatch(describe(e.storage), path, e, actual))

        reader = FileReader(be, ring, pool, cfg.io_timeout_s, verify=verify, describe=describe,
                            on_checksum=on_checksum, progress=counter.hook)
        for index, f in enumerate(m.files):
            extents = [e for e in m.extents if e.file == index]
            full = data_file_path(path, m, index, roots)
            reader.read(check_file(os.path.dirname(full), f), extents, dests)
    counter.finish()
    return f"{be.name} ({reason})"


def load(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    verify: bool = True,
    backend: str | None = None,
    progress: ProgressCallback | None = None,
    process_group: Any = None,
    strategy: str | None = None,
    rank_local: Any = None,
    data_dirs: Any = None,
) -> Any:
    """Load the checkpoint at ``path``; every extent's CRC32C is checked unless ``verify=False``.

    ``map_location`` works as in ``torch.load``: ``None`` restores each tensor to the device it was
    saved from; a device or string moves everything there; a dict maps saved locations
    (``"cuda:1"``) to new ones; a callable ``f(storage, location)`` receives each storage loaded on
    the CPU and returns the storage to use (or None to keep the default placement).
    ``progress(done_bytes, total_bytes)``, if given, is called as data is read.
    Raises :class:`ChecksumError` naming the tensor, file and offset of corrupted bytes.

    Any number of processes loads a checkpoint saved by any number (``docs/DISTRIBUTED.md``).
    With ``process_group``, every rank of the group calls ``load``; replicated data is read once
    in total and shared over the group (``strategy``: ``"allgather"``, ``"broadcast"`` or
    ``"read_all"``; default the ``load_strategy`` setting), and CUDA tensors go to each rank's
    current device unless ``map_location`` says otherwise. ``rank_local`` picks whose rank-local
    parts fill their places: ``None`` (this rank's with a process group, every rank's - a dict
    by rank - without), ``"all"``, or a rank number. ``data_dirs`` maps data directories that
    moved: ``{recorded root: new root}`` or a list in the manifest's order. With a process group
    ``progress`` counts the bytes this rank reads.
    """
    path = os.fspath(path)
    if process_group is not None:
        from .parallel_load import load_parallel

        return load_parallel(
            path,
            None,
            map_location=map_location,
            verify=verify,
            backend=backend,
            process_group=process_group,
            strategy=strategy,
            rank_local=rank_local,
            data_dirs=data_dirs,
            progress=progress,
        )
    m = read_manifest(path)
    if m.version >= 2 or rank_local is not None or data_dirs is not None:
        from .parallel_load import load_parallel

        return load_parallel(
            path,
            m,
            map_location=map_location,
            verify=verify,
            backend=backend,
            strategy=strategy,
            rank_local=rank_local,
            data_dirs=data_dirs,
            progress=progress,
        )
    for f in m.files:  # a missing or short file fails before any memory is allocated for it
        check_file(path, f)
    devices = [_target_device(s.device, map_location) for s in m.storages]
    dests = [
        torch.empty(s.nbytes, dtype=torch.uint8, device=d)
        for s, d in zip(m.storages, devices, strict=True)
    ]
    _read_all(path, m, dests, verify, backend, progress=progress)
    storages = [d.untyped_storage() for d in dests]
    if callable(map_location) and not isinstance(map_location, dict):
        storages = [
            _apply_callable(map_location, s, rec.device)
            for s, rec in zip(storages, m.storages, strict=True)
        ]
    tensors = [rebuild_tensor(t, storages[t.storage]) for t in m.tensors]
    return decode(m.tree, tensors)


def _apply_callable(fn: Callable[..., Any], storage: torch.UntypedStorage, location: str) -> Any:
    result = fn(storage, location)
    if result is None:
        return storage.to(device=_target_device(location, None)) if location != "cpu" else storage
    return result.untyped() if hasattr(result, "untyped") else result


def verify(
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    progress: ProgressCallback | None = None,
    data_dirs: Any = None,
) -> VerifyReport:
    """Re-read every extent and check its CRC32C without keeping the data; reports all mismatches.

    Raises for problems that stop the check (bad manifest, missing or truncated file).
    ``data_dirs`` as for :func:`load`.
    """
    path = os.fspath(path)
    m = read_manifest(path)
    errors: list[ChecksumError] = []
    roots = None
    if data_dirs is not None:
        from .parallel_load import root_map

        roots = root_map(m, data_dirs)
    _read_all(path, m, None, True, backend, errors, progress, roots)
    return VerifyReport(
        path, len(m.files), len(m.extents), sum(e.length for e in m.extents), errors
    )

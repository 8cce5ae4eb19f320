"""``load`` and ``verify``: manifest -> read plan -> read extents -> verify -> rebuild -> decode.

One load orchestrator, which runs alone or with a process group (like DCP's ``no_dist``): any
number of processes loads a checkpoint saved by any number. Alone (or with
``load_strategy="read_all"``) a process reads every byte it returns itself. With a process group
and ``"allgather"`` / ``"broadcast"``, the replicated data is read **once in total**: the extents
are laid end to end in file order and cut into one contiguous, aligned byte range per rank
(:func:`gds_persist.schedule.plan_reads`); each rank reads its range, checksumming as it goes,
and the bytes then travel over the process group (:mod:`gds_persist.exchange`). A range may cut
an extent, so ranks exchange the CRC32C of their pieces and every rank checks each whole extent
(:func:`gds_persist.format.checksum.crc32c_combine`): a corrupted extent raises the same
:class:`ChecksumError` on every rank. Rank-local state (``docs/DISTRIBUTED.md``) is read by the
rank it belongs to only.

:func:`read_extents` is the one read loop of every reader of checkpoints (load, verify, export,
the DCP reader). Nothing is unpickled: the manifest is JSON, validated before use; tensor bytes
are raw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import settings
from .backends import choose_backend
from .distributed import Comm, make_comm
from .errors import ChecksumError, ManifestError, NotCommittedError
from .exchange import exchange
from .flatten import rebuild_tensor
from .format import (
    MANIFEST_NAME,
    Extent,
    Manifest,
    align_up,
    crc32c_combine,
    data_file_path,
    parse_manifest,
    sections_tree,
    storage_descriptions,
)
from .format.tree import decode, tensor_indices
from .progress import ByteCounter, ProgressCallback
from .results import LoadInfo, VerifyReport
from .schedule import plan_reads
from .stages import stage
from .transfer.commit import is_temporary
from .transfer.reader import (
    DIRECT_MIN,
    Describe,
    Dests,
    FileReader,
    OnBytes,
    OnChecksum,
    check_file,
    checksum_mismatch,
)
from .transfer.staging import io_session, page_aligned_tensor

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


def root_map(m: Manifest, data_dirs: Any) -> dict[str, str]:
    """``load(data_dirs=...)``: a dict {recorded root: new root}, or a list of new roots in the
    order of the manifest's data directories."""
    if data_dirs is None:
        return {}
    if isinstance(data_dirs, dict):
        return {os.path.normpath(k): os.path.abspath(v) for k, v in data_dirs.items()}
    data_dirs = list(data_dirs)
    recorded = list(dict.fromkeys(d.root for d in m.dirs))
    if len(data_dirs) != len(recorded):
        raise ValueError(f"data_dirs has {len(data_dirs)} entries but the checkpoint records "
                         f"{len(recorded)} data directories ({recorded}); pass a list of that "
                         "length or a dict {recorded: new}")
    return {old: os.path.abspath(os.fspath(new))
            for old, new in zip(recorded, data_dirs, strict=True)}


def read_extents(path: str, m: Manifest, extents: Sequence[Extent], dests: Dests | None,
                 cfg: settings.Settings, *, roots: dict[str, str] | None = None,
                 verify: bool = True, describe: Describe | None = None,
                 on_checksum: OnChecksum | None = None, on_bytes: OnBytes | None = None,
                 progress: Callable[[int], None] | None = None) -> list[tuple[str, str]]:
    """Read ``extents`` of the checkpoint at ``path`` (manifest ``m``) into ``dests`` (flat
    uint8 tensors by storage; None: only the hooks see the bytes), file by file, each file
    checked to exist and be whole first, with the backend ``cfg`` chooses for its directory.
    The checksum and byte hooks are those of :class:`~gds_persist.transfer.reader.FileReader`;
    ``describe`` defaults to the key paths of each storage's tensors. Returns the backend and
    the reason for its choice of every directory read."""
    by_file: dict[int, list[Extent]] = {}
    for e in extents:
        by_file.setdefault(e.file, []).append(e)
    if not by_file:
        return []
    describe = describe or storage_descriptions(m)
    wants_device = any(d is not None and d.is_cuda for d in dests or ())
    by_dir: dict[str, list[tuple[str, Sequence[Extent]]]] = {}
    for index in sorted(by_file):
        full = data_file_path(path, m, index, roots)
        check_file(os.path.dirname(full), m.files[index])
        by_dir.setdefault(os.path.dirname(full), []).append((full, by_file[index]))
    chosen = []
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        for directory, files in by_dir.items():  # the files of one directory concurrently
            largest = max(files, key=lambda f: os.path.getsize(f[0]))[0]
            with stage("choose backend"):
                backend, reason = choose_backend(
                    cfg.backend, directory, wants_device, cfg.io_threads, cfg.block_bytes,
                    read_sample=(largest, os.path.getsize(largest)),
                )
            chosen.append((backend.name, reason))
            reader = FileReader(backend, ring, pool, cfg.io_timeout_s, verify=verify,
                                describe=describe, on_checksum=on_checksum, on_bytes=on_bytes,
                                progress=progress)
            reader.read_files(files, dests)
    return chosen


def _target_device(saved: str, map_location: MapLocation, distributed: bool) -> torch.device:
    if distributed and map_location is None and saved.startswith("cuda"):
        return torch.device("cuda", torch.cuda.current_device())  # each rank its own GPU
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


def _destination(nbytes: int, device: torch.device) -> torch.Tensor:
    """Where a storage is read to: large host storages page-aligned, so that O_DIRECT reads go
    straight into them (no staging copy). Their pages are faulted in by the reads themselves, on
    the I/O threads (measured faster than populating them first on one thread)."""
    if device.type == "cpu" and nbytes >= DIRECT_MIN:
        return page_aligned_tensor(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _apply_callable(fn: Callable[..., Any], storage: torch.UntypedStorage, location: str) -> Any:
    result = fn(storage, location)
    if result is None:
        if location == "cpu":
            return storage
        return storage.to(device=_target_device(location, None, False))
    return result.untyped() if hasattr(result, "untyped") else result


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
    return_info: bool = False,
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

    ``return_info=True`` returns ``(state, LoadInfo)``: the backend used and why (``auto`` reads
    through the page cache where that measured faster on the filesystem), bytes, seconds.
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    cfg = settings.current(backend=backend, load_strategy=strategy)
    comm = make_comm(process_group, cfg.collective_timeout_s)
    distributed = process_group is not None
    what = f"gds_persist load of {path} (rank {comm.rank} of {comm.size})"
    holder: dict[str, Manifest] = {}

    def open_manifest() -> None:
        with stage("manifest"):
            holder["m"] = read_manifest(path)

    comm.agree("manifest", open_manifest, what)
    m = holder["m"]
    if rank_local is None:
        rank_local = comm.rank if distributed else "all"
    if rank_local != "all" and (type(rank_local) is not int or rank_local < 0):
        raise ValueError(f"rank_local={rank_local!r}: use None (own rank with a process group, "
                         "all ranks without), 'all', or a rank number")
    tree = (sections_tree(m, None if rank_local == "all" else rank_local)
            if m.sections or rank_local != "all" else m.tree)
    if distributed and m.sections and rank_local != "all":
        saved = m.writer.get("world_size")
        if saved != comm.size:
            raise ManifestError(
                f"{path} holds rank-local state of {saved} ranks, but {comm.size} ranks load it: "
                "rank-local parts cannot be reassigned automatically; load with rank_local='all' "
                "(every rank's parts, by rank) and reshard them, or load with the saved world size")

    wanted = tensor_indices(tree)
    needed = sorted({m.tensors[i].storage for i in wanted})
    replicated = sorted({m.tensors[i].storage for i in tensor_indices(m.tree)})
    roots = root_map(m, data_dirs)
    describe = storage_descriptions(m)
    dests: list[torch.Tensor | None] = [None] * len(m.storages)
    share = bool(distributed and comm.size > 1 and cfg.load_strategy != "read_all" and replicated)
    shared, by_rank = _my_pieces(m, set(replicated), comm) if share else ([], [])
    chosen: list[tuple[str, str]] = []  # (backend, reason) of every directory read
    read_bytes = [0]

    def read() -> list[list[int]]:
        wanted_storages = set(needed)
        for index in sorted({e.file for e in m.extents if e.storage in wanted_storages}):
            full = data_file_path(path, m, index, roots)  # fail before allocating memory
            check_file(os.path.dirname(full), m.files[index])
        with stage("allocate destinations"):
            for s in needed:
                rec = m.storages[s]
                device = _target_device(rec.device, map_location, distributed)
                dests[s] = _destination(rec.nbytes, device)
        if not share:
            mine = [e for e in m.extents if e.storage in wanted_storages]
            read_bytes[0] = sum(align_up(e.length) for e in mine)
            counter = ByteCounter(progress, read_bytes[0])
            chosen.extend(read_extents(path, m, mine, dests, cfg, roots=roots, verify=verify,
                                       describe=describe, progress=counter.hook))
            counter.finish()
            return []
        own_storages = set(needed) - set(replicated)
        own = [e for e in m.extents if e.storage in own_storages]
        sub = by_rank[comm.rank]
        read_bytes[0] = sum(align_up(e.length) for e in sub + own)
        counter = ByteCounter(progress, read_bytes[0])
        piece_crcs: dict[tuple[int, int], int] = {}

        def record(_: str, e: Extent, actual: int) -> None:  # pieces: checked once combined
            piece_crcs[(e.file, e.offset)] = actual

        chosen.extend(read_extents(path, m, sub, dests, cfg, roots=roots, verify=verify,
                                   describe=describe, on_checksum=record if verify else None,
                                   progress=counter.hook))
        chosen.extend(read_extents(path, m, own, dests, cfg, roots=roots, verify=verify,
                                   describe=describe, progress=counter.hook))
        counter.finish()
        return [[e.file, e.offset, e.length, piece_crcs[(e.file, e.offset)]]
                for e in sub] if verify else []

    crcs = comm.agree("read", read, what)
    if share:
        if verify:
            _check_combined(path, m, shared, crcs, describe, roots)
        pieces = [[(e.storage, e.start, e.length) for e in sub] for sub in by_rank]
        exchange(comm, cfg.load_strategy, pieces, dests, cfg.staging_bytes)

    storages = [d.untyped_storage() if d is not None else None for d in dests]
    if callable(map_location) and not isinstance(map_location, dict):
        storages = [_apply_callable(map_location, s, rec.device) if s is not None else None
                    for s, rec in zip(storages, m.storages, strict=True)]
    with stage("rebuild tensors"):
        tensors: list[Any] = [None] * len(m.tensors)  # only those in ``tree`` are needed
        for i in wanted:
            t = m.tensors[i]
            tensors[i] = rebuild_tensor(t, storages[t.storage])  # type: ignore[arg-type]
        state = decode(tree, tensors)
    if not return_info:
        return state
    unique = list(dict.fromkeys(chosen))
    payload = sum(m.storages[s].nbytes for s in needed)
    return state, LoadInfo(path, ",".join(dict.fromkeys(b for b, _ in unique)) or "none",
                           "; ".join(r for _, r in unique) or "nothing to read", read_bytes[0],
                           payload, time.perf_counter() - t0)


def _my_pieces(m: Manifest, replicated: set[int],
               comm: Comm) -> tuple[list[Extent], list[list[Extent]]]:
    """The replicated extents in file order, and each rank's aligned pieces of them."""
    shared = sorted((e for e in m.extents if e.storage in replicated),
                    key=lambda e: (e.file, e.offset))
    parts = plan_reads([e.length for e in shared], comm.size)
    by_rank = []
    for part in parts:
        sub = []
        for k, start, length in part:
            e = shared[k]
            sub.append(Extent(e.storage, e.start + start, length, e.file, e.offset + start, 0))
        by_rank.append(sub)
    return shared, by_rank


def _check_combined(path: str, m: Manifest, shared: list[Extent], crcs: list[list[list[int]]],
                    describe: Describe, roots: dict[str, str]) -> None:
    """Every rank: join the CRCs of the pieces all ranks read into each whole extent's CRC and
    compare it with the recorded one."""
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for rank_crcs in crcs:
        for file, offset, length, crc in rank_crcs:
            pieces.setdefault(file, []).append((offset, length, crc))
    for lst in pieces.values():
        lst.sort()
    cursor: dict[int, int] = {f: 0 for f in pieces}
    for e in shared:
        lst = pieces.get(e.file, [])
        k = cursor.get(e.file, 0)
        crc, end = 0, e.offset
        while k < len(lst) and lst[k][0] < e.offset + e.length:
            offset, length, piece_crc = lst[k]
            if offset != end:
                break
            crc = crc32c_combine(crc, piece_crc, length) if end > e.offset else piece_crc
            end += length
            k += 1
        cursor[e.file] = k
        if end != e.offset + e.length or crc != e.crc32c:
            raise checksum_mismatch(describe(e.storage), data_file_path(path, m, e.file, roots),
                                    e, crc)


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
    cfg = settings.current(backend=backend)
    roots = root_map(m, data_dirs)
    for index, f in enumerate(m.files):  # every file, also one that holds no extent
        check_file(os.path.dirname(data_file_path(path, m, index, roots)), f)
    describe = storage_descriptions(m)
    errors: list[ChecksumError] = []

    def collect(file: str, e: Extent, actual: int) -> None:
        if actual != e.crc32c:
            errors.append(checksum_mismatch(describe(e.storage), file, e, actual))

    counter = ByteCounter(progress, m.total_bytes)
    read_extents(path, m, m.extents, None, cfg, roots=roots, describe=describe,
                 on_checksum=collect, progress=counter.hook)
    counter.finish()
    return VerifyReport(
        path, len(m.files), len(m.extents), sum(e.length for e in m.extents), errors
    )

"""Load of any checkpoint by any number of processes, with or without a process group.

Without a process group (or with ``load_strategy="read_all"``) a process reads every byte it
returns itself. With a process group and ``"allgather"`` / ``"broadcast"``, the replicated data is
read **once in total**: the extents are laid end to end in file order and cut into one contiguous,
aligned byte range per rank (:func:`gds_persist.schedule.plan_reads`); each rank reads its range,
checksumming as it goes, and the bytes then travel over the process group in bounded buckets
(``staging_bytes``). A range may cut an extent, so ranks exchange the CRC32C of their pieces and
every rank checks each whole extent (:func:`gds_persist.checksum.crc32c_combine`): a corrupted
extent raises the same :class:`ChecksumError` on every rank.

Rank-local state (``docs/DISTRIBUTED.md``) is read by the rank it belongs to only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import settings
from .backends import choose_backend
from .distributed import Comm, make_comm
from .errors import ManifestError
from .flatten import rebuild_tensor
from .format import (
    Extent,
    Manifest,
    align_up,
    crc32c_combine,
    data_file_path,
    sections_tree,
    storage_descriptions,
)
from .format.tree import decode, tensor_indices
from .progress import ByteCounter, ProgressCallback
from .schedule import plan_reads
from .transfer.reader import FileReader, check_file, checksum_mismatch
from .transfer.staging import io_session

Piece = tuple[int, int, int]  # (storage, start, length)


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


def read_extents(path: str, m: Manifest, roots: dict[str, str], extents: Sequence[Extent],
                 dests: Sequence[torch.Tensor | None], verify: bool, cfg: settings.Settings,
                 describe: Callable[[int], str],
                 sink: dict[tuple[int, int], int] | None = None,
                 hook: Callable[[int], None] | None = None) -> None:
    """Read ``extents`` into ``dests`` (per storage). With ``sink``, CRCs are recorded there
    (keyed by file, offset) instead of compared."""
    by_file: dict[int, list[Extent]] = {}
    for e in extents:
        by_file.setdefault(e.file, []).append(e)
    if not by_file:
        return
    wants_device = any(d is not None and d.is_cuda for d in dests)
    chosen: dict[str, Any] = {}
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        for index in sorted(by_file):
            full = data_file_path(path, m, index, roots)
            directory = os.path.dirname(full)
            check_file(directory, m.files[index])
            if directory not in chosen:
                chosen[directory] = choose_backend(cfg.backend, directory, wants_device,
                                                   cfg.io_threads, cfg.block_bytes)[0]
            on_checksum = None
            if sink is not None:  # pieces of extents: record, check once combined

                def on_checksum(path: str, e: Extent, actual: int) -> None:
                    sink[(e.file, e.offset)] = actual  # type: ignore[index]

            reader = FileReader(chosen[directory], ring, pool, cfg.io_timeout_s, verify=verify,
                                describe=describe, on_checksum=on_checksum, progress=hook)
            reader.read(full, by_file[index], dests)  # type: ignore[arg-type]


def _storage_device(saved: str, map_location: Any, distributed: bool) -> torch.device:
    from .load import _target_device

    if distributed and map_location is None and saved.startswith("cuda"):
        return torch.device("cuda", torch.cuda.current_device())  # each rank its own GPU
    return _target_device(saved, map_location)


def load_parallel(path: str, m: Manifest | None, *, map_location: Any = None, verify: bool = True,
                  backend: str | None = None, process_group: Any = None,
                  strategy: str | None = None, rank_local: Any = None,
                  data_dirs: Any = None, progress: ProgressCallback | None = None) -> Any:
    """See :func:`gds_persist.load` (the data-parallel arguments)."""
    from .load import _apply_callable, read_manifest

    cfg = settings.current(backend=backend, load_strategy=strategy)
    comm = make_comm(process_group, cfg.collective_timeout_s)
    distributed = process_group is not None
    what = f"gds_persist load of {path} (rank {comm.rank} of {comm.size})"
    holder: dict[str, Any] = {}

    def open_manifest() -> None:
        holder["m"] = m if m is not None else read_manifest(path)

    comm.agree("manifest", open_manifest, what)
    manifest: Manifest = holder["m"]
    if rank_local is None:
        rank_local = comm.rank if distributed else "all"
    if rank_local != "all" and (type(rank_local) is not int or rank_local < 0):
        raise ValueError(f"rank_local={rank_local!r}: use None (own rank with a process group, "
                         "all ranks without), 'all', or a rank number")
    tree = sections_tree(manifest, None if rank_local == "all" else rank_local) \
        if manifest.sections or rank_local != "all" else manifest.tree
    if distributed and manifest.sections and rank_local != "all":
        saved = manifest.writer.get("world_size")
        if saved != comm.size:
            raise ManifestError(
                f"{path} holds rank-local state of {saved} ranks, but {comm.size} ranks load it: "
                "rank-local parts cannot be reassigned automatically; load with rank_local='all' "
                "(every rank's parts, by rank) and reshard them, or load with the saved world size")

    wanted = tensor_indices(tree)
    needed = sorted({manifest.tensors[i].storage for i in wanted})
    replicated = sorted({manifest.tensors[i].storage for i in tensor_indices(manifest.tree)})
    roots = root_map(manifest, data_dirs)
    describe = storage_descriptions(manifest)
    dests: list[torch.Tensor | None] = [None] * len(manifest.storages)
    share = bool(distributed and comm.size > 1 and cfg.load_strategy != "read_all" and replicated)
    shared, by_rank = _my_pieces(manifest, set(replicated), comm) if share else ([], [])

    def read() -> list[list[int]]:
        wanted_storages = set(needed)
        for index in sorted({e.file for e in manifest.extents if e.storage in wanted_storages}):
            full = data_file_path(path, manifest, index, roots)  # fail before allocating memory
            check_file(os.path.dirname(full), manifest.files[index])
        for s in needed:
            rec = manifest.storages[s]
            device = _storage_device(rec.device, map_location, distributed)
            dests[s] = torch.empty(rec.nbytes, dtype=torch.uint8, device=device)
        if not share:
            mine = [e for e in manifest.extents if e.storage in wanted_storages]
            counter = ByteCounter(progress, sum(align_up(e.length) for e in mine))
            read_extents(path, manifest, roots, mine, dests, verify, cfg, describe,
                         hook=counter.hook)
            counter.finish()
            return []
        own_storages = set(needed) - set(replicated)
        own = [e for e in manifest.extents if e.storage in own_storages]
        sub = by_rank[comm.rank]
        counter = ByteCounter(progress, sum(align_up(e.length) for e in sub + own))
        sink: dict[tuple[int, int], int] | None = {} if verify else None
        read_extents(path, manifest, roots, sub, dests, verify, cfg, describe, sink, counter.hook)
        read_extents(path, manifest, roots, own, dests, verify, cfg, describe, hook=counter.hook)
        counter.finish()
        return [[e.file, e.offset, e.length, sink[(e.file, e.offset)]]
                for e in sub] if sink is not None else []

    crcs = comm.agree("read", read, what)
    if share:
        if verify:
            _check_combined(path, manifest, shared, crcs, describe, roots)
        pieces = [[(e.storage, e.start, e.length) for e in sub] for sub in by_rank]
        _exchange(comm, cfg.load_strategy, pieces, dests, cfg.staging_bytes)

    storages = [d.untyped_storage() if d is not None else None for d in dests]
    if callable(map_location) and not isinstance(map_location, dict):
        storages = [_apply_callable(map_location, s, rec.device) if s is not None else None
                    for s, rec in zip(storages, manifest.storages, strict=True)]
    tensors: list[Any] = [None] * len(manifest.tensors)  # only those in ``tree`` are needed
    for i in wanted:
        t = manifest.tensors[i]
        tensors[i] = rebuild_tensor(t, storages[t.storage])  # type: ignore[arg-type]
    return decode(tree, tensors)


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
                    describe: Callable[[int], str], roots: dict[str, str]) -> None:
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
            where = data_file_path(path, m, e.file, roots)
            raise checksum_mismatch(describe(e.storage), where, e, crc)


def _buckets(pieces: Sequence[Piece], width: int) -> list[list[tuple[int, int, int, int]]]:
    """Pack pieces into buckets of at most ``width`` bytes: (storage, start, length, offset)."""
    out: list[list[tuple[int, int, int, int]]] = []
    current: list[tuple[int, int, int, int]] = []
    used = 0
    for storage, start, length in pieces:
        while length:
            n = min(length, width - used)
            current.append((storage, start, n, used))
            used += n
            start += n
            length -= n
            if used == width:
                out.append(current)
                current, used = [], 0
    if current:
        out.append(current)
    return out


def _pack(buf: torch.Tensor, bucket: Sequence[tuple[int, int, int, int]],
          dests: Sequence[torch.Tensor | None]) -> None:
    for storage, start, n, at in bucket:
        buf[at : at + n].copy_(dests[storage][start : start + n])  # type: ignore[index]


def _unpack(buf: torch.Tensor, bucket: Sequence[tuple[int, int, int, int]],
            dests: Sequence[torch.Tensor | None]) -> None:
    for storage, start, n, at in bucket:
        dests[storage][start : start + n].copy_(buf[at : at + n])  # type: ignore[index]


def _exchange(comm: Comm, strategy: str, pieces: list[list[Piece]],
              dests: Sequence[torch.Tensor | None], budget: int) -> None:
    """Every rank holds ``pieces[rank]``; afterwards every rank holds all of them."""
    if strategy == "broadcast":
        _exchange_broadcast(comm, pieces, dests, max(budget, 1 << 20))
        return
    width = max(budget // comm.size // 4096 * 4096, 1 << 16)  # per rank per round
    buckets = [_buckets(p, width) for p in pieces]
    rounds = max(len(b) for b in buckets)
    inp = torch.zeros(width, dtype=torch.uint8, device=comm.device)
    out = torch.empty(width * comm.size, dtype=torch.uint8, device=comm.device)
    for k in range(rounds):
        if k < len(buckets[comm.rank]):
            _pack(inp, buckets[comm.rank][k], dests)
        comm.all_gather_tensor(out, inp, "exchange")
        for r in range(comm.size):
            if r != comm.rank and k < len(buckets[r]):
                _unpack(out[r * width : (r + 1) * width], buckets[r][k], dests)


DIRECT_MIN = 1 << 20  # pieces at least this large are broadcast in place, without packing


def _broadcast_packed(comm: Comm, src: int, small: list[Piece], buf: torch.Tensor,
                      dests: Sequence[torch.Tensor | None]) -> None:
    for bucket in _buckets(small, buf.numel()):
        n = bucket[-1][3] + bucket[-1][2]
        if comm.rank == src:
            _pack(buf[:n], bucket, dests)
        comm.broadcast_tensor(buf[:n], src, "exchange")
        if comm.rank != src:
            _unpack(buf[:n], bucket, dests)
    small.clear()


def _exchange_broadcast(comm: Comm, pieces: list[list[Piece]],
                        dests: Sequence[torch.Tensor | None], width: int) -> None:
    """Each rank broadcasts its pieces in turn: large ones straight from/into the destination
    storages (no copies), small ones packed into buckets of at most ``width`` bytes."""
    buf = torch.empty(width, dtype=torch.uint8, device=comm.device)
    for src in range(comm.size):
        small: list[Piece] = []
        small_bytes = 0
        for storage, start, length in pieces[src]:
            if length < DIRECT_MIN:  # decided by sizes only: the same on every rank
                small.append((storage, start, length))
                small_bytes += length
                if small_bytes >= width:
                    _broadcast_packed(comm, src, small, buf, dests)
                    small_bytes = 0
                continue
            _broadcast_packed(comm, src, small, buf, dests)
            small_bytes = 0
            dest = dests[storage]
            assert dest is not None
            for lo in range(start, start + length, width):
                piece = dest[lo : min(lo + width, start + length)]
                if piece.device == comm.device:
                    comm.broadcast_tensor(piece, src, "exchange")
                    continue
                staged = buf[: piece.numel()]  # e.g. CUDA destinations over gloo
                if comm.rank == src:
                    staged.copy_(piece)
                comm.broadcast_tensor(staged, src, "exchange")
                if comm.rank != src:
                    piece.copy_(staged)
        _broadcast_packed(comm, src, small, buf, dests)

"""``load`` and ``verify``: manifest -> read plan -> read extents -> verify -> rebuild -> decode.

One load orchestrator, which runs alone or with a process group (like DCP's ``no_dist``): any
number of processes loads a checkpoint saved by any number. Alone (or with
``load_strategy="read_all"``) a process reads every byte it returns itself. With a process group
and ``"allgather"`` / ``"broadcast"``, the replicated data is read **once in total**: the extents
are laid end to end in file order and cut into one contiguous, aligned byte range per rank
(:func:`gds_persist.parallel.schedule.plan_reads`); each rank reads its range, checksumming as it goes,
and the bytes then travel over the process group (:mod:`gds_persist.parallel.exchange`). A range may cut
an extent, so ranks exchange the CRC32C of their pieces and every rank checks each whole extent
(:func:`gds_persist.format.checksum.crc32c_combine`): a corrupted extent raises the same
:class:`ChecksumError` on every rank. Rank-local state (``docs/DISTRIBUTED.md``) is read by the
rank it belongs to only.

:func:`read_extents` is the one read loop of every reader of checkpoints (load, verify, export,
the DCP reader). Nothing is unpickled: the manifest is JSON, validated before use; tensor bytes
are raw.

Other processes may replace or remove the checkpoint during a load: every reader holds it open
first - directory, manifest, and every data file it reads, before reading any byte of them
(:mod:`gds_persist.transfer.opened`). A load thus returns one complete checkpoint, verified: the
one at the path when it began, or (replaced before its files were all open; the ranks of a
process group agree on one) the newer one. It never reports a healthy checkpoint as corrupt or
truncated; :class:`CheckpointReplacedError` only if the path was replaced ``OPEN_ATTEMPTS`` times
in a row while being opened, or removed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .. import settings
from ..backends import Backend, choose_backend
from ..backends.posix import DirectBackend
from ..errors import (
    BackendError,
    CheckpointReplacedError,
    ChecksumError,
    ManifestError,
    NotCommittedError,
)
from ..format import (
    Extent,
    Manifest,
    align_up,
    crc32c_combine,
    sections_tree,
    storage_descriptions,
)
from ..format.tree import decode, tensor_indices
from ..parallel.distributed import Comm, make_comm
from ..parallel.exchange import exchange
from ..parallel.schedule import plan_reads
from ..progress import ByteCounter, ProgressCallback
from ..results import LoadInfo, VerifyReport
from ..stages import stage
from ..transfer.opened import (
    OPEN_ATTEMPTS,
    OpenCheckpoint,
    open_checkpoint,
    opened,
    pause,
    replaced_message,
)
from ..transfer.reader import (
    Describe,
    Dests,
    FileReader,
    OnBytes,
    OnChecksum,
    OnError,
    checksum_mismatch,
)
from ..transfer.staging import io_session
from .destinations import Destinations, Matched, match, plan_destinations

log = logging.getLogger("gds_persist")
MapLocation = None | str | torch.device | dict[str, str] | Callable[..., Any]


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the committed checkpoint at ``path``."""
    return opened(path, lambda ck: ck.manifest)


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
    with io_session(
        cfg.ring_buffers, cfg.block_bytes, cfg.io_timeout_s, cfg.io_threads
    ) as (ring, pool):
        for directory, indices in by_dir.items():
            largest = max(indices, key=lambda i: ck.manifest.files[i].size)
            with stage("choose backend"):
                backend, reason = _read_backend(
                    cfg, directory, wants_device,
                    (ck.source(largest), ck.manifest.files[largest].size,
                     ck.manifest.files[largest].name))
            chosen.append((backend.name, reason))
            reader = FileReader(backend, ring, pool, cfg.io_timeout_s, verify=verify,
                                describe=describe, on_checksum=on_checksum, on_bytes=on_bytes,
                                on_error=on_error, progress=progress)
            reader.read_files([(ck.file_path(i), by_file[i], ck.source(i)) for i in indices],
                              dests)
    return chosen


def _read_backend(cfg: settings.Settings, directory: str, wants_device: bool,
                  sample: tuple[str, int, str]) -> tuple[Backend, str]:
    try:
        return choose_backend(cfg.backend, directory, wants_device, cfg.io_threads,
                              cfg.block_bytes, read_sample=sample)
    except BackendError:
        # The O_DIRECT probe needs the directory; the files are held open even when another
        # process removed it (the checkpoint was replaced meanwhile): read them as asked.
        if cfg.backend == "direct" and not os.path.isdir(directory):
            return DirectBackend(), "requested explicitly (the directory is gone; files held)"
        raise


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
    into: Any = None,
    strict: bool = True,
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

    ``into``: restore in place. A state shaped as ``save`` takes it (e.g. ``{"model":
    model.state_dict(), "optim": optimizer.state_dict()}``) whose tensors are filled with the
    checkpoint's bytes, read straight into them (host or CUDA memory; extra memory bounded by
    ``staging_bytes``, see :mod:`gds_persist.loading.destinations`). Returns the checkpoint's state with those
    same tensor objects in place; its other leaves come from the checkpoint, and checkpoint
    tensors with no destination are loaded fresh. Key paths, shapes and dtypes are checked
    before any byte is read, :class:`StateMismatchError` listing every mismatch; ``strict``
    (default) also refuses missing and unexpected keys, ``strict=False`` fills what matches,
    logs the rest and reports it in ``LoadInfo.missing_keys`` / ``unexpected_keys``.
    ``map_location`` applies only to tensors loaded fresh. A restore that fails part-way raises
    saying which tensors of ``into`` may hold partial data (``partial_keys`` of the error).
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    cfg = settings.current(backend=backend, load_strategy=strategy)
    comm = make_comm(process_group, cfg.collective_timeout_s)
    distributed = process_group is not None
    what = f"gds_persist load of {path} (rank {comm.rank} of {comm.size})"
    if rank_local is None:
        rank_local = comm.rank if distributed else "all"
    if rank_local != "all" and (type(rank_local) is not int or rank_local < 0):
        raise ValueError(f"rank_local={rank_local!r}: use None (own rank with a process group, "
                         "all ranks without), 'all', or a rank number")

    def plan_for(ck: OpenCheckpoint) -> _LoadPlan:
        ck.set_data_dirs(data_dirs)
        return _plan_load(ck.manifest, path, rank_local, comm, cfg, distributed)

    with stage("open (manifest, data files)"):
        ck, lp = _open_agreed(path, comm, what, plan_for)
    with ck:
        state, info = _load_held(ck, lp, comm, cfg, what, map_location, verify, progress,
                                 distributed, into, strict)
    info.seconds = time.perf_counter() - t0
    return (state, info) if return_info else state


@dataclass
class _LoadPlan:
    """What one rank of a load reads, derived from the manifest alone."""

    tree: Any
    wanted: list[int]  # tensors in ``tree``
    needed: list[int]  # their storages
    replicated: list[int]  # storages of the main tree (shared by ranks when ``share``)
    share: bool
    shared: list[Extent]
    by_rank: list[list[Extent]]
    mine: list[Extent]  # without sharing: every extent of the needed storages
    files: set[int]  # the data files this rank reads


def _plan_load(m: Manifest, path: str, rank_local: Any, comm: Comm, cfg: settings.Settings,
               distributed: bool) -> _LoadPlan:
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
    share = bool(distributed and comm.size > 1 and cfg.load_strategy != "read_all" and replicated)
    shared, by_rank = _my_pieces(m, set(replicated), comm) if share else ([], [])
    mine = [] if share else [e for e in m.extents if e.storage in set(needed)]
    reads = mine + (by_rank[comm.rank] + _own_reads(m, needed, replicated) if share else [])
    return _LoadPlan(tree, wanted, needed, replicated, share, shared, by_rank, mine,
                     {e.file for e in reads})


def _own_reads(m: Manifest, needed: list[int], replicated: list[int]) -> list[Extent]:
    """In a shared load, what a rank reads whole itself: its rank-local storages, and the
    encoded extents of replicated ones (an encoded extent cannot be cut between ranks)."""
    own_storages = set(needed) - set(replicated)
    shared = set(replicated)
    return [e for e in m.extents
            if e.storage in own_storages or (e.encoded and e.storage in shared)]


def _open_agreed(path: str, comm: Comm, what: str,
                 plan_for: Callable[[OpenCheckpoint], _LoadPlan]
                 ) -> tuple[OpenCheckpoint, _LoadPlan]:
    """Every rank opens the checkpoint and the data files it will read; they go on only once
    all hold the same checkpoint (same manifest) with every file open, else all open it again.

    Errors the manifest alone decides (a bad ``data_dirs``, rank-local parts that do not fit)
    are raised once the ranks agree, by every rank they concern, as they are.
    """
    for attempt in range(OPEN_ATTEMPTS):
        held: dict[str, Any] = {}
        try:
            statuses = comm.agree("manifest", partial(_open_step, path, attempt, held, plan_for),
                                  what)
        except BaseException:
            if "ck" in held:
                held["ck"].close()
            raise
        gone = [st["gone"] for st in statuses if st["gone"]]
        replaced = [st["replaced"] for st in statuses if st["replaced"]]
        if not (gone or replaced) and len({st["digest"] for st in statuses}) == 1:
            if "error" in held:
                held["ck"].close()
                raise held["error"]
            return held["ck"], held["plan"]
        if "ck" in held:
            held["ck"].close()
        if gone:
            raise CheckpointReplacedError(gone[0])
        if attempt == OPEN_ATTEMPTS - 1:
            raise CheckpointReplacedError(
                replaced[0] if replaced else
                f"{path} was replaced while the ranks were opening it ({OPEN_ATTEMPTS} times in "
                "a row they found different checkpoints there); load it again")
        pause(attempt)
    raise AssertionError("unreachable")


def _open_step(path: str, attempt: int, held: dict[str, Any],
               plan_for: Callable[[OpenCheckpoint], _LoadPlan]) -> dict[str, str]:
    """One rank's part of an attempt of :func:`_open_agreed`; what it holds goes to ``held``."""
    try:
        ck = held["ck"] = open_checkpoint(path)
    except NotCommittedError:
        if not attempt:
            raise
        return {"digest": "", "replaced": "", "gone": replaced_message(path, "removed")}
    try:
        held["plan"] = plan_for(ck)
    except (ManifestError, ValueError) as e:
        held["error"] = e
        return {"digest": ck.digest, "replaced": "", "gone": ""}
    try:
        ck.open_files(held["plan"].files)
    except CheckpointReplacedError as e:
        return {"digest": ck.digest, "replaced": str(e), "gone": ""}
    return {"digest": ck.digest, "replaced": "", "gone": ""}


def _load_held(ck: OpenCheckpoint, lp: _LoadPlan, comm: Comm, cfg: settings.Settings,
               what: str, map_location: MapLocation, verify: bool,
               progress: ProgressCallback | None, distributed: bool, into: Any,
               strict: bool) -> tuple[Any, LoadInfo]:
    """The rest of :func:`load`, on a checkpoint held open with this rank's files."""
    m = ck.manifest
    describe_storage = storage_descriptions(m)
    chosen: list[tuple[str, str]] = []  # (backend, reason) of every directory read
    held: dict[str, Any] = {}

    def allocate(s: int) -> torch.Tensor:
        rec = m.storages[s]
        device = _target_device(rec.device, map_location, distributed)
        return torch.empty(rec.nbytes, dtype=torch.uint8, device=device)

    def read() -> list[list[int]]:
        with stage("allocate destinations"):
            found = held["found"] = (None if into is None else
                                     match(m, lp.tree, into, strict, what))
            held["dest"] = plan_destinations(m, lp.wanted, lp.needed, found, allocate)
        reading = _PieceReader(ck, held["dest"], cfg, verify, describe_storage, chosen)
        sub = lp.by_rank[comm.rank] if lp.share else []
        own = _own_reads(m, lp.needed, lp.replicated) if lp.share else lp.mine
        held["read_bytes"] = sum(align_up(e.stored_length) for e in sub + own)
        counter = ByteCounter(progress, held["read_bytes"])
        crcs = reading.read(sub, counter.hook, shared=True) if sub else []
        reading.read(own, counter.hook)  # checked here, extent by extent
        counter.finish()
        return crcs

    try:
        crcs = comm.agree("read", read, what)
        dest: Destinations = held["dest"]
        if lp.share:
            if verify:
                _check_combined(ck, lp.shared, crcs, describe_storage)
            pieces = [[(p.storage, p.start, p.length) for p in dest.pieces(sub, True)[0]]
                      for sub in lp.by_rank]
            exchange(comm, cfg.load_strategy, pieces, dest.buffers, cfg.staging_bytes)
        dest.finish()
    except Exception as e:
        told = _partial(e, held["found"]) if held.get("found") and "dest" in held else e
        if told is e:
            raise  # a plain load, nothing of into= touched yet, or the note was added to e
        raise told from e
    found = held["found"]
    with stage("rebuild tensors"):
        state = decode(lp.tree, dest.returned(m, lp.wanted, _fresh_storages(m, lp, dest,
                                                                             map_location)))
    unique = list(dict.fromkeys(chosen))
    payload = sum(m.storages[s].nbytes for s in lp.needed)
    info = LoadInfo(ck.path, ",".join(dict.fromkeys(b for b, _ in unique)) or "none",
                    "; ".join(r for _, r in unique) or "nothing to read", held["read_bytes"],
                    payload, 0.0)
    if found is not None:
        info.missing_keys, info.unexpected_keys = found.missing_keys, found.unexpected_keys
        info.in_place_bytes = dest.in_place_bytes()
        if found.missing_keys or found.unexpected_keys:
            log.warning("load(into=) of %s (strict=False): %d missing key(s) %s, %d unexpected "
                        "(loaded fresh) %s", ck.path, len(found.missing_keys),
                        found.missing_keys[:8], len(found.unexpected_keys),
                        found.unexpected_keys[:8])
    return state, info


def _fresh_storages(m: Manifest, lp: _LoadPlan, dest: Destinations,
                    map_location: MapLocation) -> list[torch.UntypedStorage | None]:
    """By checkpoint storage: the fresh buffers whose tensors are returned (after a callable
    ``map_location`` had its say)."""
    storages: list[Any] = [None] * len(m.storages)
    returned = {m.tensors[i].storage for i in lp.wanted if i not in dest.matched}
    for s in returned:
        storage = dest.buffers[dest.fresh[s]].untyped_storage()
        if callable(map_location) and not isinstance(map_location, dict):
            storage = _apply_callable(map_location, storage, m.storages[s].device)
        storages[s] = storage
    return storages


@dataclass
class _PieceReader:
    """Reads extents into a load's :class:`Destinations`, cut into the pieces that land in
    each destination, and checks each extent's CRC32C once its pieces are joined."""

    ck: OpenCheckpoint
    dest: Destinations
    cfg: settings.Settings
    verify: bool
    describe_storage: Describe
    chosen: list[tuple[str, str]]

    def describe(self, buffer: int) -> str:
        return self.describe_storage(self.dest.storage_of[buffer])

    def read(self, extents: list[Extent], progress: Callable[[int], None] | None, *,
             shared: bool = False) -> list[list[int]]:
        """Read ``extents``; ``shared``: they are this rank's pieces of a shared load, cut alike
        on every rank, and the CRC32C of every piece is returned to be joined with the other
        ranks' (else each extent is checked here)."""
        pieces, cut = self.dest.pieces(extents, uniform=shared)
        crcs: list[list[int]] = []

        def on_checksum(path: str, e: Extent, actual: int) -> None:
            if shared or (e.file, e.offset) in cut:
                crcs.append([e.file, e.offset, e.length, actual])
            elif actual != e.crc32c:
                raise checksum_mismatch(self.describe(e.storage), path, e, actual)

        self.chosen.extend(read_extents(
            self.ck, pieces, self.dest.buffers, self.cfg, verify=self.verify,
            describe=self.describe, on_checksum=on_checksum if self.verify else None,
            progress=progress))
        if self.verify and cut and not shared:
            _check_combined(self.ck, [e for e in extents if (e.file, e.offset) in cut], [crcs],
                            self.describe_storage)
        return crcs


def _partial(e: Exception, found: Matched) -> Exception:
    """``e`` of a restore in place, saying which destinations may hold partial data."""
    names = [found.paths[i] for i in found.dests]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    message = (f"{e}; load(into=) stopped part-way: {len(names)} tensor(s) of into= may hold "
               f"partial data ({shown}); restore them again before using them")
    try:
        new = type(e)(message)
        new.__dict__.update(e.__dict__)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(message)
        new = e
    new.partial_keys = names  # type: ignore[attr-defined]
    return new


def _my_pieces(m: Manifest, replicated: set[int],
               comm: Comm) -> tuple[list[Extent], list[list[Extent]]]:
    """The replicated extents in file order, and each rank's aligned pieces of them."""
    shared = sorted((e for e in m.extents if e.storage in replicated and not e.encoded),
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


def _check_combined(ck: OpenCheckpoint, shared: list[Extent], crcs: list[list[list[int]]],
                    describe: Describe) -> None:
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
            raise checksum_mismatch(describe(e.storage), ck.file_path(e.file), e, crc)


def verify(
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    progress: ProgressCallback | None = None,
    data_dirs: Any = None,
) -> VerifyReport:
    """Re-read every extent and check its CRC32C without keeping the data; reports all mismatches.

    Extents of an incremental checkpoint that live in its base checkpoints are checked like its
    own (the bases are identified first); encoded extents are checked twice: the stored bytes
    against ``stored_crc32c``, then the decoded bytes against ``crc32c``.

    Raises for problems that stop the check (bad manifest, missing or truncated file).
    ``data_dirs`` as for :func:`load`.
    """
    path = os.fspath(path)
    cfg = settings.current(backend=backend)

    def check(ck: OpenCheckpoint) -> VerifyReport:
        m = ck.manifest
        ck.open_files(range(len(m.files)))  # every file, also one that holds no extent
        describe = storage_descriptions(m)
        errors: list[ChecksumError] = []

        def collect(file: str, e: Extent, actual: int) -> None:
            if actual != e.crc32c:
                errors.append(checksum_mismatch(describe(e.storage), file, e, actual))

        counter = ByteCounter(progress, sum(align_up(e.stored_length) for e in m.extents))
        read_extents(ck, m.extents, None, cfg, describe=describe, on_checksum=collect,
                     on_error=errors.append, progress=counter.hook)
        counter.finish()
        return VerifyReport(
            path, len(m.files), len(m.extents), sum(e.length for e in m.extents), errors,
            referenced_bytes=m.referenced_bytes,
            encoded_extents=sum(1 for e in m.extents if e.encoded),
        )

    return opened(path, check, data_dirs)

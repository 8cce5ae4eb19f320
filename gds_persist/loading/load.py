"""``load``: manifest -> read plan -> read extents -> verify -> rebuild -> decode.

One load orchestrator, which runs alone or with a process group (like DCP's ``no_dist``): any
number of processes loads a checkpoint saved by any number. Alone (or with
``load_strategy="read_all"``) a process reads every byte it returns itself. With a process group
and ``"allgather"`` / ``"broadcast"``, the replicated data is read **once in total**, each rank
its aligned piece, and every rank checks each whole extent's CRC32C
(:mod:`gds_persist.parallel.shared_reads`): a corrupted extent raises the same
:class:`ChecksumError` on every rank. Rank-local state (``docs/DISTRIBUTED.md``) is read by the
rank it belongs to only.

The bytes are read by the one read loop, :func:`gds_persist.loading.extents.read_extents`, into
the destinations of :mod:`gds_persist.loading.destinations`. Nothing is unpickled: the manifest
is JSON, validated before use; tensor bytes are raw. :func:`gds_persist.loading.verify.verify`
checks a checkpoint without keeping its data.

Other processes may replace or remove the checkpoint during a load: every reader holds it open
first - directory, manifest, and every data file it reads, before reading any byte of them
(:mod:`gds_persist.transfer.opened`). A load thus returns one complete checkpoint, verified: the
one at the path when it began, or (replaced before its files were all open; the ranks of a
process group agree on one) the newer one. It never reports a healthy checkpoint as corrupt or
truncated; :class:`CheckpointReplacedError` only if the path was replaced ``OPEN_ATTEMPTS`` times
in a row while being opened, or removed.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .. import settings
from ..errors import CheckpointReplacedError, ManifestError, NotCommittedError
from ..format import Extent, Manifest, align_up, sections_tree, storage_descriptions
from ..format.records import Wire
from ..format.tree import decode, tensor_indices
from ..keywords import in_options, removed_keywords, same_keywords
from ..parallel.distributed import Comm, make_comm
from ..parallel.exchange import exchange
from ..parallel.shared_reads import check_joined, shared_pieces
from ..progress import ByteCounter, ProgressCallback
from ..results import LoadInfo
from ..stages import stage
from ..stores.opened import open_checkpoint, opened
from ..transfer.opened import (
    OPEN_ATTEMPTS,
    OpenCheckpoint,
    pause,
    replaced_message,
)
from ..transfer.reader import Describe, checksum_mismatch
from . import single_file
from .destinations import (
    Destinations,
    MapLocation,
    Matched,
    apply_callable,
    match,
    plan_destinations,
    target_device,
)
from .extents import read_extents
from .options import LoadOptions, check_into

log = logging.getLogger("gds_persist")
def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the committed checkpoint at ``path``, read without any data.

    Parameters:
        path: a checkpoint directory, or a ``torch.save`` / safetensors file, or the URL of a
            checkpoint in an object store (``s3://bucket/prefix``).

    Returns:
        The :class:`~gds_persist.format.Manifest`.

    Raises:
        NotCommittedError: no committed checkpoint at ``path``.
        ManifestError: the manifest is malformed or of an unknown version.
    """
    return opened(path, lambda ck: ck.manifest)


_MOVED = {**in_options("LoadOptions", "strategy", "rank_local", "data_dirs", "weights_only"),
          "return_info": "return_info is gone since 0.2 (load returns the state only): use "
                         "`state, info = gds_persist.load_with_info(path, ...)`"}


# set by a caller whose into= holds only some of the checkpoint's tensors on purpose
_FRESH_EXPECTED: contextvars.ContextVar[bool] = contextvars.ContextVar("fresh_expected",
                                                                       default=False)


@contextlib.contextmanager
def fresh_expected() -> Iterator[None]:
    """Within it, a ``load(into=..., strict=False)`` of this thread (context) does not warn of
    the keys ``into`` lacks or has extra: the caller fills only some tensors on purpose and
    checks the rest itself (``LoadInfo`` still lists them)."""
    token = _FRESH_EXPECTED.set(True)
    try:
        yield
    finally:
        _FRESH_EXPECTED.reset(token)


@removed_keywords(_MOVED)
def load_with_info(
    path: str | os.PathLike[str],
    *,
    into: Any = None,
    strict: bool = True,
    map_location: MapLocation = None,
    verify: bool = True,
    backend: str | None = None,
    process_group: Any = None,
    progress: ProgressCallback | None = None,
    options: LoadOptions | None = None,
) -> tuple[Any, LoadInfo]:
    """:func:`load`, also returning what it did: ``state, info = load_with_info(path, ...)``.

    Parameters
    ----------
    path, into, strict, map_location, verify, backend, process_group, progress, options
        As for :func:`load`.

    Returns
    -------
    ``(state, info)``: the state as :func:`load` returns it, and a :class:`~gds_persist.LoadInfo`
    (the backend used and why, bytes, seconds; with ``strict=False`` the keys that did not
    match).
    """
    check_into(into)
    more = options if options is not None else LoadOptions()
    strategy, rank_local, weights_only = more.strategy, more.rank_local, more.weights_only
    data_dirs = more.data_dirs
    t0 = time.perf_counter()
    path = os.path.expanduser(os.fspath(path))
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
                                 distributed, into, strict, weights_only)
    info.seconds = time.perf_counter() - t0
    return state, info


@removed_keywords(_MOVED)
@same_keywords(load_with_info)
def load(path: str | os.PathLike[str], **keywords: Any) -> Any:
    """Load the checkpoint at ``path`` and return its state, every byte checked (CRC32C).

    Reference: ``docs/USAGE.md``, "Reference: load"; the same with what the load did:
    :func:`load_with_info`.

    Parameters
    ----------
    path : str or os.PathLike
        A checkpoint directory, or one ``torch.save`` or safetensors file; ``~`` is expanded.
        Or an object-store URL, ``s3://bucket/prefix`` (``docs/OBJECT_STORE.md``).
    into : state dict, optional
        Restore in place: a state shaped as ``save`` took it (``{"model":
        model.state_dict(), ...}``) whose tensors are filled with the checkpoint's bytes.
    strict : bool
        With ``into``: refuse missing and unexpected keys (``False``: fill what matches).
    map_location : device, str, dict or callable, optional
        As in ``torch.load`` (default: each tensor to the device it was saved from).
    verify : bool
        Check every extent's CRC32C (``False``: trust the bytes).
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        The I/O backend (default: the ``backend`` setting).
    process_group : torch.distributed group or "default", optional
        Every rank calls ``load``; replicated data is read once in total and shared.
    progress : callable, optional
        ``progress(done_bytes, total_bytes)``, called as data is read.
    options : LoadOptions, optional
        The rarer options: strategy, rank-local parts, moved data directories, unpickling.

    Returns
    -------
    The checkpoint's state (with ``into``: holding ``into``'s tensor objects).

    Raises
    ------
    ChecksumError
        Corrupted bytes, naming the tensor, file and offset.
    StateMismatchError
        With ``into``: key paths, shapes or dtypes that differ, every one listed.
    TypeError
        ``into`` is not a state (a module: pass ``into=model.state_dict()``), or a 0.1 keyword.
    """
    return load_with_info(path, **keywords)[0]


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
    if m.writer.get("container"):  # a single file: its pickle may use every storage
        needed = replicated = list(range(len(m.storages)))
    share = bool(distributed and comm.size > 1 and cfg.load_strategy != "read_all" and replicated)
    shared, by_rank = shared_pieces(m, set(replicated), comm.size) if share else ([], [])
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
        held = _Opening()
        try:
            statuses = [_Opened.from_wire(st) for st in comm.agree(
                "manifest", partial(_open_step, path, attempt, held, plan_for), what)]
        except BaseException:
            held.close()
            raise
        gone = [st.gone for st in statuses if st.gone]
        replaced = [st.replaced for st in statuses if st.replaced]
        if not (gone or replaced) and len({st.digest for st in statuses}) == 1:
            if held.error is not None:
                held.close()
                raise held.error
            assert held.ck is not None and held.plan is not None
            return held.ck, held.plan
        held.close()
        if gone:
            raise CheckpointReplacedError(gone[0])
        if attempt == OPEN_ATTEMPTS - 1:
            raise CheckpointReplacedError(
                replaced[0] if replaced else
                f"{path} was replaced while the ranks were opening it ({OPEN_ATTEMPTS} times in "
                "a row they found different checkpoints there); load it again")
        pause(attempt)
    raise AssertionError("unreachable")


@dataclass
class _Held:
    """What a load's read phase leaves for the rest of it."""

    found: Any = None  # the destinations in into= (None: a plain load)
    dest: Destinations | None = None
    read_bytes: int = 0
    reading: bool = False  # bytes may have reached the destinations
    state: Any = None  # a torch.save file's state, where its pickle ran before the read


@dataclass
class _Opening:
    """What one rank holds during an attempt of :func:`_open_agreed`."""

    ck: OpenCheckpoint | None = None
    plan: _LoadPlan | None = None
    error: Exception | None = None  # raised once every rank opened the same checkpoint

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


@dataclass(frozen=True)
class _Opened(Wire):
    """What a rank tells the others after an attempt to open the checkpoint."""

    digest: str = ""  # of the manifest it opened
    replaced: str = ""  # why not: replaced while opening its files
    gone: str = ""  # why not: removed


def _open_step(path: str, attempt: int, held: _Opening,
               plan_for: Callable[[OpenCheckpoint], _LoadPlan]) -> dict[str, str]:
    """One rank's part of an attempt of :func:`_open_agreed`; what it holds goes to ``held``."""
    try:
        ck = held.ck = open_checkpoint(path)
    except NotCommittedError:
        if not attempt:
            raise
        return _Opened(gone=replaced_message(path, "removed")).to_wire()
    try:
        plan = held.plan = plan_for(ck)
    except (ManifestError, ValueError) as e:
        held.error = e
        return _Opened(ck.digest).to_wire()
    try:
        ck.open_files(plan.files)
    except CheckpointReplacedError as e:
        return _Opened(ck.digest, replaced=str(e)).to_wire()
    return _Opened(ck.digest).to_wire()


def _load_held(ck: OpenCheckpoint, lp: _LoadPlan, comm: Comm, cfg: settings.Settings,
               what: str, map_location: MapLocation, verify: bool,
               progress: ProgressCallback | None, distributed: bool, into: Any,
               strict: bool, weights_only: bool) -> tuple[Any, LoadInfo]:
    """The rest of :func:`load`, on a checkpoint held open with this rank's files."""
    m = ck.manifest
    torch_file = single_file.is_torch_file(ck)
    pickle_first = single_file.unpickles_before_reading(ck, map_location, weights_only,
                                                        distributed)
    if not pickle_first:  # else its one run, before the read, is the check
        single_file.check_pickle(ck, weights_only)
    unverified = not ck.verifiable
    verify = verify and not unverified
    describe_storage = storage_descriptions(m)
    chosen: list[tuple[str, str]] = []  # (backend, reason) of every directory read
    held = _Held()

    def allocate(s: int) -> torch.Tensor:
        rec = m.storages[s]
        device = target_device(rec.device, map_location, distributed)
        return torch.empty(rec.nbytes, dtype=torch.uint8, device=device)

    def read() -> list[list[int]]:
        with stage("allocate destinations"):
            found = held.found = (None if into is None else
                                  match(m, lp.tree, into, strict, what))
            held.dest = plan_destinations(
                m, lp.wanted, lp.needed, found, allocate,
                single_file.exact_destination if torch_file else None)
        if pickle_first:  # also its check: a refused pickle stops the load before any read
            with stage("rebuild tensors"):
                held.state = single_file.rebuild(ck, lp.tree, held.dest, found, map_location,
                                                 weights_only)
        held.reading = True
        reading = PieceReader(ck, held.dest, cfg, verify, describe_storage, chosen)
        sub = lp.by_rank[comm.rank] if lp.share else []
        own = _own_reads(m, lp.needed, lp.replicated) if lp.share else lp.mine
        held.read_bytes = sum(align_up(e.stored_length) for e in sub + own)
        counter = ByteCounter(progress, held.read_bytes)
        crcs = reading.read(sub, counter.hook, shared=True) if sub else []
        reading.read(own, counter.hook)  # checked here, extent by extent
        counter.finish()
        return crcs

    try:
        crcs = comm.agree("read", read, what)
        dest = held.dest
        assert dest is not None
        if lp.share:
            if verify:
                check_joined(ck, lp.shared, crcs, describe_storage)
            pieces = [[(p.storage, p.start, p.length) for p in dest.pieces(sub, True)[0]]
                      for sub in lp.by_rank]
            exchange(comm, cfg.load_strategy, pieces, dest.buffers, cfg.staging_bytes)
        dest.finish()
    except Exception as e:
        told = _partial(e, held.found) if held.found and held.reading else e
        if told is e:
            raise  # a plain load, nothing of into= touched yet, or the note was added to e
        raise told from e
    found = held.found
    with stage("rebuild tensors"):
        if pickle_first:
            state = held.state
        elif torch_file:
            state = single_file.rebuild(ck, lp.tree, dest, found, map_location, weights_only)
        else:
            state = decode(lp.tree, dest.returned(m, lp.wanted, fresh_storages(
                m, lp.wanted, dest, map_location)))
    unique = list(dict.fromkeys(chosen))
    payload = sum(m.storages[s].nbytes for s in lp.needed)
    reasons = [r for _, r in unique] + ([single_file.UNVERIFIED] if unverified else [])
    info = LoadInfo(ck.path, ",".join(dict.fromkeys(b for b, _ in unique)) or "none",
                    "; ".join(reasons) or "nothing to read", held.read_bytes, payload, 0.0)
    if found is not None:
        info.missing_keys, info.unexpected_keys = found.missing_keys, found.unexpected_keys
        info.in_place_bytes = dest.in_place_bytes()
        if (found.missing_keys or found.unexpected_keys) and not _FRESH_EXPECTED.get():
            log.warning("load(into=) of %s (strict=False): %d missing key(s) %s, %d unexpected "
                        "(loaded fresh) %s", ck.path, len(found.missing_keys),
                        found.missing_keys[:8], len(found.unexpected_keys),
                        found.unexpected_keys[:8])
    return state, info


def fresh_storages(m: Manifest, wanted: list[int], dest: Destinations,
                   map_location: MapLocation) -> list[torch.UntypedStorage | None]:
    """By checkpoint storage: the fresh buffers whose tensors (of ``wanted``) are returned
    (after a callable ``map_location`` had its say)."""
    storages: list[Any] = [None] * len(m.storages)
    returned = {m.tensors[i].storage for i in wanted if i not in dest.matched}
    for s in returned:
        storage = dest.buffers[dest.fresh[s]].untyped_storage()
        if callable(map_location) and not isinstance(map_location, dict):
            storage = apply_callable(map_location, storage, m.storages[s].device)
        storages[s] = storage
    return storages


@dataclass
class PieceReader:
    """Reads extents into a load's :class:`Destinations`, cut into the pieces that land in
    each destination, and checks each extent's CRC32C once its pieces are joined (also the
    memory tier's restore from shares, :mod:`gds_persist.training.tier.reading`)."""

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
            check_joined(self.ck, [e for e in extents if (e.file, e.offset) in cut], [crcs],
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

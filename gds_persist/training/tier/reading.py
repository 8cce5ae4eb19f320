"""Restore of one step from the memory tier's shares (:mod:`.shares`): each rank reads, from its
node's memory, every share that node holds a copy of (its ranks' own shares and the replicas it
keeps), verified (every extent's CRC32C); the shares its node lacks arrive point to point from a
rank whose node holds them (:mod:`gds_persist.parallel.pairs`), straight into its state. Every
rank ends with the whole replicated state, in place with ``into=``
(:mod:`gds_persist.loading.destinations`). With 2 nodes and ``replicas=1`` each node holds
every share: nothing crosses the network unless a node lost its memory.

Which copy of which share each rank reads, and who sends what to whom, is the caller's plan
(:class:`Plan`, from :mod:`.recovery`'s holdings). A copy that is missing, cut short, holds
another step's manifest or fails its checksums is reported, the same on every rank, so the
caller can plan again without it; nothing else is retried here.

A rank whose own copy was lost receives its share's bytes like the others, straight into its
state; :class:`Heal` then rewrites its own copy (and the replicas it keeps) from that state,
while training resumes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import settings
from ...errors import CheckpointError
from ...format import MANIFEST_NAME, Extent, Manifest, parse_manifest, storage_descriptions
from ...format.records import Wire
from ...format.tree import decode, fill_locals, tensor_indices
from ...loading.destinations import Destinations, match, plan_destinations, target_device
from ...loading.load import PieceReader, fresh_storages
from ...parallel.distributed import Comm
from ...parallel.pairs import move
from ...stages import stage
from ...state.flatten import Flattened, flatten
from ...state.rank_local import locate, reunite, separate
from ...stores.commit import read_manifest
from ...stores.opened import open_checkpoint
from ...stores.urls import is_url, parse
from ...transfer.commit import commit, make_temporary, write_manifest
from ...transfer.opened import OpenCheckpoint
from .local_parts import load_part, receive_part, sender_of
from .shares import LOCAL_DIR, save_local, share_files


@dataclass(frozen=True)
class Source:
    """A copy of rank ``share``'s share in node ``node``'s memory: its owner's own directory
    (``kind`` "memory") or a replica (``"replica"``); ``path`` is right on that node."""

    share: int
    node: str
    kind: str
    path: str

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.share, self.node, self.kind)


@dataclass(frozen=True)
class CopyStatus(Wire):
    """A copy of a share as a rank found it, told to every rank: which (its share, node and
    kind, as :attr:`Source.key`), why it failed ('' if it did not), its manifest's digest."""

    share: int
    node: str
    kind: str
    why: str = ""
    digest: str = ""

    @classmethod
    def of(cls, copy: Source, why: str = "", digest: str = "") -> CopyStatus:
        return cls(copy.share, copy.node, copy.kind, why, digest)

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.share, self.node, self.kind)


Failures = dict[tuple[int, str, str], str]  # why each failed copy failed, by its key


def _agreed_failures(comm: Comm, phase: str, step: Any, what: str) -> Failures:
    """Every rank's failed copies, by key: ``step`` returns this rank's statuses."""
    return {st.key: st.why for st in _agreed(comm, phase, step, what) if st.why}


def _agreed(comm: Comm, phase: str, step: Any, what: str) -> list[CopyStatus]:
    return [CopyStatus.from_wire(st) for got in comm.agree(
        phase, lambda: [st.to_wire() for st in step()], what) for st in got]


@dataclass
class Plan:
    """One attempt at a step: what each rank reads from its node's memory (share -> copy), and
    the shares sent point to point: ``(share, sender, receiver)``."""

    reads: list[dict[int, Source]]
    sends: list[tuple[int, int, int]]


@dataclass
class Request:
    """What the caller of ``Checkpointer.load`` asked for."""

    into: Any = None
    strict: bool = True
    map_location: Any = None
    backend: str | None = None


@dataclass
class Heal:
    """A copy this rank keeps of a share (its own, or a replica it holds) that its node lacked,
    rebuilt from the bytes it restored: the share's data file and the step's manifest,
    committed atomically at ``path``."""

    path: str
    raw: bytes
    name: str | None
    size: int
    pieces: list[tuple[int, torch.Tensor]]  # (file offset, bytes): views of the restored state
    local: Flattened | None = None  # the rank's own rank-local part, restored

    def run(self) -> None:
        tmp = make_temporary(self.path)
        try:
            if self.name is not None:
                fd = os.open(os.path.join(tmp.dir, self.name), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.ftruncate(fd, self.size)
                    for offset, data in self.pieces:
                        os.pwrite(fd, memoryview(data.cpu().numpy().data).cast("B"), offset)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if self.local is not None:
                save_local(tmp.dir, self.local, None)
            write_manifest(tmp.dir, self.raw)
        except BaseException:
            tmp.finish()
            raise
        commit(tmp)
        self.pieces.clear()
        self.local = None


@dataclass
class Outcome:
    state: Any = None
    failures: dict[tuple[int, str, str], str] = field(default_factory=dict)  # copy -> why
    bytes_from: dict[str, int] = field(default_factory=dict)  # "memory"/"replica"/"sent"
    heals: list[Heal] = field(default_factory=list)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def read_step(comm: Comm, step: int, plan: Plan, req: Request, keep: dict[int, Source],
              peer_timeout_s: float | None = None) -> Outcome:
    """Every rank: restore ``step`` as ``plan`` says. Returns the state, or the failed copies
    (then no state; ``into`` may hold partial data, to be filled again by the next attempt).
    ``keep``: the copies this rank keeps (its own share, the replicas it holds), by share;
    those its node lacked come back in ``heals``."""
    what = f"memory-tier restore of step {step} (rank {comm.rank} of {comm.size})"
    mine = plan.reads[comm.rank]
    opened: dict[int, OpenCheckpoint] = {}
    try:
        with stage("tier restore: open the copies"):
            failures, digest = _open(comm, mine, opened, what)
        if failures:
            return Outcome(failures=failures)
        provider = min(r for r, reads in enumerate(plan.reads) if reads)
        raw = None
        if comm.rank == provider:
            raw = _manifest_bytes(mine[min(mine)].path)
        raw = comm.broadcast_bytes(raw, provider, "memory restore manifest")
        if hashlib.sha256(raw).hexdigest() != digest:  # replaced since it was opened
            src = plan.reads[provider][min(plan.reads[provider])]
            return Outcome(failures={src.key: "its manifest changed while being read"})
        m = parse_manifest(raw, f"the manifest of step {step} in the memory tier")
        return _read(comm, m, raw, plan, opened, req, what, keep, peer_timeout_s)
    finally:
        for ck in opened.values():
            ck.close()


def _manifest_bytes(path: str) -> bytes:
    """The raw manifest of a copy: a node-local directory, or the durable level's step (which
    may be in an object store)."""
    if is_url(path):
        got = read_manifest(parse(path))
        if got is None:
            raise CheckpointError(f"{path}: no committed step there any more")
        return got[0]
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return f.read()


def _open(comm: Comm, mine: dict[int, Source], opened: dict[int, OpenCheckpoint],
          what: str) -> tuple[dict[tuple[int, str, str], str], str]:
    """Open every copy this rank reads (its data file too: its size is checked); the failed
    copies (every rank's), and the manifest digest the copies agree on."""
    def step() -> list[CopyStatus]:
        out: list[CopyStatus] = []
        for k, src in mine.items():
            try:
                ck = opened[k] = open_checkpoint(src.path)
                files = share_files(ck.manifest)
                saved = ck.manifest.writer.get("world_size")
                if not files or saved != comm.size:
                    raise CheckpointError(f"{src.path} is not a share of a step of these "
                                          f"{comm.size} ranks (saved by {saved})")
                if k in files:
                    ck.open_files([files[k]])  # TruncatedError when cut short
                out.append(CopyStatus.of(src, digest=ck.digest))
            except (CheckpointError, OSError) as e:
                out.append(CopyStatus.of(src, _first_line(e)))
        return out

    statuses = _agreed(comm, "memory restore open", step, what)
    failures = {st.key: st.why for st in statuses if st.why}
    digests = [st.digest for st in statuses if st.digest]
    common = max(set(digests), key=digests.count) if digests else ""
    for st in statuses:
        if st.digest and st.digest != common:
            failures[st.key] = "it holds another manifest of this step than the others"
    return failures, common


def _read(comm: Comm, m: Manifest, raw: bytes, plan: Plan, opened: dict[int, OpenCheckpoint],
          req: Request, what: str, keep: dict[int, Source],
          peer_timeout_s: float | None) -> Outcome:
    cfg = settings.current(backend=req.backend)
    files = share_files(m)
    extents = {k: [e for e in m.extents if e.file == files[k]] if k in files else []
               for k in range(comm.size)}
    wanted = tensor_indices(m.tree)
    needed = sorted({m.tensors[i].storage for i in wanted})
    held: list[Destinations] = []  # what plan_dest() made
    where = locate(m.tree)  # rank-local placeholders: each rank restores its own part
    into, local_into = separate(req.into, where)
    parts: list[Any] = []  # this rank's rank-local subtrees, once read

    def allocate(s: int) -> torch.Tensor:
        device = target_device(m.storages[s].device, req.map_location, True)
        return torch.empty(m.storages[s].nbytes, dtype=torch.uint8, device=device)

    def plan_dest() -> None:  # a state that does not fit into= raises on every rank
        found = None if into is None else match(m, m.tree, into, req.strict, what)
        held.append(plan_destinations(m, wanted, needed, found, allocate))

    with stage("tier restore: destinations"):
        comm.agree("memory restore destinations", plan_dest, what)
    dest = held[0]
    describe = storage_descriptions(m)
    chosen: list[tuple[str, str]] = []
    mine = plan.reads[comm.rank]

    def read() -> list[CopyStatus]:
        bad = []
        for k, ck in opened.items():
            try:
                PieceReader(ck, dest, cfg, True, describe, chosen).read(extents[k], None)
            except (CheckpointError, OSError) as e:
                bad.append(CopyStatus.of(mine[k], _first_line(e)))
        own = mine.get(comm.rank)
        if where and own is not None and not bad:
            bad += _read_part(own, os.path.join(own.path, LOCAL_DIR), local_into, req, parts)
        return bad

    with stage("tier restore: read the node's shares"):
        failures = _agreed_failures(comm, "memory restore read", read, what)
    if failures:
        return Outcome(failures=failures)
    with stage("tier restore: send the missing shares"):
        _send_missing(comm, plan, extents, dest, what, peer_timeout_s)
    if where:
        with stage("tier restore: receive the rank-local part"):
            failures = _receive_part(comm, plan, keep, local_into, req, parts, what,
                                     peer_timeout_s)
        if failures:
            return Outcome(failures=failures)
    with stage("tier restore: copy what heals"):  # others' rank-local parts are not here
        local = flatten(parts) if where else None
        heals = [_heal(m, raw, files, extents[k], dest, src, local if k == comm.rank else None)
                 for k, src in keep.items()
                 if mine.get(k) != src and (not where or k == comm.rank)]
    dest.finish()
    state = decode(fill_locals(m.tree, lambda j: None), dest.returned(
        m, wanted, fresh_storages(m, wanted, dest, req.map_location)))
    state = reunite(state, where, parts) if where else state
    return Outcome(state=state, bytes_from=_bytes_from(plan, extents), heals=heals)


def _read_part(copy: Source, path: str | None, into: list[Any] | None, req: Request,
               parts: list[Any]) -> list[CopyStatus]:
    """Load this rank's rank-local part from ``path`` (None: it never arrived) into ``parts``;
    the failure of ``copy`` (the share copy it came with), if any."""
    if path is None:
        return [CopyStatus.of(copy, "its rank-local part did not arrive from its sender")]
    try:
        parts[:] = load_part(path, into, req)
    except (CheckpointError, OSError) as e:
        return [CopyStatus.of(copy, _first_line(e))]
    return []


def _receive_part(comm: Comm, plan: Plan, keep: dict[int, Source], into: list[Any] | None,
                  req: Request, parts: list[Any], what: str,
                  peer_timeout_s: float | None) -> dict[tuple[int, str, str], str]:
    """A rank sent its own share also receives its rank-local part from the sender (every
    rank calls it); the failed copies, every rank's."""
    own_dir = os.path.dirname(keep[comm.rank].path)
    landed = receive_part(comm, plan, own_dir, "memory restore: rank-local parts sent",
                          peer_timeout_s)
    sender = sender_of(plan, comm.rank)

    def step() -> list[CopyStatus]:
        if sender is None:
            return []
        copy = Source(comm.rank, plan.reads[sender][comm.rank].node,
                      plan.reads[sender][comm.rank].kind, "")
        try:
            return _read_part(copy, landed, into, req, parts)
        finally:
            if landed:
                shutil.rmtree(landed, ignore_errors=True)

    return _agreed_failures(comm, "memory restore rank-local", step, what)


def _send_missing(comm: Comm, plan: Plan, extents: dict[int, list[Extent]], dest: Destinations,
                  what: str, peer_timeout_s: float | None) -> None:
    """The shares a rank's node lacks, from the sender the plan names, straight into place.
    Both ends cut the share alike (at every tensor boundary), whatever their destinations."""
    sends, recvs = [], []
    for k, src, dst in plan.sends:
        if comm.rank in (src, dst):
            pieces = [(p.storage, p.start, p.length) for p in dest.pieces(extents[k], True)[0]]
            if comm.rank == src:
                sends += [(dst, p) for p in pieces]
            else:
                recvs += [(src, p) for p in pieces]
    move(comm, sends, recvs, dest.buffers, "memory restore: shares sent", peer_timeout_s)
    comm.agree("memory restore sent", lambda: None, what)


def _bytes_from(plan: Plan, extents: dict[int, list[Extent]]) -> dict[str, int]:
    """Bytes read from each kind of copy by all ranks, and sent between them."""
    out: dict[str, int] = {}
    size = {k: sum(e.length for e in es) for k, es in extents.items()}
    for reads in plan.reads:
        for k, src in reads.items():
            out[src.kind] = out.get(src.kind, 0) + size[k]
    for k, _, _ in plan.sends:
        out["sent"] = out.get("sent", 0) + size[k]
    return out


def _heal(m: Manifest, raw: bytes, files: dict[int, int], extents: list[Extent],
          dest: Destinations, copy: Source, local: Flattened | None) -> Heal:
    """What rewrites ``copy`` from the restored state (:meth:`Heal.run`, before training
    changes it: the Checkpointer's guard waits for it)."""
    pieces = [(p.offset, dest.buffers[p.storage][p.start : p.start + p.length])
              for p in dest.pieces(extents)[0]]  # views of the restored state: no copy
    index = files.get(copy.share)
    name = None if index is None else m.files[index].name
    size = 0 if index is None else m.files[index].size
    return Heal(copy.path, raw, name, size, pieces, local)

"""Restore of one step from the memory tier's shares (:mod:`.shares`), as the drive load's shared
read does it: each share is read once, by the rank whose node holds a copy of it, verified
(every extent's CRC32C, on the reader), and the ranks then exchange the bytes
(:func:`gds_persist.parallel.exchange.exchange`) so that every rank holds the whole state -
in place with ``into=`` (:mod:`gds_persist.loading.destinations`).

Who reads which share, from which copy (its owner's own directory, or a replica on another node:
the *holdings*), is the caller's (:mod:`.recovery`). A copy that is missing, cut short, holds
another step's manifest or fails its checksums is reported by share, the same on every rank,
so the caller can pick another copy of that share; nothing else is retried here.

A rank whose own copy was lost receives its share's bytes like the others, straight into its
state; :class:`Heal` then rewrites its own copy from those bytes, after training has resumed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import settings
from ...errors import CheckpointError
from ...format import MANIFEST_NAME, Extent, Manifest, parse_manifest, storage_descriptions
from ...format.tree import decode, tensor_indices
from ...loading.destinations import Destinations, match, plan_destinations, target_device
from ...loading.load import PieceReader, fresh_storages
from ...parallel.distributed import Comm
from ...parallel.exchange import exchange
from ...transfer.commit import commit, make_temporary, write_manifest
from ...transfer.opened import OpenCheckpoint, open_checkpoint
from .shares import share_files


@dataclass(frozen=True)
class Source:
    """A copy of rank ``share``'s share: in the directory ``path`` on rank ``holder``'s node."""

    share: int
    holder: int
    path: str

    @property
    def kind(self) -> str:
        return "memory" if self.holder == self.share else "replica"


@dataclass
class Request:
    """What the caller of ``Checkpointer.load`` asked for."""

    into: Any = None
    strict: bool = True
    map_location: Any = None
    io_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Heal:
    """This rank's own copy of a step, rebuilt from the bytes it restored (a replica's): the
    share's data file and the step's manifest, committed atomically at ``path``."""

    path: str
    raw: bytes
    name: str | None
    size: int
    pieces: list[tuple[int, torch.Tensor]]  # (file offset, bytes), copied before training resumed

    def run(self) -> None:
        tmp = make_temporary(self.path)
        try:
            if self.name is not None:
                fd = os.open(os.path.join(tmp.dir, self.name), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.ftruncate(fd, self.size)
                    for offset, data in self.pieces:
                        os.pwrite(fd, memoryview(data.numpy()).cast("B"), offset)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            write_manifest(tmp.dir, self.raw)
        except BaseException:
            tmp.finish()
            raise
        commit(tmp)
        self.pieces.clear()


@dataclass
class Outcome:
    state: Any = None
    failures: dict[int, str] = field(default_factory=dict)  # share -> why its copy failed
    share_bytes: dict[int, int] = field(default_factory=dict)  # share -> bytes read
    heal: Heal | None = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def read_step(comm: Comm, step: int, assign: dict[int, Source], req: Request,
              own_path: str) -> Outcome:
    """Every rank: restore ``step`` from the copies ``assign`` names (one per share, every
    rank's share; a copy's ``path`` matters on its holder only). Returns the state, or the
    failed copies by share (then no state; ``into`` may hold partial data, to be filled again
    by the next attempt). ``own_path``: where this rank's own copy of the step belongs."""
    what = f"memory-tier restore of step {step} (rank {comm.rank} of {comm.size})"
    mine = {k: s for k, s in assign.items() if s.holder == comm.rank}
    opened: dict[int, OpenCheckpoint] = {}
    try:
        failures, digest = _open(comm, mine, opened, what)
        if failures:
            return Outcome(failures=failures)
        first = assign[min(assign)]
        raw = None
        if comm.rank == first.holder:
            with open(os.path.join(first.path, MANIFEST_NAME), "rb") as f:
                raw = f.read()
        raw = comm.broadcast_bytes(raw, first.holder, "memory restore manifest")
        if hashlib.sha256(raw).hexdigest() != digest:  # replaced since it was opened
            return Outcome(failures={first.share: "its manifest changed while being read"})
        m = parse_manifest(raw, f"the manifest of step {step} in the memory tier")
        return _read(comm, m, raw, assign, opened, req, what, own_path)
    finally:
        for ck in opened.values():
            ck.close()


def _open(comm: Comm, mine: dict[int, Source], opened: dict[int, OpenCheckpoint],
          what: str) -> tuple[dict[int, str], str]:
    """Open every copy this rank reads (its data file too: its size is checked); the failed
    copies by share (every rank's), and the manifest digest the copies agree on."""
    def step() -> dict[str, dict[str, str]]:
        out = {}
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
                out[str(k)] = {"digest": ck.digest}
            except (CheckpointError, OSError) as e:
                out[str(k)] = {"error": _first_line(e)}
        return out

    statuses = {int(k): st for got in comm.agree("memory restore open", step, what)
                for k, st in got.items()}
    failures = {k: st["error"] for k, st in statuses.items() if "error" in st}
    digests = [st["digest"] for st in statuses.values() if "digest" in st]
    common = max(set(digests), key=digests.count) if digests else ""
    for k, st in statuses.items():
        if st.get("digest", common) != common:
            failures[k] = "it holds another manifest of this step than the other shares"
    return failures, common


def _read(comm: Comm, m: Manifest, raw: bytes, assign: dict[int, Source],
          opened: dict[int, OpenCheckpoint], req: Request, what: str, own_path: str) -> Outcome:
    cfg = settings.current(**req.io_kwargs)
    files = share_files(m)
    extents = {k: [e for e in m.extents if e.file == files[k]] if k in files else []
               for k in assign}
    wanted = tensor_indices(m.tree)
    needed = sorted({m.tensors[i].storage for i in wanted})
    held: dict[str, Destinations] = {}

    def allocate(s: int) -> torch.Tensor:
        device = target_device(m.storages[s].device, req.map_location, True)
        return torch.empty(m.storages[s].nbytes, dtype=torch.uint8, device=device)

    def plan() -> None:  # a state that does not fit into= raises on every rank
        found = None if req.into is None else match(m, m.tree, req.into, req.strict, what)
        held["dest"] = plan_destinations(m, wanted, needed, found, allocate)

    comm.agree("memory restore destinations", plan, what)
    dest = held["dest"]
    describe = storage_descriptions(m)
    chosen: list[tuple[str, str]] = []

    def read() -> dict[str, str]:
        bad = {}
        for k, ck in opened.items():
            try:
                PieceReader(ck, dest, cfg, True, describe, chosen).read(extents[k], None)
            except (CheckpointError, OSError) as e:
                bad[str(k)] = _first_line(e)
        return bad

    failures = {int(k): why for got in comm.agree("memory restore read", read, what)
                for k, why in got.items()}
    if failures:
        return Outcome(failures=failures)
    by_reader: list[list[Extent]] = [[] for _ in range(comm.size)]
    for k in sorted(assign):
        by_reader[assign[k].holder] += extents[k]
    pieces = [[(p.storage, p.start, p.length) for p in dest.pieces(sub, True)[0]]
              for sub in by_reader]
    strategy = cfg.load_strategy if cfg.load_strategy in ("allgather", "broadcast") else "broadcast"
    exchange(comm, strategy, pieces, dest.buffers, cfg.staging_bytes)
    heal = _heal(m, raw, files, extents, assign, dest, comm.rank, own_path)
    dest.finish()
    state = decode(m.tree, dest.returned(m, wanted, fresh_storages(m, wanted, dest,
                                                                  req.map_location)))
    sizes = {k: sum(e.length for e in extents[k]) for k in assign}
    return Outcome(state=state, share_bytes=sizes, heal=heal)


def _heal(m: Manifest, raw: bytes, files: dict[int, int], extents: dict[int, list[Extent]],
          assign: dict[int, Source], dest: Destinations, rank: int,
          own_path: str) -> Heal | None:
    """This rank's share came from a replica: copy its bytes now (training will change them),
    to rewrite its own copy later (:meth:`Heal.run`)."""
    src = assign.get(rank)
    if src is None or src.kind == "memory":
        return None
    pieces = []
    for p in dest.pieces(extents[rank])[0]:
        data = dest.buffers[p.storage][p.start : p.start + p.length]
        pieces.append((p.offset, data.to("cpu", copy=True)))
    index = files.get(rank)
    name = None if index is None else m.files[index].name
    size = 0 if index is None else m.files[index].size
    return Heal(own_path, raw, name, size, pieces)

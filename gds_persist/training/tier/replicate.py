"""Copies of committed share directories between ranks over the process group: the memory
tier's replicas of each rank's share, on other nodes.

Who holds whose copies is pure data (:func:`holders`): rank r's ``replicas`` copies go to the
first ranks after it (cyclically) on nodes other than r's and each other's, so that one node's
loss leaves a copy of every rank elsewhere. A transfer (:func:`transfer`) first tells every rank
what each sends to whom (file names and sizes, one all-gather), then moves the bytes in chunks of
at most :data:`CHUNK` per pair and round (memory in flight stays bounded, whatever the step's
size), and commits each received directory atomically (``transfer.commit``): a kill during a copy
leaves only a temporary directory, never a step that looks complete; a peer lost mid-copy is
named within ``peer_timeout_s`` (:class:`PeerLostError`). Bytes are not checked here: every
extent's CRC32C is checked when a copy is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import CheckpointError
from ...parallel.distributed import Comm
from ...transfer.commit import Temporary, abort, commit, make_temporary

CHUNK = 64 << 20  # bytes per pair and round


def holders(nodes: list[str], replicas: int) -> list[list[int]]:
    """For every rank, the ranks that keep its ``replicas`` copies: each on a node other than
    the rank's and the other holders', the least loaded first, then the nearest after it
    (cyclically), so that copies spread evenly. Raises when there are too few nodes."""
    distinct = len(set(nodes))
    if replicas > distinct - 1:
        raise CheckpointError(
            f"replicas={replicas} copies on other nodes need {replicas + 1} nodes, but the "
            f"process group spans {distinct} ({', '.join(sorted(set(nodes)))}; from "
            "GDS_PERSIST_NODE or the host name): lower replicas= or add nodes")
    size = len(nodes)
    load = [0] * size
    out = []
    for r in range(size):
        used, mine = {nodes[r]}, list[int]()
        for _ in range(replicas):
            cand = min((c for c in range(size) if nodes[c] not in used),
                       key=lambda c: (load[c], (c - r) % size))
            used.add(nodes[cand])
            load[cand] += 1
            mine.append(cand)
        out.append(mine)
    return out


def _listing(directory: str) -> list[list[Any]]:
    """[relative path, size] of every file under a committed step directory, in a fixed order."""
    files = []
    for base, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(base, name)
            files.append([os.path.relpath(full, directory), os.path.getsize(full)])
    return files


def _segments(files: list[list[Any]], start: int, n: int) -> list[tuple[str, int, int, int]]:
    """(file, offset in it, offset in the chunk, length) of the stream bytes [start, start+n)."""
    out, pos = [], 0
    for name, size in files:
        lo, hi = max(start, pos), min(start + n, pos + size)
        if lo < hi:
            out.append((name, lo - pos, lo - start, hi - lo))
        pos += size
    return out


def _read_chunk(directory: str, files: list[list[Any]], start: int, n: int) -> torch.Tensor:
    buf = bytearray(n)
    view = memoryview(buf)
    for name, off, at, length in _segments(files, start, n):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            f.seek(off)
            got = f.readinto(view[at : at + length])
            if got != length:
                raise CheckpointError(f"{os.path.join(directory, name)} shrank while being "
                                      "copied to a peer (removed by another process?)")
    return torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


def _write_chunk(directory: str, files: list[list[Any]], start: int, data: torch.Tensor) -> None:
    raw = memoryview(data.cpu().numpy().data).cast("B")
    for name, off, at, length in _segments(files, start, len(raw)):
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, raw[at : at + length], off)
        finally:
            os.close(fd)


def _prepare(tmp: Temporary, files: list[list[Any]]) -> None:
    for name, size in files:  # every file exists at its size, even an empty one
        path = os.path.join(tmp.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)


def _seal(tmp: Temporary, files: list[list[Any]]) -> None:
    for name, _ in files:
        fd = os.open(os.path.join(tmp.dir, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    commit(tmp)  # fsyncs the directory, then renames it into place


def transfer(comm: Comm, outgoing: Mapping[int, str], incoming: Mapping[int, str],
             phase: str, peer_timeout_s: float | None = None) -> list[int]:
    """Send the committed directory ``outgoing[dst]`` to each rank ``dst``, and commit what each
    rank ``src`` sends here at ``incoming[src]``; every rank calls it (with empty maps if it has
    no part). A missing source directory sends nothing (its receiver is told). Every chunk's
    wait is bounded by ``peer_timeout_s``: a peer that died mid-copy raises
    :class:`PeerLostError` naming it. Returns the sources whose copies were committed here."""
    mine = {str(dst): _listing(d) for dst, d in outgoing.items() if os.path.isdir(d)}
    headers = comm.all_gather_json(mine, phase)
    me = str(comm.rank)
    sources = {src: h[me] for src, h in enumerate(headers) if me in h}
    unexpected = set(sources) - set(incoming)
    if unexpected:
        raise CheckpointError(f"rank {comm.rank}: ranks {sorted(unexpected)} sent copies it has "
                              "no place for (ranks disagree on the replica plan)")
    lengths = [sum(size for _, size in files) for h in headers for files in h.values()]
    rounds = max([-(-n // CHUNK) for n in lengths] or [0])
    temps = {src: make_temporary(incoming[src]) for src in sources}
    try:
        for src, files in sources.items():
            _prepare(temps[src], files)
        for k in range(rounds):
            _round(comm, k, outgoing, mine, sources, temps, phase, peer_timeout_s)
        for src, files in sources.items():
            _seal(temps.pop(src), files)
    finally:
        for tmp in temps.values():
            abort(tmp)
    return sorted(sources)


def _round(comm: Comm, k: int, outgoing: Mapping[int, str], mine: dict[str, list[list[Any]]],
           sources: dict[int, list[list[Any]]], temps: dict[int, Temporary], phase: str,
           peer_timeout_s: float | None = None) -> None:
    """Round ``k``: every pair moves its stream's bytes [k*CHUNK, (k+1)*CHUNK)."""
    start = k * CHUNK

    def width(files: list[list[Any]]) -> int:
        return max(0, min(CHUNK, sum(size for _, size in files) - start))

    sends = [(int(dst), _read_chunk(outgoing[int(dst)], files, start, width(files)))
             for dst, files in mine.items() if width(files)]
    recvs = [(src, torch.empty(width(files), dtype=torch.uint8, device=comm.device))
             for src, files in sources.items() if width(files)]
    comm.send_recv(sends, recvs, phase, peer_timeout_s)
    for src, buf in recvs:
        _write_chunk(temps[src].dir, sources[src], start, buf)

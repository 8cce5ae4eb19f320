"""Moving replicated bytes between ranks after a shared read (``gds_persist.load`` with a process
group): each rank read some pieces of the replicated storages; afterwards every rank holds all of
them. ``"broadcast"``: each rank in turn broadcasts its pieces, large ones straight from and into
the destination storages; ``"allgather"``: every rank packs a bucket per round and all buckets are
gathered. Memory beyond the destinations stays within ``staging_bytes``. Collectives go through
:class:`gds_persist.parallel.distributed.Comm` (bounded waits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .distributed import Comm

Piece = tuple[int, int, int]  # (storage, start, length)


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


def exchange(comm: Comm, strategy: str, pieces: list[list[Piece]],
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

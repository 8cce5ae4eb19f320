"""Point-to-point messages of byte ranges between pairs of ranks: a rank sends pieces of its
buffers straight from them, its peer receives them straight into its own (no packing, no copy
but where the buffer is on another device than the group's, e.g. CUDA over gloo).

Both ends derive their lists from the same plan, in the same order: pair ``(src, dst)``'s
messages match in posting order. All are posted at once and then waited for, each wait bounded
(:meth:`gds_persist.parallel.distributed.Comm.send_recv`: a peer that died or does not answer
raises :class:`PeerLostError` naming it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .distributed import Comm

Piece = tuple[int, int, int]  # (buffer, start, length)


def move(comm: Comm, sends: Sequence[tuple[int, Piece]], recvs: Sequence[tuple[int, Piece]],
         buffers: Sequence[torch.Tensor | None], phase: str,
         peer_timeout_s: float | None = None) -> None:
    """Send each ``(dst, piece)`` of ``buffers`` to ``dst``; fill each ``(src, piece)`` from
    ``src``. Every rank with a part calls it (one with none may too: it returns at once)."""
    if not sends and not recvs:
        return
    out = [(dst, _view(buffers, p)) for dst, p in sends if p[2]]
    into = [(src, _view(buffers, p)) for src, p in recvs if p[2]]
    staged = [(view, view if view.device == comm.device else
               torch.empty(view.numel(), dtype=torch.uint8, device=comm.device))
              for _, view in into]
    comm.send_recv(out, [(src, tmp) for (src, _), (_, tmp) in zip(into, staged, strict=True)],
                   phase, peer_timeout_s)
    for view, tmp in staged:
        if tmp is not view:
            view.copy_(tmp)


def _view(buffers: Sequence[torch.Tensor | None], piece: Piece) -> torch.Tensor:
    buffer, start, length = piece
    b = buffers[buffer]
    assert b is not None
    return b[start : start + length]

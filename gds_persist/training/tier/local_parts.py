"""The rank-local parts of a memory-tier restore (``Checkpointer(rank_local=...)``). Its
``plan`` / ``req`` are :mod:`.reading`'s Plan / Request (that module imports this one).

Each rank's own part is a plain checkpoint in its share directory (``local/``, :mod:`.shares`),
copied to the share's replicas with it. A restore reads a rank's part from the copy of its share
that the rank's node holds; where its node lacks one, the rank that sends it its share also
sends it that copy's ``local/`` (:func:`.replicate.transfer`, committed under the rank's own
memory directory, then read and removed). The part is loaded like any checkpoint (verified, in
place into ``into``'s subtrees at the rank-local key paths) and put back at those paths.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ...errors import CheckpointError
from ...loading.load import load as core_load
from ...parallel.distributed import Comm
from .replicate import transfer
from .shares import LOCAL_DIR

RECEIVED = ".received-local"  # under a rank's own memory directory, while a restore reads it


def load_part(path: str, into: list[Any] | None, req: Any) -> list[Any]:
    """This rank's rank-local subtrees, in placeholder order, from the checkpoint at ``path``
    (a share copy's ``local/``, or one received)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is missing: the share holds no rank-local part")
    parts = core_load(path, map_location=req.map_location, verify=True, into=into,
                      strict=req.strict, backend=req.backend)
    if not isinstance(parts, list):
        raise CheckpointError(f"{path} does not hold a list of rank-local parts")
    return parts


def receive_part(comm: Comm, plan: Any, own_dir: str, phase: str,
                 peer_timeout_s: float | None) -> str | None:
    """Every rank calls it: the ranks whose own share was sent to them receive its ``local/``
    from the sender; returns where this rank's landed (None: it read its own, or none came)."""
    moves = [(k, src) for k, src, dst in plan.sends if k == dst]  # the same on every rank
    if not moves:
        return None
    mine, here = plan.reads[comm.rank], os.path.join(own_dir, RECEIVED)
    outgoing = {k: os.path.join(mine[k].path, LOCAL_DIR) for k, src in moves if src == comm.rank}
    incoming = {src: here for k, src in moves if k == comm.rank}
    if incoming:
        os.makedirs(own_dir, exist_ok=True)
        shutil.rmtree(here, ignore_errors=True)
    got = transfer(comm, outgoing, incoming, phase, peer_timeout_s)
    return here if incoming and got else None


def sender_of(plan: Any, rank: int) -> int | None:
    """The rank that sends ``rank`` its own share (None: its node holds a copy)."""
    return next((src for k, src, dst in plan.sends if k == dst == rank), None)

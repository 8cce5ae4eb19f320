"""Tasks of tests/test_torch_file.py run on every rank of a :class:`_gang.Gang`."""

from __future__ import annotations

from typing import Any

import torch
from _dist_tasks import make_state

import gds_persist


def save_one_file(ctx: Any, n: int, path: str, differ: bool = False) -> Any:
    """Ranks 0..n-1 save the replicated state as one torch.save file; their infos, or the
    error each raised (``differ``: rank 1's state is not rank 0's)."""
    group = ctx.group(n)
    if group is None:
        return None
    state = make_state()
    if differ and ctx.rank == 1:
        state["step"] = 101
    try:
        info = gds_persist.save(state, path, format="torch", process_group=group)
    except gds_persist.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"rank": info.rank, "writers": info.writers, "rank_bytes": info.rank_bytes,
            "bytes": info.bytes_written}


def load_one_file(ctx: Any, n: int, path: str) -> Any:
    """Ranks 0..n-1 load the file together (each reads a share): equal to the state?"""
    group = ctx.group(n)
    if group is None:
        return None
    state, info = gds_persist.load_with_info(path, process_group=group)
    want = make_state()
    ok = (torch.equal(state["model"]["wte"], want["model"]["wte"])
          and state["model"]["lm_head"].untyped_storage().data_ptr()
          == state["model"]["wte"].untyped_storage().data_ptr()
          and torch.equal(state["optimizer"]["state"][7]["exp_avg"],
                          want["optimizer"]["state"][7]["exp_avg"]))
    return {"ok": ok, "read": info.bytes_read, "payload": info.payload_bytes}

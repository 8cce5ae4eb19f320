"""Tasks run on every rank of a gloo gang by tests/test_checkpointer_distributed.py."""

from __future__ import annotations

from typing import Any

import torch


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    emb = torch.randn(64, 16, generator=g)
    return {"model": {"emb": emb, "head": emb, "w": torch.randn(300, 7, generator=g)},
            "step": step}


def checkpoint_steps(ctx: Any, root: str, steps: int, mode: str) -> dict[str, Any]:
    """Every rank saves the same replicated state each step through a Checkpointer."""
    from gds_persist import Checkpointer

    group = ctx.group(ctx.world)
    with Checkpointer(root, keep_last=2, mode=mode, process_group=group) as ckpt:
        for s in range(1, steps + 1):
            ckpt.save(s, state(s))
        ckpt.wait()
        loaded = ckpt.load()
    same = all(torch.equal(loaded["model"][k], state(steps)["model"][k]) for k in ("emb", "w"))
    tied = loaded["model"]["emb"].data_ptr() == loaded["model"]["head"].data_ptr()
    return {"rank": ctx.rank, "latest": ckpt.latest_step(), "steps": ckpt.steps(),
            "loaded_step": loaded["step"], "same": same, "tied": tied,
            "publisher": ckpt._publisher}

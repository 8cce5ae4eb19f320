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


def edited_after_save(ctx: Any, root: str) -> dict[str, Any]:
    """A data-parallel Checkpointer with a rank-local part: step 1 is clean; after ``save(2)``
    rank 1 edits its rank-local tensor (read live: the guarded optimizer holds it) before the
    writer reads it. Every rank must see step 2 refused, naming rank 1's storage; step 1
    stays the latest."""
    import threading

    from helpers import HookedCheckpointer

    from gds_persist import CheckpointError

    group = ctx.group(ctx.world)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 16))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones_like(w)
    opt.step()  # the momentum buffer exists: per-rank state below
    mine = opt.state[w]["momentum_buffer"]
    mine.add_(ctx.rank)  # the ranks' rank-local parts differ
    ckpt = HookedCheckpointer(root, keep_last=None, mode="fence", process_group=group,
                              rank_local="local")
    ckpt.guard(opt)
    gate = threading.Event()
    ckpt.before_write = lambda step: gate.wait(30)
    gate.set()
    ckpt.save(1, {"w": w, "local": {"m": mine}}).wait()
    gate.clear()
    handle = ckpt.save(2, {"w": w, "local": {"m": mine}})
    if ctx.rank == 1:
        mine.mul_(2)  # before the write read it
    gate.set()
    out: dict[str, Any] = {"error": ""}
    try:
        handle.wait()
    except CheckpointError as e:  # rank 0's TornCheckpointError, agreed on by every rank
        out["error"] = f"{type(e).__name__}: {e}"
    out["latest"] = ckpt.latest_step()
    ckpt.close()
    return out


def diverged_replicas(ctx: Any, root: str, memory: str) -> dict[str, Any]:
    """A memory-tier step whose replicated state differs on rank 1 (its weight one ulp off):
    each rank writes a share of it from its own replica, so the step would mix two states.
    Every rank must see it refused as replicas that differ, not as a tensor edited after
    save(), and nothing committed."""
    from gds_persist import Checkpointer, CheckpointError, MemoryTier

    group = ctx.group(ctx.world)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256))  # 256 KiB: both ranks write a share of it
    opt = torch.optim.SGD([w], lr=0.1)
    if ctx.rank == 1:
        with torch.no_grad():
            w.view(torch.int32)[0, 0] += 1
    ckpt = Checkpointer(root, process_group=group, memory=MemoryTier(memory), drive_every=10)
    ckpt.guard(opt)
    out: dict[str, Any] = {"error": ""}
    try:
        ckpt.save(1, {"w": w}).wait()
    except CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["steps"] = ckpt.steps()
    ckpt.close()
    return out

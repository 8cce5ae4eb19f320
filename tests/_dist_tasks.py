"""Tasks run on every rank of a :class:`_gang.Gang` (module-level so spawn can pickle them)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import torch

import gds_persist
from gds_persist import settings
from gds_persist.loading.destinations import tensor_leaves


def make_state(seed: int = 0) -> dict[str, Any]:
    """A small GPT-like replicated state: one dominant (tied) embedding split across ranks, many
    tiny optimizer tensors, every awkward kind of tensor."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(3000, 33, generator=g)
    model = OrderedDict(
        wte=emb,
        lm_head=emb,  # tied: must share storage after load
        window=emb[5:50:2, 1:7],  # non-contiguous view of the same storage
        ln=torch.randn(33, generator=g).to(torch.bfloat16),
        qkv=torch.randn(64, 99, generator=g).to(torch.float16),
        mask=torch.rand(77, generator=g) > 0.5,
        ids=torch.arange(12345, dtype=torch.int64),
        scalar=torch.tensor(3.5),
        empty=torch.empty(0, 4),
        cplx=torch.randn(5, dtype=torch.complex64, generator=g),
    )
    model._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    optimizer = {
        "state": {i: {"step": torch.tensor(float(i)),
                      "exp_avg": torch.randn(20 + i, generator=g)} for i in range(60)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(60))}],
    }
    return {"model": model, "optimizer": optimizer, "step": 100, "loss": float("inf")}


def make_local(rank: int) -> dict[str, Any]:
    """A ZeRO-style optimizer shard: different shape and values on every rank."""
    return {"shard": torch.arange(5 + 3 * rank, dtype=torch.float32) + 1000 * rank,
            "owner": rank, "flat": torch.full((4096 + rank,), rank, dtype=torch.uint8)}


def mismatches(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return [f"{path}: {type(a).__name__} instead of a tensor"]
        if (a.dtype, a.shape, a.stride(), type(a)) != (b.dtype, b.shape, b.stride(), type(b)):
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = a.numel() == 0 or torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                             b.reshape(-1).contiguous().view(torch.uint8))
        return [] if same else [f"{path}: values differ"]
    if isinstance(b, dict):
        if not isinstance(a, dict) or list(a) != list(b) or type(a) is not type(b):
            return [f"{path}: keys {list(a) if isinstance(a, dict) else a!r} vs {list(b)}"]
        out = [m for k in b for m in mismatches(a[k], b[k], f"{path}[{k!r}]")]
        if getattr(b, "_metadata", None) != getattr(a, "_metadata", None):
            out.append(f"{path}: _metadata lost")
        return out
    if isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {a!r} vs {b!r}"]
        return [m for i, (x, y) in enumerate(zip(a, b, strict=True))
                for m in mismatches(x, y, f"{path}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]


def check_loaded(out: Any, local: Any = None) -> list[str]:
    expected = make_state()
    if local is not None:
        expected["zero"] = local
    problems = mismatches(out, expected)
    m = out["model"]
    ptr = m["wte"].untyped_storage().data_ptr()
    others = {m[k].untyped_storage().data_ptr() for k in ("lm_head", "window")}
    if others != {ptr}:
        problems.append("tied weights / views no longer share storage")
    return problems


def save(ctx: Any, n: int, path: str, with_local: bool = False, **kw: Any) -> dict[str, Any] | None:
    group = ctx.group(n)
    if group is None:
        return None
    state = make_state()
    if with_local:
        state["zero"] = make_local(ctx.rank)
        kw["rank_local"] = "zero"
    info = gds_persist.save(state, path, process_group=group, **kw)
    return {"writers": info.writers, "rank_files": info.rank_files, "rank_bytes": info.rank_bytes,
            "balance": info.writer_balance, "placement": info.placement,
            "bytes": info.bytes_written, "type": type(info).__name__, "world": info.world_size}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def load_check(ctx: Any, m: int, path: str, strategy: str, local: str | None = None) -> Any:
    group = ctx.group(m)
    if group is None:
        return None
    before = _rchar()
    options = gds_persist.LoadOptions(strategy=strategy,
                                      rank_local="all" if local == "all" else None)
    out = gds_persist.load(path, process_group=group, options=options)
    read = _rchar() - before
    if local == "own":
        expected_local: Any = make_local(ctx.rank)
    elif local == "all":
        expected_local = {r: make_local(r) for r in range(len(out["zero"]))}
    else:
        expected_local = None
    return {"problems": check_loaded(out, expected_local), "read": read}


def load_into_check(ctx: Any, m: int, path: str, strategy: str) -> Any:
    """Restore in place over the group: every tensor of a live state with other values is
    filled, the same objects come back, and the bytes are the saved ones."""
    group = ctx.group(m)
    if group is None:
        return None
    live = make_state(seed=7)
    before = {id(t): t.data_ptr() for _, t in tensor_leaves(live)}
    out = gds_persist.load(path, process_group=group, into=live,
                           options=gds_persist.LoadOptions(strategy=strategy))
    problems = check_loaded(out)
    got = [t for _, t in tensor_leaves(out)]
    if [id(t) for t in got] != [id(t) for _, t in tensor_leaves(live)]:
        problems.append("load(into=) returned other tensor objects than it was given")
    if any(before[id(t)] != t.data_ptr() for t in got):
        problems.append("a destination moved")
    return problems


def save_expect_error(ctx: Any, n: int, path: str, kind: str, **kw: Any) -> Any:
    """Save where something goes wrong on some rank; return what this rank raised."""
    group = ctx.group(n)
    if group is None:
        return None
    state = make_state()
    if kind == "shape" and ctx.rank == 1:
        state["model"]["qkv"] = torch.zeros(64, 100, dtype=torch.float16)
    if kind == "values" and ctx.rank == 3:
        state["model"]["ids"] = state["model"]["ids"] + 1
    if kind == "key" and ctx.rank == 2:
        state["optimizer"]["extra"] = 1
    t0 = time.monotonic()
    try:
        gds_persist.save(state, path, process_group=group, **kw)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "failed_ranks": sorted(getattr(e, "failed_ranks", {}) or {}),
                "mro": [c.__name__ for c in type(e).__mro__]}
    return {"type": None, "seconds": time.monotonic() - t0}


def save_as_nodes(ctx: Any, path: str, ranks_per_node: int, **kw: Any) -> Any:
    """Pretend the ranks sit on nodes of ``ranks_per_node`` (GDS_PERSIST_NODE), then save."""
    os.environ["GDS_PERSIST_NODE"] = f"node{ctx.rank // ranks_per_node}"
    try:
        return save(ctx, ctx.world, path, **kw)
    finally:
        del os.environ["GDS_PERSIST_NODE"]


def load_expect_error(ctx: Any, m: int, path: str, **kw: Any) -> Any:
    group = ctx.group(m)
    if group is None:
        return None
    try:
        gds_persist.load(path, process_group=group, **kw)
    except Exception as e:  # noqa: BLE001
        return {"type": type(e).__name__, "message": str(e),
                "mro": [c.__name__ for c in type(e).__mro__]}
    return {"type": None}


def hang_one(ctx: Any, path: str, timeout_s: float) -> Any:
    """Rank 0 saves; the others never join. Rank 0 must give up after ``timeout_s``."""
    if ctx.rank != 0:
        return None
    t0 = time.monotonic()
    with settings.set(collective_timeout_s=timeout_s):
        try:
            gds_persist.save(make_state(), path, process_group=ctx.groups[ctx.world])
        except Exception as e:  # noqa: BLE001
            return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                    "mro": [c.__name__ for c in type(e).__mro__]}
    return {"type": None, "seconds": time.monotonic() - t0}


def zero_resume(ctx: Any, path: str) -> Any:
    """The docs' ZeRO example: DDP + ZeroRedundancyOptimizer, optimizer shards saved rank-local.

    Train 3 steps, save, train 2 more; then rebuild from scratch, load, train the same 2 steps.
    Two ranks, so every gradient all-reduce is a + b, whatever the bucket layout: the resumed
    run must then equal the uninterrupted one bit for bit."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = ctx.group(2)
    if group is None:
        return None

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 4)), process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-2, process_group=group)
        return model, opt

    def train(model: Any, opt: Any, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(3))
    state = {"model": model.module.state_dict(), "optimizer": opt.optim.state_dict(), "step": 3}
    gds_persist.save(state, path, process_group=group, rank_local="optimizer")
    saved_shard = {k: {n: v.clone() for n, v in s.items()}
                   for k, s in opt.optim.state_dict()["state"].items()}
    train(model, opt, range(3, 5))
    expected = [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    state = gds_persist.load(path, process_group=group)
    model.module.load_state_dict(state["model"])
    opt.optim.load_state_dict(state["optimizer"])
    shard_back = all(torch.equal(v, saved_shard[k][n])
                     for k, s in opt.optim.state_dict()["state"].items() for n, v in s.items())
    train(model, opt, range(state["step"], 5))
    params = list(model.parameters())
    return {"same": all(torch.equal(a, b) for a, b in zip(expected, params, strict=True)),
            "shard_back": shard_back and len(saved_shard) == len(opt.optim.state),
            "own_shard_tensors": len(opt.optim.state)}


def modified_state(local_rank: int | None = None) -> dict[str, Any]:
    """:func:`make_state` after a fine-tuning step that changed only a few tensors (issue 13)."""
    state = make_state()
    state["model"]["qkv"] = state["model"]["qkv"] + 1
    state["optimizer"]["state"][3]["exp_avg"] = state["optimizer"]["state"][3]["exp_avg"] * 2
    if local_rank is not None:
        local = make_local(local_rank)
        if local_rank == 1:
            local["shard"] = local["shard"] + 1
        state["zero"] = local
    return state


def save_incremental(ctx: Any, n: int, path: str, base: str | None, modified: bool,
                     with_local: bool = False, compression: str | None = None,
                     **kw: Any) -> dict[str, Any] | None:
    group = ctx.group(n)
    if group is None:
        return None
    if modified:
        state = modified_state(ctx.rank if with_local else None)
    else:
        state = make_state()
        if with_local:
            state["zero"] = make_local(ctx.rank)
    if with_local:
        kw["rank_local"] = "zero"
    info = gds_persist.save(state, path, process_group=group, base=base, **kw,
                            options=gds_persist.SaveOptions(content_hash=True,
                                                            compression=compression))
    return {"referenced": info.referenced_bytes, "bytes": info.bytes_written,
            "compression": info.compression, "payload": info.payload_bytes}


def load_modified(ctx: Any, m: int, path: str, strategy: str) -> Any:
    group = ctx.group(m)
    if group is None:
        return None
    out = gds_persist.load(path, process_group=group,
                           options=gds_persist.LoadOptions(strategy=strategy))
    return mismatches(out, modified_state(ctx.rank if "zero" in out else None))

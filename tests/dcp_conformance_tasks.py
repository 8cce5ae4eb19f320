"""Tasks for tests/test_dcp_conformance.py, run on every rank of a 2-process gloo
:class:`_gang.Gang` (module-level so spawn can pickle them). Each returns plain data to check."""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from gds_persist.dcp import GdsPersistReader, GdsPersistWriter


def full(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


class Recorder(DefaultLoadPlanner):
    """DCP's default planner, recording the address of every tensor it hands the reader."""

    def __init__(self) -> None:
        super().__init__()
        self.resolved: list[int] = []

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        t = super().resolve_tensor(read_item)
        self.resolved.append(t.data_ptr())
        return t


def dtensor_boxes(ctx: Any, path: str) -> dict[str, Any]:
    """Load a full tensor saved by one process as DTensors sharded along dim 1 (each rank's box
    cuts every saved row) and along dim 0 in float64: every byte lands in the local shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    cols = distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)])
    rows = distribute_tensor(torch.zeros(7, 3, dtype=torch.float64), mesh, [Shard(0)])
    before = [cols.to_local(), rows.to_local()]
    spans = [(t.untyped_storage().data_ptr(),
              t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()) for t in before]
    planner = Recorder()
    dcp.load({"w": cols, "odd": rows}, storage_reader=GdsPersistReader(path), planner=planner)
    return {
        "w_equal": torch.equal(cols.full_tensor(), full(10, 6, 1)),
        "odd_equal": torch.equal(rows.full_tensor(), full(7, 3, 2).double()),
        # every target the planner handed out lies in the local shards, which still have the
        # same memory: the bytes landed there
        "targets_in_shards": bool(planner.resolved) and all(
            any(lo <= p < hi for lo, hi in spans) for p in planner.resolved),
        "same_tensors": [cols.to_local().data_ptr(), rows.to_local().data_ptr()]
        == [t.data_ptr() for t in before],
    }


def sharded_and_rank_local(ctx: Any, root: str) -> dict[str, Any]:
    """A DTensor Shard(0), a ShardedTensor and rank-local keys saved by 2 ranks, loaded back
    by 2; returns what each rank found."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    with warnings.catch_warnings():  # ShardedTensor is deprecated in favour of DTensor
        warnings.simplefilter("ignore")
        from torch.distributed._shard.sharded_tensor import init_from_local_shards
        from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor.shard import Shard as StShard

        def sharded(fill: float) -> Any:
            local = torch.full((2, 4), fill + ctx.rank)
            meta = ShardMetadata([2 * ctx.rank, 0], [2, 4], f"rank:{ctx.rank}/cpu")
            return init_from_local_shards([StShard(local, meta)], [2 * ctx.world, 4])

        state = {"dt": distribute_tensor(full(9, 4, 3), mesh, [Shard(0)]), "st": sharded(10.0),
                 f"local.rank{ctx.rank}": torch.full((3,), float(ctx.rank)),
                 "shared": torch.arange(5.0)}
        path = os.path.join(root, "sharded")
        dcp.save(state, storage_writer=GdsPersistWriter(path))
        back = {"dt": distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0)]), "st": sharded(0.0),
                f"local.rank{ctx.rank}": torch.zeros(3), "shared": torch.zeros(5)}
        for shard in back["st"].local_shards():
            shard.tensor.zero_()
        dcp.load(back, storage_reader=GdsPersistReader(path))
        st_local = back["st"].local_shards()[0].tensor
    return {
        "dt": torch.equal(back["dt"].full_tensor(), full(9, 4, 3)),
        "st": torch.equal(st_local, torch.full((2, 4), 10.0 + ctx.rank)),
        "local": torch.equal(back[f"local.rank{ctx.rank}"], torch.full((3,), float(ctx.rank))),
        "shared": torch.equal(back["shared"], torch.arange(5.0)),
    }


class TrainState(Stateful):
    """DDP + Adam + a BytesIO blob, as a training loop hands DCP its state."""

    def __init__(self, model: Any, optim: Any, blob: bytes):
        self.model, self.optim, self.blob = model, optim, blob

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "blob": io.BytesIO(self.blob)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.blob = state["blob"].getvalue()


def _ddp_adam(seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optim


def stateful_ddp_adam(ctx: Any, root: str) -> dict[str, Any]:
    """Save a DDP + Adam + BytesIO train state after a step; restore it into a fresh one."""
    model, optim = _ddp_adam(0)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    path = os.path.join(root, "train")
    dcp.save({"app": TrainState(model, optim, b"rng-state-\x00\x01")},
             storage_writer=GdsPersistWriter(path))
    fresh_model, fresh_optim = _ddp_adam(1)
    fresh = TrainState(fresh_model, fresh_optim, b"")
    dcp.load({"app": fresh}, storage_reader=GdsPersistReader(path))
    saved_m, fresh_m = model.module.state_dict(), fresh_model.module.state_dict()
    exp_avg = [optim.state[p]["exp_avg"] for p in model.parameters()]
    got_avg = [fresh_optim.state[p]["exp_avg"] for p in fresh_model.parameters()]
    return {
        "model": all(torch.equal(saved_m[k], fresh_m[k]) for k in saved_m),
        "adam": all(torch.equal(a, b) for a, b in zip(exp_avg, got_avg, strict=True)),
        "step": [float(fresh_optim.state[p]["step"]) for p in fresh_model.parameters()],
        "blob": fresh.blob == b"rng-state-\x00\x01",
    }


class CountingStager:
    """A user's own AsyncStager: a host copy of every tensor, counted."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.staged = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.staged += 1
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def async_saves(ctx: Any, root: str) -> dict[str, Any]:
    """dcp.async_save with the writer as its own stager (cache_staged_state_dict: one staging
    copy reused), and with a stager of the user's; a tensor changed after async_save returns
    does not reach the checkpoint."""
    from torch.distributed.checkpoint.staging import AsyncStager

    out: dict[str, Any] = {"stager": isinstance(GdsPersistWriter(""), AsyncStager)}
    writer = GdsPersistWriter(cache_staged_state_dict=True)
    ptrs = []
    for step in range(2):
        w = torch.full((64,), float(step))
        fut = dcp.async_save({"w": w, "step": step}, storage_writer=writer,
                             checkpoint_id=os.path.join(root, f"async-a{step}"))
        w.add_(100)  # after staging: not in the checkpoint
        getattr(fut, "upload_completion", fut).result()
        assert writer.state_dict_cache is not None
        ptrs.append(writer.state_dict_cache["w"].data_ptr())
    out["cached_copy_reused"] = ptrs[0] == ptrs[1]
    out["writer_staged"] = []
    for step in range(2):
        back = {"w": torch.zeros(64), "step": -1}
        dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, f"async-a{step}")))
        out["writer_staged"].append(torch.equal(back["w"], torch.full((64,), float(step)))
                                    and back["step"] == step)
    stager = CountingStager()
    w = torch.ones(32)
    fut = dcp.async_save({"w": w}, storage_writer=GdsPersistWriter(os.path.join(root, "async-b")),
                         async_stager=stager)
    w.zero_()
    getattr(fut, "upload_completion", fut).result()
    back = {"w": torch.zeros(32)}
    dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, "async-b")))
    out["user_stager"] = stager.staged == 1 and torch.equal(back["w"], torch.ones(32))
    dist.barrier()
    return out

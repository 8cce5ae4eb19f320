"""Worker functions for tests/test_dcp.py, run in processes started by torch.multiprocessing.spawn
(gloo on 127.0.0.1). Kept out of the test module so children import only what they need.
Each worker writes its findings as JSON under ``root`` for the test to check."""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

BIG = 96 * 1024  # elements of the dominant replicated tensor (384 KiB of float32)
SPLIT_MIN = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def replicated_state(version: int = 0) -> dict:
    g = torch.Generator().manual_seed(1234 + version)
    return {
        "model": {
            "embed.weight": torch.randn(BIG, generator=g).reshape(-1, 64),
            "fc.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "fc.bias": torch.randn(16, generator=g),
            "norm": [torch.randn(8, generator=g) for _ in range(5)],
        },
        "step": 100 + version,
        "name": f"run-{version}",
        "mask": torch.rand(33, generator=g) > 0.5,
        "count": torch.tensor(7 + version, dtype=torch.int64),
    }


def zeros_like_state(sd: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return type(v)() if not isinstance(v, (int, float)) else 0

    return z(sd)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.view(torch.uint8) if a.dtype == torch.bool else a,
                b.view(torch.uint8) if b.dtype == torch.bool else b,
            )
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    return a == b


def full_sharded(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g)


def dtensor_state(mesh, placements) -> dict:
    from torch.distributed.tensor import distribute_tensor

    return {
        "w": distribute_tensor(full_sharded(10, 6, 1), mesh, placements),
        "odd": distribute_tensor(full_sharded(7, 3, 2).to(torch.float16), mesh, placements),
        "rep": torch.arange(12, dtype=torch.int32),
    }


class FailingPlanner(DefaultSavePlanner):
    """Fails on one rank in the middle of write_data (a save interrupted by an error)."""

    def __init__(self, fail_rank: int):
        super().__init__()
        self.fail_rank = fail_rank

    def resolve_data(self, write_item):
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


def save_scenarios(rank: int, world: int, port: int, root: str) -> None:
    init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    report: dict = {}
    # 1. replicated plain state dict, balanced and not
    sd = replicated_state()
    for name, bal in (("rep", True), ("rep_nobal", False)):
        w = GdsPersistWriter(os.path.join(root, name), balance=bal, split_min_bytes=SPLIT_MIN)
        dcp.save(sd, storage_writer=w)
        if rank == 0:
            report[f"{name}_rank_bytes"] = w.rank_bytes
        back = zeros_like_state(sd)
        dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, name)))
        report[f"{name}_roundtrip"] = same(back, sd)

    # 2. DTensor Shard(0) on a CPU device mesh
    mesh = init_device_mesh("cpu", (world,))
    dsd = dtensor_state(mesh, [Shard(0)])
    dcp.save(dsd, storage_writer=GdsPersistWriter(os.path.join(root, "dt")))
    back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in dsd.items()}
    dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, "dt")))
    report["dt_roundtrip"] = all(
        torch.equal(back[k].full_tensor(), dsd[k].full_tensor()) for k in ("w", "odd")
    ) and torch.equal(back["rep"], dsd["rep"])

    # 3. async_save (thread executor, DCP's default)
    sd2 = replicated_state(1)
    fut = dcp.async_save(sd2, storage_writer=GdsPersistWriter(os.path.join(root, "async")))
    fut = getattr(fut, "upload_completion", fut)
    fut.result()
    back = zeros_like_state(sd2)
    dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, "async")))
    report["async_roundtrip"] = same(back, sd2)

    # 4. a save interrupted by an error on rank 1 leaves the previous checkpoint intact
    path = os.path.join(root, "interrupted")
    dcp.save(replicated_state(0), storage_writer=GdsPersistWriter(path))
    try:
        dcp.save(
            replicated_state(2),
            storage_writer=GdsPersistWriter(path),
            planner=FailingPlanner(fail_rank=1),
        )
        report["interrupted_raised"] = False
    except BaseException as e:  # DCP raises CheckpointException (a BaseException)
        report["interrupted_raised"] = "injected failure" in str(e)
    dist.barrier()
    back = zeros_like_state(replicated_state(0))
    dcp.load(back, storage_reader=GdsPersistReader(path))
    report["interrupted_kept_previous"] = same(back, replicated_state(0))
    report["interrupted_leftovers"] = sorted(
        n for n in os.listdir(root) if n.startswith(".interrupted")
    )

    with open(os.path.join(root, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def load_scenarios(rank: int, world: int, port: int, root: str) -> None:
    """Load what a different world size saved (resharding by DCP's planner)."""
    init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    expected = dtensor_state(mesh, [Shard(0)])
    back = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in expected.items()
    }
    dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, "dt")))
    report = {
        "dt_local_shapes": [list(back[k].to_local().shape) for k in ("w", "odd")],
        "dt_equal": all(
            torch.equal(back[k].to_local(), expected[k].to_local()) for k in ("w", "odd")
        )
        and torch.equal(back["rep"], expected["rep"]),
    }
    sd = replicated_state()
    rep = zeros_like_state(sd)
    dcp.load(rep, storage_reader=GdsPersistReader(os.path.join(root, "rep")))
    report["rep_equal"] = same(rep, sd)
    with open(os.path.join(root, f"load{world}-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()

"""The plain loop under DistributedDataParallel, checkpointing every iteration with gds_persist.

    torchrun --nproc_per_node=2 examples/train_ddp.py --ckpt-dir /tmp/ddp --steps 20

gloo on CPU, NCCL on GPUs (one per rank), chosen automatically. Data-parallel replicas hold the
same state, so the checkpoint is written once per step:

* with the data-parallel scheduler (``gds_persist.save(..., process_group=...)``, when this
  gds_persist has it) every rank writes 1/N of the bytes, to the drives local to it;
* otherwise rank 0 writes it and the others wait at a barrier.

Resume: a relaunch (or a ``torchrun --max-restarts`` restart after a failure) finds
CKPT_DIR/latest and continues from its step; ``--stop-after K`` ends the run cleanly after step
K to try it.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gds_persist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_args import example_parser  # noqa: E402
from train_plain import batch, build, params_digest  # noqa: E402


def _takes_process_group(fn) -> bool:
    return "process_group" in inspect.signature(fn).parameters


def save_checkpoint(state: dict, path: str, rank: int) -> str:
    if _takes_process_group(gds_persist.save):  # the data-parallel scheduler: N writers
        gds_persist.save(state, path, process_group=dist.group.WORLD)
        return "all ranks (data-parallel scheduler)"
    if rank == 0:
        gds_persist.save(state, path)
    dist.barrier()
    return "rank 0"


def load_checkpoint(path: str, device: str) -> dict:
    if _takes_process_group(gds_persist.load):
        return gds_persist.load(path, map_location=device, process_group=dist.group.WORLD)
    return gds_persist.load(path, map_location=device)


def main() -> None:
    args = example_parser(__doc__, steps=20, width=256).parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)

    model, opt = build(args.width, device)
    latest = os.path.join(args.ckpt_dir, "latest")
    start = 1
    if os.path.exists(latest):
        ck = load_checkpoint(latest, device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start = ck["step"] + 1
        print(f"[rank {rank}] resumed from step {ck['step']}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)

    writer = "?"
    for step in range(start, args.steps + 1):
        x, y = batch(step, device, rank)  # each rank its own shard of the data
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        writer = save_checkpoint(
            {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "step": step,
                "world_size": world,
            },
            latest,
            rank,
        )
        if args.stop_after is not None and step >= args.stop_after:
            break
    print(
        f"[rank {rank}] done at step {step}; checkpoint written by {writer}; "
        f"params {params_digest(model)}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

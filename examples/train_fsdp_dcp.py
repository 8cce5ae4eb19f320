"""FSDP2 (``fully_shard``) training with PyTorch Distributed Checkpoint through gds_persist.

    torchrun --nproc_per_node=2 examples/train_fsdp_dcp.py --ckpt-dir /tmp/fsdp --steps 20

Parameters and optimizer state are sharded across ranks (DTensor ``Shard(0)``). Each iteration
starts ``dcp.async_save`` of the sharded state with ``GdsPersistWriter``: DCP stages a copy in
host memory, the writer writes every rank's shards with aligned direct I/O (kvikio/GDS on
GPUs when available), checksums them and commits CKPT_DIR/latest atomically, while the next
steps train (on its own gloo process group, so its collectives never interleave with
training's). Before the next checkpoint starts, the previous one must have finished.

On start, CKPT_DIR/latest (if present) is loaded with ``GdsPersistReader``; DCP reshards, so a
checkpoint written by any number of ranks (even one process, unsharded) resumes here.
gloo on CPU (``fully_shard`` works on a CPU device mesh in torch >= 2.6), NCCL on GPUs.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_args import example_parser  # noqa: E402
from train_plain import batch, build  # noqa: E402


class TrainState(Stateful):
    """What DCP saves and loads: model and optimizer state dicts (sharded DTensors)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer):
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def full_params_digest(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = example_parser(__doc__, steps=20, width=256).parse_args()
    warnings.filterwarnings("ignore", module="torch.distributed")

    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")  # async_save needs gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, (world,))
    # The background save runs collectives (planning) while training runs its own: give the
    # checkpoint its own process group, or the two interleave on one group and deadlock.
    ckpt_group = dist.new_group(backend="gloo")

    model, _ = build(args.width, device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"train": TrainState(model, optim), "step": 0}

    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        dcp.load(state, storage_reader=GdsPersistReader(latest))
        print(f"[rank {rank}] resumed from step {state['step']}", flush=True)
    start = state["step"] + 1

    pending = None
    step = start - 1
    for step in range(start, args.steps + 1):
        x, y = batch(step, device, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if pending is not None:
            pending.result()  # the previous checkpoint is durable and committed
        state["step"] = step
        pending = dcp.async_save(
            state, storage_writer=GdsPersistWriter(latest), process_group=ckpt_group
        )
        pending = getattr(pending, "upload_completion", pending)
        if args.stop_after is not None and step >= args.stop_after:
            break
    if pending is not None:
        pending.result()
    print(f"[rank {rank}] done at step {step}; params {full_params_digest(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

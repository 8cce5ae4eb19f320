"""One rank of a DeepSpeed run that ends as most training scripts do: its last call is
``save_checkpoint``, then the interpreter exits normally (no ``engine.destroy()``, no flush).
Run as a fresh interpreter by tests/test_deepspeed.py (an exit is what it tests, so no fork).

    python deepspeed_exit_worker.py SAVE_DIR RANK WORLD PORT {configured,explicit}

``configured``: ``attach(engine)`` with its defaults on a config asking for decoupled
checkpointing; ``explicit``: ``attach(engine, decoupled=True)``. The parameters as they were
at the last save go to ``SAVE_DIR/expected-RANK.pt`` (stock torch.save) for the test."""

from __future__ import annotations

import os
import sys

import torch

save_dir, rank, world, port, how = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                  LOCAL_WORLD_SIZE=str(world), CROSS_SIZE="1", CROSS_RANK="0",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
import deepspeed  # noqa: E402 - after the launcher's variables

from gds_persist.integrations.deepspeed import attach  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepspeed_tasks import DECOUPLED_CONFIG, _engine, _step  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
engine = _engine(deepspeed, 1, seed=0, extra=DECOUPLED_CONFIG if how == "configured" else None)
ours = attach(engine) if how == "configured" else attach(engine, decoupled=True)
assert ours.decoupled, ours.decoupled_reason  # the config's choice, or the explicit one
print("decoupled:", ours.decoupled_reason, flush=True)
for step in range(3):
    _step(engine, step, rank)
    engine.save_checkpoint(save_dir, tag=f"t{step}")
torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()},
           os.path.join(save_dir, f"expected-{rank}.pt"))
print("exiting with the last save pending:", ours.get_commit_info() is not None, flush=True)

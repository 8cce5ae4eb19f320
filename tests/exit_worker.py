"""One rank of tests/test_exit_after_collectives.py: a data-parallel save, a load, then the
interpreter exits at once, as a training script's last lines do.

Run as ``python tests/exit_worker.py RANK PORT DIR``; exits 0 when the rank got this far and the
interpreter shut down cleanly (an abort at shutdown exits -6).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import gds_persist

rank, port, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
pg = dist.group.WORLD  # held to the end, as scripts hold it
state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
gds_persist.save(state, where, process_group=pg)
back = gds_persist.load(where, process_group=pg)
assert torch.equal(back["w"], state["w"]) and back["step"] == 7
print(f"rank {rank} done", flush=True)

"""The Accelerate training loop of tests/test_accelerate.py, and its data-parallel worker (run in
processes started by torch.multiprocessing.spawn: Accelerate's MULTI_CPU over gloo on 127.0.0.1).
Kept out of the test module so children import only what they need; each worker writes its
findings as JSON under ``root`` for the test to check."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import accelerate
import numpy as np
import torch
from accelerate.utils import ProjectConfiguration

from gds_persist.integrations.accelerate import load_state, save_state


class Counter:
    """A registered object (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.n = 0
        self.history = np.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": self.history}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.history = sd["n"], sd["history"]


def setup(seed: int, **config: Any) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def steps(acc: Any, model: Any, opt: Any, sched: Any, counter: Counter, n: int) -> list[float]:
    """Training steps whose data and noise come from all three RNGs (and dropout's)."""
    losses = []
    for _ in range(n):
        x = torch.randn(8, 16)
        y = torch.from_numpy(np.random.standard_normal((8, 1)).astype(np.float32))
        loss = torch.nn.functional.mse_loss(model(x), y) * (1 + random.random())
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        counter.history = np.append(counter.history, loss.item())
        losses.append(loss.item())
    return losses


def data_parallel(rank: int, world: int, port: int, root: str) -> None:
    """Train 3 steps (each rank its own data and RNG streams), save_state, train 4 more; then
    disturb every state, load_state and train the 4 steps again."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    acc, model, opt, sched, counter = setup(0)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    steps(acc, model, opt, sched, counter, 3)
    ck = os.path.join(root, "ck")
    assert save_state(acc, ck) == ck
    expected = steps(acc, model, opt, sched, counter, 4)
    weights = [p.detach().clone() for p in model.parameters()]
    random.random()
    np.random.rand()
    torch.rand(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_state(acc, ck)
    restored_n = counter.n
    got = steps(acc, model, opt, sched, counter, 4)
    report = {
        "distributed_type": str(acc.distributed_type), "processes": acc.num_processes,
        "expected": expected, "got": got, "restored_n": restored_n,
        "weights_match": all(torch.equal(a, b) for a, b in zip(
            weights, model.parameters(), strict=True)),
        "lr": sched.get_last_lr(),
    }
    with open(os.path.join(root, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    acc.wait_for_everyone()
    acc.end_training()

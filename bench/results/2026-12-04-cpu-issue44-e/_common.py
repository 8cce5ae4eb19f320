"""What the scripts of this folder share: a fresh work folder holding the 1 GiB state saved as a
directory and as a gds torch file (``bench_loads.save_both``), and live tensors of its shapes to
restore into."""

from __future__ import annotations

import os
import shutil

import torch

from bench import bench_loads

Tensors = dict[str, torch.Tensor]


def prepared(work: str) -> tuple[Tensors, dict[str, str], Tensors]:
    """(state, paths, live) in a fresh ``work``."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    state = bench_loads.flat_state(1 << 30)
    live = {k: torch.zeros_like(t) for k, t in state.items()}
    return state, bench_loads.save_both(state, work), live

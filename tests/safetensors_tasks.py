"""Tasks of tests/test_safetensors_save.py run on every rank of a :class:`_gang.Gang`."""

from __future__ import annotations

from typing import Any

import torch

import gds_persist


def model_state() -> dict[str, torch.Tensor]:
    """A replicated flat state with a tie, the same on every rank (a fixed generator)."""
    g = torch.Generator().manual_seed(42)
    emb = torch.randn(300, 40, generator=g)
    return {"wte.weight": emb, "h.0.w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "h.0.b": torch.randn(64, generator=g), "lm_head.weight": emb,
            "pos": torch.arange(1000)}


def save_model(ctx: Any, n: int, path: str, shard: int) -> Any:
    """Ranks 0..n-1 save the replicated state as one model directory; their rank infos."""
    group = ctx.group(n)
    if group is None:
        return None
    info = gds_persist.save(model_state(), path, format="safetensors", process_group=group,
                            options=gds_persist.SaveOptions(max_shard_size=shard))
    return {"rank": info.rank, "writers": info.writers, "rank_bytes": info.rank_bytes,
            "files": info.files}

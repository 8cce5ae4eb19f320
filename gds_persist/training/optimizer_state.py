"""``init_optimizer_state``: give an optimizer its state tensors before a restore in place.

An optimizer creates its state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum buffers)
in its first ``step``; until then ``optimizer.state_dict()`` holds no tensors for
``load(into=...)`` to fill, and the checkpoint's moments would be loaded fresh and copied in.
Creating the state first, as ``torch.distributed.checkpoint.state_dict`` does for its loads, lets
the whole optimizer be restored in place.
"""

from __future__ import annotations

from typing import Any

import torch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state (so ``load(into=)`` can restore it in place) by one step
    with zero gradients and a learning rate of 0, leaving the parameters as they are (with
    ``lr=0`` neither the update nor decoupled weight decay moves them); the learning rates are
    put back and the gradients cleared. Does nothing if the optimizer already has state.

    Parameters:
        optimizer: any ``torch.optim.Optimizer`` whose groups have an ``lr``.

    Raises:
        ValueError: a parameter already holds a gradient, which the step would consume: call
            it before the backward pass.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        raise ValueError(
            "init_optimizer_state: some parameters already hold gradients, which a step would "
            "apply; call it before backward(), or after optimizer.zero_grad(set_to_none=True)")
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    saved = [_zero_lr(group) for group in optimizer.param_groups]
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _zero_lr(group: dict[str, Any]) -> Any:
    """Set a parameter group's learning rate to 0 (a tensor stays a tensor); return the old."""
    lr = group.get("lr")
    if lr is not None:
        group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    return lr

"""A Hugging Face Accelerate training loop with gds_persist checkpoints, resuming bit-exactly.

    python examples/train_accelerate.py --ckpt-dir /tmp/acc --steps 20 --stop-after 8
    python examples/train_accelerate.py --ckpt-dir /tmp/acc --steps 20     # resumes at step 8

``save_state(accelerator, path)`` / ``load_state(accelerator, path)`` from
``gds_persist.integrations.accelerate`` replace ``accelerator.save_state`` / ``load_state``: model,
optimizer, scheduler, RNG states (the dropout below uses them) and registered objects (the step
counter) in one atomic, fsynced, CRC32C-verified gds_persist directory, nothing pickled.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator

from gds_persist.integrations.accelerate import load_state, save_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_args import example_parser  # noqa: E402
from train_plain import params_digest  # noqa: E402


class Progress:
    """The training step, registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]



def main(argv: list[str] | None = None) -> str:
    ap = example_parser(__doc__, steps=20, width=64)
    ap.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    args = ap.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.Dropout(0.1),
                                torch.nn.GELU(), torch.nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.8)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        load_state(accelerator, latest)
        print(f"resumed from step {progress.step}")
    while progress.step < (args.stop_after or args.steps):
        x = torch.randn(64, 32, device=accelerator.device)  # the restored RNG decides the data
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        if progress.step % args.every == 0 or progress.step == args.steps:
            save_state(accelerator, latest)  # replaces the previous one atomically
    digest = params_digest(model)
    print(f"done at step {progress.step}; params {digest}")
    return digest


if __name__ == "__main__":
    main()

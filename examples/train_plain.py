"""A plain PyTorch training loop that checkpoints every iteration with gds_persist and resumes.

    python examples/train_plain.py --ckpt-dir /tmp/run1 --steps 20
    python examples/train_plain.py --ckpt-dir /tmp/run1 --steps 40     # resumes at step 21

Each iteration saves model, optimizer, step and RNG state to CKPT_DIR/latest. The save is atomic:
kill the program at any moment and CKPT_DIR/latest is the last complete checkpoint, so a rerun
resumes exactly where it left off (bit-for-bit the same result as an uninterrupted run).
On a GPU (--device cuda) tensors are saved from device memory (kvikio/GDS when available) and
loaded straight back onto the device. Sizes default to a few seconds on a CPU; raise --width.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
from example_args import example_parser

import gds_persist


def build(width: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, device: str, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: the same step always sees the same batch."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x.to(device), y.to(device)


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> str:
    ap = example_parser(__doc__, steps=20, width=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    model, opt = build(args.width, args.device)
    latest = os.path.join(args.ckpt_dir, "latest")
    start = 1
    if os.path.exists(latest):
        ck = gds_persist.load(latest, map_location=args.device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        torch.set_rng_state(ck["rng"].cpu())
        start = ck["step"] + 1
        print(f"resumed from step {ck['step']}")

    for step in range(start, args.steps + 1):
        x, y = batch(step, args.device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t0 = time.perf_counter()
        info = gds_persist.save(
            {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "step": step,
                "rng": torch.get_rng_state(),
                "loss": loss.item(),
            },
            latest,
        )
        if step == start or step == args.steps:
            print(
                f"step {step}: loss {loss.item():.5f}; checkpoint {info.bytes_written} bytes "
                f"with {info.backend} in {(time.perf_counter() - t0) * 1e3:.1f} ms"
            )
        if args.stop_after is not None and step >= args.stop_after:
            print(f"stopping after step {step}")
            break
    digest = params_digest(model)
    print(f"params {digest}")
    return digest


if __name__ == "__main__":
    main(sys.argv[1:])

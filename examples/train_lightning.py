"""PyTorch Lightning with gds_persist checkpoints: one plugin, nothing else changes.

    python examples/train_lightning.py --ckpt-dir /tmp/lit --steps 12 --stop-after 6
    python examples/train_lightning.py --ckpt-dir /tmp/lit --steps 12    # resumes at step 6

``Trainer(plugins=[GdsPersistCheckpointIO()])``: ModelCheckpoint keeps the 2 best checkpoints and
``last.ckpt`` as ``.ckpt`` files in torch.save's format (the plugin's default,
``format="torch"``), written by gds_persist's engine (aligned O_DIRECT writes, atomic, fsynced,
a CRC32C of every storage that gds_persist checks on load; ``torch.load`` opens them too), and
``trainer.fit(ckpt_path=...)`` resumes from them bit-exactly (checkpoints at epoch ends).
``--background`` writes each checkpoint from a host snapshot while training goes on.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from gds_persist.integrations.lightning import GdsPersistCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_args import example_parser  # noqa: E402
from train_plain import params_digest  # noqa: E402

BATCHES = 4  # per epoch; a checkpoint at each epoch end


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32 * BATCHES, 32, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
        return torch.utils.data.DataLoader(data, batch_size=32)



def main(argv: list[str] | None = None) -> str:
    ap = example_parser(__doc__, steps=12, width=64)
    ap.add_argument("--background", action="store_true", help="gds_persist's background writer")
    args = ap.parse_args(argv)

    last = os.path.join(args.ckpt_dir, "last.ckpt")
    resume = last if os.path.exists(last) else None
    torch.manual_seed(0)
    model = Regressor(args.width)
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=2, monitor="train_loss",
                                  save_last=True, every_n_train_steps=BATCHES)
    trainer = L.Trainer(
        max_steps=args.stop_after or args.steps, callbacks=[checkpoints], logger=False,
        plugins=[GdsPersistCheckpointIO(background=args.background)], accelerator="cpu",
        enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        if resume:  # resuming into the directory we checkpoint to is the point
            warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        trainer.fit(model, ckpt_path=resume)
    if resume:
        print(f"resumed from {resume}")
    digest = params_digest(model)
    kept = sorted(os.listdir(args.ckpt_dir))
    print(f"done at step {trainer.global_step}; params {digest}; checkpoints {kept}")
    return digest


if __name__ == "__main__":
    main()

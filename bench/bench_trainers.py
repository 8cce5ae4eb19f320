"""Lightning checkpoint I/O benchmark: TorchCheckpointIO vs gds_persist's plugin, same model.

A small LightningModule (an MLP of ``--width`` x ``--layers``, AdamW, a StepLR schedule) trains
for ``--steps`` steps with ModelCheckpoint(save_top_k=2, save_last=True) every ``--every`` steps
(so top-k replacement removes checkpoints too), once per method, methods interleaved over
``--runs`` runs:

  none                no checkpointing (the baseline of the step time)
  torch               Lightning's TorchCheckpointIO, plus fsync (see below)
  torch_async         AsyncCheckpointIO(torch): clone on the training thread, write in its thread
  gds                 GdsPersistCheckpointIO(): aligned O_DIRECT (or kvikio) + CRC32C + fsync
  gds_async           AsyncCheckpointIO(GdsPersistCheckpointIO())
  gds_background      GdsPersistCheckpointIO(background=True): snapshot into the Checkpointer's
                      reused (pinned) host arena on the training thread, gds_persist.save in
                      the plugin's thread

Reported per method: the mean training step time over all steps of all runs (checkpointing
steps included, so it carries the checkpoints' cost; its overhead over ``none`` in percent; a
median would hide the one-in-``--every`` steps that checkpoint), and, as medians, the time a
checkpoint blocks the training loop (``save_checkpoint`` as Lightning calls it), and the time
until a checkpoint is durable (the underlying write, in whichever thread).

Fairness: TorchCheckpointIO does not fsync (``torch.save`` into memory, then one buffered write);
here it is followed by an fsync of the file and of its directory, so every write figure includes
fsync, as gds_persist's do. Both write into the same directory (``--dir``, default a temporary
directory beside the current one) and both remove replaced top-k checkpoints the same way
(Lightning calls ``remove_checkpoint``). Don't run it on a busy machine.

    python bench/bench_trainers.py                     # CPU defaults
    python bench/bench_trainers.py --device cuda --width 4096 --layers 8
    python bench/bench_trainers.py --tiny              # smoke test (CI)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gds_persist  # noqa: E402
from bench.report import save_json  # noqa: E402
from gds_persist.integrations.lightning import GdsPersistCheckpointIO  # noqa: E402
from gds_persist.transfer.commit import fsync_path  # noqa: E402

METHODS = ("none", "torch", "torch_async", "gds", "gds_async", "gds_background")


class FsyncTorchCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO made durable: fsync of the file and its directory after the save."""

    def __init__(self, durations: list[float]):
        super().__init__()
        self.durations = durations

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        fsync_path(os.fspath(path))
        fsync_path(os.path.dirname(os.path.abspath(path)))
        self.durations.append(time.perf_counter() - t0)


class TimedGdsPersistCheckpointIO(GdsPersistCheckpointIO):
    """Records how long each write takes (in the caller's or the background thread)."""

    def __init__(self, durations: list[float], **kwargs: Any):
        super().__init__(**kwargs)
        self.durations = durations

    def _write(self, checkpoint: Any, path: str, kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        info = super()._write(checkpoint, path, kwargs)
        self.durations.append(time.perf_counter() - t0)
        return info


class Blocking(CheckpointIO):
    """Outermost wrapper: how long ``save_checkpoint`` holds the training loop."""

    def __init__(self, inner: CheckpointIO, durations: list[float]):
        self.inner, self.durations = inner, durations

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        self.inner.save_checkpoint(checkpoint, path, storage_options)
        self.durations.append(time.perf_counter() - t0)

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def make_plugin(method: str, blocking: list[float], durable: list[float]) -> Any:
    if method == "none":
        return None
    inner: CheckpointIO
    if method.startswith("torch"):
        inner = FsyncTorchCheckpointIO(durable)
    else:
        inner = TimedGdsPersistCheckpointIO(durable, background=method == "gds_background")
    if method.endswith("_async"):
        inner = AsyncCheckpointIO(inner)
    return Blocking(inner, blocking)


class Net(L.LightningModule):
    def __init__(self, width: int, layers: int, batch: int):
        super().__init__()
        self.batch = batch
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x = batch[0]
        loss = self.net(x).pow(2).mean()
        self.log("step_metric", float(self.global_step))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}

    def train_dataloader(self) -> Any:
        width = self.net[0].in_features
        data = torch.utils.data.TensorDataset(torch.randn(self.batch * 4, width))
        return torch.utils.data.DataLoader(data, batch_size=self.batch)


class StepTimer(Callback):
    """Wall time of each training step, checkpoint saves (in on_train_batch_end) included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t: float | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self._t is not None:
            self.times.append(time.perf_counter() - self._t)


def run_once(method: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    blocking: list[float] = []
    durable: list[float] = []
    plugin = make_plugin(method, blocking, durable)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    ckpt_dir = os.path.join(root, method)
    if plugin is not None:
        callbacks.append(ModelCheckpoint(
            dirpath=ckpt_dir, every_n_train_steps=args.every, save_top_k=2,
            monitor="step_metric", mode="max", save_last=True))
    torch.manual_seed(0)
    model = Net(args.width, args.layers, args.batch)
    trainer = L.Trainer(
        max_steps=args.steps, callbacks=callbacks, plugins=[plugin] if plugin else None,
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=plugin is not None,
    )
    trainer.fit(model)
    nbytes = 0
    if plugin is not None:
        last = os.path.join(ckpt_dir, "last.ckpt")
        nbytes = (os.path.getsize(last) if os.path.isfile(last)
                  else gds_persist.read_manifest(last).total_bytes)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    warm = timer.times[args.every:] or timer.times  # the first checkpoint interval warms up
    return {"step_s": warm, "blocking_s": blocking[1:] or blocking,
            "durable_s": durable[1:] or durable, "checkpoint_bytes": nbytes}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("width", 1024), ("layers", 8), ("batch", 32), ("steps", 40),
                          ("every", 5), ("runs", 3)):
        ap.add_argument(f"--{name}", type=int, default=default,
                        help="checkpoint every N steps" if name == "every" else None)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    ap.add_argument("--dir", help="where checkpoints go (default: a temporary directory here)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--tiny", action="store_true", help="smoke test: seconds, numbers meaningless")
    args = ap.parse_args(argv)
    if args.tiny:
        args.width, args.layers, args.batch, args.steps, args.every, args.runs = 32, 1, 4, 6, 2, 1
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    root = tempfile.mkdtemp(prefix="bench_trainers-", dir=args.dir or os.getcwd())
    samples: dict[str, dict[str, Any]] = {m: {"step_s": [], "blocking_s": [], "durable_s": []}
                                          for m in methods}
    try:
        with warnings.catch_warnings():  # Lightning's advice about workers and logging: noise
            warnings.simplefilter("ignore")
            for _ in range(args.runs):
                for m in methods:  # interleaved, so drift hits every method alike
                    r = run_once(m, args, root)
                    for key in ("step_s", "blocking_s", "durable_s"):
                        samples[m][key] += r[key]
                    samples[m]["checkpoint_bytes"] = r["checkpoint_bytes"]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    base = _mean(samples["none"]["step_s"]) if "none" in samples else None
    results: dict[str, Any] = {}
    for m in methods:
        s = samples[m]
        step = _mean(s["step_s"])
        results[m] = {
            "step_ms": None if step is None else step * 1e3,
            "overhead_pct": None if not (base and step) else 100 * (step / base - 1),
            "blocking_ms": None if not s["blocking_s"] else _median(s["blocking_s"]) * 1e3,
            "durable_ms": None if not s["durable_s"] else _median(s["durable_s"]) * 1e3,
            "checkpoint_mb": s.get("checkpoint_bytes", 0) / 2**20,
            "samples": len(s["step_s"]),
        }
    report = {"bench": "bench_trainers", "machine": platform.node(), "torch": torch.__version__,
              "lightning": L.__version__, "args": vars(args), "results": results}
    print(f"machine: {platform.node()}, torch {torch.__version__}, lightning {L.__version__}, "
          f"device {args.device}; MLP {args.layers}x{args.width}, AdamW; checkpoint every "
          f"{args.every} of {args.steps} steps, {args.runs} runs; every write includes fsync")
    print(f"{'method':<16}{'mean step':>10}{'overhead %':>12}{'blocks ms':>11}{'durable ms':>12}"
          f"{'ckpt MB':>9}")
    def cell(v: float | None, width: int, digits: int = 2) -> str:
        return ("-" if v is None else f"{v:.{digits}f}").rjust(width)

    for m, r in results.items():
        print(f"{m:<16}{cell(r['step_ms'], 10)}{cell(r['overhead_pct'], 12, 1)}"
              f"{cell(r['blocking_ms'], 11)}{cell(r['durable_ms'], 12)}"
              f"{r['checkpoint_mb']:9.2f}")
    return save_json(report, args.json)


if __name__ == "__main__":
    main()

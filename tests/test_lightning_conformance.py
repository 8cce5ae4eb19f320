"""The Lightning plugin through the situations Lightning's own CheckpointIO tests cover (our
tests, not theirs): a custom CheckpointIO subclass under ModelCheckpoint, AsyncCheckpointIO
wrapping, storage_options, remove_checkpoint, teardown, resume with ckpt_path="last", and
load_from_checkpoint with its arguments. The real Trainer on the CPU, tiny models."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from gds_persist.integrations.lightning import (  # noqa: E402
    STORAGE_OPTIONS,
    GdsPersistCheckpointIO,
    load_from_checkpoint,
)

BATCHES = 2
RESUMED_DIR_WARNING = "ignore:Checkpoint directory .* exists and is not empty:UserWarning"


class Net(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05, extra: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)
        if extra:  # a parameter a checkpoint of Net() lacks: strict=False loads around it
            self.bonus = torch.nn.Parameter(torch.full((3,), 7.0))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES, 8, generator=g),
                                              torch.randn(4 * BATCHES, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, root: str = "/data"):
        super().__init__()
        self.save_hyperparameters()

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 11}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]

    def train_dataloader(self) -> Any:
        return Net().train_dataloader()


class Recording(GdsPersistCheckpointIO):
    """A user's own CheckpointIO built on the plugin, as Lightning's docs show for custom IO."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.calls: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        self.calls.append(("save", os.path.basename(path)))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self.calls.append(("load", os.path.basename(path)))
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(("remove", os.path.basename(path)))
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        self.calls.append(("teardown", ""))
        super().teardown()


def trainer(plugin: Any, dirpath: Path | None, steps: int, **checkpoint: Any) -> Any:
    callbacks = ([ModelCheckpoint(dirpath=dirpath, every_n_train_steps=BATCHES, **checkpoint)]
                 if dirpath is not None else [])
    return L.Trainer(max_steps=steps, plugins=[plugin], callbacks=callbacks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     enable_checkpointing=dirpath is not None)


def test_custom_checkpoint_io_under_model_checkpoint(tmp_path: Path) -> None:
    io = Recording()
    t = trainer(io, tmp_path, 3 * BATCHES, save_top_k=1)  # no monitor: the newest is kept
    assert t.strategy.checkpoint_io is io  # the Trainer uses the user's subclass as given
    torch.manual_seed(0)
    t.fit(Net())
    saves = [p for op, p in io.calls if op == "save"]
    removes = [p for op, p in io.calls if op == "remove"]
    assert saves == [f"epoch={e}-step={BATCHES * (e + 1)}.ckpt" for e in range(3)]
    kept = os.listdir(tmp_path)
    assert len(kept) == 1 and sorted(removes + kept) == sorted(saves)  # top-1, the rest removed
    assert gds_persist.verify(tmp_path / kept[0]).ok
    assert io.calls[-1] == ("teardown", "")  # the strategy tears the plugin down after fit


@pytest.mark.filterwarnings(RESUMED_DIR_WARNING)
@pytest.mark.parametrize("wrap", ["plain", "async wrapper", "background"])
def test_resume_with_ckpt_path_last(tmp_path: Path, wrap: str) -> None:
    def plugin() -> Any:
        if wrap == "async wrapper":
            return AsyncCheckpointIO(Recording())
        return Recording(background=wrap == "background")

    torch.manual_seed(0)
    straight = Net()
    trainer(Recording(), None, 3 * BATCHES).fit(straight)
    torch.manual_seed(0)
    trainer(plugin(), tmp_path, 2 * BATCHES, save_last=True).fit(Net())
    assert gds_persist.verify(tmp_path / "last.ckpt").ok  # written by the time fit returns
    resumed_io = plugin()
    t = trainer(resumed_io, tmp_path, 3 * BATCHES, save_last=True)
    resumed = Net()
    t.fit(resumed, ckpt_path="last")  # Lightning finds last.ckpt, our plugin reads it
    inner = resumed_io.checkpoint_io if wrap == "async wrapper" else resumed_io
    assert ("load", "last.ckpt") in inner.calls
    assert t.global_step == 3 * BATCHES
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name  # epoch-end resume continues exactly


def test_async_wrapper_saves_removes_and_tears_down(tmp_path: Path) -> None:
    io = Recording()
    wrapper = AsyncCheckpointIO(io)
    t = trainer(wrapper, tmp_path, 2 * BATCHES, save_top_k=1)
    t.fit(Net())  # teardown joins the wrapper's thread: every write is committed
    # the removal of the replaced one waited for its write on the wrapper's thread
    assert sorted(io.calls) == [("remove", "epoch=0-step=2.ckpt"), ("save", "epoch=0-step=2.ckpt"),
                                ("save", "epoch=1-step=4.ckpt")]
    assert os.listdir(tmp_path) == ["epoch=1-step=4.ckpt"]
    assert gds_persist.verify(tmp_path / "epoch=1-step=4.ckpt").ok
    t.save_checkpoint(tmp_path / "manual.ckpt")  # after fit: a new thread, then wait for it
    wrapper.teardown()
    assert gds_persist.load(tmp_path / "manual.ckpt")["global_step"] == 2 * BATCHES


def test_storage_options_accepted_and_refused(tmp_path: Path) -> None:
    t = trainer(GdsPersistCheckpointIO(), None, BATCHES)
    t.fit(Net())
    t.save_checkpoint(tmp_path / "a.ckpt", storage_options={"backend": "buffered"})
    assert gds_persist.read_manifest(tmp_path / "a.ckpt").writer["backend"] == "buffered"
    assert {"backend", "base", "progress", "options"} == STORAGE_OPTIONS
    with pytest.raises(TypeError, match=r"io_threads is a setting since 0.2: use `with "
                                        r"gds_persist.settings.set\(io_threads=...\)`"):
        t.save_checkpoint(tmp_path / "b.ckpt", storage_options={"io_threads": 2})
    with pytest.raises(TypeError, match=r"use options=gds_persist.SaveOptions\(compression"):
        GdsPersistCheckpointIO(compression="lossless")
    with pytest.raises(TypeError, match=r"storage_options must be None or a dict of "
                                        r"gds_persist.save keywords \(.*backend.*\), not str"):
        t.save_checkpoint(tmp_path / "b.ckpt", storage_options="s3://bucket")
    with pytest.raises(TypeError, match=r"unknown storage option\(s\) \['acl'\]"):
        t.save_checkpoint(tmp_path / "b.ckpt", storage_options={"acl": "private"})
    with pytest.raises(TypeError, match=r"GdsPersistCheckpointIO\(\.\.\.\): unknown storage "
                                        r"option\(s\) \['process_group'\]"):
        GdsPersistCheckpointIO(process_group=None)  # Lightning saves from rank zero only
    background = GdsPersistCheckpointIO(background=True)  # refused here, not in the thread
    with pytest.raises(TypeError, match="unknown storage option"):
        background.save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.ckpt", {"acl": 1})
    background.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]


def test_remove_checkpoint_through_the_strategy(tmp_path: Path) -> None:
    t = trainer(GdsPersistCheckpointIO(), None, BATCHES)
    t.fit(Net())
    t.save_checkpoint(tmp_path / "x.ckpt")
    t.strategy.remove_checkpoint(tmp_path / "x.ckpt")  # what ModelCheckpoint calls
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Net]:
    root = tmp_path_factory.mktemp("lfc")
    torch.manual_seed(0)
    model = Net(width=8, lr=0.01)
    t = trainer(GdsPersistCheckpointIO(), None, BATCHES)
    t.fit(model, datamodule=Data(batch_size=4, root="/runs/a"))
    t.save_checkpoint(root / "model.ckpt")
    (root / "hparams.yaml").write_text("width: 8\nlr: 0.5\nextra: false\n")
    return root, model


def test_lightning_own_loader_reads_the_plugin_s_file(written: tuple[Path, Net],
                                                     tmp_path: Path) -> None:
    """The default format is torch.save's: Lightning's own load_from_checkpoint reads it (no
    gds_persist call); the directory format needs ours (Lightning opens the path as a file)."""
    root, trained = written
    model = Net.load_from_checkpoint(root / "model.ckpt")
    assert model.hparams.lr == 0.01
    for (name, a), b in zip(trained.state_dict().items(), model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    t = trainer(GdsPersistCheckpointIO(format="directory"), None, BATCHES)
    t.fit(Net(width=8, lr=0.01), datamodule=Data(batch_size=4, root="/runs/a"))
    t.save_checkpoint(tmp_path / "dir.ckpt")
    with pytest.raises(IsADirectoryError):
        Net.load_from_checkpoint(tmp_path / "dir.ckpt")
    assert load_from_checkpoint(Net, tmp_path / "dir.ckpt").hparams.lr == 0.01


def test_load_from_checkpoint_with_lightning_arguments(written: tuple[Path, Net]) -> None:
    root, trained = written
    path = root / "model.ckpt"
    model = load_from_checkpoint(Net, path)
    assert isinstance(model, Net) and model.hparams.lr == 0.01
    for (name, a), b in zip(trained.state_dict().items(), model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    overridden = load_from_checkpoint(Net, path, map_location="cpu", lr=0.3)  # overrides
    assert overridden.hparams.lr == 0.3 and overridden.layer.weight.device.type == "cpu"
    from_file = load_from_checkpoint(Net, path, hparams_file=root / "hparams.yaml")
    assert from_file.hparams.lr == 0.5
    with pytest.raises(RuntimeError, match="Missing key.*bonus"):
        load_from_checkpoint(Net, path, extra=True)  # strict by default, as Lightning
    with pytest.warns(UserWarning, match=r"not in the checkpoint: \['bonus'\]"):  # Lightning's
        loose = load_from_checkpoint(Net, path, strict=False, extra=True)
    assert torch.equal(loose.bonus, torch.full((3,), 7.0))
    assert torch.equal(loose.layer.weight, trained.layer.weight)
    mapped = load_from_checkpoint(Net, path, map_location=lambda storage, loc: storage)
    assert torch.equal(mapped.layer.bias, trained.layer.bias)
    with pytest.raises(ValueError, match=r"\.csv, \.yml or \.yaml"):
        load_from_checkpoint(Net, path, hparams_file=root / "hparams.json")


def test_load_from_checkpoint_of_a_datamodule_and_a_torch_file(written: tuple[Path, Net],
                                                              tmp_path: Path) -> None:
    root, trained = written
    data = load_from_checkpoint(Data, root / "model.ckpt")
    assert isinstance(data, Data) and data.hparams.root == "/runs/a" and data.seen == 11
    assert load_from_checkpoint(Data, root / "model.ckpt", batch_size=16).hparams.batch_size == 16
    # a torch.save file (TorchCheckpointIO's) loads through the same function
    torch.save(GdsPersistCheckpointIO().load_checkpoint(root / "model.ckpt"), tmp_path / "f.ckpt")
    again = load_from_checkpoint(Net, tmp_path / "f.ckpt", weights_only=False)
    assert torch.equal(again.layer.weight, trained.layer.weight)
    with pytest.raises(TypeError, match="is not a LightningModule or LightningDataModule"):
        load_from_checkpoint(torch.nn.Linear, root / "model.ckpt")


def test_a_removal_waits_for_the_save_of_that_path_on_another_thread(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    class Slow(GdsPersistCheckpointIO):
        def _write(self, flat: Any, path: str, kwargs: dict[str, Any]) -> Any:
            entered.set()
            release.wait(60)
            return super()._write(flat, path, kwargs)

    io = Slow(timeout_s=0.5)
    saver = threading.Thread(target=io.save_checkpoint,
                             args=({"w": torch.ones(2)}, tmp_path / "a.ckpt"))
    saver.start()
    assert entered.wait(60)
    with pytest.raises(gds_persist.CheckpointTimeout, match=r"a\.ckpt.*did not finish within "
                                                            r"0\.5 s.*not removed"):
        io.remove_checkpoint(tmp_path / "a.ckpt")  # bounded: never hangs on a stuck save
    release.set()
    saver.join(60)
    assert gds_persist.verify(tmp_path / "a.ckpt").ok
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []

"""The Lightning CheckpointIO plugin with the real Lightning Trainer on CPU: ModelCheckpoint
(top-k, save_last, its file names), resume with ckpt_path continuing bit-identically, Lightning's
AsyncCheckpointIO wrapper and the plugin's own background writer, whole-directory removal."""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gds_persist

L = pytest.importorskip("lightning.pytorch")
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from gds_persist.integrations.lightning import (  # noqa: E402
    GdsPersistCheckpointIO,
    pytorch_lightning_checkpoint_io,
)

BATCHES = 3  # per epoch; checkpoints every epoch end (mid-epoch resume is not exact in Lightning)
STEPS = 4 * BATCHES
RESUMED_DIR_WARNING = "ignore:Checkpoint directory .* exists and is not empty:UserWarning"


class Tiny(L.LightningModule):
    def __init__(self, width: int = 16, data_dir: Any = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(8 * BATCHES, 16, generator=g), torch.randn(8 * BATCHES, 1, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=8)


def fit(steps: int, plugin: Any = None, dirpath: Path | None = None, ckpt_path: Any = None,
        **checkpoint: Any) -> tuple[Tiny, Any]:
    torch.manual_seed(0)
    model = Tiny(**checkpoint.pop("model", {}))
    callbacks = []
    if dirpath is not None:
        kw = {"save_top_k": 2, "monitor": "train_loss", "save_last": True,
              "every_n_train_steps": BATCHES, **checkpoint}
        callbacks.append(ModelCheckpoint(dirpath=dirpath, **kw))
    trainer = L.Trainer(
        max_steps=steps, callbacks=callbacks, plugins=[plugin] if plugin else None, logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        enable_checkpointing=dirpath is not None,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, (callbacks[0] if callbacks else None)


@pytest.fixture(scope="module")
def uninterrupted() -> Tiny:
    return fit(STEPS)[0]


PLUGINS = {
    "plugin": lambda: GdsPersistCheckpointIO(),
    "async wrapper": lambda: AsyncCheckpointIO(GdsPersistCheckpointIO()),
    "background": lambda: GdsPersistCheckpointIO(background=True),
}


@pytest.mark.filterwarnings(RESUMED_DIR_WARNING)
@pytest.mark.parametrize("kind", PLUGINS)
def test_resume_continues_bit_identically(tmp_path: Path, uninterrupted: Tiny, kind: str) -> None:
    first, _ = fit(2 * BATCHES, PLUGINS[kind](), tmp_path)
    last = tmp_path / "last.ckpt"
    assert gds_persist.verify(last).checksum == "crc32c"  # our file: every CRC32C good
    resumed, callback = fit(STEPS, PLUGINS[kind](), tmp_path, ckpt_path=last)
    assert first.losses + resumed.losses == uninterrupted.losses
    for (name, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    # top-k (2) + last, in ModelCheckpoint's names; replaced ones removed whole, nothing hidden
    assert sorted(os.listdir(tmp_path)) == ["epoch=2-step=9.ckpt", "epoch=3-step=12.ckpt",
                                            "last.ckpt"]
    assert set(callback.best_k_models) == {str(tmp_path / "epoch=2-step=9.ckpt"),
                                           str(tmp_path / "epoch=3-step=12.ckpt")}
    for name in os.listdir(tmp_path):  # torch.save files, as TorchCheckpointIO writes them
        assert torch.load(tmp_path / name, weights_only=True)["pytorch-lightning_version"]
    state = gds_persist.load(tmp_path / "epoch=3-step=12.ckpt")
    assert state["global_step"] == STEPS and state["epoch"] == 3
    assert state["hyper_parameters"] == {"width": 16, "data_dir": None}


@pytest.mark.filterwarnings(RESUMED_DIR_WARNING)
def test_save_last_link_and_resume_through_it(tmp_path: Path, uninterrupted: Tiny) -> None:
    first, _ = fit(2 * BATCHES, GdsPersistCheckpointIO(), tmp_path, save_last="link")
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=6.ckpt"
    resumed, _ = fit(STEPS, GdsPersistCheckpointIO(), tmp_path, ckpt_path=tmp_path / "last.ckpt",
                     save_last="link")
    assert first.losses + resumed.losses == uninterrupted.losses
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=3-step=12.ckpt"


@pytest.mark.filterwarnings(RESUMED_DIR_WARNING)
def test_resume_a_torch_checkpoint_run(tmp_path: Path, uninterrupted: Tiny) -> None:
    """A run checkpointed by TorchCheckpointIO resumes with the plugin in the same directory;
    its last.ckpt file is replaced by a gds_persist directory."""
    first, _ = fit(2 * BATCHES, TorchCheckpointIO(), tmp_path)
    assert (tmp_path / "last.ckpt").is_file()
    resumed, _ = fit(STEPS, GdsPersistCheckpointIO(), tmp_path, ckpt_path=tmp_path / "last.ckpt")
    assert first.losses + resumed.losses == uninterrupted.losses
    assert gds_persist.verify(tmp_path / "last.ckpt").ok
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_remove_checkpoint_removes_whole_directories(tmp_path: Path) -> None:
    io = GdsPersistCheckpointIO(format="directory")
    path = tmp_path / "epoch=0-step=3.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "epoch": 0}, path)
    assert sorted(os.listdir(path)) == ["data-00000.bin", "manifest.json"]
    io.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []
    GdsPersistCheckpointIO().save_checkpoint({"epoch": 0}, path)  # the default: a file
    assert path.is_file()
    io.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []
    io.remove_checkpoint(path)  # already gone: nothing to do
    (tmp_path / "target").mkdir()
    os.symlink("target", tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # the link, not what it points to
    assert os.listdir(tmp_path) == ["target"]
    with pytest.raises(gds_persist.CheckpointError, match=r"target is not a gds_persist "
                                                          r"checkpoint directory.*refusing"):
        io.remove_checkpoint(tmp_path / "target")


def test_background_writer_orders_saves_removals_and_errors(tmp_path: Path) -> None:
    io = GdsPersistCheckpointIO(background=True)
    w = torch.arange(10.0)
    io.save_checkpoint({"w": w, "step": 1}, tmp_path / "a.ckpt")
    w += 100  # the snapshot was taken before save_checkpoint returned
    io.remove_checkpoint(tmp_path / "a.ckpt")  # waits for the write, then removes it
    assert not (tmp_path / "a.ckpt").exists()
    io.save_checkpoint({"w": w, "step": 2}, tmp_path / "b.ckpt")
    got = io.load_checkpoint(tmp_path / "b.ckpt")
    assert torch.equal(got["w"], torch.arange(10.0) + 100) and got["step"] == 2
    with pytest.raises(TypeError, match=r"cannot be pickled into a torch.save file"):
        io.save_checkpoint({"bad": lambda: 0}, tmp_path / "c.ckpt")  # refused before any copy
    io.teardown()
    assert not (tmp_path / "c.ckpt").exists()


def test_background_errors_surface_at_the_next_call(tmp_path: Path) -> None:
    io = GdsPersistCheckpointIO(background=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a checkpoint")
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "taken")  # fails in the thread
    with pytest.raises(gds_persist.CheckpointError, match=r"taken is not a gds_persist "
                                                          r"checkpoint directory.*refusing"):
        io.wait()
    assert sorted(os.listdir(tmp_path)) == ["taken"]  # its files untouched, nothing staged left
    assert (tmp_path / "taken" / "notes.txt").read_text() == "not a checkpoint"
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "ok.ckpt")  # the writer goes on
    io.teardown()
    assert io.last_info is not None and io.last_info.path == str(tmp_path / "ok.ckpt")


def test_a_trainer_holding_the_plugin_deep_copies_and_pickles(tmp_path: Path) -> None:
    """Lightning deep-copies trainer.callbacks (its test_callbacks_state_fit_ckpt_path): the
    progress bar holds the trainer, so the plugin, whose locks cannot be copied; and
    torch.save(trainer) pickles it. A copy is a fresh plugin with the same options."""
    io = GdsPersistCheckpointIO(background=True, verify=False, timeout_s=60.0,
                                snapshot_bytes=1 << 20, backend="buffered")
    trainer = L.Trainer(max_steps=1, plugins=[io], logger=False, accelerator="cpu",
                        enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.fit(Tiny())
    (bar,) = copy.deepcopy([c for c in trainer.callbacks if isinstance(c, ProgressBar)])
    torch.save(trainer, tmp_path / "trainer.pt")
    unpickled = torch.load(tmp_path / "trainer.pt", weights_only=False)
    for twin in (bar.trainer.strategy.checkpoint_io, unpickled.strategy.checkpoint_io):
        assert isinstance(twin, GdsPersistCheckpointIO) and twin is not io
        assert (twin.background, twin.verify, twin.timeout_s, twin.save_kwargs,
                twin._writer.capacity) == (True, False, 60.0, {"backend": "buffered"}, 1 << 20)
        assert twin._saving is not io._saving and twin._writer is not io._writer
        assert twin.last_info is None
        path = tmp_path / f"{id(twin)}.ckpt"
        twin.save_checkpoint({"w": torch.arange(6.0)}, path)  # through its own thread
        assert torch.equal(twin.load_checkpoint(path)["w"], torch.arange(6.0))
        twin.teardown()
        assert gds_persist.verify(path).ok


def test_a_copy_keeps_removals_waiting_for_its_saves(tmp_path: Path) -> None:
    """The copy's own lock still makes a removal wait for a save of that path running on
    another thread (AsyncCheckpointIO's); without it the removal finds nothing, the save
    commits after it and the checkpoint stays."""
    in_write, release = threading.Event(), threading.Event()

    def hold(done: int, total: int) -> None:  # the save stays inside its write until released
        in_write.set()
        assert release.wait(60)

    io = copy.deepcopy(GdsPersistCheckpointIO(progress=hold))
    path = tmp_path / "a.ckpt"
    saver = threading.Thread(target=io.save_checkpoint, args=({"w": torch.ones(4096)}, path))
    saver.start()
    assert in_write.wait(60)
    remover = threading.Thread(target=io.remove_checkpoint, args=(path,))
    remover.start()
    try:
        remover.join(0.2)
        waited = remover.is_alive()  # waiting for the save (one that did not wait is done)
    finally:
        release.set()
    saver.join(60)
    remover.join(60)
    assert waited and not saver.is_alive() and not remover.is_alive()
    assert os.listdir(tmp_path) == []  # saved, then removed whole


def _shared_state() -> dict[str, Any]:
    emb = torch.randn(64, 32)  # 8 KiB: more than the small arena below
    return {"state_dict": {"wte": emb, "lm_head": emb, "row": emb[2], "t": emb.t()},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(64, 32)}}}],
            "loops": {"step": 3}}


@pytest.mark.parametrize("kind", ["plain", "background", "background small arena"])
def test_shared_storages_stay_shared_and_devices_are_recorded(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """Background mode snapshots through the Checkpointer's machinery: each storage is copied
    once (tied weights and views stay one storage) and keeps its device in the manifest."""
    kwargs: dict[str, Any] = {"background": kind != "plain"}
    if kind == "background small arena":
        kwargs["snapshot_bytes"] = 4096  # smaller than a checkpoint: written from live tensors
    io = GdsPersistCheckpointIO(**kwargs)
    state = _shared_state()
    for step in range(3):  # the arena is reused from one save to the next
        io.save_checkpoint(state, tmp_path / f"s{step}.ckpt")
    expected = {k: v.clone() for k, v in state["state_dict"].items()}
    state["state_dict"]["wte"].add_(1)  # after save_checkpoint returned
    io.teardown()
    fallbacks = [r for r in caplog.records if "from the live tensors" in r.getMessage()]
    assert len(fallbacks) == (3 if kind == "background small arena" else 0)
    m = gds_persist.read_manifest(tmp_path / "s2.ckpt")
    assert len(m.storages) == 2 and [s.device for s in m.storages] == ["cpu", "cpu"]
    got = io.load_checkpoint(tmp_path / "s2.ckpt")["state_dict"]
    ptrs = {k: t.untyped_storage().data_ptr() for k, t in got.items()}
    assert len(set(ptrs.values())) == 1  # one storage, as saved
    if kind != "background small arena":  # (that one wrote the live tensors, before the add_)
        for k, t in expected.items():
            assert torch.equal(got[k], t), k
    assert got["t"].stride() == (1, 32) and torch.equal(got["row"], got["wte"][2])


@pytest.mark.gpu
def test_background_snapshot_keeps_the_cuda_device(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    emb = torch.randn(64, 32, device="cuda")
    io = GdsPersistCheckpointIO(background=True)
    io.save_checkpoint({"state_dict": {"wte": emb, "lm_head": emb, "col": emb[:, 1]},
                        "cpu": torch.ones(2)}, tmp_path / "c.ckpt")
    io.teardown()
    m = gds_persist.read_manifest(tmp_path / "c.ckpt")
    assert sorted(s.device for s in m.storages) == ["cpu", f"cuda:{emb.device.index}"]
    got = gds_persist.load(tmp_path / "c.ckpt")["state_dict"]  # to the saved devices
    assert got["wte"].is_cuda and got["wte"].data_ptr() == got["lm_head"].data_ptr()
    assert torch.equal(got["col"], emb[:, 1])


def test_hyperparameters_with_extra_leaves_and_the_pickle_option(tmp_path: Path) -> None:
    """The directory format stores these leaves by value, and pickles only with allow_pickle."""
    hp = {"data_dir": pathlib.Path("/data"), "grid": np.linspace(0, 1, 3),
          "cfg": argparse.Namespace(depth=2), "lr": np.float32(0.5)}
    io = GdsPersistCheckpointIO(format="directory")
    io.save_checkpoint({"hyper_parameters": hp, "epoch": 1}, tmp_path / "ok.ckpt")
    got = io.load_checkpoint(tmp_path / "ok.ckpt")["hyper_parameters"]
    assert got["data_dir"] == hp["data_dir"] and got["cfg"] == hp["cfg"]
    assert np.array_equal(got["grid"], hp["grid"]) and got["lr"] == hp["lr"]

    hp["callback"] = Marker(3)
    with pytest.raises(TypeError, match=r"at \['hyper_parameters'\]\['callback'\]: .*with "
                                        r"Lightning: GdsPersistCheckpointIO\(allow_pickle=True\)"):
        io.save_checkpoint({"hyper_parameters": hp}, tmp_path / "refused.ckpt")
    GdsPersistCheckpointIO(format="directory", allow_pickle=True).save_checkpoint(
        {"hyper_parameters": hp}, tmp_path / "pickled.ckpt")
    with pytest.raises(gds_persist.PickleRefusedError, match=r"\['hyper_parameters'\]\['callb"):
        io.load_checkpoint(tmp_path / "pickled.ckpt")
    trusting = GdsPersistCheckpointIO(safe_globals=[Marker])
    assert trusting.load_checkpoint(tmp_path / "pickled.ckpt")["hyper_parameters"][
        "callback"].x == 3


def test_python_objects_in_a_torch_file_load_as_lightning_loads_them(tmp_path: Path) -> None:
    """The default format keeps what TorchCheckpointIO keeps; objects beyond tensors and
    containers load with weights_only=False (trusted files) or their classes allowed."""
    hp = {"data_dir": pathlib.Path("/data"), "callback": Marker(3)}
    io = GdsPersistCheckpointIO()
    io.save_checkpoint({"hyper_parameters": hp, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(gds_persist.PickleRefusedError, match=r"weights_only=False"):
        io.load_checkpoint(tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)["hyper_parameters"]
    assert got["data_dir"] == hp["data_dir"] and got["callback"].x == 3
    trusting = GdsPersistCheckpointIO(safe_globals=[Marker, type(hp["data_dir"])])
    assert trusting.load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"]["callback"].x == 3
    assert torch.load(tmp_path / "a.ckpt", weights_only=False)["hyper_parameters"][
        "data_dir"] == hp["data_dir"]


class Marker:
    def __init__(self, x: int):
        self.x = x


def test_model_hyperparameters_travel_through_fit(tmp_path: Path) -> None:
    model, _ = fit(BATCHES, GdsPersistCheckpointIO(), tmp_path,
                   model={"data_dir": pathlib.Path("/runs/a")})
    hp = gds_persist.load(tmp_path / "last.ckpt",
                          options=gds_persist.LoadOptions(weights_only=False))["hyper_parameters"]
    assert hp == {"width": 16, "data_dir": pathlib.Path("/runs/a")}
    assert model.hparams.data_dir == pathlib.Path("/runs/a")


def test_pytorch_lightning_namespace(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_fabric.plugins import CheckpointIO

    io = pytorch_lightning_checkpoint_io()
    assert isinstance(io, CheckpointIO)  # the class pytorch_lightning's Trainer checks for

    class PlTiny(pl.LightningModule):  # type: ignore[name-defined,misc]
        training_step = Tiny.training_step
        configure_optimizers = Tiny.configure_optimizers
        train_dataloader = Tiny.train_dataloader

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(16, 1)
            self.losses: list[float] = []

    trainer = pl.Trainer(max_steps=BATCHES, plugins=[io], logger=False, accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(PlTiny())
    (name,) = os.listdir(tmp_path)
    assert gds_persist.load(tmp_path / name)["global_step"] == BATCHES


def test_importing_gds_persist_imports_no_trainer_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, gds_persist, gds_persist.integrations, gds_persist.format.leaves; "
            "heavy = [m for m in ('lightning', 'pytorch_lightning', 'lightning_fabric', "
            "'accelerate') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_urls_go_through_lightning_s_own_checkpoint_io() -> None:
    """fsspec URLs (here its real in-memory filesystem) are written and read as Lightning's
    TorchCheckpointIO does them: the engine writes local or mounted filesystems only."""
    import fsspec

    io = GdsPersistCheckpointIO()
    url = "memory://gds_persist-test/epoch=0.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "epoch": 0}, url)
    assert fsspec.filesystem("memory").exists("/gds_persist-test/epoch=0.ckpt")
    got = io.load_checkpoint(url)
    assert torch.equal(got["state_dict"]["w"], torch.arange(4.0)) and got["epoch"] == 0
    io.remove_checkpoint(url)
    assert not fsspec.filesystem("memory").exists("/gds_persist-test/epoch=0.ckpt")

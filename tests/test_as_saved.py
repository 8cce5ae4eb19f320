"""A save that returns before its bytes are written holds every tensor as it was when ``save``
was called, whatever changes it afterwards, or fails naming the tensor (training/capture.py,
saving/as_saved.py). Each case trains a small model with BatchNorm (its running statistics
change in every forward, without raising ``_version``), saves after every optimizer step while
the next step runs, and compares every checkpoint bit for bit with a copy taken at ``save``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gds_persist
from gds_persist.training.capture import COPY_BYTES
from tests.helpers import HookedCheckpointer, assert_tree_equal

STEPS = 6


def _model(frozen_base: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                               nn.Linear(32, 16), nn.BatchNorm1d(16)]
    if frozen_base:  # a large frozen base (not copied each step) before a small adapter
        base = nn.Linear(16, COPY_BYTES // 4 // 16 + 64)
        base.requires_grad_(False)
        layers = [base, nn.Linear(base.out_features, 16), *layers]
    return nn.Sequential(*layers)


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        out = type(state)((k, _clone(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):  # a module's state_dict
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list | tuple):
        return type(state)(_clone(v) for v in state)
    return state


class Run:
    """A training loop that saves the state after every step with ``ckpt.save`` and keeps a
    copy of what each save was given."""

    def __init__(self, *, frozen_base: bool = False, ema: bool = False, second: bool = False):
        self.model = _model(frozen_base)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        split = len(trainable) // 2 if second else len(trainable)
        self.optimizer = torch.optim.AdamW(trainable[:split], lr=1e-2)
        self.other = torch.optim.SGD(trainable[split:], lr=1e-2) if second else None
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9),
            use_buffers=True) if ema else None
        self.expected: dict[int, Any] = {}
        self.paths: dict[int, str] = {}
        self.g = torch.Generator().manual_seed(1)

    def state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict(),
                                 "optim": self.optimizer.state_dict(), "step": step}
        if self.other is not None:
            state["other"] = self.other.state_dict()
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def step(self) -> None:
        x = torch.randn(8, 16, generator=self.g)
        self.model(x).pow(2).mean().backward()  # BatchNorm's statistics change here
        for opt in (self.optimizer, self.other):
            if opt is not None:
                opt.step()
                opt.zero_grad()
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def train(self, ckpt: Any, after_save: Callable[[int], None] = lambda s: None,
              extra: Callable[[], dict[str, Any]] = dict) -> None:
        for step in range(1, STEPS + 1):
            self.step()
            state = {**self.state(step), **extra()}
            self.expected[step] = _clone(state)
            self.paths[step] = ckpt.save(step, state).path
            after_save(step)
        self.step()  # the last save overlaps a forward too

    def check(self, load: Callable[[int], Any], steps: list[int] | None = None) -> None:
        for step in steps or sorted(self.expected):
            assert_tree_equal(load(step), self.expected[step], f"step {step}")


def _checkpointer(tmp_path: Path, **kwargs: Any) -> gds_persist.Checkpointer:
    return HookedCheckpointer(tmp_path / "ckpt", keep_last=None, **kwargs)


@pytest.mark.parametrize("mode", ["auto", "fence", "snapshot"])
def test_batchnorm_statistics_are_those_of_the_save_in_every_mode(
        tmp_path: Path, mode: str) -> None:
    run = Run()
    with _checkpointer(tmp_path, mode=mode) as ckpt:
        ckpt.guard(run.optimizer)
        run.train(ckpt)
    run.check(lambda s: gds_persist.load(run.paths[s]))
    assert ckpt.stats.copied_at_save_bytes > 0 and ckpt.stats.read_live_bytes > 0


def test_ema_second_optimizer_and_grad_scaler_are_those_of_the_save(tmp_path: Path) -> None:
    run = Run(ema=True, second=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    with _checkpointer(tmp_path, mode="fence") as ckpt:
        ckpt.guard(run.optimizer)  # the second optimizer and the EMA are not guarded

        def scaled(step: int) -> None:
            scaler.update(new_scale=float(2 ** step))  # changes right after every save

        run.train(ckpt, after_save=scaled, extra=lambda: {"scaler": scaler.state_dict()})
    run.check(lambda s: gds_persist.load(run.paths[s]))


@pytest.mark.parametrize("case", ["helper-process", "incremental", "memory-tier"])
def test_helper_process_writer_memory_tier_and_incremental_saves(
        tmp_path: Path, case: str) -> None:
    kwargs: dict[str, Any] = {
        "helper-process": {"mode": "snapshot", "writer": "process"},
        "incremental": {"incremental": True},
        "memory-tier": {"mode": "snapshot", "memory": gds_persist.MemoryTier(tmp_path / "shm"),
                        "drive_every": 3},
    }[case]
    run = Run()
    with _checkpointer(tmp_path, **kwargs) as ckpt:
        ckpt.guard(run.optimizer)
        run.train(ckpt)
    if case != "memory-tier":
        run.check(lambda s: gds_persist.load(run.paths[s]))
        return
    durable = os.path.join(ckpt.root, "step-{:08d}")  # the durable level's steps, flushed
    run.check(lambda s: gds_persist.load(durable.format(s)), [3, 6])  # from the memory copies
    again = _checkpointer(tmp_path, **kwargs)  # the memory tier keeps the newest step
    run.check(lambda s: again.load(), [STEPS])
    assert again.restored_from == "memory"
    again.close()


def test_a_frozen_base_is_read_live_not_copied_every_step(tmp_path: Path) -> None:
    run = Run(frozen_base=True)
    base = run.model[0].weight
    copied: list[int] = []
    with _checkpointer(tmp_path, mode="fence") as ckpt:
        ckpt.guard(run.optimizer)
        run.train(ckpt, after_save=lambda s: copied.append(ckpt.stats.copied_at_save_bytes))
    run.check(lambda s: gds_persist.load(run.paths[s]))
    per_save = [b - a for a, b in zip([0, *copied], copied, strict=False)]
    assert per_save[0] > base.nbytes  # the first save cannot know it is frozen: one copy
    assert all(n < base.nbytes // 8 for n in per_save[1:]), per_save  # then never again


def test_a_buffer_edited_right_after_save_is_saved_as_it_was(tmp_path: Path) -> None:
    run = Run()
    bn = run.model[1]
    with _checkpointer(tmp_path, mode="fence") as ckpt:
        ckpt.guard(run.optimizer)
        run.train(ckpt, after_save=lambda s: bn.running_mean.numpy().__setitem__(0, 1e6))
    run.check(lambda s: gds_persist.load(run.paths[s]))


def _gated(ckpt: Any) -> threading.Event:
    """The writer waits at each write until the returned event is set (then it is cleared)."""
    gate = threading.Event()

    def before_write(step: int) -> None:
        assert gate.wait(30)
        gate.clear()

    ckpt.before_write = before_write
    return gate


def test_a_guarded_parameter_edited_before_the_write_fails_that_save_naming_it(
        tmp_path: Path) -> None:
    run = Run()
    weight = run.model[0].weight
    ckpt = _checkpointer(tmp_path, mode="fence")
    ckpt.guard(run.optimizer)
    gate = _gated(ckpt)
    run.step()
    gate.set()
    ckpt.save(1, run.state(1)).wait()
    run.step()
    handle = ckpt.save(2, run.state(2))
    with torch.no_grad():
        weight.mul_(2)  # user code, right after save, before the writer read it
    gate.set()
    with pytest.raises(gds_persist.TornCheckpointError,
                       match=r"\['model'\]\['0\.weight'\] changed after save\(\).*refused "
                             r"and not committed") as refused:
        handle.wait()
    assert refused.value.tensors == ["['model']['0.weight']"]
    assert ckpt.latest_step() == 1 and not (tmp_path / "ckpt" / "step-00000002").exists()
    gate.set()
    ckpt.save(3, run.state(3)).wait()  # the next save goes on
    assert ckpt.latest_step() == 3
    ckpt.close()


def test_an_unchanged_tensor_that_changes_during_the_write_is_refused_then_copied(
        tmp_path: Path) -> None:
    frozen = torch.zeros(COPY_BYTES // 4 + 1024)  # large, never guarded
    ckpt = _checkpointer(tmp_path, mode="fence")
    gate = _gated(ckpt)
    for step in (1, 2):  # the first save copies it; the second finds it unchanged
        gate.set()
        ckpt.save(step, {"frozen": frozen}).wait()
    handle = ckpt.save(3, {"frozen": frozen})
    frozen[0] = 1.0
    gate.set()
    with pytest.raises(gds_persist.TornCheckpointError, match="frozen"):
        handle.wait()
    assert ckpt.latest_step() == 2
    before = ckpt.stats.copied_at_save_bytes
    handle = ckpt.save(4, {"frozen": frozen})
    assert ckpt.stats.copied_at_save_bytes - before == frozen.nbytes  # changed: copied now
    frozen[1] = 1.0
    gate.set()
    handle.wait()
    assert gds_persist.load(handle.path)["frozen"][:2].tolist() == [1.0, 0.0]
    ckpt.close()


def test_lightning_background_saves_hold_the_batchnorm_statistics_of_their_save(
        tmp_path: Path) -> None:
    from gds_persist.integrations.lightning import GdsPersistCheckpointIO

    run = Run()
    io = GdsPersistCheckpointIO(background=True)
    for step in range(1, STEPS + 1):
        run.step()
        state = run.state(step)
        run.expected[step] = _clone(state)
        io.save_checkpoint(state, tmp_path / f"{step}.ckpt")  # written while the next step runs
    run.step()
    io.teardown()
    run.check(lambda s: gds_persist.load(tmp_path / f"{s}.ckpt"))


def test_accelerate_save_state_holds_the_batchnorm_statistics_of_its_save(
        tmp_path: Path) -> None:
    from accelerate import Accelerator

    from gds_persist.integrations.accelerate import save_state

    run = Run()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(run.model, run.optimizer)
    saved = {}
    for step in range(1, 3):
        run.step()
        saved[step] = _clone(model.state_dict())
        save_state(accelerator, tmp_path / f"step-{step}")
    run.step()
    for step, want in saved.items():
        got = gds_persist.load(tmp_path / f"step-{step}")
        assert_tree_equal(got["models"][0], want, f"step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_on_a_gpu_batchnorm_statistics_changed_on_the_stream_are_those_of_the_save(
        tmp_path: Path, mode: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the capture's copies and CRCs of device memory")
    run = Run()
    run.model.cuda()
    run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-2)
    run.g = torch.Generator().manual_seed(1)
    side = torch.cuda.Stream()
    with _checkpointer(tmp_path, mode=mode) as ckpt:
        ckpt.guard(run.optimizer)
        for step in range(1, STEPS + 1):
            x = torch.randn(8, 16, generator=run.g).cuda()
            with torch.cuda.stream(side):  # training on a stream of its own
                side.wait_stream(torch.cuda.current_stream())
                run.model(x).pow(2).mean().backward()
                run.optimizer.step()
                run.optimizer.zero_grad()
            torch.cuda.current_stream().wait_stream(side)
            state = run.state(step)
            run.expected[step] = _clone(state)
            run.paths[step] = ckpt.save(step, state).path
        run.model(torch.randn(8, 16, generator=run.g).cuda())  # the last save overlaps it
    # map_location=None: each tensor back where it was saved (AdamW's step counts stay on the
    # CPU; map_location="cuda" would move them, as torch.load does)
    run.check(lambda s: gds_persist.load(run.paths[s]))


@pytest.mark.gpu
def test_on_a_gpu_fingerprints_of_many_storages_are_their_crc32c() -> None:
    """save()'s fingerprints of device storages, taken in one batch, equal the host CRC32C of
    each, mixed with host ones and empty ones, in order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the batch of device CRCs")
    from gds_persist.format.checksum import crc32c
    from gds_persist.training.capture import fingerprints_of

    g = torch.Generator().manual_seed(3)
    host = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            for n in (0, 1, 4097, 300, 5 << 20, 17)]
    views = [h.cuda() if k % 2 else h for k, h in enumerate(host)] * 40
    assert fingerprints_of(views) == [crc32c(h.numpy()) for h in host] * 40

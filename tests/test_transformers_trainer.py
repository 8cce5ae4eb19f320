"""Transformers' Trainer with ``gds_persist.integrations.transformers.attach``: its checkpoints
written in the background under Trainer's names, resumed by Trainer's own code bit-exactly,
rotated by ``save_total_limit``, read by ``from_pretrained`` and stock readers; a write's error
raised at the next wait. A tiny GPT-2 on the CPU, one process."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import gds_persist
from tests.forkserver import ForkServer

transformers = pytest.importorskip("transformers")
from transformers.trainer_pt_utils import safe_globals  # noqa: E402

from gds_persist.integrations.transformers import attach  # noqa: E402

STEPS = 6


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 61, (32, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(out: Path, attached: bool = True, **args: Any) -> Any:
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=61,
                                     n_positions=8, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    kw = dict(output_dir=str(out), max_steps=STEPS, save_steps=2, per_device_train_batch_size=4,
              learning_rate=1e-2, report_to=[], use_cpu=True, logging_strategy="no",
              dataloader_num_workers=0, seed=0, disable_tqdm=True) | args
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw),
                                   train_dataset=Tokens(), eval_dataset=Tokens())
    return attach(trainer) if attached else trainer


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_is_bit_exact_and_files_are_trainers(tmp_path: Path) -> None:
    own = _trainer(tmp_path / "own", attached=False, save_total_limit=2)
    own.train()
    ours = _trainer(tmp_path / "ours", save_total_limit=2)
    ours.train()
    assert _equal(_weights(ours), _weights(own))  # attaching changes nothing in training
    assert len(ours.gds_persist.stops) == STEPS // 2
    # rotation kept the newest two, nothing half-written is left, and the files are Trainer's
    assert sorted(os.listdir(tmp_path / "ours")) == ["checkpoint-4", "checkpoint-6"]
    for step in ("checkpoint-4", "checkpoint-6"):
        assert sorted(os.listdir(tmp_path / "ours" / step)) == \
            sorted(os.listdir(tmp_path / "own" / step))
    ck = tmp_path / "ours" / "checkpoint-4"
    stock = load_file(ck / "model.safetensors")
    mine = load_file(tmp_path / "own" / "checkpoint-4" / "model.safetensors")
    assert _equal(stock, mine)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert gds_persist.verify(ck / name).ok
        with safe_globals():  # as Trainer's resume reads the numpy RNG state
            torch.load(ck / name, weights_only=True)
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours" / "checkpoint-6")
    assert _equal(again.state_dict(), _weights(ours))

    resumed = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ck))
    assert _equal(_weights(resumed), _weights(ours))


def test_best_model_at_end_and_a_damaged_checkpoint(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", eval_strategy="steps", eval_steps=2,
                       load_best_model_at_end=True, metric_for_best_model="loss",
                       save_total_limit=1)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    assert _equal(load_file(os.path.join(best, "model.safetensors")),
                  {k: v for k, v in _weights(trainer).items() if k != "lm_head.weight"})
    with open(os.path.join(best, "model.safetensors"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(gds_persist.ChecksumError, match="earlier checkpoint"):
        _trainer(tmp_path / "other").train(resume_from_checkpoint=best)


def test_a_failed_write_is_raised_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", max_steps=2)
    trainer.gds_persist.options = gds_persist.SaveOptions(max_shard_size="lots")
    with pytest.raises(ValueError, match="max_shard_size"):
        trainer.train()
    assert os.listdir(tmp_path / "run") == []


def test_ddp_ranks_share_the_writing_and_resume_bit_exactly(tmp_path: Path) -> None:
    """2 gloo ranks, forked from the fork server (tests/forkserver.py): the files are those of
    Trainer's own DDP checkpoints; the attached and resumed runs end with the own run's weights."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}
    script = str(Path(__file__).with_name("transformers_ddp_worker.py"))
    with ForkServer() as forks:
        ranks = [forks.spawn(script, [str(tmp_path), str(tmp_path / f"r{r}.json")],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=str(tmp_path / f"r{r}.log"))
                 for r in range(2)]
        codes = [w.wait(timeout=240) for w in ranks]
    logs = "\n".join((tmp_path / f"r{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["own"] == got["attached"] == got["resumed"], got
    for step in ("checkpoint-2", "checkpoint-4"):
        assert sorted(os.listdir(tmp_path / "attached" / step)) == \
            sorted(os.listdir(tmp_path / "own" / step))
    assert gds_persist.verify(tmp_path / "attached" / "checkpoint-4").ok
    assert gds_persist.verify(tmp_path / "attached" / "checkpoint-4" / "optimizer.pt").ok


def test_what_the_attached_writer_does_not_write_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", attached=False)
    trainer.args.push_to_hub = True  # set after Trainer's start, which would reach the Hub
    with pytest.raises(gds_persist.CheckpointError, match="push_to_hub"):
        attach(trainer)


class _SlowCopy(transformers.TrainerCallback):  # type: ignore[misc]
    """``change(model)`` at the start of every forward pass, with the writer thread held at the
    end of every step until the next forward has made its change: the checkpoint's copies are
    made after it, deterministically, as a slow copy would make them."""

    def __init__(self, trainer: Any, change: Any):
        self.trainer, self.change = trainer, change
        self.gate = threading.Event()
        trainer.model.register_forward_pre_hook(self._forward)
        trainer.add_callback(self)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.gate = gate = threading.Event()
        self.trainer.gds_persist.lane.submit(lambda: gate.wait(60), "held")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.gate.set()

    def _forward(self, model: Any, args: Any) -> None:
        with torch.no_grad():
            self.change(model)
        self.gate.set()


def test_a_buffer_the_next_forward_changes_is_saved_as_it_was(tmp_path: Path) -> None:
    """A buffer (here a count of forward passes, as BatchNorm's statistics) that the next
    step's forward changes while the checkpoint is written: the file holds its value at the
    checkpoint, not the next step's."""
    trainer = _trainer(tmp_path / "run", max_steps=4)
    trainer.model.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
    _SlowCopy(trainer, lambda m: m.forwards.add_(1))
    trainer.train()
    for step in (2, 4):
        saved = load_file(tmp_path / "run" / f"checkpoint-{step}" / "model.safetensors")
        assert saved["forwards"].item() == step  # one forward per step (batch 4, no accumulation)


def test_a_weight_changed_outside_the_step_fails_that_checkpoint(tmp_path: Path) -> None:
    """A parameter (held by the optimizer: copied after the checkpoint's moment, before the
    next step) changed in place by a hook meanwhile: that checkpoint is refused with the
    tensor named, never written as a mix of two steps; the earlier checkpoint stays."""
    trainer = _trainer(tmp_path / "run")  # checkpoints at steps 2, 4 and 6
    edits = {"on": False}

    def edit(model: Any) -> None:
        if edits["on"]:
            model.lm_head.weight.mul_(0.5)

    _SlowCopy(trainer, edit)
    trainer.add_callback(_EditFromStep(edits, step=4))
    with pytest.raises(gds_persist.TornCheckpointError, match="lm_head.weight|wte.weight") as e:
        trainer.train()
    assert any("wte.weight" in t or "lm_head.weight" in t for t in e.value.tensors)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2"]
    assert gds_persist.verify(tmp_path / "run" / "checkpoint-2").ok


class _EditFromStep(transformers.TrainerCallback):  # type: ignore[misc]
    """Turns the in-place edit on once the checkpoint of ``step`` was taken."""

    def __init__(self, edits: dict[str, bool], step: int):
        self.edits, self.step = edits, step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.edits["on"] = state.global_step >= self.step

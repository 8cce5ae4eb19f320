"""Transformers' Trainer with ``gds_persist.integrations.transformers.attach``: its checkpoints
written in the background under Trainer's names, resumed by Trainer's own code bit-exactly,
rotated by ``save_total_limit``, read by ``from_pretrained`` and stock readers; a write's error
raised at the next wait. A tiny GPT-2 on the CPU, one process."""

from __future__ import annotations

import json
import os
import socket
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

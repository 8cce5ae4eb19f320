"""Every public entry point as shipped: constructed with no optional argument beyond the one under
test (warm-up on, ``backend="auto"``, the default settings), doing a real save and load round
trip that must be bit-exact. Defaults switched off elsewhere in the suite are exercised here, so
a default that crashes (issue 19: ``Checkpointer(incremental=True)`` with its warm-up) cannot
hide behind tests that switch it off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from tests.helpers import assert_tree_equal


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 33, generator=g)
    return {"model": {"w": w, "tied": w, "b": torch.randn(33, generator=g).bfloat16()},
            "optim": {"step": torch.tensor(3.0), "lr": 1e-3, "betas": (0.9, 0.99)},
            "step": seed, "name": "tiny"}


def test_save_load_verify(tmp_path: Path) -> None:
    state = _state()
    info = gds_persist.save(state, tmp_path / "ck")
    assert info.bytes_written > 0 and info.backend in ("direct", "buffered")
    assert_tree_equal(gds_persist.load(tmp_path / "ck"), state)
    assert gds_persist.verify(tmp_path / "ck").ok


@pytest.mark.parametrize("option", [{"content_hash": True}, {"compression": "lossless"},
                                    {"compression": "auto"}], ids=lambda o: repr(o))
def test_save_with_one_option(tmp_path: Path, option: dict[str, Any]) -> None:
    state = _state()
    gds_persist.save(state, tmp_path / "ck", options=gds_persist.SaveOptions(**option))
    assert_tree_equal(gds_persist.load(tmp_path / "ck"), state)


def test_save_with_base(tmp_path: Path) -> None:
    first, second = _state(0), _state(0)
    second["optim"]["step"] = torch.tensor(4.0)
    gds_persist.save(first, tmp_path / "a1", options=gds_persist.SaveOptions(content_hash=True))
    info = gds_persist.save(second, tmp_path / "a2", base=tmp_path / "a1")
    assert info.referenced_bytes > 0
    assert_tree_equal(gds_persist.load(tmp_path / "a2"), second)


def test_save_with_a_plain_base_warns_and_says_why_in_the_reason(tmp_path: Path) -> None:
    """A plain save records no content hashes (hashing every save would cost 1.4-1.5x its time
    here: bench/results/2026-12-01-cpu-hash-cost.txt), so it cannot serve as a base: the save
    rewrites every byte, and says so, with the fix."""
    state = _state()
    gds_persist.save(state, tmp_path / "a1")
    fix = r"save the base with content_hash=True"
    with pytest.warns(gds_persist.UnhashedBaseWarning,
                      match=rf"^base a1: 3 of its 3 extents have no content hash, so nothing "
                            rf"could be referred to; {fix}"):
        info = gds_persist.save(state, tmp_path / "a2", base=tmp_path / "a1")
    assert info.referenced_bytes == 0 and info.bytes_written >= info.payload_bytes
    assert re.search(rf"; base a1: .* nothing could be referred to; {fix}", info.reason)
    assert_tree_equal(gds_persist.load(tmp_path / "a2"), state)


CHECKPOINTER_OPTIONS = [
    {}, {"mode": "fence"}, {"mode": "snapshot"}, {"mode": "snapshot", "writer": "process"},
    {"keep_last": 1}, {"incremental": True}, {"compression": "lossless"},
    {"compression": "auto"},
    {"keep_last": 3, "incremental": True, "compression": "auto"},  # the README's line
]


@pytest.mark.parametrize("options", CHECKPOINTER_OPTIONS, ids=lambda o: repr(o))
def test_checkpointer(tmp_path: Path, options: dict[str, Any]) -> None:
    states = [_state(step) for step in range(3)]
    with gds_persist.Checkpointer(tmp_path, **options) as ckpt:
        for step, state in enumerate(states):
            ckpt.save(step, state)
    assert ckpt.warmup_report is not None  # it ran (close waits for it)
    with gds_persist.Checkpointer(tmp_path, **options) as ckpt:
        assert_tree_equal(ckpt.load(), states[-1])
        kept = ckpt.steps()
        assert kept == [0, 1, 2][-options.get("keep_last", 3):]
        for step in kept:
            assert_tree_equal(ckpt.load(step), states[step])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist: torch's
def test_dcp_writer_and_reader(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

    state = {"w": torch.randn(64, 33), "b": torch.arange(7), "step": 3}
    dcp.save(state, storage_writer=GdsPersistWriter(tmp_path / "ck"), no_dist=True)
    back = {"w": torch.zeros(64, 33), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    dcp.load(back, storage_reader=GdsPersistReader(tmp_path / "ck"), no_dist=True)
    assert_tree_equal(back, state)


def test_lightning_plugin(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from gds_persist.integrations.lightning import GdsPersistCheckpointIO

    io = GdsPersistCheckpointIO()
    checkpoint = {"state_dict": _state()["model"], "epoch": 2, "global_step": 7}
    io.save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    assert_tree_equal(io.load_checkpoint(tmp_path / "last.ckpt"), checkpoint)
    io.teardown()


def test_accelerate_save_and_load_state(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    from gds_persist.integrations.accelerate import load_state, save_state

    acc = accelerate.Accelerator()
    torch.manual_seed(0)
    model, opt = acc.prepare(torch.nn.Linear(8, 4), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    save_state(acc, tmp_path / "ck")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_state(acc, tmp_path / "ck")
    assert_tree_equal(dict(model.state_dict()), want)

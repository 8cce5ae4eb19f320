"""save_state / load_state for Hugging Face Accelerate with the real Accelerator on CPU: model,
optimizer, scheduler, registered objects and every RNG restored, so the next steps match exactly;
alone and data-parallel (2 processes, MULTI_CPU over gloo)."""

from __future__ import annotations

import json
import logging
import os
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import gds_persist

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import DistributedType  # noqa: E402

from gds_persist.integrations.accelerate import load_state, save_state  # noqa: E402
from tests import accelerate_workers as W  # noqa: E402
from tests.accelerate_workers import setup, steps  # noqa: E402
from tests.dcp_workers import free_port  # noqa: E402


def test_round_trip_restores_everything_so_next_steps_match(tmp_path: Path) -> None:
    acc, model, opt, sched, counter = setup(0)
    steps(acc, model, opt, sched, counter, 3)
    assert save_state(acc, tmp_path / "ck") == str(tmp_path / "ck")
    expected = steps(acc, model, opt, sched, counter, 4)

    acc2, model2, opt2, sched2, counter2 = setup(1)  # other weights; RNGs moved on
    random.random()
    np.random.rand()
    load_state(acc2, tmp_path / "ck")
    assert counter2.n == 3 and len(counter2.history) == 3
    assert sched2.get_last_lr() == [0.005]
    assert steps(acc2, model2, opt2, sched2, counter2, 4) == expected
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert gds_persist.verify(tmp_path / "ck").ok
    assert sorted(os.listdir(tmp_path / "ck")) == ["data-00000.bin", "manifest.json"]


def test_load_state_fills_the_live_model_and_optimizer_in_place(tmp_path: Path) -> None:
    acc, model, opt, sched, counter = setup(0)
    steps(acc, model, opt, sched, counter, 3)
    save_state(acc, tmp_path / "ck")
    acc2, model2, opt2, sched2, counter2 = setup(1)
    steps(acc2, model2, opt2, sched2, counter2, 1)  # the optimizer's moments exist
    params = [(p, p.data_ptr()) for p in model2.parameters()]
    moments = [(t, t.data_ptr()) for st in opt2.optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor)]
    load_state(acc2, tmp_path / "ck")
    assert [p.data_ptr() for p in model2.parameters()] == [ptr for _, ptr in params]
    assert all(t.data_ptr() == ptr for t, ptr in moments)
    kept = [t for st in opt2.optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)]
    assert [id(t) for t in kept] == [id(t) for t, _ in moments]
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for st, st2 in zip(opt.optimizer.state.values(), opt2.optimizer.state.values(), strict=True):
        assert torch.equal(st["exp_avg"], st2["exp_avg"])


def test_a_correct_resume_logs_no_warning(tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """A newcomer's find: every correct resume warned of 14 "unexpected" keys (the RNG states,
    the registered object's history and the moments of the not yet stepped optimizer, which
    into= has no tensor for and are loaded fresh by design). A partial load of the user's own
    still warns."""
    acc, model, opt, sched, counter = setup(0)
    steps(acc, model, opt, sched, counter, 3)
    save_state(acc, tmp_path / "ck")
    acc2, model2, *_ = setup(1)  # as a resume starts: prepared, never stepped
    with caplog.at_level(logging.DEBUG, logger="gds_persist"):
        load_state(acc2, tmp_path / "ck")
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(),
                                                     strict=True))
        gds_persist.load(tmp_path / "ck", into={"models": [model2.state_dict()]}, strict=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unexpected (loaded fresh)" in warned[0], warned


def test_automatic_naming_total_limit_and_latest(tmp_path: Path) -> None:
    acc, model, opt, sched, counter = setup(0, project_dir=str(tmp_path),
                                            automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(3):
        steps(acc, model, opt, sched, counter, 1)
        save_state(acc)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    expected = steps(acc, model, opt, sched, counter, 2)
    acc2, model2, opt2, sched2, counter2 = setup(1, project_dir=str(tmp_path),
                                                 automatic_checkpoint_naming=True)
    load_state(acc2)  # the newest
    assert counter2.n == 3
    assert steps(acc2, model2, opt2, sched2, counter2, 2) == expected


def test_refusals_name_the_path_and_the_option(tmp_path: Path) -> None:
    acc, model, opt, sched, counter = setup(0)
    counter.history = {"not", "storable"}  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"at \['custom'\]\[0\]\['history'\]: .*with Accelerate: "
                                        r"save_state\(accelerator, \.\.\., allow_pickle=True\)"):
        save_state(acc, tmp_path / "ck")
    save_state(acc, tmp_path / "ck", allow_pickle=True)  # a set: torch's unpickler allows it
    load_state(acc, tmp_path / "ck")
    assert counter.history == {"not", "storable"}


def test_mismatched_objects_are_refused(tmp_path: Path) -> None:
    acc, *_ = setup(0)
    save_state(acc, tmp_path / "ck")
    other = accelerate.Accelerator(cpu=True)
    with pytest.raises(gds_persist.CheckpointError, match=r"holds 1 models but the accelerator "
                                                          r"has 0"):
        load_state(other, tmp_path / "ck")


@pytest.mark.slow
def test_data_parallel_processes_restore_each_their_own_state(tmp_path: Path) -> None:
    mp.spawn(W.data_parallel, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["distributed_type"].endswith("MULTI_CPU") and r["processes"] == 2
        assert r["got"] == r["expected"]  # model, optimizer, scheduler and this rank's RNGs
        assert r["weights_match"] and r["restored_n"] == 3 and r["lr"] == reports[0]["lr"]
    assert reports[0]["expected"] != reports[1]["expected"]  # each rank its own data and RNG
    ck = tmp_path / "ck"
    m = gds_persist.read_manifest(ck)
    assert m.writer["world_size"] == 2 and [s.rank for s in m.sections] == [0, 1]
    assert gds_persist.verify(ck).ok
    # rank-local parts by rank
    everything = gds_persist.load(ck, options=gds_persist.LoadOptions(rank_local="all"))
    rng = everything["rng"]
    assert sorted(rng) == [0, 1] and rng[0]["random_state"] != rng[1]["random_state"]
    assert everything["custom"][0][0]["n"] == everything["custom"][1][0]["n"] == 3
    assert everything["step"] == 0 and len(everything["models"]) == 1


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED", "XLA", "MEGATRON_LM"])
def test_sharded_training_is_refused_with_the_alternative(tmp_path: Path, kind: str) -> None:
    sharded = types.SimpleNamespace(distributed_type=getattr(DistributedType, kind),
                                    num_processes=2)  # configurations this machine cannot run
    for call in (lambda: save_state(sharded, tmp_path / "ck"),
                 lambda: load_state(sharded, tmp_path / "ck")):
        with pytest.raises(NotImplementedError, match=rf"this accelerator is {kind} with 2 "
                                                      r"processes.*gds_persist\.dcp"):
            call()
    assert not os.listdir(tmp_path)


def test_allow_pickle_is_refused_with_several_processes(tmp_path: Path) -> None:
    several = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2)
    with pytest.raises(ValueError, match=r"allow_pickle=True\) is for single-process training"):
        save_state(several, tmp_path / "ck", allow_pickle=True)

"""gds_persist inside DeepSpeed (``gds_persist.integrations.deepspeed``): real DeepSpeed engines
on the CPU accelerator, 2 real gloo ranks (one gang for the module), ZeRO 0-3; stock
``torch.load`` and DeepSpeed's ``zero_to_fp32`` read what it wrote; failures on a peer keep the
previous tag and ``latest``. The engine alone (no DeepSpeed engine, one process) is checked
below on real files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import deepspeed_tasks as tasks
import pytest
import torch
from _gang import Gang
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

import gds_persist
from gds_persist.integrations.deepspeed import GdsPersistCheckpointEngine, attach
from tests.helpers import assert_tree_equal, flip_byte

MODEL_FILE = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(2, timeout_s=120, env={"DS_ACCELERATOR": "cpu"}) as g:
        yield g


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_resumes_bit_exact_and_deepspeed_tools_read_the_files(
        gang: Gang, tmp_path: Path, stage: int) -> None:
    ranks = gang.run(tasks.resume, stage, str(tmp_path), timeout=300)
    for rank, r in enumerate(ranks):
        # decoupled: save_checkpoint returned with the commit pending (queued behind the writes,
        # so `latest` may already name t1); the next step waited for it
        assert r["pending"] and r["latest_before_step"] in (None, "t1"), r
        assert r["latest"] == "t1"
        assert (r["params"], r["optimizer"], r["losses"], r["trained"]) == ("",) * 4, r
        assert r["scheduler"] and r["steps"][0] == r["steps"][1] == tasks.STEPS_BEFORE
        assert r["client"] == 3 and r["loaded"].endswith("model_states.pt")
        names = [name for name, _ in r["written"]]
        if stage == 3:
            assert names == [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                             f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        else:  # every dp rank wrote a byte range of the one model-states file
            assert r["split_reason"] == ""
            assert MODEL_FILE in names and dict(r["written"])[MODEL_FILE] > 0
            assert names[1:] == ([f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
                                 if stage else [])
    files = ranks[0]["files"]
    assert len(files) == (1 if stage == 0 else 4 if stage == 3 else 3)
    for name, f in files.items():
        assert f == {"torch.load": "", "keys": True, "verified": True, "checksum": "crc32c",
                     "extents": f["extents"]}, name
    if stage:
        assert ranks[0]["zero_to_fp32"] == ""


@pytest.mark.slow
@pytest.mark.parametrize("decoupled", [True, False])
def test_a_failed_write_on_a_peer_keeps_the_previous_tag_and_latest(
        gang: Gang, tmp_path: Path, decoupled: bool) -> None:
    for r in gang.run(tasks.failed_write, str(tmp_path), decoupled, timeout=300):
        assert r["error"] is not None and "DistributedError" in r["error"], r
        assert "rank 1 raised" in r["error"] and "zero_pp_rank_1" in r["error"]
        assert "'latest'" in r["error"] and "not changed" in r["error"]
        assert r["latest"] == "t1" and r["t1_unchanged"]
        assert r["loaded"] == MODEL_FILE and r["params"] == ""


# --- the engine alone: one process, no DeepSpeed engine ----------------------------------------

def _deepspeed_like_state() -> dict:
    flat = torch.randn(300)
    return {"module": {"w": flat[:200].view(20, 10), "b": flat[200:210]},  # views of one flat
            "optimizer_state_dict": {"loss_scaler": LossScaler(scale=2.0),
                                     "zero_stage": ZeroStageEnum.gradients,
                                     "fp32": [torch.randn(5).requires_grad_(True)]},
            "ds_config": {"zero_optimization": {"stage": 2}}, "global_steps": 7}


def _commit_info(tmp_path: Path, tag: str) -> CheckpointCommitInfo:
    return CheckpointCommitInfo(tag=tag, save_dir=str(tmp_path), save_latest=True)


def _save_tag(engine: GdsPersistCheckpointEngine, tmp_path: Path, tag: str,
              state: dict) -> Path:
    info = _commit_info(tmp_path, tag)
    engine.create(info)
    engine.makedirs(str(tmp_path / tag), exist_ok=True)
    engine.save(state_dict=state, path=str(tmp_path / tag / MODEL_FILE))
    engine.commit(info)
    return tmp_path / tag / MODEL_FILE


@pytest.mark.parametrize("decoupled", [True, False])
def test_alone_it_writes_files_torch_load_reads_and_verifies_them(
        tmp_path: Path, decoupled: bool) -> None:
    engine = GdsPersistCheckpointEngine(decoupled=decoupled, backend="direct")
    state = _deepspeed_like_state()
    path = _save_tag(engine, tmp_path, "t1", state)
    assert (tmp_path / "latest").read_text() == "t1"
    assert [os.path.basename(i.path) for i in engine.infos] == [MODEL_FILE]
    for loaded in (torch.load(path, weights_only=False), engine.load(str(path), "cpu")):
        assert isinstance(loaded["optimizer_state_dict"]["loss_scaler"], LossScaler)
        assert loaded["optimizer_state_dict"]["loss_scaler"].cur_scale == 2.0
        assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
        assert loaded["optimizer_state_dict"]["fp32"][0].requires_grad
        module = loaded["module"]
        assert module["w"].untyped_storage().data_ptr() == module["b"].untyped_storage().data_ptr()
        assert_tree_equal(module, state["module"])
    assert gds_persist.verify(path).ok
    flip_byte(path, path.read_bytes().find(state["module"]["w"].numpy().tobytes()) + 100)
    with pytest.raises(gds_persist.ChecksumError, match=MODEL_FILE):
        engine.load(str(path))


@pytest.mark.gpu
def test_alone_cuda_tensors_are_written_from_device_memory_and_load_back(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = GdsPersistCheckpointEngine(decoupled=True)
    state = _deepspeed_like_state()
    state["module"] = {k: v.cuda() for k, v in state["module"].items()}
    path = _save_tag(engine, tmp_path, "t1", state)
    loaded = engine.load(str(path), map_location="cuda")
    assert_tree_equal(loaded["module"], state["module"])
    assert torch.load(path, weights_only=False)["module"]["w"].is_cuda


def test_alone_python_values_are_saved_as_they_were_when_save_was_called(
        tmp_path: Path) -> None:
    engine = GdsPersistCheckpointEngine(decoupled=True)
    state = _deepspeed_like_state()
    info = _commit_info(tmp_path, "t1")
    engine.create(info)
    os.makedirs(tmp_path / "t1")
    engine.save(state, str(tmp_path / "t1" / MODEL_FILE))
    state["ds_config"]["zero_optimization"]["stage"] = 3  # changed after save() returned
    state["optimizer_state_dict"]["loss_scaler"].cur_scale = 8.0
    engine.commit(info)
    loaded = engine.load(str(tmp_path / "t1" / MODEL_FILE))
    assert loaded["ds_config"]["zero_optimization"]["stage"] == 2
    assert loaded["optimizer_state_dict"]["loss_scaler"].cur_scale == 2.0


def test_alone_stock_and_legacy_torch_save_files_load(tmp_path: Path) -> None:
    engine = GdsPersistCheckpointEngine()
    state = _deepspeed_like_state()
    torch.save(state, tmp_path / "zip.pt")  # DeepSpeed's TorchCheckpointEngine, from an engine
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # no config
    for name in ("zip.pt", "legacy.pt"):
        loaded = engine.load(str(tmp_path / name), map_location=lambda storage, loc: storage)
        assert_tree_equal(loaded["module"], state["module"])
        assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients


def test_alone_a_failed_write_raises_at_commit_and_keeps_latest(tmp_path: Path) -> None:
    engine = GdsPersistCheckpointEngine(decoupled=True)
    first = _save_tag(engine, tmp_path, "t1", _deepspeed_like_state())
    before = first.read_bytes()
    os.makedirs(tmp_path / "t2" / MODEL_FILE)  # a directory where the file goes
    with pytest.raises(gds_persist.CheckpointError, match=f"t2/{MODEL_FILE} is a directory"):
        _save_tag(engine, tmp_path, "t2", _deepspeed_like_state())
    assert (tmp_path / "latest").read_text() == "t1" and first.read_bytes() == before
    assert engine.get_commit_info() is None  # nothing left pending: the next save starts clean
    _save_tag(engine, tmp_path, "t3", _deepspeed_like_state())
    assert (tmp_path / "latest").read_text() == "t3"


def test_alone_every_wait_for_the_writer_is_bounded(tmp_path: Path) -> None:
    engine = GdsPersistCheckpointEngine(decoupled=True, timeout_s=0.2)
    gate = threading.Event()
    engine._submit("a-hung-write.pt", gate.wait)  # the writer thread is busy until the gate opens
    with pytest.raises(gds_persist.CheckpointTimeout, match="a-hung-write.pt.*0.2 s.*timeout_s"):
        engine.wait()
    gate.set()
    _save_tag(engine, tmp_path, "t1", _deepspeed_like_state())  # the thread goes on
    assert (tmp_path / "latest").read_text() == "t1"


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="not a DeepSpeed engine.*deepspeed.initialize"):
        attach(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['compression'\].*backend"):
        GdsPersistCheckpointEngine(compression="lossless")
    with pytest.raises(TypeError, match=r"GdsPersistCheckpointEngine\(block_bytes=...\): "
                                        "block_bytes is a setting since 0.2"):
        GdsPersistCheckpointEngine(block_bytes=1 << 20)


# --- the edges of a run: exit, load right after save, flush, the default mode -----------------

@pytest.mark.slow
@pytest.mark.parametrize("decoupled", [False, True], ids=["default", "decoupled"])
def test_a_save_is_visible_when_documented_and_a_load_right_after_it_loads_it(
        gang: Gang, tmp_path: Path, decoupled: bool) -> None:
    for rank, r in enumerate(gang.run(tasks.edges, str(tmp_path), decoupled, timeout=300)):
        assert r["decoupled"] is decoupled, r
        assert ("requested explicitly" if decoupled
                else "does not set checkpoint.writer.decoupled") in r["reason"]
        # not decoupled, as with stock DeepSpeed: committed once save_checkpoint returns
        assert r["latest_after_save"] in ((None, "t1") if decoupled else ("t1",)), r
        assert r["latest_after_flush"] == "t1"
        assert r["verified"] and all(ok for _, ok in r["verified"]), r
        assert r["loaded"] == "t2" and r["params"] == "", r
        if rank == 0 and not decoupled:
            assert r["zero_to_fp32"] == ""


@pytest.mark.slow
# "configured" with one rank: DeepSpeed 0.19.8's own decoupled engine, which the config makes
# deepspeed.initialize start before attach replaces it, spawns a process per rank that runs
# init_distributed again on MASTER_PORT; with two ranks those collide (EADDRINUSE) and hang
@pytest.mark.parametrize("world, how", [(1, "configured"), (2, "explicit")])
def test_the_last_save_of_a_run_is_committed_at_a_normal_exit(
        tmp_path: Path, world: int, how: str) -> None:
    from dcp_workers import free_port

    script = Path(__file__).with_name("deepspeed_exit_worker.py")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank), str(world),
                               str(port), how], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
        assert "exiting with the last save pending: True" in output, output[-3000:]
        assert ("decoupled: " + ("the DeepSpeed config sets checkpoint.writer.decoupled"
                                 if how == "configured" else "requested explicitly")) in output
    assert (tmp_path / "latest").read_text() == "t2"
    files = sorted((tmp_path / "t2").iterdir())
    assert [f.name for f in files] == [MODEL_FILE] + [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    assert all(gds_persist.verify(f).ok for f in files)
    saved = torch.load(tmp_path / "t2" / MODEL_FILE, weights_only=False)["module"]
    for rank in range(world):
        expected = torch.load(tmp_path / f"expected-{rank}.pt")
        assert all(torch.equal(saved[n], t) for n, t in expected.items()), rank


def test_flush_needs_our_engine() -> None:
    from gds_persist.integrations.deepspeed import flush

    class NotAttached:
        checkpoint_engine = None

    with pytest.raises(TypeError, match=r"NoneType is not gds_persist's.*attach\(engine\)"):
        flush(NotAttached())


@pytest.mark.slow
@pytest.mark.parametrize("decoupled", [True, False])
def test_a_save_holds_the_batchnorm_statistics_of_its_step(
        gang: Gang, tmp_path: Path, decoupled: bool) -> None:
    rank0, rank1 = gang.run(tasks.batchnorm, str(tmp_path), decoupled, timeout=300)
    assert rank0 == {f"t{s}": "" for s in range(4)}, rank0
    # rank 1's statistics are its own batches' (DeepSpeed keeps rank 0's): the check can fail
    assert all("running_" in differs for differs in rank1.values()), rank1

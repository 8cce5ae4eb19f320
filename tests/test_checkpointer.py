"""Checkpointer: overlapped per-step checkpoints, exact resume, retention, `latest`, guard,
snapshot memory bound, handle semantics, background errors, close."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

import gds_persist
from gds_persist import Checkpointer, CheckpointError, CheckpointTimeout, WorkerDied
from gds_persist.state.flatten import flatten
from gds_persist.training.snapshot import SnapshotArena, snapshot_nbytes, take_snapshot
from gds_persist.training.steps import LATEST, step_name
from tests.ckpt_train import (
    assert_identical,
    make,
    one_thread,
    reference,
    restore,
    state,
    train,
    train_step,
)
from tests.helpers import HookedCheckpointer

S = 6


@pytest.fixture(scope="module")
def ref() -> list:
    return reference(S)


def small(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def hold_writer(ckpt: HookedCheckpointer) -> threading.Event:
    """Make the writer wait (before each write) until the returned event is set."""
    gate = threading.Event()
    ckpt.before_write = lambda step: gate.wait(30)
    return gate


# ---------------------------------------------------------------- basics


def test_save_load_latest_and_layout(tmp_path):
    with Checkpointer(tmp_path, keep_last=None) as ckpt:
        assert ckpt.latest_step() is None
        handles = [ckpt.save(s, small(s)) for s in (1, 2, 3)]
        infos = [h.wait() for h in handles]
        assert [i.path for i in infos] == [str(tmp_path / step_name(s)) for s in (1, 2, 3)]
        assert all(h.done() and h.released() and h.error is None for h in handles)
    assert ckpt.latest_step() == 3 and ckpt.steps() == [1, 2, 3]
    assert (tmp_path / LATEST).read_text() == "step-00000003\n"
    assert sorted(os.listdir(tmp_path)) == ["latest", *(step_name(s) for s in (1, 2, 3))]
    assert ckpt.load()["step"] == 3 and ckpt.loaded_step == 3
    assert torch.equal(ckpt.load(step=2)["w"], small(2)["w"])
    assert gds_persist.verify(tmp_path / step_name(1)).ok


@pytest.mark.parametrize("mode,writer", [("fence", "thread"), ("snapshot", "thread"),
                                         ("snapshot", "process")])
def test_exact_resume_is_bit_identical(tmp_path, ref, mode, writer):
    """Checkpoint every step; resuming from step i and training to S gives the uninterrupted
    run's parameters and optimizer state, bit for bit."""
    with one_thread():
        model, opt = make()
        with Checkpointer(tmp_path, keep_last=None, mode=mode, writer=writer) as ckpt:
            ckpt.guard(opt)
            train(model, opt, 0, S, ckpt)
        assert_identical(state(model, opt, S), ref[S], "uninterrupted")
        for i in range(1, S + 1):
            loaded = ckpt.load(step=i)
            assert_identical(loaded, ref[i], f"checkpoint {i}")
            model, opt = make()
            assert restore(model, opt, loaded) == i
            train(model, opt, i, S)
            assert_identical(state(model, opt, S), ref[S], f"resumed from {i}")


def test_step_must_not_go_back_unless_resumed(tmp_path):
    with Checkpointer(tmp_path, keep_last=None) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, small(s))
        ckpt.wait()
        with pytest.raises(ValueError, match=r"step 3 is before step 5.*load\(step=\.\.\.\)"):
            ckpt.save(3, small(3))
        with pytest.raises(ValueError, match="must be >= 0"):
            ckpt.save(-1, small(0))
    with HookedCheckpointer(tmp_path, keep_last=None) as ckpt:  # a restart resuming from step 2
        assert ckpt.load(step=2)["step"] == 2
        gate = hold_writer(ckpt)
        h = ckpt.save(3, small(3))
        # before step 3 commits, `latest` already names the step resumed from
        assert ckpt.latest_step() == 2 and ckpt.steps() == [1, 2, 3, 4, 5]
        gate.set()
        h.wait()
        assert ckpt.steps() == [1, 2, 3] and ckpt.latest_step() == 3  # abandoned 4, 5 removed


def test_unsupported_value_raises_at_save_naming_the_key(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"\['opt'\]\['fn'\]"):
            ckpt.save(1, {"opt": {"fn": object()}})
        assert ckpt.stats.saves == 0


def test_blocking_save(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        h = ckpt.save(1, small(1), blocking=True)
        assert h.done() and h.info is not None and ckpt.latest_step() == 1


# ---------------------------------------------------------------- handles, guard, close


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_handle_done_released_and_wait_timeout(tmp_path, mode):
    with HookedCheckpointer(tmp_path, mode=mode) as ckpt:
        gate = hold_writer(ckpt)
        h = ckpt.save(1, small(1))
        if mode == "snapshot":
            h.wait_released(timeout=10)  # copied: the caller may change the tensors already
            assert h.released() and not h.done()
        else:
            assert not h.released() and not h.done()
        with pytest.raises(CheckpointTimeout, match=r"waited 0\.2 s for step 1 to be written"):
            h.wait(timeout=0.2)
        assert not h.done() and ckpt.latest_step() is None
        gate.set()
        info = h.wait()
        assert h.done() and h.released() and info.path == h.path and ckpt.latest_step() == 1
        assert h.wait() is info  # again: same result


def test_guard_makes_the_update_wait_for_the_write(tmp_path):
    """The optimizer update after save(i) starts only once checkpoint i is committed (durable:
    its directory is in place with its manifest); publishing `latest` may still follow."""
    model, opt = make()
    handles: list = []
    seen: list = []
    with HookedCheckpointer(tmp_path) as ckpt:
        ckpt.before_write = lambda step: time.sleep(0.3)
        hook = ckpt.guard(opt)
        # registered after the guard, so it runs after it, just before the update itself
        def committed() -> bool | None:
            if not handles:
                return None
            h = handles[-1]
            return h.released() and os.path.exists(os.path.join(h.path, "manifest.json"))

        opt.register_step_pre_hook(lambda o, a, k: seen.append(committed()))
        train_step(model, opt, 1)
        handles.append(ckpt.save(1, state(model, opt, 1)))
        train_step(model, opt, 2)
        assert seen == [None, True]
        assert ckpt.stats.guard_waits == 1 and ckpt.stats.guard_wait_s > 0.1
        hook.remove()  # without the guard the update does not wait: save() copies the tensors
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        handles.append(ckpt.save(2, state(model, opt, 2)))
        train_step(model, opt, 3)
        assert seen[-1] is False
        assert handles[-1].wait().path.endswith(step_name(2))
        saved = gds_persist.load(handles[-1].path)["model"]
        assert all(torch.equal(saved[k], v) for k, v in at_save.items())


def test_close_waits_is_idempotent_and_refuses_saves(tmp_path):
    ckpt = HookedCheckpointer(tmp_path)
    ckpt.before_write = lambda step: time.sleep(0.2)
    h = ckpt.save(1, small(1))
    ckpt.close()
    assert h.done() and ckpt.latest_step() == 1
    ckpt.close()
    with pytest.raises(CheckpointError, match="is closed; create a new one"):
        ckpt.save(2, small(2))
    assert ckpt.load()["step"] == 1
    assert not any(t.is_alive() for t in ckpt._workers.threads.values())


def test_close_with_a_hung_write_is_bounded(tmp_path):
    ckpt = HookedCheckpointer(tmp_path, timeout_s=0.5)
    gate = hold_writer(ckpt)
    ckpt.save(1, small(1))
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeout, match=r"waited 0\.5 s for the saves of steps 1 .*hung"):
        ckpt.close()
    assert time.monotonic() - t0 < 5
    gate.set()  # the write completes after all; the thread then stops
    ckpt._workers.threads["write"].join(10)
    assert ckpt.latest_step() == 1 and not ckpt._workers.threads["write"].is_alive()


def test_context_manager_does_not_mask_the_body_exception(tmp_path):
    (tmp_path / step_name(1)).mkdir()
    (tmp_path / step_name(1) / "not-a-checkpoint").write_text("x")
    with pytest.raises(KeyError) as info:
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, small(1))
            raise KeyError("body")
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "not a gds_persist checkpoint" in notes or not hasattr(info.value, "add_note")


def test_no_file_descriptor_outlives_the_checkpointer(tmp_path):
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    with Checkpointer(tmp_path / "warm", mode="snapshot") as ckpt:  # warm caches (staging ring)
        ckpt.save(1, small(1))
    before = fds()
    for mode, writer in (("fence", "thread"), ("snapshot", "thread"), ("snapshot", "process")):
        with Checkpointer(tmp_path / f"{mode}-{writer}", keep_last=1, mode=mode,
                          writer=writer) as ckpt:
            for s in range(1, 5):
                ckpt.save(s, small(s))
        ckpt.load()
    assert fds() == before


# ---------------------------------------------------------------- errors in the background


def _make_unreplaceable(root, step: int) -> None:
    """Put something that is not a checkpoint where step `step` goes: its save fails for real."""
    d = root / step_name(step)
    d.mkdir(parents=True)
    (d / "precious.txt").write_text("not a checkpoint")


def test_background_error_surfaces_on_next_save_once(tmp_path):
    with Checkpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(1, small(1)).wait()
        _make_unreplaceable(tmp_path, 2)
        h = ckpt.save(2, small(2))
        h.wait_released(timeout=30)  # failed: tensors released, error kept for the caller
        assert h.done() and isinstance(h.error, CheckpointError)
        with pytest.raises(CheckpointError, match=r"step-00000002 exists and is not a gds_persist"):
            ckpt.save(3, small(3))
        ckpt.save(3, small(3)).wait()  # delivered once; saving goes on
        assert ckpt.latest_step() == 3 and ckpt.steps() == [3]
        assert (tmp_path / step_name(2) / "precious.txt").exists()


def test_background_error_surfaces_on_wait_and_handle(tmp_path):
    with Checkpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(1, small(1)).wait()
        _make_unreplaceable(tmp_path, 2)
        h = ckpt.save(2, small(2))
        with pytest.raises(CheckpointError, match="not a gds_persist checkpoint") as info:
            ckpt.wait()
        notes = "".join(getattr(info.value, "__notes__", [""]))
        assert "step 2" in notes or not hasattr(info.value, "add_note")
        with pytest.raises(CheckpointError):
            h.wait()  # the handle keeps its error
        ckpt.wait()  # already delivered
        # keep_last=1 never removed step 1 before a newer step committed
        assert ckpt.latest_step() == 1 and ckpt.load()["step"] == 1


def test_dead_writer_thread_is_detected_and_replaced(tmp_path):
    with HookedCheckpointer(tmp_path, timeout_s=20) as ckpt:
        def die_on_step_2(step: int) -> None:
            if step == 2:
                raise SystemExit("simulated crash of the writer thread")

        ckpt.before_write = die_on_step_2
        ckpt.save(1, small(1)).wait()
        h = ckpt.save(2, small(2))
        t0 = time.monotonic()
        with pytest.raises(WorkerDied,
                           match=r"write thread died while saving step 2 \(SystemExit: simulated"):
            h.wait()
        assert time.monotonic() - t0 < 5  # detected promptly, not at the timeout
        ckpt.save(3, small(3)).wait()
        assert ckpt.latest_step() == 3


# ---------------------------------------------------------------- retention and `latest`


def test_retention_keeps_last_k_and_cleans_leftovers(tmp_path):
    """Leftovers of dead owners go: a save's whose lock nobody holds, and (no lock) those
    untouched for an hour (docs/FORMAT.md, "Several processes, one path")."""
    (tmp_path / ".step-00000002.tmp-abc123").mkdir(parents=True)  # an interrupted save
    (tmp_path / ".step-00000002.tmp-abc123.lock").write_text("pid 1 on gone\n")  # unlocked
    (tmp_path / ".step-00000001.tmp-0ld0ld").mkdir()  # an older version's, without a lock
    (tmp_path / ".step-00000003.del-abc123").mkdir()  # an interrupted delete
    (tmp_path / ".latest.tmp-abc123").write_text("x")
    hours_ago = time.time() - 2 * 3600
    for name in (".step-00000001.tmp-0ld0ld", ".latest.tmp-abc123"):
        os.utime(tmp_path / name, (hours_ago, hours_ago))
    with Checkpointer(tmp_path, keep_last=2) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, small(s)).wait()
            assert ckpt.steps() == list(range(max(1, s - 1), s + 1))
    assert sorted(os.listdir(tmp_path)) == ["latest", step_name(4), step_name(5)]


def test_latest_pointer_fallbacks(tmp_path):
    with Checkpointer(tmp_path, keep_last=None) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, small(s))
    pointer = tmp_path / LATEST
    (tmp_path / step_name(7)).mkdir()  # no manifest: not committed
    (tmp_path / ".step-00000008.tmp-0123").mkdir()  # a save in progress
    assert ckpt.latest_step() == 3
    pointer.write_text("step-00000002\n")  # crash after committing 3, before publishing it
    assert ckpt.latest_step() == 2
    pointer.write_text("step-00000009\n")  # stale: names a step that is not there
    assert ckpt.latest_step() == 3
    pointer.write_bytes(b"\xff garbage")
    assert ckpt.latest_step() == 3
    pointer.unlink()
    assert ckpt.latest_step() == 3
    assert ckpt.load()["step"] == 3


# ---------------------------------------------------------------- snapshot mode


def test_snapshot_memory_is_bounded_and_blocking_is_reported(tmp_path, ref):
    with one_thread():
        model, opt = make()
        need = snapshot_nbytes(flatten(state(model, opt, 0)))
        train(model, opt, 0, 1)  # optimizer state exists from here on
        need = snapshot_nbytes(flatten(state(model, opt, 1)))
        budget = 2 * need + need // 2  # room for two snapshots, not three
        with HookedCheckpointer(tmp_path, keep_last=None, mode="snapshot",
                          snapshot_bytes=budget) as ckpt:
            ckpt.before_write = lambda step: time.sleep(0.15)  # a drive slower than training
            ckpt.guard(opt)
            ckpt.save(1, state(model, opt, 1))
            train(model, opt, 1, S, ckpt)
            ckpt.wait()
            stats = ckpt.stats
        assert stats.snapshot_bytes <= budget + 4095
        assert need <= stats.snapshot_peak_bytes <= stats.snapshot_bytes
        assert stats.snapshot_blocked >= 1 and stats.snapshot_blocked_s > 0
        assert stats.guard_waits >= 1 and stats.fence_fallbacks == 0
        for i in range(1, S + 1):  # every checkpoint holds the state of its own step
            assert_identical(ckpt.load(step=i), ref[i], f"checkpoint {i}")


def test_snapshot_larger_than_the_arena_is_written_fence_style(tmp_path):
    big = {"w": torch.arange(50_000, dtype=torch.float32), "step": 1}
    with Checkpointer(tmp_path, mode="snapshot", snapshot_bytes=64 << 10) as ckpt:
        h = ckpt.save(1, big)
        h.wait()
        assert h.mode == "fence" and ckpt.stats.fence_fallbacks == 1
        assert ckpt.stats.snapshot_peak_bytes == 0
    assert torch.equal(ckpt.load()["w"], big["w"])


def test_snapshot_preserves_tied_storages_views_and_parameters(tmp_path):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    sd = {"emb": base, "head": base, "row": base[1], "t": base.t(),
          "p": torch.nn.Parameter(torch.ones(3)), "ints": torch.arange(5, dtype=torch.int16),
          "empty": torch.empty(0), "step": 4, "lr": float("inf")}
    with Checkpointer(tmp_path, mode="snapshot") as ckpt:
        ckpt.save(4, sd).wait()
        assert ckpt.stats.snapshot_peak_bytes > 0
    m = gds_persist.read_manifest(tmp_path / step_name(4))
    assert len([s for s in m.storages if s.nbytes]) == 3  # base, p, ints
    out = ckpt.load()
    assert out["emb"].untyped_storage().data_ptr() == out["head"].untyped_storage().data_ptr()
    assert out["row"].untyped_storage().data_ptr() == out["emb"].untyped_storage().data_ptr()
    assert out["t"].stride() == (1, 6) and isinstance(out["p"], torch.nn.Parameter)
    assert_identical({k: v for k, v in out.items()}, sd)


def test_snapshot_copy_records_the_device_it_came_from(tmp_path):
    """A host snapshot of a CUDA tensor is recorded in the manifest as that CUDA tensor."""
    live = flatten({"t": torch.ones(3), "u": torch.ones(2)})
    # as flatten records a CUDA state dict (no GPU here: the record says where it was saved from)
    live.storages[0] = dataclasses.replace(live.storages[0], device="cuda:0")
    arena = SnapshotArena(1 << 16, 10.0)
    r = arena.reserve(snapshot_nbytes(live))
    snap = take_snapshot(live, arena, r)
    assert [s.device for s in snap.storages] == ["cuda:0", "cpu"]
    assert all(o.device.type == "cpu" for o in snap.storage_objects)  # host copies
    gds_persist.save(snap, tmp_path / "ck")
    assert [s.device for s in gds_persist.read_manifest(tmp_path / "ck").storages] == [
        "cuda:0", "cpu"]
    out = gds_persist.load(tmp_path / "ck", map_location="cpu")
    assert torch.equal(out["t"], torch.ones(3)) and torch.equal(out["u"], torch.ones(2))
    del snap
    arena.free(r)
    arena.close()


# ---------------------------------------------------------------- writer="process"


def test_process_writer_needs_snapshot_mode_and_no_group(tmp_path):
    with pytest.raises(ValueError, match="writer='process'.*needs mode='snapshot'"):
        Checkpointer(tmp_path, writer="process")
    with pytest.raises(ValueError, match="valid writers are thread, process"):
        Checkpointer(tmp_path, writer="fork")


def test_process_writer_error_comes_back_with_its_type(tmp_path):
    with Checkpointer(tmp_path, mode="snapshot", writer="process") as ckpt:
        ckpt.save(1, small(1)).wait()
        _make_unreplaceable(tmp_path, 2)
        with pytest.raises(CheckpointError, match="step-00000002 exists and is not") as info:
            ckpt.save(2, small(2)).wait()
        notes = "".join(getattr(info.value, "__notes__", ["helper process"]))
        assert "helper process" in notes
        ckpt.save(3, small(3)).wait()
        assert ckpt.latest_step() == 3


def test_dead_helper_process_is_detected_and_replaced(tmp_path):
    with Checkpointer(tmp_path, mode="snapshot", writer="process", timeout_s=60) as ckpt:
        ckpt.save(1, small(1)).wait()
        os.kill(ckpt._helper.pid, signal.SIGSTOP)  # our own child: it cannot finish a job
        h = ckpt.save(2, small(2))
        h.wait_released(timeout=30)
        deadline = time.monotonic() + 30  # until the writer thread is sending step 2's job
        while ckpt._helper._seq < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ckpt._helper._seq == 2, "the writer never sent step 2 to the helper"
        os.kill(ckpt._helper.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match=r"helper process died \(exit code -9\) while "
                                             r"writing step 2"):
            h.wait()
        assert time.monotonic() - t0 < 10
        ckpt.save(3, small(3)).wait()  # a new helper
        assert ckpt.steps() == [1, 3] and ckpt.latest_step() == 3

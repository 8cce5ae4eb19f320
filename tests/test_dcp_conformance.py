"""Our DCP writer and reader through the situations PyTorch's own storage tests cover (our
tests, not theirs): FileSystemWriter's arguments, nested state with non-tensor values, BytesIO
items and Stateful objects, checkpoint_id given to save/load, format_utils conversions,
get_state_dict/set_state_dict, no_dist saves; with 2 real gloo processes: DTensors and
ShardedTensors, rank-local keys, a DDP + Adam + Stateful train state, async_save with stagers.
And the reader's promise: every chunk lands in the planner's own tensor, bit-exact, with extra
memory bounded by the staging ring."""

from __future__ import annotations

import io
import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dcp_conformance_tasks as tasks
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _gang import Gang
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import gds_persist
from gds_persist import CheckpointError
from gds_persist.dcp import GdsPersistReader, GdsPersistWriter
from gds_persist.dcp.boxes import copy_run, narrow
from gds_persist.dcp.format_utils import dcp_to_torch_save, torch_save_to_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
REPO = Path(__file__).resolve().parent.parent


def save(state: Any, path: Any, **writer: Any) -> GdsPersistWriter:
    w = GdsPersistWriter(path, **writer)
    dcp.save(state, storage_writer=w, no_dist=True)
    return w


def load(state: Any, path: Any, **reader: Any) -> Any:
    dcp.load(state, storage_reader=GdsPersistReader(path, **reader), no_dist=True)
    return state


def original(e: BaseException) -> BaseException:
    """The error a rank raised, from DCP's CheckpointException around it."""
    return e.failures[0][0] if isinstance(e, CheckpointException) else e  # type: ignore


# --------------------------------------------------------------- FileSystemWriter's arguments

def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    save({"x": torch.ones(4)}, path)
    with pytest.raises((CheckpointException, CheckpointError)) as info:
        save({"x": torch.zeros(4)}, path, overwrite=False)
    assert "already holds a checkpoint" in str(original(info.value))
    assert "overwrite=False" in str(original(info.value))
    assert str(original(info.value)).startswith("Checkpoint already exists")  # as FileSystemWriter
    assert torch.equal(load({"x": torch.zeros(4)}, path)["x"], torch.ones(4))  # untouched
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    save({"x": torch.full((4,), 3.0)}, tmp_path / "new", overwrite=False)  # a new path: fine
    save({"x": torch.full((4,), 2.0)}, path)  # the default replaces it, atomically
    assert torch.equal(load({"x": torch.zeros(4)}, path)["x"], torch.full((4,), 2.0))


def test_overwrite_as_pytorchs_own_test_overwrite(tmp_path: Path) -> None:
    """PyTorch's DCP ``test_overwrite`` (test_fsspec.py) with our writer: its first save goes
    into an existing empty directory, the refusal is a CheckpointException saying "Checkpoint
    already exists" (FileSystemWriter's words)."""
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=GdsPersistWriter(tmp_path, overwrite=False),
             no_dist=True)
    dcp.save({"random": t2}, storage_writer=GdsPersistWriter(tmp_path, overwrite=True),
             no_dist=True)
    assert torch.allclose(load({"random": torch.zeros(10)}, tmp_path)["random"], t2)
    with pytest.raises(CheckpointException, match=r".*Checkpoint already exists.*"):
        dcp.save({"random": t2}, storage_writer=GdsPersistWriter(tmp_path, overwrite=False),
                 no_dist=True)


def test_overwrite_false_is_checked_again_at_commit(tmp_path: Path) -> None:
    """A checkpoint committed by someone else while this save was writing is not replaced."""
    path = tmp_path / "ck"
    w = GdsPersistWriter(path, overwrite=False)

    class Racing(dcp.DefaultSavePlanner):
        def resolve_data(self, item: Any) -> Any:
            if not path.exists():
                save({"x": torch.full((4,), 9.0)}, path)  # another save commits meanwhile
            return super().resolve_data(item)

    with pytest.raises((CheckpointException, CheckpointError), match="already holds"):
        dcp.save({"x": torch.ones(4)}, storage_writer=w, planner=Racing(), no_dist=True)
    assert torch.equal(load({"x": torch.zeros(4)}, path)["x"], torch.full((4,), 9.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the refused save left nothing


def test_thread_count_is_io_threads(tmp_path: Path) -> None:
    assert GdsPersistWriter(tmp_path / "a", thread_count=3).io_threads == 3
    with pytest.raises(TypeError, match=r"io_threads is a setting since 0.2: use `with "
                                        r"gds_persist.settings.set\(io_threads=...\)`"):
        GdsPersistWriter(tmp_path / "a", thread_count=3, io_threads=3)
    sd = {"w": torch.randn(300, 70), "b": torch.randn(9)}
    save(sd, tmp_path / "t", thread_count=2)
    back = load({"w": torch.zeros(300, 70), "b": torch.zeros(9)}, tmp_path / "t")
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])


@pytest.mark.parametrize(("argument", "why"), [
    ("sync_files", "fsynced before the atomic commit"),
    ("single_file_per_rank", "one\\s+aligned data file"),
])
def test_unsupported_arguments_are_refused_with_the_reason(tmp_path: Path, argument: str,
                                                           why: str) -> None:
    with pytest.raises(CheckpointError, match=rf"{argument}=False\) is not supported: .*{why}"):
        GdsPersistWriter(tmp_path / "c", **{argument: False})
    save({"x": torch.ones(2)}, tmp_path / "c", **{argument: True})  # what it always does
    assert gds_persist.verify(tmp_path / "c").ok


def test_unknown_filesystem_writer_arguments_fail_loudly(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="per_thread_copy_ahead"):
        GdsPersistWriter(tmp_path / "c", per_thread_copy_ahead=10)  # type: ignore[call-arg]


def test_writer_is_its_own_async_stager(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    plain, cached = GdsPersistWriter(tmp_path / "a"), GdsPersistWriter(
        tmp_path / "b", cache_staged_state_dict=True)
    assert isinstance(plain, AsyncStager) and isinstance(cached, AsyncStager)
    state = {"w": torch.arange(6.0), "n": {"k": torch.ones(2)}, "step": 3}
    first = cached.stage(state)
    state["w"].add_(1)
    second = cached.stage(state)  # the same host copy, refilled (pinned only with CUDA)
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["step"] == 3
    assert torch.equal(second["w"], torch.arange(6.0) + 1)
    fresh = plain.stage(state)
    assert fresh["w"].data_ptr() != state["w"].data_ptr() and torch.equal(fresh["w"], state["w"])
    assert pickle.loads(pickle.dumps(cached)).state_dict_cache is None  # process executor


# ------------------------------------------------------------ what dcp.save / dcp.load carry

class Counter(Stateful):
    def __init__(self, n: int, log: bytes = b""):
        self.n, self.log = n, log

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n), "log": io.BytesIO(self.log), "name": "counter"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.log = int(state["n"]), state["log"].getvalue()


def test_nested_state_with_non_tensor_values(tmp_path: Path) -> None:
    sd = {"model": {"layers": [{"w": torch.randn(3, 2), "cfg": {"act": "gelu", "p": 0.1}}]},
          "opt": {"lr": 0.01, "betas": (0.9, 0.95), "nothing": None, "flag": True},
          "epoch": 4, "tags": ["a", "b"]}
    save(sd, tmp_path / "ck")
    # DCP fills the keys the destination has (with any storage reader)
    back = {"model": {"layers": [{"w": torch.zeros(3, 2), "cfg": {"act": "", "p": 0.0}}]},
            "opt": {"lr": 0.0, "betas": None, "nothing": 1, "flag": False}, "epoch": 0,
            "tags": ["", ""]}
    load(back, tmp_path / "ck")
    assert torch.equal(back["model"]["layers"][0]["w"], sd["model"]["layers"][0]["w"])
    assert back["model"]["layers"][0]["cfg"] == {"act": "gelu", "p": 0.1}
    assert back["opt"] == sd["opt"] and back["epoch"] == 4 and back["tags"] == ["a", "b"]


def test_bytesio_items_and_a_stateful_holding_one(tmp_path: Path) -> None:
    """DCP's planner pickles an io.BytesIO value; the reader hands the bytes to the planner,
    as FileSystemReader does (it used to refuse them: "Unsupported global: _io.BytesIO")."""
    sd = {"blob": io.BytesIO(b"\x00raw bytes\xff"), "app": Counter(5, b"seen 5"),
          "w": torch.ones(3)}
    save(sd, tmp_path / "ck")
    back = {"blob": io.BytesIO(), "app": Counter(0), "w": torch.zeros(3)}
    load(back, tmp_path / "ck")
    assert isinstance(back["blob"], io.BytesIO) and back["blob"].getvalue() == b"\x00raw bytes\xff"
    assert back["app"].n == 5 and back["app"].log == b"seen 5"
    # the stricter mode refuses it, naming the item and keeping the unpickler's whole reason
    with pytest.raises(CheckpointException) as info:
        load({"blob": io.BytesIO(), "app": Counter(0), "w": torch.zeros(3)}, tmp_path / "ck",
             weights_only=True)
    text = str(original(info.value))
    assert "weights_only=True" in text and "DCP item" in text
    assert "Unsupported global: GLOBAL _io.BytesIO" in text  # past the first line
    assert "add_safe_globals" in text


def test_checkpoint_id_given_to_save_and_load(tmp_path: Path) -> None:
    sd = {"w": torch.randn(5, 5)}
    dcp.save(sd, storage_writer=GdsPersistWriter(), checkpoint_id=tmp_path / "a", no_dist=True)
    back = {"w": torch.zeros(5, 5)}
    dcp.load(back, storage_reader=GdsPersistReader(), checkpoint_id=tmp_path / "a", no_dist=True)
    assert torch.equal(back["w"], sd["w"])
    # one writer object, several checkpoints: each save its own id
    w = GdsPersistWriter()
    for n in range(2):
        dcp.save({"w": sd["w"] + n}, storage_writer=w, checkpoint_id=str(tmp_path / f"s{n}"),
                 no_dist=True)
    assert torch.equal(load({"w": torch.zeros(5, 5)}, tmp_path / "s1")["w"], sd["w"] + 1)
    assert GdsPersistReader.validate_checkpoint_id(tmp_path / "s0")
    assert not GdsPersistReader.validate_checkpoint_id(tmp_path / "missing")
    with pytest.raises((CheckpointException, CheckpointError), match="needs a path"):
        dcp.save(sd, storage_writer=GdsPersistWriter(), no_dist=True)


def test_get_state_dict_and_set_state_dict(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        return model, optim

    model, optim = trained(0)
    msd, osd = get_state_dict(model, optim)
    save({"model": msd, "optim": osd}, tmp_path / "ck")
    model2, optim2 = trained(1)
    msd2, osd2 = get_state_dict(model2, optim2)
    load({"model": msd2, "optim": osd2}, tmp_path / "ck")
    set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(optim.state[a]["exp_avg_sq"], optim2.state[b]["exp_avg_sq"])
    assert optim2.param_groups[0]["lr"] == 0.01


# ------------------------------------------------------------------------ format_utils

def test_format_utils_round_trip(tmp_path: Path) -> None:
    sd = {"a": torch.randn(3, 4), "n": {"b": torch.arange(5)}, "step": 7, "lrs": [0.1, 0.2]}
    torch.save(sd, tmp_path / "model.pt")
    torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "dcp")
    assert gds_persist.verify(tmp_path / "dcp").ok
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert torch.equal(back["a"], sd["a"]) and torch.equal(back["n"]["b"], sd["n"]["b"])
    assert back["step"] == 7 and back["lrs"] == [0.1, 0.2]
    # torch's own dcp_to_torch_save path (an empty state dict and its planner) reads it too
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    full: dict[str, Any] = {}
    _load_state_dict(full, storage_reader=GdsPersistReader(tmp_path / "dcp"),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert torch.equal(full["a"], sd["a"]) and full["step"] == 7


def test_dcp_to_torch_save_inside_the_checkpoint_and_what_a_replace_does(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "ck"),
             storage_writer=GdsPersistWriter(), no_dist=True)
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "ck" / "model.pt")
    got = torch.load(tmp_path / "ck" / "model.pt", weights_only=True)
    assert torch.equal(got["model"]["weight"], model.weight.detach())
    assert gds_persist.verify(tmp_path / "ck").ok  # the extra file does not disturb it
    save({"model": model}, tmp_path / "ck")  # replacing the checkpoint swaps the directory
    assert "model.pt" not in os.listdir(tmp_path / "ck")


def test_torch_save_to_dcp_into_the_source_directory_is_refused(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"not a gds_persist checkpoint; refusing to "
                                              r"replace it \(a directory holding 'model.pt'\): "
                                              r"a save replaces the whole directory"):
        torch_save_to_dcp(tmp_path / "model.pt", tmp_path)
    assert os.listdir(tmp_path) == ["model.pt"]
    torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "dcp")  # a subdirectory is the fix
    torch.save({"obj": Counter(1)}, tmp_path / "unsafe.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        torch_save_to_dcp(tmp_path / "unsafe.pt", tmp_path / "u")


# -------------------------------------------------------- every chunk into the planner's tensor

def test_targets_are_filled_in_place_whatever_their_layout(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"t": torch.randn(6, 4, generator=g), "d": torch.randn(5, 3, generator=g),
          "c": torch.randn(4, 4, generator=g), "b": torch.rand(9, generator=g) > 0.5,
          "e": torch.empty(0, 2), "s": torch.tensor(1.5)}
    save(sd, tmp_path / "ck", backend="buffered")
    targets = {"t": torch.zeros(4, 6).t(),            # non-contiguous
               "d": torch.zeros(5, 3, dtype=torch.float64),  # another dtype
               "c": torch.zeros(4, 8)[:, ::2],        # strided view of a larger tensor
               "b": torch.zeros(9, dtype=torch.bool), "e": torch.zeros(0, 2),
               "s": torch.zeros(())}
    ids = {k: (id(v), v.data_ptr()) for k, v in targets.items()}
    planner = tasks.Recorder()
    dcp.load(targets, storage_reader=GdsPersistReader(tmp_path / "ck"), planner=planner,
             no_dist=True)
    assert {k: (id(v), v.data_ptr()) for k, v in targets.items()} == ids
    assert set(planner.resolved) == {v.data_ptr() for v in targets.values() if v.numel()}
    for k, v in sd.items():
        assert torch.equal(targets[k], v.to(targets[k].dtype)), k
    assert targets["d"].dtype == torch.float64


@pytest.mark.slow
def test_many_saved_chunks_into_one_strided_target(tmp_path: Path, gang: Gang) -> None:
    """Chunks written by 2 ranks (DTensor Shard(0)) into one transposed full tensor."""
    gang.run(tasks.sharded_and_rank_local, str(tmp_path))
    target = torch.zeros(4, 9).t()
    ptr = target.data_ptr()
    load({"dt": target}, tmp_path / "sharded")
    assert target.data_ptr() == ptr and torch.equal(target, tasks.full(9, 4, 3))


def test_copy_run_puts_every_run_of_a_chunk_into_its_box() -> None:
    rng = random.Random(7)
    for _ in range(400):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        offsets = [rng.randrange(s) for s in shape]
        lengths = [rng.randint(1, s - o) for s, o in zip(shape, offsets, strict=True)]
        saved = torch.randn(shape)
        flat = saved.reshape(-1)
        target = torch.zeros(lengths[::-1]).permute(list(reversed(range(len(shape)))))
        cuts = sorted(set(rng.sample(range(1, flat.numel() + 1),
                                     min(flat.numel(), rng.randint(1, 4)))) | {flat.numel()})
        runs = list(zip([0, *cuts[:-1]], cuts, strict=True))
        rng.shuffle(runs)  # the reader's pieces come in any order
        for lo, hi in runs:
            copy_run(flat[lo:hi], lo, shape, offsets, lengths, target)
        assert torch.equal(target, narrow(saved, offsets, lengths)), (shape, offsets, lengths)


def test_pieces_that_cut_elements_are_assembled() -> None:
    from gds_persist.dcp.reader import ItemRecord, _Boxes
    from gds_persist.format import Extent

    saved = torch.randn(3, 5, dtype=torch.float64)
    raw = saved.reshape(-1).view(torch.uint8).clone()
    rec = ItemRecord("w", "tensor", "float64", (3, 5), raw.numel(), ())
    target = torch.zeros(2, 5)  # rows 1..2, in float32
    req = type("Req", (), {"storage_offsets": [1, 0], "lengths": [2, 5]})()
    sink = _Boxes([(rec, [(req, target)])])
    cuts = [0, 3, 11, 40, 41, 77, raw.numel()]  # none on an 8-byte boundary but the ends
    extent = Extent(0, 0, raw.numel(), 0, 0, 0)
    for lo, hi in reversed(list(zip(cuts, cuts[1:], strict=False))):
        sink(extent, lo, memoryview(raw[lo:hi].numpy()))
    assert torch.equal(target, saved[1:].float()) and not sink.fragments


def test_a_chunk_streams_into_a_strided_target_without_a_copy_of_it(tmp_path: Path) -> None:
    """64 MiB into a transposed target: the peak resident memory grows by the staging ring,
    not by the chunk (the reader used to read it into a buffer of its own first)."""
    script = textwrap.dedent(f"""
        import warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp, gds_persist
        from gds_persist.dcp import GdsPersistReader, GdsPersistWriter
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) * 1024
        path = {str(tmp_path / "big")!r}
        saved = torch.arange(4096 * 4096, dtype=torch.float32).reshape(4096, 4096)
        dcp.save({{"w": saved}}, storage_writer=GdsPersistWriter(path), no_dist=True)
        del saved
        target = torch.zeros(4096, 4096).t()  # touched: resident before the baseline
        base = hwm()
        gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=4 << 20)
        dcp.load({{"w": target}}, storage_reader=GdsPersistReader(path), no_dist=True)
        grew = hwm() - base
        ok = torch.equal(target[5], torch.arange(5 * 4096, 6 * 4096, dtype=torch.float32))
        print(grew, ok)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew, ok = proc.stdout.split()
    assert ok == "True"
    assert int(grew) < 24 << 20, f"peak RSS grew by {int(grew) >> 20} MiB for a 64 MiB chunk"


@pytest.mark.gpu
def test_cuda_targets_of_any_layout_are_filled_in_place(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sd = {"t": torch.randn(6, 4), "d": torch.randn(5, 3), "whole": torch.randn(64, 64)}
    save(sd, tmp_path / "ck")
    targets = {"t": torch.zeros(4, 6, device="cuda").t(),
               "d": torch.zeros(5, 3, dtype=torch.float16, device="cuda"),
               "whole": torch.zeros(64, 64, device="cuda")}
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    load(targets, tmp_path / "ck")
    assert {k: v.data_ptr() for k, v in targets.items()} == ptrs
    for k, v in sd.items():
        assert torch.equal(targets[k].cpu(), v.to(targets[k].dtype)), k


# ----------------------------------------------------------------- 2 real gloo processes

@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(2, timeout_s=120) as g:
        yield g


@pytest.mark.slow
def test_dtensor_boxes_of_a_saved_chunk_land_in_the_local_shards(tmp_path: Path,
                                                                 gang: Gang) -> None:
    save({"w": tasks.full(10, 6, 1), "odd": tasks.full(7, 3, 2)}, tmp_path / "one")
    for r in gang.run(tasks.dtensor_boxes, str(tmp_path / "one")):
        assert r == {"w_equal": True, "odd_equal": True, "targets_in_shards": True,
                     "same_tensors": True}


@pytest.mark.slow
def test_sharded_tensors_dtensors_and_rank_local_keys(tmp_path: Path, gang: Gang) -> None:
    for r in gang.run(tasks.sharded_and_rank_local, str(tmp_path)):
        assert r == {"dt": True, "st": True, "local": True, "shared": True}
    m = gds_persist.read_manifest(tmp_path / "sharded")
    assert m.writer["world_size"] == 2 and gds_persist.verify(tmp_path / "sharded").ok
    back = {"local.rank1": torch.zeros(3)}  # a rank-local key, read by one process
    assert torch.equal(load(back, tmp_path / "sharded")["local.rank1"], torch.ones(3))


@pytest.mark.slow
def test_ddp_adam_stateful_train_state_with_a_bytesio(tmp_path: Path, gang: Gang) -> None:
    for r in gang.run(tasks.stateful_ddp_adam, str(tmp_path)):
        assert r == {"model": True, "adam": True, "step": [1.0, 1.0], "blob": True}


@pytest.mark.slow
def test_async_save_with_stagers(tmp_path: Path, gang: Gang) -> None:
    for r in gang.run(tasks.async_saves, str(tmp_path)):
        assert r == {"stager": True, "cached_copy_reused": True, "writer_staged": [True, True],
                     "user_stager": True}

"""The DCP storage backend (gds_persist.dcp) with real torch.distributed.checkpoint calls.

Multi-rank cases run in processes spawned once per module (gloo on 127.0.0.1); single-process
cases use DCP's no_dist path in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned workers import it too
import dcp_workers as W  # noqa: E402

import gds_persist  # noqa: E402
from gds_persist import ChecksumError, NotCommittedError  # noqa: E402
from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written by 2 ranks, and each rank's report."""
    root = str(tmp_path_factory.mktemp("dcp2"))
    mp.spawn(W.save_scenarios, args=(2, W.free_port(), root), nprocs=2, join=True)
    reports = []
    for rank in range(2):
        with open(os.path.join(root, f"report-{rank}.json")) as f:
            reports.append(json.load(f))
    return root, reports


@pytest.mark.slow
def test_replicated_state_dict_round_trips_on_two_ranks(saved):
    _, reports = saved
    for r in reports:
        assert r["rep_roundtrip"] and r["rep_nobal_roundtrip"]


@pytest.mark.slow
def test_balancing_splits_the_dominant_replicated_tensor(saved):
    """DCP alone gives the dominant replicated tensor to one rank; our writer splits it."""
    root, reports = saved
    unbalanced = reports[0]["rep_nobal_rank_bytes"]
    balanced = reports[0]["rep_rank_bytes"]
    assert sum(unbalanced) == sum(balanced)
    assert max(unbalanced) / (sum(unbalanced) / 2) > 1.8  # one rank writes ~everything
    assert max(balanced) / (sum(balanced) / 2) < 1.05
    m = gds_persist.read_manifest(os.path.join(root, "rep"))
    assert m.writer["rank_bytes"] == balanced and len(m.files) == 2
    # the embedding is stored as two extents written by different ranks, each with its own CRC
    sizes = {f.name: f.size for f in m.files}
    assert min(sizes.values()) > 0.4 * sum(sizes.values())
    assert gds_persist.verify(os.path.join(root, "rep")).ok


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dt_roundtrip", "async_roundtrip"])
def test_every_rank_round_trips(saved, case):
    """dt_roundtrip: a DTensor sharded on dim 0 saved by two ranks, loaded by two;
    async_roundtrip: dcp.async_save."""
    _, reports = saved
    assert all(r[case] for r in reports), [r[case] for r in reports]


@pytest.mark.slow
def test_dtensor_shard0_loaded_by_one_rank_into_full_tensors(saved):
    root, _ = saved
    back = {
        "w": torch.zeros(10, 6),
        "odd": torch.zeros(7, 3, dtype=torch.float16),
        "rep": torch.zeros(12, dtype=torch.int32),
    }
    dcp.load(back, storage_reader=GdsPersistReader(os.path.join(root, "dt")), no_dist=True)
    assert torch.equal(back["w"], W.full_sharded(10, 6, 1))
    assert torch.equal(back["odd"], W.full_sharded(7, 3, 2).to(torch.float16))
    assert torch.equal(back["rep"], torch.arange(12, dtype=torch.int32))


@pytest.mark.slow
def test_dtensor_shard0_loaded_by_three_ranks(saved):
    root, _ = saved
    mp.spawn(W.load_scenarios, args=(3, W.free_port(), root), nprocs=3, join=True)
    shapes = []
    for rank in range(3):
        with open(os.path.join(root, f"load3-{rank}.json")) as f:
            r = json.load(f)
        assert r["dt_equal"] and r["rep_equal"], r
        shapes.append(r["dt_local_shapes"])
    assert [s[0][0] for s in shapes] == [4, 4, 2]  # 10 rows resharded over 3 ranks


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint(saved):
    root, reports = saved
    for r in reports:
        assert r["interrupted_raised"] and r["interrupted_kept_previous"]
    leftovers = reports[0]["interrupted_leftovers"]
    assert leftovers and all(".tmp-" in n for n in leftovers)
    for n in leftovers:  # what the failed save left is never loadable
        with pytest.raises(NotCommittedError):
            GdsPersistReader(os.path.join(root, n)).read_metadata()


def _flip_byte_in(path: str, fqn: str) -> None:
    m = gds_persist.read_manifest(path)
    items = gds_persist.load(path)["dcp_items"]
    index = next(i for i, it in enumerate(items) if it["fqn"] == fqn)
    storage = m.tensors[index].storage
    e = next(e for e in m.extents if e.storage == storage)
    with open(os.path.join(path, m.files[e.file].name), "r+b") as f:
        f.seek(e.offset + e.length // 2)
        b = f.read(1)
        f.seek(e.offset + e.length // 2)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_data_file_is_detected_naming_the_item(tmp_path):
    path = str(tmp_path / "ck")
    sd = {"layer.weight": torch.randn(64, 64), "layer.bias": torch.randn(64), "step": 3}
    dcp.save(sd, storage_writer=GdsPersistWriter(path), no_dist=True)
    _flip_byte_in(path, "layer.weight")
    back = {"layer.weight": torch.zeros(64, 64), "layer.bias": torch.zeros(64), "step": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(back, storage_reader=GdsPersistReader(path), no_dist=True)
    original = info.value.failures[0][0]
    assert isinstance(original, ChecksumError)
    assert "DCP item 'layer.weight'" in str(original) and "rank00000-host.bin" in str(original)
    assert not gds_persist.verify(path).ok
    # verify=False reads without comparing (the flipped byte comes through)
    dcp.load(back, storage_reader=GdsPersistReader(path, verify=False), no_dist=True)
    assert not torch.equal(back["layer.weight"], sd["layer.weight"])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_single_process_round_trip_of_odd_tensors(tmp_path):
    path = str(tmp_path / "ck")
    g = torch.Generator().manual_seed(0)
    sd = {
        "t": torch.randn(4, 6, generator=g).t(),  # non-contiguous: stored as its contiguous copy
        "c": torch.randn(3, dtype=torch.complex64, generator=g),
        "b": torch.rand(5, generator=g) > 0.5,
        "e": torch.empty(0, 3),
        "s": torch.tensor(2.5, dtype=torch.bfloat16),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "opt": {"lr": 0.1, "betas": (0.9, 0.99), "nan": float("nan")},
    }
    dcp.save(sd, storage_writer=GdsPersistWriter(path, backend="buffered"), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    back["opt"] = {"lr": 0.0, "betas": None, "nan": 0.0}
    dcp.load(back, storage_reader=GdsPersistReader(path), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(_bytes(back[k]), _bytes(v)), k
    assert back["opt"]["betas"] == (0.9, 0.99) and back["opt"]["lr"] == 0.1
    assert back["opt"]["nan"] != back["opt"]["nan"]


def test_replacing_a_checkpoint_is_atomic_and_refuses_foreign_directories(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"x": torch.ones(4)}, storage_writer=GdsPersistWriter(path), no_dist=True)
    dcp.save({"x": torch.full((4,), 2.0)}, storage_writer=GdsPersistWriter(path), no_dist=True)
    back = {"x": torch.zeros(4)}
    dcp.load(back, storage_reader=GdsPersistReader(path), no_dist=True)
    assert back["x"].tolist() == [2.0] * 4
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary left behind
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointException, match="not a gds_persist checkpoint"):
        dcp.save({"x": torch.ones(4)}, storage_writer=GdsPersistWriter(str(foreign)), no_dist=True)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    """SIGKILL after every rank wrote its data but before the rename: the old one survives."""
    path = str(tmp_path / "ck")
    script = textwrap.dedent(f"""
        import os, signal, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp
        import gds_persist.transfer.commit as c
        from gds_persist.dcp import GdsPersistWriter
        dcp.save({{"x": torch.ones(1000)}}, storage_writer=GdsPersistWriter({path!r}), no_dist=True)
        def killed(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        c.Temporary.swap_in = killed  # the rename into place
        dcp.save({{"x": torch.zeros(1000)}}, storage_writer=GdsPersistWriter({path!r}),
                 no_dist=True)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftovers = [n for n in os.listdir(tmp_path) if n != "ck"]
    assert leftovers and all(n.startswith(".ck.tmp-") for n in leftovers)
    back = {"x": torch.zeros(1000)}
    dcp.load(back, storage_reader=GdsPersistReader(path), no_dist=True)
    assert torch.equal(back["x"], torch.ones(1000))
    with pytest.raises(NotCommittedError):
        GdsPersistReader(str(tmp_path / leftovers[0])).read_metadata()
    # the next save of that path cleans up
    dcp.save({"x": torch.zeros(1000)}, storage_writer=GdsPersistWriter(path), no_dist=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


class Custom:
    """An arbitrary class: torch.load(weights_only=True) refuses to build it."""

    def __init__(self):
        self.v = 1


def test_reader_refuses_plain_checkpoints_and_unsafe_pickles(tmp_path):
    plain = str(tmp_path / "plain")
    gds_persist.save({"x": torch.ones(2)}, plain)
    with pytest.raises(gds_persist.CheckpointError, match="written by gds_persist.save"):
        GdsPersistReader(plain).read_metadata()

    path = str(tmp_path / "ck")
    dcp.save(
        {"obj": Custom(), "x": torch.ones(2)}, storage_writer=GdsPersistWriter(path), no_dist=True
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load({"obj": None, "x": torch.zeros(2)},
                 storage_reader=GdsPersistReader(path, weights_only=True), no_dist=True)
    assert "weights_only=True" in str(info.value.failures[0][0])
    assert "DCP item 'obj'" in str(info.value.failures[0][0])
    # by default the planner unpickles it, as with FileSystemReader (the StorageReader contract)
    back = {"obj": None, "x": torch.zeros(2)}
    dcp.load(back, storage_reader=GdsPersistReader(path), no_dist=True)
    assert isinstance(back["obj"], Custom) and back["obj"].v == 1


def test_use_collectives_false_is_refused(tmp_path):
    with pytest.raises(
        (CheckpointException, gds_persist.CheckpointError), match="use_collectives=False"
    ):
        dcp.save(
            {"x": torch.ones(2)},
            storage_writer=GdsPersistWriter(str(tmp_path / "c")),
            no_dist=True,
            use_collectives=False,
        )


def test_cli_inspect_and_verify_work_on_dcp_checkpoints(tmp_path):
    from gds_persist.cli import main

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.randn(8, 8)}, storage_writer=GdsPersistWriter(path), no_dist=True)
    assert main(["verify", path]) == 0
    shutil.copytree(path, tmp_path / "bad")
    _flip_byte_in(str(tmp_path / "bad"), "w")
    assert main(["verify", str(tmp_path / "bad")]) == 1


@pytest.mark.slow
def test_process_based_async_save(tmp_path):
    """DCP's process executor pickles the writer into a separate checkpointing process."""
    path = str(tmp_path / "ck")
    script = textwrap.dedent(f"""
        import warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from gds_persist.dcp import GdsPersistReader, GdsPersistWriter
        if __name__ == "__main__":
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{W.free_port()}",
                                    rank=0, world_size=1)
            sd = {{"w": torch.randn(100, 10), "step": 4}}
            fut = dcp.async_save(sd, storage_writer=GdsPersistWriter({path!r}),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            getattr(fut, "upload_completion", fut).result()
            back = {{"w": torch.zeros(100, 10), "step": 0}}
            dcp.load(back, storage_reader=GdsPersistReader({path!r}))
            assert torch.equal(back["w"], sd["w"]) and back["step"] == 4
            print("OK")
            dist.destroy_process_group()
    """)
    script_path = tmp_path / "run.py"
    script_path.write_text(script)
    proc = subprocess.run(
        [sys.executable, str(script_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=180,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert gds_persist.verify(path).ok

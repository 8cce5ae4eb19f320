"""One torch.save-compatible file written by the engine (``save(..., format="torch")``), and
stock torch.save / safetensors files read by it (``load``, ``load(into=)``, ``verify``).

What torch.load needs is checked with stock torch.load itself (plain, ``weights_only=True`` and
``mmap=True``); the layout with Python's zipfile and our own index reader; corruption by
flipping real bytes of real files; data-parallel writes with real gloo processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch_file_tasks as tasks
from _dist_tasks import make_state
from _gang import Gang
from safetensors.torch import load_file, save_file

import gds_persist
from gds_persist.format import torch_archive, torch_pickle
from tests.helpers import assert_tree_equal, flip_byte

REPO = Path(__file__).resolve().parent.parent
# every dtype torch.save writes as a plain tensor: not the quantized ones (their own rebuild),
# bits* and sub-byte ints (not comparable), complex32 (torch warns that it is experimental)
SUB_BYTE = {f"{s}int{n}" for s in ("", "u") for n in range(1, 8)}


def _dtypes() -> list[torch.dtype]:
    found = {d for d in (getattr(torch, n) for n in dir(torch)) if isinstance(d, torch.dtype)}
    return sorted((d for d in found if not str(d)[6:].startswith(("qint", "quint", "bits"))
                   and str(d)[6:] not in SUB_BYTE | {"complex32"}), key=str)


def _random(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bytes (NaN patterns included: compared by bytes)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


def _state() -> dict:
    state = make_state()
    state["dtypes"] = {str(d): _random(d, 37, i) for i, d in enumerate(_dtypes())}
    state["param"] = torch.nn.Parameter(torch.randn(4, 3))
    state["frozen"] = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    state["grad"] = torch.randn(3).requires_grad_(True)
    state["nested"] = [{"t": (torch.arange(3), None, "s", 2.5, True)}, []]
    state["large"] = torch.randn(1 << 18)  # several blocks: direct and staged requests
    return state


def _load_every_way(path: Path) -> Iterator[tuple[str, object]]:
    yield "torch.load", torch.load(path, weights_only=True)
    yield "torch.load(mmap)", torch.load(path, weights_only=True, mmap=True)
    yield "gds_persist.load", gds_persist.load(path)


def test_a_file_named_without_a_directory_loads_with_every_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "model.pt", as the README writes it: its directory is ""
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    gds_persist.save(state, "model.pt", format="torch")
    torch.save(state, "stock.pt")
    for name in ("model.pt", "stock.pt"):
        for backend in ("auto", "direct", "buffered"):
            assert torch.equal(gds_persist.load(name, backend=backend)["w"], state["w"]), name


def test_stock_torch_load_reads_it_bit_exactly(tmp_path: Path) -> None:
    state = _state()
    info = gds_persist.save(state, tmp_path / "x.pt", format="torch")
    assert info.path == str(tmp_path / "x.pt") and os.path.isfile(info.path)
    assert info.bytes_written == os.path.getsize(info.path)
    for how, got in _load_every_way(tmp_path / "x.pt"):
        assert_tree_equal(got, state, how)
        m = got["model"]  # tied weights stay one storage; a view stays a view of it
        assert m["lm_head"].untyped_storage().data_ptr() == m["wte"].untyped_storage().data_ptr()
        assert m["window"].untyped_storage().data_ptr() == m["wte"].untyped_storage().data_ptr()
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]  # no temporary left


def test_storages_sit_at_4096_aligned_offsets_in_a_valid_zip(tmp_path: Path) -> None:
    gds_persist.save(_state(), tmp_path / "x.pt", format="torch")
    with open(tmp_path / "x.pt", "rb") as f:
        data = f.read()
    index = torch_archive.read_index(lambda at, n: data[at:at + n], len(data))
    storages = [r for name, r in index.records.items() if name.startswith("data/")]
    assert storages and all(r.data % 4096 == 0 for r in storages)
    names = zipfile.ZipFile(tmp_path / "x.pt").namelist()  # Python's own zip reader
    assert names[0] == "x/data.pkl" and names[-1] == "x/.data/serialization_id"
    assert "x/.gds_persist/checksums.json" in names
    checksums = json.loads(zipfile.ZipFile(tmp_path / "x.pt").read(
        "x/.gds_persist/checksums.json"))
    assert checksums["algorithm"] == "crc32c" and "data/0" in checksums["records"]


def test_the_open_places_storages_where_their_local_headers_say(tmp_path: Path) -> None:
    """Opening a file gds_persist wrote reads one storage's local header and places the others
    by the writer's rule; the offsets are those of every local header, read one by one."""
    from gds_persist.transfer.opened import open_file

    gds_persist.save(_state(), tmp_path / "x.pt", format="torch")
    with open(tmp_path / "x.pt", "rb") as f:
        data = f.read()
    index = torch_archive.read_index(lambda at, n: data[at:at + n], len(data))
    with open_file(str(tmp_path / "x.pt")) as ck:
        assert ck._headers is not None  # the rest are checked on a thread
        ck.check_layout()
        placed = {e.storage: e.offset for e in ck.manifest.extents}
    pkl = index.records["data.pkl"]
    keys = [s.key for s in torch_pickle.skeleton(data[pkl.data : pkl.data + pkl.size]).storages]
    assert len(placed) > 2
    assert placed == {k: index.records[f"data/{keys[k]}"].data for k in placed}


def test_opening_without_reading_starts_no_thread_and_keeps_no_descriptor(
        tmp_path: Path) -> None:
    """The local headers are read only once data is read: reading the manifest of a file
    over and over leaves no thread and no descriptor behind."""
    import threading

    gds_persist.save(_state(), tmp_path / "x.pt", format="torch")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        gds_persist.read_manifest(tmp_path / "x.pt")
    assert len(os.listdir("/proc/self/fd")) == before
    assert not [t for t in threading.enumerate() if t.name == "gds_persist-zip-headers"]


def _local_header_at(data: bytearray, index: torch_archive.ArchiveIndex, name: str) -> int:
    """The offset of record ``name``'s local header (its data offset less header, name, extra)."""
    at = data.rfind(b"PK\x03\x04", 0, index.records[name].data)
    assert at >= 0
    return at


def test_a_storage_header_that_moves_its_data_is_refused_after_the_read(
        tmp_path: Path) -> None:
    """A local header (not the first storage's) that puts its data elsewhere than the writer's
    rule: the bytes read are intact (CRC32C passes), but torch.load would read other bytes
    there, so load, restore in place and verify refuse the file, naming the record."""
    sd = {"a": torch.randn(3000), "b": torch.randn(5000), "c": torch.randn(7000)}
    path = tmp_path / "x.pt"
    gds_persist.save(sd, path, format="torch")
    data = bytearray(path.read_bytes())
    index = torch_archive.read_index(lambda at, n: bytes(data[at:at + n]), len(data))
    header = _local_header_at(data, index, "data/2")
    extra_len = int.from_bytes(data[header + 28 : header + 30], "little")
    data[header + 28 : header + 30] = (extra_len - 4).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    for attempt in (lambda: gds_persist.load(path),
                    lambda: gds_persist.load(path, into={k: torch.zeros_like(t)
                                                         for k, t in sd.items()}),
                    lambda: gds_persist.verify(path)):
        with pytest.raises(gds_persist.ManifestError, match=r"x/data/2: its local header puts "
                           r"its data at offset \d+, not at \d+"):
            attempt()


def test_an_archive_rewritten_by_zipfile_still_loads_verified(tmp_path: Path) -> None:
    """Python's zipfile rewrites every local header (no padding): the first storage's header
    disagrees with the writer's rule, so every local header is read, and the file loads with
    every storage checked against its CRC32C."""
    sd = {"a": torch.randn(3000), "b": torch.randn(5000), "c": torch.arange(100)}
    gds_persist.save(sd, tmp_path / "x.pt", format="torch")
    data = (tmp_path / "x.pt").read_bytes()
    index = torch_archive.read_index(lambda at, n: data[at:at + n], len(data))
    with zipfile.ZipFile(tmp_path / "y.pt", "w", zipfile.ZIP_STORED) as dst:
        for name, rec in index.records.items():  # the bytes as stored (storages record no CRC)
            dst.writestr(f"x/{name}", data[rec.data : rec.data + rec.size])
    state, info = gds_persist.load_with_info(tmp_path / "y.pt")
    assert_tree_equal(state, sd)
    assert gds_persist.verify(tmp_path / "y.pt").ok


def test_every_backend_writes_the_same_bytes(tmp_path: Path) -> None:
    state = _state()
    files = {}
    for backend in ("direct", "buffered"):
        (tmp_path / backend).mkdir()
        gds_persist.save(state, tmp_path / backend / "x.pt", format="torch", backend=backend)
        files[backend] = (tmp_path / backend / "x.pt").read_bytes()
    index = torch_archive.read_index(*_reader(tmp_path / "direct" / "x.pt"))
    tail = index.records[torch_archive.CHECKSUM_RECORD].data  # from here: who wrote it (backend)
    assert files["direct"][:tail] == files["buffered"][:tail]
    doc = [json.loads(f[tail:].split(b"PK\x07\x08")[0]) for f in files.values()]
    assert doc[0]["records"] == doc[1]["records"]  # the same CRC32C of every record
    assert [d["writer"]["backend"] for d in doc] == ["direct", "buffered"]


def test_small_staging_and_block_sizes_change_nothing(tmp_path: Path) -> None:
    state = _state()
    with gds_persist.settings.set(block_bytes=4096, staging_bytes=3 * 4096, io_threads=2):
        gds_persist.save(state, tmp_path / "x.pt", format="torch")
        assert_tree_equal(gds_persist.load(tmp_path / "x.pt"), state)
    assert_tree_equal(torch.load(tmp_path / "x.pt", weights_only=True), state)


def test_a_flipped_byte_is_reported_by_gds_persist_while_torch_load_takes_it(
        tmp_path: Path) -> None:
    state = {"w": torch.arange(100000, dtype=torch.float32)}
    gds_persist.save(state, tmp_path / "x.pt", format="torch")
    assert gds_persist.verify(tmp_path / "x.pt").ok
    offset = torch_archive.read_index(*_reader(tmp_path / "x.pt")).records["data/0"].data
    flip_byte(tmp_path / "x.pt", offset + 1234)
    assert not torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], state["w"])
    with pytest.raises(gds_persist.ChecksumError, match=r"checksum mismatch in tensor \['w'\]"):
        gds_persist.load(tmp_path / "x.pt")
    report = gds_persist.verify(tmp_path / "x.pt")
    assert not report.ok and report.checksum == "crc32c"
    r = _cli("verify", str(tmp_path / "x.pt"))
    assert r.returncode == 1 and "MISMATCH" in r.stderr


def test_a_replaced_file_is_replaced_atomically_and_a_failure_keeps_the_old(
        tmp_path: Path) -> None:
    gds_persist.save({"w": torch.ones(3)}, tmp_path / "x.pt", format="torch")
    with pytest.raises(TypeError, match=r"cannot be pickled into a torch.save file"):
        gds_persist.save({"w": torch.zeros(3), "f": lambda: 1}, tmp_path / "x.pt",
                         format="torch", allow_pickle=True)
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], torch.ones(3))
    gds_persist.save({"w": torch.zeros(3)}, tmp_path / "x.pt", format="torch")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], torch.zeros(3))
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]


class Box:
    """An object torch's weights-only unpickler does not know."""


def test_what_a_torch_file_cannot_hold_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"weights_only=True\) does not read .*allow_pickle=True"):
        gds_persist.save({"w": torch.ones(1), "box": Box()}, tmp_path / "a.pt", format="torch")
    with pytest.raises(ValueError, match=r"format='torch' writes one plain torch.save file.*"
                                         r"compression="):
        gds_persist.save({"w": torch.ones(1)}, tmp_path / "a.pt", format="torch",
                         options=gds_persist.SaveOptions(compression="lossless"))
    with pytest.raises(ValueError, match=r"format=.*valid formats are directory, torch"):
        gds_persist.save({"w": torch.ones(1)}, tmp_path / "a.pt", format="zip")
    gds_persist.save({"w": torch.ones(1)}, tmp_path / "ck")  # a checkpoint directory
    with pytest.raises(gds_persist.CheckpointError, match=r"is a directory; a format='torch'"):
        gds_persist.save({"w": torch.ones(1)}, tmp_path / "ck", format="torch")
    assert gds_persist.verify(tmp_path / "ck").ok  # untouched
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_python_objects_ride_in_the_pickle_with_allow_pickle(tmp_path: Path) -> None:
    from argparse import Namespace

    state = {"w": torch.ones(2), "args": Namespace(lr=0.1, name="run")}
    gds_persist.save(state, tmp_path / "a.pt", format="torch", allow_pickle=True)
    assert torch.load(tmp_path / "a.pt", weights_only=False)["args"].lr == 0.1
    with pytest.raises(gds_persist.PickleRefusedError, match=r"weights_only=False.*Nothing was"):
        gds_persist.load(tmp_path / "a.pt")
    got = gds_persist.load(tmp_path / "a.pt", options=gds_persist.LoadOptions(weights_only=False))
    assert got["args"] == state["args"] and torch.equal(got["w"], state["w"])


def test_stock_torch_save_files_load_and_restore_in_place(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "stock.pt")
    got, info = gds_persist.load_with_info(tmp_path / "stock.pt")
    assert_tree_equal(got, state)
    assert "not verified: the file records no checksums" in info.reason
    live = {"model": OrderedDict((k, torch.zeros_like(v)) for k, v in state["model"].items()),
            "large": torch.zeros_like(state["large"])}
    addresses = {k: v.data_ptr() for k, v in live["model"].items()}
    got, info = gds_persist.load_with_info(tmp_path / "stock.pt", into=live, strict=False)
    assert got["large"] is live["large"] and torch.equal(live["large"], state["large"])
    assert info.in_place_bytes >= state["large"].numel() * 4  # straight into the tensor
    for k, v in live["model"].items():
        assert got["model"][k] is v and v.data_ptr() == addresses[k]
        assert torch.equal(v, state["model"][k]), k
    assert_tree_equal(got["optimizer"], state["optimizer"])  # the rest, loaded fresh
    with pytest.raises(gds_persist.StateMismatchError, match=r"\['large'\]: saved float32"):
        gds_persist.load(tmp_path / "stock.pt", into={"large": torch.zeros(3)}, strict=False)


MEMORY_PROBE = textwrap.dedent("""
    import json, sys, torch, gds_persist
    path = sys.argv[1]
    live = {f"w{i}": torch.zeros(1 << 22) for i in range(16)}  # 256 MiB, touched
    def hwm():
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
    before = hwm()
    gds_persist.load(path, into=live)
    growth = hwm() - before
    ok = all(bool((t == i).all()) for i, t in enumerate(live.values()))
    print(json.dumps({"growth": growth, "ok": ok,
                      "staging": gds_persist.settings.current().staging_bytes}))
""")


def test_a_stock_file_restores_in_place_with_bounded_memory(tmp_path: Path) -> None:
    torch.save({f"w{i}": torch.full((1 << 22,), float(i)) for i in range(16)},
               tmp_path / "stock.pt")
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "stock.pt")],
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"]
    assert result["growth"] <= result["staging"] + (64 << 20), result


def test_safetensors_files_load_flat_and_in_place(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.randn(300, 7), "b": torch.arange(10, dtype=torch.int16),
               "e": torch.empty(0, 3), "h": torch.randn(5).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    got, info = gds_persist.load_with_info(tmp_path / "m.safetensors")
    assert_tree_equal(got, load_file(str(tmp_path / "m.safetensors")))  # same keys, same order
    assert "not verified" in info.reason
    live = {k: torch.zeros_like(v) for k, v in tensors.items()}
    got = gds_persist.load(tmp_path / "m.safetensors", into=live)
    for k, v in live.items():
        assert got[k] is v and torch.equal(v, tensors[k])
    assert not gds_persist.verify(tmp_path / "m.safetensors").verified
    r = _cli("verify", str(tmp_path / "m.safetensors"))
    assert r.returncode == 3 and "NOT VERIFIED" in r.stdout


def test_verify_checks_a_stock_file_against_its_zip_crc32(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(5000.0)}, tmp_path / "stock.pt")
    report = gds_persist.verify(tmp_path / "stock.pt")
    assert report.ok and report.checksum == "zip crc-32" and report.extents == 1
    offset = torch_archive.read_index(*_reader(tmp_path / "stock.pt")).records["data/0"].data
    flip_byte(tmp_path / "stock.pt", offset + 17)
    report = gds_persist.verify(tmp_path / "stock.pt")
    assert [str(e) for e in report.errors][0].startswith("zip CRC-32 mismatch in tensor ['w']")


def test_inspect_shows_a_torch_file(tmp_path: Path) -> None:
    gds_persist.save({"w": torch.ones(4, 5)}, tmp_path / "x.pt", format="torch")
    r = _cli("inspect", str(tmp_path / "x.pt"))
    assert r.returncode == 0, r.stderr
    assert "['w']" in r.stdout and "float32" in r.stdout and "[4, 5]" in r.stdout


def test_export_and_dcp_to_torch_save_write_the_engine_s_file(tmp_path: Path) -> None:
    state = {"w": torch.randn(100), "step": 3}
    gds_persist.save(state, tmp_path / "ck")
    gds_persist.export_checkpoint(tmp_path / "ck", tmp_path / "out.pt")
    assert "x" not in zipfile.ZipFile(tmp_path / "out.pt").namelist()[0]
    assert gds_persist.verify(tmp_path / "out.pt").checksum == "crc32c"
    assert_tree_equal(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_a_file_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.pt").write_text("hello\n")
    with pytest.raises(gds_persist.NotACheckpointDirectoryError,
                       match=r"neither a torch.save archive nor a safetensors file"):
        gds_persist.load(tmp_path / "notes.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "cut.pt")
    data = (tmp_path / "cut.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) - 30])
    with pytest.raises(gds_persist.ManifestError, match=r"cut.pt: not a torch.save archive"):
        gds_persist.load(tmp_path / "cut.pt")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "direct", "kvikio"])
def test_cuda_state_to_a_torch_file_and_back_in_place(tmp_path: Path, backend: str) -> None:
    """CUDA storages go through pinned buffers (direct) or from device memory (kvikio); the
    file loads on the GPU with torch.load, and gds_persist fills live CUDA tensors in place."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    if backend == "kvikio":
        from tests.helpers import kvikio_missing

        if (why := kvikio_missing()) is not None:
            pytest.skip(why)
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda"),
             "host": torch.arange(5)}
    info = gds_persist.save(state, tmp_path / "x.pt", format="torch", backend=backend)
    assert backend == "auto" or info.backend == backend, info.reason
    assert_tree_equal(torch.load(tmp_path / "x.pt", weights_only=True), state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    got = gds_persist.load(tmp_path / "x.pt", into=live, backend=backend)
    for k, v in live.items():
        assert got[k] is v and torch.equal(v, state[k]), k


# --- data-parallel: the ranks write parts of the one file ---------------------------------------

@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(3, timeout_s=60) as g:
        yield g


@pytest.mark.slow
def test_ranks_write_byte_ranges_of_one_file(gang: Gang, tmp_path: Path) -> None:
    path = tmp_path / "dp.pt"
    infos = [i for i in gang.run(tasks.save_one_file, 3, str(path)) if i is not None]
    assert all("error" not in i for i in infos), infos
    assert infos[0]["writers"] == [0, 1, 2]
    assert all(i["rank_bytes"] > 0 for i in infos)  # every rank wrote a part
    assert sum(i["rank_bytes"] for i in infos) < infos[0]["bytes"]  # the tail: rank 0, after
    assert_tree_equal(torch.load(path, weights_only=True), make_state())
    assert gds_persist.verify(path).ok
    loaded = [r for r in gang.run(tasks.load_one_file, 3, str(path)) if r is not None]
    assert all(r["ok"] for r in loaded)
    _, alone = gds_persist.load_with_info(path)
    assert sum(r["read"] for r in loaded) <= alone.bytes_read + 3 * 2 * 4096  # once in total


@pytest.mark.slow
def test_ranks_holding_different_states_are_refused(gang: Gang, tmp_path: Path) -> None:
    path = tmp_path / "dp.pt"
    results = [r for r in gang.run(tasks.save_one_file, 2, str(path), differ=True) if r]
    assert all("ReplicationError" in r["error"] and "ranks [1]" in r["error"] for r in results)
    assert not path.exists() and os.listdir(tmp_path) == []


def _reader(path: Path) -> tuple:
    data = path.read_bytes()
    return (lambda at, n: data[at:at + n]), len(data)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gds_persist", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_replicas_on_other_gpus_pickle_alike_but_for_their_ordinals() -> None:
    """Data-parallel ranks hold their replica on their own GPU: the location strings of the
    persistent ids differ ("cuda:0", "cuda:12", of other lengths) and nothing else may."""
    from gds_persist.format.torch_pickle import replica_digest

    def pid(location: bytes) -> bytes:  # BINUNICODE as protocol 2 writes it
        return b"(X\x07\x00\x00\x00storageq\x01" + b"X" + len(location).to_bytes(4, "little") \
            + location + b"q\x02tQ."

    assert replica_digest(pid(b"cuda:0")) == replica_digest(pid(b"cuda:12"))
    assert replica_digest(pid(b"cuda:0")) != replica_digest(pid(b"cpu"))
    state = {"w": torch.ones(3)}
    from gds_persist.format.torch_pickle import pickle_state

    assert replica_digest(pickle_state(state)[0]) == replica_digest(pickle_state(state)[0])
    assert replica_digest(pickle_state(state)[0]) != replica_digest(
        pickle_state({"w": torch.ones(4)})[0])

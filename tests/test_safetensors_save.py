"""``save(state, directory, format="safetensors")``: the Hugging Face layout written by the engine,
read back by stock ``safetensors`` (``load_file``, ``safe_open``), Transformers'
``from_pretrained``, and gds_persist's ``load``, ``load(into=)`` and ``verify`` (every tensor's
CRC32C). Real files, real bytes flipped, real gloo ranks."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors_tasks as tasks
import torch
from _gang import Gang
from safetensors import safe_open
from safetensors.torch import load_file

import gds_persist
from gds_persist.format.safetensors import CRC_KEY, TIED_KEY
from tests.helpers import flip_byte

SHARD = 20_000  # bytes: the model_state() cut into several files


def _header(file: Path) -> tuple[int, dict]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _check_layout(file: Path) -> None:
    """Data aligned at 4096, tensors back to back from its start to the end of the file."""
    start, header = _header(file)
    assert start % 4096 == 0
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert os.path.getsize(file) == start + spans[-1][1]


def test_one_file_read_by_stock_readers_and_load(tmp_path: Path) -> None:
    state = tasks.model_state()
    state["nc"] = torch.randn(5, 7).t()  # not contiguous: stored as its contiguous copy
    state["empty"] = torch.empty(0, 3)
    info = gds_persist.save(state, tmp_path / "m", format="safetensors")
    file = tmp_path / "m" / "model.safetensors"
    assert info.files == ["model.safetensors"] and info.storages == len(state) - 1
    _check_layout(file)
    stock = load_file(file)
    assert "lm_head.weight" not in stock  # a tie is stored once, as save_pretrained does
    assert all(torch.equal(stock[k], state[k]) for k in stock)
    with safe_open(file, "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and json.loads(meta[TIED_KEY]) == {
            "lm_head.weight": "wte.weight"}
        assert set(json.loads(meta[CRC_KEY])) == set(f.keys())
    back = gds_persist.load(tmp_path / "m")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert back["lm_head.weight"].untyped_storage().data_ptr() == \
        back["wte.weight"].untyped_storage().data_ptr()  # the tie restored
    assert gds_persist.verify(tmp_path / "m").ok


def test_shards_index_and_load_into(tmp_path: Path) -> None:
    state = tasks.model_state()
    gds_persist.save(state, tmp_path / "m", format="safetensors",
                     options=gds_persist.SaveOptions(max_shard_size=SHARD))
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(tmp_path / "m")) == sorted([*files,
                                                         "model.safetensors.index.json"])
    for name in files:
        _check_layout(tmp_path / "m" / name)
        for k, v in load_file(tmp_path / "m" / name).items():
            assert index["weight_map"][k] == name and torch.equal(v, state[k])
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    out = gds_persist.load(tmp_path / "m", into=into)
    assert all(torch.equal(out[k], state[k]) and out[k].data_ptr() == ptrs[k] for k in state)
    assert gds_persist.verify(tmp_path / "m").ok


def test_a_flipped_byte_is_found_in_its_tensor(tmp_path: Path) -> None:
    gds_persist.save(tasks.model_state(), tmp_path / "m", format="safetensors")
    file = tmp_path / "m" / "model.safetensors"
    start, header = _header(file)
    flip_byte(file, start + header["h.0.b"]["data_offsets"][0] + 3)
    report = gds_persist.verify(tmp_path / "m")
    assert not report.ok and "h.0.b" in str(report.errors[0])
    with pytest.raises(gds_persist.ChecksumError, match="h.0.b"):
        gds_persist.load(tmp_path / "m")


def test_a_failed_save_leaves_the_previous_model_and_other_files(tmp_path: Path) -> None:
    d = tmp_path / "m"
    gds_persist.save(tasks.model_state(), d, format="safetensors",
                     options=gds_persist.SaveOptions(max_shard_size=SHARD))
    (d / "config.json").write_text("{}")
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}

    def fail(done: int, total: int) -> None:
        raise RuntimeError("interrupted mid-write")

    changed = {k: v + 1 for k, v in tasks.model_state().items()}
    with pytest.raises(RuntimeError, match="mid-write"):
        gds_persist.save(changed, d, format="safetensors", progress=fail)
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    assert [n for n in os.listdir(tmp_path) if n != "m"] == []  # no temporary left
    gds_persist.save(changed, d, format="safetensors")  # one file now: the shards go
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]  # config.json kept
    assert torch.equal(load_file(d / "model.safetensors")["h.0.b"], changed["h.0.b"])


def test_what_safetensors_cannot_hold_is_refused_before_writing(tmp_path: Path) -> None:
    for bad, match in (({"a": {"b": torch.ones(1)}}, "flat mapping"),
                       ({"a": torch.ones(1, dtype=torch.complex128)}, "no code"),
                       ({"a": torch.ones(1), 3: torch.ones(1)}, "strings")):
        with pytest.raises(TypeError, match=match):
            gds_persist.save(bad, tmp_path / "m", format="safetensors")
    assert not (tmp_path / "m").exists()
    (tmp_path / "x" / "sub").mkdir(parents=True)  # files of its own would be carried over
    with pytest.raises(gds_persist.CheckpointError, match="not a gds_persist checkpoint"):
        gds_persist.save({"a": torch.ones(1)}, tmp_path / "x", format="safetensors")


def test_from_pretrained_reads_it_and_ties_the_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=101,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    config.save_pretrained(tmp_path / "m")
    gds_persist.save(model.state_dict(), tmp_path / "m", format="safetensors")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m").eval()
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_stock_model_directory_loads_unverified(tmp_path: Path) -> None:
    """save_pretrained's files (no CRC32C recorded): load and load(into=) read them through the
    engine (the tied lm_head.weight is not stored, as for load_file); verify checks nothing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=101,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "hf")
    back, info = gds_persist.load_with_info(tmp_path / "hf")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    assert "not verified" in info.reason
    report = gds_persist.verify(tmp_path / "hf")
    assert report.ok and report.checksum == "none"
    into = {k: torch.zeros_like(v) for k, v in want.items()}
    gds_persist.load(tmp_path / "hf", into=into)
    assert all(torch.equal(into[k], want[k]) for k in want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["direct", "kvikio"])
def test_cuda_weights_to_safetensors_and_back_in_place(tmp_path: Path, backend: str) -> None:
    """CUDA tensors through pinned buffers (direct) or from device memory (kvikio)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    if backend == "kvikio":
        from tests.helpers import kvikio_missing

        if (why := kvikio_missing()) is not None:
            pytest.skip(why)
    state = {k: v.cuda() for k, v in tasks.model_state().items()}
    info = gds_persist.save(state, tmp_path / "m", format="safetensors", backend=backend)
    assert info.backend == backend, info.reason
    stock = load_file(tmp_path / "m" / "model.safetensors", device="cuda")
    assert all(torch.equal(v, state[k]) for k, v in stock.items())
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    gds_persist.load(tmp_path / "m", into=live, backend=backend)
    assert all(torch.equal(live[k], state[k]) for k in state)


@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(2, timeout_s=60) as g:
        yield g


def test_ranks_write_byte_ranges_of_the_shards(gang: Gang, tmp_path: Path) -> None:
    infos = [i for i in gang.run(tasks.save_model, 2, str(tmp_path / "m"), SHARD) if i]
    assert [i["writers"] for i in infos] == [[0, 1]] * 2
    assert all(i["rank_bytes"] > 0 for i in infos)
    want = tasks.model_state()
    back = gds_persist.load(tmp_path / "m")
    assert all(torch.equal(back[k], want[k]) for k in want)
    assert gds_persist.verify(tmp_path / "m").ok
    for name in infos[0]["files"][:-1]:
        _check_layout(tmp_path / "m" / name)

"""The conformance suite: every backend must round-trip every kind of state dict bit-exactly.

Each test that takes the ``backend`` fixture runs once per backend (direct, buffered, and kvikio
on GPU machines); the data is saved *and* loaded with that backend.
"""

from __future__ import annotations

import math
import os
import string
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_persist
from gds_persist.format import ALIGNMENT, DTYPES, align_up
from tests.helpers import (
    BackendCase,
    assert_tree_equal,
    available_backends,
    cuda_missing,
    data_files,
    kvikio_missing,
    manifest_doc,
    random_tensor,
    raw_bytes,
)

# A ring of two 8 KiB buffers: every tensor above 16 KiB is larger than the whole ring.
BLOCK = 8192
RING = 2 * BLOCK
SMALL_RING = {"block_bytes": BLOCK, "staging_bytes": RING}

REQUIRED_DTYPES = [
    "bfloat16", "float16", "float32", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "complex64", "complex128",
]


def roundtrip(sd: Any, path: Path, backend: BackendCase, **ring: Any) -> Any:
    """Save and load ``sd`` with the staging ring ``ring`` (block_bytes, staging_bytes)."""
    with gds_persist.settings.set(**ring):
        info = gds_persist.save(sd, path, backend=backend.name)
        assert info.backend == backend.name
        return gds_persist.load(path, backend=backend.name)


# --- dtypes, shapes, views -------------------------------------------------------------------

def test_required_dtypes_are_supported() -> None:
    missing = [n for n in REQUIRED_DTYPES if n not in DTYPES]
    assert not missing, f"dtypes the format cannot name: {missing}"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_every_dtype_bit_exact(backend: BackendCase, tmp_path: Path) -> None:
    """Every dtype the format names, with random bits (random NaN payloads included)."""
    sd = {name: random_tensor(dt, 37, seed=i, device=backend.device)
          for i, (name, dt) in enumerate(sorted(DTYPES.items()))}
    sd["float32_specials"] = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3.4e38], device=backend.device)
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool", "complex128"])
def test_zero_dim_and_empty_tensors(backend: BackendCase, tmp_path: Path, dtype: str) -> None:
    dt, dev = DTYPES[dtype], backend.device
    sd = {
        "scalar": random_tensor(dt, 1, device=dev).reshape(()),
        "empty": torch.empty(0, dtype=dt, device=dev),
        "empty_2d": torch.empty(0, 5, dtype=dt, device=dev),
        "empty_mid": torch.empty(3, 0, 2, dtype=dt, device=dev),
        "empty_view_of_data": random_tensor(dt, 8, seed=1, device=dev)[4:4],
        "after_empties": random_tensor(dt, 3, seed=2, device=dev),
    }
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)
    assert got["scalar"].dim() == 0


def test_non_contiguous_views(backend: BackendCase, tmp_path: Path) -> None:
    dev = backend.device
    base = torch.arange(6 * 7 * 5, dtype=torch.float32, device=dev).reshape(6, 7, 5)
    other = torch.arange(100, dtype=torch.int16, device=dev)
    sd = {
        "transposed": base.transpose(0, 2),
        "sliced": base[1:5, ::2, 3:],  # storage offset and strides
        "column": base[:, 3, 1],
        "permuted": base.permute(2, 0, 1),
        "expanded": other[5:6].expand(4, 3),  # stride 0
        "overlapping": other.as_strided((5, 4), (2, 1), 7),
        "tail": other[90:],
    }
    assert not sd["sliced"].is_contiguous() and sd["sliced"].storage_offset() > 0
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)
    # views of one storage share it after load (and it is the whole storage, written once)
    ptrs = {got[k].untyped_storage().data_ptr() for k in ("transposed", "sliced", "column",
                                                          "permuted")}
    assert len(ptrs) == 1
    assert got["expanded"].untyped_storage().data_ptr() == got["tail"].untyped_storage().data_ptr()
    m = manifest_doc(tmp_path / "ck")["body"]
    assert len(m["storages"]) == 2


def test_tied_storages_share_after_load(backend: BackendCase, tmp_path: Path) -> None:
    """Tied embedding / LM-head weights stay tied, like torch.save."""
    dev = backend.device
    emb = torch.randn(11, 4, device=dev)
    separate = emb.clone()
    sd = {"wte": emb, "lm_head": emb, "row": emb[3], "t": emb.t(), "separate": separate,
          "nested": [{"again": emb}]}
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)
    ptr = got["wte"].untyped_storage().data_ptr()
    for k in ("lm_head", "row", "t"):
        assert got[k].untyped_storage().data_ptr() == ptr, k
    assert got["nested"][0]["again"].untyped_storage().data_ptr() == ptr
    assert got["separate"].untyped_storage().data_ptr() != ptr
    got["wte"][3, 0] = 42.0  # writes through, as torch.save's loaded ties do
    assert got["lm_head"][3, 0].item() == 42.0 and got["row"][0].item() == 42.0
    assert got["t"][0, 3].item() == 42.0 and got["separate"][3, 0].item() != 42.0
    body = manifest_doc(tmp_path / "ck")["body"]
    assert len(body["storages"]) == 2 and len(body["tensors"]) == 6


def test_storages_sharing_an_address_but_not_a_size(backend: BackendCase, tmp_path: Path) -> None:
    """from_numpy of a[:10] and of a: two storages at one address; neither may be truncated."""
    arr = np.arange(100, dtype=np.float32)
    sd = {"head": torch.from_numpy(arr[:10]), "all": torch.from_numpy(arr),
          "again": torch.from_numpy(arr[:10])}
    assert sd["head"].untyped_storage().data_ptr() == sd["all"].untyped_storage().data_ptr()
    if backend.device != "cpu":
        sd = {k: v.to(backend.device) for k, v in sd.items()}
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)


def test_views_with_other_dtypes_share_storage(backend: BackendCase, tmp_path: Path) -> None:
    x = torch.randn(6, device=backend.device)
    sd = {"f32": x, "i32": x.view(torch.int32), "bf16_tail": x.view(torch.bfloat16)[3:],
          "bytes": x.view(torch.uint8)[::5]}
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1


@pytest.mark.parametrize("block, staging", [(4096, 8192), (BLOCK, RING), (BLOCK, 3 * BLOCK + 4096)])
def test_tensors_larger_than_the_staging_ring(backend: BackendCase, tmp_path: Path, block: int,
                                              staging: int) -> None:
    dev = backend.device
    sd = {
        "big": random_tensor(torch.float32, 50_001, seed=1, device=dev),  # many ring sizes
        "small": random_tensor(torch.int8, 3, seed=2, device=dev),
        "bigger_bf16": random_tensor(torch.bfloat16, 3 * RING + 7, seed=3, device=dev),
    }
    got = roundtrip(sd, tmp_path / "ck", backend, block_bytes=block, staging_bytes=staging)
    assert_tree_equal(got, sd)


def test_staging_ring_from_settings(backend: BackendCase, tmp_path: Path) -> None:
    """The same through ``settings.set`` (context manager) instead of arguments."""
    sd = {"big": random_tensor(torch.float64, 9_999, seed=4, device=backend.device)}
    with gds_persist.settings.set(**SMALL_RING) as cfg:
        assert cfg.block_bytes == BLOCK and cfg.ring_buffers == 2
        gds_persist.save(sd, tmp_path / "ck", backend=backend.name)
        got = gds_persist.load(tmp_path / "ck", backend=backend.name)
    assert_tree_equal(got, sd)


EDGE_SIZES = [1, 511, 512, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, RING - 1, RING,
              RING + 1]


@pytest.mark.parametrize("nbytes", EDGE_SIZES)
def test_alignment_edges_one_tensor(backend: BackendCase, tmp_path: Path, nbytes: int) -> None:
    t = random_tensor(torch.uint8, nbytes, seed=nbytes, device=backend.device)
    got = roundtrip({"t": t}, tmp_path / "ck", backend, **SMALL_RING)
    assert_tree_equal(got, {"t": t})
    files = data_files(tmp_path / "ck")
    (content,) = files.values()
    assert len(content) == align_up(nbytes, ALIGNMENT)
    assert content[:nbytes] == raw_bytes(t)
    assert content[nbytes:] == bytes(len(content) - nbytes), "padding after the tail must be zeros"


def test_alignment_edges_packed(backend: BackendCase, tmp_path: Path) -> None:
    """All edge sizes in one file: each extent aligned, the gaps between them zeros."""
    dev = backend.device
    sd = {f"n{n}": random_tensor(torch.uint8, n, seed=n, device=dev) for n in EDGE_SIZES}
    sd["f32_odd"] = random_tensor(torch.float32, 1023, seed=7, device=dev)  # 4092 bytes
    got = roundtrip(sd, tmp_path / "ck", backend, **SMALL_RING)
    assert_tree_equal(got, sd)
    body = manifest_doc(tmp_path / "ck")["body"]
    (content,) = data_files(tmp_path / "ck").values()
    assert len(content) == body["files"][0]["size"] and len(content) % ALIGNMENT == 0
    covered = bytearray(len(content))
    for e in body["extents"]:
        assert e["offset"] % ALIGNMENT == 0
        covered[e["offset"] : e["offset"] + e["length"]] = b"\x01" * e["length"]
    gaps = bytes(b for b, c in zip(content, covered, strict=True) if not c)
    assert gaps == bytes(len(gaps)), "bytes between extents must be zeros"


def test_data_files_byte_identical_across_backends(tmp_path: Path) -> None:
    backends = available_backends(str(tmp_path))
    outputs = {}
    for b in backends:
        sd = {
            "a": random_tensor(torch.float32, 5000, seed=1, device=b.device),
            "b": random_tensor(torch.bfloat16, 3, seed=2, device=b.device),
            "tied": None,
            "c": [random_tensor(torch.int64, 2049, seed=3, device=b.device), 7, "x"],
        }
        sd["tied"] = sd["a"][10:20]
        path = tmp_path / b.name
        with gds_persist.settings.set(**SMALL_RING):
            gds_persist.save(sd, path, backend=b.name)
        body = manifest_doc(path)["body"]
        body.pop("writer")
        if b.device != "cpu":  # the device a storage came from is recorded; nothing else differs
            for s in body["storages"]:
                s["device"] = "cpu"
        outputs[b.name] = (data_files(path), body)
    assert len(outputs) >= 2, "needs at least two backends"
    reference_name, reference = next(iter(outputs.items()))
    for name, out in outputs.items():
        assert out[0] == reference[0], f"data files of {name} differ from {reference_name}"
        assert out[1] == reference[1], f"manifest of {name} differs from {reference_name}"


# --- state dict structure ------------------------------------------------------------------

def _tensors(device: str) -> st.SearchStrategy[torch.Tensor]:
    dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool,
                              torch.uint8, torch.complex64, torch.float8_e5m2])
    shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
    return st.builds(
        lambda dt, shape, seed: random_tensor(dt, math.prod(shape), seed, device).reshape(shape),
        dtypes, shapes, st.integers(0, 2**16),
    )


def _json_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    )


def _state_dicts(device: str) -> st.SearchStrategy[Any]:
    keys = st.one_of(st.text(string.printable, max_size=6), st.integers(-5, 1000))
    leaves = st.one_of(_json_leaves(), _tensors(device))
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=4).map(OrderedDict),
        ),
        max_leaves=12,
    )


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_nested_state_dicts_property(backend: BackendCase, tmp_path: Path, data: Any) -> None:
    sd = data.draw(_state_dicts(backend.device))
    shared = data.draw(_tensors(backend.device))
    sd = {"tree": sd, "shared": shared, "also_shared": [shared], "step": 3}
    path = tmp_path / "ck"  # the same path every example: also exercises replacing a checkpoint
    got = roundtrip(sd, path, backend)
    assert_tree_equal(got, sd)
    if shared.untyped_storage().nbytes():
        assert (got["shared"].untyped_storage().data_ptr()
                == got["also_shared"][0].untyped_storage().data_ptr())


def test_json_leaves_exact(backend: BackendCase, tmp_path: Path) -> None:
    sd = {
        "ints": [0, -1, 2**63, -(2**80), True, False], "none": None, "s": "ünï\u2603\x00\"'",
        "floats": (0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308),
        1: "int key", -3: {0: "nested int keys"}, "1": "str key next to int key 1",
        "empty": {}, "empty_list": [], "empty_tuple": (),
    }
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)


def test_parameters_and_requires_grad(backend: BackendCase, tmp_path: Path) -> None:
    dev = backend.device
    sd = {
        "param": torch.nn.Parameter(torch.randn(3, device=dev)),
        "frozen_param": torch.nn.Parameter(torch.randn(2, device=dev), requires_grad=False),
        "leaf_grad": torch.randn(4, device=dev).requires_grad_(),
        "plain": torch.randn(2, device=dev),
    }
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)  # checks exact type and requires_grad
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    assert type(got["frozen_param"]) is torch.nn.Parameter and not got["frozen_param"].requires_grad
    assert type(got["leaf_grad"]) is torch.Tensor and got["leaf_grad"].requires_grad
    assert got["leaf_grad"].is_leaf


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4),
    ).to(device)


def test_ordered_dict_and_metadata(backend: BackendCase, tmp_path: Path) -> None:
    sd = _model(backend.device).state_dict()
    assert type(sd) is OrderedDict and sd._metadata  # what nn.Module gives
    got = roundtrip({"model": sd}, tmp_path / "ck", backend)["model"]
    assert type(got) is OrderedDict
    assert list(got) == list(sd)
    assert got._metadata == sd._metadata
    assert_tree_equal(got, sd)


def test_model_and_adam_round_trip(backend: BackendCase, tmp_path: Path) -> None:
    dev = backend.device
    model = _model(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    x = torch.randn(5, 8, device=dev)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2, "lr": 1e-2}
    got = roundtrip(sd, tmp_path / "ck", backend)
    assert_tree_equal(got, sd)

    model2 = _model(dev)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1.0)
    model2.load_state_dict(got["model"])
    opt2.load_state_dict(got["optim"])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)
    for m, o in ((model, opt), (model2, opt2)):  # one more identical step on both
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(),
                              strict=True):
        assert raw_bytes(a) == raw_bytes(b), k


# --- map_location ---------------------------------------------------------------------------

MAP_LOCATIONS = {
    "none": None,
    "str": "cpu",
    "device": torch.device("cpu"),
    "dict": {"cpu": "cpu"},
    "callable_identity": lambda storage, location: storage,
    "callable_none": lambda storage, location: None,
}


@pytest.mark.parametrize("name", MAP_LOCATIONS)
def test_map_location_on_cpu(tmp_path: Path, name: str) -> None:
    emb = torch.randn(6, 3)
    sd = {"w": emb, "tied": emb[2:], "n": [torch.arange(5)]}
    gds_persist.save(sd, tmp_path / "ck")
    got = gds_persist.load(tmp_path / "ck", map_location=MAP_LOCATIONS[name])
    assert_tree_equal(got, sd, device="cpu")
    assert got["w"].untyped_storage().data_ptr() == got["tied"].untyped_storage().data_ptr()


def test_map_location_callable_sees_each_storage_once(tmp_path: Path) -> None:
    emb = torch.randn(6, 3)
    sd = {"w": emb, "tied": emb.t(), "other": torch.ones(2, dtype=torch.int32)}
    gds_persist.save(sd, tmp_path / "ck")
    calls: list[tuple[int, str]] = []

    def fn(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        assert storage.device.type == "cpu"
        calls.append((storage.nbytes(), location))
        return storage

    got = gds_persist.load(tmp_path / "ck", map_location=fn)
    assert sorted(calls) == [(8, "cpu"), (72, "cpu")]
    assert_tree_equal(got, sd)


def _pretend_saved_on(path: Path, device: str) -> None:
    """Relabel every storage as saved from ``device`` (resealing the manifest)."""
    from tests.helpers import rewrite_manifest

    def edit(body: dict[str, Any]) -> None:
        for s in body["storages"]:
            s["device"] = device

    rewrite_manifest(path, edit)


@pytest.mark.parametrize("name", ["str", "device", "dict", "callable"])
def test_map_location_moves_cuda_checkpoint_to_cpu(tmp_path: Path, name: str) -> None:
    """A checkpoint written from cuda:0 loads on a CPU-only process with map_location."""
    sd = {"w": torch.randn(4, 4), "b": torch.arange(3)}
    gds_persist.save(sd, tmp_path / "ck")
    _pretend_saved_on(tmp_path / "ck", "cuda:0")
    seen: list[str] = []
    location = {
        "str": "cpu", "device": torch.device("cpu"), "dict": {"cuda:0": "cpu"},
        "callable": lambda s, loc: seen.append(loc) or s,
    }[name]
    got = gds_persist.load(tmp_path / "ck", map_location=location)
    assert_tree_equal(got, sd, device="cpu")
    if name == "callable":
        assert seen == ["cuda:0", "cuda:0"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error message")
def test_cuda_checkpoint_without_map_location_on_cpu_machine(tmp_path: Path) -> None:
    gds_persist.save({"w": torch.ones(2)}, tmp_path / "ck")
    _pretend_saved_on(tmp_path / "ck", "cuda:0")
    match = r"saved on cuda:0 but CUDA is not available.*map_location"
    with pytest.raises(RuntimeError, match=match):
        gds_persist.load(tmp_path / "ck")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_missing() is not None, reason=f"{cuda_missing()}")
@pytest.mark.parametrize("target", ["cpu", "cuda", "cuda:0"])
def test_map_location_between_devices_on_gpu(tmp_path: Path, target: str) -> None:
    for source in ("cpu", "cuda"):
        sd = {"w": torch.randn(33, device=source), "i": torch.arange(7, device=source)}
        path = tmp_path / f"from-{source}"
        gds_persist.save(sd, path)
        got = gds_persist.load(path, map_location=target)
        assert_tree_equal(got, sd, device=target if target != "cuda" else "cuda:0")
        back = gds_persist.load(path)  # None: where it came from
        assert back["w"].device.type == source


def test_path_like_and_str_paths(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4)}
    gds_persist.save(sd, str(tmp_path / "s"))
    gds_persist.save(sd, tmp_path / "p")
    assert_tree_equal(gds_persist.load(os.fspath(tmp_path / "p")), sd)
    assert_tree_equal(gds_persist.load(tmp_path / "s"), sd)


def test_save_info_reports_backend_reason_bytes_and_time(backend: BackendCase,
                                                         tmp_path: Path) -> None:
    emb = torch.randn(1000, device=backend.device)
    sd = {"a": emb, "tied": emb[:10], "b": torch.ones(3, dtype=torch.int16, device=backend.device)}
    info = gds_persist.save(sd, tmp_path / "ck", backend=backend.name)
    on_disk = sum(len(b) for b in data_files(tmp_path / "ck").values())
    assert info.backend == backend.name
    if backend.name == "kvikio":  # plus the GDS/compat mode and why, and KvikIO's settings
        assert info.reason.startswith("requested explicitly; ")
    else:
        assert info.reason == "requested explicitly"
    assert info.bytes_written == on_disk == 8192
    assert info.payload_bytes == 4006
    assert (info.tensors, info.storages, info.files) == (3, 2, ["data-00000.bin"])
    assert info.seconds > 0 and info.gbps > 0
    assert info.path == str(tmp_path / "ck")
    writer = manifest_doc(tmp_path / "ck")["body"]["writer"]
    assert (writer["backend"], writer["reason"]) == (info.backend, info.reason)


def test_auto_says_why(tmp_path: Path) -> None:
    from gds_persist.backends import supports_o_direct

    direct = supports_o_direct(str(tmp_path))[0]  # ext4 here; ramfs cases are in test_errors
    info = gds_persist.save({"w": torch.ones(2)}, tmp_path / "ck")
    assert info.backend == ("direct" if direct else "buffered")
    assert info.reason.startswith("auto: ") and "O_DIRECT" in info.reason
    assert "kvikio not used (no CUDA tensors)" in info.reason


@pytest.mark.gpu
def test_auto_with_cuda_tensors(tmp_path: Path) -> None:
    """kvikio where cuFile runs in GDS mode, the pinned pipeline in compatibility mode
    (tests/test_backend_auto.py has the rule for every case)."""
    missing = kvikio_missing()
    if missing:
        pytest.skip(f"kvikio backend: {missing}")
    from gds_persist.backends.kvikio_backend import kvikio_facts

    sd = {"w": torch.randn(5000, device="cuda"), "step": torch.tensor(3),  # mixed, like Adam
          "tied": None}
    sd["tied"] = sd["w"][10:]
    info = gds_persist.save(sd, tmp_path / "ck")
    if kvikio_facts().gds:
        assert info.backend == "kvikio" and info.reason.startswith("auto: CUDA tensors and cuFile")
    else:
        assert info.backend in ("direct", "buffered") and "compatibility mode" in info.reason
    got = gds_persist.load(tmp_path / "ck")
    assert_tree_equal(got, sd)
    assert got["w"].untyped_storage().data_ptr() == got["tied"].untyped_storage().data_ptr()
    assert gds_persist.verify(tmp_path / "ck").ok

"""Extra leaf types (format version 3: gds_persist/format/leaves.py, encoded by flatten.py;
docs/FORMAT.md "Version 3"): each one round trips exactly, plain checkpoints are unchanged,
everything else is refused naming the key path and the option, pickled leaves load only through
torch's weights_only unpickler, and every walker of the tree sees the wrapped children."""

from __future__ import annotations

import argparse
import collections
import enum
import json
import math
import os
import pathlib
import random
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gds_persist
from gds_persist.errors import ManifestError, PickleRefusedError
from gds_persist.format import MANIFEST_NAME, tree
from gds_persist.state.flatten import flatten, rebuild_tensor
from gds_persist.training.steps import step_name
from tests.helpers import rewrite_manifest


class Color(enum.Enum):
    RED = 1
    PAIR = (2, "two")


class Level(enum.IntEnum):
    HIGH = 3


class Mode(str, enum.Enum):
    FAST = "fast"


class Opaque:  # not storable without pickle, and not allowed by torch's weights_only unpickler
    def __init__(self, x: int):
        self.x = x


class Evil:
    """Unpickling it would create the file named by ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


Point = collections.namedtuple("Point", "x y")


def _roundtrip(value: Any, tmp_path: Path, **kw: Any) -> Any:
    gds_persist.save({"v": value}, tmp_path / "ck", **kw)
    return gds_persist.load(tmp_path / "ck")["v"]


def _same_array(got: Any, want: np.ndarray) -> None:
    assert type(got) is np.ndarray and got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape and got.tobytes() == want.astype(got.dtype).tobytes()
    assert got.flags.writeable


ARRAYS = {
    "float32 2d": lambda: np.arange(12, dtype=np.float32).reshape(3, 4),
    "float16": lambda: np.array([1.5, -0.0, np.inf, np.nan], dtype=np.float16),
    "float64 0d": lambda: np.array(2.5),
    "int8..uint64": lambda: np.array([-1, 2, 3], dtype=np.int8),
    "uint16": lambda: np.array([1, 65535], dtype=np.uint16),
    "uint32 rng": lambda: np.random.RandomState(0).get_state()[1],
    "uint64": lambda: np.array([2**64 - 1], dtype=np.uint64),
    "bool": lambda: np.array([True, False]),
    "complex128": lambda: np.array([1 + 2j, -3j]),
    "empty": lambda: np.zeros((0, 3)),
    "empty 1d": lambda: np.zeros(0),
    "non-contiguous": lambda: np.arange(20).reshape(4, 5)[::2, 1::2],
    "big-endian": lambda: np.arange(4, dtype=">i4"),
    "read-only": lambda: np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
    "datetime64": lambda: np.array(["2024-02-29", "NaT"], dtype="M8[D]"),
    "timedelta64": lambda: np.array([5, -1], dtype="m8[ms]"),
    "str": lambda: np.array(["héllo", ""], dtype="U5"),
    "bytes": lambda: np.array([b"ab", b"c"], dtype="S2"),
}


@pytest.mark.parametrize("case", ARRAYS)
def test_numpy_arrays_round_trip_exactly(tmp_path: Path, case: str) -> None:
    a = ARRAYS[case]()
    _same_array(_roundtrip(a, tmp_path), a)


def test_numpy_array_bytes_are_a_tensor_with_its_key_path(tmp_path: Path) -> None:
    gds_persist.save({"rng": {"np": np.arange(3, dtype=np.uint32)}}, tmp_path / "ck")
    m = gds_persist.read_manifest(tmp_path / "ck")
    assert [t.dtype for t in m.tensors] == ["uint32"]
    node = m.tree["v"][0]["v"][0]
    assert node == {"t": "ndarray", "dtype": "<u4", "shape": [3], "v": [{"t": "tensor", "i": 0}]}
    assert tree.tensor_paths(m.tree) == {0: "['rng']['np']"}


SCALARS = [np.float32(0.1), np.float16(-2.5), np.int64(-3), np.uint8(255), np.bool_(True),
           np.complex64(1 - 2j), np.int32(7), np.datetime64("2020-01-01T10:00", "m"),
           np.bytes_(b"xy"), np.float32(np.nan)]


@pytest.mark.parametrize("value", SCALARS, ids=lambda v: type(v).__name__)
def test_numpy_scalars_round_trip_with_their_type(tmp_path: Path, value: Any) -> None:
    got = _roundtrip(value, tmp_path)
    assert type(got) is type(value) and got.tobytes() == value.tobytes()


OTHERS: dict[str, tuple[Any, Any]] = {  # value -> what loads (by value where it is not rebuilt)
    "bytes": (b"\x00\xffraw", b"\x00\xffraw"),
    "posix path": (pathlib.Path("/data/run 1/ckpt"), pathlib.Path("/data/run 1/ckpt")),
    "pure windows path": (pathlib.PureWindowsPath(r"C:\runs\a"),
                          pathlib.PureWindowsPath(r"C:\runs\a")),
    "enum": (Color.RED, 1),
    "enum tuple value": (Color.PAIR, (2, "two")),
    "namespace": (argparse.Namespace(lr=0.1, name="x"), argparse.Namespace(lr=0.1, name="x")),
    "simple namespace": (types.SimpleNamespace(a=[1, 2]), types.SimpleNamespace(a=[1, 2])),
    "defaultdict": (collections.defaultdict(int, {"a": 1}), {"a": 1}),
    "counter": (collections.Counter("aab"), {"a": 2, "b": 1}),
    "ordereddict subclass": (type("OD", (collections.OrderedDict,), {})(b=1, a=2),
                             collections.OrderedDict(b=1, a=2)),
    "namedtuple": (Point(1, 2.5), (1, 2.5)),
    "torch.Size": (torch.Size([2, 3]), torch.Size([2, 3])),
    "python rng state": (random.Random(3).getstate(), random.Random(3).getstate()),
}


@pytest.mark.parametrize("case", OTHERS)
def test_other_leaves_round_trip(tmp_path: Path, case: str) -> None:
    value, want = OTHERS[case]
    got = _roundtrip(value, tmp_path)
    assert type(got) is type(want) and got == want
    if isinstance(want, dict):
        assert list(got) == list(want)


def test_numpy_rng_state_restores_the_generator(tmp_path: Path) -> None:
    rs = np.random.RandomState(5)
    rs.standard_normal(3)  # has_gauss set
    got = _roundtrip(rs.get_state(), tmp_path)
    after = np.random.RandomState()
    after.set_state(got)
    assert np.array_equal(after.standard_normal(10), rs.standard_normal(10))


def test_tensors_inside_dict_subclasses_and_namespaces(tmp_path: Path) -> None:
    w = torch.randn(3)
    state = {"hp": collections.defaultdict(list, {"w": w, "tied": w}),
             "ns": argparse.Namespace(t=torch.ones(2))}
    gds_persist.save(state, tmp_path / "ck")
    got = gds_persist.load(tmp_path / "ck")
    assert torch.equal(got["hp"]["w"], w)
    assert got["hp"]["w"].data_ptr() == got["hp"]["tied"].data_ptr()  # still one storage
    assert torch.equal(got["ns"].t, torch.ones(2))


def test_a_lightning_style_checkpoint_round_trips(tmp_path: Path) -> None:
    hp = {"lr": np.float32(0.1), "data": pathlib.Path("/d"), "mode": Color.RED,
          "cfg": argparse.Namespace(depth=3), "grid": np.linspace(0, 1, 3)}
    ck = {"hyper_parameters": type("AttributeDict", (dict,), {})(hp), "epoch": 1,
          "optimizer_states": [{"param_groups": [{"lr": np.float32(0.1), "betas": (0.9, 0.99)}]}],
          "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                  "torch": torch.get_rng_state()}}
    got = _roundtrip(ck, tmp_path)
    assert type(got["hyper_parameters"]) is dict and got["hyper_parameters"]["cfg"].depth == 3
    assert got["rng"]["python"] == ck["rng"]["python"]
    assert torch.equal(got["rng"]["torch"], ck["rng"]["torch"])
    assert got["optimizer_states"][0]["param_groups"][0]["lr"] == np.float32(0.1)


def test_plain_checkpoints_are_encoded_as_before(tmp_path: Path) -> None:
    """Values JSON already holds keep their plain nodes: such a checkpoint is byte for byte what
    gds_persist wrote before the extra leaves existed."""
    state = {"f": np.float64(0.25), "level": Level.HIGH, "mode": Mode.FAST, "inf": math.inf,
             "od": collections.OrderedDict(a=(1, None)), 3: [torch.ones(1)]}
    gds_persist.save(state, tmp_path / "ck")
    tree = gds_persist.read_manifest(tmp_path / "ck").tree
    assert json.dumps(tree, sort_keys=True) == (
        '{"k": ["f", "level", "mode", "inf", "od", 3], "t": "dict", "v": [0.25, 3, "fast", '
        '{"t": "float", "v": "inf"}, {"k": ["a"], "t": "odict", "v": [{"t": "tuple", "v": [1, '
        'null]}]}, {"t": "list", "v": [{"i": 0, "t": "tensor"}]}]}'
    )


# --- refusals ---------------------------------------------------------------------------------

HERE = r"(tests\.)?test_leaves"  # the module's name as pytest imported it
REFUSED: dict[str, tuple[Any, str]] = {
    "object": (Opaque(1), rf"{HERE}\.Opaque"),
    "set": ({1, 2}, r"builtins\.set"),
    "object array": (np.array([None, 1], dtype=object), r"numpy\.ndarray"),
    "structured array": (np.zeros(2, dtype=[("a", "i4")]), r"numpy\.ndarray"),
    "masked array": (np.ma.masked_array([1, 2], mask=[0, 1]), r"numpy\.ma\.MaskedArray"),
    "bytearray": (bytearray(b"x"), r"builtins\.bytearray"),
    "enum of an object": (enum.Enum("E", {"X": Opaque(2)}).X, rf"{HERE}\.Opaque"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_name_the_key_path_and_the_option(tmp_path: Path, case: str) -> None:
    value, what = REFUSED[case]
    match = (rf"^cannot checkpoint an object of type {what} at \['a'\]\[1\]\['b'\]: "
             r".*pass save\(\.\.\., allow_pickle=True\)")
    with pytest.raises(TypeError, match=match):
        gds_persist.save({"a": [0, {"b": value}]}, tmp_path / "ck")
    assert not os.listdir(tmp_path)


def test_unpicklable_objects_are_refused_even_with_allow_pickle(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"builtins\.function at \['fn'\]: even allow_pickle=True "
                                        r"cannot pickle it"):
        gds_persist.save({"fn": lambda: 0}, tmp_path / "ck", allow_pickle=True)


def test_allow_pickle_is_single_process_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"allow_pickle=True is for single-process saves"):
        gds_persist.save({"x": 1}, tmp_path / "ck", allow_pickle=True, rank_local="x")


# --- the pickle opt-in ------------------------------------------------------------------------

def test_pickled_leaves_that_torch_allows_load(tmp_path: Path) -> None:
    got = _roundtrip({"s": {1, 2}, "l": [{3}]}, tmp_path, allow_pickle=True)
    assert got == {"s": {1, 2}, "l": [{3}]}
    m = gds_persist.read_manifest(tmp_path / "ck")
    assert m.tree["v"][0]["v"][0]["t"] == "pickle" and m.tree["v"][0]["v"][0]["type"] == (
        "builtins.set")


def test_pickled_class_is_refused_at_load_until_allowed(tmp_path: Path) -> None:
    gds_persist.save({"cb": [Opaque(5)]}, tmp_path / "ck", allow_pickle=True)
    match = (rf"cannot load the pickled {HERE}\.Opaque at \['cb'\]\[0\]: torch\.load\("
             rf"weights_only=True\) refuses it \(Unsupported global: GLOBAL {HERE}\.Opaque .*"
             rf"add_safe_globals\(\[{HERE}\.Opaque, \.\.\.\]\)")
    with pytest.raises(PickleRefusedError, match=match):
        gds_persist.load(tmp_path / "ck")
    with torch.serialization.safe_globals([Opaque]):
        assert gds_persist.load(tmp_path / "ck")["cb"][0].x == 5


def test_a_malicious_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    gds_persist.save({"x": Evil(str(marker))}, tmp_path / "ck", allow_pickle=True)
    with pytest.raises(PickleRefusedError, match=rf"pickled {HERE}\.Evil at \['x'\]"):
        gds_persist.load(tmp_path / "ck")
    assert not marker.exists()


# --- hostile manifests ------------------------------------------------------------------------

def _node(path: Path, node: Any) -> None:
    def edit(body: dict[str, Any]) -> None:
        body["tree"]["v"][0] = node

    rewrite_manifest(path, edit)


TENSOR = {"t": "tensor", "i": 0}
HOSTILE: dict[str, tuple[Any, str]] = {
    "bad dtype": ({"t": "ndarray", "dtype": "|O", "shape": [1], "v": [TENSOR]}, r"'dtype'"),
    "big-endian dtype": ({"t": "ndarray", "dtype": ">f4", "shape": [1], "v": [TENSOR]},
                         r"'dtype'"),
    "negative shape": ({"t": "ndarray", "dtype": "<f4", "shape": [-1], "v": [TENSOR]}, r"shape"),
    "array without tensor": ({"t": "ndarray", "dtype": "<f4", "shape": [1], "v": [1]},
                             r"tensor node"),
    "tensor index": ({"t": "ndarray", "dtype": "<f4", "shape": [1],
                      "v": [{"t": "tensor", "i": 9}]}, r"is not valid"),
    "scalar hex length": ({"t": "npscalar", "dtype": "<f4", "v": "00"}, r"4 bytes in lowercase"),
    "bytes not hex": ({"t": "bytes", "v": "zz"}, r"lowercase hex"),
    "path type": ({"t": "path", "type": "os.system", "v": "/x"}, r"'type' must be one of"),
    "enum in enum": ({"t": "enum", "type": "a.B", "v": [{"t": "enum", "type": "a.B", "v": [1]}]},
                     r"cannot itself be an extra leaf"),
    "pickle of a number": ({"t": "pickle", "type": "a.B", "v": [1]}, r"tensor node"),
    "type name": ({"t": "dict", "type": "a b", "k": [], "v": []}, r"dotted type name"),
    "extra member": ({"t": "bytes", "v": "", "x": 1}, r"exactly the members"),
    "local in enum": ({"t": "enum", "type": "a.B", "v": [{"t": "local", "i": 0}]},
                      r"is not valid"),
}


def _version_3(path: Path) -> None:
    gds_persist.save({"a": torch.ones(1), "n": np.int8(1)}, path)  # version 3: the extra leaf


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_extra_leaf_nodes_are_refused(tmp_path: Path, case: str) -> None:
    _version_3(tmp_path / "ck")
    node, match = HOSTILE[case]
    _node(tmp_path / "ck", node)
    with pytest.raises(ManifestError, match=rf"{MANIFEST_NAME}: tree node .*{match}"):
        gds_persist.load(tmp_path / "ck")


def test_array_whose_tensor_has_another_size_is_refused(tmp_path: Path) -> None:
    _version_3(tmp_path / "ck")
    _node(tmp_path / "ck", {"t": "ndarray", "dtype": "<f8", "shape": [2], "v": [TENSOR]})
    with pytest.raises(ManifestError, match=r"numpy array at \['a'\] is float64 \[2\] but its "
                                            r"tensor holds 4 bytes"):
        gds_persist.load(tmp_path / "ck")


def test_export_to_torch_says_which_leaves_need_safe_globals(tmp_path: Path) -> None:
    gds_persist.save({"w": torch.ones(2), "a": np.arange(2), "p": pathlib.Path("/x")},
                     tmp_path / "ck")
    info = gds_persist.export_checkpoint(tmp_path / "ck", tmp_path / "out.pt")
    assert any("ndarray, path leaves" in n and "add_safe_globals" in n for n in info.notes)


# --- format version 3 -------------------------------------------------------------------------

def _raw(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST_NAME).read_text())


def test_version_3_only_when_an_extra_leaf_is_used(tmp_path: Path) -> None:
    plain = {"w": torch.ones(2), "f": np.float64(0.5), "level": Level.HIGH, "t": (1, "x")}
    gds_persist.save(plain, tmp_path / "plain")
    raw = _raw(tmp_path / "plain")
    assert raw["version"] == 1 and "dirs" not in raw["body"] and "sections" not in raw["body"]
    gds_persist.save({**plain, "b": b"\x01"}, tmp_path / "extra")
    raw = _raw(tmp_path / "extra")
    assert raw["version"] == 3 and raw["body"]["dirs"] == [] and raw["body"]["sections"] == []
    assert raw["body"]["files"][0]["dir"] == 0
    assert gds_persist.read_manifest(tmp_path / "extra").version == 3
    # an extra leaf only in a rank-local section makes it version 3 as well
    gds_persist.save({"w": torch.ones(1), "opt": {"rng": np.arange(2)}}, tmp_path / "local",
                     rank_local="opt")
    assert _raw(tmp_path / "local")["version"] == 3
    got = gds_persist.load(tmp_path / "local", options=gds_persist.LoadOptions(rank_local=0))
    assert np.array_equal(got["opt"]["rng"], np.arange(2))


def test_a_reader_that_predates_version_3_says_upgrade(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_persist.format import manifest

    _version_3(tmp_path / "ck")
    monkeypatch.setattr(manifest, "READABLE_VERSIONS", (1, 2))  # a gds_persist from before
    with pytest.raises(ManifestError, match=r"format version 3 is not supported by this "
                                            r"gds_persist .*upgrade gds_persist to read it"):
        gds_persist.load(tmp_path / "ck")


@pytest.mark.parametrize("version", [1, 2])
def test_extra_leaves_in_an_older_version_are_refused(tmp_path: Path, version: int) -> None:
    _version_3(tmp_path / "ck")

    def edit(doc: dict[str, Any]) -> None:
        doc["version"] = version
        if version == 1:
            body = doc["body"]
            del body["dirs"], body["sections"]
            body["files"] = [{"name": f["name"], "size": f["size"]} for f in body["files"]]

    rewrite_manifest(tmp_path / "ck", edit, whole=True)
    with pytest.raises(ManifestError, match=r"extra leaf nodes need format version 3"):
        gds_persist.load(tmp_path / "ck")


# --- one walker: wrapped children are seen everywhere -----------------------------------------

def test_the_walker_sees_wrapped_children() -> None:
    a = np.arange(3, dtype=np.float32)
    flat = flatten({"arr": a, "e": Color.PAIR, "nt": Point(torch.ones(1), 2), "p": {1}},
                   allow_pickle=True)
    t = flat.tree
    assert tree.tensor_paths(t) == {0: "['arr']", 1: "['nt'][0]", 2: "['p']"}
    assert tree.tensor_indices(t) == [0, 1, 2]
    assert tree.uses_leaves(t) and not tree.uses_leaves(tree.sequence([1]))
    shifted = tree.shift_tensors(t, 5)  # renumbers tensors inside wrappers and typed containers
    assert tree.tensor_indices(shifted) == [5, 6, 7]
    assert shifted["v"][0]["t"] == "ndarray" and shifted["v"][2]["type"].endswith("Point")
    assert tree.validate(shifted, 8) == 0
    with pytest.raises(ValueError, match="is not valid"):
        tree.validate(shifted, 7)
    with pytest.raises(ValueError, match="need format version 3"):
        tree.validate(t, 3, extra_leaves=False)
    tensors = [rebuild_tensor(r, flat.storage_objects[r.storage]) for r in flat.tensors]
    decoded = tree.decode(t, tensors)
    assert np.array_equal(decoded["arr"], a) and decoded["e"] == (2, "two")
    assert decoded["nt"] == (torch.ones(1), 2) and decoded["p"] == {1}


def test_replica_differences_inside_extra_leaves_are_named() -> None:
    def tree_of(value: Any) -> Any:
        return flatten({"x": value}).tree

    assert tree.difference(tree_of(Point(1, 2)), tree_of((1, 2))) == (
        f"['x']: type '{Point.__module__}.Point' (rank 0: None)")
    assert tree.difference(tree_of(np.zeros(1, np.float32)), tree_of(np.zeros(1))) == (
        "['x']: dtype '<f4' (rank 0: '<f8')")
    assert tree.difference(tree_of(Color.RED), tree_of(Color.PAIR)) == (
        "['x']: 1 (rank 0: {'t': 'tuple', 'v': [2, 'two']})")
    assert tree.difference(tree_of(Color.RED), tree_of(Color.RED)) == ""


# --- the Checkpointer: typed leaves survive snapshot mode, allow_pickle passes through ----------

@pytest.mark.parametrize("mode,writer", [("fence", "thread"), ("snapshot", "thread"),
                                         ("snapshot", "process")])
def test_checkpointer_keeps_extra_leaves(tmp_path: Path, mode: str, writer: str) -> None:
    w = torch.randn(4)
    state = {"w": w, "tied": w[1:], "rng": np.random.RandomState(2).get_state(),
             "mode": Color.PAIR, "hp": collections.defaultdict(int, a=1),
             "ns": argparse.Namespace(lr=0.5), "size": torch.Size([3]), "opaque": {7, 8}}
    with pytest.raises(TypeError, match=r"\['opaque'\].*allow_pickle=True"), \
            gds_persist.Checkpointer(tmp_path / "refuse", mode=mode) as ck:
        ck.save(1, state)
    with gds_persist.Checkpointer(tmp_path / "run", mode=mode, writer=writer,
                                  allow_pickle=True) as ck:
        h = ck.save(1, state)
        h.wait_released()
        state["hp"]["a"] = 99  # the snapshot (or the tree) was taken at save()
        w.zero_()
        h.wait()
        got = ck.load()
    assert h.mode == mode
    assert got["mode"] == (2, "two") and got["hp"] == {"a": 1} and type(got["hp"]) is dict
    assert got["ns"] == argparse.Namespace(lr=0.5) and got["size"] == torch.Size([3])
    assert got["opaque"] == {7, 8}
    assert np.array_equal(got["rng"][1], np.random.RandomState(2).get_state()[1])
    assert got["tied"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    assert gds_persist.read_manifest(tmp_path / "run" / step_name(1)).version == 3


def test_checkpointer_allow_pickle_is_single_process_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allow_pickle=True is for single-process saves"):
        gds_persist.Checkpointer(tmp_path, allow_pickle=True, process_group="default")

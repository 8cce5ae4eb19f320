"""The tree encoding (gds_persist.format.tree): one walker, and every question asked of it agrees
on where tensors are, including under a mapping's ``_metadata``."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.format import tree
from gds_persist.state.flatten import flatten
from tests.helpers import assert_tree_equal, flip_byte


def _with_meta() -> OrderedDict:
    inner = OrderedDict(w=torch.arange(4.0))
    inner._metadata = {"": {"version": 2}, "t": torch.full((1000,), 7.0)}  # type: ignore[attr-defined]
    return OrderedDict(m=inner, step=3, xs=[torch.ones(2), (1.5, float("nan"))])


def test_a_tensor_under_metadata_is_found_by_every_question() -> None:
    flat = flatten(_with_meta())
    assert tree.tensor_indices(flat.tree) == [0, 1, 2]
    assert tree.tensor_key_paths(flat.tree) == {
        0: ("m", "w"), 1: ("m", "_metadata", "t"), 2: ("xs", 0)}
    assert tree.tensor_paths(flat.tree)[1] == "['m']['_metadata']['t']"
    assert sorted(tree.tensor_key_paths(flat.tree)) == sorted(tree.tensor_indices(flat.tree))


def test_walk_visits_every_node_in_tree_order() -> None:
    flat = flatten(_with_meta())
    paths = [p for p, _ in tree.walk(flat.tree)]
    assert paths[:4] == [(), ("m",), ("m", "w"), ("m", "_metadata")]
    assert ("xs", 1, 1) in paths


def test_decode_inverts_flatten() -> None:
    sd = _with_meta()
    flat = flatten(sd)
    tensors = [torch.zeros(0)] * len(flat.tensors)
    out = tree.decode(flat.tree, tensors)
    assert type(out) is OrderedDict and list(out) == ["m", "step", "xs"]
    assert out["m"]._metadata["t"] is tensors[1]
    assert isinstance(out["xs"][1], tuple) and out["xs"][1][1] != out["xs"][1][1]  # nan


def test_metadata_tensor_round_trips_and_is_named_when_corrupted(tmp_path: Path) -> None:
    sd = _with_meta()
    path = tmp_path / "ck"
    gds_persist.save(sd, path)
    out = gds_persist.load(path)
    assert torch.equal(out["m"]._metadata["t"], sd["m"]._metadata["t"])
    assert out["m"]._metadata[""] == {"version": 2}
    assert_tree_equal(out["xs"], sd["xs"])
    m = gds_persist.read_manifest(path)
    (e,) = [e for e in m.extents if e.length == 4000]
    flip_byte(path / m.files[e.file].name, e.offset + 5)
    with pytest.raises(gds_persist.ChecksumError, match=r"tensor \['m'\]\['_metadata'\]\['t'\]"):
        gds_persist.load(path)


def test_transform_helpers() -> None:
    t = tree.mapping(["a", "b"], [tree.local(0), tree.sequence([tree.tensor(0), tree.local(1)])],
                     ordered=True, meta=tree.tensor(1))
    assert tree.has_locals(t) and not tree.has_locals(tree.sequence([1, "x"]))
    filled = tree.fill_locals(t, lambda j: f"part{j}")
    out = tree.decode(filled, ["T0", "T1"])
    assert out == {"a": "part0", "b": ["T0", "part1"]} and out._metadata == "T1"
    shifted = tree.shift_tensors(t, 5)
    assert tree.tensor_indices(shifted) == [5, 6] and tree.tensor_indices(t) == [0, 1]


def test_difference_names_the_first_place() -> None:
    a = flatten({"model": {"w": torch.ones(2)}, "lr": 0.1}).tree
    b = flatten({"model": {"w": torch.ones(2)}, "lr": 0.2}).tree
    assert tree.difference(a, a) == ""
    assert tree.difference(a, b) == "['lr']: 0.1 (rank 0: 0.2)"
    c = flatten({"model": {"v": torch.ones(2)}, "lr": 0.1}).tree
    assert tree.difference(c, a).startswith("['model']: keys differ from rank 0's (extra: ['v']")
    d = flatten({"model": {"w": 3}, "lr": 0.1}).tree
    assert tree.difference(d, a) == "['model']['w']: 3 (rank 0: a tensor)"


@pytest.mark.parametrize(("node", "message"), [
    ({"t": "tensor", "i": 2}, "is not valid"),
    ({"t": "local", "i": 0}, "is not valid"),
    (float("inf"), "non-finite float"),
    ([1], "tree holds a list"),
    ({"t": "dict", "k": ["a"], "v": []}, "is not valid"),
])
def test_validate_refuses(node: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tree.validate(node, 2)


def test_validate_counts_placeholders_in_tree_order() -> None:
    t = tree.sequence([tree.local(0), tree.mapping(["x"], [tree.local(1)])])
    assert tree.validate(t, 0, placeholders=0) == 2
    with pytest.raises(ValueError, match="is not valid"):
        tree.validate(tree.sequence([tree.local(1)]), 0, placeholders=0)

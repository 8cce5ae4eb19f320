"""The tree: how a manifest stores the structure of a state dict. Every module that builds, walks,
checks or decodes it goes through this one.

Plain JSON values (``str``, ``int``, finite ``float``, ``bool``, ``None``) stand for themselves.
Everything else is a *node*, a JSON object whose ``"t"`` says its kind:

* ``{"t": "tensor", "i": n}``: tensor ``n`` of the manifest's ``tensors``;
* ``{"t": "float", "v": "inf" | "-inf" | "nan"}``: a float JSON cannot hold;
* ``{"t": "list" | "tuple", "v": [item, ...]}``;
* ``{"t": "dict" | "odict", "k": [key, ...], "v": [value, ...]}``, keys ``str`` or ``int``, and
  optionally ``"meta": node``: the mapping's ``_metadata`` attribute (``nn.Module.state_dict()``
  keeps version information there);
* ``{"t": "local", "i": j}``: placeholder ``j`` for rank-local state (format version 2, main
  tree only), numbered in tree order; the manifest's sections hold what it stands for;
* the extra leaf kinds of format version 3 (:mod:`.leaves`: numpy arrays and scalars, bytes,
  paths, enums, pickles, and containers with a ``"type"``). A *wrapper* (enum, ndarray, pickle)
  holds one child in ``"v"``, at the wrapper's own key path and depth.

Tree order, used everywhere: depth first, a container's items in order, a mapping's ``meta``
after its values, a wrapper's child after the wrapper. A key path is the tuple of keys and list
positions from the root to a node; a mapping's ``meta`` is reached through the key
``"_metadata"``, a wrapped child through no key (the key ``WRAPPED`` of :func:`children`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from . import leaves
from .records import MAX_DEPTH

TENSOR = "tensor"
FLOAT = "float"
LIST = "list"
TUPLE = "tuple"
DICT = "dict"
ODICT = "odict"
LOCAL = "local"
SEQUENCES = (LIST, TUPLE)
MAPPINGS = (DICT, ODICT)
META_KEY = "_metadata"  # the key path element of a mapping's ``meta``
NON_FINITE = ("inf", "-inf", "nan")
WRAPPED = None  # the "key" of a wrapper's child in children(): it keeps the wrapper's key path

KeyPath = tuple[Any, ...]
_ABSENT = object()


# --- constructors -------------------------------------------------------------------------------


def tensor(index: int) -> dict[str, Any]:
    return {"t": TENSOR, "i": index}


def local(index: int) -> dict[str, Any]:
    return {"t": LOCAL, "i": index}


def number(value: float) -> Any:
    """A float as stored: itself when finite, else a float node."""
    return value if math.isfinite(value) else {"t": FLOAT, "v": repr(value)}


def sequence(items: list[Any], *, is_tuple: bool = False) -> dict[str, Any]:
    return {"t": TUPLE if is_tuple else LIST, "v": items}


def mapping(
    keys: list[Any], values: list[Any], *, ordered: bool = False, meta: Any = _ABSENT
) -> dict[str, Any]:
    node: dict[str, Any] = {"t": ODICT if ordered else DICT, "k": keys, "v": values}
    if meta is not _ABSENT:
        node["meta"] = meta
    return node


# --- the walker ---------------------------------------------------------------------------------


def kind(node: Any) -> str | None:
    """A node's kind; ``None`` for a plain JSON value."""
    return node.get("t") if isinstance(node, dict) else None


def children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` of a container node in tree order (a mapping's ``meta`` last, under
    ``"_metadata"``; a wrapper's child under ``WRAPPED``); ``[]`` for anything else."""
    k = kind(node)
    if k in SEQUENCES:
        return list(enumerate(node["v"]))
    if k in MAPPINGS:
        out = list(zip(node["k"], node["v"], strict=True))
        if "meta" in node:
            out.append((META_KEY, node["meta"]))
        return out
    if k in leaves.WRAPPERS:
        return [(WRAPPED, leaves.wrapped(node))]
    return []


def child_path(path: KeyPath, key: Any) -> KeyPath:
    """The key path of the child ``key`` (from :func:`children`) of the node at ``path``."""
    return path if key is WRAPPED else (*path, key)


def uses_leaves(tree: Any) -> bool:
    """Whether the tree holds an extra leaf node (format version 3, :mod:`.leaves`)."""
    return any(leaves.is_extra(n) for _, n in walk(tree))


def list_items(node: Any) -> list[Any] | None:
    """The items of a list node (exactly ``{"t": "list", "v": [...]}``); None for anything
    else. Safe on unchecked input."""
    if kind(node) == LIST and set(node) == {"t", "v"} and isinstance(node["v"], list):
        return list(node["v"])
    return None


def walk(node: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Every node and plain value of the tree with its key path, in tree order."""
    yield path, node
    for key, child in children(node):
        yield from walk(child, child_path(path, key))


def objects_of(obj: Any, cls: type | tuple[type, ...], path: KeyPath = ()
               ) -> Iterator[tuple[KeyPath, Any]]:
    """(key path, object) of every instance of ``cls`` in live nested mappings, lists and
    tuples (a state dict, an unpickled skeleton), in order; anything else is skipped."""
    if isinstance(obj, cls):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from objects_of(value, cls, (*path, key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from objects_of(value, cls, (*path, i))


def transform(node: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of the tree with every node without children (plain values, tensor, float, local
    and childless extra nodes) replaced by ``leaf(it)``; containers and wrappers are rebuilt
    around the results."""
    k = kind(node)
    if k not in SEQUENCES and k not in MAPPINGS and k not in leaves.WRAPPERS:
        return leaf(node)
    out = {**node, "v": [transform(v, leaf) for v in node["v"]]}
    if "meta" in node:
        out["meta"] = transform(node["meta"], leaf)
    return out


# --- what the walker answers --------------------------------------------------------------------


def tensor_indices(tree: Any) -> list[int]:
    """Indices of the tensors in the tree, in tree order (``meta`` included)."""
    return [n["i"] for _, n in walk(tree) if kind(n) == TENSOR]


def tensor_key_paths(tree: Any) -> dict[int, KeyPath]:
    """Each tensor index -> its key path as a tuple, e.g. ``("model", "wte")``."""
    return {n["i"]: p for p, n in walk(tree) if kind(n) == TENSOR}


def path_str(path: KeyPath) -> str:
    """A key path as the code that reaches it: ``['model']['wte']``; ``<root>`` for ``()``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def tensor_paths(tree: Any) -> dict[int, str]:
    """Each tensor index -> its printable key path, e.g. ``['model']['wte']``."""
    return {i: path_str(p) for i, p in tensor_key_paths(tree).items()}


def has_locals(tree: Any) -> bool:
    """Whether the tree holds rank-local placeholders."""
    return any(kind(n) == LOCAL for _, n in walk(tree))


def fill_locals(tree: Any, fill: Callable[[int], Any]) -> Any:
    """The tree with placeholder ``j`` replaced by ``fill(j)``."""
    return transform(tree, lambda n: fill(n["i"]) if kind(n) == LOCAL else n)


def shift_tensors(tree: Any, by: int) -> Any:
    """The tree with every tensor index raised by ``by`` (a part of many, renumbered)."""
    return transform(tree, lambda n: tensor(n["i"] + by) if kind(n) == TENSOR else n)


def decode(tree: Any, tensors: Sequence[Any], path: KeyPath = ()) -> Any:
    """The state dict a tree describes, with tensor node ``i`` replaced by ``tensors[i]``
    (the inverse of :func:`gds_persist.state.flatten.flatten`'s encoding); ``path``: where ``tree``
    is, for errors. Extra leaves need real tensors (:func:`.leaves.decode`)."""
    k = kind(tree)
    if k is None:
        return tree
    if k == TENSOR:
        return tensors[tree["i"]]
    if k == FLOAT:
        return float(tree["v"])
    if leaves.is_extra(tree):
        return leaves.decode(tree, path_str(path), lambda node: decode(node, tensors, path))
    if k in SEQUENCES:
        items = [decode(v, tensors, (*path, i)) for i, v in enumerate(tree["v"])]
        return items if k == LIST else tuple(items)
    if k not in MAPPINGS:
        raise ValueError(f"cannot decode a {k!r} node (fill rank-local placeholders first)")
    cls = OrderedDict if k == ODICT else dict
    out = cls(
        (key, decode(v, tensors, (*path, key)))
        for key, v in zip(tree["k"], tree["v"], strict=True)
    )
    if "meta" in tree:
        out._metadata = decode(tree["meta"], tensors, (*path, META_KEY))  # type: ignore[attr-defined]
    return out


def difference(a: Any, b: Any, path: KeyPath = ()) -> str:
    """Where tree ``a`` first differs from tree ``b`` (rank 0's), in words; ``""`` if nowhere."""
    where = path_str(path)
    if type(a) is not type(b) or not isinstance(a, dict):
        if a == b and type(a) is type(b):
            return ""
        return f"{where}: {_short(a)} (rank 0: {_short(b)})"
    k = kind(a)
    if k != kind(b):
        return f"{where}: a {k} (rank 0: a {kind(b)})"
    for member in sorted((set(a) | set(b)) - {"t", "i", "k", "v", "meta"}):  # type, dtype, shape
        if a.get(member, _ABSENT) != b.get(member, _ABSENT):
            return f"{where}: {member} {_short(a.get(member))} (rank 0: {_short(b.get(member))})"
    if k in MAPPINGS and a["k"] != b["k"]:
        extra = [x for x in a["k"] if x not in b["k"]]
        missing = [x for x in b["k"] if x not in a["k"]]
        return f"{where}: keys differ from rank 0's (extra: {extra[:5]}, missing: {missing[:5]})"
    if k in leaves.WRAPPERS:
        return difference(leaves.wrapped(a), leaves.wrapped(b), path)
    if k in SEQUENCES or k in MAPPINGS:
        if len(a["v"]) != len(b["v"]):
            return f"{where}: {len(a['v'])} items (rank 0: {len(b['v'])})"
        if ("meta" in a) != ("meta" in b):
            have = {True: "has", False: "has no"}
            return (
                f"{where}: {have['meta' in a]} {META_KEY} (rank 0: {have['meta' in b]} {META_KEY})"
            )
        for (key, x), (_, y) in zip(children(a), children(b), strict=True):
            d = difference(x, y, (*path, key))
            if d:
                return d
        return ""
    return "" if a == b else f"{where}: {_short(a)} (rank 0: {_short(b)})"


def _short(v: Any) -> str:
    if kind(v) == TENSOR:
        return "a tensor"
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


# --- checking a tree that came from outside -----------------------------------------------------


def validate(
    node: Any, n_tensors: int, *, placeholders: int | None = None, extra_leaves: bool = True
) -> int:
    """Check that ``node`` is a well-formed tree whose tensor nodes index ``n_tensors`` tensors
    and that is nested at most ``MAX_DEPTH`` deep; raise ``ValueError`` saying what is wrong.

    ``placeholders``: ``None`` refuses rank-local placeholders; a number allows them, numbered
    in tree order from that number on. ``extra_leaves``: whether the node kinds of
    :mod:`.leaves` (format version 3) are allowed. Returns the number of placeholders after the
    tree.
    """
    return _Validator(n_tensors, placeholders, extra_leaves).check(node, 0)


class _Validator:
    def __init__(self, n_tensors: int, placeholders: int | None, extra_leaves: bool):
        self.n_tensors = n_tensors
        self.allow_locals = placeholders is not None
        self.n_local = placeholders or 0
        self.extra_leaves = extra_leaves

    def check(self, node: Any, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree is nested too deeply (more than {MAX_DEPTH} levels)")
        if node is None or isinstance(node, (bool, int, str)):
            return self.n_local
        if isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError("tree holds a non-finite float outside a float node")
            return self.n_local
        if not isinstance(node, dict):
            raise ValueError(f"tree holds a {type(node).__name__}")
        k = node.get("t")
        if leaves.is_extra(node):
            if not self.extra_leaves:
                raise ValueError(f"tree node {str(node)[:80]!r} is not valid: extra leaf nodes "
                                 f"need format version {leaves.VERSION}")
            leaves.check(node)
            if k in leaves.TYPED:  # the container itself, minus its type
                return self.check(leaves.untyped(node), depth)
            if k in leaves.WRAPPERS:  # the child at the wrapper's own depth
                return self.check(leaves.wrapped(node), depth)
            return self.n_local
        if k == TENSOR and set(node) == {"t", "i"} and _index(node["i"], self.n_tensors):
            return self.n_local
        if k == FLOAT and set(node) == {"t", "v"} and node["v"] in NON_FINITE:
            return self.n_local
        if (
            k == LOCAL
            and self.allow_locals
            and set(node) == {"t", "i"}
            and type(node["i"]) is int
            and node["i"] == self.n_local
        ):
            self.n_local += 1  # placeholders are numbered in tree order
            return self.n_local
        if k in SEQUENCES and set(node) == {"t", "v"} and isinstance(node["v"], list):
            for v in node["v"]:
                self.check(v, depth + 1)
            return self.n_local
        if k in MAPPINGS and {"t", "k", "v"} <= set(node) <= {"t", "k", "v", "meta"}:
            keys, values = node["k"], node["v"]
            if (
                isinstance(keys, list)
                and isinstance(values, list)
                and len(keys) == len(values)
                and all(isinstance(x, str) or type(x) is int for x in keys)
            ):
                for _, v in children(node):
                    self.check(v, depth + 1)
                return self.n_local
        raise ValueError(f"tree node {str(node)[:80]!r} is not valid")


def _index(v: Any, n: int) -> bool:
    return type(v) is int and 0 <= v < n

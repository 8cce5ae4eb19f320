"""Rank-local parts of a live state dict (``save(..., rank_local=...)``, ``docs/DISTRIBUTED.md``).

The subtrees at the marked key paths differ per rank (ZeRO shards) and are written by their owner
only; the rest is replicated. :func:`split_rank_local` cuts a state dict into the two flattened
parts: the replicated one holds a ``{"t": "local", "i": j}`` placeholder where each subtree was.
Only the spine down to each marked path is copied; the caller's state dict is not changed.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from ..format import tree as _tree
from .flatten import Flattened, flatten

KeyPath = _tree.KeyPath


def normalize_paths(rank_local: str | KeyPath | Iterable[str | KeyPath] | None) -> list[KeyPath]:
    """``"optimizer"`` or ``("optimizer", "state")`` or a list of them -> list of key tuples."""
    if rank_local is None:
        return []
    if isinstance(rank_local, (str, tuple)):
        rank_local = [rank_local]
    paths = [(p,) if isinstance(p, (str, int)) else tuple(p) for p in rank_local]
    for a in paths:
        for b in paths:
            if a is not b and a == b[: len(a)]:
                raise ValueError(f"rank_local paths {a!r} and {b!r} overlap; mark only the "
                                 "outer one")
    return paths


def _replace_at(obj: Any, path: KeyPath, value: Any, full: KeyPath) -> tuple[Any, Any]:
    """A copy of ``obj`` with the subtree at ``path`` replaced (only the spine is copied)."""
    key, rest = path[0], path[1:]
    if isinstance(obj, dict):
        if key not in obj:
            raise KeyError(f"rank_local path {full!r}: key {key!r} is not in the state dict")
        new_child, old = (value, obj[key]) if not rest else _replace_at(obj[key], rest, value, full)
        copy = OrderedDict(obj) if isinstance(obj, OrderedDict) else dict(obj)
        if isinstance(copy, OrderedDict) and hasattr(obj, "_metadata"):  # a dict cannot carry it
            copy._metadata = obj._metadata  # type: ignore[attr-defined]
        copy[key] = new_child
        return copy, old
    if isinstance(obj, (list, tuple)) and type(key) is int and 0 <= key < len(obj):
        items = list(obj)
        items[key], old = ((value, items[key]) if not rest
                           else _replace_at(items[key], rest, value, full))
        return (items if isinstance(obj, list) else tuple(items)), old
    raise KeyError(f"rank_local path {full!r}: {key!r} does not index a {type(obj).__name__}")


def split_rank_local(state: Any, paths: Sequence[KeyPath]) -> tuple[Flattened, Flattened]:
    """Flatten ``state`` into its replicated part (with ``{"t": "local", "i": j}`` placeholders,
    numbered in tree order) and its rank-local part (a list tree, one subtree per placeholder)."""
    token = uuid.uuid4().hex
    marks = {f"\x00gds_persist-rank-local:{token}:{j}": j for j in range(len(paths))}
    by_mark = {j: m for m, j in marks.items()}
    subtrees: list[Any] = [None] * len(paths)
    for j, p in enumerate(paths):
        if p == ():
            if len(paths) > 1:
                raise ValueError("rank_local=() marks the whole state; give no other path")
            state, subtrees[j] = by_mark[j], state
        else:
            state, subtrees[j] = _replace_at(state, p, by_mark[j], p)
    replicated = flatten(state)
    order: list[int] = []

    def placeholder(node: Any) -> Any:
        if isinstance(node, str) and node in marks:
            order.append(marks[node])
            return _tree.local(len(order) - 1)
        return node

    replicated.tree = _tree.transform(replicated.tree, placeholder)
    local = flatten([subtrees[j] for j in order]) if paths else flatten([])
    return replicated, local

"""Rank-local parts of a live state dict (``save(..., rank_local=...)``, ``docs/DISTRIBUTED.md``).

The subtrees at the marked key paths differ per rank (ZeRO shards) and are written by their owner
only; the rest is replicated. :func:`split_rank_local` cuts a state dict into the two flattened
parts: the replicated one holds a ``{"t": "local", "i": j}`` placeholder where each subtree was.
Only the spine down to each marked path is copied; the caller's state dict is not changed.

A :class:`~gds_persist.Checkpointer` flattens a state once, at ``save``, and snapshots or writes
that one Flattened later: :func:`join` keeps both parts in one (the local part's tensors and
storages numbered after the replicated part's), :func:`unjoin` takes them apart again, over
whatever memory the storages are by then (a snapshot's copies).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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


@dataclass
class Split:
    """A state already cut into its replicated and its rank-local part (what
    :func:`gds_persist.save` takes in place of a state dict, with a process group)."""

    replicated: Flattened
    local: Flattened


_JOINED = ("gds_persist-joined", "replicated", "local")  # the joined tree's keys


def join(split: Split) -> Flattened:
    """Both parts as one Flattened (tree: a mapping of the two trees and the replicated part's
    counts), undone by :func:`unjoin`."""
    rep, loc = split.replicated, split.local
    n_t, n_s = len(rep.tensors), len(rep.storages)
    tree = _tree.mapping(list(_JOINED), [
        _tree.sequence([n_t, n_s]), rep.tree, _tree.shift_tensors(loc.tree, n_t)])
    crcs = (None if rep.crc_at_save is None or loc.crc_at_save is None
            else rep.crc_at_save + loc.crc_at_save)
    return Flattened(tree, rep.tensors + [replace(t, storage=t.storage + n_s)
                                          for t in loc.tensors],
                     rep.storages + loc.storages, rep.storage_objects + loc.storage_objects, crcs)


def unjoin(flat: Flattened) -> Split:
    """The two parts of a :func:`join`, over ``flat``'s storage objects."""
    counts, rep_tree, loc_tree = flat.tree["v"]
    n_t, n_s = counts["v"]
    local_tensors = [replace(t, storage=t.storage - n_s) for t in flat.tensors[n_t:]]
    crcs = flat.crc_at_save
    return Split(
        Flattened(rep_tree, flat.tensors[:n_t], flat.storages[:n_s], flat.storage_objects[:n_s],
                  None if crcs is None else crcs[:n_s]),
        Flattened(_tree.shift_tensors(loc_tree, -n_t), local_tensors, flat.storages[n_s:],
                  flat.storage_objects[n_s:], None if crcs is None else crcs[n_s:]))


def locate(tree: Any) -> dict[int, KeyPath]:
    """Placeholder number -> its key path in a replicated tree."""
    return {n["i"]: p for p, n in _tree.walk(tree) if _tree.kind(n) == _tree.LOCAL}


def separate(state: Any, where: dict[int, KeyPath]) -> tuple[Any, list[Any] | None]:
    """``state`` (e.g. a load's ``into=``) without its rank-local subtrees (None there), and
    those subtrees in placeholder order; None gives (None, None)."""
    if state is None:
        return None, None
    parts: list[Any] = [None] * len(where)
    for j, p in where.items():
        try:
            state, parts[j] = _replace_at(state, p, None, p) if p else (None, state)
        except KeyError:  # not in into=: loaded fresh (strict=False) or refused (strict)
            parts[j] = None
    return state, parts


def reunite(state: Any, where: dict[int, KeyPath], parts: Sequence[Any]) -> Any:
    """The inverse of :func:`separate`: each rank-local subtree put back at its key path."""
    for j, p in where.items():
        state = _replace_at(state, p, parts[j], p)[0] if p else parts[j]
    return state

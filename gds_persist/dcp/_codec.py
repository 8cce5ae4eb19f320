"""DCP ``Metadata`` <-> JSON, so a DCP checkpoint written by :class:`GdsPersistWriter` holds no
pickle: everything DCP needs is stored in the gds_persist manifest (``writer["dcp"]``), covered
by the manifest's own CRC32C and validated before use.

``planner_data`` is free-form in DCP; the default planner stores ``{fqn: (key, key, ...)}``
paths. We store any nesting of dict / list / tuple / ``torch.Size`` / str / int / float / bool /
None, tagged so tuples stay tuples; anything else is refused with a clear error at save time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointError, ManifestError
from ..format import DTYPES, dtype_name

_MAX_DEPTH = 200


def encode_value(obj: Any, where: str, depth: int = 0) -> Any:
    """Tagged JSON for planner data: containers become ``{"<tag>": ...}``."""
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{where} is nested too deeply to store")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Size):
        return {"s": [int(d) for d in obj]}
    if isinstance(obj, tuple):
        return {"t": [encode_value(v, where, depth + 1) for v in obj]}
    if isinstance(obj, list):
        return {"l": [encode_value(v, where, depth + 1) for v in obj]}
    if isinstance(obj, dict):
        return {
            "m": [
                [encode_value(k, where, depth + 1), encode_value(v, where, depth + 1)]
                for k, v in obj.items()
            ]
        }
    raise CheckpointError(
        f"{where} holds an object of type {type(obj).__module__}.{type(obj).__qualname__}, "
        "which GdsPersistWriter cannot store without pickling; use DCP's DefaultSavePlanner or "
        "a planner whose planner_data is made of dict/list/tuple/str/int/float/bool/None"
    )


def decode_value(obj: Any, where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ManifestError(f"{where}: nested too deeply")
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, dict) and len(obj) == 1:
        ((tag, v),) = obj.items()
        if tag == "f" and v in ("inf", "-inf", "nan"):
            return float(v)
        if tag == "s" and isinstance(v, list) and all(type(d) is int and d >= 0 for d in v):
            return torch.Size(v)
        if tag in ("t", "l") and isinstance(v, list):
            items = [decode_value(x, where, depth + 1) for x in v]
            return tuple(items) if tag == "t" else items
        if (
            tag == "m"
            and isinstance(v, list)
            and all(isinstance(p, list) and len(p) == 2 for p in v)
        ):
            out = {}
            for k, val in v:
                key = decode_value(k, where, depth + 1)
                try:
                    out[key] = decode_value(val, where, depth + 1)
                except TypeError as e:  # unhashable key
                    raise ManifestError(f"{where}: bad mapping key {k!r}") from e
            return out
    raise ManifestError(f"{where}: cannot decode {str(obj)[:80]!r}")


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """Everything of ``md`` except ``storage_data`` (which the manifest's extents replace)."""
    items: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes"}
        elif isinstance(entry, TensorStorageMetadata):
            props = entry.properties
            if props.dtype not in DTYPES.values():
                raise CheckpointError(
                    f"DCP item {fqn!r} has dtype {props.dtype}, which gds_persist cannot store"
                )
            items[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(props.dtype),
                "requires_grad": bool(props.requires_grad),
                "size": [int(d) for d in entry.size],
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in entry.chunks
                ],
            }
        else:
            raise CheckpointError(
                f"DCP item {fqn!r} has storage metadata of type {type(entry).__qualname__}, "
                "which this version of GdsPersistWriter does not know"
            )
    sm = md.storage_meta
    storage_meta = (
        None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(m) for m in (sm.modules or [])],
        }
    )
    return {
        "version": md.version,
        "state_dict_metadata": items,
        "planner_data": encode_value(md.planner_data, "DCP planner_data"),
        "storage_meta": storage_meta,
    }


def _size(v: Any, where: str) -> torch.Size:
    if not isinstance(v, list) or not all(type(d) is int and d >= 0 for d in v):
        raise ManifestError(f"{where}: {v!r} is not a list of non-negative ints")
    return torch.Size(v)


def decode_metadata(doc: Any, where: str) -> Metadata:
    """DCP ``Metadata`` (without ``storage_data``) from a validated manifest's ``writer["dcp"]``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("state_dict_metadata"), dict):
        raise ManifestError(f"{where}: the DCP metadata is missing or malformed")
    items: dict[str, Any] = {}
    for fqn, e in doc["state_dict_metadata"].items():
        here = f"{where}: DCP item {fqn!r}"
        if not isinstance(e, dict):
            raise ManifestError(f"{here} is malformed")
        if e.get("kind") == "bytes":
            items[fqn] = BytesStorageMetadata()
            continue
        if (
            e.get("kind") != "tensor"
            or e.get("dtype") not in DTYPES
            or not isinstance(e.get("chunks"), list)
        ):
            raise ManifestError(f"{here} is malformed: {str(e)[:120]}")
        size = _size(e.get("size"), here)
        chunks = []
        for c in e["chunks"]:
            if not isinstance(c, dict):
                raise ManifestError(f"{here}: bad chunk {c!r}")
            offsets, sizes = _size(c.get("offsets"), here), _size(c.get("sizes"), here)
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=False))
            ):
                raise ManifestError(
                    f"{here}: chunk {c!r} lies outside the tensor's size {list(size)}"
                )
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        props = TensorProperties(
            dtype=DTYPES[e["dtype"]], requires_grad=bool(e.get("requires_grad"))
        )
        items[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)
    sm = doc.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            modules=list(sm.get("modules") or []),
        )
    version = doc.get("version")
    return Metadata(
        state_dict_metadata=items,
        planner_data=decode_value(doc.get("planner_data"), f"{where}: DCP planner_data"),
        storage_meta=storage_meta,
        version=version if isinstance(version, str) else None,
    )

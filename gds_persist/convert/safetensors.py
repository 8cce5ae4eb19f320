"""The safetensors format, written and read here (no dependency on the ``safetensors`` package).

A safetensors file is an 8-byte little-endian header length, a JSON header (``name -> dtype,
shape, data_offsets``, plus ``__metadata__`` strings) padded to 8 bytes, then the data buffer.
:func:`plan_safetensors` and :func:`st_header` build the header of an export from the manifest
alone (so the data can stream); :func:`map_safetensors` maps a file (``mmap``) and parses it into
tensors backed by the mapping.

What safetensors cannot hold, and what happens
----------------------------------------------
safetensors holds a flat mapping ``name -> contiguous tensor`` plus string metadata.

* nested containers (dicts, lists, tuples): keys are joined with ``sep`` (default ``"."``, so
  ``{"model": {"fc.weight": t}}`` becomes ``"model.fc.weight"`` as Hugging Face tools expect;
  list/tuple positions become their index). Two paths that join to the same name are refused
  (``ValueError``; choose another ``sep``). The exact structure is kept in the metadata entry
  ``"gds_persist"`` so :func:`gds_persist.import_checkpoint` restores it.
* non-tensor leaves (ints, floats incl. inf/nan, bools, strings, None): not tensors, so
  ``safetensors.torch.load_file`` does not return them; they are kept in that metadata entry
  and restored by :func:`gds_persist.import_checkpoint`.
* tensors sharing a storage (tied weights): safetensors cannot alias, so each tensor is written
  with its own copy of its bytes. Tensors that are identical views of one storage (the common
  case: tied embedding / LM-head weights) are recorded and come back as one shared tensor on
  import; partially overlapping views come back as independent copies.
* non-contiguous views: written as their contiguous copy (values equal, strides not kept).
* ``nn.Parameter`` / ``requires_grad``: kept in the metadata, restored on import.
* dtypes safetensors has no code for (e.g. complex128, float8 variants other than e4m3fn/e5m2
  and their fnuz forms, bit/quantized types) and a state dict that is a bare tensor: refused with
  a ``TypeError`` naming the key; use ``to="torch"``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, SafetensorsError
from ..format import DTYPES, TensorRecord
from ..format.safetensors import MAX_HEADER, ST_DTYPES, parse_header
from ..format.tree import decode, path_str, tensor_key_paths, validate

META_KEY = "gds_persist"
_META_VERSION = 1


@dataclass
class StEntry:
    index: int  # tensor index in the manifest / flattened state
    name: str
    record: TensorRecord
    nbytes: int
    begin: int = 0  # data offset in the safetensors buffer


def plan_safetensors(
    tree: Any, tensors: list[TensorRecord], sep: str
) -> tuple[list[StEntry], dict[str, str]]:
    """Names, order and offsets of the tensors, and the metadata that restores the rest."""
    paths = tensor_key_paths(tree)
    entries: list[StEntry] = []
    seen: dict[str, tuple[Any, ...]] = {}
    for i, rec in enumerate(tensors):
        p = paths[i]
        if not p:
            raise TypeError(
                "cannot export a bare tensor to safetensors: wrap it in a dict "
                "({'weight': t}) or use to='torch'"
            )
        name = sep.join(str(k) for k in p)
        if name in seen:
            raise ValueError(
                f"keys {path_str(seen[name])} and {path_str(p)} both become {name!r} when joined "
                f"with sep={sep!r}; choose another separator (e.g. sep='/')"
            )
        seen[name] = p
        dtype = DTYPES[rec.dtype]
        if dtype not in ST_DTYPES:
            raise TypeError(
                f"cannot export {path_str(p)} to safetensors: it has no code for dtype {dtype}; "
                "use to='torch' (torch.save holds every dtype)"
            )
        entries.append(StEntry(i, name, rec, math.prod(rec.shape) * dtype.itemsize))
    # data in storage order, so a streaming export reads each storage once, front to back
    entries.sort(key=lambda e: (e.record.storage, e.record.storage_offset, e.index))
    pos = 0
    for e in entries:
        e.begin = pos
        pos += e.nbytes
    tied: dict[tuple[Any, ...], list[str]] = {}
    for e in entries:
        r = e.record
        if e.nbytes:
            tied.setdefault((r.storage, r.storage_offset, r.shape, r.stride, r.dtype), []).append(
                e.name
            )
    by_index = sorted(entries, key=lambda e: e.index)
    meta = {
        "version": _META_VERSION,
        "sep": sep,
        "tree": tree,
        "names": [e.name for e in by_index],
        "parameter": [e.record.parameter for e in by_index],
        "requires_grad": [e.record.requires_grad for e in by_index],
        "tied": [names for names in tied.values() if len(names) > 1],
    }
    return entries, {"format": "pt", META_KEY: json.dumps(meta, separators=(",", ":"))}


def st_header(entries: list[StEntry], metadata: dict[str, str]) -> bytes:
    """The header of a file holding ``entries``: length, JSON, padding to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        header[e.name] = {
            "dtype": ST_DTYPES[DTYPES[e.record.dtype]],
            "shape": list(e.record.shape),
            "data_offsets": [e.begin, e.begin + e.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned
    if len(raw) > MAX_HEADER:
        raise ValueError(
            f"the safetensors header would be {len(raw)} bytes, above the "
            f"{MAX_HEADER}-byte limit of the format"
        )
    return struct.pack("<Q", len(raw)) + raw


def map_safetensors(file: str) -> Any:
    """The contents of the safetensors ``file``, its tensors backed by a read-only mapping of
    it: the state dict :func:`gds_persist.export_checkpoint` wrote, or a flat ``{name: tensor}``
    dict for a file without its metadata."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    try:
        header = parse_header(lambda at, n: mm[at : at + n] if mm is not None else b"", size)
    except SafetensorsError as e:
        raise CheckpointError(f"{file}: not a valid safetensors file: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    for t in header.tensors:
        if t.end == t.begin:
            tensors[t.name] = torch.empty(t.shape, dtype=t.dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only; we never write to it
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.end - t.begin,  # type: ignore
                                   offset=header.data_start + t.begin)
        tensors[t.name] = raw.view(t.dtype).reshape(t.shape)
    ours = header.metadata.get(META_KEY)
    if ours is None:
        return tensors
    return _restore(file, tensors, ours)


def _restore(file: str, tensors: dict[str, torch.Tensor], raw_meta: str) -> Any:
    """Rebuild the exported state dict from the metadata
    :func:`gds_persist.export_checkpoint` wrote."""
    try:
        meta = json.loads(raw_meta)
        names = meta["names"]
        tree = meta["tree"]
        params, grads, tied = meta["parameter"], meta["requires_grad"], meta["tied"]
        assert meta["version"] == _META_VERSION and len(names) == len(params) == len(grads)
        validate(tree, len(names))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{file}: its gds_persist metadata is malformed ({e})") from None
    if set(names) != set(tensors):
        raise CheckpointError(
            f"{file}: its gds_persist metadata names other tensors than the file holds"
        )
    canonical = {}
    for group in tied:
        for other in group[1:]:
            canonical[other] = group[0]
    out = []
    for name, is_param, needs_grad in zip(names, params, grads, strict=False):
        t = tensors[canonical.get(name, name)]
        if is_param:
            t = torch.nn.Parameter(t, requires_grad=needs_grad)
        elif needs_grad:
            t = t.requires_grad_(True)
        out.append(t)
    # identical tied views must be the very same object, so they share one storage again
    first: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        key = canonical.get(name, name)
        if key in first:
            out[i] = first[key]
        else:
            first[key] = out[i]
    return decode(tree, out)

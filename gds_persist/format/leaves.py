"""The extra leaf node kinds of the tree (format version 3): what they are, how a node of each
kind is checked, and the Python value it loads as. ``docs/FORMAT.md``, "Version 3".

Trainer checkpoints hold more than tensors (Lightning's hyper-parameters and callback states,
Accelerate's RNG states). These values are stored by value, as JSON tree nodes:

======================================  =====================================================
Python value                            tree node
======================================  =====================================================
``numpy.ndarray`` (no objects)          ``{"t": "ndarray", "dtype": "<u4", "shape": [624],
                                        "v": [{"t": "tensor", "i": N}]}``: the bytes are a tensor
numpy scalar (``np.int64(3)``, ...)     ``{"t": "npscalar", "dtype": "<i8", "v": "0300..."}``
``bytes``                               ``{"t": "bytes", "v": "<hex>"}``
``pathlib`` path                        ``{"t": "path", "type": "PosixPath", "v": "/a/b"}``
``enum.Enum`` member                    ``{"t": "enum", "type": "mod.Color", "v": [value]}``:
                                        loads as its value
dict / list / tuple subclass,           the dict / list / tuple node with ``"type": "mod.Name"``:
``argparse.Namespace``,                 loads as the plain container (by value), except
``types.SimpleNamespace``               ``argparse.Namespace``, ``types.SimpleNamespace`` and
                                        ``torch.Size``, which are rebuilt
anything else, only with                ``{"t": "pickle", "type": "mod.Name", "v": [tensor]}``:
``save(..., allow_pickle=True)``        ``torch.save`` bytes, loaded only by ``torch.load(...,
                                        weights_only=True)`` (torch's restricted unpickler)
======================================  =====================================================

A *wrapper* (``enum``, ``ndarray``, ``pickle``) holds one *wrapped* child in ``v``: it has the
wrapper's key path, is never itself one of these nodes and never a rank-local placeholder, and it
adds no nesting depth. The walker (:mod:`.tree`) sees it like any child. Encoding Python objects
into these nodes is :mod:`gds_persist.state.flatten`'s job; nothing here imports a module a
checkpoint names.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pathlib
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ManifestError, PickleRefusedError

VERSION = 3  # the format version that introduced these node kinds
NDARRAY = "ndarray"
NPSCALAR = "npscalar"
BYTES = "bytes"
PATH = "path"
ENUM = "enum"
PICKLE = "pickle"
WRAPPERS = (ENUM, NDARRAY, PICKLE)  # nodes holding one wrapped child in "v"
KINDS = (NDARRAY, NPSCALAR, BYTES, PATH, ENUM, PICKLE)
TYPED = ("dict", "odict", "list", "tuple")  # container kinds that may carry a "type" member
TYPE = "type"
PICKLE_OPTION = "allow_pickle=True"
_TYPE_NAME = re.compile(r"^[\w.<>]{1,300}$")
_HEX = re.compile(r"^(?:[0-9a-f]{2})*$")
# numpy dtypes stored as arrays and scalars: bool, ints, floats, complex, datetime/timedelta,
# fixed-size bytes and str; always little-endian (``|`` for single bytes)
DTYPE = re.compile(
    r"^(\|b1|\|[iu]1|<[iu][248]|<f(2|4|8|12|16)|<c(8|16|24|32)"
    r"|<[mM]8(\[[0-9]{0,9}[A-Za-z]{1,2}\])?|\|S[1-9][0-9]{0,8}|<U[1-9][0-9]{0,8})$"
)
PATHS: dict[str, type[pathlib.PurePath]] = {
    "PosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
_NATIVE_PATH = {"posix": "PosixPath", "nt": "WindowsPath"}.get(os.name)


def is_extra(node: Any) -> bool:
    """Whether a tree node is one of these (an extra kind, or a container with a type)."""
    if not isinstance(node, dict):
        return False
    kind = node.get("t")
    return kind in KINDS or (kind in TYPED and TYPE in node)


def wrapped(node: dict[str, Any]) -> Any:
    """A wrapper's child (callers check ``node["t"] in WRAPPERS``)."""
    return node["v"][0]


def untyped(node: dict[str, Any]) -> dict[str, Any]:
    """A typed container node without its ``type``: the plain container node."""
    return {k: v for k, v in node.items() if k != TYPE}


# --- constructors -------------------------------------------------------------------------------


def ndarray(dtype: str, shape: list[int], tensor: Any) -> dict[str, Any]:
    return {"t": NDARRAY, "dtype": dtype, "shape": shape, "v": [tensor]}


def npscalar(dtype: str, data: bytes) -> dict[str, Any]:
    return {"t": NPSCALAR, "dtype": dtype, "v": data.hex()}


def bytes_node(data: bytes) -> dict[str, Any]:
    return {"t": BYTES, "v": data.hex()}


def path(flavour: str, text: str) -> dict[str, Any]:
    return {"t": PATH, TYPE: flavour, "v": text}


def enum(type_name: str, value: Any) -> dict[str, Any]:
    return {"t": ENUM, TYPE: type_name, "v": [value]}


def pickle(type_name: str, tensor: Any) -> dict[str, Any]:
    return {"t": PICKLE, TYPE: type_name, "v": [tensor]}


def typed(container: dict[str, Any], type_name: str) -> dict[str, Any]:
    return {**container, TYPE: type_name}


# --- checking a node that came from outside -----------------------------------------------------


def check(node: dict[str, Any]) -> None:
    """Check the members of one of these nodes (not its children: the caller checks those,
    knowing that a wrapped child is at the node's own depth); ``ValueError`` saying what is
    wrong."""
    kind = node["t"]

    def bad(why: str) -> ValueError:
        return ValueError(f"tree node {str(node)[:80]!r} is not valid: {why}")

    def fields(*names: str) -> None:
        if set(node) != {"t", *names}:
            raise bad(f"a {kind} node has exactly the members t, {', '.join(names)}")

    def type_member() -> None:
        if not (isinstance(node[TYPE], str) and _TYPE_NAME.match(node[TYPE])):
            raise bad("'type' must be a dotted type name")

    def wrapper(must_be_tensor: bool) -> None:
        v = node["v"]
        if not (isinstance(v, list) and len(v) == 1):
            raise bad("'v' must be a list of one node")
        inner = v[0]
        if is_extra(inner):
            raise bad("a wrapped value cannot itself be an extra leaf")
        if isinstance(inner, dict) and inner.get("t") == "local":
            raise bad("a wrapped value cannot be a rank-local placeholder")
        if must_be_tensor and not (isinstance(inner, dict) and inner.get("t") == "tensor"):
            raise bad("'v' must hold a tensor node")

    if kind in TYPED:
        type_member()
    elif kind == BYTES:
        fields("v")
        if not (isinstance(node["v"], str) and _HEX.match(node["v"])):
            raise bad("'v' must be lowercase hex")
    elif kind == PATH:
        fields(TYPE, "v")
        if node[TYPE] not in PATHS or not isinstance(node["v"], str) or "\x00" in node["v"]:
            raise bad(f"'type' must be one of {sorted(PATHS)} and 'v' a path string")
    elif kind in (ENUM, PICKLE):
        fields(TYPE, "v")
        type_member()
        wrapper(must_be_tensor=kind == PICKLE)
    else:  # npscalar, ndarray
        fields(*(("dtype", "v") if kind == NPSCALAR else ("dtype", "shape", "v")))
        if not (isinstance(node["dtype"], str) and DTYPE.match(node["dtype"])):
            raise bad("'dtype' is not a supported little-endian numpy dtype")
        import numpy as np

        itemsize = np.dtype(node["dtype"]).itemsize
        if kind == NPSCALAR:
            v = node["v"]
            if not (isinstance(v, str) and _HEX.match(v) and len(v) == 2 * itemsize):
                raise bad(f"'v' must be {itemsize} bytes in lowercase hex")
            return
        shape = node["shape"]
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(type(d) is int and 0 <= d <= 1 << 48 for d in shape)
                and math.prod(shape) * itemsize <= 1 << 62):
            raise bad("'shape' must be a list of sizes")
        wrapper(must_be_tensor=True)


# --- loading ------------------------------------------------------------------------------------


def decode(node: dict[str, Any], where: str, child: Callable[[Any], Any]) -> Any:
    """The Python value of one of these nodes; ``child(node)`` decodes a nested node (the plain
    container of a typed one, a wrapper's child); ``where`` is its key path, for errors."""
    kind = node["t"]
    if kind in TYPED:  # the plain container, rebuilt for a few types
        return _restore(node[TYPE], child(untyped(node)))
    if kind == BYTES:
        return bytes.fromhex(node["v"])
    if kind == PATH:
        native = node[TYPE] == _NATIVE_PATH
        return pathlib.Path(node["v"]) if native else PATHS[node[TYPE]](node["v"])
    if kind == NPSCALAR:
        import numpy as np

        return np.frombuffer(bytes.fromhex(node["v"]), dtype=np.dtype(node["dtype"]))[0]
    value = child(wrapped(node))
    if kind == ENUM:
        return value
    if kind == NDARRAY:
        return _array(value, node, where)
    return _unpickle(value, node[TYPE], where)


def _restore(name: str, value: Any) -> Any:
    if name in ("argparse.Namespace", "types.SimpleNamespace") and isinstance(value, dict) \
            and all(isinstance(k, str) for k in value):
        return (argparse.Namespace if name[0] == "a" else types.SimpleNamespace)(**value)
    if name == "torch.Size" and isinstance(value, tuple) \
            and all(type(v) is int and v >= 0 for v in value):
        return torch.Size(value)
    return value


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # (an empty tensor may have any strides)
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _array(t: torch.Tensor, node: dict[str, Any], where: str) -> Any:
    import numpy as np

    dtype, shape = np.dtype(node["dtype"]), tuple(node["shape"])
    raw = _bytes_of(t)
    if raw.numel() != dtype.itemsize * math.prod(shape):
        raise ManifestError(
            f"the numpy array at {where} is {dtype} {list(shape)} but its tensor holds "
            f"{raw.numel()} bytes; the manifest is corrupted"
        )
    return raw.numpy().view(dtype).reshape(shape)


def _unpickle(t: torch.Tensor, name: str, where: str) -> Any:
    data = _bytes_of(t).numpy().tobytes()
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        text = str(e)
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", text)
        reason = found.group(1).strip() if found else (text.strip() or type(e).__name__)[:200]
        needed = re.search(r"GLOBAL (\S+) was not", text)
        classes = f"[{needed.group(1)}, ...]" if needed else "[...]"
        raise PickleRefusedError(
            f"cannot load the pickled {name} at {where}: torch.load(weights_only=True) "
            f"refuses it ({reason}). It was saved with {PICKLE_OPTION}; only if you trust this "
            f"checkpoint, allow its classes with torch.serialization.add_safe_globals({classes}) "
            f"or load inside `with torch.serialization.safe_globals({classes}):`"
        ) from e


def needs_safe_globals(node: Any) -> str | None:
    """What a ``torch.save`` of the loaded value of ``node`` holds that
    ``torch.load(weights_only=True)`` refuses by default (for ``export --to torch``); None if
    nothing."""
    if not isinstance(node, dict):
        return None
    if node.get("t") in (NDARRAY, NPSCALAR, PATH, PICKLE):
        return str(node["t"])
    if node.get(TYPE) in ("argparse.Namespace", "types.SimpleNamespace"):
        return str(node[TYPE])
    return None

"""Stage 1 of a save, last stage of a load: state dict <-> (tree, tensors, storages).

A state dict is turned into three plain things:

* a JSON tree of containers and leaves, where each tensor is replaced by its index;
* one :class:`TensorRecord` per tensor (dtype, shape, stride, offset into its storage);
* one :class:`StorageRecord` per distinct storage, so tensors that share memory (tied embedding
  and LM-head weights, views) are written once and share memory again after load, as with
  ``torch.save``.

Nothing here touches files; nothing here unpickles: the tree is JSON data.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (getattr(torch, n) for n in dir(torch))
    if isinstance(d, torch.dtype) and d not in _QUANTIZED
}
_SUPPORTED_DEVICES = ("cpu", "cuda")
_JSON_SCALARS = (str, int, type(None))  # bool is an int subclass; floats are handled apart
MAX_DEPTH = 100  # containers nested deeper than this are refused at save and in a manifest


@dataclass(frozen=True)
class StorageRecord:
    """One distinct block of tensor memory, written as raw bytes."""

    nbytes: int
    device: str


@dataclass(frozen=True)
class TensorRecord:
    """How to rebuild one tensor as a view of a storage (strides and offset in elements)."""

    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool = False
    parameter: bool = False


@dataclass
class Flattened:
    tree: Any
    tensors: list[TensorRecord]
    storages: list[StorageRecord]
    storage_objects: list[torch.UntypedStorage]  # live memory, same order as ``storages``


def _path_str(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _reject(path: tuple[Any, ...], what: str, fix: str) -> TypeError:
    return TypeError(f"cannot checkpoint {what} at {_path_str(path)}: {fix}")


def _check_tensor(t: torch.Tensor, path: tuple[Any, ...]) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise _reject(
            path,
            f"tensor subclass {type(t).__module__}.{type(t).__qualname__}",
            "save plain tensors (e.g. t.as_subclass(torch.Tensor), or the subclass's inner "
            "tensors); for DTensor state use gds_persist.dcp",
        )
    if t.layout != torch.strided:
        raise _reject(path, f"a {t.layout} tensor", "convert it with .to_dense() first")
    if t.is_quantized or t.dtype in _QUANTIZED:
        raise _reject(
            path,
            f"a quantized tensor ({t.dtype})",
            "save .int_repr() and its scale/zero_point, or .dequantize()",
        )
    if t.device.type not in _SUPPORTED_DEVICES:
        raise _reject(path, f"a tensor on device {t.device}", "move it to 'cpu' or 'cuda' first")
    if t.is_conj() or t.is_neg():
        raise _reject(
            path, "a tensor with a lazy conj/neg bit", "call .resolve_conj().resolve_neg()"
        )


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[TensorRecord] = []
        self.storages: list[StorageRecord] = []
        self.storage_objects: list[torch.UntypedStorage] = []
        self._storage_index: dict[tuple[str, int, int], int] = {}

    def storage_index(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        # the size is part of the key: distinct storages can start at one address (from_numpy
        # of a[:10] and of a) and must not be merged into the smaller one
        key = (str(t.device), storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key in self._storage_index:
            return self._storage_index[key]
        index = len(self.storages)
        # A host snapshot of a CUDA tensor (gds_persist.snapshot) records the device it came from.
        device = getattr(t, "_gds_persist_saved_device", None) or str(t.device)
        self.storages.append(StorageRecord(nbytes=storage.nbytes(), device=device))
        self.storage_objects.append(storage)
        if storage.nbytes():
            self._storage_index[key] = index
        return index

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        _check_tensor(t, path)
        record = TensorRecord(
            storage=self.storage_index(t),
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            storage_offset=int(t.storage_offset()),
            requires_grad=t.requires_grad,
            parameter=isinstance(t, torch.nn.Parameter),
        )
        self.tensors.append(record)
        return {"t": "tensor", "i": len(self.tensors) - 1}

    def node(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise _reject(
                path,
                f"a value nested more than {MAX_DEPTH} levels deep",
                "flatten the structure (loading must not exhaust the stack)",
            )
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, bool) or isinstance(obj, _JSON_SCALARS):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
        if isinstance(obj, dict):
            return self.mapping(obj, path)
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"t": kind, "v": [self.node(v, (*path, i)) for i, v in enumerate(obj)]}
        raise _reject(
            path,
            f"an object of type {type(obj).__module__}.{type(obj).__qualname__}",
            "only tensors, dict/list/tuple, and int/float/bool/str/None are stored; convert it "
            "(e.g. numpy arrays with torch.from_numpy, other objects to a dict of these)",
        )

    def mapping(self, obj: dict[Any, Any], path: tuple[Any, ...]) -> dict[str, Any]:
        if type(obj) not in (dict, OrderedDict):
            raise _reject(path, f"a mapping of type {type(obj).__qualname__}", "use dict(...)")
        keys = list(obj.keys())
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise _reject(
                    (*path, k), f"a dict key of type {type(k).__qualname__}", "use str or int keys"
                )
        node: dict[str, Any] = {
            "t": "odict" if isinstance(obj, OrderedDict) else "dict",
            "k": keys,
            "v": [self.node(obj[k], (*path, k)) for k in keys],
        }
        metadata = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info
        if metadata is not None:
            node["meta"] = self.node(metadata, (*path, "_metadata"))
        return node


def flatten(state_dict: Any) -> Flattened:
    """Split ``state_dict`` into a JSON tree, tensor views and distinct storages.

    Raises TypeError naming the key path for anything that cannot be stored faithfully.
    """
    f = _Flattener()
    tree = f.node(state_dict, ())
    return Flattened(tree, f.tensors, f.storages, f.storage_objects)


def rebuild_tensor(record: TensorRecord, storage: torch.UntypedStorage) -> torch.Tensor:
    t = torch.empty(0, dtype=DTYPES[record.dtype], device=storage.device)
    t.set_(storage, record.storage_offset, record.shape, record.stride)
    if record.parameter:
        return torch.nn.Parameter(t, requires_grad=record.requires_grad)
    return t.requires_grad_(record.requires_grad) if record.requires_grad else t


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`'s tree encoding, with tensors already rebuilt."""
    if not isinstance(tree, dict):
        return tree
    kind = tree["t"]
    if kind == "tensor":
        return tensors[tree["i"]]
    if kind == "float":
        return float(tree["v"])
    if kind in ("list", "tuple"):
        items = [unflatten(v, tensors) for v in tree["v"]]
        return items if kind == "list" else tuple(items)
    cls = OrderedDict if kind == "odict" else dict
    out = cls((k, unflatten(v, tensors)) for k, v in zip(tree["k"], tree["v"], strict=True))
    if "meta" in tree:
        out._metadata = unflatten(tree["meta"], tensors)  # type: ignore[attr-defined]
    return out


def tensor_key_paths(tree: Any) -> dict[int, tuple[Any, ...]]:
    """Map each tensor index in ``tree`` to its key path as a tuple, e.g. ``("model", "wte")``."""
    out: dict[int, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if not isinstance(node, dict):
            return
        kind = node.get("t")
        if kind == "tensor":
            out[node["i"]] = path
        elif kind in ("list", "tuple"):
            for i, v in enumerate(node["v"]):
                walk(v, (*path, i))
        elif kind in ("dict", "odict"):
            for k, v in zip(node["k"], node["v"], strict=True):
                walk(v, (*path, k))

    walk(tree, ())
    return out


def tensor_paths(tree: Any) -> dict[int, str]:
    """Map each tensor index in ``tree`` to its printable key path, e.g. ``['model']['wte']``."""
    return {i: _path_str(p) for i, p in tensor_key_paths(tree).items()}

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

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .format import tree
from .format.records import (
    DTYPES,
    MAX_DEPTH,
    QUANTIZED_DTYPES,
    StorageRecord,
    TensorRecord,
    dtype_name,
)

_SUPPORTED_DEVICES = ("cpu", "cuda")
_JSON_SCALARS = (str, int, type(None))  # bool is an int subclass; floats are handled apart


@dataclass
class Flattened:
    """A state dict taken apart. ``storages[k]`` describes ``storage_objects[k]``, the live
    memory to write; its ``device`` is what the manifest records (a snapshot's host copy of a
    CUDA storage records the CUDA device)."""

    tree: Any
    tensors: list[TensorRecord]
    storages: list[StorageRecord]
    storage_objects: list[torch.UntypedStorage]  # live memory, same order as ``storages``


def _reject(path: tuple[Any, ...], what: str, fix: str) -> TypeError:
    return TypeError(f"cannot checkpoint {what} at {tree.path_str(path)}: {fix}")


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
    if t.is_quantized or t.dtype in QUANTIZED_DTYPES:
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
        self.storages.append(StorageRecord(nbytes=storage.nbytes(), device=str(t.device)))
        self.storage_objects.append(storage)
        if storage.nbytes():
            self._storage_index[key] = index
        return index

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        _check_tensor(t, path)
        record = TensorRecord(
            storage=self.storage_index(t),
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            storage_offset=int(t.storage_offset()),
            requires_grad=t.requires_grad,
            parameter=isinstance(t, torch.nn.Parameter),
        )
        self.tensors.append(record)
        return tree.tensor(len(self.tensors) - 1)

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
            return tree.number(obj)
        if isinstance(obj, dict):
            return self.mapping(obj, path)
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            items = [self.node(v, (*path, i)) for i, v in enumerate(obj)]
            return tree.sequence(items, is_tuple=isinstance(obj, tuple))
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
        values = [self.node(obj[k], (*path, k)) for k in keys]
        ordered = isinstance(obj, OrderedDict)
        metadata = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info
        if metadata is None:
            return tree.mapping(keys, values, ordered=ordered)
        meta = self.node(metadata, (*path, tree.META_KEY))
        return tree.mapping(keys, values, ordered=ordered, meta=meta)


def flatten(state_dict: Any) -> Flattened:
    """Split ``state_dict`` into a JSON tree, tensor views and distinct storages.

    Raises TypeError naming the key path for anything that cannot be stored faithfully.
    """
    f = _Flattener()
    encoded = f.node(state_dict, ())
    return Flattened(encoded, f.tensors, f.storages, f.storage_objects)


def rebuild_tensor(record: TensorRecord, storage: torch.UntypedStorage) -> torch.Tensor:
    t = torch.empty(0, dtype=DTYPES[record.dtype], device=storage.device)
    t.set_(storage, record.storage_offset, record.shape, record.stride)
    if record.parameter:
        return torch.nn.Parameter(t, requires_grad=record.requires_grad)
    return t.requires_grad_(record.requires_grad) if record.requires_grad else t

"""Stage 1 of a save, last stage of a load: state dict <-> (tree, tensors, storages).

A state dict is turned into three plain things:

* a JSON tree of containers and leaves, where each tensor is replaced by its index;
* one :class:`TensorRecord` per tensor (dtype, shape, stride, offset into its storage);
* one :class:`StorageRecord` per distinct storage, so tensors that share memory (tied embedding
  and LM-head weights, views) are written once and share memory again after load, as with
  ``torch.save``.

Leaves beyond tensors and JSON scalars (numpy arrays and scalars, bytes, pathlib paths, enums,
dict/list/tuple subclasses and namespaces) become the extra leaf nodes of
:mod:`gds_persist.format.leaves` (format version 3); anything else is refused, or with
``allow_pickle`` stored as ``torch.save`` bytes.

Nothing here touches files; nothing here unpickles: the tree is JSON data.
"""

from __future__ import annotations

import argparse
import enum
import io
import pathlib
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..format import leaves, tree
from ..format.records import (
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
    # CRC32C of each storage's bytes when save() was called (training/capture.py): a save
    # whose written bytes differ is refused (TornCheckpointError); None: nothing to check (for
    # one storage: a private copy taken at save())
    crc_at_save: list[int | None] | None = None


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


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def refusal(path: tuple[Any, ...], what: str) -> TypeError:
    """The error for a leaf no node kind holds: names the key path and ``allow_pickle``."""
    return _reject(
        path,
        what,
        "gds_persist stores tensors, dict/list/tuple, int/float/bool/str/None and the extra "
        "leaves of docs/FORMAT.md (numpy arrays and scalars, bytes, pathlib paths, enums, "
        "dict/list/tuple subclasses and namespaces by value); convert it (e.g. to a dict of "
        f"these), or pass save(..., {leaves.PICKLE_OPTION}) to store it pickled (loaded only "
        "through torch.load(weights_only=True), which runs no code)",
    )


class _Flattener:
    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle  # store objects no node kind holds pickled
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
        if type(obj) in (dict, OrderedDict):
            return self.mapping(obj, path)
        if type(obj) in (list, tuple):
            return self.sequence(obj, path)
        return self.extra(obj, path)

    def sequence(self, obj: list[Any] | tuple[Any, ...], path: tuple[Any, ...]) -> dict[str, Any]:
        items = [self.node(v, (*path, i)) for i, v in enumerate(obj)]
        return tree.sequence(items, is_tuple=isinstance(obj, tuple))

    def mapping(self, obj: dict[Any, Any], path: tuple[Any, ...]) -> dict[str, Any]:
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


    # --- the extra leaves (format/leaves.py) ----------------------------------------------

    def extra(self, obj: Any, path: tuple[Any, ...]) -> Any:
        """The node of a leaf that is not a tensor, a JSON scalar or a plain container."""
        module = type(obj).__module__
        if module == "numpy" or module.startswith("numpy."):
            node = self.numpy(obj, path)
            if node is not None:
                return node
        elif type(obj) is bytes:
            return leaves.bytes_node(obj)
        elif isinstance(obj, pathlib.PurePath):
            flavour = next(c.__name__ for c in type(obj).__mro__ if c.__name__ in leaves.PATHS)
            return leaves.path(flavour, str(obj))
        elif isinstance(obj, enum.Enum):
            value = self.node(obj.value, path)
            # a value that is itself an extra leaf is stored as that (an enum loads as its value)
            return value if leaves.is_extra(value) else leaves.enum(_type_name(type(obj)), value)
        elif isinstance(obj, dict):
            base = OrderedDict(obj) if isinstance(obj, OrderedDict) else dict(obj)
            return leaves.typed(self.mapping(base, path), _type_name(type(obj)))
        elif isinstance(obj, (argparse.Namespace, types.SimpleNamespace)):
            return leaves.typed(self.mapping(dict(vars(obj)), path), _type_name(type(obj)))
        elif isinstance(obj, (list, tuple)):
            plain = list(obj) if isinstance(obj, list) else tuple(obj)
            return leaves.typed(self.sequence(plain, path), _type_name(type(obj)))
        if self.allow_pickle:
            return self.pickle(obj, path)
        raise refusal(path, f"an object of type {_type_name(type(obj))}")

    def numpy(self, obj: Any, path: tuple[Any, ...]) -> Any:
        import numpy as np

        dtype = obj.dtype.newbyteorder("<") if hasattr(obj, "dtype") else None
        if dtype is None or not leaves.DTYPE.match(dtype.str):
            return None  # object and structured dtypes, numpy types without a dtype
        if isinstance(obj, np.generic):
            return leaves.npscalar(dtype.str, np.asarray(obj, dtype).tobytes())
        if type(obj) is not np.ndarray:
            return None
        a = obj if obj.dtype == dtype else obj.astype(dtype)
        if not (a.flags.c_contiguous and a.flags.writeable):
            a = a.copy(order="C")  # torch.from_numpy warns about read-only arrays
        try:
            t = torch.from_numpy(a)  # a typed tensor where torch has the dtype (export shows it)
        except TypeError:
            t = torch.from_numpy(a.reshape(-1).view(np.uint8))
        return leaves.ndarray(dtype.str, list(a.shape), self.tensor(t, path))

    def pickle(self, obj: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            raise _reject(
                path,
                f"an object of type {_type_name(type(obj))}",
                f"even {leaves.PICKLE_OPTION} cannot pickle it ({type(e).__name__}: {e}); "
                "convert it",
            ) from e
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        return leaves.pickle(_type_name(type(obj)), self.tensor(data, path))


def flatten(state_dict: Any, allow_pickle: bool = False) -> Flattened:
    """Split ``state_dict`` into a JSON tree, tensor views and distinct storages.

    Raises TypeError naming the key path for anything that cannot be stored faithfully (the
    extra leaves of :mod:`gds_persist.format.leaves` are stored by value; ``allow_pickle``
    stores any other object pickled).
    """
    f = _Flattener(allow_pickle)
    encoded = f.node(state_dict, ())
    return Flattened(encoded, f.tensors, f.storages, f.storage_objects)


def rebuild_tensor(record: TensorRecord, storage: torch.UntypedStorage) -> torch.Tensor:
    t = torch.empty(0, dtype=DTYPES[record.dtype], device=storage.device)
    t.set_(storage, record.storage_offset, record.shape, record.stride)
    if record.parameter:
        return torch.nn.Parameter(t, requires_grad=record.requires_grad)
    return t.requires_grad_(record.requires_grad) if record.requires_grad else t

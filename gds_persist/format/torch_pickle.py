"""The pickle inside a ``torch.save`` archive (``data.pkl``): written as torch.save writes it,
read three ways.

* :func:`pickle_state`: protocol 2, storages as persistent ids ``("storage", storage type, key,
  location, numel)`` with keys in first-use order; tensors reduce themselves
  (``torch._utils._rebuild_tensor_v2`` and friends), so ``torch.load`` rebuilds exactly what was
  saved: views, shared storages, parameters, ``OrderedDict`` metadata, Python leaves.
* :func:`skeleton`: the structure *without running any global of the file*: known rebuild
  functions build :class:`~.records.TensorRecord` placeholders, every other global is an inert
  :class:`Opaque` stand-in. It says which storages there are (key, dtype, bytes, location),
  which tensors view them and where those sit in nested dicts/lists/tuples - all a load needs
  to plan its reads and to match ``into=`` before reading a byte. Safe on any file.
* :func:`unpickle`: the real objects over storages the load has filled, by torch's own
  weights-only unpickler (default: tensors, containers and what
  ``torch.serialization.add_safe_globals`` allows; nothing else runs), or by the plain pickle
  machinery for trusted files that hold other objects (``weights_only=False``).
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .records import TensorRecord, dtype_name

PROTOCOL = 2  # torch.save's; torch's weights-only unpickler knows only protocol 2's opcodes
StorageFor = Callable[[str, torch.dtype, int, str], torch.UntypedStorage]  # key, dtype, nbytes,
# location -> the untyped storage to rebuild the tensors of that key over


@dataclass
class StorageEntry:
    """One storage of a pickled state: record ``data/<key>``."""

    key: str
    storage: torch.UntypedStorage
    dtype: torch.dtype  # uint8 for an untyped storage
    location: str  # "cpu", "cuda:0", ...


class _StatePickler(pickle.Pickler):
    """torch.save's pickler: its storage hook is the only thing of ours."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.entries: list[StorageEntry] = []
        self._keys: dict[int, str] = {}  # StorageImpl address -> key
        self._dtypes: dict[int, torch.dtype] = {}  # data address -> the dtype it was saved as

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
            storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype, numel = obj, torch.uint8, obj.nbytes()
            storage_type = torch.UntypedStorage
        else:
            return None
        if untyped.device.type == "meta":
            raise TypeError("a tensor on the meta device has no bytes to save; materialize it "
                            "(e.g. model.to_empty(device=...) and initialize it) first")
        if untyped.data_ptr() and self._dtypes.setdefault(untyped.data_ptr(), dtype) != dtype:
            raise TypeError("two tensors view the same memory as different dtypes, which a "
                            "torch.save file cannot hold (torch.save refuses it too); save "
                            "one of them as a copy (.clone())")
        key = self._keys.get(untyped._cdata)
        if key is None:
            key = self._keys[untyped._cdata] = str(len(self.entries))
            self.entries.append(StorageEntry(key, untyped, dtype,
                                             torch.serialization.location_tag(untyped)))
        return ("storage", storage_type, key, self.entries[int(key)].location, numel)


def pickle_state(state: Any) -> tuple[bytes, list[StorageEntry]]:
    """``data.pkl`` of ``state`` and its storages in key order (``data/0``, ``data/1``, ...)."""
    buf = io.BytesIO()
    pickler = _StatePickler(buf)
    try:
        pickler.dump(state)
    except (pickle.PicklingError, AttributeError) as e:  # a lambda, a local class, a lock...
        raise TypeError(f"the state cannot be pickled into a torch.save file: {e}; keep only "
                        "tensors, containers and importable objects in it") from e
    return buf.getvalue(), pickler.entries


_CUDA_LOCATION = re.compile(rb"X[\x00-\xff]{4}cuda:[0-9]+")  # a BINUNICODE "cuda:N"


def replica_digest(data: bytes) -> str:
    """What must be equal between the pickles of replicas of one state: ``data`` without the
    ordinals of its CUDA locations (data-parallel ranks hold their replica on their own GPU)."""
    return hashlib.sha256(_CUDA_LOCATION.sub(b"cuda", data)).hexdigest()


# --- the skeleton -------------------------------------------------------------------------------

@dataclass(eq=False)
class StorageRef:
    key: str
    dtype: torch.dtype
    nbytes: int
    location: str


class Opaque:
    """Stands in for any global of the file that is not a tensor rebuild: accepts whatever the
    pickle does to it (call, new, setstate, items) and runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque(*args)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("items", []).append((key, value))

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("items", []).append(value)

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


@dataclass
class Skeleton:
    """What :func:`skeleton` found: the structure with :class:`~.records.TensorRecord` leaves
    (``storage``: the storage's key) and the storages in key order."""

    obj: Any
    storages: list[StorageRef]


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module in ("torch._utils", "torch._tensor") and name in _REBUILDS:
            return _REBUILDS[name].__get__(self)
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(torch.uint8)
        if module == "torch" and name.endswith("Storage"):
            try:
                return _StorageType(torch.storage._get_dtype_from_pickle_storage_type(name))
            except KeyError:
                pass
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name == "Size":
            return tuple
        return Opaque

    def persistent_load(self, pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5 or _text(pid[0]) != "storage":
            raise pickle.UnpicklingError(f"an unknown persistent id {pid!r} (not a storage)")
        _, storage_type, key, location, numel = pid
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else torch.uint8
        key = _text(key)
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, dtype, int(numel) * dtype.itemsize,
                                                  _text(location))
        return ref

    def _tensor(self, storage: Any, offset: int, size: Any, stride: Any, requires_grad: Any,
                dtype: torch.dtype | None = None) -> Any:
        if not isinstance(storage, StorageRef):
            return Opaque
        key = int(storage.key) if storage.key.isdigit() else -1  # refused by skeleton()
        return TensorRecord(key, dtype_name(dtype or storage.dtype), tuple(size), tuple(stride),
                            int(offset), bool(requires_grad))

    def _v2(self, storage: Any, offset: int, size: Any, stride: Any, requires_grad: Any = False,
            hooks: Any = None, metadata: Any = None) -> Any:
        return self._tensor(storage, offset, size, stride, requires_grad)

    def _v3(self, storage: Any, offset: int, size: Any, stride: Any, requires_grad: Any,
            hooks: Any, dtype: torch.dtype, metadata: Any = None) -> Any:
        return self._tensor(storage, offset, size, stride, requires_grad, dtype)

    def _parameter(self, data: Any, requires_grad: Any, *rest: Any) -> Any:
        if isinstance(data, TensorRecord):
            return replace(data, requires_grad=bool(requires_grad), parameter=True)
        return data

    def _from_type(self, func: Any, new_type: Any, args: Any, state: Any) -> Any:
        return func(*args)


_REBUILDS = {"_rebuild_tensor_v2": _SkeletonUnpickler._v2,
             "_rebuild_tensor_v3": _SkeletonUnpickler._v3,
             "_rebuild_parameter": _SkeletonUnpickler._parameter,
             "_rebuild_parameter_with_state": _SkeletonUnpickler._parameter,
             "_rebuild_from_type_v2": _SkeletonUnpickler._from_type}


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def skeleton(data: bytes) -> Skeleton:
    """The structure of ``data.pkl`` (see the module docstring); runs nothing of the file.
    Storages are listed in key order; a key that is not a number, or a gap, is refused."""
    u = _SkeletonUnpickler(data)
    try:
        obj = u.load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise pickle.UnpicklingError(f"data.pkl cannot be read ({type(e).__name__}: {e})") from e
    keys = sorted(u.storages, key=lambda k: int(k) if k.isdigit() else -1)
    if [k for k in keys] != [str(i) for i in range(len(keys))]:
        raise pickle.UnpicklingError(f"storage keys {keys[:8]} are not 0..{len(keys) - 1}")
    return Skeleton(obj, [u.storages[k] for k in keys])


# --- the real objects -----------------------------------------------------------------------

def unpickle(data: bytes, storage_for: StorageFor, weights_only: bool = True) -> Any:
    """The state of ``data.pkl`` with every storage key's tensors rebuilt over
    ``storage_for(key, dtype, nbytes, location)``. ``weights_only``: torch's weights-only
    unpickler (raises ``pickle.UnpicklingError`` naming a global it does not allow)."""
    cache: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(pid: Any) -> torch.storage.TypedStorage:
        _, storage_type, key, location, numel = pid
        key = _text(key)
        if key not in cache:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            untyped = storage_for(key, dtype, int(numel) * dtype.itemsize, _text(location))
            cache[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype,
                                                    _internal=True)
        return cache[key]

    if weights_only:
        from torch import _weights_only_unpickler

        u: Any = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    else:
        u = _TrustedUnpickler(io.BytesIO(data), encoding="utf-8")
    u.persistent_load = persistent_load
    return u.load()


class _TrustedUnpickler(pickle.Unpickler):
    """The plain unpickler, with torch.load's storage-type lookup (``weights_only=False``)."""

    def find_class(self, module: str, name: str) -> Any:
        if "Storage" in name:
            try:
                return torch.serialization.StorageType(name)
            except KeyError:
                pass
        return super().find_class("torch._tensor" if module == "torch.tensor" else module, name)

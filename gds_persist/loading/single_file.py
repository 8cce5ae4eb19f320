"""Loading a single-file checkpoint - a ``torch.save`` archive or a safetensors file - through the
same read path as a checkpoint directory (:class:`~gds_persist.transfer.opened.OpenFile`
describes it as a manifest): what differs is only what to read and how the state is rebuilt.

* Every storage is read (a torch.save file's tensors may also sit inside other objects the
  pickle builds), so a process group shares every byte.
* ``into=``: a storage lands in place only where one destination is exactly that storage (a
  parameter, an optimizer moment); else through a fresh buffer, copied into the destinations.
  So every tensor the pickle rebuilds, also one the key paths cannot reach, views memory that
  holds the checkpoint's bytes.
* The state of a torch.save file is its pickle run over the destination storages
  (:func:`gds_persist.format.torch_pickle.unpickle`): torch's weights-only unpickler unless the
  caller trusts the file (``weights_only=False``). It is refused before any byte is read: the
  one run happens before the read where the storages are final
  (:func:`unpickles_before_reading`), else a check over meta storages comes first and the run
  after the read. The destinations of ``into=`` are then put at their key paths. A safetensors file
  decodes like a directory's tree (a flat ``{name: tensor}`` mapping).
* Verification: a file gds_persist wrote carries the CRC32C of every storage, checked as for a
  directory; a stock torch.save or safetensors file carries none (torch.load checks nothing
  either), and :class:`~gds_persist.LoadInfo` says it was read unverified.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import PickleRefusedError
from ..format import Manifest
from ..format.torch_pickle import unpickle
from ..format.tree import KeyPath, tensor_key_paths
from ..transfer.opened import OpenCheckpoint, OpenFile
from .destinations import Destinations, MapLocation, Matched, apply_callable

UNVERIFIED = ("not verified: the file records no checksums (a stock torch.save or safetensors "
              "file; torch.load checks nothing either); gds_persist.save(..., format='torch') "
              "writes files it can verify")


def is_torch_file(ck: OpenCheckpoint) -> bool:
    return isinstance(ck, OpenFile) and ck.pickle is not None


def unpickles_before_reading(ck: OpenCheckpoint, map_location: MapLocation,
                             weights_only: bool, distributed: bool) -> bool:
    """Whether the load runs the pickle once, over its destination storages before any byte is
    read (:func:`rebuild` is then also the check of :func:`check_pickle`): where those
    storages are final (no ``map_location`` callable moves them after the read, no other rank
    fills them) and the weights-only unpickler cannot run code that reads their bytes. Else
    it runs after the read, checked first over meta storages where it is weights-only. One
    run instead of two saves the unpickler's pass, 0.03-0.05 s for the 560 tensors of a 1 GiB
    GPT-like state."""
    return is_torch_file(ck) and weights_only and not distributed and not callable(map_location)


def check_pickle(ck: OpenCheckpoint, weights_only: bool) -> None:
    """Before any byte is read: the pickle of a torch.save file is one this load may run."""
    if not is_torch_file(ck) or not weights_only:
        return
    assert isinstance(ck, OpenFile) and ck.pickle is not None
    _unpickle(ck, lambda key, dtype, nbytes, location: torch.UntypedStorage(nbytes,
                                                                            device="meta"), True)


def rebuild(ck: OpenCheckpoint, tree: Any, dest: Destinations, found: Matched | None,
            map_location: MapLocation, weights_only: bool) -> Any:
    """The state of a torch.save file over the storages ``dest`` holds (see the module
    docstring), with the destinations of ``into=`` at their key paths."""
    assert isinstance(ck, OpenFile)
    m = ck.manifest

    def storage_for(key: str, dtype: torch.dtype, nbytes: int,
                    location: str) -> torch.UntypedStorage:
        s = int(key)
        if s in dest.fresh:
            storage = dest.buffers[dest.fresh[s]].untyped_storage()
            if callable(map_location) and not isinstance(map_location, dict):
                storage = apply_callable(map_location, storage, m.storages[s].device)
            return storage
        return dest.buffers[dest.spans[s][0].buffer].untyped_storage()  # one exact destination

    state = _unpickle(ck, storage_for, weights_only)
    if found is None or not found.dests:
        return state
    paths = tensor_key_paths(tree)
    return with_tensors_at(state, {paths[i]: t for i, t in found.dests.items()})


def exact_destination(m: Manifest, s: int, dests: list[torch.Tensor]) -> bool:
    """Whether storage ``s`` may land in place: one destination that is exactly the storage."""
    if len(dests) != 1:
        return False
    d = dests[0]
    return d.storage_offset() == 0 and d.untyped_storage().nbytes() == m.storages[s].nbytes


def with_tensors_at(obj: Any, tensors: dict[KeyPath, torch.Tensor], path: KeyPath = ()) -> Any:
    """``obj`` with the tensors at the given key paths replaced (dicts and lists in place,
    tuples rebuilt)."""
    if path in tensors:
        return tensors[path]
    if not any(p[: len(path)] == path and len(p) > len(path) for p in tensors):
        return obj
    if isinstance(obj, Mapping):
        for key in list(obj):
            obj[key] = with_tensors_at(obj[key], tensors, (*path, key))  # type: ignore[index]
    elif isinstance(obj, list):
        obj[:] = [with_tensors_at(v, tensors, (*path, i)) for i, v in enumerate(obj)]
    elif isinstance(obj, tuple):
        items = [with_tensors_at(v, tensors, (*path, i)) for i, v in enumerate(obj)]
        obj = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _unpickle(ck: OpenFile, storage_for: Any, weights_only: bool) -> Any:
    assert ck.pickle is not None
    try:
        return unpickle(ck.pickle, storage_for, weights_only)
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise PickleRefusedError(
            f"{ck.path}: the file's pickle holds objects torch's weights-only unpickler does "
            f"not allow ({str(e).splitlines()[0]}); if you trust the file, load it with "
            "weights_only=False (a DeepSpeed checkpoint needs that), or allow the classes with "
            "torch.serialization.add_safe_globals([...]). Nothing was read") from None

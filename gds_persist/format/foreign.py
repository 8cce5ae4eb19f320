"""Single-file checkpoints described as manifests, so every reader (load, ``load(into=)``, a
process group's shared read, verify, inspect) reads them as it reads a checkpoint directory:
one data file (the file itself), one extent per storage at the offset where its bytes are.

* a ``torch.save`` archive (:mod:`.torch_archive`, :mod:`.torch_pickle`): a storage per
  ``data/N`` record; the tensors the pickle's dicts, lists and tuples hold, with their key
  paths (tensors inside other objects are still read: their storages are listed); the CRC32C
  of each storage from gds_persist's checksums record, where the file has one;
* a safetensors file (:mod:`.safetensors`): a storage per tensor, the flat ``{name: tensor}``
  mapping ``safetensors.torch.load_file`` returns; no checksums (the format has none).

Extents here sit wherever the file put them (torch.save: 64-byte aligned; safetensors: 8);
the reader aligns its requests around them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import tree as _tree
from .manifest import Manifest
from .records import DataFile, Extent, StorageRecord, TensorRecord, dtype_name
from .safetensors import StHeader, recorded_crcs, recorded_ties
from .torch_pickle import Skeleton

TORCH = "torch"
SAFETENSORS = "safetensors"


def torch_manifest(name: str, file_size: int, sk: Skeleton, offsets: list[int],
                   checksums: dict[str, int] | None, writer: dict[str, Any]) -> Manifest:
    """The manifest of a torch.save archive: ``offsets[k]`` is where ``data/k`` starts;
    ``checksums``: CRC32C by record name (None: the file records none)."""
    storages = [StorageRecord(s.nbytes, s.location) for s in sk.storages]
    tensors: list[TensorRecord] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, TensorRecord):
            tensors.append(obj)
            return _tree.tensor(len(tensors) - 1)
        if isinstance(obj, Mapping):
            keys = [k for k in obj if type(k) in (str, int)]  # others: not reachable by path
            return _tree.mapping(keys, [leaf(obj[k]) for k in keys])
        if isinstance(obj, list | tuple):
            return _tree.sequence([leaf(v) for v in obj], is_tuple=isinstance(obj, tuple))
        return None  # the real object comes from the pickle (torch_pickle.unpickle)

    tree = leaf(sk.obj)
    extents = [Extent(k, 0, s.nbytes, 0, offsets[k],
                      (checksums or {}).get(f"data/{k}", 0))
               for k, s in enumerate(sk.storages) if s.nbytes]
    return Manifest([DataFile(name, file_size)], storages, tensors, extents, tree,
                    {"container": TORCH, "checksums": checksums is not None, **writer})


def safetensors_manifest(name: str, file_size: int, header: StHeader) -> Manifest:
    """The manifest of a safetensors file: the flat mapping of its tensors."""
    storages, tensors, extents = [], [], []
    for k, t in enumerate(header.tensors):
        storages.append(StorageRecord(t.end - t.begin, "cpu"))
        tensors.append(TensorRecord(k, dtype_name(t.dtype), t.shape, _contiguous(t.shape), 0))
        if t.end > t.begin:
            extents.append(Extent(k, 0, t.end - t.begin, 0, header.data_start + t.begin, 0))
    tree = _tree.mapping([t.name for t in header.tensors],
                         [_tree.tensor(k) for k in range(len(header.tensors))])
    return Manifest([DataFile(name, file_size)], storages, tensors, extents, tree,
                    {"container": SAFETENSORS, "checksums": False, "metadata": header.metadata})


def hf_manifest(shards: list[tuple[str, int, StHeader]]) -> Manifest:
    """The manifest of a Hugging Face model directory (``model.safetensors`` or its shards):
    one data file per shard, a storage per stored tensor, the flat mapping of every name (a tied
    name views its stored tensor's storage); the CRC32C gds_persist recorded, where every file
    has them (``writer["checksums"]``)."""
    files: list[DataFile] = []
    storages: list[StorageRecord] = []
    tensors: list[TensorRecord] = []
    extents: list[Extent] = []
    names: list[str] = []
    where: dict[str, int] = {}
    crcs: dict[str, int] = {}
    ties: dict[str, str] = {}
    verifiable = True
    for f, (name, size, header) in enumerate(shards):
        files.append(DataFile(name, size))
        recorded = recorded_crcs(header)
        verifiable = verifiable and recorded is not None
        crcs.update(recorded or {})
        ties.update(recorded_ties(header))
        for t in header.tensors:
            k = len(storages)
            where[t.name] = k
            names.append(t.name)
            storages.append(StorageRecord(t.end - t.begin, "cpu"))
            tensors.append(TensorRecord(k, dtype_name(t.dtype), t.shape, _contiguous(t.shape), 0))
            if t.end > t.begin:
                extents.append(Extent(k, 0, t.end - t.begin, f, header.data_start + t.begin,
                                      crcs.get(t.name, 0)))
    for alias, stored in ties.items():
        if stored in where and alias not in where:
            names.append(alias)
            tensors.append(replace(tensors[where[stored]]))
    tree = _tree.mapping(names, [_tree.tensor(k) for k in range(len(names))])
    return Manifest(files, storages, tensors, extents, tree,
                    {"container": SAFETENSORS, "checksums": verifiable, "files": len(files)})


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))

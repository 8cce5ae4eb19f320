"""The one place a save's manifest is put together: the replicated state's records, each rank's
rank-local part after them, the written extents (sorted), the data files, and the extents a
version-4 save refers to in its bases. Every directory layout (one process, data-parallel, the
memory tier's shares) and the DCP writer build their manifests here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..format import DataDir, DataFile, Extent, Manifest, Section, StorageRecord, TensorRecord
from ..format import tree as _tree
from ..format.records import Wire
from .incremental import Candidate, assemble_references


@dataclass(frozen=True)
class Part(Wire):
    """A tree and its records: a whole state, or one rank's rank-local part of it."""

    tree: Any
    tensors: list[TensorRecord] = field(default_factory=list)
    storages: list[StorageRecord] = field(default_factory=list)


@dataclass(frozen=True)
class Referral(Wire):
    """A unit not written because a base holds its bytes: the storage and where they are."""

    storage: int
    candidate: Candidate


def build_manifest(state: Part, files: Sequence[DataFile], extents: Sequence[Extent],
                   writer: dict[str, Any], *, locals_by_rank: Sequence[Part] = (),
                   dirs: Sequence[DataDir] = (), referred: Sequence[Referral] = (),
                   sections: Sequence[Section] = ()) -> Manifest:
    """The manifest of ``state`` written as ``extents`` of ``files``. ``locals_by_rank``: each
    rank's rank-local part, whose storages follow the state's in rank order (sections only where
    the state's tree holds rank-local placeholders); ``referred``: units a base holds;
    ``sections``: rank-local sections whose records ``state`` holds already (a copy)."""
    storages, tensors = list(state.storages), list(state.tensors)
    sections = list(sections)
    has_local = _tree.has_locals(state.tree)
    for rank, part in enumerate(locals_by_rank):
        t_base, s_base = len(tensors), len(storages)
        storages += part.storages
        tensors += [replace(t, storage=t.storage + s_base) for t in part.tensors]
        if has_local:
            sections.append(Section(rank, _tree.shift_tensors(part.tree, t_base)))
    files = list(files)
    ref_files, bases, ref_extents = assemble_references(
        [(r.storage, r.candidate) for r in referred], len(files))
    return Manifest(files + ref_files, storages, tensors,
                    sorted(extents, key=lambda e: (e.file, e.offset)) + ref_extents, state.tree,
                    writer, dirs=list(dirs), sections=sections, bases=bases)

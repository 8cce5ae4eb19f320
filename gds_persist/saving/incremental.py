"""Writing fewer bytes (format version 4): the base checkpoint and references to it. The units
that are referred to or written are cut in :mod:`.units`.

**References.** ``save(..., base=B)``: a unit whose key path (the path of its storage's first
tensor), byte range and BLAKE3-128 equal those of an extent of ``B`` is not written; the new
manifest lists that extent (same offset, length, codec and checksums) in a file record that names
the checkpoint physically holding the bytes - ``B`` itself, or, if ``B`` refers to it, ``B``'s own
base: chains are flattened, a reference always names where the bytes are. Each such checkpoint is
recorded with the SHA-256 of its manifest, checked when the save opens it and again before the
commit, and by every load. A base must be a sibling directory (same parent) and never the path
being saved; extents in external data directories (``data_dirs``) are not referred to.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ReferencedCheckpointError, UnhashedBaseWarning
from ..format import MANIFEST_NAME, BaseRef, DataFile, Extent, manifest_storage_keys
from ..format.records import Wire
from ..transfer.opened import OpenCheckpoint, open_checkpoint
from ..transfer.unit_writer import Unit

Key = tuple[str, int, int]  # (key path, start, length)


# --- the base --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Holder(Wire):
    """The checkpoint that physically holds referred bytes: its name and manifest SHA-256."""

    name: str
    manifest_sha256: str


@dataclass(frozen=True)
class Candidate(Wire):
    """An extent of the base (by key path and range) that a unit may refer to."""

    blake3: str
    extent: Extent
    holder: Holder
    file_name: str
    file_size: int


@dataclass
class BaseIndex:
    """A base checkpoint held open, and the extents a new checkpoint may refer to."""

    path: str
    ck: OpenCheckpoint
    candidates: dict[Key, Candidate]
    holders: dict[str, Holder]
    note: str = ""  # what could not be referred to, and why

    def close(self) -> None:
        self.ck.close()

    def match(self, key: str, unit: Unit, blake3: str) -> Candidate | None:
        c = self.candidates.get((key, unit.start, unit.length))
        return c if c is not None and blake3 and c.blake3 == blake3 else None

    def check_unchanged(self) -> None:
        """Before the commit: every checkpoint referred to is still the one identified."""
        for h in self.holders.values():
            _check_holder(os.path.dirname(os.path.abspath(self.path)), h)


def check_base_path(path: str, base: str) -> str:
    """``base`` as an absolute path; ValueError unless it is a sibling of ``path`` (the same
    parent directory) and not ``path`` itself."""
    path, base = os.path.abspath(path), os.path.abspath(os.fspath(base))
    if base == path:
        raise ValueError(f"base={base!r} is the checkpoint being saved: the new checkpoint would "
                         "refer to bytes its own commit replaces; pass an earlier checkpoint")
    if (os.path.dirname(base) != os.path.dirname(path)
            or os.path.dirname(os.path.realpath(base)) != os.path.realpath(os.path.dirname(path))):
        raise ValueError(
            f"base={base!r} is not a sibling of {path!r}: an incremental checkpoint refers only "
            "to checkpoints in its own parent directory (references outside the checkpoint's "
            "root are refused when loading); save next to the base, or without base=")
    return base


def open_base(path: str, base: str) -> BaseIndex:
    """Open ``base`` (a committed sibling of ``path``) and index what may be referred to."""
    base = check_base_path(path, base)
    ck = open_checkpoint(base)
    try:
        m = ck.manifest
        parent = os.path.dirname(base)
        keys = manifest_storage_keys(m)
        own = Holder(os.path.basename(base), ck.digest)
        holders: dict[str, Holder] = {own.name: own}
        refused: dict[str, str] = {}
        for ref in m.bases:
            h = Holder(ref.name, ref.manifest_sha256)
            try:
                _check_holder(parent, h)
                holders[h.name] = h
            except ReferencedCheckpointError as why:
                refused[h.name] = str(why)
        candidates: dict[Key, Candidate] = {}
        unhashed = 0
        for e in m.extents:
            f = m.files[e.file]
            if f.dir or e.storage not in keys:
                continue
            holder = own if not f.base else holders.get(m.bases[f.base - 1].name)
            if holder is None:
                continue
            if not e.blake3:
                unhashed += 1
                continue
            candidates[(keys[e.storage], e.start, e.length)] = Candidate(
                e.blake3, e, holder, f.name, f.size)
        notes = []
        if unhashed:
            notes.append(unhashed_note(own.name, unhashed, len(m.extents)))
            warnings.warn(UnhashedBaseWarning(notes[-1]), stacklevel=4)  # the caller of save
        notes += [f"not referring to {n}: {why}" for n, why in refused.items()]
        return BaseIndex(base, ck, candidates, holders, "; ".join(notes))
    except BaseException:
        ck.close()
        raise


def unhashed_note(name: str, unhashed: int, extents: int) -> str:
    """Why a save refers to nothing of a base saved without content hashes, and the fix."""
    nothing = "nothing could be referred to" if unhashed == extents else "those are written again"
    return (f"base {name}: {unhashed} of its {extents} extents have no content hash, so "
            f"{nothing}; save the base with content_hash=True (Checkpointer(incremental=True) "
            "does) so that later saves can refer to it")


def _check_holder(parent: str, h: Holder) -> None:
    full = os.path.join(parent, h.name)
    try:
        with open(os.path.join(full, MANIFEST_NAME), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise ReferencedCheckpointError(
            f"the checkpoint {full} that holds referred bytes cannot be read ({e}); it was "
            "deleted or moved") from None
    if digest != h.manifest_sha256:
        raise ReferencedCheckpointError(
            f"the checkpoint {full} that holds referred bytes was replaced (its manifest changed)")


@dataclass
class References:
    """Referred units of a save, turned into file records, bases and extents."""

    base: BaseIndex | None
    keys: dict[int, str]  # storage (as the writer numbers it) -> key path
    units: Sequence[Unit]
    matched: dict[int, Candidate] = field(default_factory=dict)

    def decide(self, k: int, blake3: str) -> bool:
        """The unit writer's ``decide``: refer to unit ``k`` if the base holds its bytes."""
        if self.base is None:
            return False
        u = self.units[k]
        key = self.keys.get(u.storage)
        c = self.base.match(key, u, blake3) if key is not None else None
        if c is None:
            return False
        self.matched[k] = c  # dict writes are atomic under the GIL
        return True

    def likely_changed(self, k: int) -> bool:
        """Whether unit ``k`` probably changed since the base: no base extent for its key and
        range, or the base wrote that extent itself (it changed at the base's save). Such units
        are written first, so the drive starts while the other units are still being hashed."""
        if self.base is None:
            return True
        u = self.units[k]
        key = self.keys.get(u.storage)
        c = self.base.candidates.get((key, u.start, u.length)) if key is not None else None
        return c is None or c.holder.name == os.path.basename(self.base.path)

    def referred_bytes(self) -> int:
        return sum(self.units[k].length for k in self.matched)


def assemble_references(referred: Sequence[tuple[int, Candidate]], first_file: int,
                        ) -> tuple[list[DataFile], list[BaseRef], list[Extent]]:
    """File records (numbered from ``first_file``), bases and extents for referred units:
    ``referred`` lists ``(storage, candidate)``; one file record per (holder, file)."""
    bases: dict[str, int] = {}
    base_list: list[BaseRef] = []
    files: dict[tuple[str, str], int] = {}
    file_list: list[DataFile] = []
    extents = []
    for storage, c in referred:
        if c.holder.name not in bases:
            base_list.append(BaseRef(c.holder.name, c.holder.manifest_sha256))
            bases[c.holder.name] = len(base_list)
        fkey = (c.holder.name, c.file_name)
        if fkey not in files:
            file_list.append(DataFile(c.file_name, c.file_size, 0, bases[c.holder.name]))
            files[fkey] = first_file + len(file_list) - 1
        e = c.extent
        extents.append(Extent(storage, e.start, e.length, files[fkey], e.offset, e.crc32c,
                              e.codec, e.stored, e.stored_crc32c, e.blake3))
    return file_list, base_list, extents


def describe_references(refs: References | None) -> dict[str, Any]:
    """The manifest's ``writer["incremental"]``: for humans."""
    if refs is None or refs.base is None:
        return {}
    return {"base": os.path.basename(refs.base.path), "referred_bytes": refs.referred_bytes(),
            "note": refs.base.note}

"""The commit of a checkpoint in an object store, where there is no rename: the manifest object
is the commit (``docs/OBJECT_STORE.md``, "Commit").

A save of ``s3://b/run/step-1`` writes, in this order:

1. its data objects under a prefix of its own, ``run/step-1/.save-<id>/`` (``<id>``: the time
   and a random part, unique to the save), each completed whole (multipart) before the next
   step;
2. checks that every object the manifest names is there, whole;
3. the manifest, ``run/step-1/manifest.json``, in one PUT (atomic: a reader sees the previous
   manifest or this one, never a part), naming its objects' prefix (``writer["objects"]``).

A reader trusts only what the manifest names. Two saves of one URL at once: each writes its own
prefix; the manifest PUT last wins, and names only its own save's complete objects. Nothing
torn is ever visible. A failed save deletes its objects (:meth:`ObjectTarget.finish`); one
killed leaves them and no manifest: the next save of the URL removes every ``.save-*`` prefix
that the manifest does not name once its objects are ``object_grace_s`` old (a concurrent save's
objects are younger), and the objects of the manifest it replaced at once.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, replace

from .. import settings
from ..errors import CheckpointError, ManifestError, ObjectStoreError
from ..format import MANIFEST_NAME, Manifest, dump_manifest, parse_manifest
from .base import ObjectStore
from .urls import Location, parse, store_for

SAVE_MARK = ".save-"
OBJECTS = "objects"  # the manifest's writer record: the prefix of its data objects


def objects_of(m: Manifest, url: str) -> str:
    """The name of the prefix holding ``m``'s data objects (validated: one plain name)."""
    name = m.writer.get(OBJECTS)
    if not isinstance(name, str) or not name.startswith(SAVE_MARK) or "/" in name:
        raise ManifestError(f"{url}/{MANIFEST_NAME} names no data objects of its own (writer "
                            f"record {OBJECTS!r}: {name!r}): not a checkpoint written to an "
                            "object store by gds_persist")
    return name


def read_manifest(loc: Location) -> tuple[bytes, Manifest] | None:
    """The committed manifest at ``loc`` (raw and validated), None where there is none."""
    raw = store_for(loc).get(loc.child(MANIFEST_NAME).key)
    if raw is None:
        return None
    manifest = parse_manifest(raw, f"{loc.url}/{MANIFEST_NAME}")
    objects_of(manifest, loc.url)
    return raw, manifest


@dataclass
class ObjectTarget:
    """One save's data prefix (the counterpart of a temporary directory): ``dir`` is the URL
    its data objects are written under."""

    path: str
    dir: str
    ident: str
    committed: bool = False

    @property
    def loc(self) -> Location:
        return parse(self.path)

    @property
    def prefix(self) -> str:
        return f"{self.loc.key}/{SAVE_MARK}{self.ident}/"

    def finish(self) -> None:
        """After the commit: nothing (the objects are the checkpoint's). Before it (a failure):
        delete what this save wrote; what cannot be deleted now goes with a later save."""
        if self.committed:
            return
        try:
            store = store_for(self.loc)
            store.delete([o.key for o in store.listing(self.prefix)])
        except CheckpointError:
            pass


def begin(url: str, replace_ok: bool = True) -> ObjectTarget:
    """Start a save of ``url``: refuse what is not a checkpoint (objects other than a manifest
    and save prefixes), then name this save's data prefix."""
    loc = parse(url)
    store = store_for(loc)
    foreign = [o.key for o in store.listing(loc.key + "/")
               if not o.key[len(loc.key) + 1:].startswith(SAVE_MARK)
               and o.key[len(loc.key) + 1:] != MANIFEST_NAME]
    if foreign:
        raise CheckpointError(
            f"{url} holds objects that are not a gds_persist checkpoint ({foreign[0]}, "
            f"{len(foreign)} in all); a save never deletes those: save to another prefix "
            "(docs/OBJECT_STORE.md, \"Commit\")")
    if not replace_ok and store.size(loc.child(MANIFEST_NAME).key) is not None:
        raise CheckpointError(f"Checkpoint already exists and overwrite=False: {url} already "
                              "holds a checkpoint; choose another URL or pass overwrite=True")
    ident = f"{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
    return ObjectTarget(loc.url, f"{loc.url}/{SAVE_MARK}{ident}", ident)


def seal(target: ObjectTarget, manifest: Manifest, replace_ok: bool = True) -> None:
    """Commit ``target``: check its objects, then PUT the manifest naming them (the commit
    point), then remove the objects no manifest names any more (best effort). On a failure
    before the PUT, ``target``'s objects are deleted and the previous checkpoint is intact."""
    loc, store = target.loc, store_for(target.loc)
    try:
        manifest = replace(manifest, writer={**manifest.writer,
                                             OBJECTS: f"{SAVE_MARK}{target.ident}"})
        raw = dump_manifest(manifest)
        parse_manifest(raw, f"the manifest being written for {target.path}")
        _check_objects(store, target, manifest)
        previous = read_manifest(loc)
        if previous is not None and not replace_ok:
            raise CheckpointError(f"Checkpoint already exists and overwrite=False: {loc.url} "
                                  "holds a checkpoint committed meanwhile")
        store.put(loc.child(MANIFEST_NAME).key, raw)
    except BaseException:
        target.finish()
        raise
    target.committed = True
    try:
        sweep(loc, keep={f"{SAVE_MARK}{target.ident}"},
              dead={objects_of(previous[1], loc.url)} if previous else set())
    except CheckpointError:
        pass  # committed; a later save removes what is left


def _check_objects(store: ObjectStore, target: ObjectTarget, m: Manifest) -> None:
    """Every data object the manifest names is there, whole (not removed by another save's
    sweep: a save slower than ``object_grace_s`` is refused here, never committed torn)."""
    have = {o.key[len(target.prefix):]: o.size for o in store.listing(target.prefix)}
    for f in m.files:
        if have.get(f.name, -1) < f.size:
            raise ObjectStoreError(
                f"{target.dir}/{f.name}: written by this save but missing or short before its "
                "commit (another save's cleanup removed it? a save must take less than the "
                "object_grace_s setting); nothing was committed", f"{target.dir}/{f.name}")


def sweep(loc: Location, keep: set[str], dead: set[str]) -> list[str]:
    """Remove the data prefixes under ``loc`` that the committed manifest does not name: those
    in ``dead`` (replaced just now) at once, the others once ``object_grace_s`` old; and give
    up unfinished uploads as old. Returns the prefixes removed."""
    store, grace = store_for(loc), settings.current().object_grace_s
    current = read_manifest(loc)
    if current is not None:
        keep = keep | {objects_of(current[1], loc.url)}
    groups: dict[str, list[tuple[str, float]]] = {}
    for o in store.listing(f"{loc.key}/{SAVE_MARK}"):
        name = o.key[len(loc.key) + 1:].partition("/")[0]
        groups.setdefault(name, []).append((o.key, o.age_s))
    gone = [name for name, objs in groups.items() if name not in keep
            and (name in dead or min(age for _, age in objs) >= grace)]
    store.delete([k for name in gone for k, _ in groups[name]])
    for key, upload in store.stale_uploads(f"{loc.key}/{SAVE_MARK}", grace):
        if key[len(loc.key) + 1:].partition("/")[0] not in keep:
            store.abort_upload(key, upload)
    return sorted(gone)


def object_path(url: str, m: Manifest, name: str) -> str:
    """The URL of data object ``name`` of the checkpoint ``url`` whose manifest is ``m``."""
    return f"{url}/{objects_of(m, url)}/{os.path.basename(name)}"

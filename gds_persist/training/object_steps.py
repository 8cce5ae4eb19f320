"""A :class:`~gds_persist.Checkpointer` root in an object store (``s3://bucket/run``): the same
layout as :mod:`.steps`, in objects::

    run/step-00000042/manifest.json          a committed step (gds_persist.save to its URL)
    run/step-00000042/.save-<id>/data-*.bin  its data objects
    run/latest                               "step-00000042\\n": one PUT, after the step's
                                             manifest (atomic: the old or the new pointer)

Order of a publish: the step's manifest object (its commit), then ``latest``, then old steps
removed: each by deleting its manifest first (from then on it is not committed: a reader never
meets a step without its data), then its data objects. A crash between leaves data objects
without a manifest, which the next publish's sweep removes (:func:`apply_retention`).
"""

from __future__ import annotations

import re

from ..format import MANIFEST_NAME
from ..stores.commit import SAVE_MARK, sweep
from ..stores.urls import Location, parse, store_for

LATEST = "latest"
_STEP_MANIFEST = re.compile(r"^(step-(\d+))/" + re.escape(MANIFEST_NAME) + "$")
_STEP_ANY = re.compile(r"^step-(\d+)/")


def _names(root: str) -> tuple[Location, list[str]]:
    loc = parse(root)
    prefix = loc.key + "/"
    return loc, [o.key[len(prefix):] for o in store_for(loc).listing(prefix)]


def committed_steps(root: str) -> list[int]:
    """Steps whose manifest object exists, ascending."""
    _, names = _names(root)
    return sorted(int(m.group(2)) for n in names if (m := _STEP_MANIFEST.match(n)))


def read_latest(root: str) -> int | None:
    loc = parse(root)
    raw = store_for(loc).get(loc.child(LATEST).key)
    if raw is None:
        return None
    m = re.fullmatch(r"step-(\d+)", raw.decode("ascii", "replace").strip())
    return int(m.group(1)) if m else None


def write_latest(root: str, step: int) -> None:
    loc = parse(root)
    store_for(loc).put(loc.child(LATEST).key, f"step-{step:08d}\n".encode("ascii"))


def remove_step(root: str, step: int) -> None:
    """Uncommit the step (its manifest goes first), then delete its data objects."""
    loc = parse(root).child(f"step-{step:08d}")
    store = store_for(loc)
    store.delete([loc.child(MANIFEST_NAME).key])
    store.delete([o.key for o in store.listing(loc.key + "/")])


def apply_retention(root: str, newest: int, keep_last: int | None) -> list[int]:
    """As :func:`gds_persist.training.steps.apply_retention`: steps above ``newest`` and all
    but the ``keep_last`` newest up to it go (``newest`` never); then the data objects of
    interrupted saves of steps up to ``newest`` (once ``object_grace_s`` old: a save still
    running is younger). Returns the removed steps."""
    steps = committed_steps(root)
    upto = [s for s in steps if s <= newest]
    old = upto[:-keep_last] if keep_last is not None else []
    removed = [s for s in [*(s for s in steps if s > newest), *old] if s != newest]
    for s in removed:
        remove_step(root, s)
    _, names = _names(root)
    leftovers = {int(m.group(1)) for n in names if (m := _STEP_ANY.match(n))
                 and f"/{SAVE_MARK}" in n and int(m.group(1)) <= newest}
    for s in sorted(leftovers):
        sweep(parse(root).child(f"step-{s:08d}"), keep=set(), dead=set())
    return removed

"""The layout of a :class:`~gds_persist.Checkpointer` root: step directories, ``latest``, retention.

::

    root/
      step-00000041/            a committed checkpoint (a gds_persist.save directory)
      step-00000042/
      latest                    "step-00000042\\n": the newest published step, replaced atomically
      .step-00000043.tmp-<id>/  a save in progress, or one a crash interrupted (never loaded),
      .step-00000043.tmp-<id>.lock  with the lock its owner holds while alive (core ``save``)

Order of a publish: the step directory is committed (core ``save``: fsync + atomic rename), then
``latest`` is replaced (temp file, fsync, rename, fsync of the root), then old steps are removed.
A crash anywhere leaves ``latest`` naming a committed step, or missing / naming a step that is
gone, in which case :func:`latest_step` falls back to the newest committed step directory.
Removal renames a directory to a hidden ``.step-N.del-<id>`` before deleting it, so a crash in the
middle of a delete never leaves a half-deleted directory that looks committed. A step that a kept
step refers to (``Checkpointer(incremental=True)``: the bytes it did not write again) is kept
with it, however old.

Other processes may use the root at once (an evaluation job loading ``latest``, a second
Checkpointer): leftovers of saves are removed only once their owner is gone (core ``save``'s
owner locks), ``.latest.tmp-*`` files of other publishers only once untouched for an hour, and
a reader loading a step that retention removes keeps reading the files it holds open
(``gds_persist.transfer.opened``).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

from ..errors import NotACheckpointDirectoryError, NotCommittedError
from ..format import MANIFEST_NAME, base_names
from ..stores import is_url
from ..transfer.commit import fsync_path, remove_stale_temporaries, remove_tree
from ..transfer.locks import STALE_UNLOCKED_S, untouched_for
from . import object_steps

LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")
_HIDDEN_STEP = re.compile(r"^\.step-(\d+)\.(tmp|old|del)-")
_HIDDEN_LATEST = ".latest.tmp-"


def make_root(root: str) -> None:
    """Create the Checkpointer root (and its parents) if missing; a file in the way raises
    :class:`NotACheckpointDirectoryError` saying what to do (not the bare ``FileExistsError``).
    A root in an object store needs no making: a prefix exists once an object is under it."""
    if is_url(root):
        return
    try:
        os.makedirs(root, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        blocker = root  # the nearest existing component: the file in the way
        while not os.path.lexists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        raise NotACheckpointDirectoryError(
            f"Checkpointer root {root} cannot be a directory: {blocker} is a file. A "
            "Checkpointer keeps its steps in a directory there; pass a directory path (a new "
            "one is created), or move the file away (a torch.save file there: "
            "gds_persist.import_checkpoint converts it, or gds_persist.load reads it)"
        ) from e


def check_root(root: str) -> None:
    """What :func:`make_root` would refuse, found without creating anything."""
    if is_url(root):
        return
    existing = root
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        make_root(root)  # raises NotACheckpointDirectoryError naming the file in the way


def nothing_to_load(root: str) -> NotCommittedError:
    """The error of a load from a root without committed steps: a ``FileNotFoundError`` too,
    as ``torch.load`` raises for a missing file (``except FileNotFoundError: start fresh``)."""
    return NotCommittedError(
        f"no committed checkpoint in {root} to load (no step-* directory with a manifest); "
        "save one first, or start fresh where there is none (this error is a FileNotFoundError)"
    )


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_path(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def parse_step(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def committed_steps(root: str) -> list[int]:
    """Steps whose directory is committed (holds a manifest), ascending."""
    if is_url(root):
        return object_steps.committed_steps(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        step = parse_step(name)
        if step is not None and os.path.isfile(os.path.join(root, name, MANIFEST_NAME)):
            steps.append(step)
    return sorted(steps)


def read_latest(root: str) -> int | None:
    """The step ``latest`` names, or None when it is missing or unreadable."""
    if is_url(root):
        return object_steps.read_latest(root)
    try:
        with open(os.path.join(root, LATEST), encoding="ascii") as f:
            text = f.read(64)
    except (OSError, UnicodeDecodeError):
        return None
    return parse_step(text.strip())


def latest_step(root: str) -> int | None:
    """The newest published committed step: what ``latest`` names if that step is committed,
    else (pointer missing, stale or garbled after a crash or a manual delete) the newest committed
    step directory; None when there is none."""
    steps = committed_steps(root)
    pointed = read_latest(root)
    if pointed is not None and pointed in steps:
        return pointed
    return steps[-1] if steps else None


def write_latest(root: str, step: int) -> None:
    """Point ``latest`` at ``step`` atomically and durably."""
    if is_url(root):
        return object_steps.write_latest(root, step)
    for name in os.listdir(root):  # another publisher's may be in flight: only old ones
        if name.startswith(_HIDDEN_LATEST) and untouched_for(os.path.join(root, name),
                                                             STALE_UNLOCKED_S):
            _remove(os.path.join(root, name))
    tmp = os.path.join(root, f"{_HIDDEN_LATEST}{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.write(fd, f"{step_name(step)}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(root, LATEST))
    except BaseException:
        _remove(tmp)
        raise
    fsync_path(root)


def remove_step(root: str, step: int) -> None:
    """Delete a step directory: hide it with one rename (atomic), then remove it. A reader
    holding it open keeps reading it; one gone already (another process removed it) is fine."""
    if is_url(root):
        return object_steps.remove_step(root, step)
    path = step_path(root, step)
    hidden = os.path.join(root, f".{step_name(step)}.del-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    remove_tree(hidden)


def apply_retention(root: str, newest: int, keep_last: int | None) -> list[int]:
    """After ``newest`` is committed and ``latest`` names it: remove what is not kept.

    Removes committed steps above ``newest`` (left from a timeline abandoned by resuming from an
    older step), all but the ``keep_last`` newest steps up to ``newest``, and leftovers of
    interrupted saves and deletes of steps up to ``newest`` (no save of those is still running).
    ``newest`` itself is never removed, nor any step whose bytes a kept step refers to (an
    incremental checkpoint's bases, :func:`referenced_steps`). Returns the removed steps.
    """
    if is_url(root):
        return object_steps.apply_retention(root, newest, keep_last)
    steps = committed_steps(root)
    above = [s for s in steps if s > newest]
    upto = [s for s in steps if s <= newest]
    old = upto[:-keep_last] if keep_last is not None else []
    candidates = {s for s in above + old if s != newest}
    protected = referenced_steps(root, [s for s in steps if s not in candidates])
    removed = [s for s in above + old if s != newest and s not in protected]
    for s in removed:
        remove_step(root, s)
    saves = set()
    for name in os.listdir(root):
        m = _HIDDEN_STEP.match(name)
        if m and int(m.group(1)) <= newest:
            if m.group(2) == "del":  # an interrupted delete
                _remove(os.path.join(root, name))
            else:
                saves.add(int(m.group(1)))
    for s in sorted(saves):  # of saves: only those whose owner is gone
        remove_stale_temporaries(root, step_name(s))
    if removed:
        fsync_path(root)
    return removed


def references(root: str, step: int) -> set[str]:
    """Names of the checkpoints whose data files step ``step`` refers to (its manifest's
    ``bases``, as far as they can be read); empty when it has none or its manifest cannot be
    read (such a step cannot be loaded anyway)."""
    try:
        with open(os.path.join(step_path(root, step), MANIFEST_NAME), "rb") as f:
            return base_names(f.read())
    except OSError:
        return set()


def referenced_steps(root: str, kept: list[int]) -> set[int]:
    """The steps whose bytes the ``kept`` steps refer to, directly or through each other."""
    protected: set[int] = set()
    todo = list(kept)
    while todo:
        for name in references(root, todo.pop()):
            step = parse_step(name)
            if step is not None and step not in protected:
                protected.add(step)
                todo.append(step)
    return protected


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

"""The data directories of a data-parallel save (``save(..., data_dirs=[...])``): in each root, one
directory per save (a stripe, ``<prefix>.gds-<save id>``) that the ranks of a node write their
files into, and the files each rank wrote, removed again if the save fails before its commit.

Several saves of one path may run at once (the last to commit wins). Each rank holds a shared
``flock`` on its data directory's ``.lock`` file (created right after the directory) until the
save ended, so no other save's cleanup removes a live save's data directory (one without a lock
file yet is new: a directory without one is removed only once untouched for an hour). The
cleanup runs under the commit lock, so a directory whose lock is free belongs to a save that
committed before this one (replaced now) or never will; the committed checkpoint's own
directory is never removed.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..format import STRIPE_MARK
from ..transfer.commit import fsync_path, remove_tree
from ..transfer.locks import STALE_UNLOCKED_S, FileLock, acquire, try_acquire, untouched_for

STRIPE_LOCK = ".lock"  # in each data directory: held (shared) by the ranks writing into it


def stripe_prefix(path: str) -> str:
    """The first part of the names of ``path``'s data directories (then the save id)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path))[:100].lstrip(".-") or "ckpt"
    return f"{base}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


@dataclass
class RankFiles:
    """What one rank wrote in one data-parallel save, and the data directories it holds."""

    roots: Sequence[str]  # the data_dirs (absolute)
    timeout_s: float
    dirs: list[str] = field(default_factory=list)  # the data directories it created or entered
    locks: list[FileLock] = field(default_factory=list)  # shared, one per directory
    written: list[str] = field(default_factory=list)  # its files, in any directory

    def directory(self, d: int, tmp: str, stripe: str) -> str:
        """Where this rank writes the files of plan directory ``d`` (-1: the temporary checkpoint
        directory ``tmp``); a data directory is created once and held until the save ends."""
        directory = tmp if d < 0 else os.path.join(self.roots[d], stripe)
        if d >= 0 and directory not in self.dirs:
            os.makedirs(directory, exist_ok=True)
            self.dirs.append(directory)
            self.locks.append(acquire(
                os.path.join(directory, STRIPE_LOCK), shared=True, timeout_s=self.timeout_s,
                what=f"saving into {directory}"))
        return directory

    def writing(self, directory: str, names: Sequence[str]) -> None:
        """Record the files about to be written into ``directory`` (removed if the save fails)."""
        self.written += [os.path.join(directory, n) for n in names]

    def make_durable(self, d: int, directory: str) -> None:
        """After writing into plan directory ``d``: its new entries are durable before the
        commit (the directory itself, the root and the root's parent)."""
        if d >= 0:
            for entry in (directory, self.roots[d], os.path.dirname(self.roots[d])):
                fsync_path(entry)

    def release(self) -> None:
        """At the end of the save, failed or not: release the data directory locks."""
        while self.locks:
            self.locks.pop().release()

    def remove(self) -> None:
        """After a save failed before its commit: remove the files written, then the data
        directories whichever rank of each is the last to get here."""
        for f in self.written:
            try:
                os.unlink(f)
            except OSError:
                pass
        while self.locks:
            self.locks.pop().release(remove=True)  # the last holder deletes the lock file
        for d in self.dirs:
            try:
                os.rmdir(d)  # succeeds for whichever rank of the directory cleans up last
            except OSError:
                pass


def remove_stale_stripes(roots: Sequence[str], prefix: str, keep: str) -> list[str]:
    """After a commit, under its commit lock: remove this path's data directories other than
    ``keep`` whose lock is free (their save ended: replaced by this commit, or interrupted).
    A directory without a lock file (an older gds_persist's) goes once untouched for
    ``STALE_UNLOCKED_S``. Best effort; returns what was removed."""
    removed = []
    for root in roots:
        try:
            entries = os.listdir(root)
        except OSError:
            continue
        for entry in entries:
            full = os.path.join(root, entry)
            if not entry.startswith(prefix + STRIPE_MARK) or entry == keep:
                continue
            lock = try_acquire(os.path.join(full, STRIPE_LOCK))
            if lock is not None:  # its save ended; the lock file goes with the directory
                try:
                    if remove_tree(full):
                        removed.append(entry)
                finally:
                    lock.release()
            elif (not os.path.lexists(os.path.join(full, STRIPE_LOCK))
                  and untouched_for(full, STALE_UNLOCKED_S) and remove_tree(full)):
                removed.append(entry)
    return removed

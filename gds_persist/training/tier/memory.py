"""The node-memory tier of a :class:`~gds_persist.Checkpointer`: layout, room, retention.

::

    memory_root/<job>/
      rank-00003/step-00000042/     rank 3's share of step 42 (its data file + the whole manifest)
      replica-00001/step-00000042/  rank 1's share of step 42, copied here from another node
      replica-00001/.step-00000043.tmp-<id>/   a copy in progress (never loaded)

``memory_root`` is a tmpfs on the node (``/dev/shm/...``), so a step survives the training
process's death and is read back at memory speed by the restarted one; ``<job>`` is
``$GDS_PERSIST_JOB`` or derived from the drive root, so the restarted job finds it. Each rank
keeps its byte-range share of the replicated state (:mod:`.shares`: the drive save's split), with
the same atomic commit and CRC32C of every extent as the drive; a node's tier thus needs
``(1 + replicas) x state x ranks_on_node / world`` plus a manifest per share
(:func:`lacks_room`). Every directory keeps its latest complete step; the next one is written
beside it and the older is removed only once every rank has committed the new step and its
replicas (:meth:`MemoryStore.retain`), so a failure at any instant leaves one complete step.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from ...format.records import Wire
from .. import steps as _steps

JOB_ENV = "GDS_PERSIST_JOB"


def job_name(drive_root: str) -> str:
    """``$GDS_PERSIST_JOB``, else the drive root's name and a hash of its path: stable across
    restarts of one job, distinct for two jobs sharing a tmpfs."""
    env = os.environ.get(JOB_ENV)
    if env:
        return env
    digest = hashlib.sha1(os.path.abspath(drive_root).encode()).hexdigest()[:10]
    return f"{os.path.basename(drive_root.rstrip(os.sep)) or 'root'}-{digest}"


def lacks_room(needs: list[int], frees: list[int], nodes: list[str],
               holders: list[list[int]]) -> str | None:
    """Why the tier cannot take the next step (None when it can): ``needs[r]`` is rank r's share
    (:func:`.shares.share_bytes`); each node's free bytes must hold its ranks' shares plus the
    shares it keeps as replicas of other nodes' ranks (``holders``). Ranks on one node share
    its tmpfs, so they are counted together there."""
    want: dict[str, int] = {}
    for r, need in enumerate(needs):
        for holder in [r, *holders[r]]:
            want[nodes[holder]] = want.get(nodes[holder], 0) + need
    for r, node in enumerate(nodes):
        if frees[r] < want[node]:
            return (f"the memory tier of node {node!r} (rank {r}) has {frees[r] / 2**20:.0f} MiB "
                    f"free but its ranks' shares of the step and the replicas it keeps need "
                    f"{want[node] / 2**20:.0f} MiB there: "
                    "make the tmpfs larger (mount -o remount,size=...) or lower replicas=")
    return None


@dataclass(frozen=True)
class Holdings(Wire):
    """One level's committed steps on a rank: of its own share, and of the replicas it holds
    (by the rank whose share they are)."""

    own: list[int]
    replicas: dict[str, list[int]]


@dataclass(frozen=True)
class RankInventory(Wire):
    """What a rank tells the others before a restore: what each node-local level holds
    (nearest first), its node, the drive's steps."""

    levels: list[Holdings]
    node: str = ""
    drive: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Room(Wire):
    """What a rank tells the others before a memory step: its node, the room left in the
    node's tmpfs, its state's structure digest, the bytes of its rank-local part."""

    node: str
    free: int
    digest: str
    local: int
    flush_idle: bool = True  # no flush to the durable level in flight on this rank
    flush_retry: bool = False  # this rank's last flush failed (it is reported before idle)


@dataclass(frozen=True)
class MemoryStore:
    """One rank's view of its node's memory directory ``root`` (``memory_root/<job>``)."""

    root: str
    rank: int

    def rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"rank-{rank:05d}")

    def replica_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"replica-{rank:05d}")

    @property
    def own_dir(self) -> str:
        return self.rank_dir(self.rank)

    def own_step(self, step: int) -> str:
        return _steps.step_path(self.own_dir, step)

    def replica_step(self, rank: int, step: int) -> str:
        return _steps.step_path(self.replica_dir(rank), step)

    def free_bytes(self) -> int:
        os.makedirs(self.own_dir, exist_ok=True)
        st = os.statvfs(self.own_dir)
        return st.f_bavail * st.f_frsize

    def inventory(self) -> Holdings:
        """The committed steps here: this rank's own, and the replicas held by rank."""
        replicas: dict[str, list[int]] = {}
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            names = []
        for name in names:
            if name.startswith("replica-") and name[8:].isdigit():
                replicas[str(int(name[8:]))] = _steps.committed_steps(os.path.join(self.root,
                                                                                   name))
        return Holdings(_steps.committed_steps(self.own_dir), replicas)

    def retain(self, step: int, replicas_of: list[int], pinned: set[int] | None = None) -> None:
        """Every rank committed ``step`` and its replicas: drop the older steps (and anything
        newer, left by an abandoned timeline) of this rank's directory and of the replicas of
        ``replicas_of`` it holds; but the ``pinned`` ones (the durable level's flush needs
        them)."""
        for directory in [self.own_dir, *(self.replica_dir(r) for r in replicas_of)]:
            if not os.path.isdir(directory):
                continue
            for old in _steps.committed_steps(directory):
                if old < step and old not in (pinned or set()):
                    _steps.remove_step(directory, old)
            _steps.apply_retention(directory, step, None)  # newer steps, leftovers

"""What a :class:`~gds_persist.Checkpointer` is told about where steps go: the public
:class:`MemoryTier` (a level beside the drive, ``docs/RECOVERY.md``) and :class:`TierConfig`,
the typed record of the Checkpointer's arguments that :class:`~.tiers.Tiers` works from."""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any

from ..state.rank_local import KeyPath
from ..stores import refuse_url


@dataclass(frozen=True)
class LocalLevel:
    """A node-local level of a Checkpointer: ``Checkpointer(root, levels=[LocalLevel(...)])``.

    Every ``every`` steps each rank commits its byte-range share of the replicated state to
    the node-local directory ``root`` and copies it to ``copies`` ranks on other nodes, so the
    level survives the loss of a node; ``load()`` restores from the nearest verified copies
    and the durable ``root`` of the Checkpointer is flushed from the newest of them in the
    background (``docs/RECOVERY.md``).

    Parameters
    ----------
    root : path
        A node-local directory: a tmpfs (``/dev/shm/ckpt``) or the node's NVMe
        (``/local_nvme/ckpt``, written with O_DIRECT where the filesystem takes it); ``~`` is
        expanded.
    every : int
        Write every ``every``-th step to this level.
    copies : int, optional
        Copies of each share on ranks of other nodes (default: 1 where the group spans
        several nodes, else 0; the node is ``$GDS_PERSIST_NODE`` or the host name).
    peer_timeout_s : float
        Bound on each chunk of a copy to or from another rank, seconds.
    name : str, optional
        What stats and restores call the level (default: "memory" on a tmpfs, else "local";
        a second level of the same kind gets its position appended).
    """

    root: str | os.PathLike[str]
    every: int = 1
    copies: int | None = None
    peer_timeout_s: float = 60.0
    name: str | None = None

    def __post_init__(self) -> None:
        kind = type(self).__name__
        refuse_url(self.root, f"{kind}(root=...), a node-local directory,")
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(
            os.fspath(self.root))))
        if operator.index(self.every) < 1:
            raise ValueError(f"{kind}(every={self.every}) must be at least 1 (a step goes "
                             "to the level when its interval divides it)")
        if self.copies is not None and operator.index(self.copies) < 0:
            name = "replicas" if isinstance(self, MemoryTier) else "copies"
            raise ValueError(f"{kind}({name}={self.copies}) must be 0 or more")
        if not (math.isfinite(self.peer_timeout_s) and self.peer_timeout_s > 0):
            raise ValueError(f"{kind}(peer_timeout_s={self.peer_timeout_s}) must be "
                             "positive and finite (seconds)")

    @property
    def replicas(self) -> int | None:
        return self.copies


class MemoryTier(LocalLevel):
    """The memory level of a Checkpointer: ``Checkpointer(root, memory=MemoryTier(...))``, a
    :class:`LocalLevel` on a tmpfs whose copies are called ``replicas``.

    Parameters
    ----------
    root : path
        A node-local tmpfs directory (``/dev/shm/ckpt``); ``~`` is expanded.
    every : int
        Write every ``every``-th step to memory (the drive's interval is the Checkpointer's
        ``drive_every``).
    replicas : int, optional
        Copies of each share on ranks of other nodes (default: 1 where the group spans
        several nodes, else 0).
    peer_timeout_s : float
        Bound on each chunk of a copy to or from another rank, seconds.
    """

    def __init__(self, root: str | os.PathLike[str], every: int = 1,
                 replicas: int | None = None, peer_timeout_s: float = 60.0):
        super().__init__(root, every, replicas, peer_timeout_s, "memory")

    def __repr__(self) -> str:
        return (f"MemoryTier(root={self.root!r}, every={self.every}, replicas={self.copies}, "
                f"peer_timeout_s={self.peer_timeout_s})")


@dataclass
class TierConfig:
    """The Checkpointer's arguments about where each step goes and how it is saved there."""

    root: str
    levels: list[LocalLevel] = field(default_factory=list)  # node-local, nearest first
    drive_every: int = 1
    keep_last: int | None = 3
    backend: str | None = None  # of every save and load
    compression: str | None = None  # of the drive's saves (None: the setting)
    incremental: bool = False  # the drive's saves refer to the last committed step
    process_group: Any = None
    rank_local: list[KeyPath] = field(default_factory=list)  # key paths each rank keeps itself
    timeout_s: float = 1800.0


def check_levels(memory: MemoryTier | None, levels: Any, drive_every: int,
                 writer: str) -> list[LocalLevel]:
    """The Checkpointer's level arguments, checked (ValueError naming the fix): the node-local
    levels, nearest first (``memory=`` is the first)."""
    if memory is not None and not isinstance(memory, MemoryTier):
        raise TypeError(f"memory= takes gds_persist.MemoryTier(root=...), not a "
                        f"{type(memory).__name__}")
    given = list(levels or [])
    for level in given:
        if not isinstance(level, LocalLevel):
            raise TypeError(f"levels= takes a list of gds_persist.LocalLevel(root=..., "
                            f"every=...), not a {type(level).__name__}")
    out = ([memory] if memory is not None else []) + given
    roots = [level.root for level in out]
    if len(set(roots)) != len(roots):
        raise ValueError(f"two node-local levels share a directory ({roots}): give each "
                         "level a directory of its own")
    if operator.index(drive_every) < 1:
        raise ValueError(f"drive_every={drive_every} must be at least 1 (a step is written to "
                         "the drive when its interval divides it)")
    if not out and drive_every != 1:
        raise ValueError("drive_every is for a Checkpointer with node-local levels: pass "
                         "levels=[gds_persist.LocalLevel(root=DIR)] (a tmpfs such as "
                         "/dev/shm/ckpt, or the node's NVMe)")
    if out and writer == "process":
        raise ValueError("writer='process' writes only to the drive; node-local levels "
                         "(memory=, levels=) needs writer='thread'")
    return out

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
class MemoryTier:
    """The memory level of a Checkpointer: ``Checkpointer(root, memory=MemoryTier(...))``.

    Every ``every`` steps each rank commits its byte-range share of the replicated state to
    a node-local tmpfs and copies it to ``replicas`` ranks on other nodes; ``load()`` then
    restores from the nearest verified copies (``docs/RECOVERY.md``).

    Parameters
    ----------
    root : path
        A node-local tmpfs directory (``/dev/shm/ckpt``); ``~`` is expanded.
    every : int
        Write every ``every``-th step to memory (the drive's interval is the Checkpointer's
        ``drive_every``).
    replicas : int, optional
        Copies of each share on ranks of other nodes (default: 1 where the group spans
        several nodes, else 0; the node is ``$GDS_PERSIST_NODE`` or the host name).
    peer_timeout_s : float
        Bound on each chunk of a copy to or from another rank, seconds.
    """

    root: str | os.PathLike[str]
    every: int = 1
    replicas: int | None = None
    peer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        refuse_url(self.root, "MemoryTier(root=...), a node's memory,")
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(
            os.fspath(self.root))))
        if operator.index(self.every) < 1:
            raise ValueError(f"MemoryTier(every={self.every}) must be at least 1 (a step goes "
                             "to the memory tier when its interval divides it)")
        if self.replicas is not None and operator.index(self.replicas) < 0:
            raise ValueError(f"MemoryTier(replicas={self.replicas}) must be 0 or more")
        if not (math.isfinite(self.peer_timeout_s) and self.peer_timeout_s > 0):
            raise ValueError(f"MemoryTier(peer_timeout_s={self.peer_timeout_s}) must be "
                             "positive and finite (seconds)")


@dataclass
class TierConfig:
    """The Checkpointer's arguments about where each step goes and how it is saved there."""

    root: str
    memory: MemoryTier | None = None
    drive_every: int = 1
    keep_last: int | None = 3
    backend: str | None = None  # of every save and load
    compression: str | None = None  # of the drive's saves (None: the setting)
    incremental: bool = False  # the drive's saves refer to the last committed step
    process_group: Any = None
    rank_local: list[KeyPath] = field(default_factory=list)  # key paths each rank keeps itself
    timeout_s: float = 1800.0


def check_tiers(memory: MemoryTier | None, drive_every: int, writer: str) -> None:
    """The Checkpointer's tier arguments, checked (ValueError naming the fix)."""
    if memory is not None and not isinstance(memory, MemoryTier):
        raise TypeError(f"memory= takes gds_persist.MemoryTier(root=...), not a "
                        f"{type(memory).__name__}")
    if operator.index(drive_every) < 1:
        raise ValueError(f"drive_every={drive_every} must be at least 1 (a step is written to "
                         "the drive when its interval divides it)")
    if memory is None and drive_every != 1:
        raise ValueError("drive_every is for a Checkpointer with a memory tier: pass "
                         "memory=gds_persist.MemoryTier(root=DIR) (a tmpfs such as /dev/shm/ckpt)")
    if memory is not None and writer == "process":
        raise ValueError("writer='process' writes only to the drive; the memory tier "
                         "(memory=) needs writer='thread'")

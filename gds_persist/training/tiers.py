"""Where a Checkpointer's step goes and how it gets there: :class:`Tiers` (``docs/RECOVERY.md``).

Without a memory tier every step goes to the drive (``root``). With one (``memory=``) a
step goes to each tier whose interval divides it: ``MemoryTier.every``, this node's tmpfs with the
rank's copies on its replica holders (:mod:`.tier`), and ``drive_every``, the drive; a step in
neither is not written. A memory step for which some node's tmpfs lacks room goes to the drive
instead. On the drive one process writes, or every rank 1/N with a process group;
``incremental=True`` refers each save to the last committed step. A drive step counts once rank
0 has published it as ``latest`` and applied retention, and every rank has learnt the outcome.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .. import settings
from ..errors import CheckpointError, CheckpointTimeout, PeerLostError
from ..format import MANIFEST_NAME
from ..parallel.distributed import Comm
from ..parallel.topology import node_name
from ..results import SaveInfo
from ..saving.options import SaveOptions
from ..saving.save import save as core_save
from ..state.flatten import Flattened, flatten
from ..state.rank_local import KeyPath, Split, join, normalize_paths, split_rank_local, unjoin
from . import steps as _steps
from .handles import CheckpointerStats, Job, SaveHandle
from .helper import HelperProcess
from .options import TierConfig
from .tier.memory import MemoryStore, Room, lacks_room
from .tier.reading import Heal
from .tier.recovery import Restored
from .tier.replicate import holders, transfer
from .tier.shares import (
    check_same_structure,
    local_bytes,
    plan_shares,
    save_share,
    share_bytes,
    structure_digest,
)

log = logging.getLogger("gds_persist")


def check_rank_local(rank_local: Any, process_group: Any) -> list[KeyPath]:
    """The Checkpointer's ``rank_local`` key paths, normalized (ValueError naming the fix)."""
    paths = normalize_paths(rank_local)
    if paths and process_group is None:
        raise ValueError("rank_local= marks state that differs between ranks (ZeRO shards); "
                         "it needs the ranks' process_group= as well")
    return paths


class Tiers:
    """The write side of one Checkpointer: which tiers a step goes to, writing it there, and
    publishing a drive step. Runs in the writer thread (but for :meth:`of`, :meth:`path` and
    :meth:`skipped`); counts into ``stats`` under ``lock`` (the Checkpointer's).

    ``config``: the Checkpointer's arguments; ``memory``: this rank's memory-tier directory
    (None without one). ``helper``: ``writer="process"``'s helper, which writes the snapshots
    described in ``job.remote``. ``base_step``: the committed step the next incremental save
    refers to (the Checkpointer sets it on a load).
    """

    def __init__(self, config: TierConfig, comm: Comm, memory: MemoryStore | None, *,
                 helper: HelperProcess | None, stats: CheckpointerStats, lock: threading.RLock,
                 base_step: int | None):
        self.config = config
        self.root = config.root
        self.memory = memory
        tier = config.memory
        self.memory_every = tier.every if tier is not None else 1
        self.drive_every = config.drive_every
        self._replicas = tier.replicas if tier is not None else None
        self.peer_timeout_s = tier.peer_timeout_s if tier is not None else 60.0
        self.keep_last = config.keep_last
        self.incremental = config.incremental
        self.base_step = base_step
        self._comm = comm
        self._publisher = comm.rank == 0  # moves `latest` and removes old steps
        self._holders: list[list[int]] | None = None  # by rank: who keeps its replicas
        self._process_group = config.process_group
        self._helper = helper
        self._timeout_s = config.timeout_s
        self.rank_local = config.rank_local  # key paths each rank keeps for itself
        self._healer: threading.Thread | None = None  # rewriting copies a restore lacked
        self._heal_read: threading.Event | None = None  # set once they are written
        self._stats, self._lock = stats, lock

    def flatten(self, state: Any, allow_pickle: bool) -> Flattened:
        """The state as the writer takes it: with ``rank_local``, both parts joined in one."""
        if not self.rank_local:
            return flatten(state, allow_pickle)
        return join(Split(*split_rank_local(state, self.rank_local)))

    def _parts(self, flat: Flattened) -> tuple[Flattened, Flattened | None]:
        """A job's replicated and rank-local parts (None without ``rank_local``)."""
        if not self.rank_local:
            return flat, None
        split = unjoin(flat)
        return split.replicated, split.local

    # ---------------------------------------------------------------- where a step goes

    def of(self, step: int) -> tuple[str, ...]:
        """The tiers ``step`` goes to: "memory" and/or "drive" (none: it is not written)."""
        if self.memory is None:
            return ("drive",)
        return tuple(t for t, every in (("memory", self.memory_every),
                                        ("drive", self.drive_every)) if step % every == 0)

    def path(self, step: int, tiers: tuple[str, ...]) -> str:
        """Where the step's checkpoint lands: its step directory on the drive, or in this
        rank's memory when it goes to the memory tier only."""
        if "drive" in tiers or self.memory is None:
            return _steps.step_path(self.root, step)
        return self.memory.own_step(step)

    def skipped(self, step: int) -> SaveInfo:
        """The SaveInfo of a step in neither tier: nothing written, and why."""
        return SaveInfo(
            path="", backend="none", bytes_written=0, payload_bytes=0, seconds=0.0,
            tensors=0, storages=0, reason=f"step {step} is in neither tier (MemoryTier(every="
            f"{self.memory_every}), drive_every={self.drive_every}): not written")

    # ---------------------------------------------------------------- writing it there

    def write(self, job: Job, release: Callable[[], None]) -> SaveInfo:
        """Write the job's step to its tiers (the memory tier first); the SaveInfo of the last.
        A memory step without room adds "drive" to ``job.tiers`` and goes there. ``release``
        frees the job's tensors: called once a memory-only step's share is committed, before
        its replicas are copied (they are copied from the tmpfs)."""
        info = self._write_memory(job, release) if "memory" in job.tiers else None
        if info is None or "drive" in job.tiers:
            info = self._write_drive(job)
        return info

    def publish(self, h: SaveHandle) -> None:
        """After every rank's drive save of ``h`` has returned: rank 0 publishes it, and every
        rank learns the outcome, so no rank's handle is done before ``latest`` names the step."""
        self._comm.agree("publish", lambda: self._publish(h),
                         f"publishing step {h.step} under {self.root}")

    def committed(self, step: int, info: SaveInfo) -> None:
        """Count a published drive step; the next incremental save refers to it."""
        with self._lock:
            self._stats.committed += 1
            self._stats.write_s += info.seconds
            self._stats.bytes_written += info.bytes_written
            self._stats.bytes_referenced += info.referenced_bytes
            self.base_step = step

    def _write_memory(self, job: Job, release: Callable[[], None]) -> SaveInfo | None:
        """Commit every rank's share of the step to its node's memory and the shares' replicas
        to their holders; None (and the step goes to the drive instead) when some node's tmpfs
        lacks room."""
        assert self.memory is not None and job.flat is not None
        tier, step, comm = self.memory, job.handle.step, self._comm
        flat, local = self._parts(job.flat)
        self.join_heal()  # a restore's healing of this rank's copy ends before the next step
        room = Room(node_name(), tier.free_bytes(), structure_digest(flat), local_bytes(local))
        facts = [Room.from_wire(f)
                 for f in comm.all_gather_json(room.to_wire(), "memory tier room")]
        check_same_structure([f.digest for f in facts], step)
        nodes = [f.node for f in facts]
        self.replica_plan(nodes)
        assert self._holders is not None
        plan = plan_shares([st.nbytes for st in flat.storages], nodes)
        needs = [n + f.local for n, f in zip(share_bytes(plan), facts, strict=True)]
        why = lacks_room(needs, [f.free for f in facts], nodes, self._holders)
        if why is not None:
            log.warning("gds_persist.Checkpointer(%s): step %d goes to the drive: %s",
                        self.root, step, why)
            with self._lock:
                self._stats.memory_fallbacks += 1
                self._stats.memory_fallback_reason = why
            job.tiers = (*job.tiers, "drive") if "drive" not in job.tiers else job.tiers
            job.handle.path = _steps.step_path(self.root, step)
            return None
        t0 = time.perf_counter()
        info = save_share(comm, tier.own_step(step), flat, plan, self.config.backend, step, local)
        if "drive" not in job.tiers:  # what follows reads only the tmpfs: training may go on
            release()
        t1 = time.perf_counter()
        mine = self._holders[comm.rank]
        held = [r for r, hs in enumerate(self._holders) if comm.rank in hs]
        try:
            transfer(comm, {h: tier.own_step(step) for h in mine},
                     {r: tier.replica_step(r, step) for r in held}, f"replicas of step {step}",
                     self.peer_timeout_s)
        except PeerLostError as e:  # said at once: the handle raises it only at the next call
            log.error("gds_persist.Checkpointer(%s): PeerLostError: %s", self.root, e)
            raise
        comm.agree("memory retention", lambda: tier.retain(step, held),
                   f"memory-tier retention after step {step} under {tier.root}")
        with self._lock:
            s = self._stats
            s.memory_committed += 1
            s.memory_write_s += t1 - t0
            s.replicate_s += time.perf_counter() - t1
            s.replica_holders = list(mine)
            s.memory_share_bytes = info.bytes_written
        return info

    def replica_plan(self, nodes: list[str]) -> list[list[int]]:
        """By rank, the ranks keeping its replicas (fixed at the first call)."""
        if self._holders is None:
            count = self._replicas
            if count is None:  # default: one copy elsewhere, where there is an elsewhere
                count = min(1, len(set(nodes)) - 1)
            self._holders = holders(nodes, count)
        return self._holders

    # ---------------------------------------------------------------- healing after a restore

    def take(self, got: Restored) -> Any:
        """The restored state (the Restored lets go of it), its healing started."""
        state, got.state = got.state, None
        self.heal(got.heals)
        return state

    def heal(self, jobs: list[Heal]) -> None:
        """Rewrite the memory copies this rank keeps that its node lacked at a restore (its own
        share, the replicas it holds) in the background, straight from the restored state:
        ``guard``'s wait (:meth:`wait_heal_read`) holds the first update until they are
        written, and the next memory step waits for them (:meth:`join_heal`)."""
        if not jobs:
            return
        self.join_heal()
        done = self._heal_read = threading.Event()

        def run() -> None:
            try:
                _heal_all(jobs)
            finally:
                done.set()

        def _heal_all(jobs: list[Heal]) -> None:
            for job in jobs:
                t0 = time.perf_counter()
                try:
                    job.run()
                except Exception as e:  # noqa: BLE001 - a copy is only a cache: log, go on
                    log.warning("gds_persist.Checkpointer(%s): healing the memory copy %s "
                                "failed (%s: %s); the next memory step writes it anew",
                                self.root, job.path, type(e).__name__, e)
                    continue
                with self._lock:
                    self._stats.healed += 1
                    self._stats.heal_s += time.perf_counter() - t0

        self._healer = threading.Thread(target=run, name="gds_persist-heal", daemon=True)
        self._healer.start()

    def join_heal(self) -> None:
        if self._healer is not None:
            self._healer.join(self._timeout_s)
            self._healer = None

    def wait_heal_read(self, timeout: float | None = None) -> None:
        """Until the healing no longer reads the restored tensors (bounded; then it goes on)."""
        done = self._heal_read
        if done is not None and not done.wait(self._timeout_s if timeout is None else timeout):
            log.warning("gds_persist.Checkpointer(%s): healing the memory copies still reads "
                        "the restored state; the update goes on (the copy may fail its "
                        "checksums and is then written anew at the next memory step)", self.root)

    def _write_drive(self, job: Job) -> SaveInfo:
        """The step to ``root`` (the drive): one writer, or every rank 1/N with a group."""
        h = job.handle
        options = SaveOptions(compression=self.config.compression,
                              content_hash=True if self.incremental else None)
        base = self._base_for(h)
        if job.remote is not None:
            assert self._helper is not None
            try:  # the helper saves with the settings in force here (settings.set is per process)
                info = self._helper.write(
                    {**job.remote, "path": h.path, "settings": asdict(settings.current()),
                     "kwargs": {"backend": self.config.backend, "base": base, "options": options}},
                    self._timeout_s, f"writing step {h.step}")
            except TimeoutError as e:
                raise CheckpointTimeout(f"{e} (under {self.root}); raise "
                                        "Checkpointer(timeout_s=...) if the drive is slow"
                                        ) from None
        else:
            assert job.flat is not None
            state = unjoin(job.flat) if self.rank_local else job.flat
            info = core_save(state, h.path, backend=self.config.backend, base=base,  # flattened
                             process_group=self._process_group, options=options)  # at save()
        return info

    def _base_for(self, h: SaveHandle) -> str | None:
        """incremental=True: the committed step this save refers to (the last one this
        Checkpointer committed, or loaded, or found at start), if it is still there."""
        if not self.incremental or self.base_step is None:
            return None
        path = _steps.step_path(self.root, self.base_step)
        if path == h.path or not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            return None
        return path

    def _publish(self, h: SaveHandle) -> None:
        if not self._publisher:
            return
        try:
            _steps.write_latest(self.root, h.step)
            _steps.apply_retention(self.root, h.step, self.keep_last)
        except OSError as e:
            raise CheckpointError(
                f"step {h.step} was committed at {h.path}, but publishing it failed "
                f"(updating {self.root}/latest or removing old steps): {e}"
            ) from e

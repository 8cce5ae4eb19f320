"""Where a Checkpointer's step goes and how it gets there: :class:`Tiers` (``docs/RECOVERY.md``).

Without node-local levels every step goes to the drive (``root``, the durable level). With them
(``levels=``, ``memory=``) a step goes to each level whose interval divides it - the node's
directory with the rank's share, its copies on other nodes' ranks (:mod:`.tier`) - and, every
``drive_every`` steps, to the durable level: flushed in the background from the newest local
copy (:mod:`.tier.flush`), so training waits only for the local commit. A flush in flight when
the next is due makes that one wait for the next local step; a failed flush leaves the previous
durable step and is retried then. With ``rank_local``, ``incremental`` or compression the
durable level is written from the state, as without levels. A step for which every level lacks
room goes to the drive from the state. On the drive one process writes, or every rank 1/N with
a process group. A drive step counts once rank 0 has published it as ``latest`` and applied
retention, and every rank has learnt the outcome.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from .. import settings
from ..backends.posix import filesystem_type
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
from .durable import DurableFlushes
from .handles import CheckpointerStats, Job, SaveHandle
from .helper import HelperProcess
from .options import LocalLevel, TierConfig
from .tier.memory import MemoryStore, Room, job_name, lacks_room
from .tier.reading import Heal
from .tier.recovery import LevelView, Restored
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


class Level:
    """A node-local level as the writer holds it: its arguments, its name, this rank's
    directory of it, and who keeps each rank's copies (fixed at the first step)."""

    def __init__(self, spec: LocalLevel, name: str, store: MemoryStore):
        self.spec, self.name, self.store = spec, name, store
        self.holders: list[list[int]] | None = None

    @property
    def view(self) -> LevelView:
        return LevelView(self.name, self.store)

    def replica_plan(self, nodes: list[str]) -> list[list[int]]:
        """By rank, the ranks keeping its copies (fixed at the first call)."""
        if self.holders is None:
            count = self.spec.copies
            if count is None:  # default: one copy elsewhere, where there is an elsewhere
                count = min(1, len(set(nodes)) - 1)
            self.holders = holders(nodes, count)
        return self.holders


def level_names(levels: list[LocalLevel]) -> list[str]:
    """Each level's name: its own, else "memory" on a tmpfs and "local" elsewhere, with the
    position appended where two would be alike."""
    names = [level.name or ("memory" if _on_tmpfs(os.fspath(level.root)) else "local")
             for level in levels]
    return [n if names.count(n) == 1 else f"{n}{i + 1}" for i, n in enumerate(names)]


def _spans_world(process_group: Any) -> bool:
    """The group is every rank (the flusher's own group is made over the default group)."""
    if process_group is None or process_group == "default":
        return True
    import torch.distributed as dist

    return bool(dist.get_world_size(process_group) == dist.get_world_size())


def _on_tmpfs(directory: str) -> bool:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return filesystem_type(fd) in ("tmpfs", "ramfs")
    finally:
        os.close(fd)


class Tiers:
    """The write side of one Checkpointer: which levels a step goes to, writing it there,
    flushing the durable level, and publishing a drive step. Runs in the writer thread (but for
    :meth:`of`, :meth:`path` and :meth:`skipped`); counts into ``stats`` under ``lock`` (the
    Checkpointer's).

    ``config``: the Checkpointer's arguments. ``helper``: ``writer="process"``'s helper, which
    writes the snapshots described in ``job.remote``. ``base_step``: the committed step the next
    incremental save refers to (the Checkpointer sets it on a load).
    """

    def __init__(self, config: TierConfig, comm: Comm, *, helper: HelperProcess | None,
                 stats: CheckpointerStats, lock: threading.RLock, base_step: int | None):
        self.config = config
        self.root = config.root
        job = job_name(self.root)
        self.levels = [Level(spec, name, MemoryStore(os.path.join(spec.root, job), comm.rank))
                       for spec, name in zip(config.levels, level_names(config.levels),
                                             strict=True)]
        self.drive_every = config.drive_every
        self.keep_last = config.keep_last
        self.incremental = config.incremental
        self.base_step = base_step
        self._comm = comm
        self._publisher = comm.rank == 0  # moves `latest` and removes old steps
        self._process_group = config.process_group
        self._helper = helper
        self._timeout_s = config.timeout_s
        self.rank_local = config.rank_local  # key paths each rank keeps for itself
        self._healer: threading.Thread | None = None  # rewriting copies a restore lacked
        self._heal_read: threading.Event | None = None  # set once they are written
        self._stats, self._lock = stats, lock
        self.durable = (DurableFlushes(comm, config.process_group, self.root, config.backend,
                                       config.keep_last, config.timeout_s, self._share_dirs,
                                       stats, lock)
                        if self.levels and self.flushes(config) else None)

    @staticmethod
    def flushes(config: TierConfig) -> bool:
        """The durable level is flushed from the local copies (not written from the state):
        a flush copies the shares' files as they are, which no incremental, compressed or
        rank-local durable step is; and its group spans every rank (it is made collectively)."""
        return not (config.rank_local or config.incremental
                    or config.compression not in (None, "none")) and _spans_world(
                        config.process_group)

    @property
    def memory_every(self) -> int:
        return self.levels[0].spec.every if self.levels else 1

    @property
    def peer_timeout_s(self) -> float:
        return self.levels[0].spec.peer_timeout_s if self.levels else 60.0

    def replica_plan(self, nodes: list[str]) -> list[list[int]]:
        """By rank, the ranks keeping its copies in the nearest level."""
        return self.levels[0].replica_plan(nodes)

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
        """Where ``step`` goes: the names of its node-local levels and/or "drive" (none: it is
        not written)."""
        if not self.levels:
            return ("drive",)
        due = [(lv.name, lv.spec.every) for lv in self.levels] + [("drive", self.drive_every)]
        return tuple(name for name, every in due if step % every == 0)

    def path(self, step: int, tiers: tuple[str, ...]) -> str:
        """Where the step's checkpoint lands: this rank's directory of its nearest node-local
        level, else its step directory on the drive."""
        for lv in self.levels:
            if lv.name in tiers and (self.durable is not None or "drive" not in tiers):
                return lv.store.own_step(step)
        return _steps.step_path(self.root, step)

    def skipped(self, step: int) -> SaveInfo:
        """The SaveInfo of a step in no level: nothing written, and why."""
        every = ", ".join(f"{lv.name} every {lv.spec.every}" for lv in self.levels)
        return SaveInfo(
            path="", backend="none", bytes_written=0, payload_bytes=0, seconds=0.0,
            tensors=0, storages=0, reason=f"step {step} is in no level ({every}, "
            f"drive_every={self.drive_every}): not written")

    # ---------------------------------------------------------------- writing it there

    def write(self, job: Job, release: Callable[[], None]) -> SaveInfo:
        """Write the job's step to its node-local levels (nearest first), then flush or write
        the durable level; the SaveInfo of the nearest level written (or of the drive).
        ``release`` frees the job's tensors: called once the last level's share is committed
        when the drive is not written from them (flushes copy the levels' files)."""
        step = job.handle.step
        local = [lv for lv in self.levels if lv.name in job.tiers]
        due = "drive" in job.tiers
        from_state = due and (self.durable is None or self.durable.newest_local is None
                              and not local)
        written: list[Level] = []
        nearest: SaveInfo | None = None
        for i, lv in enumerate(local):
            last = i == len(local) - 1
            info = self._write_level(lv, job, release if last and not from_state else None,
                                     first=i == 0)
            if info is not None:
                written.append(lv)
                nearest = nearest or info
        if local and not written:  # every level lacked room: the drive, from the state
            from_state = True
        if from_state:
            if self.durable is not None:  # one writer of the durable level at a time
                self.durable.yield_to_a_save(step, self._timeout_s)
            job.tiers = (*job.tiers, "drive") if not due else job.tiers
            job.handle.path = _steps.step_path(self.root, step)
            return self._write_drive(job)
        job.tiers = tuple(t for t in job.tiers if t != "drive")  # flushed, not published here
        if self.durable is not None:
            self.durable.after_step(step, bool(written), due)
        if nearest is None and due and self.durable is not None:
            return replace(self.skipped(step), reason=(
                f"step {step} is in no node-local level: the durable level is flushed from "
                f"step {self.durable.newest_local}'s local copies in the background"))
        return nearest if nearest is not None else self.skipped(step)

    def _share_dirs(self, step: int) -> list[str]:
        """This rank's committed copies of its share of ``step``, nearest level first."""
        return [lv.store.own_step(step) for lv in self.levels
                if step in lv.store.inventory().own]

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

    def _write_level(self, lv: Level, job: Job, release: Callable[[], None] | None,
                     first: bool) -> SaveInfo | None:
        """Commit every rank's share of the step to its node's directory of ``lv`` and the
        shares' copies to their holders; None (the level skips the step) when some node lacks
        room. ``first``: the job's first level, whose facts also say every rank's flusher state."""
        assert job.flat is not None
        tier, step, comm = lv.store, job.handle.step, self._comm
        flat, local = self._parts(job.flat)
        if lv is self.levels[0]:
            self.join_heal()  # a restore's healing of this rank's copy ends before the next step
        idle, failed = self.durable.flags() if self.durable is not None else (True, False)
        room = Room(node_name(), tier.free_bytes(), structure_digest(flat), local_bytes(local),
                    idle, failed)
        facts = [Room.from_wire(f)
                 for f in comm.all_gather_json(room.to_wire(), f"{lv.name} level room")]
        check_same_structure([f.digest for f in facts], step)
        if first and self.durable is not None:
            self.durable.gathered([(f.flush_idle, f.flush_retry) for f in facts])
        nodes = [f.node for f in facts]
        plan_of = lv.replica_plan(nodes)
        plan = plan_shares([st.nbytes for st in flat.storages], nodes)
        needs = [n + f.local for n, f in zip(share_bytes(plan), facts, strict=True)]
        why = lacks_room(needs, [f.free for f in facts], nodes, plan_of)
        if why is not None:
            log.warning("gds_persist.Checkpointer(%s): step %d skips the %s level: %s",
                        self.root, step, lv.name, why)
            with self._lock:
                self._stats.memory_fallbacks += 1
                self._stats.memory_fallback_reason = why
            return None
        t0 = time.perf_counter()
        info = save_share(comm, tier.own_step(step), flat, plan, self.config.backend, step, local)
        if release is not None:  # what follows reads only the level's files: training goes on
            release()
        t1 = time.perf_counter()
        mine = plan_of[comm.rank]
        held = [r for r, hs in enumerate(plan_of) if comm.rank in hs]
        try:
            transfer(comm, {h: tier.own_step(step) for h in mine},
                     {r: tier.replica_step(r, step) for r in held}, f"copies of step {step}",
                     lv.spec.peer_timeout_s)
        except PeerLostError as e:  # said at once: the handle raises it only at the next call
            log.error("gds_persist.Checkpointer(%s): PeerLostError: %s", self.root, e)
            raise
        pinned = self.durable.pinned() if self.durable is not None else set()
        comm.agree(f"{lv.name} retention", lambda: tier.retain(step, held, pinned),
                   f"{lv.name}-level retention after step {step} under {tier.root}")
        self._count_level(lv, info, t1 - t0, time.perf_counter() - t1, mine)
        return info

    def _count_level(self, lv: Level, info: SaveInfo, write_s: float, copy_s: float,
                     holders_of_mine: list[int]) -> None:
        with self._lock:
            s = self._stats
            s.memory_committed += 1
            s.memory_write_s += write_s
            s.replicate_s += copy_s
            s.replica_holders = list(holders_of_mine)
            s.memory_share_bytes = info.bytes_written
            s.level_commits[lv.name] = s.level_commits.get(lv.name, 0) + 1

    # ---------------------------------------------------------------- the durable level

    def finish_flush(self, timeout: float, final: bool) -> None:
        """Once the writer is idle: the last flush (:meth:`DurableFlushes.finish`), then the
        steps the levels kept only for a flush are let go."""
        if self.durable is None:
            return
        self.durable.finish(timeout, final)
        for lv in self.levels:
            own = lv.store.inventory().own
            if lv.holders is None or not own:
                continue
            held = [r for r, hs in enumerate(lv.holders) if self._comm.rank in hs]
            try:
                lv.store.retain(own[-1], held, self.durable.pinned())
            except OSError as e:  # the steps stay; the next level step removes them
                log.warning("gds_persist.Checkpointer(%s): retention of the %s level: %s",
                            self.root, lv.name, e)

    def stop_flusher(self, timeout: float) -> None:
        if self.durable is not None:
            self.durable.stop(timeout)

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

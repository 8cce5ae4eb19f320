"""The one save sequence. Every way of saving runs it; what differs is a :class:`Layout` beside
it (which bytes go where, what the seal records), as DCP's planner sits beside its storage writer.

Phases, alone or with a process group (:meth:`~gds_persist.parallel.distributed.Comm.agree`
closes each, so a failure on any rank is raised on every rank, naming it, and nothing is
committed; one process runs the same phases without collectives):

1. ``prepare``: each rank describes its state (:meth:`Layout.prepare`); the committing ranks
   ``begin`` (a temporary directory or file beside the path, :mod:`gds_persist.transfer.commit`).
2. ``plan``: from every rank's facts, the same plan on every rank (:meth:`Layout.plan`).
3. ``write``: each rank writes and fsyncs its share, and reports it (:meth:`Layout.write`).
4. ``commit``: the committing ranks seal (:meth:`Layout.seal`: the manifest out of every rank's
   report, or a file's tail; the written checksums checked against the state at ``save``) and
   commit atomically; every rank returns only once that is durable.
5. ``cleanup`` (best effort, after the commit), then every rank releases what it held.

A failure before the commit removes the temporary directory; the previous checkpoint at the path
is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .. import settings
from ..errors import DiskFullError
from ..format import Manifest
from ..format.records import Wire
from ..parallel.distributed import Comm, SoloComm, make_comm
from ..stages import stage
from ..stores import commit as objects
from ..stores.urls import is_url
from ..transfer.commit import Temporary, abort, begin, seal

Facts = TypeVar("Facts", bound=Wire)
R = TypeVar("R", bound=Wire)
Report = TypeVar("Report", bound=Wire)


@dataclass(frozen=True)
class Began(Wire):
    """What a committing rank's ``begin`` tells the others: where the save is being written."""

    tmp: str = ""  # the temporary directory ('' on ranks that did not begin)
    save_id: str = ""


@dataclass(frozen=True)
class Prepared(Wire):
    """What every rank tells the others in ``prepare``: its layout's facts (their wire form;
    the layout decodes them) and what it began."""

    facts: Any
    began: Began


@dataclass
class Run:
    """One save in progress, as this rank sees it; what the layout's methods are given."""

    path: str
    comm: Comm
    cfg: settings.Settings
    what: str  # "gds_persist save of PATH (rank R of N)": the subject of every error
    intact: str  # what a failure means for the path
    t0: float = field(default_factory=time.perf_counter)
    # this rank's temporary (a directory, or an object store's data prefix), where it committed
    # or will commit
    tmp: Temporary | objects.ObjectTarget | None = None
    began: list[Began] = field(default_factory=list)  # every rank's, after prepare
    reports: list[Any] = field(default_factory=list)  # every rank's, after write
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase on this rank
    committing: bool = False  # from then on a failure may come after the rename
    needs: str = ""  # set by the plan: what the save needs, for a full filesystem's error
    _clock: float = 0.0

    def agree(self, phase: str, step: Any, outcome: str | None = None) -> list[Any]:
        """``step`` run on every rank, outcomes exchanged; a failure anywhere raises here."""
        return self.comm.agree(phase, step, self.what, self.intact if outcome is None else outcome)

    def exchange(self, phase: str, step: Callable[[], R], kind: type[R]) -> list[R]:
        """:meth:`agree` for a step that returns a :class:`Wire` record: every rank's record
        (alone, this rank's as it is: nothing crosses a process)."""
        if isinstance(self.comm, SoloComm):
            return self.agree(phase, step)
        return [kind.from_wire(r) for r in self.agree(phase, lambda: step().to_wire())]

    def tick(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - (self._clock or self.t0)
        self._clock = now

    @property
    def first(self) -> Began:
        """What rank 0 began (the temporary directory every rank of a shared save writes to)."""
        return self.began[0]


class Layout(Generic[Facts, Report]):
    """Which bytes go where and what the seal records, for one way of saving.

    The sequence calls, in order: :meth:`prepare` (every rank), :meth:`begin` (committing ranks),
    :meth:`plan` (every rank, with every rank's facts), :meth:`write` (every rank), :meth:`seal`
    and :meth:`commit` (committing ranks, with every rank's report), :meth:`cleanup`, then
    :meth:`info`; after a failure :meth:`abandon`, and at the end :meth:`release`.
    """

    facts_type: type[Wire] | None  # None: nothing to exchange before writing (the plan is
    # given): ``begin`` and ``write`` then run in one agreed phase, saving a round trip
    report_type: type[Wire]
    every_rank_commits = False  # True: each rank commits a target of its own (memory shares)
    replace = True  # False: refuse to replace a checkpoint at the path (checked under the lock)

    def prepare(self, run: Run) -> Facts:
        raise NotImplementedError

    def begin(self, run: Run) -> Temporary | objects.ObjectTarget:
        """This rank's temporary target: by default a temporary checkpoint directory (a URL:
        this save's data prefix in the object store, :mod:`gds_persist.stores.commit`)."""
        if is_url(run.path):
            return objects.begin(run.path, self.replace)
        return begin(run.path, run.cfg.io_timeout_s)

    def plan(self, run: Run, facts: list[Facts]) -> None:
        raise NotImplementedError

    def write(self, run: Run) -> Report:
        raise NotImplementedError

    def seal(self, run: Run, reports: list[Report]) -> Any:
        """What the commit records (a :class:`Manifest` for a directory), built from every
        rank's report, after checking that the written bytes are those of the state at save."""
        raise NotImplementedError

    def commit(self, run: Run, sealed: Any) -> None:
        """Make ``sealed`` durable and visible atomically (default: a directory's manifest)."""
        assert run.tmp is not None and isinstance(sealed, Manifest)
        if isinstance(run.tmp, objects.ObjectTarget):  # the manifest object, written last
            objects.seal(run.tmp, sealed, self.replace)
            return
        # the commit lock stays held until the sequence ends: cleanup() runs under it
        seal(run.tmp, sealed, run.cfg.io_timeout_s, self.replace, check=run.comm.size > 1,
             keep_lock=True)

    def cleanup(self, run: Run) -> None:
        """After the commit, best effort: what other saves left (e.g. stale data directories)."""

    def abandon(self, run: Run) -> None:
        """After a failure: remove what this rank wrote outside its temporary target."""

    def release(self, run: Run, committed: bool) -> None:
        """At the end, failed or not: locks this rank holds."""

    def info(self, run: Run) -> Any:
        """What the save returns (a :class:`SaveInfo` for ``gds_persist.save``)."""
        raise NotImplementedError


def run_save(layout: Layout[Any, Any], path: str, comm: Comm | None = None, *,
             cfg: settings.Settings, process_group: Any = None, what: str = "") -> Any:
    """Run the save sequence of ``layout`` for ``path`` on this rank (see the module docstring);
    every rank of ``process_group`` (or ``comm``) calls it."""
    comm = comm or make_comm(process_group, cfg.collective_timeout_s)
    run = Run(path, comm, cfg, what or f"gds_persist save of {path}"
              + (f" (rank {comm.rank} of {comm.size})" if comm.size > 1 else ""),
              f"; nothing was committed and any previous checkpoint at {path} is intact")
    committed = False
    try:
        with _disk_full(run):
            if layout.facts_type is not None:
                _prepare_and_plan(layout, run)
            run.reports = run.exchange("write", lambda: _write(layout, run), layout.report_type)
            run.tick("write")
            run.committing = True
            run.agree("commit", lambda: _seal_and_commit(layout, run),
                      f"; the commit failed, so any previous checkpoint at {path} is intact")
        committed = True
        run.tick("commit")
        layout.cleanup(run)
    except BaseException:
        if not committed:
            if isinstance(run.tmp, objects.ObjectTarget):
                run.tmp.finish()  # its objects go; never the committed checkpoint's
            elif run.tmp is not None:
                abort(run.tmp)  # never holds the new checkpoint once it was renamed into place
            if not run.committing:
                layout.abandon(run)
        raise
    finally:
        layout.release(run, committed)
        if committed and run.tmp is not None:
            run.tmp.finish()
    return layout.info(run)


def begin_driven(layout: Layout[Any, Any], path: str, cfg: settings.Settings, what: str) -> Run:
    """For a framework that runs the phases and the agreement itself (DCP: its planner's
    gather and scatter): the committing rank's ``begin``; :func:`finish_driven` ends the run."""
    run = Run(path, make_comm(None, cfg.collective_timeout_s), cfg, what, "")
    run.tmp = layout.begin(run)
    run.began = [Began(run.tmp.dir)]
    return run


def finish_driven(layout: Layout[Any, Any], run: Run, reports: list[Any]) -> None:
    """The committing rank's seal and commit of a run :func:`begin_driven` began; on failure
    the temporary target goes and the previous checkpoint stays."""
    assert run.tmp is not None
    run.reports = reports
    try:
        _seal_and_commit(layout, run)
    finally:
        run.tmp.finish()  # after the commit: releases the lock, removes what was replaced


def _prepare_and_plan(layout: Layout[Any, Any], run: Run) -> None:
    def prepare() -> Prepared:
        facts = layout.prepare(run)
        began = Began()
        if layout.every_rank_commits or run.comm.rank == 0:
            with stage("begin (temporary directory)"):
                run.tmp = layout.begin(run)
            began = Began(run.tmp.dir, uuid.uuid4().hex[:12])
        return Prepared(facts if isinstance(run.comm, SoloComm) else facts.to_wire(), began)

    kind = layout.facts_type
    assert kind is not None
    gathered = run.exchange("prepare", prepare, Prepared)
    run.began = [g.began for g in gathered]
    run.tick("prepare")
    layout.plan(run, [kind.from_wire(g.facts) if isinstance(g.facts, dict) else g.facts
                      for g in gathered])
    run.tick("plan")


def _write(layout: Layout[Any, Any], run: Run) -> Wire:
    if layout.facts_type is None:  # begin here: nothing was exchanged before
        run.tmp = layout.begin(run)
        run.began = [Began(run.tmp.dir)]
    return layout.write(run)


def _seal_and_commit(layout: Layout[Any, Any], run: Run) -> None:
    if run.tmp is None:  # a rank that only writes
        return
    sealed = layout.seal(run, run.reports)
    with stage("commit (manifest, fsync, rename)"):
        layout.commit(run, sealed)


@contextlib.contextmanager
def _disk_full(run: Run) -> Iterator[None]:
    """A full filesystem (ENOSPC) as :class:`DiskFullError`, saying that nothing was lost."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise DiskFullError(
            errno.ENOSPC, f"no space left on the filesystem of {run.path}: {run.needs}free "
            "space or save "
            "elsewhere (the partial save was removed and earlier checkpoints are untouched)",
        ) from e

"""The flush: a step already committed in node-local levels, written to the durable level
(the Checkpointer's ``root``: a shared directory or an object store) from the newest local
copy, not from the live state (SCR's flush), in the background.

Each rank committed its byte-range share of the step (:mod:`.shares`) into one or more local
levels: ``<level>/<job>/rank-R/step-N/`` holds its data file ``data-r<R>-00000.bin`` and the
manifest of the *whole* step (every rank's extents, identical bytes on every rank). A flush is
a :class:`~gds_persist.saving.sequence.Layout` on the one save sequence, so it is atomic as
every save is (a temporary directory renamed into place, or data objects then the manifest
object); the durable step is every rank's data file, byte for byte, plus that same manifest:

1. ``prepare``: each rank reads the manifest of each of its copies (nearest first) and says
   which it holds (SHA-256 of the bytes) or why a copy is unusable;
2. ``plan``: the manifest every rank holds is the step's (the first of rank 0's copies that
   every rank has); each rank keeps its copies of that manifest, in order;
3. ``write``: each rank writes its copies' data file, in order, until one verifies: the file
   mmap'd as one storage goes through the engine's writer (bounded memory: its staging ring),
   which checksums every extent as it passes, so the bytes checked against the manifest's
   CRC32C are the bytes written, in one pass; a copy whose bytes changed since its commit is
   passed over (its file removed from the durable step); no copy verifies: the flush fails on
   every rank, naming each copy and why, and nothing is committed;
4. ``commit``: rank 0 commits that manifest (in an object store it also names its objects).

:func:`publish` then points ``latest`` at the step and applies retention (after the commit:
an old step goes only once a newer one is committed). :class:`Flusher` runs flushes one at a
time on a thread and a process group of its own; a failed flush is recorded, never raised into
training, and the caller flushes again at its next chance.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from ... import settings
from ...errors import CheckpointError
from ...format import MANIFEST_NAME, Extent, Manifest, parse_manifest
from ...format.layout import FilePlan
from ...format.records import Wire
from ...parallel.distributed import Comm, background_group, make_comm
from ...results import SaveInfo
from ...saving.sequence import Layout, Run, run_save
from ...saving.units import backend_for, with_fallback
from ...stores.io import object_settings
from ...stores.urls import is_url
from ...transfer.writer import write_plan
from .. import steps as _steps
from .shares import LOCAL_DIR, SHARES_MARK, share_files

log = logging.getLogger("gds_persist")

DOC = "docs/RECOVERY.md, \"What survives which failure\""


@dataclass(frozen=True)
class Copy(Wire):
    """One local copy of a rank's share as ``prepare`` found it."""

    dir: str
    digest: str  # SHA-256 of its manifest's bytes; "" where the copy is unusable
    why: str = ""  # why it is unusable


@dataclass(frozen=True)
class Copies(Wire):
    """What a rank tells the others in ``prepare``: its copies, nearest first."""

    copies: list[Copy]


@dataclass(frozen=True)
class Flushed(Wire):
    """What a rank tells the others once its data file is written and fsynced."""

    name: str  # the data file written ('' where the rank holds none)
    size: int
    source: str  # the copy it came from
    passed_over: list[str]  # copies not used, and why
    backend: str
    reason: str


class FlushLayout(Layout[Copies, Flushed]):
    """A committed step's shares, copied from node-local levels into the durable step (see the
    module docstring)."""

    facts_type, report_type = Copies, Flushed

    def __init__(self, share_dirs: list[str], step: int,
                 progress: Callable[[int], None] | None = None):
        self.share_dirs, self.step, self.progress = list(share_dirs), step, progress
        self.manifests: dict[str, tuple[bytes, Manifest]] = {}
        self.mine: list[str] = []
        self.passed_over: list[str] = []
        self.file: int | None = None

    def prepare(self, run: Run) -> Copies:
        return Copies([self._inspect(d) for d in self.share_dirs])

    def _inspect(self, share_dir: str) -> Copy:
        where = os.path.join(share_dir, MANIFEST_NAME)
        try:
            with open(where, "rb") as f:
                raw = f.read()
            m = parse_manifest(raw, where)
        except OSError as e:
            return Copy(share_dir, "", f"no committed manifest ({e.strerror or e})")
        except CheckpointError as e:
            return Copy(share_dir, "", str(e).splitlines()[0])
        if m.writer.get("layout") != SHARES_MARK:
            return Copy(share_dir, "", "not a memory-tier share (its manifest's writer record "
                                       f"has layout {m.writer.get('layout')!r})")
        if os.path.isdir(os.path.join(share_dir, LOCAL_DIR)):
            return Copy(share_dir, "", "it holds a rank-local part, which a flush does not "
                                       "carry to the durable level")
        digest = hashlib.sha256(raw).hexdigest()
        self.manifests[digest] = (raw, m)
        return Copy(share_dir, digest)

    def plan(self, run: Run, facts: list[Copies]) -> None:
        digest = _common_manifest(facts, self.step, run)
        _, m = self.manifests[digest]
        if m.writer.get("world_size") != run.comm.size:
            raise CheckpointError(
                f"{run.what}: step {self.step}'s shares were written by "
                f"{m.writer.get('world_size')} ranks, but {run.comm.size} flush them; flush a "
                f"step with the ranks that committed it ({DOC}){run.intact}")
        self.manifest = m
        own = facts[run.comm.rank].copies
        self.mine = [c.dir for c in own if c.digest == digest]
        self.passed_over = [f"{c.dir}: {c.why or 'it holds another step (its manifest differs)'}"
                            for c in own if c.digest != digest]
        self.file = share_files(m).get(run.comm.rank)

    def write(self, run: Run) -> Flushed:
        if self.file is None:
            return Flushed("", 0, "", self.passed_over, "none", "this rank holds no data file")
        f = self.manifest.files[self.file]
        extents = [e for e in self.manifest.extents if e.file == self.file]
        problems = list(self.passed_over)
        for share_dir in self.mine:
            path = os.path.join(share_dir, f.name)
            with _mapped(path, f.size) as (data, unusable):
                if unusable:
                    problems.append(f"{share_dir}: {unusable}")
                    continue
                be, reason, wrong = _copy(run, f.name, f.size, data, extents, self.progress)
            if wrong:
                problems.append(f"{share_dir}: {wrong}")
                continue
            return Flushed(f.name, f.size, share_dir, problems, be, reason)
        # said first, whole: a peer's error reaches the other ranks as its first 500 characters
        raise CheckpointError(
            f"no local copy of rank {run.comm.rank}'s share of step {self.step} verifies: "
            f"{'; '.join(problems) or 'no copies given'}{run.intact}; flush a later step "
            f"once it is committed locally ({DOC})")

    def seal(self, run: Run, reports: list[Flushed]) -> Manifest:
        """The step's own manifest, once every data file it names was written."""
        written = {r.name for r in reports if r.name}
        missing = [f.name for f in self.manifest.files if f.name not in written]
        if missing:
            raise CheckpointError(f"{run.what}: no rank wrote {', '.join(missing)} of step "
                                  f"{self.step} ({DOC}){run.intact}")
        return self.manifest

    def info(self, run: Run) -> SaveInfo:
        mine = run.reports[run.comm.rank]
        m = self.manifest
        used = f"; copied from {mine.source}" if mine.source else ""
        over = f"; passed over {'; '.join(mine.passed_over)}" if mine.passed_over else ""
        return SaveInfo(path=run.path, backend=mine.backend, reason=mine.reason + used + over,
                        bytes_written=mine.size,
                        payload_bytes=sum(e.length for e in m.extents if e.file == self.file),
                        seconds=time.perf_counter() - run.t0, tensors=len(m.tensors),
                        storages=len(m.storages), files=[mine.name] if mine.name else [])


def _common_manifest(facts: list[Copies], step: int, run: Run) -> str:
    """The manifest every rank holds a copy of: the first such of rank 0's copies."""
    held = [{c.digest for c in f.copies if c.digest} for f in facts]
    for c in facts[0].copies:
        if c.digest and all(c.digest in h for h in held):
            return c.digest
    said = "; ".join(f"rank {r}: " + (", ".join(f"{c.dir} ({c.why or 'manifest ' + c.digest[:12]})"
                                                for c in f.copies) or "no copies given")
                     for r, f in enumerate(facts))
    raise CheckpointError(
        f"{run.what}: the ranks hold no common committed copy of step {step} ({said}); "
        f"flush a step every rank has committed ({DOC}){run.intact}")


@contextmanager
def _mapped(path: str, size: int) -> Iterator[tuple[memoryview, str]]:
    """``path`` mapped (private, copy on write: a writable buffer for the writer's storage, and
    nothing written back); the second item not empty where it cannot be (the view then empty)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        yield memoryview(b""), f"{os.path.basename(path)}: {e.strerror or e}"
        return
    try:
        have = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if have == size and size else None
    finally:
        os.close(fd)
    if mm is None:
        yield memoryview(b""), (f"{os.path.basename(path)} holds {have} bytes, its manifest "
                                f"says {size}")
        return
    view = memoryview(mm)
    try:
        yield view, ""
    finally:
        try:
            view.release()
            mm.close()
        except BufferError:
            pass  # a tensor on it is still referenced: unmapped when it is collected


def _copy(run: Run, name: str, size: int, data: memoryview, extents: list[Extent],
          progress: Callable[[int], None] | None) -> tuple[str, str, str]:
    """Write the local data file ``data`` as data file ``name`` of the durable step through the
    engine's writer, which checksums every extent as it passes: what differs from the manifest
    (the bytes changed since their commit) is said, and the file written is removed. One pass:
    the bytes checked are the bytes written. The gaps between extents are written as zeros, as
    the share's save wrote them."""
    target = run.first.tmp
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    try:
        be, reason = backend_for(run.cfg, target, [storage])
        # the file as one storage: each extent's bytes are at its own offset
        ordered = sorted(extents, key=lambda e: e.offset)
        plan = FilePlan(name, size, tuple(replace(e, storage=0, start=e.offset, crc32c=0)
                                          for e in ordered))
        sealed = write_plan(be, target, [plan], [storage], run.cfg, progress)
    finally:
        del storage  # the mapping closes once no tensor refers to it
    wrong = [(e, got.crc32c) for e, got in zip(ordered, sealed, strict=True)
             if got.crc32c != e.crc32c]
    if not wrong:
        return be.name, with_fallback(be, reason), ""
    if not is_url(target):  # an object is replaced by the next copy's; a file is not
        os.unlink(os.path.join(target, name))
    e, got = wrong[0]
    return "", "", (f"CRC32C mismatch in bytes {e.offset}..{e.offset + e.length} ({got:08x}, "
                    f"the manifest says {e.crc32c:08x})")


def flush_step(comm: Comm, share_dirs: list[str], durable_path: str, step: int,
               backend: str | None = None,
               progress: Callable[[int], None] | None = None) -> SaveInfo:
    """Every rank: write step ``step`` to ``durable_path`` from this rank's committed local
    copies of its share, atomically (see the module docstring).

    Parameters:
        comm: the ranks that committed the step's shares (a ``SoloComm`` for one process).
        share_dirs: this rank's committed copies of its own share of ``step`` (each a
            ``rank-R/step-N`` directory), nearest first: the first that verifies is written.
        durable_path: the durable step: a directory, or an ``s3://`` URL.
        step: the step, for messages.
        backend: the write backend (``None``: the ``backend`` setting).
        progress: called with each count of bytes written, from the I/O threads.

    Returns:
        This rank's :class:`~gds_persist.SaveInfo` (its ``reason`` names the copy used and
        those passed over).

    Raises:
        CheckpointError: on every rank, where any rank's copies all fail (each named, with
            why) or the durable level fails; nothing is committed and the previous durable
            step is intact.
    """
    cfg = settings.current(backend=backend)
    if is_url(durable_path):
        cfg = object_settings(cfg)
    return run_save(FlushLayout(share_dirs, step, progress), durable_path, comm, cfg=cfg,
                    what=f"flush of step {step} to {durable_path}"
                    + (f" (rank {comm.rank} of {comm.size})" if comm.size > 1 else ""))


def publish(comm: Comm, root: str, step: int, keep_last: int | None) -> list[int]:
    """Every rank, after :func:`flush_step` committed ``step`` under ``root``: rank 0 points
    ``latest`` at it, then applies retention (a directory or an object-store root); every rank
    learns the outcome. Returns the steps removed.

    Parameters:
        comm: the ranks of the flush.
        root: the durable level's root (a directory or an ``s3://`` URL).
        step: the step just committed there.
        keep_last: how many committed steps to keep (``None``: all).
    """
    def run() -> list[int]:
        if comm.rank != 0:
            return []
        try:
            _steps.write_latest(root, step)
            return _steps.apply_retention(root, step, keep_last)
        except OSError as e:
            raise CheckpointError(f"step {step} was flushed to {_steps.step_path(root, step)}, "
                                  f"but publishing it failed (updating {root}/latest or "
                                  f"removing old steps): {e}") from e

    return comm.agree("publish flush", run, f"publishing the flushed step {step} under {root}",
                      "; the step is committed, and the next flush publishes again")[0]


@dataclass
class FlushStats:
    """What this rank's flushes did (read and written under the caller's lock).

    Attributes:
        flushed: flushes committed (and published).
        last_step: the newest step flushed (None: none yet).
        bytes_written: this rank's bytes written to the durable level, all flushes.
        seconds: wall time of the committed flushes, publishing included.
        failures: flushes that failed (each left the previous durable step intact).
        last_error: why the last failure failed ('' where none did).
        failed_step: the step of the last failure (None: none).
    """

    flushed: int = 0
    last_step: int | None = None
    bytes_written: int = 0
    seconds: float = 0.0
    failures: int = 0
    last_error: str = ""
    failed_step: int | None = None


BACKGROUND_NICE = 10  # how much lower the flush's threads run than training's


def _yield_cores() -> None:
    """Lower this thread's CPU priority (Linux: nice is per thread, and the I/O threads it
    starts inherit it), so that a flush takes the cores training leaves idle rather than
    stretching its iterations; where that is not allowed, it runs as it is."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (OSError, AttributeError):
        pass


class Flusher:
    """Flushes steps one at a time on a thread of its own, with a process group of its own
    (``background_group``: the training thread's collectives never pair with its own), each
    followed by :func:`publish`. A flush that fails is counted in ``stats`` with why; it never
    raises into training, and the caller starts the next flush at its next chance.

    Parameters:
        root: the durable level's root (a directory or an ``s3://`` URL); step ``N`` goes to
            its ``step-0000000N``.
        stats: where each flush's outcome goes, updated under ``lock``.
        lock: the caller's lock over ``stats``.
        process_group: the ranks that flush together (``None``: this process alone); the
            flusher runs its collectives on a group of its own over the same ranks.
        keep_last: how many durable steps retention keeps (``None``: all).
        backend: the write backend (``None``: the ``backend`` setting).
        timeout_s: the collectives' bound (``None``: the ``collective_timeout_s`` setting).

    Every rank constructs it at the same point (creating the group is collective).
    """

    def __init__(self, root: str, stats: FlushStats, lock: Any, *,
                 process_group: Any = None, keep_last: int | None = None,
                 backend: str | None = None, timeout_s: float | None = None):
        self.root, self.stats, self.lock = root, stats, lock
        self.keep_last, self.backend = keep_last, backend
        timeout = timeout_s if timeout_s is not None else settings.current().collective_timeout_s
        group = background_group(timeout) if process_group is not None else None
        self.comm = make_comm(group, timeout)
        self._idle = threading.Event()
        self._idle.set()
        self._jobs: queue.SimpleQueue[tuple[int, list[str]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gds_persist-flush", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """No flush in progress on this rank."""
        return self._idle.is_set()

    def start(self, step: int, share_dirs: list[str]) -> None:
        """Flush ``step`` from ``share_dirs`` (this rank's copies, nearest first) in the
        background. Every rank calls it for the same step, and only while :attr:`idle`.

        Parameters:
            step: a step every rank has committed in its local levels.
            share_dirs: this rank's committed copies of its share of ``step``, nearest first.
        """
        if self._closed:
            raise CheckpointError(f"the flusher of {self.root} is closed; make a new one")
        if not self._idle.is_set():
            raise CheckpointError(f"the flusher of {self.root} is still flushing; start step "
                                  f"{step} once it is idle (every rank the same step)")
        self._idle.clear()
        self._jobs.put((step, list(share_dirs)))

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the flush in progress ends; False where ``timeout`` (s) passed first.

        Parameters:
            timeout: seconds to wait at most (``None``: until it ends).
        """
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Let the flush in progress end, then stop the thread; False where it had not ended
        within ``timeout`` (s; the thread is a daemon: it does not hold the process).

        Parameters:
            timeout: seconds to wait at most (``None``: until it ends).
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _yield_cores()
        while (job := self._jobs.get()) is not None:
            try:
                self._flush(*job)
            finally:
                self._idle.set()

    def _flush(self, step: int, share_dirs: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            info = flush_step(self.comm, share_dirs, _steps.step_path(self.root, step), step,
                              self.backend)
            publish(self.comm, self.root, step, self.keep_last)
        except Exception as e:  # noqa: BLE001 - recorded; training goes on, the next flush retries
            log.warning("gds_persist: flushing step %d to %s failed: %s", step, self.root, e)
            with self.lock:
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                self.stats.failed_step = step
            return
        with self.lock:
            s = self.stats
            s.flushed += 1
            s.last_step = step if s.last_step is None else max(s.last_step, step)
            s.bytes_written += info.bytes_written
            s.seconds += time.perf_counter() - t0


"""The helper process of ``Checkpointer(mode="snapshot", writer="process")``.

Why: a writer *thread* runs core ``save``'s Python (plan, the per-piece copy/CRC loop, the
manifest) in the training process, and a training loop that is itself mostly Python (many small
ops, or a GPU loop launching kernels) waits for the GIL meanwhile: measured at about 16 ms per
checkpoint of ~800 small tensors (docs/TRAINING.md). In a helper process that work takes no GIL
from training; the training process only copies the tensors into the shared snapshot arena.

Protocol (pickled, over a socketpair): the Checkpointer's writer thread sends one job at a time
(where the snapshot lies in the arena, the flattened state's tree and records, the save
arguments: the same description the thread writer gets as a Flattened) and
waits, bounded and watching the process, for ``("ok", seq, SaveInfo)`` or ``("error", seq,
exception)``. The helper drops its views of the arena before it answers, so the arena bytes can be
reused at once. It dies with the training process (PR_SET_PDEATHSIG, and a watchdog on its
parent pid), so that a killed trainer never leaves it writing into a root a restarted trainer
uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, WorkerDied


class HelperProcess:
    """One helper process; :meth:`write` runs one job in it. Not thread-safe: one caller.

    Started with ``python -m gds_persist.training._helper_main`` (not ``multiprocessing`` spawn,
    which would re-run the training script's top-level code in the helper) and talked to over a
    socketpair.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._seq = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the helper if it is not running (it imports torch: seconds, in the background)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.stop(0.0)
        ours, theirs = socket.socketpair()
        package_parent = str(Path(os.path.abspath(__file__)).parents[2])  # above gds_persist/
        env = dict(os.environ)  # the helper imports this very gds_persist
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH"))
                                            if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gds_persist.training._helper_main", str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())

    def write(self, job: dict[str, Any], timeout_s: float, what: str) -> Any:
        """Run ``job`` in the helper; return its SaveInfo or raise its error.

        Raises :class:`WorkerDied` if the helper exits meanwhile, and a TimeoutError after
        ``timeout_s`` (the helper is then killed: it must not commit later, unseen).
        """
        self.start()
        assert self._conn is not None and self._proc is not None
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        try:
            self._conn.send({**job, "seq": seq})
            while True:
                if self._conn.poll(0.25):
                    status, got, value = self._conn.recv()
                    if got != seq:  # an answer to an abandoned job: not ours
                        continue
                    if status == "ok":
                        return value
                    raise value
                if self._proc.poll() is not None:
                    raise EOFError
                if time.monotonic() >= deadline:
                    self.stop(0.0)
                    raise TimeoutError(f"the helper process took more than {timeout_s:.0f} s "
                                       f"{what}; it was stopped")
        except TimeoutError:  # an OSError subclass, but the helper was stopped on purpose
            raise
        except (EOFError, OSError) as e:
            if isinstance(e, OSError) and not self._exited(5.0):  # a reset: its end is closing
                raise
            code = self._proc.wait(5)
            self.stop(0.0)
            raise WorkerDied(f"the gds_persist helper process died (exit code {code}) while "
                             f"{what}; that save is lost, a new helper takes the next") from None

    def _exited(self, within_s: float) -> bool:
        """Whether the helper has exited, waiting up to ``within_s`` for a dying one."""
        assert self._proc is not None
        try:
            self._proc.wait(within_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            with contextlib.suppress(OSError):
                if proc is not None and proc.poll() is None and timeout_s > 0:
                    conn.send(None)  # finish and exit
            conn.close()
        if proc is None:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()  # our own child, by object
            proc.wait(5)


def _die_with(parent: int) -> None:
    """Exit when the training process does: at once via PR_SET_PDEATHSIG, else by polling."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="gds_persist-helper-watchdog", daemon=True).start()


def _transportable(e: BaseException) -> BaseException:
    note = f"(raised in the gds_persist helper process, pid {os.getpid()})"
    if hasattr(e, "add_note"):
        e.add_note(note)
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception that does not pickle: keep its text
        return CheckpointError(f"{type(e).__name__}: {e} {note}")


def main(conn: Connection, parent: int) -> None:
    """The helper process: write the jobs it is sent until told to stop or its parent is gone."""
    _die_with(parent)
    import torch

    from .. import settings
    from ..saving.save import save
    from .snapshot import map_shared, over_copies

    torch.set_num_threads(1)  # its copies must not take the training's cores
    maps: dict[tuple[int, int, int], Any] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the Checkpointer is gone
            return
        if job is None:
            return
        try:
            key = tuple(job["arena"])
            if key not in maps:
                for old in maps.values():
                    old.close()
                maps = {key: map_shared(*key)}
            views = [torch.frombuffer(maps[key], dtype=torch.uint8, count=s.nbytes, offset=off)
                     if s.nbytes else torch.empty(0, dtype=torch.uint8)
                     for s, off in zip(job["storages"], job["offsets"], strict=True)]
            flat = over_copies(job["tree"], job["tensors"], job["storages"], views,
                               job["crc_at_save"])
            with settings.set(**job["settings"]):  # the training process's, at the write
                info = save(flat, job["path"], **job["kwargs"])
            del flat, views  # nothing here may touch the arena bytes once the answer is sent
            conn.send(("ok", job["seq"], info))
        except Exception as e:  # noqa: BLE001 - sent back to the Checkpointer
            conn.send(("error", job["seq"], _transportable(e)))


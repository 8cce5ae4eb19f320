"""A fork server: worker processes for the multi-process tests, without each importing torch.

A fresh Python process spends about 4 s of CPU importing torch and gds_persist, and 2-4 s more
on torch._dynamo, which the first optimizer imports. The memory tier's tests start 18 jobs of 4
ranks and the docs' examples 26 scripts: on the 2-core CI machines forking them from a server
that has imported all of it took those tests from 249 s to 30 s and from 112 s to 44 s. The
server (``python tests/forkserver.py MODULES_JSON``) imports those modules once and forks a
worker for every request; the worker runs its script as ``__main__`` with its own argv,
environment and output files, and exits through the normal interpreter shutdown (atexit, thread
and gloo teardown), as a fresh process does.

A forked worker is not a fresh process in every timing: tests/test_exit_after_collectives.py
starts fresh interpreters, because without its fix the exit race it guards against aborts
about 1 pair of fresh processes in 4, but forked ones 1 pair in 58.

Only a single-threaded process may fork safely (a lock held by another thread stays held in the
child forever), so the server checks it has one thread before every fork, and it never runs a
torch operator (whose intra-op thread pool would break in a forked child).

:class:`ForkServer` is the test side; :meth:`ForkServer.spawn` returns a :class:`Worker`, which
answers as ``subprocess.Popen`` does (``poll``, ``wait``, ``returncode``, ``send_signal``).
Signals go through the server, which sends them only to a child it has not yet reaped: a pid
cannot have been reused by then.

Protocol, one JSON object per line: requests ``{"spawn": ID, "script", "argv", "env", "cwd",
"stdout", "stderr", "warnings_error"}`` and ``{"signal": PID, "number": SIG}``; replies
``{"started": ID, "pid": PID}`` and ``{"exited": PID, "status": WAIT_STATUS}``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

SERVER = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(SERVER))
# what the workers import; torch._dynamo comes with the first optimizer (torch._disable_dynamo),
# 800 modules and 2-4 s of CPU a process
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gds_persist"]


# ------------------------------------------------------------------ the server process


def _run_child(request: dict[str, Any], reply_fd: int) -> None:
    """In the forked child: become a fresh-looking process running ``script`` as __main__."""
    import traceback
    import warnings

    os.close(reply_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's request pipe is not the worker's to read
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.chdir(request["cwd"])
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(request["script"])  # as `python SCRIPT` sets it
    if request["warnings_error"]:  # as `python -W error`
        warnings.simplefilter("error")
    # every way out is a SystemExit, which unwinds out of serve() (the child never returns to
    # the server's loop): the interpreter's own shutdown follows
    try:
        _exec_as_main(request["script"])
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would
        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _exec_as_main(script: str) -> None:
    """Run ``script`` as the module ``__main__``, which keeps its globals until the interpreter
    shuts down, as in a fresh process (runpy.run_path clears them when the script ends: objects
    a script holds to its end, a process group, tensors, would go before the shutdown)."""
    import types

    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)


def _reply(fd: int, **message: Any) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _fork(request: dict[str, Any], reply_fd: int, children: set[int]) -> None:
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"the fork server has {threads} threads: it must fork single-threaded"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_child(request, reply_fd)
    children.add(pid)
    _reply(reply_fd, started=request["spawn"], pid=pid)


def _reap(reply_fd: int, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _reply(reply_fd, exited=pid, status=status)


def serve(modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)
    reply_fd = os.dup(1)  # replies on a descriptor of their own, never a child's stdout
    os.dup2(2, 1)
    children: set[int] = set()
    pending = b""
    _reply(reply_fd, ready=os.getpid())
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        _reap(reply_fd, children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the tests are done (or gone): so are their workers
            for pid in children:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            request = json.loads(line)
            if "spawn" in request:
                _fork(request, reply_fd, children)
            elif request["signal"] in children:  # not reaped: the pid is still that child's
                os.kill(request["signal"], request["number"])


# ------------------------------------------------------------------ the test side


class ForkServer:
    """The server process and a thread reading its replies."""

    def __init__(self, modules: list[str] | None = None, *, warnings_error: bool = False) -> None:
        """Starts the server importing ``modules`` (default :data:`PRELOAD`); with
        ``warnings_error`` it runs as ``python -W error``, its imports included, and so do its
        workers."""
        # numpy's OpenBLAS starts a thread pool when torch imports numpy, and a forking process
        # must have one thread; no worker uses numpy's BLAS (torch computes with its own)
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OPENBLAS_NUM_THREADS": "1"}
        flags = ["-W", "error"] if warnings_error else []
        self.proc = subprocess.Popen([sys.executable, *flags, SERVER,
                                      json.dumps(modules or PRELOAD)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._status: dict[int, int] = {}  # pid -> wait status
        self._next = 0
        self._ended = False
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first and "ready" in json.loads(first), f"fork server did not start: {first!r}"
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._pids[message["started"]] = message["pid"]
                else:
                    self._status[message["exited"]] = message["status"]
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _send(self, **request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _await(self, ready: Any, timeout: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: ready() or self._ended, timeout)

    def spawn(self, script: str, argv: list[str], *, env: dict[str, str] | None = None,
              stdout: str = os.devnull, stderr: str | None = None, cwd: str | None = None,
              warnings_error: bool = False) -> Worker:
        """Start ``python script *argv`` (as a fork of the server); ``stderr`` defaults to
        ``stdout``'s file."""
        self._next += 1
        ident = self._next
        self._send(spawn=ident, script=os.path.abspath(script), argv=argv,
                   env=dict(os.environ if env is None else env), cwd=cwd or os.getcwd(),
                   stdout=stdout, stderr=stderr or stdout, warnings_error=warnings_error)
        self._await(lambda: ident in self._pids, 60)
        if ident not in self._pids:
            raise RuntimeError(f"fork server did not start {script} (exit {self.proc.poll()})")
        return Worker(self, self._pids[ident], [script, *argv])

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the server, which SIGKILLs and reaps the workers still running."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Worker:
    """One forked worker, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        status = self.server._status.get(self.pid)
        if status is not None:
            self.returncode = os.waitstatus_to_exitcode(status)
        elif self.server._ended:
            raise RuntimeError(f"fork server ended before worker {self.pid} ({self.args})")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.server._await(lambda: self.pid in self.server._status, timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            self.server._send(signal=self.pid, number=int(number))

    def kill(self) -> None:
        self.send_signal(9)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))

"""tests/forkserver.py, the fork server the memory tier's ranks and the docs' examples run in:
a forked worker gets its own argv, environment, directory and output files, reports its exit as
``subprocess.Popen`` does (a traceback exits 1, a signal -N), and shuts down as an interpreter
does, with its script's globals alive until then."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forkserver import ForkServer


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    with ForkServer(["json"]) as server:  # nothing heavy: these workers import nothing else
        yield server


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_worker_gets_its_own_argv_env_cwd_and_files(forks, tmp_path):
    script = _script(tmp_path, """
        import os, sys
        print(sys.argv[1:], os.environ["WORKER_TAG"], os.getcwd(), __name__, sys.path[0])
        print("to stderr", file=sys.stderr)
    """)
    out, err = tmp_path / "out", tmp_path / "err"
    (tmp_path / "elsewhere").mkdir()
    worker = forks.spawn(script, ["a", "b"], env={**os.environ, "WORKER_TAG": "t7"},
                         cwd=str(tmp_path / "elsewhere"), stdout=str(out), stderr=str(err))
    assert worker.wait(timeout=60) == 0 and worker.returncode == 0
    assert out.read_text() == f"['a', 'b'] t7 {tmp_path / 'elsewhere'} __main__ {tmp_path}\n"
    assert err.read_text() == "to stderr\n"
    assert "WORKER_TAG" not in os.environ


def test_exit_status_as_popen_reports_it(forks, tmp_path):
    log = str(tmp_path / "log")
    raising = forks.spawn(_script(tmp_path, "raise ValueError('boom')\n"), [], stdout=log)
    assert raising.wait(timeout=60) == 1
    assert "ValueError: boom" in Path(log).read_text()
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    assert forks.spawn(str(tmp_path / "exits.py"), []).wait(timeout=60) == 3


def test_signals_reach_a_running_worker_and_wait_times_out(forks, tmp_path):
    sleeper = forks.spawn(_script(tmp_path, "import time\ntime.sleep(600)\n"), [])
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.5)
    assert sleeper.poll() is None
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    sleeper.kill()  # reaped: nothing is sent, no error


def test_globals_live_until_the_interpreter_shuts_down(forks, tmp_path):
    """What the script holds to its end is released in the interpreter's shutdown, after
    atexit, as in a fresh process; and -W error turns a warning into an exit of 1."""
    log = tmp_path / "log"
    script = _script(tmp_path, """
        import atexit, os
        class Held:
            def __del__(self):
                os.write(1, b"released\\n")
        held = Held()
        atexit.register(lambda: os.write(1, b"atexit\\n"))
        print("end of script", flush=True)
    """)
    assert forks.spawn(script, [], stdout=str(log)).wait(timeout=60) == 0
    assert log.read_text() == "end of script\natexit\nreleased\n"
    warns = _script(tmp_path, "import warnings\nwarnings.warn('careful')\n")
    assert forks.spawn(warns, [], warnings_error=True).wait(timeout=60) == 1
    assert forks.spawn(warns, []).wait(timeout=60) == 0

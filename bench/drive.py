"""The drive's own limit, measured in the same run as the methods it is compared with.

With fio installed: a sequential O_DIRECT write (``--end_fsync=1``: fio runs the final fsync
inside its timed I/O loop, so the write figure includes durability) and a sequential O_DIRECT read
of the same file, 1 MiB requests at queue depth 16, io_uring (libaio if io_uring is refused).
``--fallocate=native``: fio reserves the file's blocks up front, as gds_persist does inside its
timed save (a write that allocates blocks as it goes is slower on ext4, so ``none`` would give a
limit that is easy to beat, not the drive's limit).

Without fio: a plain aligned O_DIRECT stream from Python (a few threads ``os.pwrite``/``os.preadv``
large 4096-aligned blocks of one page-aligned buffer, then fsync), labelled as such: it is a lower
bound on the drive's limit, not fio. On a filesystem without O_DIRECT (tmpfs, some network
filesystems) the same stream runs buffered (write + fsync; read after the page cache is dropped),
again labelled as such.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

FIO_BS = 1 << 20
FIO_IODEPTH = 16
PY_BLOCK = 8 << 20
PY_THREADS = 4


@dataclass
class DriveRun:
    """One timed drive-limit transfer."""

    seconds: float
    nbytes: int
    tool: str  # what measured it, e.g. "fio io_uring" or "python O_DIRECT"
    detail: dict[str, Any] = field(default_factory=dict)


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    fio = fio_path()
    if not fio:
        return None
    try:
        out = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class DriveProbe:
    """Measures sequential O_DIRECT write then read of ``nbytes`` in ``directory``.

    ``write()`` must precede ``read()`` (the read uses the file the write made); ``cleanup()``
    removes it. ``tool`` says what is used; ``notes`` what went wrong on the way (e.g. io_uring
    refused, so libaio). ``jobs``: fio jobs at once, each writing and reading its own file of
    ``nbytes / jobs`` (the same parallelism as a writer with that many I/O threads and files).
    On a memory-backed filesystem (tmpfs) fio does not preallocate (``--fallocate=none``): there
    preallocating allocates the pages before fio's timed writes, which gds_persist's timed save
    does not (it writes into unallocated pages, as fio then does).
    """

    def __init__(self, directory: str, nbytes: int, *, use_fio: bool = True,
                 o_direct: bool = True, jobs: int = 1):
        self.directory = directory
        self.jobs = max(1, jobs)
        self.nbytes = round_up(max(nbytes, FIO_BS * self.jobs), FIO_BS * self.jobs)
        self.path = os.path.join(directory, "drive-limit.bin")
        self.notes: list[str] = []
        self.o_direct = o_direct
        self.fallocate = "none" if _memory_backed(directory) else "native"
        self._engines = ["io_uring", "libaio"]
        self._fio = fio_path() if use_fio and o_direct else None
        if not o_direct:
            self.notes.append("the directory refuses O_DIRECT: buffered Python stream + fsync")
        elif use_fio and not self._fio:
            self.notes.append("fio not installed: plain Python O_DIRECT stream instead")

    @property
    def tool(self) -> str:
        if self._fio:
            jobs = f", {self.jobs} jobs" if self.jobs > 1 else ""
            return f"fio {self._engines[0]} (O_DIRECT, bs=1M, iodepth={FIO_IODEPTH}{jobs})"
        return (f"{self._python_name} stream ({PY_THREADS} threads, {PY_BLOCK >> 20} MiB "
                "blocks)")

    @property
    def _python_name(self) -> str:
        return "python O_DIRECT" if self.o_direct else "python buffered+fsync"

    def write(self) -> DriveRun:
        self.cleanup()
        return self._run("write")

    def read(self) -> DriveRun:
        return self._run("read")

    def cleanup(self) -> None:
        for path in [self.path, *self._job_files()]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _job_files(self) -> list[str]:
        return [f"{self.path}.{k}" for k in range(self.jobs)] if self.jobs > 1 else []

    def _run(self, rw: str) -> DriveRun:
        while self._fio:
            try:
                return self._fio_run(rw)
            except RuntimeError as e:
                self.notes.append(f"fio {self._engines.pop(0)} failed ({e})")
                if not self._engines:
                    self.notes.append("falling back to the plain Python O_DIRECT stream")
                    self._fio = None
        seconds = _stream(self.path, self.nbytes, rw == "write", self.o_direct)
        return DriveRun(seconds, self.nbytes, self._python_name)

    def _fio_run(self, rw: str) -> DriveRun:
        assert self._fio
        engine = self._engines[0]
        target = (["--filename=" + self.path] if self.jobs == 1 else
                  [f"--directory={self.directory}", "--filename_format=drive-limit.bin.$jobnum",
                   f"--numjobs={self.jobs}", "--group_reporting"])
        cmd = [
            self._fio, "--name=drive-limit", *target, f"--rw={rw}",
            f"--bs={FIO_BS}", f"--iodepth={FIO_IODEPTH}", f"--ioengine={engine}", "--direct=1",
            f"--size={self.nbytes // self.jobs}", f"--fallocate={self.fallocate}",
            "--output-format=json",
        ]
        if rw == "write":
            cmd.append("--end_fsync=1")
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(str(e)) from e
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError((out.stderr or out.stdout).strip().splitlines()[-1:] or
                               f"exit status {out.returncode}")
        job = parse_fio_json(out.stdout)["jobs"][0]
        if job.get("error"):
            raise RuntimeError(f"fio job error {job['error']}")
        stats = job[rw]
        nbytes = int(stats["io_bytes"])
        runtime_s = float(stats["runtime"]) / 1000.0  # ms; includes end_fsync for writes
        seconds = runtime_s if runtime_s > 0 else wall
        return DriveRun(seconds, nbytes, f"fio {engine}",
                        {"fio_runtime_s": runtime_s, "process_wall_s": wall,
                         "fio_bw_bytes": stats.get("bw_bytes"), "engine": engine})


def _memory_backed(directory: str) -> bool:
    from gds_persist.backends.posix import filesystem_type

    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return False
    try:
        return filesystem_type(fd) == "tmpfs"
    finally:
        os.close(fd)


def parse_fio_json(text: str) -> dict[str, Any]:
    """fio's JSON output; fio may print notes before the JSON object."""
    start = text.find("{")
    if start < 0:
        raise RuntimeError("fio printed no JSON")
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError as e:
        raise RuntimeError(f"fio output is not JSON: {e}") from e


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # anonymous mappings are page aligned
    chunk = os.urandom(min(nbytes, 1 << 20))
    for off in range(0, nbytes - len(chunk) + 1, len(chunk)):
        buf[off:off + len(chunk)] = chunk
    return buf


def _stream(path: str, nbytes: int, write: bool, direct: bool = True) -> float:
    """Seconds to move ``nbytes`` sequentially (thread t does blocks t, t+T, ...); a write
    includes its fsync. ``direct``: O_DIRECT (buffer, offsets and lengths 4096-aligned)."""
    block = min(PY_BLOCK, round_up(nbytes, 4096))
    offsets = list(range(0, nbytes, block))
    threads = min(PY_THREADS, len(offsets))
    bufs = [_aligned_buffer(block) for _ in range(threads if not write else 1)]
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)

    def worker(t: int) -> None:
        with memoryview(bufs[0 if write else t]) as view:
            for off in offsets[t::threads]:
                n = round_up(min(block, nbytes - off), 4096)
                done = 0
                while done < n:
                    if write:
                        got = os.pwrite(fd, view[done:n], off + done)
                    else:
                        got = os.preadv(fd, [view[done:n]], off + done)
                    if got <= 0:
                        raise OSError(f"short transfer on {path} at {off + done}")
                    done += got

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        if write:
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()

"""The limit a save can reach on this machine: the aligned O_DIRECT writer.

    python bench/bench_limit.py [--size 1GiB] [--runs 3] [--dir DIR]

fio is not a save's limit where the drive is fast: it rewrites one small buffer that stays in
the CPU cache, where a checkpoint's bytes are distinct and come from DRAM. The limit a save can
reach moves the same distinct bytes as a checkpoint, already in page-aligned memory, with
O_DIRECT ``pwrite`` in ``block_bytes`` (16 MiB) requests by as many threads as gds_persist has
I/O threads, one file each (opened and reserved exactly as the engine opens its data files),
fsynced: no checksum, no staging copy. Its read is the same files read back with O_DIRECT into
that memory. :class:`AlignedLimit` is the measurement (``bench_io.py`` runs it beside fio in
every repetition, the "x limit" column); run as a script it pairs it with ``gds_persist.save``
in ABBA order and prints both, and beside them the **checksummed writer**: the same writes, each
request's CRC32C taken first on its thread (what a save that verifies its bytes cannot skip),
the bound where the CPU, not the drive, is the limit (tmpfs on few cores). See docs/BENCHMARK.md
"The aligned-writer limit".

Importing this module does nothing; :func:`main` runs the script.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gds_persist.backends.posix import open_fd, pread_all, pwrite_all  # noqa: E402
from gds_persist.format import crc32c  # noqa: E402

PAGE = 4096


@dataclass
class LimitRun:
    seconds: float
    nbytes: int
    tool: str


class AlignedLimit:
    """The bytes of ``tensors`` copied once into page-aligned memory (distinct bytes, as a
    checkpoint's), cut into ``jobs`` contiguous parts of whole ``block_bytes`` requests; each
    ``write()`` writes part k to its own file with O_DIRECT from one thread and fsyncs it."""

    def __init__(self, directory: str, tensors: list[torch.Tensor], jobs: int,
                 block_bytes: int = 16 << 20, o_direct: bool = True, checksum: bool = False):
        self.directory = directory
        self.checksum = checksum  # CRC32C of every request before its write
        self.jobs = max(1, jobs)
        self.block = block_bytes
        self.flags = os.O_DIRECT if o_direct and hasattr(os, "O_DIRECT") else 0
        storages = _distinct_storages(tensors)
        payload = sum(st.nbytes() for st in storages)
        self.nbytes = -(-max(payload, PAGE) // PAGE) * PAGE
        self.memory = mmap.mmap(-1, self.nbytes)  # anonymous: page aligned
        view = torch.frombuffer(self.memory, dtype=torch.uint8)
        at = 0
        for st in storages:
            n = st.nbytes()
            view[at : at + n].copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st))
            at += n
        del view
        per = -(-self.nbytes // self.jobs // PAGE) * PAGE
        self.parts = [(lo, min(lo + per, self.nbytes)) for lo in range(0, self.nbytes, per)]
        self.paths = [os.path.join(directory, f"aligned-limit.{k}") for k in range(len(self.parts))]

    @property
    def tool(self) -> str:
        how = "O_DIRECT" if self.flags else "buffered+fsync"
        return (f"aligned writer ({how} pwrite, {self.block >> 20} MiB requests, "
                f"{len(self.parts)} threads/files)")

    def _each(self, fn: object) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(self.parts)) as pool:
            list(pool.map(fn, range(len(self.parts))))  # type: ignore[call-overload]
        return time.perf_counter() - t0

    def write(self) -> LimitRun:
        self.cleanup()
        return LimitRun(self._transfer(True), self.nbytes, "aligned writer")

    def read(self) -> LimitRun:
        return LimitRun(self._transfer(False), self.nbytes, "aligned reader")

    def _transfer(self, write: bool) -> float:
        """Seconds for every thread to write (fsynced; files opened as the engine opens its
        data files) or read its part."""
        view = memoryview(self.memory)

        def one(k: int) -> None:
            lo, hi = self.parts[k]
            fd = (open_fd(self.paths[k], True, hi - lo, self.flags) if write
                  else os.open(self.paths[k], os.O_RDONLY | self.flags))
            try:
                for a in range(lo, hi, self.block):
                    part = view[a : min(a + self.block, hi)]
                    if write:
                        if self.checksum:
                            crc32c(part)
                        pwrite_all(fd, part, a - lo)
                    else:
                        pread_all(fd, part, a - lo)
                if write:
                    os.fsync(fd)
            finally:
                os.close(fd)

        try:
            return self._each(one)
        finally:
            view.release()

    def cleanup(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.cleanup()
        self.memory.close()


def _distinct_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages of ``tensors``, each once (tied weights share one), as a checkpoint holds
    them."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault((str(st.device), st.data_ptr()), st)
    return list(seen.values())


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Pair the aligned writer with ``gds_persist.save`` (and torch.save with ``--torch``) in
    ABBA order; print every pair and the medians."""
    import gds_persist
    from bench.bench_io import new_parser, work_directory
    from bench.state import iter_tensors, make_state_dict
    from gds_persist.backends import supports_o_direct

    p = new_parser("bench_limit.py", __doc__, "state dict size")
    p.add_argument("--runs", type=int, default=3, help="ABBA pairs (default 3)")
    p.add_argument("--dir", default=None, help="directory to test (default bench/out)")
    p.add_argument("--format", default="directory", choices=("directory", "torch"),
                   help="gds_persist.save's format")
    args = p.parse_args(argv)
    sd = make_state_dict(args.size, seed=0)
    tensors = [t for _, t in iter_tensors(sd)]
    jobs = gds_persist.settings.current().io_threads
    times: dict[str, list[float]] = {"limit": [], "checksummed": [], "save": []}
    with work_directory(args.dir, "limit-") as workdir:
        limit = AlignedLimit(workdir, tensors, jobs, gds_persist.settings.current().block_bytes,
                             o_direct=supports_o_direct(workdir)[0])
        target = os.path.join(workdir, "ckpt" + (".pt" if args.format == "torch" else ""))

        def save() -> float:
            t0 = time.perf_counter()
            gds_persist.save(sd, target, format=args.format)
            return time.perf_counter() - t0

        def once(which: str) -> None:
            os.sync()
            limit.checksum = which == "checksummed"
            s = save() if which == "save" else limit.write().seconds
            times[which].append(s)
            limit.cleanup()
            _remove(target)
            print(f"  {which:<11} {limit.nbytes / s / 1e9:6.2f} GB/s", flush=True)

        order = ("limit", "checksummed", "save")
        for which in order:  # warm-up (not kept)
            once(which)
        times = {which: [] for which in order}
        for r in range(args.runs):
            for which in (order if r % 2 == 0 else order[::-1]):
                once(which)
        limit.close()
    _report(limit, times)
    return times


def _report(limit: AlignedLimit, times: dict[str, list[float]]) -> None:
    def rate(which: str) -> str:
        return f"{limit.nbytes / statistics.median(times[which]) / 1e9:.2f} GB/s"

    print(f"{limit.tool}: median {rate('limit')}; checksummed writer {rate('checksummed')}; "
          f"save median {rate('save')}")
    for bound in ("limit", "checksummed"):
        ratios = [b / s for b, s in zip(times[bound], times["save"], strict=True)]
        print(f"save / {bound} per pair {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")


def _remove(path: str) -> None:
    import shutil

    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


if __name__ == "__main__":
    main()

"""A gang of spawned worker processes in one real gloo process group, reused across tests.

Starting processes that import torch costs seconds, so a test module starts one gang and sends it
many tasks. Each worker joins a gloo group of ``world`` ranks (FileStore rendezvous: no ports to
race for) and also creates the subgroups of the first ``k`` ranks for every ``k``, so a task can
save with 2 or 3 ranks and load with another count. A task is a module-level function
``fn(ctx, *args, **kwargs)`` run on every rank; :meth:`Gang.run` returns every rank's result, or
raises with the workers' tracebacks. No mocks: these are real processes and real collectives.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass
class Ctx:
    rank: int
    world: int
    groups: dict[int, Any]  # k -> group of ranks 0..k-1 (None on ranks outside it)

    def group(self, k: int) -> Any:
        return self.groups[k] if self.rank < k else None


def _worker(rank: int, world: int, init_file: str, tasks: Any, results: Any, timeout_s: float,
            env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    groups: dict[int, Any] = {world: dist.group.WORLD}
    for k in range(1, world):
        g = dist.new_group(list(range(k)))  # every rank takes part in creating every group
        groups[k] = g if rank < k else None
    ctx = Ctx(rank, world, groups)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - sent back to the test
            results.put((rank, False, traceback.format_exc()))
    os._exit(0)  # skip destroy_process_group: a broken group may hang on teardown


class Gang:
    def __init__(self, world: int, timeout_s: float = 60, env: dict[str, str] | None = None):
        self.world = world
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="gds_persist-gang-")
        os.close(fd)
        os.unlink(self._init_file)  # FileStore creates it
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world, self._init_file, self.tasks[r], self.results,
                                        timeout_s, env or {}))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results by rank."""
        if self.broken:
            raise RuntimeError("the gang's process group was broken by an earlier test")
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.broken = True
                raise TimeoutError(f"gang task {fn.__name__} did not finish within {timeout} s "
                                   f"(ranks done: {sorted(out)})") from None
            out[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in out.items() if not ok}
        if failed:
            raise AssertionError("\n".join(f"--- rank {r}:\n{tb}"
                                           for r, tb in sorted(failed.items())))
        return [out[r][1] for r in range(self.world)]

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # only our own children, by object
                p.join(timeout=5)
        try:
            os.unlink(self._init_file)
        except OSError:
            pass

"""Does a checkpoint writer *thread* slow the training loop through the GIL?

The Checkpointer writes from a Python thread in the training process. Its work (``copy_`` into
the staging ring, CRC32C, ``pwrite``, ``fsync``) runs in C with the GIL released, but the Python
between those calls takes it. This measures, for a training loop on one intra-op thread, the
iteration time under three conditions, interleaved in short windows (so that drifting load from
other processes hits all three alike):

* ``none``: no writer;
* ``thread``: a writer thread in the training process saving a same-sized state dict (model +
  2x Adam state) with ``gds_persist.save`` back to back;
* ``process``: the same writer in a separate process, which cannot take the training process's
  GIL. ``thread - process`` is what the GIL costs; ``process - none`` is contention for cores,
  memory bandwidth and the disk, which moving the writer to a helper process would not remove.

Also per condition, from the training thread's ``/proc/thread-self/schedstat``: its time waiting
for a core (``runq``) and its time *blocked* (wall - on CPU - runq): the training loop does no
I/O, so blocked time is time spent waiting for the GIL, measured directly and unaffected by how
loaded the machine is. And the writer's throughput, and how late a probe thread that sleeps 1 ms
wakes up (it needs the GIL to return).

Workloads: ``compute`` (bench_train's default GPT: large ops, little Python) and ``python`` (a
tiny deep GPT: many small ops, the loop mostly in the interpreter).

    python bench/gil_contention.py [--cycles 8] [--json FILE]   (Linux: needs schedstat)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

import gds_persist  # noqa: E402

WORKLOADS = {  # bench_train arguments, iterations per window
    "compute": ([], 2),
    "python": (["--d-model", "32", "--layers", "16", "--heads", "2", "--vocab", "256",
                "--seq", "16", "--batch", "2"], 40),
}
CONDITIONS = ("none", "thread", "process")


def _random_state(shapes: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(s) for i, s in enumerate(shapes)}


def _writer(state: Any, directory: str, active: Any, idle: Any, stop: Any, counter: Any) -> None:
    """Save back to back while ``active`` is set; ``idle`` is set while not saving."""
    path = os.path.join(directory, f"ckpt-{os.getpid()}-{threading.get_ident()}")
    while not stop.is_set():
        if not active.wait(0.05):
            idle.set()
            continue
        idle.clear()
        info = gds_persist.save(state, path)
        with counter.get_lock():
            counter.value += info.bytes_written
    idle.set()


def _process_writer(shapes: list[tuple[int, ...]], directory: str, ready: Any, *events: Any
                    ) -> None:
    torch.set_num_threads(1)
    state = _random_state(shapes)
    ready.set()
    _writer(state, directory, *events)


def _schedstat() -> tuple[float, float]:
    stat = bench_train._schedstat()
    if stat is None:
        raise SystemExit("gil_contention needs Linux /proc/thread-self/schedstat")
    return stat


class Probe:
    """Sleeps 1 ms in a loop and records how late it wakes, under the current condition."""

    def __init__(self) -> None:
        self.condition = "none"
        self.late: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            condition, t0 = self.condition, time.perf_counter()
            time.sleep(0.001)
            self.late[condition].append(time.perf_counter() - t0 - 0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(workload: str, cycles: int, directory: str, window: int | None = None
            ) -> dict[str, dict[str, float]]:
    argv, per_window = WORKLOADS[workload]
    per_window = window or per_window
    targs = bench_train.parse(argv)
    model, opt = bench_train.build(targs)
    bench_train.train_step(model, opt, targs)
    shapes = [tuple(t.shape) for t in bench_train.state(model, opt, 0)["model"].values()] * 3
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    gates = {c: (ctx.Event(), ctx.Event(), ctx.Value("q", 0)) for c in ("thread", "process")}
    thread = threading.Thread(target=_writer, args=(_random_state(shapes), directory,
                                                    *gates["thread"][:2], stop,
                                                    gates["thread"][2]))
    ready = ctx.Event()
    proc = ctx.Process(target=_process_writer,
                       args=(shapes, directory, ready, *gates["process"][:2], stop,
                             gates["process"][2]))
    thread.start()
    proc.start()
    while not ready.wait(0.5):
        if not proc.is_alive():
            stop.set()
            thread.join(120)
            raise SystemExit(f"the writer process died at start (exit code {proc.exitcode})")
    probe = Probe()
    times: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    waits = {c: [0.0, 0.0] for c in CONDITIONS}  # runq, blocked (GIL) seconds
    written = {c: 0 for c in CONDITIONS}
    elapsed = {c: 0.0 for c in CONDITIONS}
    try:
        for _ in range(2):
            bench_train.train_step(model, opt, targs)  # warm-up
        for cycle in range(cycles):
            order = CONDITIONS[cycle % 3:] + CONDITIONS[: cycle % 3]
            for condition in order:
                for name, (active, _, _) in gates.items():
                    if name != condition:
                        active.clear()
                for name, (_, idle, _) in gates.items():
                    if name != condition and not idle.wait(120):
                        raise SystemExit(f"the {name} writer did not finish a save in 120 s")
                if not proc.is_alive():
                    raise SystemExit(f"the writer process died (exit code {proc.exitcode})")
                if condition in gates:
                    gates[condition][0].set()
                    counter = gates[condition][2]
                probe.condition = condition
                bytes0 = counter.value if condition in gates else 0
                t_start = time.perf_counter()
                for _ in range(per_window):
                    cpu0, runq0 = _schedstat()
                    t0 = time.perf_counter()
                    bench_train.train_step(model, opt, targs)
                    wall = time.perf_counter() - t0
                    cpu1, runq1 = _schedstat()
                    times[condition].append(wall)
                    waits[condition][0] += runq1 - runq0
                    waits[condition][1] += max(0.0, wall - (cpu1 - cpu0) - (runq1 - runq0))
                elapsed[condition] += time.perf_counter() - t_start
                if condition in gates:
                    written[condition] += counter.value - bytes0
    finally:
        stop.set()
        for active, _, _ in gates.values():
            active.set()
        probe.stop()
        thread.join(120)
        proc.join(120)
    rows = {}
    for c in CONDITIONS:
        late = sorted(probe.late[c]) or [0.0]
        n = len(times[c])
        rows[c] = {"iter_s": statistics.median(times[c]), "iterations": n,
                   "runq_ms_per_iter": 1e3 * waits[c][0] / n,
                   "gil_wait_ms_per_iter": 1e3 * waits[c][1] / n,
                   "writer_gbps": written[c] / elapsed[c] / 1e9 if elapsed[c] else 0.0,
                   "probe_late_p50_ms": 1e3 * late[len(late) // 2],
                   "probe_late_p99_ms": 1e3 * late[int(len(late) * 0.99)]}
    base = rows["none"]["iter_s"]
    for r in rows.values():
        r["slowdown_pct"] = 100.0 * (r["iter_s"] / base - 1.0)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=8, help="windows per condition")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dir", default=".")
    p.add_argument("--window", type=int, default=None, help="iterations per window")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.workloads, args.cycles, args.window = "python", 1, 2
    out: dict[str, Any] = {}
    with bench_train.scratch(1, "gil_contention-", args.dir) as directory:
        print(f"training on 1 intra-op thread, {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}; writer: gds_persist.save back to back into "
              f"{directory}; {args.cycles} interleaved windows per condition")
        print(f"{'workload':<9} {'writer':<8} {'iter ms':>8} {'slowdown':>9} {'GIL wait':>9} "
              f"{'runq':>7} {'writer GB/s':>12} {'probe late p50/p99 ms':>22}")
        for name in args.workloads.split(","):
            rows = measure(name, args.cycles, directory, args.window)
            for where, r in rows.items():
                print(f"{name:<9} {where:<8} {1e3 * r['iter_s']:>8.2f} "
                      f"{r['slowdown_pct']:>+8.1f}% {r['gil_wait_ms_per_iter']:>9.2f} "
                      f"{r['runq_ms_per_iter']:>7.2f} {r['writer_gbps']:>12.2f} "
                      f"{r['probe_late_p50_ms']:>10.2f}/{r['probe_late_p99_ms']:.2f}")
            gil = rows["thread"]["slowdown_pct"] - rows["process"]["slowdown_pct"]
            wait = rows["thread"]["gil_wait_ms_per_iter"] - rows["none"]["gil_wait_ms_per_iter"]
            print(f"{name:<9} writer thread: GIL wait {wait:+.2f} ms per iteration "
                  f"({100 * wait / 1e3 / rows['none']['iter_s']:+.1f}% of an iteration); "
                  f"thread - process slowdown {gil:+.1f} points (noisy when loaded)")
            out[name] = {"rows": rows, "gil_cost_points": gil, "gil_wait_ms_per_iter": wait}
        return bench_train.save_json(out, args.json)


if __name__ == "__main__":
    main()

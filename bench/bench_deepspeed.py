"""DeepSpeed's checkpoint writers side by side with gds_persist's engine, in one run.

    python bench/bench_deepspeed.py [--size 1GiB] [--runs 3] [--dir DIR] [--fastpersist]
                                    [--json OUT] [--tiny]

One DeepSpeed-shaped state (bench/state.py's GPT model + Adam state, plus the Python objects a
DeepSpeed checkpoint holds: a LossScaler, the ZeRO stage enum, the config) is saved as one file
by each writer, in the same directory, interleaved (order rotated every round), the file
removed and ``os.sync()`` run before each timed save; every save is timed until durable:

* ``torch``: DeepSpeed's ``TorchCheckpointEngine`` (``torch.save``, zip serialization as an
  engine configures it), then the file and directory fsynced;
* ``fastpersist-defaults`` / ``fastpersist-tuned``: FastPersist's writer, ``torch.save`` into
  ``deepspeed.io.FastFileWriter`` over DeepSpeed's async_io op (O_DIRECT, page-locked double
  buffer; its ``close()`` fsyncs) with DeepSpeed's defaults (1 MiB blocks, queue depth 8, 1
  thread, 64 MiB buffer) and tuned (8 MiB, 32, 2 threads, 256 MiB); only with
  ``--fastpersist``: the async_io op needs ``apt-get install -y libaio-dev`` (root) and builds
  once, about 4 minutes on 2 cores (cached in ~/.cache/torch_extensions);
* ``gds_persist``: :class:`gds_persist.integrations.deepspeed.GdsPersistCheckpointEngine`
  (``create``, ``save``, ``commit``: the file durable, atomically in place), not decoupled;
  ``gds_persist-decoupled`` the same decoupled: its ``save`` returning is shown beside it.

Each writer saves once untimed first (DeepSpeed's ops load on first use).

GB/s = the state's tensor bytes / seconds (median of the rounds); ratios are medians of the
per-round ratios. Every file is read back with ``torch.load`` once and compared bit-exactly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import machine, report  # noqa: E402
from bench.bench_io import log, new_parser, work_directory  # noqa: E402
from bench.state import iter_tensors, make_state_dict  # noqa: E402
from gds_persist.transfer.commit import fsync_path  # noqa: E402

DEFAULTS = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
            "buffer": 64 << 20}  # DeepSpeed 0.19's "aio" and "writer" defaults
TUNED = {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 2,
         "buffer": 256 << 20}
FASTPERSIST_BUILD = ("pass --fastpersist to run it (it builds DeepSpeed's async_io op once: "
                     "apt-get install -y libaio-dev as root, then about 4 minutes)")
Save = Callable[[Any, str], None]


def deepspeed_state(size: int) -> dict[str, Any]:
    """A DeepSpeed-shaped checkpoint of about ``size`` tensor bytes."""
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    gpt = make_state_dict(size, dtype="fp32")
    return {"module": gpt["model"], "optimizer": gpt["optimizer"],
            "loss_scaler": LossScaler(scale=65536.0), "zero_stage": ZeroStageEnum.disabled,
            "ds_config": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
                "stage": 0}}, "ds_version": deepspeed.__version__, "global_steps": 1000}


# --------------------------------------------------------------------------- the writers

def torch_engine() -> Save:
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine = TorchCheckpointEngine(SimpleNamespace(checkpoint_config={
        "checkpoint_serialization": True}))  # what an engine's config gives it

    def save(state: Any, path: str) -> None:
        engine.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(os.path.dirname(path))
    return save


def fastpersist(settings: dict[str, int]) -> Save:
    """FastPersist's writer with these aio settings (its handle and buffer made once)."""
    import deepspeed.io.fast_file_writer as ffw
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.ops.op_builder.utils import UtilsBuilder

    ffw.UtilsBuilder = UtilsBuilder  # the CPU accelerator maps it to "not implemented"
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(
        block_size=settings["block_size"], queue_depth=settings["queue_depth"],
        single_submit=False, overlap_events=True,
        intra_op_parallelism=settings["intra_op_parallelism"])
    buffer = handle.new_cpu_locked_tensor(settings["buffer"], torch.empty(0, dtype=torch.uint8))

    def save(state: Any, path: str) -> None:
        writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=handle,
                                                           pinned_tensor=buffer,
                                                           double_buffer=True))
        torch.save(state, writer)
        writer.close()  # drains, writes the tail, fsyncs
        fsync_path(os.path.dirname(path))
    return save


def ours(decoupled: bool, returned: list[float]) -> Save:
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from gds_persist.integrations.deepspeed import GdsPersistCheckpointEngine

    engine = GdsPersistCheckpointEngine(decoupled=decoupled)

    def save(state: Any, path: str) -> None:
        t0 = time.perf_counter()
        info = CheckpointCommitInfo(tag="bench", save_dir=os.path.dirname(path),
                                    save_latest=False)
        engine.create(info)
        engine.save(state, path)
        returned.append(time.perf_counter() - t0)
        engine.commit(info)
    return save


def writers(fast: bool) -> tuple[dict[str, Save], dict[str, str], dict[str, list[float]]]:
    """The writers to run, those not run (and why), and the decoupled save's return times."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    returned: dict[str, list[float]] = {"gds_persist-decoupled": []}
    run: dict[str, Save] = {"torch": torch_engine()}
    skipped: dict[str, str] = {}
    for key, settings in (("fastpersist-defaults", DEFAULTS), ("fastpersist-tuned", TUNED)):
        if not fast:
            skipped[key] = FASTPERSIST_BUILD
        elif not AsyncIOBuilder().is_compatible(verbose=False):
            skipped[key] = ("DeepSpeed's async_io op cannot build here (libaio missing?): "
                            "apt-get install -y libaio-dev as root")
        else:
            run[key] = fastpersist(settings)
    run["gds_persist"] = ours(False, [])
    run["gds_persist-decoupled"] = ours(True, returned["gds_persist-decoupled"])
    return run, skipped, returned


# --------------------------------------------------------------------------- the rounds

def measure(run: dict[str, Save], state: Any, workdir: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of every writer's saves, by round; after one untimed save each (the first use
    of DeepSpeed's ops loads them, gds_persist's first save warms its threads)."""
    keys = list(run)
    for key in keys:
        run[key](state, os.path.join(workdir, f"{key}.pt"))
        log(f"warm-up {key} done")
    times: dict[str, list[float]] = {k: [] for k in run}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            path = os.path.join(workdir, f"{key}.pt")
            if os.path.exists(path):
                os.unlink(path)  # FastFileWriter does not truncate: a new file each time
            os.sync()
            t0 = time.perf_counter()
            run[key](state, path)
            times[key].append(time.perf_counter() - t0)
            log(f"round {r + 1}/{rounds} {key}: {times[key][-1]:.3f} s")
    return times


def check(run: dict[str, Save], state: Any, workdir: str) -> dict[str, str]:
    """"ok" where torch.load reads back every tensor bit-exactly, else what differs."""
    want = dict(iter_tensors(state))
    out = {}
    for key in run:
        got = dict(iter_tensors(torch.load(os.path.join(workdir, f"{key}.pt"),
                                           weights_only=False)))
        bad = [k for k, t in want.items() if k not in got or not torch.equal(got[k], t)]
        out[key] = "ok" if not bad and got.keys() == want.keys() else f"differs at {bad[:2]}"
    return out


COLUMNS = (("writer", 24, "<"), ("GB/s", 6, ">"), ("min-max", 11, ">"), ("x torch", 7, ">"),
           ("x FP dflt", 9, ">"), ("x FP tuned", 10, ">"), ("check", 6, "<"))


def table(times: dict[str, list[float]], nbytes: int, checks: dict[str, str]) -> list[str]:
    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in times.items()}

    def ratio(key: str, base: str) -> str:
        value = report.paired_ratio(gbps[key], gbps[base]) if base in gbps else None
        return "-" if value is None else f"{value:.2f}"

    lines = [report.fixed_width(tuple(c[0] for c in COLUMNS), COLUMNS),
             report.fixed_width(tuple("-" * c[1] for c in COLUMNS), COLUMNS)]
    for key, values in gbps.items():
        lines.append(report.fixed_width((
            key, f"{statistics.median(values):.2f}", f"{min(values):.2f}-{max(values):.2f}",
            ratio(key, "torch"), ratio(key, "fastpersist-defaults"),
            ratio(key, "fastpersist-tuned"), checks[key]), COLUMNS))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("bench_deepspeed.py", __doc__, "the state's tensor bytes")
    p.add_argument("--runs", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--dir", default=None, help="where the files go (default bench/out)")
    p.add_argument("--fastpersist", action="store_true",
                   help="also run FastPersist's writer (builds the async_io op once)")
    p.add_argument("--json", default=None, help="write the raw record here")
    p.add_argument("--tiny", action="store_true", help="4 MiB, 1 round: a smoke test")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    size, rounds = (4 << 20, 1) if args.tiny else (args.size, args.runs)
    log("importing DeepSpeed, building the state")
    state = deepspeed_state(size)
    nbytes = sum(t.untyped_storage().nbytes() for t in
                 {id(t.untyped_storage()): t for _, t in iter_tensors(state)}.values())
    run, skipped, returned = writers(args.fastpersist)
    with work_directory(args.dir, "bench-deepspeed-") as workdir:
        where = machine.describe(workdir)
        times = measure(run, state, workdir, rounds)
        checks = check(run, state, workdir)
    record = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": where, "load_average": os.getloadavg(), "bytes": nbytes,
              "rounds": rounds, "seconds": times, "checks": checks, "skipped": skipped,
              "decoupled_save_returned_s": returned["gds_persist-decoupled"][1:]}  # no warm-up
    for line in _header(record) + table(times, nbytes, checks) + _notes(record):
        print(line)
    if args.json:
        report.to_json(record, args.json)
    return record


def _header(record: dict[str, Any]) -> list[str]:
    m, v = record["machine"], record["machine"]["versions"]
    import deepspeed

    return [
        "DeepSpeed checkpoint writers vs gds_persist (one file per save, fsync included)",
        f"  CPU        {m['cpu']}; {m['cores']['usable']} usable cores; load average "
        f"{' '.join(f'{x:.2f}' for x in record['load_average'])} (at the end)",
        f"  directory  {m['directory']} on {m['filesystem']['fstype']} "
        f"({m['filesystem']['source']}); O_DIRECT {'yes' if m['o_direct']['supported'] else 'no'}",
        f"  versions   torch {v.get('torch')}, deepspeed {deepspeed.__version__}, gds_persist "
        f"{v.get('gds_persist')}" + (f" (git {v['gds_persist_git']})"
                                     if v.get("gds_persist_git") else ""),
        f"  state      {record['bytes'] / 2**30:.2f} GiB of tensors ({record['bytes']} bytes), "
        "GPT fp32 + Adam state, DeepSpeed's Python objects",
        f"  rounds     {record['rounds']}, interleaved (order rotated), file removed and "
        "os.sync() before each save", ""]


def _notes(record: dict[str, Any]) -> list[str]:
    lines = [""]
    back = record["decoupled_save_returned_s"]
    if back:
        lines.append(f"gds_persist-decoupled: save() returned after {statistics.median(back):.3f}"
                     " s (median); the row is the time until commit() made the file durable.")
    lines += [f"not run: {key}: {why}" for key, why in record["skipped"].items()]
    lines.append("x A = median over rounds of (GB/s / A's GB/s in the same round); FP = "
                 "FastPersist's FastFileWriter.")
    return lines


if __name__ == "__main__":
    main()

"""Checkpoint I/O comparison benchmark: the project's main job.

    python bench/bench_io.py [--size 2GiB] [--runs 3] [--dir DIR] [--json OUT] [--png OUT]
                             [--methods gds-direct,torch,...] [--device cpu|cuda]

On one synthetic GPT-style state dict it measures, interleaved in one run, durable saves (fsync
included) and cold loads of every available method (bench/methods.py), next to the drive's own
sequential O_DIRECT write/read limit (fio, or a plain Python O_DIRECT stream without fio) and the
limit a save of these distinct bytes can reach (the aligned writer, bench/bench_limit.py). It prints
a header describing the machine and one fixed-width row per method; ``--json`` keeps every raw
timing. See docs/BENCHMARK.md.

Importing this module does nothing; :func:`main` runs the benchmark.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gds_persist  # noqa: E402
from bench import chart, machine, methods, report  # noqa: E402
from bench.bench_limit import AlignedLimit  # noqa: E402
from bench.drive import DriveProbe, fio_version  # noqa: E402
from bench.state import DTYPES, make_state_dict, summarize  # noqa: E402
from gds_persist.progress import cli_progress  # noqa: E402

DEFAULT_SIZE = "2GiB"
DEFAULT_RUNS = 3
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"8MiB"``, ``"1.5g"`` or plain bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"size {text!r}: use a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least 1 MiB")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers")
    return values


def new_parser(prog: str, doc: str | None, size_help: str) -> argparse.ArgumentParser:
    """A benchmark's parser: described by the first paragraph of ``doc``, with ``--size``."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE),
                   help=f"{size_help} (default {DEFAULT_SIZE})")
    return p


def device_of(name: str) -> torch.device:
    """``--device`` as a torch.device; exits saying so where it is CUDA and there is none."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch.cuda.is_available() is False on this machine")
    return device


def require_known(keys: list[str], known: list[str]) -> None:
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(known)}")


@contextmanager
def work_directory(directory: str | None, prefix: str) -> Iterator[str]:
    """A temporary subdirectory of ``directory`` (default bench/out), removed afterwards."""
    base = directory or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield workdir
    finally:
        methods.remove(workdir)


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("bench_io.py", __doc__, "state dict size, e.g. 2GiB, 512MiB")
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                   help=f"timed repetitions per method, median and spread reported "
                        f"(default {DEFAULT_RUNS})")
    p.add_argument("--dir", default=None,
                   help="directory on the drive to test; a temporary subdirectory is created "
                        "and removed (default: bench/out/ in the repository)")
    p.add_argument("--json", dest="json_out", default=None, help="write everything to this file")
    p.add_argument("--svg", dest="svg_out", default=None,
                   help="write the bar chart here as SVG (bench/chart.py, no dependency; "
                        "make bench writes bench/out/bench_io.svg)")
    p.add_argument("--png", dest="png_out", default=None,
                   help="write a bar chart here (needs matplotlib; skipped with a message)")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of: " + ", ".join(methods.REGISTRY))
    p.add_argument("--dtype", choices=DTYPES, default="mixed",
                   help="mixed (default): bf16 params + fp32 master/exp_avg/exp_avg_sq "
                        "(14 B/param); fp32: fp32 params + exp_avg/exp_avg_sq (12 B/param)")
    p.add_argument("--device", default="cpu",
                   help="where the state dict lives: cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0, help="state dict generator seed (default 0)")
    p.add_argument("--dcp-threads", type=_int_list, default=(1, 2, 4),
                   help="DCP FileSystemWriter thread counts to calibrate, one save each "
                        "(default 1,2,4); give one value to skip the calibration")
    p.add_argument("--no-fio", action="store_true",
                   help="measure the drive limit with the Python O_DIRECT stream even if fio "
                        "is installed")
    p.add_argument("--cache-drop", choices=machine.CACHE_MODES, default="auto",
                   help="how the page cache is emptied before each load: global = drop_caches "
                        "(root), per-file = posix_fadvise(DONTNEED) on the checkpoint's files; "
                        "auto (default) = global as root, else per-file")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds (a save and a load of every method) before the timed "
                        "ones (default 1): the process's first large allocations fault in "
                        "fresh pages at several times the later cost, which would otherwise "
                        "fall on whichever method runs first")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the first load of each method with the source tensors")
    return p


_T0 = [time.perf_counter()]


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the report), with seconds since the run started."""
    clear = "\r\033[K" if sys.stderr.isatty() else ""  # over the progress bar, if one is drawn
    print(f"{clear}[{time.perf_counter() - _T0[0]:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _check(method: methods.Method, ctx: methods.Context, loaded: Any,
           expected: dict[str, torch.Tensor]) -> str | None:
    """None if every source tensor came back bit-exact under its key, else what differs."""
    got = method.loaded_tensors(ctx, loaded)
    missing = [k for k in expected if k not in got]
    if missing:
        return f"{len(missing)} tensor(s) missing after load, e.g. {missing[0]}"
    for k, t in expected.items():
        g = got[k]
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g.to(t.device), t):
            return f"tensor {k} differs after load"
    return None


def _load_resident(m: methods.Method, ctx: methods.Context, path: str) -> Any:
    """The method's load; for a lazy (mmap) loader also a touch of every page it returned."""
    loaded = m.load(ctx, path)
    if m.lazy_load:
        methods.touch_pages(list(m.loaded_tensors(ctx, loaded).values()))
    return loaded


def _save_and_load(m: methods.Method, ctx: methods.Context, path: str, cache_mode: str,
                   cache: dict[str, Any], disk: dict[str, int], resident: dict[str, int],
                   expected: dict[str, torch.Tensor],
                   checks: dict[str, str]) -> tuple[float, float]:
    """One repetition of one method: timed durable save, cache eviction, timed cold load.

    Records what it saw in ``cache``, ``disk``, ``resident`` and ``checks`` (the bit-exact
    comparison with ``expected``, when given)."""
    methods.remove(path)
    os.sync()  # untimed: nothing dirty from earlier steps is flushed inside this save
    s_save, _ = _timed(ctx, m.save, ctx, path)
    disk[m.key] = methods.disk_bytes(path)
    cache["how"], cache["detail"] = machine.drop_page_cache([path], cache_mode)
    cached = machine.resident_bytes([path])
    if cached is not None:
        resident[m.key] = max(resident.get(m.key, 0), cached)
    s_load, loaded = _timed(ctx, _load_resident, m, ctx, path)
    if expected:
        problem = _check(m, ctx, loaded, expected)
        if problem:
            checks[m.key] = problem
            log(f"  WARNING {m.key}: {problem}")
    return s_save, s_load


def _warm_up(args: argparse.Namespace, available: list[methods.Method], ctx: methods.Context,
             workdir: str, cache: dict[str, Any]) -> None:
    """``args.warmup`` untimed rounds of every method; nothing is recorded."""
    for k in range(args.warmup):
        log(f"warm-up {k + 1}/{args.warmup} (untimed)")
        for m in available:
            path = os.path.join(workdir, m.key)
            try:
                _save_and_load(m, ctx, path, args.cache_drop, cache, {}, {}, {}, {})
            except Exception as e:  # noqa: BLE001 - the timed run reports the failure
                log(f"  warm-up of {m.key} failed: {type(e).__name__}: {e}")
            finally:
                gc.collect()
                methods.remove(path)


def _timed(ctx: methods.Context, fn: Any, *args: Any) -> tuple[float, Any]:
    ctx.synchronize()
    t0 = time.perf_counter()
    result = fn(*args)
    ctx.synchronize()
    return time.perf_counter() - t0, result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed ``args``; print as it goes; return the record."""
    t_start = _T0[0] = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    device = device_of(args.device)
    keys = [k.strip() for k in args.methods.split(",") if k.strip()] if args.methods else None
    require_known(keys or [], list(methods.REGISTRY))
    with work_directory(args.dir, "bench-") as workdir:
        return _run_in(args, device, keys, workdir, started, t_start)


def _run_in(args: argparse.Namespace, device: torch.device, keys: list[str] | None,
            workdir: str, started: str, t_start: float) -> dict[str, Any]:
    facts = machine.describe(workdir)
    log(f"generating a {args.size / 2**30:.2f} GiB {args.dtype} state dict (seed {args.seed}) "
        f"on {device} ...")
    t0 = time.perf_counter()
    sd = make_state_dict(args.size, dtype=args.dtype, seed=args.seed, device=device)
    summ = summarize(sd)
    cfg = sd["config"]
    log(f"  {summ.tensors} tensors in {time.perf_counter() - t0:.1f}s")
    ctx = methods.Context(sd=sd, summary=summ, workdir=workdir, device=device,
                          dcp_threads=tuple(args.dcp_threads),
                          o_direct=facts["o_direct"]["supported"])
    chosen = methods.select(ctx, keys)
    for m, why in chosen.unavailable:
        log(f"  not available: {m.label or m.key}: {why}")
    for m in chosen.available:
        log(f"  preparing {m.key} ...")
        m.prepare(ctx)

    # The reference drive limit runs as many fio jobs (files) as gds_persist has I/O threads,
    # so "x drive" compares like with like; one job is shown beside it.
    jobs = gds_persist.settings.current().io_threads
    probe = DriveProbe(workdir, summ.payload_bytes, use_fio=not args.no_fio,
                       o_direct=ctx.o_direct, jobs=jobs)
    single = (DriveProbe(workdir, summ.payload_bytes, use_fio=not args.no_fio,
                         o_direct=ctx.o_direct) if jobs > 1 and probe.tool.startswith("fio")
              else None)
    limit = AlignedLimit(workdir, [t for _, t in _source_tensors(sd)], jobs,
                         gds_persist.settings.current().block_bytes, o_direct=ctx.o_direct)
    limit_w = report.Series("limit", "aligned-writer limit", "save", limit.nbytes, limit=True,
                            tool=limit.tool)
    limit_r = report.Series("limit", "aligned-reader limit", "load", limit.nbytes, limit=True,
                            tool=limit.tool)
    expected = dict(_source_tensors(sd)) if not args.no_check else {}
    drive_w = report.Series("drive", "drive limit", "save", probe.nbytes, drive=True)
    drive_r = report.Series("drive", "drive limit", "load", probe.nbytes, drive=True)
    single_w = report.Series("drive-1", "drive limit: fio 1 job", "save", probe.nbytes)
    single_r = report.Series("drive-1", "drive limit: fio 1 job", "load", probe.nbytes)
    series: dict[tuple[str, str], report.Series] = {}
    for m in chosen.available:
        for op in ("save", "load"):
            label = (m.load_label or m.label) if op == "load" else m.label
            series[(m.key, op)] = report.Series(m.key, label, op, summ.payload_bytes,
                                                baseline=m.baseline)
    disk: dict[str, int] = {}
    checks: dict[str, str] = {}
    cache: dict[str, Any] = {"how": "none", "detail": "not attempted"}
    resident: dict[str, int] = {}  # most checkpoint bytes still cached right before a load
    failed: dict[str, str] = {}
    items: list[methods.Method | None] = [None, *chosen.available]  # None = the drive limit
    order: list[list[str]] = []
    drive_runs: list[dict[str, Any]] = []
    bar = cli_progress("bench")  # on a terminal only: bytes saved + loaded by all runs so far
    moved, to_move = 0, args.runs * len(items) * 2 * summ.payload_bytes
    _warm_up(args, chosen.available, ctx, workdir, cache)
    for rep in range(args.runs):
        shift = rep % len(items)
        this = items[shift:] + items[:shift]
        order.append([("drive" if m is None else m.key) for m in this])
        log(f"run {rep + 1}/{args.runs}: " + ", ".join(order[-1]))
        for m in this:
            if m is None:
                for p, sw, sr in ((probe, drive_w, drive_r), (single, single_w, single_r)):
                    if p is None:
                        continue
                    w, r = _drive_once(p, args.cache_drop, cache)
                    drive_runs.append({"jobs": p.jobs, "write": w.__dict__, "read": r.__dict__})
                    sw.seconds.append(w.seconds)
                    sr.seconds.append(r.seconds)
                    sw.nbytes, sr.nbytes = w.nbytes, r.nbytes
                    disk[sw.key] = w.nbytes
                    if p is probe:
                        drive_w.tool = drive_r.tool = w.tool
                    log(f"  drive  write {w.nbytes / w.seconds / 1e9:6.2f} GB/s  "
                        f"read {r.nbytes / r.seconds / 1e9:6.2f} GB/s  ({p.tool})")
                w, r = _drive_once(limit, args.cache_drop, cache)
                limit_w.seconds.append(w.seconds)
                limit_r.seconds.append(r.seconds)
                disk["limit"] = limit.nbytes
                log(f"  limit  write {w.nbytes / w.seconds / 1e9:6.2f} GB/s  "
                    f"read {r.nbytes / r.seconds / 1e9:6.2f} GB/s  ({limit.tool})")
                moved += 2 * summ.payload_bytes
                if bar is not None:
                    bar(min(moved, to_move), to_move)
                continue
            path = os.path.join(workdir, m.key)
            try:
                s_save, s_load = _save_and_load(m, ctx, path, args.cache_drop, cache, disk,
                                                resident, expected if rep == 0 else {}, checks)
            except Exception as e:  # noqa: BLE001 - one broken method must not stop the run
                failed[m.key] = f"{type(e).__name__}: {e}"
                log(f"  FAILED {m.key}: {failed[m.key]} (dropped from the remaining runs)")
                items.remove(m)
                continue
            finally:
                gc.collect()
                methods.remove(path)
            series[(m.key, "save")].seconds.append(s_save)
            series[(m.key, "load")].seconds.append(s_load)
            log(f"  {m.key:<12} save {summ.payload_bytes / s_save / 1e9:6.2f} GB/s  "
                f"load {summ.payload_bytes / s_load / 1e9:6.2f} GB/s")
            moved += 2 * summ.payload_bytes
            if bar is not None:
                bar(min(moved, to_move), to_move)
    if bar is not None:
        bar(to_move, to_move)
        bar.close()
    drive_w.tool = drive_r.tool = drive_w.tool or probe.tool
    cache["resident_before_load"] = resident
    limit.close()

    done = [m for m in chosen.available if m.key not in failed]
    singles_w, singles_r = ([single_w], [single_r]) if single is not None else ([], [])
    all_series = [limit_w, drive_w, *singles_w, *(series[(m.key, "save")] for m in done),
                  limit_r, drive_r, *singles_r, *(series[(m.key, "load")] for m in done)]
    table = report.rows(all_series)
    elapsed = time.perf_counter() - t_start
    record: dict[str, Any] = {
        "schema": "gds_persist-bench/1",
        "started": started,
        "elapsed_s": elapsed,
        "argv": sys.argv,
        "config": {"size_requested": args.size, "runs": args.runs, "warmup": args.warmup,
                   "dtype": args.dtype,
                   "seed": args.seed, "device": str(device), "methods": keys,
                   "dcp_threads": list(args.dcp_threads), "directory": workdir},
        "machine": facts,
        "gpu_line": machine.gpu_line(facts["gpu"]),
        "state": {**summ.__dict__, "shape": cfg,
                  "description": (f"GPT {cfg['layers']} layers, hidden {cfg['hidden']}, vocab "
                                  f"{cfg['vocab']} (tied LM head), Adam; {summ.tensors} tensors "
                                  f"({summ.small_tensors} under 64 KiB), largest "
                                  f"{summ.largest_bytes / 2**20:.1f} MiB")},
        "cache": cache,
        "limit": {"tool": limit.tool, "bytes": limit.nbytes},
        "drive": {"tool": drive_w.tool, "notes": probe.notes, "fio": fio_version(),
                  "bytes": probe.nbytes, "runs": drive_runs},
        "methods": [{"key": m.key, "label": m.label, "load_label": m.load_label or m.label,
                     "available": True, "notes": m.notes,
                     "info": m.info, "disk_bytes": disk.get(m.key),
                     "check": checks.get(m.key, "ok" if expected else "skipped"),
                     "failed": failed.get(m.key)}
                    for m in chosen.available]
        + [{"key": m.key, "label": m.label, "available": False, "reason": why}
           for m, why in chosen.unavailable],
        "order": order,
        "series": [{"key": s.key, "label": s.label, "op": s.op, "nbytes": s.nbytes,
                    "seconds": s.seconds, "gbps": s.gbps, "tool": s.tool} for s in all_series],
        "rows": table,
        "per_run": per_run_ratios(series, args.runs),
    }
    print_report(record, disk)
    if args.json_out:
        report.to_json(record, args.json_out)
        print(f"JSON written to {args.json_out}")
    if args.svg_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.svg_out)), exist_ok=True)
        git = facts["versions"].get("gds_persist_git")
        print(chart.write_svg(record, args.svg_out, f"{started[:10]}"
                              + (f", gds_persist at {git}" if git else "")))
    if args.png_out:
        print(report.to_png(record, args.png_out))
    return record


def _drive_once(probe: DriveProbe | AlignedLimit, cache_drop: str,
                cache: dict[str, Any]) -> tuple[Any, Any]:
    """One drive-limit (or aligned-writer) write and cold read with ``probe``; its files are
    removed after."""
    os.sync()
    w = probe.write()
    cache["how"], cache["detail"] = machine.drop_page_cache([probe.directory], cache_drop)
    r = probe.read()
    probe.cleanup()
    return w, r


def _source_tensors(sd: Any) -> list[tuple[str, torch.Tensor]]:
    from bench.state import iter_tensors

    return iter_tensors(sd)


def per_run_ratios(series: dict[tuple[str, str], report.Series],
                   runs: int) -> list[dict[str, float]]:
    """Per repetition, the load ratios the read-mode rule answers for, each of methods measured
    side by side in that repetition: ``auto_vs_faster`` = gds-auto's load time / the faster of
    gds-direct and gds-buffered (1.05 = 5% slower), ``auto_x_torch`` = torch.load's time /
    gds-auto's (above 1: faster than torch.load). Only where those methods ran every time."""
    def seconds(key: str) -> list[float] | None:
        s = series.get((key, "load"))
        return s.seconds if s is not None and len(s.seconds) == runs else None

    auto, direct, buffered, torch_ = (seconds(k) for k in ("gds-auto", "gds-direct",
                                                            "gds-buffered", "torch"))
    out: list[dict[str, float]] = [{} for _ in range(runs)]
    for r in range(runs):
        if auto and direct and buffered:
            out[r]["auto_vs_faster"] = auto[r] / min(direct[r], buffered[r])
        if auto and torch_:
            out[r]["auto_x_torch"] = torch_[r] / auto[r]
    return out if any(out) else []


def per_run_lines(per_run: list[dict[str, float]]) -> list[str]:
    lines = []
    for r, ratios in enumerate(per_run, 1):
        shown = []
        if "auto_vs_faster" in ratios:
            shown.append(f"auto / faster of direct, buffered {ratios['auto_vs_faster']:.3f}")
        if "auto_x_torch" in ratios:
            shown.append(f"auto {ratios['auto_x_torch']:.2f}x torch.load")
        lines.append(f"load, run {r}: " + "; ".join(shown))
    return lines


def print_report(record: dict[str, Any], disk: dict[str, int]) -> None:
    warmup = record["config"].get("warmup", 0)
    lines = report.header_lines(record, runs_note=(
        f"{report.RUNS_NOTE}; after {warmup} untimed warm-up round(s) of every method"))
    lines.append("")
    lines += report.table_lines(record["rows"], disk)
    lines.append("")
    lines += report.LEGEND
    for m in record["methods"]:
        if not m["available"]:
            lines.append(f"not run: {m['label'] or m['key']}: {m['reason']}")
        elif m["failed"]:
            lines.append(f"FAILED (no row): {m['label']}: {m['failed']}")
    for m in record["methods"]:
        if m["available"]:
            extra = list(m["notes"])
            if m["check"] not in ("ok", "skipped"):
                extra.append("LOAD CHECK FAILED: " + m["check"])
            if m["info"].get("reason"):
                extra.append(f"backend {m['info'].get('backend')}: {m['info']['reason']}")
            if m["info"].get("load_reason"):
                extra.append(f"load backend {m['info']['load_backend']}: "
                             f"{m['info']['load_reason']}")
            if extra:
                lines.append(f"{m['label']}: " + "; ".join(extra))
    lines += per_run_lines(record.get("per_run", []))
    lines.append(f"elapsed {record['elapsed_s']:.1f}s")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

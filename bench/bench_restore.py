"""Restore into a live model and optimizer (issue 18): time and peak memory of every method.

    python bench/bench_restore.py [--size 2GiB] [--runs 3] [--dir DIR] [--device cpu|cuda]
                                  [--methods torch,gds-into,...] [--json OUT] [--tiny]

A GPT-like model (bench/bench_train.py's ``GPT``, fp32, tied embedding and LM head) and its
AdamW optimizer, with the optimizer state created and every byte touched as after a training
step, are restored from a checkpoint of the same shapes (other values, another learning rate) by
each method (:data:`METHODS`), next to fio's cold read with as many jobs as gds_persist has I/O
threads (bench/drive.py). Every measurement of a method runs in a fresh process, so its host
peak is its own: the live model is built first, then the page cache is dropped, the peak RSS is
reset (``/proc/self/clear_refs``) and ``VmHWM`` read before and after the timed restore; with
``--device cuda`` also ``torch.cuda.max_memory_allocated`` growth. Methods run interleaved, the
order rotated every repetition; ratios are medians of per-repetition ratios. The first
measurement of each method then compares every tensor and the learning rate with the saved
state, outside the timing. docs/BENCHMARK.md explains the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import re
import sys
import time
import zlib
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gds_persist  # noqa: E402
from bench import machine, methods, report  # noqa: E402
from bench.bench_fewer_bytes import fingerprints  # noqa: E402
from bench.bench_io import device_of, log, new_parser, require_known, work_directory  # noqa: E402
from bench.bench_train import GPT  # noqa: E402
from bench.drive import DriveProbe, fio_version  # noqa: E402
from bench.state import GPTShape, choose_shape, iter_tensors, summarize  # noqa: E402
from gds_persist.transfer.commit import fsync_path  # noqa: E402

SAVED_LR, LIVE_LR = 3e-4, 1e-3  # a restore must bring back the saved learning rate
SAVED_STEP = 1000.0


# --------------------------------------------------------------------------- the live objects


def build_live(shape: GPTShape, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """The model and AdamW as after a training step: parameters and state allocated and touched."""
    with torch.device("meta"):  # no init pass: the values are set below
        model = GPT(shape.vocab, shape.context, shape.hidden, shape.layers, shape.hidden // 64)
    model.to_empty(device=device)
    model.head.weight = model.tok.weight  # to_empty unties them
    opt = torch.optim.AdamW(model.parameters(), lr=LIVE_LR)
    for p in model.parameters():
        p.detach().fill_(0.01)
    gds_persist.init_optimizer_state(opt)  # a step with zero gradients: step, exp_avg, exp_avg_sq
    return model, opt


def live_state(model: GPT, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def canonical_keys(state: dict[str, Any]) -> dict[str, str]:
    """Each tensor's key -> the first key holding its storage (the tied LM head -> the
    embedding), so both keys expect the same saved values."""
    first: dict[int, str] = {}
    return {k: first.setdefault(t.untyped_storage().data_ptr(), k) for k, t in iter_tensors(state)}


def saved_value(key: str, like: torch.Tensor, seed: int) -> torch.Tensor:
    """The value the checkpoint holds under (canonical) ``key``: seeded per key, on the CPU."""
    if like.dim() == 0:
        return torch.tensor(SAVED_STEP, dtype=like.dtype)  # AdamW's step counters
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))  # CPU: 32 bits
    values = torch.empty(like.shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen)
    return values.to(like.dtype)


def check(model: GPT, opt: torch.optim.Optimizer, expected: dict[str, str]) -> str:
    """``"ok"`` if every tensor's SHA-256 and the learning rate are the saved ones, else what
    differs."""
    got = fingerprints(live_state(model, opt))
    if set(got) != set(expected):
        return f"keys differ after the restore: {sorted(set(got) ^ set(expected))[:3]}"
    wrong = [k for k in got if got[k] != expected[k]]
    if wrong:
        return f"{len(wrong)} tensor(s) differ from the saved ones, e.g. {wrong[0]}"
    lr = opt.param_groups[0]["lr"]
    return "ok" if lr == SAVED_LR else f"learning rate {lr} after the restore, saved {SAVED_LR}"


# --------------------------------------------------------------------------- the checkpoints


def _save_torch(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _flat_for_safetensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors holds a flat dict of unshared tensors: tied keys are left out and named in
    the metadata, with the optimizer's param_groups."""
    canon = canonical_keys(state)
    flat = {k: t for k, t in iter_tensors(state) if canon[k] == k}
    ties = {k: c for k, c in canon.items() if c != k}
    return flat, {"ties": json.dumps(ties),
                  "param_groups": json.dumps(state["optim"]["param_groups"])}


def _save_safetensors(state: dict[str, Any], path: str) -> None:
    from safetensors.torch import save_file

    flat, metadata = _flat_for_safetensors(state)
    save_file(flat, path, metadata=metadata)
    fsync_path(path)


def _save_dcp(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with methods._quiet_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _save_dcp_gds(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistWriter

    with methods._quiet_dcp():
        dcp.save(state, storage_writer=GdsPersistWriter(path), no_dist=True)


FORMATS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "torch.pt": _save_torch, "model.safetensors": _save_safetensors, "dcp": _save_dcp,
    "dcp-gds": _save_dcp_gds, "gds": lambda state, path: gds_persist.save(state, path),
    "gds.pt": lambda state, path: gds_persist.save(state, path, format="torch")}


def save_checkpoints(shape: GPTShape, device: torch.device, seed: int, workdir: str,
                     formats: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the saved state in every format needed; returns its summary (payload bytes...) and
    the SHA-256 of every tensor, which the first restore of each method is checked against."""
    model, opt = build_live(shape, device)
    for g in opt.param_groups:
        g["lr"] = SAVED_LR
    state = live_state(model, opt)
    canon = canonical_keys(state)
    with torch.no_grad():
        for key, t in iter_tensors(state):
            if canon[key] == key:
                t.copy_(saved_value(key, t, seed))
    for name in formats:
        log(f"  saving {name} ...")
        FORMATS[name](state, os.path.join(workdir, name))
    fsync_path(workdir)
    return summarize(state).__dict__, fingerprints(state)


# --------------------------------------------------------------------------- the methods


def _load_torch(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                device: torch.device) -> None:
    sd = torch.load(os.path.join(workdir, "torch.pt"), map_location=device, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def _load_torch_mmap(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                     device: torch.device) -> None:
    sd = torch.load(os.path.join(workdir, "torch.pt"), map_location=device, weights_only=True,
                    mmap=True)
    model.load_state_dict(sd["model"], assign=True)  # the mapped tensors replace the live ones
    opt.load_state_dict(sd["optim"])


def _load_safetensors(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                      device: torch.device) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(workdir, "model.safetensors")
    flat = load_file(path, device=str(device))
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    for key, src in json.loads(meta["ties"]).items():
        flat[key] = flat[src]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        if key.startswith("optim.state."):
            index, name = key[len("optim.state."):].split(".", 1)
            state.setdefault(int(index), {})[name] = t
    model.load_state_dict({k[len("model."):]: t for k, t in flat.items()
                           if k.startswith("model.")})
    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def _dcp_loader(reader: Callable[[str], Any]) -> Callable[..., None]:
    def restore(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                device: torch.device) -> None:
        import torch.distributed.checkpoint as dcp

        state = live_state(model, opt)  # DCP fills these tensors, then load_state_dict as DCP says
        with methods._quiet_dcp():
            dcp.load(state, storage_reader=reader(workdir), no_dist=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    return restore


def _fs_reader(workdir: str) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(os.path.join(workdir, "dcp"))


def _gds_reader(workdir: str) -> Any:
    from gds_persist.dcp import GdsPersistReader

    return GdsPersistReader(os.path.join(workdir, "dcp-gds"))


def _load_gds(model: GPT, opt: torch.optim.Optimizer, workdir: str,
              device: torch.device) -> None:
    sd = gds_persist.load(os.path.join(workdir, "gds"), map_location=device)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


_LOAD_INFO: list[Any] = []  # the LoadInfo of this process's gds_persist restore (its read mode)


def _load_gds_into(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                   device: torch.device) -> None:
    restored, info = gds_persist.load_with_info(os.path.join(workdir, "gds"), into=live_state(model,
                                                                                              opt))
    _LOAD_INFO[:] = [info]
    opt.load_state_dict(restored["optim"])  # its tensors are the optimizer's: the lr etc.


def _gds_into_file(name: str) -> Callable[..., None]:
    """load(into=) of a torch.save file (``torch.pt``: stock torch.save; ``gds.pt``: ours)."""
    def restore(model: GPT, opt: torch.optim.Optimizer, workdir: str,
                device: torch.device) -> None:
        restored, info = gds_persist.load_with_info(os.path.join(workdir, name),
                                                    into=live_state(model, opt))
        _LOAD_INFO[:] = [info]
        opt.load_state_dict(restored["optim"])
    return restore


def _needs(module: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001
            return f"{module} not importable ({e})"
        return None
    return probe


class Restore:
    """One method: its row label, the checkpoint it reads, the restore, and why it cannot run."""

    def __init__(self, label: str, fmt: str, restore: Callable[..., None], lazy: bool = False,
                 unavailable: Callable[[], str | None] = lambda: None):
        self.label, self.fmt, self.restore, self.lazy = label, fmt, restore, lazy
        self.unavailable = unavailable


METHODS: dict[str, Restore] = {
    "torch": Restore("torch.load + load_state_dict", "torch.pt", _load_torch),
    "torch-mmap": Restore("torch.load(mmap) + assign=True", "torch.pt", _load_torch_mmap,
                          lazy=True),
    "safetensors": Restore("safetensors load_file + lsd", "model.safetensors",
                           _load_safetensors, lazy=True, unavailable=_needs("safetensors.torch")),
    "dcp": Restore("DCP FileSystemReader", "dcp", _dcp_loader(_fs_reader),
                   unavailable=_needs("torch.distributed.checkpoint")),
    "dcp-gds": Restore("DCP GdsPersistReader", "dcp-gds", _dcp_loader(_gds_reader),
                       unavailable=_needs("torch.distributed.checkpoint")),
    "gds": Restore("gds_persist.load + lsd", "gds", _load_gds),
    "gds-into": Restore("gds_persist.load(into=)", "gds", _load_gds_into),
    "gds-into-torch": Restore("gds_persist.load(into=) torch.save file", "torch.pt",
                              _gds_into_file("torch.pt")),
    "gds-into-gds.pt": Restore("gds_persist.load(into=) gds .pt file", "gds.pt",
                               _gds_into_file("gds.pt")),
}
FIO = "fio"  # the drive row's key


# --------------------------------------------------------------------------- one measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))  # type: ignore


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process: build, drop the cache, timed restore, check."""
    device = torch.device(spec["device"])
    for name in PRELOAD[1:]:
        _needs(name)()  # imported before the timing, as the server did unless it failed
    method = METHODS[spec["method"]]
    model, opt = build_live(GPTShape(**spec["shape"]), device)
    cache = machine.drop_page_cache([os.path.join(spec["workdir"], method.fmt)],
                                    spec["cache_drop"])
    gc.collect()
    reset = _reset_peak_rss()
    before = _status_kib("VmHWM")
    cuda_before = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    method.restore(model, opt, spec["workdir"], device)
    if method.lazy:  # mapped file pages: read them inside the timing, as the eager loaders do
        methods.touch_pages([t for _, t in iter_tensors(live_state(model, opt))])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "hwm_growth": (_status_kib("VmHWM") - before) * 1024,
           "hwm_reset": reset, "cache": cache,
           "cuda_growth": (torch.cuda.max_memory_allocated(device) - cuda_before
                           if device.type == "cuda" else None)}
    if _LOAD_INFO:  # which read mode the restore took, and why
        out["load_backend"], out["load_reason"] = _LOAD_INFO[0].backend, _LOAD_INFO[0].reason
    if spec["expected"]:
        out["check"] = check(model, opt, spec["expected"])
    return out


PRELOAD = ("bench.bench_restore", "torch.distributed.checkpoint", "safetensors.torch",
           "gds_persist.dcp")
CHILD_TIMEOUT_S = 1800


def _forked(spec: dict[str, Any], conn: Any) -> None:
    try:
        conn.send(child(spec))
    except BaseException as e:  # noqa: BLE001 - reported as the method's failure
        conn.send({"failed": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`child` in a fresh process, forked from a server that imported torch once (an
    import costs ~13 s on this shared 2-core machine); its result, or ``{"failed": why}``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked, args=(spec, send), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(CHILD_TIMEOUT_S):
            proc.kill()
            return {"failed": f"no result within {CHILD_TIMEOUT_S} s"}
        return recv.recv()
    except EOFError:
        return {"failed": f"the measurement process died (exit status {proc.exitcode})"}
    finally:
        proc.join()
        recv.close()


# --------------------------------------------------------------------------- the run


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("bench_restore.py", __doc__, "model + AdamW state size")
    p.add_argument("--runs", type=int, default=3, help="measurements per method (default 3)")
    p.add_argument("--dir", default=None,
                   help="directory on the drive (e.g. /dev/shm/bench for RAM); a temporary "
                        "subdirectory is created and removed (default bench/out)")
    p.add_argument("--device", default="cpu", help="where the live model lives: cpu or cuda")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of: " + ", ".join([*METHODS, FIO]))
    p.add_argument("--seed", type=int, default=0, help="seed of the saved values (default 0)")
    p.add_argument("--cache-drop", choices=machine.CACHE_MODES, default="auto",
                   help="how the page cache is emptied before each restore (as bench_io.py)")
    p.add_argument("--no-fio", action="store_true", help="Python O_DIRECT stream, not fio")
    p.add_argument("--json", dest="json_out", default=None, help="write everything here")
    p.add_argument("--tiny", action="store_true", help="smoke test: 8 MiB, one run")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.tiny:
        args.size, args.runs = 8 << 20, 1
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    device = device_of(args.device)
    keys = [k.strip() for k in args.methods.split(",")] if args.methods else [*METHODS, FIO]
    require_known(keys, [*METHODS, FIO])
    with work_directory(args.dir, "restore-") as workdir:
        return _run_in(args, device, keys, workdir)


def _run_in(args: argparse.Namespace, device: torch.device, keys: list[str],
            workdir: str) -> dict[str, Any]:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    facts = machine.describe(workdir)
    skipped = {k: why for k in keys if k in METHODS and (why := METHODS[k].unavailable())}
    chosen = [k for k in keys if k in METHODS and k not in skipped]
    shape = choose_shape(args.size, "fp32")
    log(f"saving a {args.size / 2**30:.2f} GiB GPT ({shape}) + AdamW state on {device} ...")
    state, expected = save_checkpoints(shape, device, args.seed, workdir,
                             sorted({METHODS[k].fmt for k in chosen}))
    gc.collect()
    payload = state["payload_bytes"]
    probe = DriveProbe(workdir, payload, use_fio=not args.no_fio, o_direct=facts["o_direct"][
        "supported"], jobs=gds_persist.settings.current().io_threads) if FIO in keys else None
    if probe is not None:
        probe.write()
    series = {k: report.Series(k, METHODS[k].label, "load", payload, baseline=k == "torch")
              for k in chosen}
    if probe is not None:
        series[FIO] = report.Series(FIO, "fio read", "load", probe.nbytes, tool=probe.tool,
                                    drive=True)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in series}
    failed: dict[str, str] = {}
    cache = {"how": "none", "detail": "not attempted"}
    items = list(series)
    for rep in range(args.runs):
        order = items[rep % len(items):] + items[:rep % len(items)]
        log(f"run {rep + 1}/{args.runs}: {', '.join(order)}")
        for key in order:
            if key in failed:
                continue
            if key == FIO:
                assert probe is not None
                cache["how"], cache["detail"] = machine.drop_page_cache([workdir], args.cache_drop)
                r = probe.read()
                series[key].seconds.append(r.seconds)
                series[key].nbytes = r.nbytes
                results[key].append({"seconds": r.seconds, "tool": r.tool})
                continue
            res = measure({"method": key, "workdir": workdir, "shape": shape.__dict__,
                           "device": str(device), "expected": expected if rep == 0 else None,
                           "cache_drop": args.cache_drop})
            if "failed" in res:
                failed[key] = res["failed"]
                log(f"  FAILED {key}: {res['failed']} (dropped from the remaining runs)")
                continue
            cache["how"], cache["detail"] = res["cache"]
            series[key].seconds.append(res["seconds"])
            results[key].append(res)
            log(f"  {key:<12} {res['seconds']:6.2f}s  host peak +{res['hwm_growth'] / 2**20:7.1f}"
                f" MiB" + (f"  check {res['check']}" if "check" in res else "")
                + (f"  read {res['load_backend']}" if "load_backend" in res else ""))
    if probe is not None:
        probe.cleanup()
    if facts["filesystem"]["fstype"] == "tmpfs":
        cache["detail"] = ("tmpfs: the checkpoint's pages are the file itself and cannot be "
                           "dropped; every restore reads RAM")
    done = [s for k, s in series.items() if k not in failed]
    record: dict[str, Any] = {
        "schema": "gds_persist-bench-restore/1", "started": started, "argv": sys.argv,
        "config": {"size_requested": args.size, "runs": args.runs, "device": str(device),
                   "seed": args.seed, "methods": keys, "directory": workdir},
        "machine": facts, "gpu_line": machine.gpu_line(facts["gpu"]),
        "state": {**state, "shape": shape.__dict__,
                  "description": (f"GPT {shape.layers} layers, hidden {shape.hidden}, vocab "
                                  f"{shape.vocab} (tied LM head), fp32 + AdamW (step, exp_avg, "
                                  f"exp_avg_sq); {state['tensors']} tensors")},
        "cache": {**cache, "resident_before_load": {}},
        "drive": {"tool": probe.tool if probe else "not run", "notes": probe.notes if probe
                  else [], "fio": fio_version()},
        "skipped": skipped, "failed": failed, "results": results,
        "rows": report.rows(done), "x_mmap": _x_mmap(series, failed),
        "staging_bytes": gds_persist.settings.current().staging_bytes,
    }
    record["elapsed_s"] = time.perf_counter() - t_start
    print("\n".join(report_lines(record)), flush=True)
    if args.json_out:
        report.to_json(record, args.json_out)
        print(f"JSON written to {args.json_out}")
    return record


def _x_mmap(series: dict[str, report.Series], failed: dict[str, str]) -> dict[str, float | None]:
    mmap = series.get("torch-mmap")
    if mmap is None or "torch-mmap" in failed:
        return {}
    return {k: report.paired_ratio(s.gbps, mmap.gbps) for k, s in series.items()
            if k not in failed and len(s.seconds) == len(mmap.seconds)}


COLUMNS = (("method", 31, "<"), ("s", 6, ">"), ("min-max s", 11, ">"), ("GB/s", 5, ">"),
           ("host peak +", 11, ">"), ("GPU peak +", 10, ">"), ("x torch", 7, ">"),
           ("x mmap", 6, ">"), ("x fio", 5, ">"), ("check", 5, "<"))


def _median_bytes(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    return report._bytes(report.summary(values)["median"]) if values else "-"


def report_lines(record: dict[str, Any]) -> list[str]:
    """The header, one fixed-width row per method, the legend, and what did not run."""
    title = f"gds_persist restore benchmark (live model + AdamW, {record['config']['device']})"
    lines = [*report.header_lines(record, title=title, runs_note=(
        "one fresh process per measurement, interleaved (order rotated every repetition)")), ""]
    table = [report.fixed_width(tuple(c[0] for c in COLUMNS), COLUMNS),
             report.fixed_width(tuple("-" * c[1] for c in COLUMNS), COLUMNS)]
    for r in record["rows"]:
        runs = record["results"][r["key"]]
        s, num = r["seconds"], report._num
        table.append(report.fixed_width((
            r["label"][:31], num(s["median"]), f"{num(s['min'])}-{num(s['max'])}",
            num(r["gbps"]["median"]), _median_bytes(runs, "hwm_growth"),
            _median_bytes(runs, "cuda_growth"), num(r["x_baseline"]),
            num(record["x_mmap"].get(r["key"])), num(r["x_drive"]),
            "-" if r["drive"] else runs[0].get("check", "-")[:5]), COLUMNS))
    lines += table + ["", *restore_legend(record)]
    lines += [f"not run: {k}: {why}" for k, why in record["skipped"].items()]
    lines += [f"FAILED (no row): {k}: {why}" for k, why in record["failed"].items()]
    lines += [f"CHECK FAILED: {k}: {runs[0]['check']}" for k, runs in record["results"].items()
              if runs and runs[0].get("check") not in (None, "ok")]
    lines.append(f"elapsed {record['elapsed_s']:.1f}s")
    return lines


def restore_legend(record: dict[str, Any]) -> list[str]:
    return [
        "s = seconds of the restore (median; min-max over the runs); GB/s = state payload "
        "(distinct storages) / s.",
        "host peak + = growth of VmHWM during the restore (peak RSS reset just before; mapped "
        "file pages count), median; GPU peak + = torch.cuda.max_memory_allocated growth; "
        f"staging_bytes = {report._bytes(record['staging_bytes'])}.",
        "x torch / x mmap / x fio = median over repetitions of this row's GB/s over the "
        "torch.load + load_state_dict / torch.load(mmap) / fio row of the same repetition.",
        "check = every tensor and the learning rate compared bit for bit with the saved state "
        "after the first restore of each method (outside the timing).",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

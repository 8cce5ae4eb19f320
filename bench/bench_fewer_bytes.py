"""Writing fewer bytes (issue 13): incremental checkpoints and lossless compression, measured.

    python bench/bench_fewer_bytes.py [--dir DIR] [--shm DIR] [--runs 5] [--checkpoints 6]
                                      [--state PATH] [--train-steps 300] [--tiny]
                                      [--json OUT] [--txt OUT]

Effective save rate = state-dict payload bytes / seconds of a durable save (fsync included),
divided by fio's sequential O_DIRECT write limit measured in the same run (bench/drive.py, as many
jobs as gds_persist has I/O threads; a plain Python O_DIRECT stream where fio is missing).

1. **Fine-tuning** with ~90% of the parameters frozen: a GPT whose blocks but the last are frozen
   (AdamW over the trainable ones), one optimizer step between checkpoints, ``--checkpoints`` in a
   row through ``Checkpointer(incremental=True, compression=--ft-compression)``, ``--runs`` times
   (each in a fresh root). Per checkpoint: seconds of the blocking save, its rate / fio. Every
   step's checkpoint is loaded back afterwards and compared bit for bit (SHA-256 of every
   tensor's bytes, taken before the save) with what was saved. The yardstick beside it: the
   bytes that change every step (trainable parameters and their AdamW state) written alone by
   a plain save and by fio of the same size, since a drive writes ~150 MB slower per byte than
   the 1 GiB of the fio row.
2. **Trained state**: the bf16 parameters, fp32 master weights and fp32 AdamW state of a GPT
   trained ``--train-steps`` AdamW steps (or the state saved at ``--state``: a ``torch.save`` of
   ``{"mp": {"bf16_params", "fp32_master", "exp_avg", "exp_avg_sq", ...}}``); per tensor kind
   and for all of it: the lossless compression ratio, and the rate / fio of ``compression="none"``,
   ``"auto"`` and ``"lossless"`` (what compressing costs where ``auto`` declines) on the disk
   (``--dir``) and on tmpfs (``--shm``), interleaved (order rotated per run), ``--runs`` times.
   Every compressed checkpoint is loaded back once and compared bit for bit.

Medians over runs are reported with min-max; ``--json`` keeps every raw timing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gds_persist  # noqa: E402
from bench import machine  # noqa: E402
from bench.bench_train import GPT  # noqa: E402
from bench.drive import DriveProbe, fio_version  # noqa: E402

KINDS = ("bf16_params", "fp32_master", "exp_avg", "exp_avg_sq")
MODES = ("none", "auto", "lossless")  # lossless: what compressing costs where auto declines


# --- a small GPT (bench/bench_train.py's) and a synthetic corpus ---------------------------

def markov_batches(vocab: int, context: int, batch: int, seed: int) -> Any:
    """A synthetic corpus: each token has 8 Zipf-distributed successors (weights k^-1.5)."""
    g = torch.Generator().manual_seed(seed)
    uni = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    succ = torch.multinomial((uni / uni.sum()).float(), vocab * 8, replacement=True,
                             generator=g).view(vocab, 8)
    w = 1.0 / torch.arange(1, 9, dtype=torch.float32) ** 1.5
    w = w / w.sum()
    while True:
        x = torch.empty(batch, context + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, 64, (batch,), generator=g)
        for t in range(context):
            k = torch.multinomial(w.expand(batch, 8), 1, generator=g).squeeze(1)
            x[:, t + 1] = succ[x[:, t], k]
        yield x[:, :-1], x[:, 1:]


def train_mixed_precision(steps: int, cfg: dict[str, int], log: Any) -> dict[str, Any]:
    """A GPT trained ``steps`` AdamW steps in mixed precision (bf16 autocast, fp32 master and
    AdamW state); returns the kinds of its state as dicts of tensors."""
    torch.manual_seed(1)
    model = GPT(cfg["vocab"], cfg["context"], cfg["d"], cfg["layers"], cfg["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batches = markov_batches(cfg["vocab"], cfg["context"], cfg["batch"], 1)
    t0 = time.perf_counter()
    for step in range(steps):
        for pg in opt.param_groups:
            pg["lr"] = 6e-4 * min(1.0, (step + 1) / 30) * (0.5 + 0.5 * math.cos(math.pi * step
                                                                                 / steps))
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  training: step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    names = [k for k, _ in model.named_parameters()]
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    st = opt.state_dict()["state"]
    return {"bf16_params": {k: v.to(torch.bfloat16) for k, v in params.items()},
            "fp32_master": params,
            "exp_avg": {names[i]: s["exp_avg"] for i, s in st.items()},
            "exp_avg_sq": {names[i]: s["exp_avg_sq"] for i, s in st.items()},
            "step": {names[i]: s["step"] for i, s in st.items()}}


# --- measuring ---------------------------------------------------------------------------------

def tensors_of(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in tensors_of(v, f"{prefix}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in tensors_of(v, f"{prefix}/{i}")]
    return []


def payload_bytes(tree: Any) -> int:
    seen = {}
    for _, t in tensors_of(tree):
        s = t.untyped_storage()
        seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def fingerprints(tree: Any) -> dict[str, str]:
    """SHA-256 of every tensor's bytes (independent of the library's own hashes)."""
    return {k: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                              .numpy()).hexdigest() for k, t in tensors_of(tree)}


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def drive_limit(directory: str, nbytes: int, use_fio: bool) -> dict[str, Any]:
    jobs = gds_persist.settings.current().io_threads
    probe = DriveProbe(directory, nbytes, use_fio=use_fio,
                       o_direct=machine.o_direct(directory)[0], jobs=jobs)
    os.sync()
    try:
        run = probe.write()
    finally:
        probe.cleanup()
    return {"bytes_per_s": run.nbytes / run.seconds, "tool": probe.tool, "notes": probe.notes}


# --- workload 1: fine-tuning ---------------------------------------------------------------------

def finetune(args: argparse.Namespace, workdir: str, log: Any) -> dict[str, Any]:
    cfg = args.ft_model
    torch.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["context"], cfg["d"], cfg["layers"], cfg["heads"])
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.blocks[-1].parameters():  # fine-tune the last block only
        p.requires_grad_(True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    batches = markov_batches(cfg["vocab"], cfg["context"], cfg["batch"], 2)
    log(f"fine-tuning: GPT {n_all / 1e6:.1f}M parameters, {n_train / 1e6:.2f}M trainable "
        f"({100 * n_train / n_all:.1f}%), AdamW over the trainable ones; "
        f"{args.checkpoints} checkpoints x {args.runs} runs, "
        f"Checkpointer(incremental=True, compression={args.ft_compression!r})")
    runs: list[dict[str, Any]] = []
    for r in range(args.runs):
        drive = drive_limit(workdir, args.fio_bytes, not args.no_fio)
        root = os.path.join(workdir, f"finetune-{r}")
        shutil.rmtree(root, ignore_errors=True)
        saves: list[dict[str, Any]] = []
        expected: dict[int, dict[str, str]] = {}
        with gds_persist.Checkpointer(root, keep_last=None, incremental=True,
                                      compression=args.ft_compression, warmup=False) as ckpt:
            for c in range(args.checkpoints):
                x, y = next(batches)
                loss = F.cross_entropy(model(x).view(-1, cfg["vocab"]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": c}
                expected[c] = fingerprints(state)
                payload = payload_bytes(state)
                t0 = time.perf_counter()
                info = ckpt.save(c, state, blocking=True).wait()
                seconds = time.perf_counter() - t0
                saves.append({"checkpoint": c, "seconds": seconds, "payload": payload,
                              "written": info.bytes_written, "referenced": info.referenced_bytes,
                              "compression": info.compression,
                              "compression_reason": info.compression_reason,
                              "x_fio": payload / seconds / drive["bytes_per_s"]})
        exact = all(fingerprints(gds_persist.load(os.path.join(root, f"step-{c:08d}")))
                    == expected[c] for c in range(args.checkpoints))
        shutil.rmtree(root, ignore_errors=True)
        floor = changed_bytes_alone(model, opt, workdir, not args.no_fio)
        runs.append({"drive": drive, "saves": saves, "exact": exact, "changed_alone": floor})
        log(f"  run {r}: fio {drive['bytes_per_s'] / 1e9:.2f} GB/s; x fio per checkpoint "
            + " ".join(f"{s['x_fio']:.2f}" for s in saves) + f"; restore exact: {exact}; "
            f"the {floor['nbytes'] / 1e6:.0f} MB that change alone: plain save "
            f"{floor['save_s'] * 1e3:.0f} ms, fio {floor['fio_s'] * 1e3:.0f} ms")
    later = [s["x_fio"] for run in runs for s in run["saves"][1:]]
    return {
        "model": cfg, "parameters": n_all, "trainable": n_train,
        "compression": args.ft_compression, "runs": runs,
        "x_fio_from_second": summary(later),
        "x_fio_first": summary([run["saves"][0]["x_fio"] for run in runs]),
        "fio_bytes_per_s": summary([run["drive"]["bytes_per_s"] for run in runs]),
        "written_fraction_from_second": summary(
            [s["written"] / s["payload"] for run in runs for s in run["saves"][1:]]),
        "all_exact": all(run["exact"] for run in runs),
        "target_x_fio": 5.0,
        "incremental_over_changed_alone": summary(
            [s["seconds"] / run["changed_alone"]["save_s"] for run in runs
             for s in run["saves"][1:]]),
    }


def changed_bytes_alone(model: torch.nn.Module, opt: torch.optim.Optimizer, workdir: str,
                        use_fio: bool) -> dict[str, float]:
    """The floor under an incremental save: the bytes that change every step (the trainable
    parameters and their optimizer state) written alone by a plain save (median of 3), and by
    fio, same size, same directory. On a real drive a write of ~150 MB does not reach the rate
    of a 1 GiB one (start-up and fsync latency), so this is the fair yardstick."""
    changed = {f"p{i}": p.detach() for i, p in enumerate(model.parameters()) if p.requires_grad}
    for i, st in enumerate(opt.state.values()):
        changed.update({f"s{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    nbytes = payload_bytes(changed)
    path = os.path.join(workdir, "changed-alone")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gds_persist.save(changed, path)
        times.append(time.perf_counter() - t0)
    shutil.rmtree(path, ignore_errors=True)
    fio = drive_limit(workdir, nbytes, use_fio)
    return {"nbytes": nbytes, "save_s": statistics.median(times),
            "fio_s": nbytes / fio["bytes_per_s"]}


# --- workload 2: a trained state ------------------------------------------------------------------

def trained_kinds(args: argparse.Namespace, log: Any) -> tuple[dict[str, Any], str]:
    if args.state:
        raw = torch.load(args.state, weights_only=True)
        mp = raw["mp"]
        what = f"{args.state} ({raw.get('config')})"
    else:
        mp = train_mixed_precision(args.train_steps, args.mp_model, log)
        what = f"trained here: {args.train_steps} AdamW steps, {args.mp_model}"
    kinds = {k: mp[k] for k in KINDS}
    kinds["all"] = {k: mp[k] for k in (*KINDS, "step")}
    return kinds, what


def trained_state(args: argparse.Namespace, targets: dict[str, str],
                  log: Any) -> dict[str, Any]:
    kinds, what = trained_kinds(args, log)
    log(f"trained state: {what}; payload " + ", ".join(
        f"{k} {payload_bytes(v) / 1e6:.1f} MB" for k, v in kinds.items()))
    out: dict[str, Any] = {"source": what, "kinds": {}, "targets": {}}
    check_dir = next(iter(targets.values()))
    for kind, state in kinds.items():  # the ratio, once, and a bit-exact load
        path = os.path.join(check_dir, f"ratio-{kind}")
        info = gds_persist.save(state, path,
                                options=gds_persist.SaveOptions(compression="lossless"))
        m = gds_persist.read_manifest(path)
        encoded = [e for e in m.extents if e.encoded]
        exact = fingerprints(gds_persist.load(path)) == fingerprints(state)
        out["kinds"][kind] = {
            "payload": info.payload_bytes, "written": info.bytes_written,
            "ratio_on_disk": sum(-(-s.nbytes // 4096) * 4096 for s in m.storages)
            / info.bytes_written,
            "ratio_encoded": (sum(e.length for e in encoded) / sum(e.stored for e in encoded)
                              if encoded else 1.0),
            "encoded_extents": len(encoded), "extents": len(m.extents), "exact": exact}
        shutil.rmtree(path)
    for target, directory in targets.items():
        rows: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in kinds}
        reasons: dict[str, list[str]] = {k: [] for k in kinds}
        fio = []
        for r in range(args.runs):
            drive = drive_limit(directory, args.fio_bytes, not args.no_fio)
            fio.append(drive["bytes_per_s"])
            for kind, state in kinds.items():
                order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]  # rotated: paired
                for mode in order:
                    path = os.path.join(directory, f"{kind}-{mode}")
                    os.sync()
                    t0 = time.perf_counter()
                    info = gds_persist.save(state, path,
                                            options=gds_persist.SaveOptions(compression=mode))
                    seconds = time.perf_counter() - t0
                    rows[kind][mode].append(info.payload_bytes / seconds / drive["bytes_per_s"])
                    if mode == "auto":
                        reasons[kind].append(info.compression_reason)
                    shutil.rmtree(path)
            log(f"  {target} run {r}: fio {drive['bytes_per_s'] / 1e9:.2f} GB/s; " + "; ".join(
                f"{k} " + " ".join(f"{m} {rows[k][m][-1]:.2f}" for m in MODES) for k in kinds))
        out["targets"][target] = {
            "directory": directory, "fio_bytes_per_s": summary(fio), "fio_raw": fio,
            "x_fio": {k: {m: summary(v) for m, v in modes.items()} for k, modes in rows.items()},
            "raw": rows, "auto_reasons": reasons,
            "auto_over_none": {k: summary([a / n for a, n in zip(rows[k]["auto"],
                                                                 rows[k]["none"], strict=True)])
                               for k in kinds}}
    return out


# --- report --------------------------------------------------------------------------------------

def _fmt(s: dict[str, Any], spec: str = "{:.2f}") -> str:
    if s.get("median") is None:
        return "-"
    return f"{spec.format(s['median'])} [{spec.format(s['min'])}-{spec.format(s['max'])}]"


def report_lines(record: dict[str, Any]) -> list[str]:
    lines = [f"gds_persist bench_fewer_bytes {record['when']}",
             f"  CPU {record['machine']['cpu']} ({record['machine']['cores']}), "
             f"GPU: {record['machine']['gpu'].get('summary', 'none')}",
             f"  disk {record['dirs']['disk']} ({record['machine']['filesystem']})",
             f"  versions {record['machine']['versions']}", ""]
    ft = record["finetune"]
    lines += [f"1. fine-tuning, {ft['trainable'] / 1e6:.2f}M of {ft['parameters'] / 1e6:.1f}M "
              f"parameters trainable, Checkpointer(incremental=True, compression="
              f"{ft['compression']!r}), {len(ft['runs'])} runs",
              f"  fio write limit (GB/s): {_fmt({k: v / 1e9 if isinstance(v, float) else v for k, v in ft['fio_bytes_per_s'].items()})}",  # noqa: E501
              f"  effective save rate / fio, 1st checkpoint: {_fmt(ft['x_fio_first'])}",
              f"  effective save rate / fio, 2nd checkpoint on: {_fmt(ft['x_fio_from_second'])}"
              f"  (target >= {ft['target_x_fio']})",
              f"  bytes written / payload, 2nd on: {_fmt(ft['written_fraction_from_second'], '{:.3f}')}",  # noqa: E501
              f"  every step restored bit-exact: {ft['all_exact']}",
              f"  incremental save time / plain save of the changed bytes alone, 2nd on: "
              f"{_fmt(ft['incremental_over_changed_alone'])}", ""]
    tr = record["trained"]
    lines += [f"2. trained state: {tr['source']}",
              f"  {'kind':<12} {'payload MB':>10} {'ratio(disk)':>11} {'ratio(enc)':>10} "
              f"{'exact':>5}"]
    for k, v in tr["kinds"].items():
        lines.append(f"  {k:<12} {v['payload'] / 1e6:>10.1f} {v['ratio_on_disk']:>11.3f} "
                     f"{v['ratio_encoded']:>10.3f} {str(v['exact']):>5}")
    for target, t in tr["targets"].items():
        fio = {k: v / 1e9 if isinstance(v, float) else v for k, v in t["fio_bytes_per_s"].items()}
        lines += ["", f"  {target} ({t['directory']}): fio write limit {_fmt(fio)} GB/s; "
                  "effective save rate / fio, median [min-max]",
                  f"  {'kind':<12} {'none':>20} {'auto':>20} {'lossless':>20} "
                  f"{'auto/none (paired)':>22}"]
        for k in t["x_fio"]:
            lines.append(f"  {k:<12} {_fmt(t['x_fio'][k]['none']):>20} "
                         f"{_fmt(t['x_fio'][k]['auto']):>20} "
                         f"{_fmt(t['x_fio'][k]['lossless']):>20} "
                         f"{_fmt(t['auto_over_none'][k]):>22}")
        first = t["auto_reasons"].get("all") or [""]
        lines.append(f"  auto's reason (all, first run): {first[0]}")
    lines.append(f"elapsed {record['elapsed_s']:.0f} s")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="directory on the disk under test (a temporary "
                   "subdirectory is created; default: the system temp directory)")
    p.add_argument("--shm", default="/dev/shm", help="tmpfs directory (default /dev/shm); "
                   "'' to skip")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--checkpoints", type=int, default=6, help="fine-tuning checkpoints per run")
    p.add_argument("--ft-compression", default="auto", choices=("none", "lossless", "auto"))
    p.add_argument("--state", default=None, help="a torch.save of a trained state (see above)")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--fio-bytes", type=int, default=1 << 30)
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a smoke run in seconds (tests)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--txt", dest="txt_out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    args.ft_model = dict(vocab=8192, d=1024, layers=8, heads=16, context=64, batch=2)
    args.mp_model = dict(vocab=8192, d=512, layers=6, heads=8, context=128, batch=8)
    if args.tiny:
        args.ft_model = dict(vocab=256, d=64, layers=4, heads=4, context=16, batch=2)
        args.mp_model = dict(vocab=256, d=64, layers=2, heads=4, context=16, batch=4)
        args.train_steps = min(args.train_steps, 20)
        args.runs = min(args.runs, 2)
        args.checkpoints = min(args.checkpoints, 3)
        args.fio_bytes = min(args.fio_bytes, 8 << 20)
    t0 = time.perf_counter()
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    base = args.dir or tempfile.gettempdir()
    workdir = tempfile.mkdtemp(prefix="gdsp-fewer-", dir=base)
    targets = {"disk": workdir}
    shm_dir = None
    if args.shm and os.path.isdir(args.shm):
        shm_dir = tempfile.mkdtemp(prefix="gdsp-fewer-", dir=args.shm)
        targets["tmpfs"] = shm_dir
    try:
        record: dict[str, Any] = {
            "schema": "gds_persist-bench-fewer-bytes/1",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv if argv is None else argv, "tiny": args.tiny,
            "machine": machine.describe(workdir), "fio": fio_version(),
            "dirs": {"disk": workdir, "tmpfs": shm_dir},
            "settings": vars(gds_persist.settings.current()),
        }
        record["machine"]["gpu"] = {"summary": machine.gpu_line(record["machine"]["gpu"])}
        record["finetune"] = finetune(args, workdir, log)
        record["trained"] = trained_state(args, targets, log)
        record["elapsed_s"] = time.perf_counter() - t0
        record["log"] = lines
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)
    text = report_lines(record)
    print("\n".join(text), flush=True)
    if args.txt_out:
        with open(args.txt_out, "w") as f:
            f.write("\n".join(lines + [""] + text) + "\n")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    main()

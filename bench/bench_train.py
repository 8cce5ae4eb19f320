"""Training-loop benchmark: what checkpointing every iteration adds to the iteration time.

A small GPT-style transformer (plain PyTorch, tied embedding/LM head, AdamW) trains on random
tokens; after every optimizer step the full state (model + optimizer + step) is checkpointed with
each method, interleaved over ``--rounds``:

  none          no checkpoint (the baseline)
  torch_save    torch.save + fsync every iteration, blocking (keeps the last 2 files)
  gds_blocking  gds_persist.Checkpointer(...).save(..., blocking=True): fast I/O, no overlap
  gds_fence     Checkpointer(mode="fence") + guard(optimizer): the write overlaps forward/backward
  gds_snapshot  Checkpointer(mode="snapshot") + guard: a bounded host copy, written in background
  gds_snapshot_process  the same, written by a helper process (writer="process"): no GIL taken
  gds_auto      Checkpointer() (mode="auto", the default) + guard: the mode it chose, and why, in
                the notes and the JSON (fence for CPU state; snapshot for GPU state that fits)
  gds_memory    Checkpointer(mode="snapshot", memory=MemoryTier(<tmpfs>, every=1),
                drive_every=--drive-every) + guard: the memory tier every iteration, the drive
                every 100 steps (docs/RECOVERY.md); the notes count the drive writes timed
  gds_levels    Checkpointer(mode="snapshot", levels=[LocalLevel(<tmpfs>, every=1),
                LocalLevel(<disk>, every=--local-every)], drive_every=--drive-every) + guard:
                two node-local levels, the durable root flushed from them in the background
                (docs/RECOVERY.md); the notes count the level commits and flushes timed

On CPU it runs with one intra-op thread (``--threads``), so the other core stands in for the idle
host of a GPU machine; the model must be sized so one iteration's compute is longer than one
checkpoint write (the header says whether it is). Reported per method: median iteration time
after warm-up (with the 10th-90th percentile spread) and its overhead over ``none`` in percent.
Every write includes fsync. ``--json FILE`` writes the same numbers (``gds-persist advise
--from-bench FILE`` reads them).

    python bench/bench_train.py                 # CPU defaults, about two minutes
    python bench/bench_train.py --device cuda --d-model 1024 --layers 12 --batch 16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gds_persist  # noqa: E402
from bench.report import save_json  # noqa: E402
from gds_persist.state.flatten import flatten  # noqa: E402
from gds_persist.training.capture import Captured  # noqa: E402

MODES = ("none", "torch_save", "gds_blocking", "gds_fence", "gds_snapshot", "gds_snapshot_process",
         "gds_auto", "gds_memory", "gds_levels", "gds_fence_uncaptured",
         "gds_snapshot_uncaptured")
# *_uncaptured: the same Checkpointer with save()'s capture switched off - how saves ran before
# every tensor was captured or checked (training/capture.py): what the capture costs, paired;
# those checkpoints may mix two steps (BatchNorm statistics), so they are a baseline, not a mode
VARIANTS = ("gpt", "batchnorm", "frozen")


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int,
                 batchnorm: bool = False):
        super().__init__()
        # --variant batchnorm: running statistics that every forward changes in place
        self.bn = nn.BatchNorm1d(d) if batchnorm else None
        self.adapter: nn.Linear | None = None  # --variant frozen: the only trained weights
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        if self.adapter is not None:
            x = x + self.adapter(x)
        return self.head(self.ln(x))


def build(args: argparse.Namespace) -> tuple[GPT, torch.optim.Optimizer]:
    """The model and its optimizer; ``--variant frozen``: a frozen base beside a small trained
    adapter (the optimizer holds only the adapter, so the base is neither guarded nor copied)."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads,
                batchnorm=args.variant == "batchnorm").to(args.device)
    if args.variant == "frozen":
        model.requires_grad_(False)
        model.adapter = nn.Linear(args.d_model, args.d_model).to(args.device)
        return model, torch.optim.AdamW(model.adapter.parameters(), lr=1e-4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: GPT, opt: torch.optim.Optimizer, args: argparse.Namespace) -> None:
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state(model: GPT, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def sync(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


class TorchSave:
    """torch.save + fsync of the file and its directory, keeping the last two files."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.files: list[str] = []
        self.write_s: list[float] = []

    def save(self, step: int, sd: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"step-{step:08d}.pt")
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.files.append(path)
        while len(self.files) > 2:
            os.unlink(self.files.pop(0))
        self.write_s.append(time.perf_counter() - t0)

    def close(self) -> None:
        pass


def run_segment(mode: str, model: GPT, opt: torch.optim.Optimizer, args: argparse.Namespace,
                step: int, root: str, acc: dict[str, Any]) -> tuple[list[float], int]:
    """``warmup + iters`` iterations checkpointed with ``mode``: the timed iterations' seconds.

    Adds to ``acc`` over the timed iterations: ``blocked_s`` (wall - on CPU - waiting for a core:
    the training thread sleeping, i.e. in the guard's wait or waiting for the GIL), ``runq_s``
    (runnable, waiting for a core the checkpoint's threads held), the guard's and the snapshot
    arena's waits, and per-checkpoint write times.
    """
    saver: Any = None
    hook = None
    if mode == "torch_save":
        saver = TorchSave(os.path.join(root, "torch_save"))
    elif mode.startswith("gds_"):
        mode_name = mode.removesuffix("_uncaptured")
        kind = ("snapshot" if mode.startswith("gds_snapshot") or mode in TIERED else
                "auto" if mode == "gds_auto" else "fence")
        writer = "process" if mode_name.endswith("_process") else "thread"
        memory_root = os.path.join(args.memory_dir, os.path.basename(root))
        tiers = _tiers(mode, args, memory_root, root)
        saver = gds_persist.Checkpointer(os.path.join(root, mode), keep_last=2, mode=kind,
                                         backend=args.backend, writer=writer, **tiers)
        hook = saver.guard(opt)
        if mode.endswith("_uncaptured"):
            saver._capture = lambda flat, held: (flat, Captured())
    times = []
    try:
        for i in range(args.warmup + args.iters):
            if i == args.warmup and isinstance(saver, gds_persist.Checkpointer):
                saver.wait()  # warm-up drained (a helper process has started), not timed
                before = saver.stats
            step += 1
            sched0 = _schedstat()
            t0 = time.perf_counter()
            train_step(model, opt, args)
            if mode == "gds_blocking":
                saver.save(step, state(model, opt, step), blocking=True)
            elif saver is not None:
                saver.save(step, state(model, opt, step))
            sync(args)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                sched1 = _schedstat()
                if sched0 and sched1:
                    runq = sched1[1] - sched0[1]
                    acc["runq_s"] = acc.get("runq_s", 0.0) + runq
                    acc["blocked_s"] = acc.get("blocked_s", 0.0) + max(
                        0.0, times[-1] - (sched1[0] - sched0[0]) - runq)
        if isinstance(saver, gds_persist.Checkpointer):
            saver.wait()  # the timed iterations' saves counted once committed (not timed)
            after = saver.stats
            for name in ("guard_waits", "guard_wait_s", "snapshot_blocked", "snapshot_blocked_s",
                         "fence_fallbacks", "committed", "memory_committed"):
                acc[name] = acc.get(name, 0) + getattr(after, name) - getattr(before, name)
            if mode == "gds_levels":
                _count_levels(acc, before, after)
            acc["snapshot_bytes"] = after.snapshot_bytes
            acc["mode"], acc["mode_reason"] = after.mode, after.mode_reason
    finally:
        if hook is not None:
            hook.remove()
        if saver is not None:
            saver.close()  # the last write completes outside the timed iterations
        if mode in TIERED:
            shutil.rmtree(memory_root, ignore_errors=True)
    if isinstance(saver, TorchSave):
        acc.setdefault("writes_s", []).extend(saver.write_s)
    elif mode in TIERED:  # one commit to a node-local level (one process: no copies)
        s = saver.stats
        if s.durable is not None:  # the segment's flushes, close()'s last one included
            acc["flushed_with_close"] = acc.get("flushed_with_close", 0) + s.durable.flushed
        acc.setdefault("writes_s", []).append(s.memory_write_s / max(s.memory_committed, 1))
    elif saver is not None:
        s = saver.stats
        acc.setdefault("writes_s", []).append(s.write_s / max(s.committed, 1))
    return times, step


TIERED = ("gds_memory", "gds_levels")  # their nearest level in a tmpfs under --memory-dir


def _tiers(mode: str, args: argparse.Namespace, memory_root: str, root: str) -> dict[str, Any]:
    """The Checkpointer's tier arguments for ``mode``: the memory tier, or the two node-local
    levels (tmpfs every step, the disk every ``--local-every``) with the durable root flushed
    every ``--drive-every`` steps."""
    if mode == "gds_memory":
        return {"memory": gds_persist.MemoryTier(memory_root, every=1),
                "drive_every": args.drive_every}
    if mode == "gds_levels":
        disk = os.path.join(root, "gds_levels-local")
        return {"levels": [gds_persist.LocalLevel(memory_root, every=1),
                           gds_persist.LocalLevel(disk, every=args.local_every)],
                "drive_every": args.drive_every}
    return {}


def _count_levels(acc: dict[str, Any], before: Any, after: Any) -> None:
    """Add to ``acc`` the timed iterations' commits per level and the durable level's flushes
    (committed, failed, seconds; started before the timed iterations end, done by then)."""
    levels = acc.setdefault("level_commits", {})
    for name, n in after.level_commits.items():
        levels[name] = levels.get(name, 0) + n - before.level_commits.get(name, 0)
    for name in ("flushed", "failures", "seconds", "bytes_written"):
        acc[f"flush_{name}"] = (acc.get(f"flush_{name}", 0) + getattr(after.durable, name)
                                - getattr(before.durable, name))
    acc["flush_skipped"] = acc.get("flush_skipped", 0) + after.flush_skipped - before.flush_skipped
    if after.durable.last_error:
        acc["flush_last_error"] = after.durable.last_error
    if after.flush_lag:
        acc["flush_lag"] = after.flush_lag


def _schedstat() -> tuple[float, float] | None:
    """(seconds on CPU, seconds waiting for a core) of this thread; None where not Linux."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runq, _ = f.read().split()
    except OSError:
        return None
    return int(on_cpu) / 1e9, int(runq) / 1e9


def _fs_type(path: str) -> str:
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and \
                        len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        pass
    return f"{kind} at {best or '?'}"


def header(args: argparse.Namespace, model: GPT, ckpt_bytes: int, root: str) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    if args.device.startswith("cuda"):
        dev = f"GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        dev = "no GPU (CPU training)"
    params = sum(p.numel() for p in model.parameters())
    return [
        f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), {dev}",
        f"checkpoints in {root}: {_fs_type(root)}; backend {args.backend or 'auto'}",
        f"model: GPT ({args.variant}) d={args.d_model} layers={args.layers} heads={args.heads} "
        f"vocab={args.vocab} "
        f"seq={args.seq} batch={args.batch}: {params / 1e6:.2f} M parameters; checkpoint "
        f"(model + AdamW + step) {ckpt_bytes / 1e6:.1f} MB",
        f"timing: median of {args.iters} iterations x {args.rounds} rounds per method after "
        f"{args.warmup} warm-up iterations; methods interleaved; every write includes fsync",
    ]


def paired_overheads(rounds: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per method, each round's overhead in percent: its median iteration over ``none``'s in
    the same round (the segments of a round run back to back, so the host's slow and fast
    spells, which last seconds to minutes on the shared VMs, fall on both)."""
    out: dict[str, list[float]] = {}
    for r in rounds:
        if not r.get("none"):
            continue
        base = statistics.median(r["none"])
        for mode, xs in r.items():
            if xs:
                out.setdefault(mode, []).append(100.0 * (statistics.median(xs) / base - 1.0))
    return out


def summarize(samples: dict[str, list[float]], extras: dict[str, dict[str, Any]],
              rounds: list[dict[str, list[float]]] | None = None) -> dict[str, dict[str, Any]]:
    base = statistics.median(samples["none"]) if samples.get("none") else None
    paired = paired_overheads(rounds or [])
    out = {}
    for mode, xs in samples.items():
        xs = sorted(xs)
        med = statistics.median(xs)
        q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
        acc = dict(extras.get(mode, {}))
        row = {"median_s": med, "p10_s": q[0], "p90_s": q[-1], "samples": len(xs)}
        writes = acc.pop("writes_s", None)
        if writes:
            row["write_s"] = statistics.median(writes)
        row["blocked_s_per_iter"] = acc.pop("blocked_s", 0.0) / len(xs)
        row["runq_s_per_iter"] = acc.pop("runq_s", 0.0) / len(xs)
        if mode in paired:
            row["paired_overhead_pct"] = statistics.median(paired[mode])
            row["round_overheads_pct"] = paired[mode]
        row["guard_wait_s_per_iter"] = acc.get("guard_wait_s", 0.0) / len(xs)
        row.update(acc)
        if base:
            row["overhead_s"] = med - base
            row["overhead_pct"] = 100.0 * (med / base - 1.0)
        out[mode] = row
    return out


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"{'method':<24} {'iter ms':>9} {'p10-p90 ms':>17} {'overhead':>9} {'paired':>8} "
             f"{'write ms':>9} {'guard ms':>9} {'GIL ms':>7} {'core ms':>8}  notes"]
    for mode, r in results.items():
        spread = f"{1e3 * r['p10_s']:.1f}-{1e3 * r['p90_s']:.1f}"
        over = f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else "-"
        write = f"{1e3 * r['write_s']:.1f}" if "write_s" in r else "-"
        notes = []
        if r.get("guard_waits"):
            notes.append(f"guard waited in {r['guard_waits']} of {r['samples']} iterations")
        if r.get("snapshot_blocked"):
            notes.append(f"snapshot blocked {r['snapshot_blocked']}x "
                         f"{1e3 * r['snapshot_blocked_s']:.0f} ms")
        if r.get("fence_fallbacks"):
            notes.append(f"{r['fence_fallbacks']} fence fallbacks")
        if mode == "gds_auto" and r.get("mode"):
            notes.append(f"chose {r['mode']}")
        if mode == "gds_memory":
            notes.append(f"{r.get('memory_committed', 0)} memory, {r.get('committed', 0)} drive "
                         "checkpoints timed")
        if mode == "gds_levels":
            commits = ", ".join(f"{k} {v}" for k, v in r.get("level_commits", {}).items())
            notes.append(f"level commits timed: {commits}; flushes to the durable root "
                         f"{r.get('flush_flushed', 0)} committed, {r.get('flush_failures', 0)} "
                         f"failed, {r.get('flush_skipped', 0)} skipped")
        guard = 1e3 * r["guard_wait_s_per_iter"]
        gil = "-"  # the blocking methods sleep in their own I/O
        if mode not in ("torch_save", "gds_blocking"):
            gil = f"{1e3 * max(0.0, r['blocked_s_per_iter'] - r['guard_wait_s_per_iter']):.2f}"
        paired = f"{r['paired_overhead_pct']:+.1f}%" if "paired_overhead_pct" in r else "-"
        lines.append(f"{mode:<24} {1e3 * r['median_s']:>9.1f} {spread:>17} {over:>9} {paired:>8} "
                     f"{write:>9} {guard:>9.1f} {gil:>7} {1e3 * r['runq_s_per_iter']:>8.2f}  "
                     f"{'; '.join(notes)}")
    lines.append("(paired: median over rounds of the overhead over none's iterations in the same "
                 "round; write: one checkpoint, durable; guard: mean wait per iteration in "
                 "optimizer.step for the write; GIL: mean other time the training thread slept, "
                 "i.e. waiting for the GIL; core: mean time it was runnable but waited for a "
                 "core)")
    if results.get("gds_auto", {}).get("mode_reason"):
        lines.append(f"gds_auto: {results['gds_auto']['mode_reason']}")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default 1 on CPU, torch's default on GPU)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=6, help="timed iterations per method and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--variant", choices=VARIANTS, default="gpt",
                   help="batchnorm: with a BatchNorm layer; frozen: a frozen base beside a "
                        "trained adapter")
    p.add_argument("--backend", default=None, help="gds_persist backend (default auto)")
    p.add_argument("--memory-dir", default="/dev/shm", help="gds_memory: the tmpfs of its tier")
    p.add_argument("--drive-every", type=int, default=100,
                   help="gds_memory: drive interval; gds_levels: the durable root's interval")
    p.add_argument("--local-every", type=int, default=10,
                   help="gds_levels: the disk level's interval (the tmpfs level: every step)")
    p.add_argument("--dir", default=None,
                   help="where checkpoints go: a temporary subdirectory of it (default "
                        "bench/out, git-ignored)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads = 32, 1, 2
        args.vocab, args.seq, args.batch = 128, 16, 2
        args.iters, args.warmup, args.rounds = 2, 1, 1
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; valid: {', '.join(MODES)}")
    if "none" not in modes:
        modes.insert(0, "none")
    args.modes = modes
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(base, exist_ok=True)
    threads = args.threads or (1 if args.device == "cpu" else torch.get_num_threads())
    with scratch(threads, "bench_train-", base) as root:
        model, opt = build(args)
        train_step(model, opt, args)  # optimizer state exists from here on
        ckpt_bytes = sum(s.nbytes for s in flatten(state(model, opt, 0)).storages)
        for line in header(args, model, ckpt_bytes, root):
            print(line)
        samples: dict[str, list[float]] = {m: [] for m in args.modes}
        extras: dict[str, dict[str, Any]] = {m: {} for m in args.modes}
        rounds: list[dict[str, list[float]]] = []
        step = 1
        for _ in range(args.rounds):
            rounds.append({})
            for mode in args.modes:
                times, step = run_segment(mode, model, opt, args, step, root, extras[mode])
                samples[mode] += times
                rounds[-1][mode] = times
        results = summarize(samples, extras, rounds)
        compute = results["none"]["median_s"]
        write = next((results[m]["write_s"] for m in ("gds_blocking", "gds_fence")
                      if m in results), None)
        print()
        print("\n".join(table(results)))
        if write is not None:
            ok = "yes" if compute > write else "NO: enlarge the model (--d-model/--layers/--batch)"
            print(f"\ncompute per iteration {1e3 * compute:.1f} ms > one gds_persist checkpoint "
                  f"write {1e3 * write:.1f} ms: {ok}")
        for mode, before in (("gds_fence", "gds_fence_uncaptured"),
                             ("gds_snapshot", "gds_snapshot_uncaptured")):
            if "round_overheads_pct" in results.get(mode, {}) and \
                    "round_overheads_pct" in results.get(before, {}):
                diffs = [a - b for a, b in zip(results[mode]["round_overheads_pct"],
                                               results[before]["round_overheads_pct"],
                                               strict=True)]
                diff = statistics.median(diffs)
                print(f"{mode} - {before}: {diff:+.1f} points, what capturing every tensor "
                      f"costs (median over rounds of {', '.join(f'{d:+.1f}' for d in diffs)}; "
                      f"{'meets' if diff <= 2.0 else 'MISSES'} the <= 2 points target)")
        for mode in ("gds_fence", "gds_snapshot", "gds_snapshot_process"):
            if mode in results and "overhead_pct" in results[mode]:
                pct = results[mode]["overhead_pct"]
                print(f"{mode}: {pct:+.1f}% per-iteration overhead "
                      f"({'meets' if pct <= 5.0 else 'MISSES'} the <= 5% target)")
        if "overhead_pct" in results.get("gds_memory", {}):
            pct = results["gds_memory"]["overhead_pct"]
            print(f"gds_memory: {pct:+.1f}% per-iteration overhead, memory tier every iteration "
                  f"({'meets' if pct <= 1.0 else 'MISSES'} the <= 1% target of issue 20)")
        for mode, issue in (("gds_memory", "issue 25"), ("gds_levels", "issue 41")):
            print_against_snapshot(results, mode, issue)
        report = {"config": {k: v for k, v in vars(args).items()},
                  "header": header(args, model, ckpt_bytes, root), "checkpoint_bytes": ckpt_bytes,
                  "compute_s": compute, "write_s": write, "results": results}
        return save_json(report, args.json)


def print_against_snapshot(results: dict[str, dict[str, Any]], mode: str, issue: str) -> None:
    """``mode``'s paired overhead minus the snapshot's, round by round, against the target of
    ``issue``: at most 2 points more."""
    tiered, snap = results.get(mode, {}), results.get("gds_snapshot", {})
    if "paired_overhead_pct" in tiered and "paired_overhead_pct" in snap:
        diffs = [m - s for m, s in zip(tiered["round_overheads_pct"],
                                       snap["round_overheads_pct"], strict=True)]
        diff = statistics.median(diffs)
        print(f"{mode} - gds_snapshot: {diff:+.1f} points (median over rounds of "
              f"{', '.join(f'{d:+.1f}' for d in diffs)}; "
              f"{'meets' if diff <= 2.0 else 'MISSES'} {issue}'s <= 2 points)")


@contextlib.contextmanager
def scratch(threads: int, prefix: str, base: str) -> Iterator[str]:
    """A fresh directory in ``base`` and ``threads`` intra-op threads for one run; both undone
    after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    root = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield root
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

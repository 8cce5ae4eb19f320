"""One rank of a small data-parallel training job checkpointing through the memory tier; run by
tests/test_memory_tier.py (4 of them: 2 nodes x 2 ranks) and bench/bench_recovery.py.

``python tests/tier_worker.py CONFIG_JSON``: joins a gloo group (FileStore), restores with
``ckpt.load()`` (``into=`` the live state with ``into``) when ``resume`` is set, trains up to
``stop`` saving every step (memory every step, drive every ``drive_every``), and writes what it
restored and ended with to ``out``. The training is deterministic in every process
(:func:`train_step`; :func:`reference` replays it): a restored state is compared bit for bit
with the uninterrupted run's. ``kill_in_replication`` ([rank, step]): that rank SIGKILLs itself
in the middle of copying that step to its replica holder. ``rank_local``: the state also holds
a per-rank ``shard`` (as ZeRO's optimizer shards), marked ``rank_local="shard"``; a restore
checks each rank got its own, of the restored step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tests.forkserver import ForkServer

WIDTH = 384  # 3 x 384 x 384 x 4 B (weights + Adam's two moments) ~ 1.7 MiB per rank


def build(width: int = WIDTH) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Linear, opt: torch.optim.Optimizer, step: int) -> None:
    """One Adam step whose gradients and updates are elementwise (the loss's sums never reach the
    state). The ranks' states are compared bit for bit with a replay in another process, so no
    state may go through a library's reduction: the former step (a linear layer's forward on a
    batch of 8, its backward, Adam) came out with other bits, always the same ones, in 3 of 420
    worker processes, on the process's first step, from the same initial weights and before any
    save (its forward alone: 0 of 280)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(model.weight.shape, generator=g)
    loss = (model.weight * x - x.flip(1)).square().sum() + (model.bias - x[0]).square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def state(model: torch.nn.Linear, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def shard_of(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s own state after ``step``: differs on every rank and at every step."""
    return torch.arange(50_000, dtype=torch.float32) + 1e6 * rank + step


def digest(sd: dict[str, Any]) -> str:
    """A hash of every tensor's bytes and the step: equal digests are bit-identical states."""
    h = hashlib.sha256(str(sd["step"]).encode())
    model = sd["model"]
    for k in sorted(model):
        h.update(k.encode() + model[k].numpy().tobytes())
    for pid, st in sorted(sd["optim"]["state"].items()):
        for k in sorted(st):
            h.update(f"{pid}.{k}".encode() + st[k].numpy().tobytes())
    return h.hexdigest()


def tensor_digests(sd: dict[str, Any]) -> dict[str, str]:
    """A hash per tensor of ``sd``: where two ranks' states differ, which tensors do."""
    out = {f"model.{k}": hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
           for k, t in sd["model"].items()}
    for pid, st in sd["optim"]["state"].items():
        for k, t in st.items():
            out[f"optim.{pid}.{k}"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    return out


def _replay(steps: int) -> dict[str, list[Any]]:
    """The uninterrupted run in this process: each step's digest and tensor digests."""
    model, opt = build()
    out: dict[str, list[Any]] = {"digests": [""], "tensors": [{}]}
    for s in range(1, steps + 1):
        train_step(model, opt, s)
        out["digests"].append(digest(state(model, opt, s)))
        out["tensors"].append(tensor_digests(state(model, opt, s)))
    return out


_uninterrupted = functools.cache(_replay)


def reference(steps: int) -> list[str]:
    """Digests of the uninterrupted run after each step (index 0: before training)."""
    return list(_uninterrupted(steps)["digests"])


def reference_tensors(step: int) -> dict[str, str]:
    """:func:`tensor_digests` of the uninterrupted run after ``step``."""
    return dict(_uninterrupted(max(step, 40))["tensors"][step])  # 40: the tests' replay


def _kill_in_replication(rank: int, step: int) -> None:
    from gds_persist.training.tier import replicate

    replicate.CHUNK = 64 << 10  # many rounds per step: the kill lands mid-copy
    original = replicate._round

    def killing(comm: Any, k: int, *args: Any) -> None:
        if comm.rank == rank and k == 3 and f"copies of step {step}" in args:
            os.kill(os.getpid(), signal.SIGKILL)
        original(comm, k, *args)

    replicate._round = killing  # type: ignore[assignment]


def _kill_in_flush(pid: int, step: int) -> None:
    """SIGKILL process ``pid`` (the object store's endpoint) once a flush of ``step`` or later
    has written its first bytes."""
    from gds_persist.training.tier import flush

    original = flush.flush_step

    def killing(comm: Any, share_dirs: list[str], path: str, s: int, *args: Any) -> Any:
        def progress(_: int) -> None:
            if s >= step:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # another rank's flush killed it already
        return original(comm, share_dirs, path, s, *args[:1], progress)

    flush.flush_step = killing  # type: ignore[assignment]


def _hold(ckpt: Any, until: str, timeout: float = 120) -> None:
    """Training pauses until the file ``until`` exists (the test's go), having flushed the
    newest local step (``ckpt.flush()``: a failure is counted, not raised), saying what the
    durable level's flushes did."""
    ckpt.flush()
    durable = ckpt.stats.durable
    os.write(1, f"holding: flushed {durable.last_step} failed {durable.failures}\n".encode())
    said, deadline = "", time.monotonic() + timeout
    while not os.path.exists(until) and time.monotonic() < deadline:
        durable = ckpt.stats.durable
        now = f"flushed {durable.last_step} failed {durable.failures}\n"
        if now != said:
            os.write(1, now.encode())
            said = now
        time.sleep(0.02)


def main(cfg: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    import torch.distributed as dist

    import gds_persist

    rank = cfg["rank"]
    if cfg.get("kill_in_replication"):
        _kill_in_replication(*cfg["kill_in_replication"])
    if cfg.get("kill_in_flush"):
        _kill_in_flush(*cfg["kill_in_flush"])
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank,
                            world_size=cfg["world"], timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo")  # the Checkpointer's own group
    model, opt = build(cfg.get("width", WIDTH))
    out: dict[str, Any] = {"rank": rank, "base": os.path.dirname(cfg["out"])}
    local = cfg.get("rank_local", False)

    def full(step: int) -> dict[str, Any]:
        sd = state(model, opt, step)
        return {**sd, "shard": shard_of(rank, step)} if local else sd

    peer_s = cfg.get("peer_timeout_s", 60.0)
    levels: dict[str, Any] = {"memory": gds_persist.MemoryTier(
        cfg["memory"], every=1, replicas=1, peer_timeout_s=peer_s)}
    if cfg.get("levels"):  # [root, every, copies] per node-local level, nearest first
        levels = {"levels": [gds_persist.LocalLevel(root, every=every, copies=copies,
                                                    peer_timeout_s=peer_s)
                             for root, every, copies in cfg["levels"]]}
    with gds_persist.Checkpointer(cfg["drive"], process_group=group, **levels,
                                  drive_every=cfg["drive_every"], keep_last=2, mode="fence",
                                  warmup=False, timeout_s=120,
                                  rank_local="shard" if local else None) as ckpt:
        ckpt.guard(opt)
        start = 0
        if cfg["resume"]:
            into = None
            if cfg.get("into"):  # restore in place into the live model and optimizer
                gds_persist.init_optimizer_state(opt)
                into = full(0)
            from gds_persist.stages import profiling

            dist.barrier(group)  # every rank starts the restore together: start skew not in it
            with profiling() as profile:  # where the restore's time goes (bench_recovery)
                sd = ckpt.load(into=into)
            out["restore_stages"] = {k: round(v.seconds, 4) for k, v in profile.stages.items()}
            if into is not None:
                assert sd["model"]["weight"] is into["model"]["weight"], "not restored in place"
                assert not local or sd["shard"] is into["shard"], "shard not restored in place"
            if local:  # its own shard, of the step restored
                out["shard_ok"] = torch.equal(sd["shard"], shard_of(rank, sd["step"]))
            out["restored_s"] = time.perf_counter() - t0  # main() start to state restored
            out["restored_at"] = time.time()  # the launcher knows when the process started
            out["restored"] = digest(sd)
            out["restored_tensors"] = tensor_digests(sd)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            start = sd["step"]
            s = ckpt.stats
            out.update(restored_from=ckpt.restored_from, restore_step=s.restore_step,
                       restore_sources=s.restore_sources, restore_skipped=s.restore_skipped,
                       restore_s=s.restore_s, restore_bytes=s.restore_bytes)
        saved = {"step": start, "digest": ""}

        def unchanged_by_its_save(*_: Any) -> None:  # runs after the guard: tensors released
            if saved["digest"] and digest(state(model, opt, saved["step"])) != saved["digest"]:
                os.write(1, f"changed while saved {saved['step']}\n".encode())

        opt.register_step_pre_hook(unchanged_by_its_save)
        for step in range(start + 1, cfg["stop"] + 1):
            if cfg.get("hold") and step == cfg["hold"][0]:
                _hold(ckpt, cfg["hold"][1])
            train_step(model, opt, step)
            saved.update(step=step, digest=digest(state(model, opt, step)))
            ckpt.save(step, full(step))
            # one write(2): a SIGKILL cannot split the line (the launcher waits for it)
            os.write(1, f"trained {step} {saved['digest']}\nsaved {step}\n".encode())
            durable = ckpt.stats.durable
            if durable is not None:  # what the durable level's flushes did so far
                os.write(1, f"flushed {durable.last_step} failed {durable.failures}\n".encode())
        ckpt.wait()
        if cfg.get("flush"):  # the newest local step made durable before the job ends
            ckpt.flush()
            os.write(1, f"final flush: {ckpt.stats.durable}\n".encode())
        out["final"] = digest(state(model, opt, cfg["stop"]))
        out["holders"] = ckpt.stats.replica_holders
        out["healed"] = ckpt.stats.healed
        out["share_bytes"] = ckpt.stats.memory_share_bytes
        durable = ckpt.stats.durable
        out["flush"] = None if durable is None else vars(durable)
        out["level_commits"] = ckpt.stats.level_commits
    with open(cfg["out"], "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # skip the gloo teardown, which may abort at exit on a loaded machine
    # (tests/test_examples.py, GLOO_EXIT_ABORT): everything is committed and reported


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))


# ------------------------------------------------------------------ the launcher (tests, bench)

WORKER = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(WORKER))
NODES, PER_NODE = 2, 2


def node_of(rank: int) -> str:
    return f"n{rank // PER_NODE}"


def _head_and_tail(log: str, head: int = 800, tail: int = 3200) -> str:
    """A rank's log cut to its first lines (what it trained: the digests) and its end (the
    error)."""
    if len(log) <= head + tail:
        return log
    return f"{log[:head]}\n[... {len(log) - head - tail} characters ...]\n{log[-tail:]}"


class Job:
    """The 4 ranks of one incarnation of the job (2 nodes x 2 ranks, a memory_root per node
    under ``base``), started as separate processes like an elastic launcher starts them: fresh
    interpreters, or forks of ``forks`` (a :class:`tests.forkserver.ForkServer`, which has
    imported torch already)."""

    def __init__(self, base: str, *, resume: bool, stop: int, drive_every: int = 2,
                 kill_in_replication: list[int] | None = None, memory: str | None = None,
                 width: int = WIDTH, into: bool = False, peer_timeout_s: float = 60.0,
                 rank_local: bool = False, forks: ForkServer | None = None,
                 levels: list[tuple[int, int]] | None = None, drive: str | None = None,
                 flush: bool = False, kill_in_flush: list[int] | None = None,
                 hold: list[Any] | None = None):
        import subprocess
        import uuid

        self.base, self.memory = base, memory
        self.drive = drive or os.path.join(base, "drive")
        tag = uuid.uuid4().hex[:8]
        self.outs = [os.path.join(base, f"out-{tag}-{r}.json") for r in range(self.world)]
        self.logs = [os.path.join(base, f"log-{tag}-{r}.txt") for r in range(self.world)]
        self.started = time.time()
        self.procs = []
        for r in range(self.world):
            cfg = {"rank": r, "world": self.world, "init": os.path.join(base, f"init-{tag}"),
                   "drive": self.drive, "memory": self.memory_root(r), "flush": flush,
                   "kill_in_flush": kill_in_flush, "hold": hold,
                   "levels": [[self.level_root(i, r), every, copies]
                              for i, (every, copies) in enumerate(levels or [])],
                   "drive_every": drive_every, "stop": stop, "resume": resume,
                   "out": self.outs[r], "kill_in_replication": kill_in_replication,
                   "width": width, "into": into, "peer_timeout_s": peer_timeout_s,
                   "rank_local": rank_local}
            env = {**os.environ, "GDS_PERSIST_NODE": node_of(r),
                   "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": REPO}
            with open(self.logs[r], "w") as log:  # exists before the rank starts: log() reads it
                if forks is not None:
                    self.procs.append(forks.spawn(WORKER, [json.dumps(cfg)], env=env,
                                                  stdout=self.logs[r]))
                else:
                    self.procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(cfg)],
                                                       env=env, stdout=log, stderr=log))

    world = NODES * PER_NODE

    def memory_root(self, rank: int) -> str:
        """Node ``rank``'s memory_root: a directory per node, under ``memory`` (else ``base``)."""
        return os.path.join(self.memory or self.base, f"mem-{node_of(rank)}")

    def level_root(self, level: int, rank: int) -> str:
        """Node ``rank``'s directory of node-local level ``level`` (``levels=``): the first in
        memory as :meth:`memory_root`, the others on the disk under ``base`` (as a node's NVMe)."""
        if level == 0:
            return self.memory_root(rank)
        return os.path.join(self.base, f"local{level}-{node_of(rank)}")

    def log(self, rank: int) -> str:
        with open(self.logs[rank]) as f:
            return f.read()

    def wait(self, timeout: float = 180) -> list[dict[str, Any]]:
        """Every rank's result; raises with the logs of ranks that failed."""
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            self.kill()
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        if bad:
            raise AssertionError("\n".join(f"--- rank {r} exited {self.procs[r].returncode}:\n"
                                           f"{_head_and_tail(self.log(r))}" for r in bad))
        out = []
        for path in self.outs:
            with open(path) as f:
                out.append(json.load(f))
        return out

    def kill_at(self, rank: int, step: int, timeout: float = 180) -> None:
        """SIGKILL ``rank`` once it has saved ``step``, then the others (the launcher tearing
        down the job after one rank died)."""
        deadline = time.monotonic() + timeout
        while f"saved {step}\n" not in self.log(rank):
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"rank {rank} never saved step {step}:\n{self.log(rank)}")
            time.sleep(0.01)
        self.procs[rank].send_signal(signal.SIGKILL)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:  # our own children, by object
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()

"""Tasks of tests/test_deepspeed.py, run on every rank of a :class:`_gang.Gang` (2 gloo ranks):
real DeepSpeed engines (CPU accelerator) training a tiny model, saving and resuming through
``gds_persist.integrations.deepspeed``. Each returns plain data for the test to check."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

HIDDEN = 16
STEPS_BEFORE, STEPS_AFTER = 3, 2


def _deepspeed(ctx: Any) -> Any:
    """DeepSpeed on this rank of the gang's (already initialized) gloo group."""
    for key, value in {"RANK": ctx.rank, "LOCAL_RANK": ctx.rank, "WORLD_SIZE": ctx.world,
                       "LOCAL_WORLD_SIZE": ctx.world, "CROSS_SIZE": 1, "CROSS_RANK": 0}.items():
        os.environ[key] = str(value)
    import deepspeed

    # the shm comm op compiles on first use (a minute); gloo does the collectives without it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # takes the gang's group
    return deepspeed


# DeepSpeed's own decoupled checkpoint writer, as a user turns it on (its data-parallel writer
# config needs "data_parallel" set and the launcher's CROSS_SIZE / CROSS_RANK in 0.19.8)
DECOUPLED_CONFIG = {"checkpoint": {"writer": {"decoupled": True, "data_parallel": "replica"}}}


def _engine(ds: Any, stage: int, seed: int, extra: dict[str, Any] | None = None) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(2 * HIDDEN, HIDDEN))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **(extra or {})}
    engine, _, _, _ = ds.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                    config=config)
    return engine


def _step(engine: Any, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, HIDDEN, generator=g), torch.randn(4, HIDDEN, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.detach().clone()


def _params(ds: Any, engine: Any, stage: int) -> dict[str, torch.Tensor]:
    named = dict(engine.module.named_parameters())
    if stage == 3:
        with ds.zero.GatheredParameters(list(named.values()), modifier_rank=None):
            return {n: p.detach().clone() for n, p in named.items()}
    return {n: p.detach().clone() for n, p in named.items()}


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of nested dicts / lists / tuples by path, cloned."""
    if isinstance(obj, torch.Tensor):
        return {path: obj.detach().clone()}
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, list | tuple) else ())
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{path}/{key}"))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """"" if the two have the same paths and bit-identical tensors, else what differs."""
    if a.keys() != b.keys():
        return f"paths differ: {sorted(set(a) ^ set(b))[:4]}"
    for k in a:
        x, y = a[k], b[k]
        if (x.dtype, x.shape) != (y.dtype, y.shape) or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return f"{k} differs"
    return ""


def _master(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone()
            for n, p in engine.module.named_parameters()}


def _latest(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read()
    except FileNotFoundError:
        return None


def resume(ctx: Any, stage: int, root: str, decoupled: bool = True) -> dict[str, Any]:
    """Train, save through gds_persist, train on (the reference); a fresh engine from another
    seed loads the checkpoint and trains the same steps. Rank 0 also reads the files with
    torch.load, verifies them and runs zero_to_fp32."""
    from gds_persist.integrations.deepspeed import attach

    ds = _deepspeed(ctx)
    save_dir = os.path.join(root, f"stage{stage}")
    engine = _engine(ds, stage, seed=0)
    ours = attach(engine, decoupled=decoupled)
    for s in range(STEPS_BEFORE):
        _step(engine, s, ctx.rank)
    saved = {"params": _params(ds, engine, stage),
             "optimizer": _tensors(engine.optimizer.state_dict()),
             "scheduler": engine.lr_scheduler.state_dict(), "steps": engine.global_steps}
    master = _master(engine) if stage else None
    engine.save_checkpoint(save_dir, tag="t1", client_state={"my_step": 3})
    out: dict[str, Any] = {"pending": ours.get_commit_info() is not None,
                           "latest_before_step": _latest(save_dir)}
    reference = [_step(engine, STEPS_BEFORE + s, ctx.rank) for s in range(STEPS_AFTER)]
    out["latest"] = _latest(save_dir)
    out["written"] = sorted((os.path.basename(i.path), getattr(i, "rank_bytes", i.bytes_written))
                            for i in ours.infos)
    out["split_reason"] = ours.split_reason
    reference_params = _params(ds, engine, stage)
    engine.destroy()

    fresh = _engine(ds, stage, seed=123)
    attach(fresh, decoupled=decoupled)
    path, client = fresh.load_checkpoint(save_dir)
    out["loaded"] = os.path.basename(path or "")
    out["client"] = (client or {}).get("my_step")
    out["params"] = _same(saved["params"], _params(ds, fresh, stage))
    out["optimizer"] = _same(saved["optimizer"], _tensors(fresh.optimizer.state_dict()))
    out["scheduler"] = fresh.lr_scheduler.state_dict() == saved["scheduler"]
    out["steps"] = (fresh.global_steps, saved["steps"])
    again = [_step(fresh, STEPS_BEFORE + s, ctx.rank) for s in range(STEPS_AFTER)]
    out["losses"] = _same(dict(enumerate(reference)), dict(enumerate(again)))  # type: ignore[arg-type]
    out["trained"] = _same(reference_params, _params(ds, fresh, stage))
    fresh.destroy()
    torch.distributed.barrier()
    if ctx.rank == 0:
        out.update(_tools(save_dir, "t1", master))
    torch.distributed.barrier()
    return out


def _tools(save_dir: str, tag: str, master: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """What DeepSpeed's tools and stock torch.load make of the files."""
    import gds_persist

    out: dict[str, Any] = {"files": {}}
    tag_dir = os.path.join(save_dir, tag)
    for name in sorted(os.listdir(tag_dir)):
        path = os.path.join(tag_dir, name)
        stock = torch.load(path, weights_only=False)
        ours = gds_persist.load(path, options=gds_persist.LoadOptions(weights_only=False))
        report = gds_persist.verify(path)
        out["files"][name] = {"torch.load": _same(_tensors(stock), _tensors(ours)),
                              "keys": sorted(stock) == sorted(ours), "verified": report.ok,
                              "checksum": report.checksum, "extents": report.extents}
    if master is not None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out["zero_to_fp32"] = _same(master, dict(get_fp32_state_dict_from_zero_checkpoint(
            save_dir)))
    return out


def failed_write(ctx: Any, root: str, decoupled: bool) -> dict[str, Any]:
    """ZeRO-1: tag t1 is committed; then rank 1 cannot write its file of t2 (a directory is in
    the way). Every rank must raise naming rank 1; ``latest`` and t1's files stay; a fresh
    engine resumes from t1."""
    from gds_persist import CheckpointError
    from gds_persist.integrations.deepspeed import attach

    ds = _deepspeed(ctx)
    save_dir = os.path.join(root, f"failed-{'decoupled' if decoupled else 'sync'}")
    engine = _engine(ds, 1, seed=0)
    attach(engine, decoupled=decoupled)
    _step(engine, 0, ctx.rank)
    engine.save_checkpoint(save_dir, tag="t1")
    at_t1 = _params(ds, engine, 1)
    _step(engine, 1, ctx.rank)  # commits t1 (decoupled), then updates
    before = _digests(os.path.join(save_dir, "t1"))
    if ctx.rank == 1:
        os.makedirs(os.path.join(save_dir, "t2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    torch.distributed.barrier()
    out: dict[str, Any] = {"error": None}
    try:
        engine.save_checkpoint(save_dir, tag="t2")
        _step(engine, 2, ctx.rank)  # decoupled: the commit runs (and fails) here
    except CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    engine.destroy()
    torch.distributed.barrier()
    out["latest"] = _latest(save_dir)
    out["t1_unchanged"] = _digests(os.path.join(save_dir, "t1")) == before
    fresh = _engine(ds, 1, seed=123)
    attach(fresh, decoupled=decoupled)
    path, _ = fresh.load_checkpoint(save_dir)
    out["loaded"] = os.path.basename(path or "")
    out["params"] = _same(at_t1, _params(ds, fresh, 1))
    fresh.destroy()
    torch.distributed.barrier()
    return out


def _digests(directory: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def edges(ctx: Any, root: str, decoupled: bool) -> dict[str, Any]:
    """``attach(engine)`` with its defaults (not decoupled: the config does not ask for it) or
    ``attach(engine, decoupled=True)``: what a script sees right after ``save_checkpoint``,
    after ``flush``, and from ``load_checkpoint`` right after a second save. (A config asking
    for decoupled checkpointing makes DeepSpeed start a process, which a gang's daemonic ranks
    cannot: deepspeed_exit_worker.py runs that one.)"""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import gds_persist
    from gds_persist.integrations.deepspeed import attach, flush

    ds = _deepspeed(ctx)
    save_dir = os.path.join(root, f"edges-{'decoupled' if decoupled else 'default'}")
    engine = _engine(ds, 1, seed=0)
    ours = attach(engine, decoupled=True) if decoupled else attach(engine)
    out: dict[str, Any] = {"decoupled": ours.decoupled, "reason": ours.decoupled_reason}
    _step(engine, 0, ctx.rank)
    master = _master(engine)
    engine.save_checkpoint(save_dir, tag="t1")
    out["latest_after_save"] = _latest(save_dir)
    if not decoupled and ctx.rank == 0:  # what a tool finds once save_checkpoint returned
        out["zero_to_fp32"] = _same(master, dict(get_fp32_state_dict_from_zero_checkpoint(
            save_dir)))
    flush(engine)
    out["latest_after_flush"] = _latest(save_dir)
    tag_dir = os.path.join(save_dir, "t1")
    out["verified"] = sorted((n, gds_persist.verify(os.path.join(tag_dir, n)).ok)
                             for n in os.listdir(tag_dir))
    _step(engine, 1, ctx.rank)
    at_t2 = _params(ds, engine, 1)
    engine.save_checkpoint(save_dir, tag="t2")
    _step(engine, 2, ctx.rank)  # the state moves on; the load must bring t2 back
    path, _ = engine.load_checkpoint(save_dir)
    out["loaded"] = os.path.basename(os.path.dirname(path or ""))
    out["params"] = _same(at_t2, _params(ds, engine, 1))
    engine.destroy()
    torch.distributed.barrier()
    return out


def batchnorm(ctx: Any, root: str, decoupled: bool = True) -> dict[str, Any]:
    """A save of a model with BatchNorm after every step: the next step's forward changes the
    running statistics while a decoupled save writes. Each tag's model states must equal a copy
    of the module's state taken at ``save_checkpoint`` on data-parallel rank 0 (each rank's
    statistics are its own batches'; DeepSpeed keeps rank 0's, and so must the split write)."""
    from gds_persist.integrations.deepspeed import attach, flush

    ds = _deepspeed(ctx)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = ds.initialize(model=model, optimizer=opt, config=config)
    attach(engine, decoupled=decoupled)
    save_dir = os.path.join(root, f"batchnorm-{decoupled}")
    expected = {}
    for step in range(4):
        _step(engine, step, ctx.rank)
        expected[f"t{step}"] = _tensors(engine.module.state_dict())
        engine.save_checkpoint(save_dir, tag=f"t{step}")
    g = torch.Generator().manual_seed(99)
    engine(torch.randn(4, HIDDEN, generator=g))  # the last save overlaps a forward too
    flush(engine)
    out = {}
    for tag, want in expected.items():
        saved = torch.load(os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"),
                           weights_only=False)["module"]
        out[tag] = _same(want, _tensors(saved))
    engine.destroy()
    torch.distributed.barrier()
    return out

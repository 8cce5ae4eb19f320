"""Transformers' ``Trainer``: its checkpoints written by gds_persist, in the background.

``attach(trainer)`` replaces, on that instance only, the methods Trainer's checkpointing goes
through (a ``TrainerCallback`` cannot replace writes): ``_save_checkpoint`` (what a checkpoint
holds), ``_load_from_checkpoint`` (resume: the previous write finished, then every file
verified, then Trainer's own resume code), ``_load_best_model`` and ``train`` (wait for the
write in flight first). Reference: ``docs/INTEGRATIONS.md``, "Transformers".

A checkpoint is taken at Trainer's moment - the scheduler, scaler, RNG states and
``trainer_state.json`` as Trainer records them; the buffers (which a forward pass may change)
and frozen weights copied then; the optimizer's parameters and state copied by the writer thread
during the next step's forward and backward (the optimizer's step waits for the copy: a step
pre-hook), and checked against their CRC32C at the checkpoint, so an in-place change by other
code fails that checkpoint (:class:`~gds_persist.TornCheckpointError`), never mixes two steps in
it - and written by the one background
writer (:class:`~gds_persist.training.background_writer.Lane`) while training goes on: the
weights as ``model.safetensors`` (``save(format="safetensors")``), the optimizer, scheduler,
scaler and RNG states as the ``torch.save`` files Trainer names (``save(format="torch")``,
which ``torch.load`` reads), into a hidden ``.checkpoint-N.tmp-*`` folder renamed to
``checkpoint-N`` once all of it is durable. Trainer's rotation
(``save_total_limit``) then runs: it lists ``checkpoint-*`` folders only, so it never counts or
deletes one being written. The next checkpoint, a resume, ``load_best_model_at_end`` and the end
of ``train()`` wait for the write in flight; its error is raised there.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, ChecksumError, TornCheckpointError
from ..loading.verify import verify
from ..parallel.distributed import background_group, make_comm
from ..saving.options import SaveOptions
from ..saving.save import save
from ..training.background_writer import Lane, collect
from ..training.capture import HeldAtSave, capture_nested, held_by
from ..transfer.commit import fsync_path

DOC = 'docs/INTEGRATIONS.md, "Transformers"'
TORCH_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")  # and this rank's RNG states


class _Attached:
    """The state of one attached Trainer: its lane and the checkpoint write in flight."""

    def __init__(self, trainer: Any, timeout_s: float, max_shard_size: Any):
        refused = [name for name, on in (
            ("DeepSpeed", getattr(trainer, "is_deepspeed_enabled", False)),
            ("FSDP", getattr(trainer, "is_fsdp_enabled", False)),
            ("push_to_hub", trainer.args.push_to_hub)) if on]
        if refused:
            raise CheckpointError(
                f"gds_persist.integrations.transformers.attach: this Trainer uses "
                f"{', '.join(refused)}, whose checkpoints the attached writer does not write "
                f"(sharded states, uploads); train without attach(), or without them ({DOC})")
        self.trainer, self.timeout_s = trainer, timeout_s
        # with DDP: a gloo group of its own for the writer thread's collectives (every rank
        # calls attach, so every rank creates it), and this rank's place in it
        self.group = background_group(timeout_s) if trainer.args.world_size > 1 else None
        self.comm = make_comm(self.group, timeout_s)
        self.rank = self.comm.rank
        self.options = SaveOptions(max_shard_size=max_shard_size)
        self.lane = Lane("transformers")
        self.pending: list[tuple[str, Future[None]]] = []
        self.stops: list[float] = []  # seconds each checkpoint held training up
        self.spare: dict[str, Any] = {}  # the previous checkpoint's copies, reused
        self.copying: Future[dict[str, Any]] | None = None  # the copies the next step awaits
        self.hooked: set[int] = set()  # the optimizers whose step waits for them

    def wait(self) -> None:
        """The write in flight finished; its error raised here."""
        pending, self.pending = self.pending, []
        collect(pending, self.timeout_s, "attach(timeout_s=)")

    def save_checkpoint(self, model: Any, trial: Any) -> None:
        t0 = time.perf_counter()
        self.wait()
        tr = self.trainer
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if tr.hp_search_backend is None and trial is None:
            tr.store_flos()
        run_dir = tr._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{tr.state.global_step}")
        if tr.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{tr.state.best_global_step}")
            if os.path.exists(best) or tr.state.best_global_step == tr.state.global_step:
                tr.state.best_model_checkpoint = best
        ident = self.comm.broadcast_json(uuid.uuid4().hex[:12], 0, "checkpoint folder")
        tmp = os.path.join(run_dir, f".{os.path.basename(output_dir)}.tmp-{ident}")
        try:
            small, now, live, at_save = self._take(tmp)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # the optimizer's tensors are copied by the writer thread while the next step's forward
        # and backward run; the optimizer's step waits for the copy (fence)
        copying = self.copying = self.lane.submit(lambda: self._copies(live), "copy")
        self._hook()
        self.pending.append((output_dir, self.lane.submit(
            lambda: self._write(tmp, output_dir, small, {**copying.result(), **now}, run_dir,
                                at_save),
            output_dir)))
        self.stops.append(time.perf_counter() - t0)

    def _copies(self, live: dict[str, Any]) -> dict[str, Any]:
        """Copies of ``live`` made into the previous checkpoint's (free again: its write
        finished before this checkpoint began), as copying into memory already touched is
        several times faster than into fresh pages."""
        copies = {k: _copy_into(v, self.spare.get(k)) for k, v in live.items()}
        self.spare = dict(copies)
        return copies

    def _hook(self) -> None:
        """The fence on the optimizer's step, once per optimizer (Trainer makes its optimizer
        in ``train()``)."""
        opt = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        if opt is not None and id(opt) not in self.hooked:
            opt.register_step_pre_hook(lambda *args: self._fence())
            self.hooked.add(id(opt))

    def _fence(self) -> None:
        """Before the optimizer changes the weights: the checkpoint's copies are done (the wait
        counted in the checkpoint's stop)."""
        copying, self.copying = self.copying, None
        if copying is None:
            return
        t0 = time.perf_counter()
        collect([("copy", copying)], self.timeout_s, "attach(timeout_s=)")
        self.stops[-1] += time.perf_counter() - t0

    def _take(self, tmp: str) -> tuple[dict[str, bytes], dict[str, Any], dict[str, Any],
                                       HeldAtSave]:
        """What the checkpoint holds, at this moment: the small files written now into ``tmp``
        (rank 0), the trainer state as text, copies of the scheduler's, scaler's and RNG
        states, and the model and optimizer states - the optimizer's parameters and state
        live (copied before its next step; their CRC32C now, to check the copy), the rest
        (buffers a forward pass changes, frozen weights) copied now
        (:func:`~gds_persist.training.capture.capture_nested`)."""
        tr = self.trainer
        unwrapped = tr.accelerator.unwrap_model(tr.model, keep_torch_compile=False)
        if self.rank == 0:
            os.makedirs(tmp)
            self._small_files(unwrapped, tmp)
        live: dict[str, Any] = {"model": unwrapped.state_dict()}
        now: dict[str, Any] = {}
        if not tr.args.save_only_model:
            if tr.optimizer is not None:
                live["optimizer.pt"] = tr.optimizer.state_dict()
            if tr.lr_scheduler is not None:
                now["scheduler.pt"] = copy.deepcopy(tr.lr_scheduler.state_dict())
            scaler = getattr(tr.accelerator, "scaler", None)
            if scaler is not None:
                now["scaler.pt"] = copy.deepcopy(scaler.state_dict())
            now[_rng_name(self.comm.size, self.rank)] = _rng_states(self.comm.size)
        from transformers.trainer_callback import ExportableState

        for cb in [*tr.callback_handler.callbacks, tr.control]:  # as Trainer does
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(tr.state.stateful_callbacks.get(name), list):
                    tr.state.stateful_callbacks[name].append(cb.state())
                else:
                    tr.state.stateful_callbacks[name] = cb.state()
        text = json.dumps(dataclasses.asdict(tr.state), indent=2, sort_keys=True) + "\n"
        opt = getattr(tr.optimizer, "optimizer", tr.optimizer)
        live, at_save = capture_nested(live, held_by([opt] if opt is not None else []))
        return ({"trainer_state.json": text.encode()} if self.rank == 0 else {}), now, live, \
            at_save

    def _small_files(self, unwrapped: Any, tmp: str) -> None:
        """Trainer's ``_save`` without the weights: config, generation config, processing
        class, training arguments."""
        tr = self.trainer
        if hasattr(unwrapped, "config"):
            unwrapped.config.save_pretrained(tmp)
        if getattr(unwrapped, "generation_config", None) is not None \
                and getattr(unwrapped, "can_generate", lambda: False)():
            unwrapped.generation_config.save_pretrained(tmp)
        if tr.processing_class is not None:
            tr.processing_class.save_pretrained(tmp)
        torch.save(tr.args, os.path.join(tmp, "training_args.bin"))

    def _write(self, tmp: str, output_dir: str, small: dict[str, bytes],
               tensors: dict[str, Any], run_dir: str, at_save: HeldAtSave) -> None:
        """In the background: the copies checked against the checkpoint's moment, every file
        written (the ranks of a group share the model's and the optimizer's, each writes its
        RNG state), then rank 0 renames the folder into place and rotates; every rank returns
        once that is done."""
        from transformers.trainer_pt_utils import safe_globals

        group = self.group
        try:
            self.comm.agree("copied", lambda: _refuse_torn(at_save, tensors, output_dir),
                            f"checkpoint {output_dir}")
            save(tensors.pop("model"), tmp, format="safetensors", options=self.options,
                 process_group=group)
            for name, state in tensors.items():
                shared = name == "optimizer.pt"  # replicated in DDP: written by every rank
                if shared or self.rank == 0 or name.startswith("rng_state"):
                    with safe_globals():  # the numpy RNG state, which Trainer's resume allows
                        save(state, os.path.join(tmp, name), format="torch",
                             process_group=group if shared else None)
            self.comm.agree("written", lambda: None, f"checkpoint {output_dir}")
            if self.rank == 0:
                _publish(tmp, output_dir, small)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.comm.agree("committed", lambda: None, f"checkpoint {output_dir}")
        if self.rank == 0:
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir,
                               save_total_limit=self.trainer.args.save_total_limit,
                               best_model_checkpoint=self.trainer.state.best_model_checkpoint,
                               use_mtime=False)

    def check(self, checkpoint: str) -> None:
        """Before Trainer resumes from ``checkpoint``: every file gds_persist wrote verified."""
        self.wait()
        names = (*TORCH_FILES, _rng_name(self.comm.size, self.rank))
        found = [n for n in names if os.path.isfile(os.path.join(checkpoint, n))]
        for target in [checkpoint, *(os.path.join(checkpoint, n) for n in found)]:
            report = verify(target)
            if not report.ok:
                raise ChecksumError(
                    f"{target} does not match the checksums recorded when it was written "
                    f"({report.errors[0]}); resume from an earlier checkpoint ({DOC})")


def _refuse_torn(at_save: HeldAtSave, tensors: dict[str, Any], output_dir: str) -> None:
    torn = at_save.torn(tensors)
    if torn:
        raise TornCheckpointError(
            f"checkpoint {output_dir}: {', '.join(torn[:4])}{' ...' if len(torn) > 4 else ''} "
            "changed in place after the checkpoint was taken and before the optimizer's next "
            "step (code other than the step changed them: a hook, a callback); the checkpoint "
            f"was not written and earlier ones are intact: change them in the step ({DOC})",
            torn)


def _publish(tmp: str, output_dir: str, small: dict[str, bytes]) -> None:
    """The small files written, everything fsynced, the folder renamed to ``output_dir``."""
    for name, raw in small.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(raw)
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    if os.path.isdir(output_dir):  # a checkpoint of this step saved before: replaced
        shutil.rmtree(output_dir)
    os.rename(tmp, output_dir)
    fsync_path(os.path.dirname(output_dir))


def _rng_name(world: int, rank: int) -> str:
    return "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"


def _copy_into(obj: Any, spare: Any) -> Any:
    """A copy of ``obj`` (tensors copied, storages shared as in ``obj``), made of ``spare``'s
    tensors where it is an earlier copy of the same structure, shapes and dtypes."""
    if spare is not None and _same_shape(obj, spare):
        _copy_tensors(obj, spare)
        return spare
    return copy.deepcopy(obj)


def _same_shape(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device and b.is_contiguous() == a.is_contiguous())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_shape(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same_shape(x, y) for x, y in zip(a, b, strict=True))
    return not isinstance(b, torch.Tensor | dict | list | tuple)


def _copy_tensors(src: Any, dst: Any) -> Any:
    """Copy ``src``'s tensors into ``dst``'s; its other values replace ``dst``'s in place
    (dicts) or are compared equal (sequences of plain values: copied anew where they differ)."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
        return dst
    if isinstance(src, dict):
        for k, v in src.items():
            dst[k] = _copy_tensors(v, dst[k])
        return dst
    if isinstance(src, list):
        dst[:] = [_copy_tensors(x, y) for x, y in zip(src, dst, strict=True)]
        return dst
    if isinstance(src, tuple):
        return type(src)(_copy_tensors(x, y) for x, y in zip(src, dst, strict=True))
    return copy.deepcopy(src)


def _rng_states(world: int) -> dict[str, Any]:
    """The RNG states as Trainer's ``_save_rng_state`` records them."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = (torch.cuda.random.get_rng_state_all() if world > 1
                          else torch.cuda.random.get_rng_state())
    return states


def attach(trainer: Any, *, timeout_s: float = 600.0, max_shard_size: Any = None) -> Any:
    """Make ``trainer``'s checkpoints go through gds_persist, written while training goes on.

    Parameters
    ----------
    trainer : transformers.Trainer
        The Trainer, before ``train()``; its own methods are replaced on this instance only.
    timeout_s : float
        How long the next checkpoint, a resume or the end of training waits for the write in
        flight before raising :class:`~gds_persist.CheckpointTimeout`.
    max_shard_size : int or str, optional
        Cut the weights into shards beyond this many bytes (as ``save_pretrained``).

    Returns
    -------
    transformers.Trainer
        ``trainer`` itself; ``trainer.gds_persist.stops`` lists the seconds each checkpoint
        held training up.

    Raises
    ------
    CheckpointError
        A Trainer with DeepSpeed, FSDP or ``push_to_hub`` (not written by the attached writer).

    Notes
    -----
    With DDP every rank calls ``attach``: the ranks write byte ranges of the weights and of the
    optimizer state, each its RNG states, and rank 0 the rest and the rename.
    """
    state = _Attached(trainer, timeout_s, max_shard_size)
    load_checkpoint = trainer._load_from_checkpoint
    load_best = trainer._load_best_model
    train = trainer.train

    def resume(checkpoint: str, model: Any = None) -> Any:
        state.check(checkpoint)
        return load_checkpoint(checkpoint, model)

    def best() -> Any:
        state.wait()
        return load_best()

    def train_then_wait(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:
            state.wait()

    replaced: dict[str, Callable[..., Any]] = {
        "_save_checkpoint": state.save_checkpoint, "_load_from_checkpoint": resume,
        "_load_best_model": best, "train": train_then_wait}
    for name, fn in replaced.items():
        setattr(trainer, name, fn)
    trainer.gds_persist = state
    return trainer

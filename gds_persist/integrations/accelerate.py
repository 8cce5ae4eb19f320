"""Hugging Face Accelerate: ``Accelerator.save_state`` / ``load_state`` through gds_persist.

::

    from gds_persist.integrations.accelerate import load_state, save_state

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    save_state(accelerator, "ckpt/step-100")        # instead of accelerator.save_state(...)
    load_state(accelerator, "ckpt/step-100")        # instead of accelerator.load_state(...)

They save and restore what ``Accelerator.save_state`` does (every prepared model, optimizer,
scheduler, the state of stateful dataloaders, the gradient scaler, the Python / numpy / torch
(and CUDA) RNG states, ``accelerator.step`` and objects registered with
``register_for_checkpointing``), with the same directory choice (``output_dir``, or
``project_dir/checkpoints/checkpoint_<iteration>`` with ``automatic_checkpoint_naming``, keeping
at most ``total_limit``) and the same pre-hooks, but as one gds_persist checkpoint directory:
written durably and atomically, CRC32C-verified on load, nothing pickled (RNG states are numpy
arrays, tuples and tensors, stored as such; ``allow_pickle=True`` for other objects, loaded only
through ``torch.load(weights_only=True)``).

Accelerate's ``register_save_state_pre_hook`` can only take over model weights (optimizers,
schedulers and RNG states are always pickled by ``save_state``), hence functions rather than
hooks.

Several processes: data-parallel training (``DistributedType.MULTI_CPU`` over gloo,
``MULTI_GPU`` over NCCL: DDP) is a data-parallel gds_persist save and load over the default
process group (docs/DISTRIBUTED.md). Every process calls ``save_state`` / ``load_state``, as with
Accelerate. The models, optimizers, schedulers, scaler and step are replicated (each process
writes a byte-balanced share; their structure is compared across processes); the RNG states,
dataloader states and registered objects are each process's own (rank-local sections: loading
needs the same number of processes). ``allow_pickle`` is single-process only. Sharded training
(FSDP, DeepSpeed, Megatron-LM) and XLA raise ``NotImplementedError``: use
``gds_persist.dcp`` or ``accelerator.save_state`` there.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, NotCommittedError
from ..loading.load import fresh_expected, load
from ..saving.save import save
from ._common import is_checkpoint_dir, remove_checkpoint

__all__ = ["load_state", "save_state"]

LAYOUT = "gds_persist.integrations.accelerate/1"  # the checkpoint's "layout" entry
DATA_PARALLEL = ("MULTI_CPU", "MULTI_GPU")  # replicated models: a data-parallel save and load
RANK_LOCAL = ["rng", "dataloaders", "custom"]  # each process's own, with several processes


def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = None, *,
               allow_pickle: bool = False, **save_kwargs: Any) -> str:
    """Save what ``accelerator.save_state`` saves as one gds_persist checkpoint directory (an
    existing one there is replaced atomically). Every process calls it.

    Parameters
    ----------
    accelerator
        The ``accelerate.Accelerator`` whose prepared objects are saved.
    output_dir
        Where; None: the next ``checkpoint_<n>`` of ``automatic_checkpoint_naming``.
    allow_pickle
        Store leaves that are not tensors or plain data pickled (one process only).
    save_kwargs
        :func:`gds_persist.save` keywords (``backend``, ``io_threads``, ...).

    Returns
    -------
    str
        The checkpoint directory.

    Raises
    ------
    NotImplementedError
        Sharded training (FSDP, DeepSpeed, Megatron-LM) or XLA.
    TypeError
        A leaf a checkpoint cannot hold without ``allow_pickle=True``, naming its key path.
    """
    several = _processes(accelerator) > 1
    if several and allow_pickle:
        raise ValueError("save_state(..., allow_pickle=True) is for single-process training; "
                         f"this accelerator has {accelerator.num_processes} processes")
    output_dir = _output_dir(accelerator, output_dir)
    models = list(accelerator._models)
    weights = [accelerator.get_state_dict(m, unwrap=False) for m in models]
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(models, weights, output_dir)  # as Accelerate: may save and drop some weights
    state = {
        "layout": LAYOUT,
        "models": weights,
        "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [dl.state_dict() if getattr(dl, "use_stateful_dataloader", False)
                        else None for dl in accelerator._dataloaders],
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "rng": rng_states(),
        "step": accelerator.step,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
    }
    main = accelerator.is_main_process
    if main and os.path.isdir(output_dir) and not os.listdir(output_dir):
        os.rmdir(output_dir)  # made empty by hand or by Accelerate: gds_persist creates it
    if several:
        save_kwargs = {"process_group": "default", "rank_local": RANK_LOCAL, **save_kwargs}
    try:
        save(state, output_dir, allow_pickle=allow_pickle, **save_kwargs)
    except TypeError as e:
        if allow_pickle or "allow_pickle=True" not in str(e):
            raise
        raise TypeError(f"{e}; with Accelerate: save_state(accelerator, ..., "
                        "allow_pickle=True)") from e
    accelerator.project_configuration.iteration += 1
    return output_dir


def load_state(accelerator: Any, input_dir: str | os.PathLike[str] | None = None, *,
               verify: bool = True, strict: bool = True) -> None:
    """Restore the state :func:`save_state` saved into the prepared objects of ``accelerator``:
    the models' and optimizers' tensors are filled in place (``gds_persist.load(into=...)``).
    Every process calls it.

    Parameters
    ----------
    accelerator
        The ``accelerate.Accelerator``, with the same objects prepared as when it was saved.
    input_dir
        The checkpoint; None: the newest ``checkpoint_<n>`` (``automatic_checkpoint_naming``).
    verify
        Check every CRC32C while reading.
    strict
        As the models' ``load_state_dict(strict=...)``.

    Raises
    ------
    CheckpointError
        ``input_dir`` was not written by :func:`save_state`, or holds another number of models,
        optimizers, schedulers, dataloaders or registered objects than ``accelerator``.
    NotCommittedError
        ``input_dir`` is None and no committed checkpoint is there.
    """
    several = _processes(accelerator) > 1
    input_dir = _input_dir(accelerator, input_dir)
    # into= holds only the live tensors: in every correct resume the checkpoint's RNG states,
    # registered objects and a not yet stepped optimizer's moments have none and load fresh
    # (checked below: the objects' counts, the models' load_state_dict(strict=strict))
    with fresh_expected():
        state = load(input_dir, map_location="cpu", verify=verify,
                     process_group="default" if several else None, into=_live(accelerator),
                     strict=False)
    if not (isinstance(state, dict) and state.get("layout") == LAYOUT):
        raise CheckpointError(
            f"{input_dir} was not written by gds_persist.integrations.accelerate.save_state")
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, input_dir)  # as Accelerate: may load and drop some models
    hooked = accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook
    _restore(input_dir, "models", models, state["models"][: len(models)] if hooked
             else state["models"], lambda m, sd: m.load_state_dict(sd, strict=strict))
    _restore(input_dir, "optimizers", accelerator._optimizers, state["optimizers"],
             lambda o, sd: o.load_state_dict(sd))
    _restore(input_dir, "schedulers", accelerator._schedulers, state["schedulers"],
             lambda s, sd: s.load_state_dict(sd))
    _restore(input_dir, "dataloaders", accelerator._dataloaders, state["dataloaders"],
             lambda dl, sd: sd is not None and dl.load_state_dict(sd))
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    _restore(input_dir, "registered objects", accelerator._custom_objects, state["custom"],
             lambda obj, sd: obj.load_state_dict(sd))
    set_rng_states(state["rng"])
    accelerator.step = state["step"]


def _live(accelerator: Any) -> dict[str, Any]:
    """The tensors of the prepared models and optimizers, for the load to fill in place (on
    their own devices: a model on a GPU is read straight into its parameters). Their
    ``load_state_dict`` then finds its own tensors there: nothing is copied twice."""
    return {"models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
            "optimizers": [opt.state_dict() for opt in accelerator._optimizers]}


def rng_states() -> dict[str, Any]:
    """The RNG states ``Accelerator.save_state`` saves.

    Returns
    -------
    dict
        Python's, numpy's and torch's states, and CUDA's where CUDA is available.
    """
    states: dict[str, Any] = {
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back the RNG states of :func:`rng_states`.

    Parameters
    ----------
    states
        What :func:`rng_states` returned (CUDA's is skipped where CUDA is not available).
    """
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _processes(accelerator: Any) -> int:
    """The number of processes, after checking that their state can be saved here."""
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    n = int(accelerator.num_processes)
    if (kind == "NO" and n == 1) or (kind in DATA_PARALLEL and n >= 1):
        return n
    raise NotImplementedError(
        f"gds_persist.integrations.accelerate supports single-process and data-parallel "
        f"({', '.join(DATA_PARALLEL)}) training; this accelerator is {kind} with {n} "
        "processes, whose state is sharded (use gds_persist.dcp, or accelerator.save_state)")


def _output_dir(accelerator: Any, output_dir: str | os.PathLike[str] | None) -> str:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or a ProjectConfiguration with "
                             "automatic_checkpoint_naming=True)")
        return os.fspath(output_dir)
    root = os.path.join(accelerator.project_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    existing = _numbered(root)
    if config.total_limit is not None and accelerator.is_main_process:
        for _, old in existing[: max(0, len(existing) + 1 - config.total_limit)]:
            remove_checkpoint(old)  # whole directories, oldest first
    path = os.path.join(root, f"checkpoint_{config.iteration}")
    if os.path.exists(path):
        raise ValueError(f"Checkpoint directory {path} ({config.iteration}) already exists; "
                         "set accelerator.project_configuration.iteration to continue after it")
    return path


def _input_dir(accelerator: Any, input_dir: str | os.PathLike[str] | None) -> str:
    if input_dir is not None:
        return os.path.expanduser(os.fspath(input_dir))
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming=True)")
    found = _numbered(os.path.join(accelerator.project_dir, "checkpoints"))
    if not found:
        raise NotCommittedError(
            f"no committed checkpoint_<n> in {accelerator.project_dir}/checkpoints")
    return found[-1][1]


def _numbered(root: str) -> list[tuple[int, str]]:
    """Committed ``checkpoint_<n>`` directories under ``root``, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"checkpoint_(\d+)", name)
        if m and is_checkpoint_dir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def _restore(where: str, what: str, objects: list[Any], states: list[Any], apply: Any) -> None:
    if len(objects) != len(states):
        raise CheckpointError(
            f"{where} holds {len(states)} {what} but the accelerator has {len(objects)}; "
            "prepare the same objects as when it was saved")
    for obj, sd in zip(objects, states, strict=True):
        apply(obj, sd)

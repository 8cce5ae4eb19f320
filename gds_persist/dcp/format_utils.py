"""Conversions between DCP checkpoints and ``torch.save`` files with gds_persist's DCP storage.

The counterparts of ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` and
``torch_save_to_dcp`` (which are fixed to ``FileSystemReader``/``FileSystemWriter``), with the
same positional arguments. Differences, and why (docs/INTEGRATIONS.md): the ``torch.save`` file
appears atomically and every CRC32C is checked on the way (as ``export_checkpoint`` writes it),
and ``torch_save_to_dcp`` unpickles its source with ``weights_only=True`` unless told otherwise.
The DCP directory must be new, empty or a checkpoint: it is replaced whole, so the directory
that holds the source file is refused.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ..loading.load import load, read_manifest
from ..saving.save import save
from ..transfer.commit import check_replaceable
from .consolidate import consolidate, is_dcp
from .writer import GdsPersistWriter


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike[str],
                      torch_save_path: str | os.PathLike[str]) -> None:
    """Consolidate the DCP checkpoint into one ``torch.save`` file (all in host memory). A
    checkpoint written by ``gds_persist.save`` is loaded whole instead, as
    ``export_checkpoint`` does."""
    path = os.fspath(dcp_checkpoint_dir)
    state = consolidate(path) if is_dcp(read_manifest(path)) else load(path, map_location="cpu")
    save(state, torch_save_path, format="torch", allow_pickle=True)


def torch_save_to_dcp(torch_save_path: str | os.PathLike[str],
                      dcp_checkpoint_dir: str | os.PathLike[str], *,
                      weights_only: bool = True) -> None:
    """Save the state dict of a ``torch.save`` file as a DCP checkpoint (one process).
    ``weights_only=False`` unpickles any object, as torch's own function does: trusted files
    only."""
    check_replaceable(os.fspath(dcp_checkpoint_dir))  # before reading the source
    state = torch.load(torch_save_path, weights_only=weights_only)
    with warnings.catch_warnings():  # one process on purpose: DCP's no_dist warning says so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, storage_writer=GdsPersistWriter(dcp_checkpoint_dir), no_dist=True)

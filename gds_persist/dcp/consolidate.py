"""A checkpoint written through DCP, consolidated into one full (unsharded) state dict.

DCP's own planner (``_EmptyStateDictLoadPlanner``, the one ``dcp_to_torch_save`` uses) builds
the full state dict on the CPU from the saved metadata, reading through
:class:`~gds_persist.dcp.GdsPersistReader` (every CRC32C checked). All of it is held in memory.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..format import Manifest
from .reader import GdsPersistReader
from .writer import WRITER_TAG


def is_dcp(m: Manifest) -> bool:
    """Whether the checkpoint of manifest ``m`` was written through DCP (GdsPersistWriter)."""
    return m.writer.get("writer") == WRITER_TAG


def consolidate(path: str | os.PathLike[str], backend: str | None = None) -> dict[str, Any]:
    """The DCP checkpoint at ``path`` as one full (unsharded) state dict on the CPU, via DCP's
    own planner."""
    sd: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(
            sd,
            storage_reader=GdsPersistReader(path, backend=backend),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return sd

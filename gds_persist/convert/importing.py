"""``import_checkpoint``: a ``torch.save`` file or a safetensors file as a gds_persist checkpoint.

The source file is mapped, not read (memory: :mod:`gds_persist.convert`), and never unpickled
beyond ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.safetensors import looks_like_safetensors
from ..format.torch_archive import ZIP_MAGIC
from ..progress import ProgressCallback
from ..results import SaveInfo
from ..saving.save import save
from ..stores import refuse_url
from . import FORMATS
from .safetensors import map_safetensors


def detect_format(file: str) -> str:
    """``"torch"`` or ``"safetensors"``, from the first bytes of ``file``."""
    with open(file, "rb") as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
    if head[:4] == ZIP_MAGIC or head[:1] == b"\x80":  # zip (torch.save) or a legacy pickle
        return "torch"
    if looks_like_safetensors(head, size):
        return "safetensors"
    raise ValueError(
        f"{file} is neither a torch.save file nor a safetensors file "
        "(pass format= to say which it is)"
    )


def import_checkpoint(
    file: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    format: str = "auto",
    backend: str | None = None,  # noqa: A002
    progress: ProgressCallback | None = None,
    **save_options: Any,
) -> SaveInfo:
    """Save the contents of a ``torch.save`` file or a safetensors file as a gds_persist
    checkpoint at ``path`` (atomically, like :func:`gds_persist.save`). torch files are read
    with ``torch.load(weights_only=True)`` only: one that needs any other class is refused,
    never unpickled. A safetensors file written by :func:`gds_persist.export_checkpoint` gets
    its nesting, non-tensor leaves, parameters and tied tensors back; any other gives a flat
    ``{name: tensor}`` dict.

    Parameters:
        file: the ``torch.save`` or safetensors file.
        path: where the checkpoint goes.
        format: ``"auto"`` (from the file's first bytes), ``"torch"`` or ``"safetensors"``.
        backend, progress: as for :func:`gds_persist.save`.
        save_options: further keywords of :func:`gds_persist.save`.

    Returns:
        The :class:`~gds_persist.SaveInfo` of the save.

    Raises:
        ValueError: ``file`` is neither format, or an unknown ``format``.
        CheckpointError: a torch file that needs a class ``weights_only=True`` refuses.
    """
    file, path = os.fspath(file), os.fspath(path)
    refuse_url(file, "import_checkpoint")
    refuse_url(path, "import_checkpoint")
    kind = detect_format(file) if format == "auto" else format
    if kind not in FORMATS:
        raise ValueError(f"unknown import format {format!r}; valid: auto, {', '.join(FORMATS)}")
    if kind == "torch":
        state = _load_torch_file(file)
    else:
        state = map_safetensors(file)
    return save(state, path, backend=backend, progress=progress, **save_options)


def _load_torch_file(file: str) -> Any:
    with open(file, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{file} holds objects that torch.load(weights_only=True) refuses to build "
            f"({first[0] if first else 'unsupported global'}). gds_persist never unpickles "
            "arbitrary code: in an environment you trust, load it and save its tensors and "
            "plain values (e.g. model.state_dict()) with torch.save, then import that file"
        ) from e

"""The rarer options of :func:`gds_persist.load`: :class:`LoadOptions`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadOptions:
    """The rarer options of :func:`gds_persist.load`, passed as ``load(..., options=...)``.

    Parameters
    ----------
    strategy : {"broadcast", "allgather", "read_all"}, optional
        With a process group: how replicated data reaches every rank (read once in total and
        shared, or read by every rank). Default: the ``load_strategy`` setting.
    rank_local : None, "all" or int
        Whose rank-local parts fill their places: None (this rank's with a process group,
        every rank's - a dict by rank - without), ``"all"``, or a rank number.
    data_dirs : dict or list, optional
        Data directories that moved: ``{recorded root: new root}``, or a list in the
        manifest's order.
    weights_only : bool
        A ``torch.save`` file's pickle runs through torch's weights-only unpickler;
        ``False`` runs any object it holds (trusted files only).
    """

    strategy: str | None = None
    rank_local: Any = None
    data_dirs: Any = None
    weights_only: bool = True


def check_into(into: Any) -> None:
    """TypeError, naming the fix, for an ``into=`` that is not a state (whose tensors would
    all count as missing: a module, an optimizer, a path)."""
    if into is None or isinstance(into, Mapping | list | tuple):
        return
    kind = type(into).__name__
    if hasattr(into, "state_dict"):
        raise TypeError(f"load(into=...) takes a state dict, not a {kind}: pass "
                        "into=model.state_dict() (its tensors are filled in place; for a whole "
                        "checkpoint, into={'model': model.state_dict(), "
                        "'optim': optimizer.state_dict()} as it was saved)")
    if isinstance(into, str | bytes | os.PathLike):
        raise TypeError(f"load(into=...) takes the state dict to fill, not a {kind} path "
                        f"({into!r}): the checkpoint's path is load's first argument")
    raise TypeError(f"load(into=...) takes a state dict (dicts, lists and tuples of tensors, "
                    f"as save took it), not a {kind}")

"""The check that makes overlapping saves exact: a checkpoint holds every storage's bytes as
they were when ``save()`` was called, or it is refused before it is committed.

Whoever returns from ``save()`` before the bytes are written (the Checkpointer, the DeepSpeed
engine) records the CRC32C of each storage at that moment (``Flattened.crc_at_save``, taken by
:mod:`gds_persist.training.capture`). The writer computes the CRC32C of the bytes it actually
wrote, extent by extent, as it always does; here, just before the commit, they are joined per
storage and compared. A storage that changed in between (a forward pass, another optimizer,
user code) makes the save raise :class:`TornCheckpointError` naming its tensors, and nothing
is committed. No byte is read again: the cost is one combine per extent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import TornCheckpointError
from ..format import Extent, joined_crcs, storage_keys
from ..state.flatten import Flattened

SHOWN = 8  # tensors named in the message (all of them are in the exception's ``tensors``)


def refuse_changed(expected: Sequence[int | None] | None, written: Sequence[int | None],
                   name_of: Callable[[int], str], what: str) -> None:
    """Raise :class:`TornCheckpointError` if a storage's ``written`` CRC32C differs from the one
    ``expected`` (taken at ``save()``); ``name_of(k)`` names storage ``k`` for the message. None
    on either side is not compared: expected None is a private copy taken at ``save()``, written
    None a storage not wholly in this file (checked where it is)."""
    if expected is None:
        return
    changed = [name_of(k) for k, (want, got) in enumerate(zip(expected, written, strict=True))
               if want is not None and got is not None and got != want]
    if changed:
        more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
        raise TornCheckpointError(
            f"{what}: {', '.join(changed[:SHOWN])}{more} changed after save() was called and "
            "before its bytes were written (a forward pass, another optimizer, or an in-place "
            "edit), so this checkpoint would mix two states: it was refused and not committed; "
            "earlier checkpoints are intact. Tensors nobody guards are copied at save() unless "
            "they stayed unchanged since the previous save; such a tensor is copied from now on. "
            "For a tensor the guarded optimizer holds, change it only after "
            "handle.wait_released() (docs/TRAINING.md, 'What a save captures')", changed)


def refuse_torn(flat: Flattened, extents: Sequence[Extent], what: str,
                ranks: Sequence[tuple[Sequence[int], Sequence[int | None] | None]] = ()) -> None:
    """:func:`refuse_changed` for a directory-format save of ``flat`` about to be sealed with
    ``extents`` (every rank's, on the rank that commits). A data-parallel save passes each
    rank's rank-local storage sizes and the CRCs it took at ``save`` (``ranks``): they follow
    ``flat``'s storages in the manifest, in rank order."""
    if flat.crc_at_save is None:
        return
    keys = storage_keys(flat.tree, flat.tensors)
    expected, sizes = list(flat.crc_at_save), [s.nbytes for s in flat.storages]
    names = [keys.get(k, f"storage {k}") for k in range(len(sizes))]
    for rank, (local, crcs) in enumerate(ranks):
        expected += crcs or [None] * len(local)
        sizes += local
        names += [f"rank {rank}'s rank-local storage {i}" for i in range(len(local))]
    written = joined_crcs([(e.storage, e.start, e.length, e.crc32c) for e in extents], sizes)
    refuse_changed(expected, written, names.__getitem__, what)

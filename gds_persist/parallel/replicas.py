"""The replica check of a data-parallel save (``check_replicas=``, ``docs/DISTRIBUTED.md``).

Every rank that claims to hold the same replicated state describes it (structure, and with
``"checksums"`` the CRC32C of every storage's bytes); ranks compare digests of the descriptions
in the ``prepare`` phase, and only where one differs does the ``check`` phase find and report, per
rank, where its state first differs from rank 0's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import ReplicationError
from ..format import TensorRecord
from ..format import tree as _tree
from ..state.flatten import Flattened
from ..transfer.crc import device_crc32c
from ..transfer.pipeline import byte_view
from .distributed import Comm

CHECK_REPLICAS = ("structure", "checksums", "off")


def describe(flat: Flattened, crcs: list[int] | None) -> dict[str, Any]:
    """What must be identical on every rank that claims to hold the same replicated state."""
    return {
        "tree": flat.tree,
        "tensors": [t.to_wire() for t in flat.tensors],
        "storages": [[s.nbytes, s.device.split(":")[0]] for s in flat.storages],
        "crc32c": crcs,
    }


def digest(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def description_of(flat: Flattened, check: str) -> tuple[dict[str, Any], str]:
    """This rank's description of its replicated state, as the other ranks see it (through
    JSON), and its digest ('' with ``check="off"``); ``"checksums"`` reads every byte."""
    crcs = None
    if check == "checksums":
        crcs = [device_crc32c(byte_view(s)) for s in flat.storage_objects]
    description = json.loads(json.dumps(describe(flat, crcs)))
    return description, digest(description) if check != "off" else ""


def first_difference(mine: dict[str, Any], ref: dict[str, Any]) -> str:
    """Where this rank's replicated state first differs from rank 0's, in words ('' if nowhere)."""
    t = _tree.difference(mine["tree"], ref["tree"])
    if t:
        return t
    names = _tree.tensor_paths(mine["tree"])
    for i, (a, b) in enumerate(zip(mine["tensors"], ref["tensors"], strict=True)):
        for name in TensorRecord.__dataclass_fields__:
            if a[name] != b[name]:
                return f"tensor {names.get(i, i)}: {name} {a[name]} (rank 0: {b[name]})"
    by_storage: dict[int, str] = {}
    for i, rec in enumerate(mine["tensors"]):
        by_storage.setdefault(rec["storage"], names.get(i, f"#{i}"))
    if len(mine["storages"]) != len(ref["storages"]):
        return f"{len(mine['storages'])} storages (rank 0: {len(ref['storages'])})"
    for s, (a, b) in enumerate(zip(mine["storages"], ref["storages"], strict=True)):
        if a != b:
            return (f"tensor {by_storage.get(s, s)}: storage of {a[0]} bytes on {a[1]} "
                    f"(rank 0: {b[0]} bytes on {b[1]})")
    for s, (a, b) in enumerate(zip(mine["crc32c"] or [], ref["crc32c"] or [], strict=True)):
        if a != b:
            return (f"tensor {by_storage.get(s, s)}: same shape and dtype, different values "
                    f"(crc32c {a:08x}, rank 0: {b:08x})")
    return ""


def check_replicas(comm: Comm, description: dict[str, Any], digests: list[str], what: str,
                   intact: str) -> None:
    """The ``check`` phase, on every rank: where the ranks' ``digests`` differ, find where each
    differing rank's state differs from rank 0's and raise :class:`ReplicationError` saying so."""
    if all(d == digests[0] for d in digests):
        return
    ref = comm.broadcast_json(description if comm.rank == 0 else None, 0, "check")
    diffs = comm.agree("check", lambda: first_difference(description, ref), what, intact)
    bad = {r: d or "differs from rank 0" for r, d in enumerate(diffs) if digests[r] != digests[0]}
    raise ReplicationError(
        f"{what}: the state promised to be replicated (everything not marked rank_local) "
        "differs between ranks: " + "; ".join(f"rank {r}: {d}" for r, d in bad.items())
        + "; mark per-rank state with rank_local=..., or fix the replicas" + intact,
        failed_ranks=bad, phase="check")

"""Fields of a manifest read without validating the rest, for housekeeping that runs at every
save and must not fail on a damaged manifest (retention).

A full :func:`.manifest.parse_manifest` of a 209-tensor manifest held the GIL 6.4 ms; the
Checkpointer's retention asked it of every kept step after every memory-tier step, time the
training thread waited for.
"""

from __future__ import annotations

import json


def base_names(raw: bytes) -> set[str]:
    """The names in the manifest's ``bases`` (an incremental checkpoint's sibling checkpoints).
    Lenient on purpose: whatever can be read counts, so a damaged manifest still protects the
    bases it names; nothing readable, none."""
    try:
        bases = json.loads(raw)["body"].get("bases", [])
        return {b["name"] for b in bases if isinstance(b, dict) and isinstance(b.get("name"), str)}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return set()

"""Gang tasks of tests/test_object_store_group.py (module-level so spawn can pickle them)."""

from __future__ import annotations

from typing import Any

from _dist_tasks import check_loaded

import gds_persist


def load_check(ctx: Any, url: str, strategy: str) -> dict[str, Any]:
    """Load ``url`` over the group of both ranks: what is wrong with it, and the bytes this rank
    fetched from the store (``LoadInfo.bytes_read``: socket reads escape /proc's rchar)."""
    out, info = gds_persist.load_with_info(url, process_group=ctx.group(2),
                                           options=gds_persist.LoadOptions(strategy=strategy))
    return {"problems": check_loaded(out), "read": info.bytes_read, "backend": info.backend}

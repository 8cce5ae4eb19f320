"""``Checkpointer.load``'s work: a step from the drive, or with a memory tier from the nearest
verified copies (:mod:`.tier.recovery`), and what a load sets for the saves after it."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CheckpointReplacedError
from ..loading.load import load_with_info as core_load
from ..loading.options import check_into
from ..parallel.distributed import Comm
from . import steps as _steps
from .handles import CheckpointerStats
from .tier.reading import Request
from .tier.recovery import Restored, restore
from .tiers import Tiers

_LOAD_ATTEMPTS = 3  # load(): steps removed by another process's retention while being opened


class Restoring:
    """The Checkpointer's loading; the Checkpointer sets these attributes."""

    root: str
    process_group: Any
    loaded_step: int | None
    restored_from: str | None
    _backend: str | None
    _comm: Comm
    _lock: threading.RLock
    _stats: CheckpointerStats
    _tiers: Tiers
    _floor: int
    _rollback_to: int | None

    def latest_step(self) -> int | None:
        """The newest committed, published step under ``root`` (None if there is none)."""
        return _steps.latest_step(self.root)

    def _load(self, step: int | None, map_location: Any, verify: bool, into: Any,
              strict: bool) -> Any:
        """``load()`` once in-flight saves are done."""
        check_into(into)
        kwargs = {"backend": self._backend, "into": into, "strict": strict,
                  "process_group": self.process_group}
        if self._tiers.levels:
            return self._restore(step, map_location, verify, kwargs)
        for attempt in range(_LOAD_ATTEMPTS):
            latest = self.latest_step()
            # with a process group, every rank loads the step rank 0 chose
            chosen = self._comm.broadcast_json(latest if step is None else step, 0,
                                               "checkpoint step")
            if chosen is None:
                raise _steps.nothing_to_load(self.root)  # also a FileNotFoundError
            path = _steps.step_path(self.root, chosen)
            try:  # every rank raises the same CheckpointReplacedError (ranks agree in load)
                state = core_load(path, map_location=map_location, verify=verify, **kwargs)[0]
                break
            except CheckpointReplacedError:
                if step is not None or attempt == _LOAD_ATTEMPTS - 1:
                    raise
        self._loaded(chosen, latest, Restored(None, chosen, "drive", ["drive"] * self._comm.size))
        return state

    def _restore(self, step: int | None, map_location: Any, verify: bool,
                 kwargs: dict[str, Any]) -> Any:
        """load() with node-local levels: ``step`` (default the newest every rank can restore)
        from the nearest verified copies (:mod:`.tier.recovery`); a copy of the nearest level
        this node lacked is rewritten afterwards, in the background."""
        if self._tiers.durable is not None:  # a flush in flight may still move `latest`
            self._tiers.durable.flusher.join(self._tiers.config.timeout_s)

        def load_drive(path: str) -> tuple[Any, int]:
            state, info = core_load(path, map_location=map_location, verify=verify, **kwargs)
            return state, info.payload_bytes

        request = Request(kwargs["into"], kwargs["strict"], map_location, self._backend)
        latest, peer_s = self.latest_step(), self._tiers.peer_timeout_s
        got = restore(self._comm, [lv.view for lv in self._tiers.levels], self.root,
                      load_drive, request, step, peer_s, self._tiers.replica_plan)
        state = self._tiers.take(got)  # and heals this node's copies from the state
        self._loaded(got.step, latest, got)
        return state

    def _loaded(self, step: int, latest: int | None, got: Restored) -> None:
        with self._lock:
            self.loaded_step = step
            self._floor = step
            self._tiers.base_step = step
            self._rollback_to = step if latest is not None and step < latest else None
            self.restored_from = got.source
            s = self._stats
            s.restored_from, s.restore_step, s.restore_s = got.source, step, got.seconds
            s.restore_sources, s.restore_skipped = list(got.sources), list(got.skipped)
            s.restore_bytes = dict(got.bytes_from)

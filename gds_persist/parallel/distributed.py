"""The distributed glue: the only module that calls ``torch.distributed``.

A :class:`Comm` gives the save and load orchestration (``parallel_save``, ``load``) the
few collectives they need: exchange small JSON messages, broadcast / all-gather byte buffers, and
:meth:`Comm.agree` - run a local step, then learn every rank's outcome, so that when one rank fails
*every* rank raises an error naming it and its cause, instead of the others hanging.

Every wait is bounded: collectives run asynchronously and are waited for with
``collective_timeout_s`` (a setting); a wait that runs out raises :class:`CollectiveTimeoutError`
naming the phase. With gloo that bound is exact. With NCCL, ``Work.wait`` only orders the GPU
stream, so there the bound is the process group's own ``timeout`` (``init_process_group(timeout=)``)
enforced by NCCL's watchdog: set it.

:class:`SoloComm` is the ``no_dist`` path (one process, no process group): the same orchestration
runs on it, so single-process saves with rank-local parts or data directories need no
``torch.distributed`` at all.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..errors import CollectiveTimeoutError, DistributedError, PeerLostError

log = logging.getLogger("gds_persist")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


# How long a finished collective may take to let go of its tensors (see _await_release).
RELEASE_TIMEOUT_S = 5.0


def _await_release(tensors: list[torch.Tensor], baseline: list[int]) -> None:
    """Return once nothing but Python refers to ``tensors`` again.

    A gloo worker thread drops its reference to a finished collective's tensors a moment after
    the wait returns, and dropping it takes the GIL (torch keeps each tensor's Python object
    alive while C++ holds the tensor). If the interpreter is shutting down by then, that thread
    is killed while it unwinds C++ code: the process aborts with "terminate called without an
    active exception" (pytorch/pytorch#190489). Waiting here, GIL released, until the tensors'
    Python reference counts are back at ``baseline`` (counted before the post) means no worker
    still holds our tensors when this returns, so none is left to race the interpreter's exit.
    """
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    pause = 0.0
    while (any(n > b for n, b in zip(_refcounts(tensors), baseline, strict=True))
           and time.monotonic() < deadline):
        time.sleep(pause)  # releases the GIL, which the worker needs to let go
        pause = min(2 * pause or 1e-5, 1e-3)
    if time.monotonic() >= deadline:
        log.warning("gds_persist: a finished gloo collective still held its tensors after "
                    "%g s; going on", RELEASE_TIMEOUT_S)


def _refcounts(tensors: list[torch.Tensor]) -> list[int]:
    """Python references to each tensor (counted the same way before and after a post)."""
    return [sys.getrefcount(t) for t in tensors]


class Comm:
    """Collectives over one group. ``rank``/``size`` are ranks within the group."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where collective buffers must live
    timeout_s: float = 600.0
    backend: str = "none"

    # -- primitives (overridden by GroupComm) --------------------------------------------------
    def all_gather_bytes(self, data: bytes, phase: str) -> list[bytes]:
        return [data]

    def broadcast_bytes(self, data: bytes | None, src: int, phase: str) -> bytes:
        assert data is not None
        return data

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        pass

    def all_gather_tensor(self, out: torch.Tensor, inp: torch.Tensor, phase: str) -> None:
        out.copy_(inp)

    def send_recv(self, sends: list[tuple[int, torch.Tensor]],
                  recvs: list[tuple[int, torch.Tensor]], phase: str,
                  peer_timeout_s: float | None = None) -> None:
        """Point to point: send each ``(dst, tensor)`` and fill each ``(src, tensor)``, all posted
        at once and then waited for (so pairs that send both ways cannot deadlock); each wait
        is bounded by ``peer_timeout_s`` (default ``timeout_s``), and a peer that died or does
        not answer raises :class:`PeerLostError` naming it. One process has no peers: only
        empty lists."""
        if sends or recvs:
            raise DistributedError(f"phase '{phase}': point-to-point transfers need a process "
                                   "group (this Checkpointer has none)", phase=phase)

    # -- built on the primitives ----------------------------------------------------------------
    def all_gather_json(self, obj: Any, phase: str) -> list[Any]:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(obj).encode(), phase)]

    def broadcast_json(self, obj: Any, src: int, phase: str) -> Any:
        data = json.dumps(obj).encode() if self.rank == src else None
        return json.loads(self.broadcast_bytes(data, src, phase))

    def agree(self, phase: str, step: Callable[[], Any], what: str, outcome: str = "") -> list[Any]:
        """Run ``step`` here, then exchange outcomes with every rank; return every rank's result.

        If any rank's step raised, every rank raises :class:`DistributedError` naming each failed
        rank and its exception (chained from the local exception where this rank failed).
        ``what`` names the operation (``"save of /ckpt/step-100"``), ``outcome`` what the failure
        means for the checkpoint.
        """
        local_error: Exception | None = None
        try:
            status = {"ok": True, "result": step()}
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here too
            local_error = e
            status = {"ok": False, "error": _first_line(e)}
        try:
            statuses = self.all_gather_json(status, phase)
        except DistributedError as e:
            raise type(e)(f"{what}: {e}{outcome}", failed_ranks=e.failed_ranks,
                          phase=e.phase) from (local_error or e)
        failed = {r: s["error"] for r, s in enumerate(statuses) if not s["ok"]}
        if failed:
            causes = "; ".join(f"rank {r} raised {cause}" for r, cause in sorted(failed.items()))
            raise DistributedError(f"{what} failed in phase '{phase}': {causes}{outcome}",
                                   failed_ranks=failed, phase=phase) from local_error
        return [s["result"] for s in statuses]


class SoloComm(Comm):
    """One process, no process group: a failing step raises its own exception, unwrapped."""

    def agree(self, phase: str, step: Callable[[], Any], what: str, outcome: str = "") -> list[Any]:
        return [step()]


class GroupComm(Comm):
    """Collectives over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group: Any, timeout_s: float):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "a process_group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (or pass process_group=None)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise DistributedError("this process is not a member of the process_group it was given")
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self.timeout_s = timeout_s
        self._gather_single = (getattr(dist, "all_gather_single", None)
                               or dist.all_gather_into_tensor)

    def _global(self, group_rank: int) -> int:
        try:
            return self._dist.get_global_rank(self.group, group_rank)
        except (RuntimeError, ValueError, AttributeError):
            return group_rank  # the default group: group ranks are global ranks

    def _collective(self, phase: str, tensors: list[torch.Tensor],
                    post: Callable[[], Any]) -> None:
        """Post one asynchronous collective on ``tensors`` (``post()`` returns its work), wait
        for it (bounded), and, with gloo, until its worker has let go of the tensors."""
        baseline = _refcounts(tensors)
        work = post()
        self._wait(work, phase)
        del work
        if self.backend == "gloo":
            _await_release(tensors, baseline)

    def _wait(self, work: Any, phase: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            text = str(e).lower()
            if "timed out" in text or "timeout" in text:
                raise CollectiveTimeoutError(
                    f"rank {self.rank} waited {self.timeout_s:g} s for the other ranks in phase "
                    f"'{phase}', in vain: a rank hung, died or is not taking part (see its log); "
                    "raise the collective_timeout_s setting if ranks are only slow",
                    phase=phase) from e
            raise DistributedError(
                f"rank {self.rank} lost contact with the other ranks in phase '{phase}' "
                f"({_first_line(e)}): a rank probably died; see its log", phase=phase) from e
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def all_gather_bytes(self, data: bytes, phase: str) -> list[bytes]:
        lengths = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        mine = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.all_gather_tensor(lengths, mine, phase)
        sizes = lengths.tolist()
        width = max(sizes) or 1
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(width * self.size, dtype=torch.uint8, device=self.device)
        self.all_gather_tensor(out, buf.to(self.device), phase)
        raw = out.cpu().numpy().tobytes()
        return [raw[r * width : r * width + n] for r, n in enumerate(sizes)]

    def broadcast_bytes(self, data: bytes | None, src: int, phase: str) -> bytes:
        n = torch.tensor([len(data) if self.rank == src and data is not None else 0],
                         dtype=torch.int64, device=self.device)
        self.broadcast_tensor(n, src, phase)
        buf = torch.zeros(max(int(n.item()), 1), dtype=torch.uint8)
        if self.rank == src and data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        self.broadcast_tensor(buf, src, phase)
        return buf.cpu().numpy().tobytes()[: int(n.item())]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        self._collective(phase, [tensor], lambda: self._dist.broadcast(
            tensor, src=self._global(src), group=self.group, async_op=True))

    def all_gather_tensor(self, out: torch.Tensor, inp: torch.Tensor, phase: str) -> None:
        self._collective(phase, [out, inp], lambda: self._gather_single(
            out, inp, group=self.group, async_op=True))

    def send_recv(self, sends: list[tuple[int, torch.Tensor]],
                  recvs: list[tuple[int, torch.Tensor]], phase: str,
                  peer_timeout_s: float | None = None) -> None:
        outgoing = [(d, t.to(self.device)) for d, t in sends]  # alive until waited for
        tensors = [t for _, t in outgoing] + [t for _, t in recvs]
        baseline = _refcounts(tensors)
        works: list[tuple[int, str, Any]] = [
            (d, "sending to", self._dist.isend(t, dst=self._global(d), group=self.group))
            for d, t in outgoing]
        works += [(s, "receiving from", self._dist.irecv(t, src=self._global(s),
                                                         group=self.group)) for s, t in recvs]
        limit = self.timeout_s if peer_timeout_s is None else peer_timeout_s
        for peer, doing, work in works:
            try:
                work.wait(timeout=timedelta(seconds=limit))
            except RuntimeError as e:
                raise PeerLostError(
                    f"rank {self.rank} lost rank {peer} while {doing} it in phase '{phase}' "
                    f"({_first_line(e)}): rank {peer} died or hung (see its log); a peer that "
                    f"is only slow needs a larger peer_timeout_s (now {limit:g} s)",
                    peer=peer, phase=phase) from e
        works.clear()  # and the loop's last one: our references to the works go
        work = None
        if self.backend == "gloo":
            _await_release(tensors, baseline)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def make_comm(process_group: Any, timeout_s: float) -> Comm:
    """A :class:`GroupComm` for ``process_group`` (``"default"``: the default group), or a
    :class:`SoloComm` for ``None``."""
    if process_group is None:
        return SoloComm()
    if isinstance(process_group, str) and process_group == "default":
        import torch.distributed as dist

        process_group = dist.group.WORLD
    return GroupComm(process_group, timeout_s)


def background_group(timeout_s: float) -> Any:
    """A gloo group of every rank of the default group, for the collectives a background thread
    runs while the main thread runs its own on the default group (two threads must not share a
    group: their collectives could pair up in a different order on different ranks); None where
    torch.distributed is not initialized. Every rank calls it, in the same order relative to
    other group creations (``new_group`` is collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

"""The Checkpointer's ``mode="auto"``: snapshot or fence, from the state and the machine it meets.

:func:`choose_mode` is a pure function of what a first ``save`` sees (the snapshot's size, whether
any of the state lives on a GPU, the host memory described by :class:`HostMemory`), so the rule is
tested for every case; :func:`host_memory` reads the machine. The rule (docs/TRAINING.md):

* **CPU-only state: fence.** No copy and no extra memory; measured best on the CPU machine
  (:data:`CPU_FIGURES`: fence +2.5% per iteration, snapshot +6.3%).
* **State on a GPU: snapshot**, into a bounded pinned arena, when the arena fits the host memory:
  the arena (twice the snapshot, else one snapshot) times the processes of this node that may
  each take one (``LOCAL_WORLD_SIZE``) must fit in :data:`HOST_FRACTION` of MemAvailable. The
  copy out of GPU memory takes milliseconds, and the optimizer's update then never waits for a
  write (:data:`GPU_FIGURES`: snapshot +0.1% per iteration, fence +72.6%, where one write
  outlasted forward + backward).
* otherwise (host memory too small or unknown, or ``snapshot_bytes`` smaller than one snapshot):
  **fence**.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HOST_FRACTION = 0.5  # of MemAvailable, for every arena of this node: the rest stays for the job
_MEASURED = 'docs/TRAINING.md, "Fence, snapshot, or auto (the default)": '
CPU_FIGURES = (_MEASURED + "CPU-only training, 64 MB checkpoint every iteration, fence +2.5% "
               "vs snapshot +6.3%")
GPU_FIGURES = (_MEASURED + "H200, 1.02 GB checkpoint every 575 ms iteration, snapshot +0.1% "
               "vs fence +72.6%")
GB = 1e9


@dataclass(frozen=True)
class HostMemory:
    """The host memory a snapshot arena would come out of."""

    available_bytes: int | None  # MemAvailable; None when unknown
    source: str  # where the figure came from, or why it is unknown
    local_processes: int = 1  # processes on this node that may each take an arena


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # "fence" or "snapshot"
    snapshot_bytes: int | None  # the arena's capacity in snapshot mode
    reason: str


def choose_mode(snapshot_nbytes: int, on_gpu: bool, memory: HostMemory,
                snapshot_bytes: int | None = None) -> ModeChoice:
    """``mode="auto"``'s choice for a state whose snapshot takes ``snapshot_nbytes``
    (``snapshot_bytes``: the arena size the user gave, else twice then once the snapshot)."""
    if not on_gpu:
        return ModeChoice("fence", None, f"auto: CPU-only state: fence, no copy ({CPU_FIGURES})")
    need = snapshot_nbytes
    if snapshot_bytes is not None and snapshot_bytes < need:
        return ModeChoice("fence", None, (
            f"auto: a snapshot needs {need / GB:.2f} GB but snapshot_bytes is "
            f"{snapshot_bytes / GB:.2f} GB: fence"))
    if memory.available_bytes is None:
        return ModeChoice("fence", None, f"auto: state on a GPU but host memory unknown "
                                         f"({memory.source}): fence")
    budget = int(memory.available_bytes * HOST_FRACTION)
    per = memory.local_processes
    of_node = f" x {per} processes on this node" if per > 1 else ""
    sizes = [snapshot_bytes] if snapshot_bytes is not None else [2 * need, need]
    for arena in sizes:
        if arena * per <= budget:
            depth = ("" if snapshot_bytes is not None else
                     ", two snapshots deep" if arena == 2 * need else
                     ", one snapshot deep (two do not fit)")
            return ModeChoice("snapshot", arena, (
                f"auto: state on a GPU; a {arena / GB:.2f} GB pinned arena{of_node}{depth} fits "
                f"in {HOST_FRACTION:.0%} of {memory.available_bytes / GB:.2f} GB available "
                f"({memory.source}): snapshot, so the update need not wait for the write "
                f"({GPU_FIGURES})"))
    return ModeChoice("fence", None, (
        f"auto: state on a GPU, but a {sizes[-1] / GB:.2f} GB snapshot arena{of_node} does not "
        f"fit in {HOST_FRACTION:.0%} of {memory.available_bytes / GB:.2f} GB available "
        f"({memory.source}): fence"))


def host_memory(meminfo: str = "/proc/meminfo") -> HostMemory:
    """MemAvailable now, and the processes of this node (``LOCAL_WORLD_SIZE``, set by torchrun).
    Never raises: an unknown figure is None with the reason."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    per = int(local) if local.isdigit() and int(local) > 0 else 1
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return HostMemory(kib * 1024, f"{meminfo} MemAvailable", per)
    except (OSError, ValueError, IndexError) as e:
        return HostMemory(None, f"{meminfo} unreadable: {e}", per)
    return HostMemory(None, f"no MemAvailable in {meminfo}", per)

"""bench_recovery.py's levels configuration: restore after a node loss from the peers' copies
against a restore from the durable level alone (cold page cache), and the bytes each level holds
per node.

The job (tests/tier_worker.py's ``Job``: 2 nodes x 2 gloo ranks) checkpoints through two
node-local levels, ``LEVELS`` = (every, copies): a tmpfs directory per node (``mem/mem-n0``,
every step) and a disk directory per node (``base/local1-n0``, every 2nd step), each share with
one copy on the other node, and flushes the durable level (``base/drive``) from them; it trains
2 steps and flushes the newest before it ends, so every level holds step 2.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
from collections.abc import Callable
from typing import Any

from bench import machine
from tests.tier_worker import NODES, Job

LEVEL_SOURCES = ("peers", "durable")
LEVELS = [(1, 1), (2, 1)]  # (every, copies): the tmpfs level, the disk level
DRIVE_EVERY = 2
LEVEL_TARGET = 1.5  # peers after a node loss, times faster than the cold durable restore
NODE_NAMES = [f"n{i}" for i in range(NODES)]


def level_dirs(base: str, mem: str, node: str) -> dict[str, str]:
    """Node ``node``'s directory of each level, by the level's kind (as ``Job.level_root``)."""
    return {"tmpfs": os.path.join(mem, f"mem-{node}"),
            "disk": os.path.join(base, f"local1-{node}")}


def allocated(path: str) -> int:
    """Allocated bytes of every file under ``path`` (holes not counted; 0 where missing)."""
    return sum(os.stat(os.path.join(b, n)).st_blocks * 512
               for b, _, names in os.walk(path) for n in names)


def train(base: str, mem: str, width: int, timeout: float) -> dict[str, Any]:
    """Train the job 2 steps through the levels, the newest step flushed before it ends: what
    it committed and flushed, and the allocated bytes per node and level, and of the durable
    level."""
    results = Job(base, resume=False, stop=2, memory=mem, width=width, levels=LEVELS,
                  drive_every=DRIVE_EVERY, flush=True).wait(timeout)
    return {"level_commits": results[0]["level_commits"], "flush": results[0]["flush"],
            "share_bytes": [r["share_bytes"] for r in results],
            "bytes_per_node": {node: {kind: allocated(d)
                                      for kind, d in level_dirs(base, mem, node).items()}
                               for node in NODE_NAMES},
            "durable_bytes": allocated(os.path.join(base, "drive"))}


def run_round(base: str, mem: str, cache: str, restart: Callable[..., dict[str, Any]],
              warm: Callable[[], None], floor: Callable[[str], float]
              ) -> dict[str, dict[str, Any]]:
    """One restart after node n1's loss (``peers``), one with every node-local directory gone
    (``durable``, the page cache emptied first), and ``floor(mem)`` beside them (the least a
    restore from a tmpfs does); the directories are put back after."""
    kw = {"levels": LEVELS, "drive_every": DRIVE_EVERY}
    for d in level_dirs(base, mem, "n1").values():
        shutil.rmtree(d, ignore_errors=True)  # node n1 lost (healed, where it is, by the restore)
    out = {"peers": restart(**kw), "floor": {"restore_s": floor(mem)}}
    gone = [d for node in NODE_NAMES for d in level_dirs(base, mem, node).values()]
    out["durable"] = cold_restart(base, gone, cache, functools.partial(restart, **kw), warm)
    return out


def cold_restart(base: str, gone: list[str], cache: str, restart: Callable[[], dict[str, Any]],
                 warm: Callable[[], None]) -> dict[str, Any]:
    """``restart()`` with the directories ``gone`` moved away and the page cache of the drive
    (``base/drive``) emptied (``warm``: read the libraries back after a global drop); the
    directories are put back after, in place of what the restart made there."""
    away = [d for d in gone if os.path.isdir(d)]
    for d in away:
        os.rename(d, d + ".away")
    try:
        how, _ = machine.drop_page_cache([os.path.join(base, "drive")], cache)
        if how == "drop_caches":
            warm()
        return {**restart(), "cache": how}
    finally:
        for d in away:
            shutil.rmtree(d, ignore_errors=True)
            os.rename(d + ".away", d)


def summarize(out: dict[str, dict[str, Any]]) -> None:
    """Add to ``out`` (the sources' medians) the peers' ratio to the cold durable restore."""
    peers, durable = out["peers"], out["durable"]
    for k in ("start_to_restored_s", "restore_s"):
        peers[f"x_durable_{k}"] = durable[k] / peers[k]
        peers[f"x_durable_{k}_rounds"] = [d / p for d, p in zip(
            durable["rounds_s"][k], peers["rounds_s"][k], strict=True)]
    peers["target"] = LEVEL_TARGET


def table(out: dict[str, dict[str, Any]], trained: dict[str, Any], size: int,
          row: Callable[[str, dict[str, Any], int, str], str]) -> list[str]:
    peers = out["peers"]
    lines = ["levels: tmpfs every step, disk every 2nd step, 1 copy of each share on the other "
             "node, the durable level flushed from them",
             f"{'source':<8} {'start->restored':>16} {'restore':>9} {'GB/s/rank':>10} "
             f"{'x durable':>8}  ranks' sources (bytes read from each source, all ranks)",
             row("peers", peers, size, f"{peers['x_durable_restore_s']:.1f}x")
             + f"; n1's copies rewritten by the restore: {peers['healed_n1']:g}"]
    lines.append(row("durable", out["durable"], size, "-"))
    floor = out["levels_floor"]
    lines.append(f"{'floor':<8} {'':>16} {floor['restore_s']:>8.3f}s "
                 f"{size / floor['restore_s'] / 1e9:>10.2f} {floor['x_durable_restore_s']:>8.1f}x"
                 "  the least a restore from the tmpfs does (bench/memory_floor.py)")
    met = "met" if peers["x_durable_restore_s"] >= LEVEL_TARGET else "NOT met"
    rounds = ", ".join(f"{x:.1f}" for x in peers["x_durable_restore_s_rounds"])
    lines.append(f"target peers >= {LEVEL_TARGET:g}x the cold durable restore: restore "
                 f"{peers['x_durable_restore_s']:.1f}x (rounds {rounds}), start->restored "
                 f"{peers['x_durable_start_to_restored_s']:.1f}x ({met}); at most "
                 f"{floor['x_durable_restore_s']:.1f}x on this machine (the floor)")
    for node, kinds in trained["bytes_per_node"].items():
        lines.append(f"level bytes on {node}: " + ", ".join(
            f"{kind} {n / 2**20:.1f} MiB = {n / size:.3f}x the state" for kind, n in kinds.items())
            + " (design: (1 + copies) x state / nodes = 1.0x)")
    lines.append(f"durable level: {trained['durable_bytes'] / 2**20:.1f} MiB = "
                 f"{trained['durable_bytes'] / size:.3f}x the state; training committed "
                 f"{trained['level_commits']}, flushed {trained['flush']['flushed']} "
                 f"(failures {trained['flush']['failures']})")
    return lines


def medians_of(rounds: list[dict[str, dict[str, Any]]],
               medians: Callable[..., dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = medians(rounds, LEVEL_SOURCES)
    summarize(out)
    out["peers"]["healed_n1"] = statistics.median(r["peers"].get("healed", 0) for r in rounds)
    floor = statistics.median(r["floor"]["restore_s"] for r in rounds)
    out["levels_floor"] = {"restore_s": floor,
                           "x_durable_restore_s": out["durable"]["restore_s"] / floor}
    return out

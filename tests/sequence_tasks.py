"""A file format the tests add as users of the save sequence would: every rank's own 1-D tensor
in a data file of its own, sealed by one manifest that ``gds_persist.load`` reads as
``{"rank0": t0, "rank1": t1, ...}``. It is the whole of a new layout: facts, plan, write, seal,
info (tests/test_sequence.py); the tasks run it on a gang's ranks (tests/_gang.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

import gds_persist
from gds_persist import settings
from gds_persist.format import DataFile, Extent, Manifest, StorageRecord, TensorRecord
from gds_persist.format import tree as _tree
from gds_persist.format.layout import layout_file
from gds_persist.format.records import Wire
from gds_persist.results import SaveInfo
from gds_persist.saving.manifest_builder import Part, build_manifest
from gds_persist.saving.sequence import Layout, Run, run_save
from gds_persist.saving.units import backend_for
from gds_persist.transfer.writer import write_plan


@dataclass(frozen=True)
class Size(Wire):
    nbytes: int


@dataclass(frozen=True)
class Written(Wire):
    extents: list[Extent]
    file_size: int


class PerRankFiles(Layout[Size, Written]):
    """Rank r's tensor in ``r<r>.bin``; ``fail_on``: that rank raises while writing."""

    facts_type, report_type = Size, Written

    def __init__(self, tensor: torch.Tensor, fail_on: int | None = None):
        self.tensor, self.fail_on = tensor.contiguous().view(torch.uint8), fail_on

    def prepare(self, run: Run) -> Size:
        return Size(self.tensor.numel())

    def plan(self, run: Run, facts: list[Size]) -> None:
        self.sizes = [f.nbytes for f in facts]
        self.files = [layout_file(f"r{r}.bin", r, [(r, 0, n)]) for r, n in enumerate(self.sizes)]

    def write(self, run: Run) -> Written:
        rank = run.comm.rank
        if rank == self.fail_on:
            raise OSError(f"rank {rank} was told to fail")
        storage = self.tensor.untyped_storage()
        mine = self.files[rank]
        mine = replace(mine, extents=tuple(replace(e, storage=0) for e in mine.extents))
        backend, _ = backend_for(run.cfg, run.first.tmp, [storage])
        extents = write_plan(backend, run.first.tmp, [mine], [storage], run.cfg)
        return Written([replace(e, storage=rank) for e in extents], mine.size)

    def seal(self, run: Run, reports: list[Written]) -> Manifest:
        world = len(reports)
        tree = _tree.mapping([f"rank{r}" for r in range(world)],
                             [_tree.tensor(r) for r in range(world)])
        part = Part(tree, [TensorRecord(r, "uint8", (n,), (1,), 0)
                           for r, n in enumerate(self.sizes)],
                    [StorageRecord(n, "cpu") for n in self.sizes])
        return build_manifest(part, [DataFile(f"r{r}.bin", w.file_size)
                                     for r, w in enumerate(reports)],
                              [e for w in reports for e in w.extents],
                              {"backend": "test", "layout": "per-rank files"})

    def info(self, run: Run) -> SaveInfo:
        return SaveInfo(run.path, "test", "", sum(w.file_size for w in run.reports),
                        sum(self.sizes), 0.0, len(self.sizes), len(self.sizes))


def save_per_rank(path: str, tensor: torch.Tensor, group: Any = None,
                  fail_on: int | None = None) -> SaveInfo:
    cfg = settings.current()
    return run_save(PerRankFiles(tensor, fail_on), os.path.abspath(path), cfg=cfg,
                    process_group=group)


# --- gang tasks: fn(ctx, ...) on every rank ---------------------------------------------------

def rank_bytes(rank: int, n: int = 10_000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).add(rank * 7).to(torch.uint8)


def save_ranks(ctx: Any, path: str, fail_on: int | None = None) -> str:
    """Every rank saves its own bytes; returns '' or this rank's error's first line."""
    try:
        save_per_rank(path, rank_bytes(ctx.rank, 10_000 + 5_000 * ctx.rank),
                      ctx.group(ctx.world), fail_on)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return ""


def load_all(ctx: Any, path: str) -> dict[str, list[int]] | None:
    if ctx.rank:
        return None
    state = gds_persist.load(path)
    return {k: v.tolist() for k, v in state.items()}

"""The save sequence (gds_persist/saving/sequence.py) with a layout the tests add
(tests/sequence_tasks.py): what a new file format gets from it - every rank's outcome agreed,
one atomic commit, nothing committed and the previous checkpoint intact when any rank fails -
and the typed records that cross ranks (format/records.py: Wire)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sequence_tasks as tasks
import torch
from _gang import Gang

import gds_persist
from gds_persist.format import Extent, StorageRecord, TensorRecord
from gds_persist.format.records import Wire
from gds_persist.saving.directory import Compression, Report
from gds_persist.saving.incremental import Candidate, Holder
from gds_persist.saving.manifest_builder import Part, Referral

WORLD = 2


@pytest.fixture(scope="module")
def gang() -> Iterator[Gang]:
    with Gang(WORLD, timeout_s=60) as g:
        yield g


def test_a_new_layout_saves_alone_and_load_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    info = tasks.save_per_rank(str(path), tasks.rank_bytes(0))
    assert info.payload_bytes == 10_000
    state = gds_persist.load(path)
    assert torch.equal(state["rank0"], tasks.rank_bytes(0))
    assert gds_persist.verify(path) is not None
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary or lock left


def test_a_failed_write_commits_nothing_and_keeps_the_previous(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    tasks.save_per_rank(str(path), tasks.rank_bytes(0))
    with pytest.raises(OSError, match="told to fail"):
        tasks.save_per_rank(str(path), tasks.rank_bytes(1), fail_on=0)
    assert torch.equal(gds_persist.load(path)["rank0"], tasks.rank_bytes(0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_every_rank_writes_its_part_and_rank_0_commits(gang: Gang, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    assert gang.run(tasks.save_ranks, path) == [""] * WORLD
    loaded = gang.run(tasks.load_all, path)[0]
    assert loaded == {f"rank{r}": tasks.rank_bytes(r, 10_000 + 5_000 * r).tolist()
                      for r in range(WORLD)}


def test_a_rank_failing_fails_every_rank_and_keeps_the_previous(gang: Gang,
                                                                 tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    assert gang.run(tasks.save_ranks, path) == [""] * WORLD
    before = gang.run(tasks.load_all, path)[0]
    errors = gang.run(tasks.save_ranks, path, 1)
    assert all(e.startswith("DistributedError") and "rank 1 raised" in e
               and "told to fail" in e for e in errors), errors
    assert gang.run(tasks.load_all, path)[0] == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@dataclass(frozen=True)
class Nested(Wire):
    extents: list[Extent]
    shape: tuple[int, ...]
    by_name: dict[str, int] = field(default_factory=dict)
    maybe: Compression | None = None


def test_records_cross_ranks_by_field_name_and_come_back_typed() -> None:
    e = Extent(3, 4096, 100, 1, 8192, 0xDEADBEEF, "blosc2", 60, 7, "ab" * 16)
    assert e.to_wire()["crc32c"] == 0xDEADBEEF  # by name, not by position
    assert Extent.from_wire(e.to_wire()) == e
    t = TensorRecord(0, "float32", (2, 3), (3, 1), 0, True, True)
    assert TensorRecord.from_wire(t.to_wire()) == t  # tuples come back as tuples
    n = Nested([e], (1, 2), {"a": 1}, Compression("auto", True, "faster"))
    assert Nested.from_wire(n.to_wire()) == n
    assert Nested.from_wire(Nested([], ()).to_wire()).maybe is None
    referral = Referral(5, Candidate("cd" * 16, e, Holder("step-1", "0" * 64), "data.bin", 4096))
    report = Report("direct", "why", "digest", 0.5,
                    Part({"t": "dict"}, [t], [StorageRecord(24, "cpu")]), [e], {"0": 4096},
                    [referral], 100, "", None)
    assert Report.from_wire(report.to_wire()) == report

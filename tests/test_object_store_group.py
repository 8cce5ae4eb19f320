"""A checkpoint in an object store loaded by a process group (real gloo ranks, the local S3
server of bench/s3_server.py): each rank fetches its share by ranged reads and the ranks
exchange the rest, as for a drive; fresh tensors and into=."""

from __future__ import annotations

from collections.abc import Iterator

import _dist_tasks as tasks
import ckpt_dist_tasks
import object_store_tasks
import pytest
from _gang import Gang

import gds_persist
from bench.s3_server import S3Server

URL = "s3://group/run/step-1"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server("group") as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env.items():
            mp.setenv(k, v)
        gds_persist.save(tasks.make_state(), URL)
        yield server


@pytest.fixture(scope="module")
def gang(s3: S3Server) -> Iterator[Gang]:
    with Gang(2, timeout_s=60, env=s3.env) as g:
        yield g


@pytest.mark.parametrize("strategy", ["broadcast", "read_all"])
def test_a_group_loads_an_object_store_checkpoint(gang: Gang, strategy: str) -> None:
    results = gang.run(object_store_tasks.load_check, URL, strategy)
    assert [r["problems"] for r in results] == [[], []]
    assert {r["backend"] for r in results} == {"s3"}
    total = gds_persist.read_manifest(URL).total_bytes
    read = [r["read"] for r in results]
    if strategy == "read_all":
        assert all(r >= total for r in read), (read, total)
    else:  # each rank its share: the replicated bytes cross the store once in total
        assert all(r < 0.8 * total for r in read) and sum(read) >= total, (read, total)


def test_a_group_restores_in_place_from_an_object_store(gang: Gang) -> None:
    assert gang.run(tasks.load_into_check, 2, URL, "broadcast") == [[], []]


@pytest.mark.parametrize("local", [False, True])
def test_a_group_saves_to_the_object_store_each_rank_its_share(gang: Gang, local: bool) -> None:
    url = f"s3://group/dp/local-{local}"
    infos = gang.run(tasks.save, 2, url, with_local=local)
    assert [i["world"] for i in infos] == [2, 2]
    assert all(i["rank_bytes"] > 0 for i in infos)  # both ranks wrote objects
    assert gds_persist.verify(url).ok
    strategy, own = ("broadcast", "own") if local else ("broadcast", None)
    results = gang.run(tasks.load_check, 2, url, strategy, own)
    assert [r["problems"] for r in results] == [[], []]


def test_a_group_checkpointer_with_its_root_in_the_object_store(gang: Gang) -> None:
    got = gang.run(ckpt_dist_tasks.checkpoint_steps, "s3://group/ckpt-run", 3, "fence")
    assert [(r["latest"], r["steps"], r["loaded_step"], r["same"], r["tied"]) for r in got] == \
        [(3, [2, 3], 3, True, True)] * 2
    assert [r["publisher"] for r in got] == [True, False]

"""One model served by every master of a real Redis Cluster (3 masters, 3 replicas of real
redis-server processes), through a URL that spreads requests over its shards
(``rediscluster://…&shards=3``): each request on the shard its ID falls in, a worker taking from
every shard; the split per master; a plain Celery producer and ``AsyncResult`` on the same URL; a
worker killed holding requests of every shard."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from celery import Celery

from asyncinfer.broker.cluster_backend import register_schemes
from asyncinfer.broker.cluster_client import shard_client
from asyncinfer.broker.shards import request_shard
from asyncinfer.client import Client
from tests.support.crashy import (
    answered_by_second,
    crashy_env,
    held_by_first,
    two_crashy_workers,
)
from tests.support.processes import start_worker, stop_together
from tests.support.redis_cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

SHARDS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def _url(cluster: LocalCluster) -> str:
    (host, port), *others = cluster.seeds
    return (f"rediscluster://{host}:{port}/?nodes=" + ",".join(f"{h}:{p}" for h, p in others)
            + f"&shards={SHARDS}")


def _row(i: float) -> dict[str, np.ndarray]:
    return {"input": np.array([[float(i)]], np.float32)}


def _results_per_master(cluster: LocalCluster, ids: set[str]) -> dict[int, int]:
    """How many of ``ids``' results each master holds (by port)."""
    found: Counter[int] = Counter()
    for master in cluster.masters():
        for key in master.client().scan_iter(match="*celery-task-meta-*", count=1000):
            if key.decode().split("celery-task-meta-", 1)[1] in ids:
                found[master.port] += 1
    return dict(found)


def test_one_model_is_served_by_every_master_each_within_ten_percent_of_the_mean(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # Given one worker of one model on a URL that spreads requests over 3 shards (one a master)
    url = _url(cluster)
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          "--concurrency", "4")
    client = Client(broker_url=url)
    register_schemes()
    celery = Celery("producer", broker=url, backend=url)  # a plain Celery app on the same URL
    celery.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                       result_accept_content=["json"])
    try:
        # When the Client sends 3,000 requests, and the plain Celery producer 30
        futures = [client.submit("identity", _row(i)) for i in range(3000)]
        answers = [f.result(timeout=60) for f in futures]
        sent = [celery.send_task("asyncinfer.infer", queue="infer.identity", kwargs={
            "model": "identity",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [float(i)]}]})
            for i in range(30)]
        by_celery = [s.get(timeout=30)["outputs"][0]["data"] for s in sent]
        # Then every one is answered once, with its own input
        assert [float(a.as_numpy("input")[0, 0]) for a in answers] == [float(i) for i in range(3000)]
        assert by_celery == [[float(i)] for i in range(30)]
        # and each master holds the results of its shard's requests: each within 10 % of the mean
        ids = {f.id for f in futures}
        per_master = _results_per_master(cluster, ids)
        assert len(per_master) == 3 and sum(per_master.values()) == 3000, per_master
        assert all(abs(n - 1000) <= 100 for n in per_master.values()), per_master
        print(f"\n3,000 requests of one model over 3 masters: {sorted(per_master.values())}")
        # the plain Celery producer spread its requests too, and AsyncResult reads any request
        # by its ID alone, whichever shard it fell on
        assert {request_shard(s.id, SHARDS) for s in sent} == {0, 1, 2}
        assert len(_results_per_master(cluster, {s.id for s in sent})) == 3
        on_each = {request_shard(f.id, SHARDS): f.id for f in futures}
        assert sorted(on_each) == [0, 1, 2]
        for request_id in on_each.values():
            assert celery.AsyncResult(request_id).get(timeout=10)["id"] == request_id
        assert client.result(on_each[2], timeout_s=10)["input"].tolist() == (
            answers[[f.id for f in futures].index(on_each[2])]["input"].tolist())
        # and nothing is left on any shard's queue, nothing held
        for shard in range(SHARDS):
            r = shard_client(url, shard)
            assert (r.llen("infer.identity"), r.hlen("unacked")) == (0, 0)
            r.close()
        assert "fast consumer on infer.identity (3 shards)" in worker.log()
    finally:
        client.close()
        celery.close()
        worker.stop()


def test_a_worker_killed_holding_requests_of_every_shard_another_answers_them(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # Given two workers on the spread URL at the default settings, the first on a slow kernel
    # (15 s a batch), and 12 requests of all three shards held by the first
    url = _url(cluster)
    shards = [shard_client(url, shard) for shard in range(SHARDS)]
    r = shards[0]  # where the test model records its runs
    prefix, slow = crashy_env(url, "spread", 15)
    first, second = two_crashy_workers(url, url, tmp_path, slow, {**slow, "CRASHY_SLEEP_S": "0.2"})
    client = Client(broker_url=url)
    try:
        futures = held_by_first(client, r, prefix, second.pid, shards)
        assert {request_shard(f.id, SHARDS) for f in futures} == {0, 1, 2}
        # When the first is killed outright
        struck = time.monotonic()
        first.process.kill()
        first.process.wait()
        # Then the second answers every one, from every shard, within the lease and a sweep;
        # those on the first's device ran once more each, together, the others once
        answered_by_second(futures, r, prefix, struck, 60, "kill -9, over 3 shards,")
    finally:
        client.close()
        for w in (first, second):
            if w.process.poll() is None:
                os.kill(w.pid, signal.SIGCONT)
        stop_together([first, second])
        for s in shards:
            s.close()

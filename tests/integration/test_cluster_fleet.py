"""The fleet on a real Redis Cluster (3 masters, 3 replicas of real redis-server processes), through
a ``rediscluster://`` URL: a worker, the ``Client``, Celery's ``AsyncResult`` and ``send_task``,
every key of the fleet in its shard's hash slot on that slot's master."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from celery import Celery

from asyncinfer.broker.cluster_backend import register_schemes
from asyncinfer.broker.shards import key_prefix, shard_tags, tag_slot
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.status import queue_depths
from tests.support.processes import start_worker
from tests.support.redis_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def _url(cluster: LocalCluster) -> str:
    (host, port), *others = cluster.seeds
    return f"rediscluster://{host}:{port}/?nodes=" + ",".join(f"{h}:{p}" for h, p in others)


def _row(i: float) -> dict[str, np.ndarray]:
    return {"input": np.array([[float(i)]], np.float32)}


def test_a_worker_and_its_producers_on_a_cluster_keep_every_key_in_the_shard(
        cluster: LocalCluster, tmp_path: Path) -> None:
    url = _url(cluster)
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          "--concurrency", "4")
    client = Client(settings=Settings(broker_url=url))
    register_schemes()
    celery = Celery("producer", broker=url, backend=url)  # a plain Celery app, as the docs say
    celery.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                       result_accept_content=["json"])
    try:
        # When the Client sends requests, and a plain Celery producer sends one
        futures = [client.submit("identity", _row(i)) for i in range(20)]
        answers = [f.result(timeout=30) for f in futures]
        sent = celery.send_task("asyncinfer.infer", queue="infer.identity", kwargs={
            "model": "identity",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [7.0]}]})
        by_celery = sent.get(timeout=30)
        # Then every one is answered, from any process by its ID
        assert [float(a.as_numpy("input")[0, 0]) for a in answers] == list(range(20))
        assert celery.AsyncResult(futures[3].id).get(timeout=10)["id"] == futures[3].id
        assert by_celery["outputs"][0]["data"] == [7.0]
        # and the results live in the shard's slot, on the master that owns it
        tag = shard_tags(1)[0]
        master = cluster.master_of_slot(tag_slot(tag)).client()
        assert master.exists(key_prefix(tag) + f"celery-task-meta-{futures[0].id}".encode())
        others = [m.client() for m in cluster.masters() if m.port != master.connection_pool.
                  connection_kwargs["port"]]
        assert all(other.dbsize() == 0 for other in others)  # nothing outside the shard
        assert "fast consumer on infer.identity" in worker.log()
        assert queue_depths(client.app, {"identity"}) == {"identity": 0}
    finally:
        client.close()
        worker.stop()

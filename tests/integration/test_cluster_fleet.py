"""The fleet on a real Redis Cluster (3 masters, 3 replicas of real redis-server processes), through
a ``rediscluster://`` URL: a worker, the ``Client``, Celery's ``AsyncResult`` and ``send_task``, a
stream of parts, the gateway through tritonclient, every key of the fleet in its shard's hash slot
on that slot's master."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from celery import Celery

from asyncinfer.broker.cluster_backend import register_schemes
from asyncinfer.broker.shards import key_prefix, shard_tags, tag_slot
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import ModelError, SequenceNotStarted
from asyncinfer.ops.status import queue_depths
from tests.support.processes import TEST_FACTORIES, run_cli, start_gateway, start_worker
from tests.support.redis_cluster import LocalCluster
from tests.support.rows import identity_row
from tests.support.sequence_models import ACCUMULATOR_FACTORY

pytestmark = pytest.mark.timeout(120)


def test_a_worker_and_its_producers_on_a_cluster_keep_every_key_in_the_shard(
        cluster: LocalCluster, tmp_path: Path) -> None:
    url = cluster.fleet_url()
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          "--concurrency", "4")
    client = Client(settings=Settings(broker_url=url))
    register_schemes()
    celery = Celery("producer", broker=url, backend=url)  # a plain Celery app, as the docs say
    celery.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                       result_accept_content=["json"])
    try:
        # When the Client sends requests, and a plain Celery producer sends one
        futures = [client.submit("identity", identity_row(i)) for i in range(20)]
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
        every = [k for m in cluster.masters() for k in m.client().keys("*")]
        assert every and all(k.startswith(b"{") for k in every)  # nothing outside a shard
        assert "fast consumer on infer.identity" in worker.log()
        assert queue_depths(client.app, {"identity"}) == {"identity": 0}
    finally:
        client.close()
        worker.stop()


def test_a_stream_and_the_gateway_on_a_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    url = cluster.fleet_url()
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "identity,echo-stream", "--hostname", "streams@%h")
    gateway = start_gateway(url, tmp_path / "gateway.log")
    client = Client(broker_url=url)
    try:
        # When a decoupled model streams its parts, and tritonclient calls through the gateway
        words = [f"w{i}" for i in range(30)]
        with client.stream("echo-stream", {"text_input": [" ".join(words)]}) as parts:
            got = [(part.index, str(part["text_output"].reshape(-1)[0])) for part in parts]
        http = httpclient.InferenceServerClient(gateway.http_url)
        x = httpclient.InferInput("input", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[2.5]], np.float32))
        by_http = http.infer("identity", [x]).as_numpy("input")
        grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
        g = grpcclient.InferInput("input", [1, 1], "FP32")
        g.set_data_from_numpy(np.array([[3.5]], np.float32))
        by_grpc = grpc.infer("identity", [g]).as_numpy("input")
        # Then every part arrives once, in order, and each gateway call is answered
        assert got == list(enumerate(words, start=1))
        assert by_http.tolist() == [[2.5]] and by_grpc.tolist() == [[3.5]]
        assert http.is_model_ready("identity")
        http.close()
        grpc.close()
    finally:
        client.close()
        gateway.stop()
        worker.stop()


def test_the_routing_table_puts_models_on_shards_of_their_own_on_masters_of_their_own(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # Given two models routed to two shards of three of one cluster, a worker each
    url = cluster.fleet_url()
    shard_url = [f"{url}&shards=3&shard={k}" for k in range(3)]
    first = start_worker(shard_url[1], tmp_path / "first.log", "--device", "cpu", "--models",
                         "identity", "--hostname", "first@%h")
    second = start_worker(shard_url[2], tmp_path / "second.log", "--device", "cpu", "--models",
                          "sleep", "--hostname", "second@%h")
    client = Client(settings=Settings(broker_url=shard_url[1],
                                      broker_routes=f"sleep={shard_url[2]}"))
    try:
        # When one client sends requests of both
        ones = [client.submit("identity", identity_row(i)) for i in range(10)]
        twos = [client.submit("sleep", identity_row(0.01)) for _ in range(10)]
        assert [float(f.result(timeout=30).as_numpy("input")[0, 0]) for f in ones] == list(range(10))
        assert all(f.result(timeout=30) is not None for f in twos)
        # Then each model's requests and results are on its shard's master, two masters apart
        tags = shard_tags(3)
        masters = [cluster.master_of_slot(tag_slot(tags[k])) for k in (1, 2)]
        assert masters[0].port != masters[1].port
        for master, k, futures in ((masters[0], 1, ones), (masters[1], 2, twos)):
            keys = [key_prefix(tags[k]) + f"celery-task-meta-{f.id}".encode() for f in futures]
            with master.client() as c:
                assert c.exists(*keys) == 10
    finally:
        client.close()
        first.stop()
        second.stop()


def test_the_cache_priorities_dead_letters_and_commands_on_a_cluster(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # Given a worker of "poison" (doubles its input; fails on a negative row) that caches its
    # answers and keeps its dead letters, on a shard of its own
    url = cluster.fleet_url("&shards=3&shard=0")
    options = json.dumps({"poison": {"response_cache": True, "dead_letter": True}})
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "poison",
                          ASYNCINFER_MODEL_OPTIONS=options)
    client = Client(settings=Settings(broker_url=url, model_options=options))
    try:
        # When a request is sent twice, one with a high priority, and one that fails
        first = client.infer("poison", identity_row(1.5), timeout_s=30)
        again = client.submit("poison", identity_row(1.5), priority=0).result(timeout=30)
        failed = client.submit("poison", identity_row(-1.0))
        with pytest.raises(ModelError):
            failed.result(timeout=30)
        # Then the second is answered from the cache, and the failure kept as a dead letter
        assert first.as_numpy("output").tolist() == again.as_numpy("output").tolist() == [[3.0]]
        assert again.raw["parameters"]["cache_hit"] is True
        assert "cache_hit" not in first.raw["parameters"]
        # And the commands read the cluster: status, models, stats, dead letters, purge, cancel
        assert "infer.poison" in run_cli(url, "status")
        assert "poison" in run_cli(url, "models")
        stats = run_cli(url, "stats", "poison")
        # one inference on the device, one batch; two successes (the hit is one), one failure
        assert re.search(r"poison\s+1\s+1\s+2\s+1\s", stats), stats
        dead = run_cli(url, "dead", "list", "poison")
        assert failed.id in dead, dead
        worker.stop()
        waiting = [client.submit("poison", identity_row(float(i))) for i in range(4)]
        assert "4" in run_cli(url, "purge", "poison", "--yes")
        assert f"revoked {waiting[0].id}" in run_cli(url, "cancel", waiting[0].id)
    finally:
        client.close()
        worker.stop()


def test_a_sequence_on_a_cluster_accumulates_on_its_worker(cluster: LocalCluster, tmp_path: Path) -> None:
    # Given a worker hosting the stateful accumulator on a cluster's shard
    url = cluster.fleet_url("&shards=3&shard=2")
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "accumulator", ASYNCINFER_MODEL_FACTORIES=f"{TEST_FACTORIES},"
                                                                    f"{ACCUMULATOR_FACTORY}")
    client = Client(broker_url=url)
    try:
        def step(value: int, **flags: Any) -> int:
            r = client.infer("accumulator", {"INPUT": np.array([[value]], np.int64)},
                             parameters={"sequence_id": "cluster-seq", **flags}, timeout_s=30)
            return int(r["SUM"][0, 0])

        # When a sequence's requests are sent, then one more after its end
        sums = [step(3, sequence_start=True), step(4), step(5, sequence_end=True)]
        # Then they accumulate on the worker the sequence is pinned to (its registration and the
        # pin in the shard), and the one after the end is refused
        assert sums == [3, 7, 12]
        with pytest.raises(SequenceNotStarted):
            step(1)
    finally:
        client.close()
        worker.stop()

"""One model served by every master of a real Redis Cluster (3 masters, 3 replicas of real
redis-server processes), through a URL that spreads requests over its shards
(``rediscluster://…&shards=3``): each request on the shard its ID falls in, a worker taking from
every shard; the split per master; a plain Celery producer and ``AsyncResult`` on the same URL; a
worker killed holding requests of every shard."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from celery import Celery

from asyncinfer.broker.cluster_backend import register_schemes
from asyncinfer.broker.cluster_client import shard_client
from asyncinfer.broker.shards import request_shard
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import ModelError, SequenceNotStarted
from asyncinfer.wire.keys import TRACES_KEY
from tests.support.crashy import (
    answered_by_second,
    crashy_env,
    held_by_first,
    two_crashy_workers,
)
from tests.support.processes import TEST_FACTORIES, run_cli, start_gateway, start_worker, stop_together
from tests.support.redis_cluster import LocalCluster, ids_on_shard
from tests.support.rows import identity_row
from tests.support.sequence_models import ACCUMULATOR_FACTORY

pytestmark = pytest.mark.timeout(180)

SHARDS = 3


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
    url = cluster.fleet_url(f"&shards={SHARDS}")
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          "--concurrency", "4")
    client = Client(broker_url=url)
    register_schemes()
    celery = Celery("producer", broker=url, backend=url)  # a plain Celery app on the same URL
    celery.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                       result_accept_content=["json"])
    try:
        # When the Client sends 3,000 requests, and the plain Celery producer 30
        futures = [client.submit("identity", identity_row(i)) for i in range(3000)]
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
            assert (r.llen("infer.identity"), r.hlen("unacked"), r.hlen(TRACES_KEY)) == (0, 0, 0)
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
    url = cluster.fleet_url(f"&shards={SHARDS}")
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
        # those on the first's device ran once more each, each shard's together, the others once
        answered_by_second(futures, r, prefix, struck, 60, "kill -9, over 3 shards,",
                           shard_of=lambda request_id: request_shard(request_id, SHARDS))
    finally:
        client.close()
        for w in (first, second):
            if w.process.poll() is None:
                os.kill(w.pid, signal.SIGCONT)
        stop_together([first, second])
        for s in shards:
            s.close()


def test_streams_sequences_the_gateway_dead_letters_and_commands_over_every_shard(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # Given a worker of four models on the spread URL, and the gateway
    url = cluster.fleet_url(f"&shards={SHARDS}")
    options = json.dumps({"poison": {"dead_letter": True, "response_cache": True}})
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "identity,echo-stream,accumulator,poison",
                          ASYNCINFER_MODEL_FACTORIES=f"{TEST_FACTORIES},{ACCUMULATOR_FACTORY}",
                          ASYNCINFER_MODEL_OPTIONS=options)
    gateway = start_gateway(url, tmp_path / "gateway.log")
    client = Client(settings=Settings(broker_url=url, model_options=options))
    try:
        # When streams, two sequences, gateway calls and failing requests fall on every shard
        words = [f"w{i}" for i in range(20)]
        streamed = []
        for _ in range(3):
            with client.stream("echo-stream", {"text_input": [" ".join(words)]}) as parts:
                streamed.append([str(p["text_output"].reshape(-1)[0]) for p in parts])

        def step(sequence: str, value: int, **flags: Any) -> int:
            r = client.infer("accumulator", {"INPUT": np.array([[value]], np.int64)},
                             parameters={"sequence_id": sequence, **flags}, timeout_s=30)
            return int(r["SUM"][0, 0])

        sequences = {name: [step(name, 3, sequence_start=True), step(name, 4),
                            step(name, 5, sequence_end=True)] for name in ("seq-a", "seq-b")}
        http = httpclient.InferenceServerClient(gateway.http_url)
        grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
        by_gateway = []
        for i in range(6):
            x = httpclient.InferInput("input", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[float(i)]], np.float32))
            by_gateway.append(float(http.infer("identity", [x]).as_numpy("input")[0, 0]))
            g = grpcclient.InferInput("input", [1, 1], "FP32")
            g.set_data_from_numpy(np.array([[float(i)]], np.float32))
            by_gateway.append(float(grpc.infer("identity", [g]).as_numpy("input")[0, 0]))
        http.close()
        grpc.close()
        # the same input 4 times on each shard: each shard answers it once, then from its cache
        cached = [client.submit("poison", identity_row(2.0), request_id=rid).result(timeout=30)
                  for shard in range(SHARDS) for rid in ids_on_shard(shard, 4, SHARDS)]
        failed: list[Any] = []  # 9 at least, and until every shard has some (the IDs are random)
        while len(failed) < 9 or {request_shard(f.id, SHARDS) for f in failed} != set(range(SHARDS)):
            assert len(failed) < 60, "60 generated IDs missed a shard"
            failed.append(client.submit("poison", identity_row(-1.0)))
        for f in failed:
            with pytest.raises(ModelError):
                f.result(timeout=30)
        # Then each stream's parts arrive once, in order; each sequence accumulates on its worker
        assert streamed == [words] * 3
        assert sequences == {"seq-a": [3, 7, 12], "seq-b": [3, 7, 12]}
        with pytest.raises(SequenceNotStarted):
            step("seq-a", 1)
        assert by_gateway == [float(i) for i in range(6) for _ in range(2)]
        assert [a.as_numpy("output").tolist() for a in cached] == [[[4.0]]] * 12
        assert [bool(a.raw["parameters"].get("cache_hit")) for a in cached] == (
            [False, True, True, True] * SHARDS)
        # and the commands see every shard: the dead letters of all, then what waits on all
        assert {request_shard(f.id, SHARDS) for f in failed} == {0, 1, 2}
        dead = run_cli(url, "dead", "list", "poison")
        assert all(f.id in dead for f in failed), dead
        worker.stop()
        waiting = [client.submit("identity", identity_row(float(i))) for i in range(12)]
        for f in waiting:
            f.sent()
        assert {request_shard(f.id, SHARDS) for f in waiting} == {0, 1, 2}
        assert re.search(r"infer\.identity\s+12\b", run_cli(url, "status")) is not None
        assert "removed 12 requests" in run_cli(url, "purge", "identity", "--yes")
        assert "requeued 9" in run_cli(url, "dead", "requeue", "poison", "--all")
    finally:
        client.close()
        gateway.stop()
        worker.stop()


def test_an_idle_worker_killed_leaves_every_shard_to_the_other(cluster: LocalCluster,
                                                                tmp_path: Path) -> None:
    # Given two idle workers on the spread URL, each watching every shard's lists
    url = cluster.fleet_url(f"&shards={SHARDS}")
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "identity",
                         "--hostname", "idle-first@%h")
    second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models", "identity",
                          "--hostname", "idle-second@%h")
    client = Client(broker_url=url)
    try:
        assert client.infer("identity", identity_row(-1), timeout_s=30) is not None
        time.sleep(2.0)  # both idle: blocked in Redis, or waiting for a bell
        # When the first is killed outright while idle, and 60 requests come on all shards
        first.process.kill()
        first.process.wait()
        sent_at = time.monotonic()
        futures = [client.submit("identity", identity_row(i)) for i in range(60)]
        answers = [f.result(timeout=60) for f in futures]
        last_s = time.monotonic() - sent_at
        # Then the second answers every one (whatever watches the dead one held), each once
        assert {request_shard(f.id, SHARDS) for f in futures} == {0, 1, 2}
        assert [float(a.as_numpy("input")[0, 0]) for a in answers] == [float(i) for i in range(60)]
        assert {a.parameters["worker"].split("@")[0] for a in answers} == {"idle-second"}
        print(f"\nan idle worker killed, over 3 shards: sent 60, answered 60, lost 0, "
              f"last answer {last_s:.1f} s after the sends")
    finally:
        client.close()
        stop_together([first, second])

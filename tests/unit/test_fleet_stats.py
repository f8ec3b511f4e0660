"""The fleet statistics: a worker's counts (worker/stats.py), their flush to Redis and the sum over
workers in Triton's form (broker/fleet_stats.py), on fakeredis."""

from __future__ import annotations

import time
from typing import cast

import fakeredis
import pytest
import redis
import torch

from asyncinfer.broker.fleet_stats import FleetStats, stats_key, triton_stats
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import deliver
from asyncinfer.policy.policy import Policy
from asyncinfer.wire.keys import STATS_INDEX_KEY
from asyncinfer.wire.protocol import Request, Tensor
from asyncinfer.worker.lifecycle import Settlement
from asyncinfer.worker.metrics import WorkerMetrics
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.stats import StatsCounts, StatsFlusher

pytestmark = pytest.mark.timeout(10)

MS = 1_000_000  # ns


def test_a_batch_counts_per_request_and_per_batch_size() -> None:
    counts = StatsCounts()
    counts.record_batch("m", rows=5, requests=2, waits_s=[0.001, 0.003], phases_s=(0.001, 0.002, 0.004))
    counts.record_failure("m", 0.5)
    taken, last = counts.take()
    assert taken["m"] == {
        "execution_count": 1, "inference_count": 5,
        "success_count": 2, "success_ns": 4 * MS + 2 * 7 * MS,
        "queue_count": 2, "queue_ns": 4 * MS,
        "compute_input_count": 2, "compute_input_ns": 2 * MS,
        "compute_infer_count": 2, "compute_infer_ns": 4 * MS,
        "compute_output_count": 2, "compute_output_ns": 8 * MS,
        "batch:5:compute_input_count": 1, "batch:5:compute_input_ns": 1 * MS,
        "batch:5:compute_infer_count": 1, "batch:5:compute_infer_ns": 2 * MS,
        "batch:5:compute_output_count": 1, "batch:5:compute_output_ns": 4 * MS,
        "fail_count": 1, "fail_ns": 500 * MS}
    assert set(last) == {"m"} and last["m"] > 1_600_000_000_000
    assert counts.take() == ({}, {})  # taken once


def test_worker_metrics_feed_the_counts_from_the_same_points() -> None:
    metrics = WorkerMetrics()
    metrics.record_batch("m", "cpu", 3, 0.01, [0.0, 0.0, 0.0], (0.002, 0.006, 0.002))
    metrics.record_outcome("m", "cpu", "SUCCESS")
    metrics.record_outcome("m", "cpu", "FAILURE", ValueError("x"), 0.25)
    metrics.record_outcome("m", "cpu", "REVOKED")
    taken, _ = metrics.stats.take()
    assert (taken["m"]["success_count"], taken["m"]["fail_count"]) == (3, 1)
    assert taken["m"]["batch:3:compute_infer_ns"] == 6 * MS
    assert taken["m"]["fail_ns"] == 250 * MS


def test_deliver_splits_a_batch_time_into_its_three_phases() -> None:
    seen: list[tuple[object, ...]] = []
    request = Request(id="r", model="m", parameters={}, binary_output=True,
                      inputs=[Tensor("x", "FP32", (2, 1), torch.zeros(2, 1), binary=True)])
    item = WorkItem(request=request, rows=2, signature=None)
    started = time.perf_counter() - 0.010
    deliver([item], {"y": torch.zeros(2, 1)}, started, "m", "cpu",
            lambda *args: seen.append(args), launched=started + 0.002, device_s=0.005)
    (model, device, rows, compute_s, waits_s, (input_s, infer_s, output_s)), = seen
    assert (model, device, rows, len(waits_s)) == ("m", "cpu", 2, 1)
    assert input_s == pytest.approx(0.002) and infer_s == pytest.approx(0.005)
    assert input_s + infer_s + output_s == pytest.approx(compute_s)
    assert output_s >= 0.003 - 1e-9


def _flushed(client: fakeredis.FakeRedis, worker: str, device: str, *batches: tuple[int, int]
             ) -> StatsCounts:
    counts = StatsCounts()
    for rows, requests in batches:
        counts.record_batch("m", rows, requests, [0.001] * requests, (0.001, 0.002, 0.001))
    assert StatsFlusher(FleetStats(client), counts, worker, device).flush()
    return counts


def test_two_workers_sum_per_batch_size_and_show_apart() -> None:
    client = fakeredis.FakeRedis()
    _flushed(client, "w1", "cpu", (4, 4), (1, 1))
    _flushed(client, "w2", "cuda:0", (4, 2), (2, 2))
    _flushed(client, "w1", "cpu", (1, 1))  # a second flush adds to the first
    (stats,) = FleetStats(client).model_stats(model="m")
    assert (stats["name"], stats["version"]) == ("m", "1")
    assert stats["inference_count"] == 4 + 1 + 4 + 2 + 1
    assert stats["execution_count"] == 5
    assert stats["inference_stats"]["success"]["count"] == 4 + 1 + 2 + 2 + 1
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {
        1: 2, 2: 1, 4: 2}
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"]) == 12
    workers = stats["asyncinfer"]["workers"]
    assert [(w["worker"], w["device"], w["inference_count"]) for w in workers] == [
        ("w1", "cpu", 6), ("w2", "cuda:0", 6)]
    assert [d["device"] for d in stats["asyncinfer"]["devices"]] == ["cpu", "cuda:0"]
    assert stats["last_inference"] == max(w["last_inference"] for w in workers)


def test_hashes_are_kept_for_the_retention_window_and_lapsed_ones_leave_the_index() -> None:
    client = fakeredis.FakeRedis()
    fleet = FleetStats(client, retention_s=600)
    counts = StatsCounts()
    counts.record_batch("m", 1, 1, [0.0], (0.0, 0.0, 0.0))
    StatsFlusher(fleet, counts, "w1", "cpu").flush()
    assert 0 < client.ttl(stats_key("m", "w1")) <= 600
    assert 0 < client.ttl(STATS_INDEX_KEY) <= 600
    counts.record_batch("m", 1, 1, [0.0], (0.0, 0.0, 0.0))
    StatsFlusher(fleet, counts, "w2", "cpu").flush()
    client.delete(stats_key("m", "w1"))  # as if its TTL passed
    assert [w["worker"] for w in fleet.read()["m"]] == ["w2"]
    assert client.smembers(STATS_INDEX_KEY) == {b"m\tw2"}


def test_a_failed_flush_keeps_its_counts_for_the_next() -> None:
    client = fakeredis.FakeRedis()
    counts = StatsCounts()
    counts.record_batch("m", 2, 2, [0.0, 0.0], (0.0, 0.0, 0.0))

    class Down:
        def add(self, *args: object) -> None:
            raise redis.ConnectionError("down")

    flusher = StatsFlusher(FleetStats(client), counts, "w1", "cpu")
    flusher.fleet = Down()  # type: ignore[assignment]
    assert not flusher.flush()
    counts.record_batch("m", 1, 1, [0.0], (0.0, 0.0, 0.0))
    flusher.fleet = FleetStats(client)
    assert flusher.flush()
    (stats,) = FleetStats(client).model_stats(model="m")
    assert (stats["inference_count"], stats["execution_count"]) == (3, 2)


def test_nothing_counted_makes_no_redis_call() -> None:
    class Refuses:
        def add(self, *args: object) -> None:
            raise AssertionError("called Redis with nothing to add")

    flusher = StatsFlusher(Refuses(), StatsCounts(), "w1", "cpu")  # type: ignore[arg-type]
    assert flusher.flush()


def test_a_model_without_counts_shows_zeros_in_triton_form() -> None:
    stats = triton_stats("idle", [])
    assert stats["inference_count"] == 0 and stats["batch_stats"] == []
    assert set(stats["inference_stats"]) == {"success", "fail", "queue", "compute_input",
                                             "compute_infer", "compute_output", "cache_hit",
                                             "cache_miss"}
    assert FleetStats(fakeredis.FakeRedis()).model_stats(["idle"])[0]["name"] == "idle"


def test_a_failure_counts_its_time_from_the_take() -> None:
    settlement = Settlement("w@h", "cpu", cast(Policy, None))
    taken = TakenMessage(raw=b"", queue="infer.m", request_id="r",
                         received_at=time.perf_counter() - 0.2)
    settlement.failed(taken, "m", ValueError("bad"))
    settlement.failed(object(), "m", ValueError("no take known"))
    counts, _ = settlement.metrics.stats.take()
    assert counts["m"]["fail_count"] == 2
    assert 200 * MS <= counts["m"]["fail_ns"] < 60_000 * MS

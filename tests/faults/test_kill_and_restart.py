"""Faults: a worker killed with SIGKILL mid-work, and Redis restarted under load.

Both run on a broker no other worker consumes (a database of their own on the session Redis, or
a Redis of their own), so what they count is theirs alone.
"""

from __future__ import annotations

import time
from concurrent.futures import wait

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.ops.redis_server import RedisServer
from tests.support.databases import gated_broker, gated_executions
from tests.support.processes import start_worker
from tests.support.waiting import wait_for


def _whereabouts(r: redis.Redis, request_ids: list[str], queue: str) -> str:
    """Where each request is: its stored state, on the queue, or held unacknowledged."""
    queued = b"".join(r.lrange(queue, 0, -1))
    unacked = b"".join(r.hvals("unacked"))
    lines = []
    for rid in request_ids:
        meta = r.get(f"celery-task-meta-{rid}")
        lines.append(f"{rid}: state={meta[:40] if meta else None} queued={rid.encode() in queued} "
                     f"unacked={rid.encode() in unacked}")
    keys = sorted(k.decode(errors="replace") for k in r.scan_iter(count=1000)
                  if not k.startswith(b"celery-task-meta-"))
    return "requests never answered:\n" + "\n".join(lines) + f"\nother keys: {keys}"


def _index(i: int) -> dict[str, np.ndarray]:
    return {"index": np.array([[float(i)]], np.float64)}


@pytest.mark.timeout(120)
def test_requests_of_a_killed_worker_complete_once_on_a_new_worker(redis_db, tmp_path) -> None:
    # Given a worker for the model "gated" (which counts executions per index in Redis and runs
    # only while the gate is open) on a database of its own, with a 4 s visibility timeout
    url = redis_db.url
    prefix, r, env = gated_broker(url, "faults")
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "gated",
                         "--hostname", "gated-first@%h", **env)
    second = None
    client = Client(broker_url=url)
    try:
        # And 30 requests it has completed (results stored and acknowledged in one pipeline)
        futures = [client.submit("gated", _index(i)) for i in range(30)]
        for i, f in enumerate(futures):
            assert f.result(timeout=60)["output"].tolist() == [[float(i)]]
        # When the gate closes, 120 more arrive, and the worker is stuck in forward with them
        r.set(f"{prefix}:gate", "closed")
        futures += [client.submit("gated", _index(i)) for i in range(30, 150)]
        wait_for(lambda: r.get(f"{prefix}:blocked"), 60, "the first worker to block in forward", poll_s=0.02)
        # (at least two device batches of 32, more for a fast device: ASYNCINFER_HOLD_BATCHES, _S)
        wait_for(lambda: r.hlen("unacked") >= 64, 60, "the first worker to take 64", poll_s=0.02)
        # and it is killed with SIGKILL (no shutdown, no acks, nothing restored by it)
        first.process.kill()
        first.process.wait()
        held = r.hlen("unacked")
        assert held >= 64 and r.llen("infer.gated") == 120 - held
        # Then, with the gate open and a new worker started, every request completes
        r.delete(f"{prefix}:gate")
        second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models", "gated",
                              "--hostname", "gated-second@%h", **env)
        for i, f in enumerate(futures):
            response = f.result(timeout=90)
            assert response["output"].tolist() == [[float(i)]]
        assert all(f.result().parameters["worker"].startswith("gated-second@") for f in futures[30:])
        # And each ran exactly once: none lost, none twice
        executions = gated_executions(r, prefix)
        assert executions == {i: 1 for i in range(150)}
        wait_for(lambda: r.hlen("unacked") == 0, 30, "acks of the last results", poll_s=0.02)
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()
        r.close()


@pytest.mark.timeout(150)
def test_workers_killed_while_requests_stream_in_lose_none(redis_db, tmp_path) -> None:
    # Given a worker taking a steady stream of requests (the gate open: the model only counts)
    url = redis_db.url
    prefix, r, env = gated_broker(url, "stream")
    workers = []
    client = Client(broker_url=url)
    try:
        futures = []
        for round_ in range(3):
            workers.append(start_worker(url, tmp_path / f"w{round_}.log", "--device", "cpu",
                                        "--models", "gated", "--hostname", f"stream{round_}@%h",
                                        "--concurrency", "8", **env))
            # When it is killed with SIGKILL in the middle of taking them
            start = len(futures)
            futures += [client.submit("gated", _index(i)) for i in range(start, start + 300)]
            wanted, batch = start + 100, futures[start:]
            wait_for(lambda: sum(f.done() for f in batch) >= wanted - start, 60,  # noqa: B023
                     "requests completing", poll_s=0.005)
            workers[-1].process.kill()
            workers[-1].process.wait()
        workers.append(start_worker(url, tmp_path / "last.log", "--device", "cpu", "--models",
                                    "gated", "--hostname", "stream-last@%h", **env))
        # Then every request still completes (redelivered after the visibility timeout): none
        # was taken from its queue without being recorded as unacknowledged
        wait([*futures], timeout=90)
        missing = [f.id for f in futures if not f.done()]
        assert not missing, _whereabouts(r, missing[:5], "infer.gated")
        for i, f in enumerate(futures):
            assert f.result(timeout=0)["output"].tolist() == [[float(i)]]
        executions = gated_executions(r, prefix)
        assert set(executions) == set(range(len(futures)))
    finally:
        client.close()
        for w in workers:
            w.stop()
        r.close()


@pytest.mark.timeout(120)
def test_redis_restarted_under_load_loses_nothing(tmp_path) -> None:
    # Given Redis with append-only persistence, a worker serving "sleep" one request at a time,
    # and a client with 20 requests queued or in flight
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    worker = start_worker(server.url, tmp_path / "worker.log", "--device", "cpu", "--models", "sleep",
                          "--hostname", "aof@%h",
                          ASYNCINFER_MODEL_OPTIONS='{"sleep": {"max_batch_size": 1}}')
    client = Client(broker_url=server.url)
    try:
        values = [0.1 + i / 1000 for i in range(20)]
        futures = [client.submit("sleep", np.array([[v]], np.float32)) for v in values]
        wait_for(lambda: sum(f.done() for f in futures) >= 2, 60, "the first results", poll_s=0.02)
        # When Redis stops (SIGTERM: it writes its append-only file) and starts again on the same
        # port and folder, with neither the worker nor the client restarted
        port = server.port
        server.stop()
        time.sleep(0.5)
        server.start()
        assert server.port == port
        # and more requests are sent through the same client
        values += [0.01 * i for i in range(5)]
        futures += [client.submit("sleep", np.array([[v]], np.float32)) for v in values[20:]]
        # Then every accepted request gets its result: none was lost
        for v, f in zip(values, futures, strict=True):
            assert f.result(timeout=90)["output"].tolist() == [[pytest.approx(v)]]
        assert worker.process.poll() is None
        assert "lost Redis" in worker.log() or "storing" in worker.log()
    finally:
        client.close()
        worker.stop()
        server.stop()

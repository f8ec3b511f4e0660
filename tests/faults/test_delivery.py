"""Faults nobody names: a worker frozen while idle and then killed, kill -9 again and again during
a paced stream, Redis out of memory, a vital thread that dies.

Each runs on a broker no other worker consumes (a database of its own on the session Redis, or a
Redis of its own), so what it counts is its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.client import Client
from asyncinfer.constants import priority_lists
from asyncinfer.errors import BrokerRefused, BrokerUnavailable
from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.supervision.vital import EXIT_THREAD_DIED
from tests.support.databases import gated_broker, gated_executions
from tests.support.paced import index_input, kill_during_paced_stream
from tests.support.processes import ROOT, start_worker
from tests.support.producer import json_producer
from tests.support.waiting import wait_for


@pytest.mark.timeout(120)
def test_idle_worker_frozen_then_killed_loses_nothing(redis_db, tmp_path) -> None:
    # Given an idle worker, frozen (SIGSTOP) while it waits for work
    url = redis_db.url
    prefix, r, env = gated_broker(url, "idle")
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "gated",
                         "--hostname", "idle-first@%h", **env)
    second = None
    client = Client(broker_url=url)
    celery = json_producer(url)
    try:
        assert client.infer("gated", index_input(100), timeout_s=30)["output"].tolist() == [[100.0]]
        # idle: blocked in Redis waiting for work on each of its lists (not between a result and
        # its next, empty take, whose script Redis could run after the first request below came)
        lists = len(priority_lists(["infer.gated"]))
        _freeze_while_blocked(r, first.pid, lists)
        # When requests arrive from our client and from Celery's send_task (which rings nothing)
        futures = [client.submit("gated", index_input(i)) for i in range(4)]
        results = [celery.send_task("asyncinfer.infer", queue="infer.gated", kwargs={
            "model": "gated", "inputs": [{"name": "index", "shape": [1, 1], "datatype": "FP64",
                                          "data": [float(i)]}]}) for i in range(4, 8)]
        time.sleep(0.5)  # Redis answers the frozen worker's blocking command now, if ever
        # Then none has left its queue: waking a worker takes nothing
        assert r.llen("infer.gated") == 8 and r.hlen("unacked") == 0
        # And when the frozen worker is killed and a fresh one starts, each runs, once
        first.process.kill()
        first.process.wait()
        second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models", "gated",
                              "--hostname", "idle-second@%h", **env)
        for i, f in enumerate(futures):
            assert f.result(timeout=60)["output"].tolist() == [[float(i)]]
        for i, res in enumerate(results, start=4):
            assert res.get(timeout=60)["outputs"][0]["data"] == [float(i)]
        assert gated_executions(r, prefix) == {100: 1, **{i: 1 for i in range(8)}}
        # And a worker stopped with SIGTERM leaves cleanly (status 0, no thread "died")
        second.stop()
        assert second.process.returncode == 0 and " died " not in second.log(), second.log()[-2000:]
        second = None
    finally:
        client.close()
        celery.close()
        if first.process.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
        first.stop()
        if second is not None:
            second.stop()
        r.close()


@pytest.mark.timeout(120)
def test_a_clean_stop_gives_back_at_once_a_request_waiting_for_its_eta(redis_db, tmp_path) -> None:
    # Given a worker holding a request it took that waits for its eta (a countdown, as a retry's
    # backoff waits), and nothing else
    url = redis_db.url
    prefix, r, env = gated_broker(url, "eta-stop")
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "gated",
                         "--hostname", "eta-first@%h", **env)
    second = None
    celery = json_producer(url)
    try:
        waiting = celery.send_task("asyncinfer.infer", queue="infer.gated", countdown=4, kwargs={
            "model": "gated", "inputs": [{"name": "index", "shape": [1, 1], "datatype": "FP64",
                                          "data": [7.0]}]})
        wait_for(lambda: r.llen("infer.gated") == 0 and r.hlen("unacked") == 1, 10,
                 "the worker to take it")
        # When the worker is stopped cleanly (SIGTERM) before the eta
        stopped_at = time.monotonic()
        first.stop()
        # Then the request is back on its queue as soon as the worker is gone (not after its lease
        # runs out), unacknowledged nowhere
        assert first.process.returncode == 0
        assert r.llen("infer.gated") == 1 and r.hlen("unacked") == 0, first.log()[-2000:]
        assert "sent 1 held requests back to their queues" in first.log()
        # And another worker runs it once, at its eta
        second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models", "gated",
                              "--hostname", "eta-second@%h", **env)
        assert waiting.get(timeout=60)["outputs"][0]["data"] == [7.0]
        assert time.monotonic() - stopped_at < 60
        assert gated_executions(r, prefix) == {7: 1}
    finally:
        celery.close()
        first.stop()
        if second is not None:
            second.stop()
        r.close()


def _freeze_while_blocked(r: redis.Redis, pid: int, lists: int, tries: int = 20) -> None:
    """SIGSTOP the worker ``pid`` while it is blocked in Redis on each of its ``lists``, and still
    so once frozen: an idle consumer ends its block about once a second to take anyway, and one
    frozen just as it did would have its take run by Redis after the next push (the take of a
    worker that was not idle). Such a freeze is undone and tried again."""
    for _ in range(tries):
        wait_for(lambda: _blocked_waiting(r) >= lists, 10, "the worker to wait on each list",
                 poll_s=0.02)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)  # a command it sent just before the stop: run by Redis by now
        if _blocked_waiting(r) >= lists:
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"the worker was not frozen while blocked on its lists in {tries} tries")


def _blocked_waiting(r: redis.Redis) -> int:
    """How many clients of ``r``'s database are blocked in an idle consumer's wait (BLMOVE, or
    BRPOPLPUSH before Redis 6.2)."""
    db = str(r.connection_pool.connection_kwargs.get("db", 0))
    return sum(1 for c in r.client_list() if "b" in c.get("flags", "")
               and c.get("cmd") in ("blmove", "brpoplpush") and c.get("db") == db)


@pytest.mark.timeout(150)
def test_kill_9_again_and_again_during_a_paced_stream_loses_none(redis_db, tmp_path) -> None:
    # Given two workers sharing a paced stream (mostly idle between requests, where waking on a
    # request once took it off its queue unrecorded)
    url = redis_db.url
    prefix, r, env = gated_broker(url, "paced")
    try:
        # When one of them is killed with SIGKILL every 3 s and replaced
        counts = kill_during_paced_stream(url, r, prefix, env, tmp_path, rate_per_s=50,
                                          duration_s=15, kill_every_s=3)
        # Then every request sent is answered with its own value
        assert counts["kills"] >= 3 and counts["sent"] == 750
        assert counts["lost"] == 0, counts
        print("paced kill -9 stream:", counts)
    finally:
        r.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("consumer", ["fast", "celery"])
def test_redis_out_of_memory_then_freed_the_same_worker_serves_again(tmp_path, consumer: str) -> None:
    # Given a Redis of its own (noeviction, as Celery requires) and a worker of identity, on the
    # fast consumer or Celery's own
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    worker = start_worker(server.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "identity", "--hostname", f"oom-{consumer}@%h", "--concurrency", "8",
                          ASYNCINFER_CONSUMER=consumer)
    client = Client(broker_url=server.url, serializer="msgpack")
    r = redis.Redis.from_url(server.url)
    try:
        big = np.arange(65536, dtype=np.float32).reshape(1, -1)  # 256 KiB a request and a result
        for f in [client.submit("identity", {"x": big}) for _ in range(30)]:
            assert f.result(timeout=60)["x"].shape == (1, 65536)
        # When Redis is full of those results (maxmemory below what it uses) while requests wait
        os.kill(worker.pid, signal.SIGSTOP)
        waiting = [client.submit("identity", {"x": big + i}) for i in range(10)]
        for f in waiting:
            f.sent()  # on the queue before Redis fills
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 2 * 1024 * 1024)
        os.kill(worker.pid, signal.SIGCONT)
        # Then the worker takes them but Redis refuses their bookkeeping or their results: it
        # says so and retries
        wait_for(lambda: "OutOfMemoryError" in worker.log() or "out of memory" in worker.log(), 30,
                 "the worker meeting OOM")
        # And a submit is refused with an asyncinfer error naming the request and the cause,
        # leaving nothing registered in the result watcher
        with pytest.raises(BrokerRefused, match=r"request oom-1: broker is out of memory") as err:
            client.submit("identity", {"x": big}, request_id="oom-1").sent()
        assert "oom-1" not in client.watcher._callbacks, err.value
        # When memory is freed (the old results deleted)
        for key in r.scan_iter("celery-task-meta-*", count=1000):
            r.delete(key)
        # Then the same worker process stores the waiting results and serves new requests
        for i, f in enumerate(waiting):
            assert f.result(timeout=60)["x"][0, :3].tolist() == [i, i + 1.0, i + 2.0]
        assert client.infer("identity", {"x": big[:, :4]}, timeout_s=30)["x"].tolist() == [[0, 1, 2, 3]]
        assert worker.process.poll() is None and "Unrecoverable error" not in worker.log()
    finally:
        if worker.process.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
        client.close()
        r.close()
        worker.stop()
        server.stop()


_DYING_THREAD = """
import time
from asyncinfer.supervision.vital import vital_thread

def loop():
    raise RuntimeError("a bug nobody caught")

vital_thread(loop, "asyncinfer-results").start()
time.sleep(30)
raise SystemExit(0)
"""


def test_a_vital_thread_that_dies_takes_the_process_down_non_zero() -> None:
    # Given a process whose vital thread raises: it must not live on serving nothing
    proc = subprocess.run([sys.executable, "-c", _DYING_THREAD], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    # Then it exits at once with EXIT_THREAD_DIED, saying which thread died and why
    assert proc.returncode == EXIT_THREAD_DIED
    assert "thread asyncinfer-results died (RuntimeError: a bug nobody caught)" in proc.stderr


@pytest.mark.timeout(60)
def test_redis_frozen_before_a_submit_the_submit_fails_within_the_connect_timeout(tmp_path) -> None:
    # Given a Redis of its own whose catalogue knows the model, and a client with the defaults
    # (the unknown-model check on, connect_timeout_s 5 s)
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    r = redis.Redis.from_url(server.url)
    Catalogue(r).announce("parked@nowhere", [{"name": "gated"}])
    client = Client(broker_url=server.url)
    try:
        # When Redis is frozen (SIGSTOP: it accepts connections and answers nothing) before the
        # client's first submit, which must read the catalogue
        os.kill(server.process.pid, signal.SIGSTOP)
        future = client.submit("gated", index_input(0), request_id="frozen-first")
        # Then the submit returns and its future fails with BrokerUnavailable naming the request,
        # within the connect timeout's bounds (Celery's backend client waited 120 s here)
        with pytest.raises(BrokerUnavailable, match="frozen-first"):
            future.result(timeout=40)
        # And the catalogue is not read again at once: the next submit does not wait on it
        assert client.knows_now("gated")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        client.close()
        r.close()
        server.stop()


@pytest.mark.timeout(120)
def test_redis_frozen_mid_stream_loses_nothing_and_runs_nothing_twice(tmp_path) -> None:
    # Given a Redis of its own, a worker of the counting model and requests flowing
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    env = {"GATED_REDIS_URL": server.url, "GATED_PREFIX": "frozen"}
    worker = start_worker(server.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "gated", "--hostname", "frozen@%h", "--concurrency", "8", **env)
    client = Client(broker_url=server.url)
    r = redis.Redis.from_url(server.url)
    try:
        futures = [client.submit("gated", index_input(i)) for i in range(20)]
        # When Redis is frozen (SIGSTOP) for 3 s while more requests are being submitted
        os.kill(server.process.pid, signal.SIGSTOP)
        late: list = []
        sender = threading.Thread(target=lambda: late.extend(
            client.submit("gated", index_input(i)) for i in range(20, 30)))
        sender.start()
        time.sleep(3)
        os.kill(server.process.pid, signal.SIGCONT)
        sender.join(timeout=60)
        # Then every request is answered with its own value, each run once, by the same process
        for i, f in enumerate(futures + late):
            assert f.result(timeout=60)["output"].tolist() == [[float(i)]]
        assert len(late) == 10
        assert gated_executions(r, "frozen") == {i: 1 for i in range(30)}
        assert worker.process.poll() is None
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        client.close()
        r.close()
        worker.stop()
        server.stop()

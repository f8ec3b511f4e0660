"""Fault: Redis restarted without its data (no persistence, a host replaced, a failover to a
replica behind) while a worker holds requests it has not started yet.

Nobody else can have what the worker held: its queue entries went with the data. The worker must
lease them again and answer every one; what was still queued is gone, and each of its futures ends
with ``RequestLost``. Default settings (lease 10 s, the lost check's 30 s).
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.errors import RequestLost
from asyncinfer.ops.redis_server import RedisServer
from tests.support.crashy import crashy_env, crashy_index, crashy_starts, report_counts
from tests.support.databases import RedisDatabase
from tests.support.processes import start_worker
from tests.support.waiting import wait_for

QUEUE = "infer.crashy"


def _queued_ids(r: redis.Redis) -> set[str]:
    return {json.loads(m)["headers"]["id"] for m in r.lrange(QUEUE, 0, -1)}


@pytest.mark.timeout(240)
def test_redis_restarted_empty_under_a_worker_answers_all_it_held(redis_db: RedisDatabase,
                                                                  tmp_path) -> None:
    # Given Redis without persistence, a worker running batches of 8 on a 3 s kernel (what it
    # runs recorded on another Redis), and 200 requests: the worker holds some, the rest queued
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    prefix, env = crashy_env(redis_db.url, "amnesia", 3.0)
    env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"max_batch_size": 8}})
    env["ASYNCINFER_HOLD_BATCHES"] = "4"  # 32 held: one batch on the device, three waiting
    worker = start_worker(server.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "crashy", **env)
    client = Client(broker_url=server.url)
    r = redis.Redis.from_url(server.url)
    try:
        futures = [client.submit("crashy", crashy_index(i)) for i in range(200)]
        for f in futures:
            f.sent()
        wait_for(lambda: sum(crashy_starts(redis_db.client, prefix).values()) >= 8, 60,
                 "the first batch on the device")
        # When Redis is killed and comes back on its port without any of it
        queued = _queued_ids(r)
        server.process.kill()
        server.process.wait()
        server.process = None
        struck = time.monotonic()
        server.start()
        assert r.llen(QUEUE) == 0  # the queue went with the data
        # Then every request the worker held (not queued at the fault) is answered with its value
        held = [(i, f) for i, f in enumerate(futures) if f.id not in queued]
        print(f"\nat the fault: {len(queued)} queued, {len(held)} held or answered, "
              f"{sum(f.done() for f in futures)} answered")
        answers = {i: f.result(timeout=120)["output"].tolist() for i, f in held}
        assert answers == {i: [[float(i)]] for i, _ in held}
        # And each queued one is answered (taken just before the fault) or ends with RequestLost
        ends = [f.exception(timeout=150) for f in futures if f.id in queued]
        lost = [e for e in ends if e is not None]
        assert all(isinstance(e, RequestLost) for e in lost), lost
        last_s = time.monotonic() - struck
        # And none ran twice; the worker still serves
        starts = crashy_starts(redis_db.client, prefix)
        assert all(n == 1 for n in starts.values()), starts
        assert client.infer("crashy", crashy_index(7), timeout_s=60)["output"].tolist() == [[7.0]]
        assert worker.process.poll() is None and "Redis forgot" in worker.log()
        report_counts(f"Redis restarted empty (held {len(held)}, queued {len(queued)})", 200,
                      200 - len(lost), starts, last_s)
        print(f"RequestLost: {len(lost)} of the {len(queued)} queued")
    finally:
        client.close()
        r.close()
        worker.stop()
        server.stop()

"""A device that hangs without an error, at the shipped defaults (no time limit set): `asyncinfer
up` with two workers, one request among 60 whose kernel never returns (the "sleep" model asked to
sleep an hour). The hang watch finds it (no progress for 30 s, the floor), the hung worker gives
back what it had not started and leaves to be replaced, the leases count a death against the hung
batch; the request runs alone on the next device, hangs again, and fails for good with
``WorkerLost`` naming the hang, while every good request is answered and the fleet serves on."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.errors import WorkerLost
from asyncinfer.ops.status import cluster_status
from tests.support.databases import RedisDatabase
from tests.support.marks import FORWARD_MARKS_ENV, forward_marks_key
from tests.support.processes import start_up, stop_up
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(420)

HANG_S = 3600.0


def _runs(r: redis.Redis) -> Counter[float]:
    """How many times the device started each value's row."""
    runs: Counter[float] = Counter()
    for batch in r.lrange(forward_marks_key("sleep"), 0, -1):
        runs.update(round(v, 4) for v in json.loads(batch))
    return runs


def test_a_hung_kernel_is_found_at_the_defaults_and_the_fleet_serves_on(
        redis_db: RedisDatabase, tmp_path: Path) -> None:
    from tests.support.processes import worker_env

    url = redis_db.url
    env = worker_env(url, **{FORWARD_MARKS_ENV: url})
    log_path = tmp_path / "up.log"
    log = open(log_path, "wb")
    up = start_up(env, log, "--devices", "cpu,cpu", "--models", "sleep", "--no-gateway")
    started: list[int] = []
    client = Client(broker_url=url)
    r = redis.Redis.from_url(url)
    try:
        workers = wait_for(lambda: (lambda w: w if len(w) == 2 else None)(
            cluster_status(client.app, 0.5).workers), 120, "two workers")
        started += [w.pid for w in workers]
        goods = {round(0.01 + i / 1000, 4): None for i in range(59)}
        values = list(goods)
        sent_at = time.monotonic()
        futures = {}
        for i, value in enumerate(values):
            if i == 10:  # the hang among them, not first
                hang = client.submit("sleep", np.array([[HANG_S]], np.float32))
            futures[value] = client.submit("sleep", np.array([[value]], np.float32))
        answered = {}
        for value, future in futures.items():
            answered[value] = future.result(timeout=240)["output"].tolist()
        last_good_s = time.monotonic() - sent_at
        assert answered == {v: [[pytest.approx(v)]] for v in values}
        with pytest.raises(WorkerLost, match=rf"request {hang.id}: worker processes died 2 times "
                                             r"while this request was on their device \(a hang "
                                             r"counts as two deaths\).*the last was a hang: "
                                             r"model 'sleep': a batch of "
                                             r"\d+ request\(s\) made no progress on the device for "
                                             r"3\d s \(the hang limit: 30 s\)"):
            hang.result(timeout=300)
        hung_s = time.monotonic() - sent_at
        # The fleet serves on: both workers are back (each was replaced once it hung).
        again = wait_for(lambda: (lambda w: w if len(w) == 2 else None)(
            cluster_status(client.app, 0.5).workers), 120, "two workers again")
        started += [w.pid for w in again]
        assert client.infer("sleep", np.array([[0.001]], np.float32), timeout_s=60)[
            "output"].tolist() == [[pytest.approx(0.001)]]
        text = log_path.read_text(errors="replace")
        assert text.count("the device hung") == 2 and "exited with 75" in text
        runs = _runs(r)
        twice = sorted(v for v in values if runs[v] > 1)
        print(f"\nsent 60, answered {len(answered)}, failed 1 (WorkerLost after "
              f"{hung_s:.0f} s), lost 0, ran twice {len(twice)}, last good answer "
              f"{last_good_s:.0f} s after the first send")
        # The hang ran twice (the second time alone); a good request ran twice only if it shared
        # the hung batch (one death each, then run again alone): none the hung worker had not
        # started, and none more than twice.
        assert runs[HANG_S] == 2 and all(1 <= runs[v] <= 2 for v in values)
        hung_batch = next(set(round(v, 4) for v in json.loads(batch))
                          for batch in r.lrange(forward_marks_key("sleep"), 0, -1)
                          if HANG_S in json.loads(batch))
        assert set(twice) <= hung_batch
    finally:
        client.close()
        r.close()
        stop_up(up, started)
        log.close()


def test_a_clean_stop_with_a_hung_batch_counts_a_death_instead_of_handing_it_on(
        redis_db: RedisDatabase, tmp_path: Path) -> None:
    """Stopping a worker whose device hangs (SIGTERM, its 10 s grace) does not send the hung
    request back as if it had not run — the next worker would hang on it just the same: it goes
    back at once with a death counted (as if the worker had died with it on its device), so the
    next worker runs it alone; the requests the stopped worker had not started go back at once
    too, with no death."""
    from asyncinfer.wire.keys import DEATHS_PREFIX, HUNG_PREFIX, LEASE_DEVICE_KEY, LEASES_KEY
    from tests.support.marks import ForwardMarks
    from tests.support.processes import start_worker

    url = redis_db.url
    r = redis.Redis.from_url(url)
    marks = ForwardMarks(r, "sleep")
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "sleep",
                         **{FORWARD_MARKS_ENV: url})
    second = None
    client = Client(broker_url=url)
    try:
        hang = client.submit("sleep", np.array([[HANG_S]], np.float32))
        marks.wait_on_device(HANG_S)
        waiting = [client.submit("sleep", np.array([[0.5]], np.float32)) for _ in range(3)]
        wait_for(lambda: "sent back" in first.log() or r.llen("infer.sleep") == 0, 30,
                 "the waiting requests taken or handed on")
        first.stop(timeout_s=60)
        assert first.process.returncode == 0
        assert "made no progress on the device" in first.log() and "when this worker stopped" in (
            first.log())
        assert r.get(HUNG_PREFIX + hang.id) is not None
        # Everything it held is back on the queue, nothing leased or marked; a death is counted
        # against the hung one only
        queued = [json.loads(m)["headers"]["id"] for m in r.lrange("infer.sleep", 0, -1)]
        assert sorted(queued) == sorted([hang.id] + [f.id for f in waiting])
        assert r.hlen(LEASE_DEVICE_KEY) == 0 and r.zcard(LEASES_KEY) == 0
        assert r.get(DEATHS_PREFIX + hang.id) == b"1"
        # The next worker runs it alone
        second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models", "sleep",
                              **{FORWARD_MARKS_ENV: url})
        wait_for(lambda: [b for b in marks.batches() if HANG_S in b] == [[HANG_S], [HANG_S]], 30,
                 "the hung request on the second device, alone")
        assert all(r.get(DEATHS_PREFIX + f.id) is None for f in waiting)
    finally:
        client.close()
        for worker in (first, second):
            if worker is not None and worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait(10)
        r.close()

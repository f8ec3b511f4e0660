"""Hosts whose clocks disagree by a minute, at the shipped defaults.

A request's ``expires`` is written by its producer and a retry's ``eta`` (or a Celery
``countdown``) by whoever sent it; both are judged by the worker that takes the request. Each
process keeps its offset from the broker's clock (Redis ``TIME``: broker/clock_skew.py) and sets
and judges every deadline on that clock (wire/clock.py), so a worker or a producer a minute off
keeps every deadline and delay. The skewed processes are real ones with their clock moved by
libfaketime (``LD_PRELOAD``: ``time.time()`` and ``datetime.now()`` off by the offset; the
monotonic clock left alone, as NTP leaves it); Redis and this test keep the true time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import libfaketime
import numpy as np
import pytest
import redis
from celery.exceptions import TaskRevokedError

from asyncinfer.client import Client
from tests.support.processes import ROOT, start_worker, worker_env
from tests.support.producer import json_producer

pytestmark = pytest.mark.timeout(240)

#: How far the skewed hosts' clocks are off (seconds), as the issue's hosts were.
SKEW_S = 60


def skewed(offset_s: int) -> dict[str, str]:
    """The environment that moves a process' wall clock by ``offset_s`` seconds."""
    lib = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    return {"LD_PRELOAD": str(lib), "FAKETIME": f"{offset_s:+d}s", "DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}


@pytest.fixture(scope="module", autouse=True)
def _clocks_can_be_moved() -> None:
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                         env={**os.environ, **skewed(SKEW_S)}, capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0 or abs(float(out.stdout or 0) - time.time() - SKEW_S) > 5:
        pytest.skip(f"libfaketime cannot move a process' clock here: {out.stderr[-300:]}")


def _index_kwargs(value: float) -> dict[str, object]:
    return {"model": "identity", "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64",
                                             "data": [value]}]}


@pytest.mark.parametrize("offset_s", [SKEW_S, -SKEW_S], ids=["worker-60s-ahead", "worker-60s-behind"])
def test_a_worker_a_minute_off_keeps_every_expires_and_countdown(redis_db, tmp_path,
                                                                 offset_s: int) -> None:
    # Given a worker whose clock is a minute off Redis' (and this producer's)
    url = redis_db.url
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          **skewed(offset_s))
    client = Client(broker_url=url)
    celery = json_producer(url)
    try:
        # Then it says so once in its log
        said = "ahead of the broker's" if offset_s > 0 else "behind the broker's"
        assert f"this host's clock is {abs(offset_s)}." in worker.log() and said in worker.log()
        # When requests are sent with expires=30: each runs and is answered (a worker ahead once
        # dropped them all as expired)
        futures = [client.submit("identity", {"x": np.array([[i]], np.float32)}, expires=30)
                   for i in range(20)]
        answers = [f.result(timeout=60)["x"].tolist() for f in futures]
        assert answers == [[[float(i)]] for i in range(20)]
        # When a request is sent with countdown=3 (Celery's own producer): it runs no sooner
        # than 3 s and not a minute late (a worker ahead ran it at once, one behind after 63 s)
        sent_at = time.monotonic()
        delayed = celery.send_task("asyncinfer.infer", queue="infer.identity", countdown=3,
                                   kwargs=_index_kwargs(7.0))
        assert delayed.get(timeout=90)["outputs"][0]["data"] == [7.0]
        delayed_s = time.monotonic() - sent_at
        assert 2.5 <= delayed_s < 3 + 7, delayed_s
        # When requests with expires=2 wait 4 s for the worker (frozen meanwhile): none runs, each
        # fails as expired (a worker behind ran them, a minute before their deadline by its clock)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            stale = [client.submit("identity", {"x": np.array([[i]], np.float32)}, expires=2)
                     for i in range(5)]
            for f in stale:
                f.sent()
            time.sleep(4)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        outcomes = []
        for f in stale:
            try:
                f.result(timeout=60)
                outcomes.append("ran")
            except TaskRevokedError as exc:  # what Celery's AsyncResult raises for it, too
                outcomes.append("expired" if "expired" in str(exc) else str(exc))
        assert outcomes == ["expired"] * 5
        # And a fresh request after that still runs
        assert client.infer("identity", {"x": np.array([[9]], np.float32)},
                            timeout_s=30)["x"].tolist() == [[9.0]]
        print(f"worker {offset_s:+d} s: sent 26, answered 21, expired 5 of 5 stale, countdown=3 "
              f"ran after {delayed_s:.2f} s")
    finally:
        client.close()
        celery.close()
        worker.stop()


_SKEWED_PRODUCER = """
import json, sys
import numpy as np
from asyncinfer.client import Client

client = Client(broker_url=sys.argv[1])
futures = [client.submit("identity", {"x": np.array([[i]], np.float32)}, expires=30)
           for i in range(10)]
out = []
for f in futures:
    try:
        out.append(f.result(timeout=60)["x"].tolist()[0][0])
    except Exception as exc:
        out.append(type(exc).__name__)
client.close()
print(json.dumps(out))
"""


def test_a_producer_a_minute_behind_sets_expires_that_the_worker_keeps(redis_db, tmp_path) -> None:
    # Given a worker on the true time and a producer whose clock is a minute behind
    url = redis_db.url
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity")
    try:
        # When the producer sends 10 requests with expires=30 (by its clock: 30 s before the
        # worker's now)
        out = subprocess.run([sys.executable, "-c", _SKEWED_PRODUCER, url],
                             env=worker_env(url, **skewed(-SKEW_S)), cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        # Then every one runs and is answered (none was dropped as expired)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.splitlines()[-1]) == [float(i) for i in range(10)]
        # And nothing of them is left on the broker
        r = redis.Redis.from_url(url)
        try:
            assert r.llen("infer.identity") == 0
        finally:
            r.close()
    finally:
        worker.stop()

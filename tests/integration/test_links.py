"""Celery ``link`` / ``link_error`` callbacks on asyncinfer.infer, run by another app's worker."""

from __future__ import annotations

import json
import sys
import time
import uuid

import numpy as np
import pytest
from celery import signature

from tests.support.processes import WorkerProcess, worker_env

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def callback_worker(redis_url, worker, tmp_path_factory):
    argv = [sys.executable, "-m", "celery", "-A", "tests.support.callback_app", "worker", "-Q", "callbacks",
            "-n", "callbacks@%h", "-l", "INFO"]
    proc = WorkerProcess(argv, worker_env(redis_url), tmp_path_factory.mktemp("cb") / "cb.log").wait_ready()
    yield proc
    proc.stop()


def _wait_len(redis_client, key: str, n: int, timeout_s: float = 60.0) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_client.llen(key) >= n:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # a duplicate would arrive right behind
    return redis_client.lrange(key, 0, -1)


def test_link_and_link_error_fire_once_each(client, callback_worker, redis_client) -> None:
    tag = uuid.uuid4().hex
    link = signature("tests.record_response", kwargs={"tag": tag}, queue="callbacks", app=client.app)
    link_error = signature("tests.record_failure", kwargs={"tag": tag}, queue="callbacks", app=client.app)
    # Given 5 good requests and 2 bad ones, each with both callbacks
    good = [client.submit("identity", np.array([[i]], np.int32), link=link, link_error=link_error)
            for i in range(5)]
    # (a wrong shape, sent past the client's input check, which would refuse it at submit)
    bad = [client.sender.send_watched(client.submission(
        "mlp", np.ones((1, 3), np.float32), check=False, link=link, link_error=link_error))
           for _ in range(2)]
    for f in good:
        f.result(timeout=60)
    for f in bad:
        assert f.exception(timeout=60) is not None
    # Then each good request's response reached the link once, and each failure the errback once
    linked = [json.loads(x) for x in _wait_len(redis_client, f"test:linked:{tag}", len(good))]
    assert sorted(x["id"] for x in linked) == sorted(f.id for f in good)
    by_id = {x["id"]: x["outputs"][0]["data"] for x in linked}
    assert [by_id[f.id] for f in good] == [[i] for i in range(5)]
    failed = [x.decode() for x in _wait_len(redis_client, f"test:failed:{tag}", len(bad))]
    assert sorted(failed) == sorted(f.id for f in bad)

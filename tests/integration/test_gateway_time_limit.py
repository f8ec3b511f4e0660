"""A request past its hard time limit, answered by the gateway (gateway/call_errors.py) in words
that name the request and the limit, never Celery's ``TimeLimitExceeded(2.0,)``; and the bare
limit Celery's pool stores, as the client's future raises it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
from celery.exceptions import TimeLimitExceeded

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.gateway.call_errors import error_for
from tests.support.processes import launch_gateway, launch_worker, ready_together, stop_together

pytestmark = pytest.mark.timeout(180)


def post(url: str, path: str, doc: dict, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=90) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_gateway_says_a_hard_time_limit_in_words(redis_db, tmp_path) -> None:
    # Given a worker whose hard time limit (1 s) a request of 30 s passes, and a gateway
    procs = ready_together([
        launch_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                      "sleep", ASYNCINFER_TIME_LIMIT_S="1", ASYNCINFER_MAX_RETRIES="0"),
        launch_gateway(redis_db.url, tmp_path / "gateway.log")])
    try:
        request_id = f"gw-limit-{uuid.uuid4().hex}"
        doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [30.0]}]}
        # When it is sent through the gateway
        status, answer = post(procs[1].http_url, "/v2/models/sleep/infer", doc,
                              {"idempotency-key": request_id})
    finally:
        stop_together(procs)
    # Then 504 (the v2 mapping of a deadline), in words naming the request and the limit
    assert status == 504, answer
    assert answer["error"] == (f"request {request_id}: time limit (1 s) exceeded on model 'sleep' "
                               f"(its batch is still on the device)")


def test_a_bare_limit_stored_by_celerys_pool_names_the_request(redis_db) -> None:
    # Given the failure Celery's prefork pool stores: the bare limit, no request named
    request_id = f"pool-limit-{uuid.uuid4().hex}"
    with Client(settings=Settings(broker_url=redis_db.url)) as client:
        client.app.backend.mark_as_failure(request_id, TimeLimitExceeded(2.0))
        # When a client waits for it: still Celery's TimeLimitExceeded, now naming the request
        with pytest.raises(TimeLimitExceeded) as caught:
            client.result(request_id, timeout_s=10)
    assert caught.value.args == (f"request {request_id}: time limit (2 s) exceeded",)
    # and the gateway's answer to it
    answer = error_for(caught.value)
    assert (answer.status, answer.message) == (504, f"request {request_id}: time limit (2 s) "
                                                    f"exceeded")

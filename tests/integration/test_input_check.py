"""A request that does not fit its model's declared inputs is refused at submit, in the worker's
words, and never sent (client/input_check.py); a Celery producer sending the same request gets the
worker's FAILURE with the same words."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import redis

from asyncinfer.client import aio
from asyncinfer.client.outgoing import input_payloads
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.keys import CLAIM_PREFIX
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

WRONG = {"input": np.ones((1, 3), np.float32)}  # mlp declares input FP32 [n, 16]


def words(request_id: str) -> str:
    return f"request {request_id}: input 'input': shape [1, 3] does not match [n, 16]"


def test_a_request_that_does_not_fit_mlp_is_refused_at_submit_and_not_sent(
        client, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    # Given the session worker's announcement of mlp, with every datatype its input accepts
    wait_for(lambda: (e := client.models().get("mlp")) is not None and e.ready
             and e.metadata.get("input_datatypes") == {"input": ["FP32"]}, 30, "mlp announced")
    queued = r.llen("infer.mlp")
    rid = f"misfit-{uuid.uuid4().hex[:8]}"
    # When a request of the wrong shape is submitted
    with pytest.raises(InvalidRequest) as caught:
        client.submit("mlp", WRONG, request_id=rid)
    # Then submit raises the worker's words, and nothing went out: no message, no claim, no wait
    assert str(caught.value) == words(rid)
    assert r.llen("infer.mlp") == queued
    assert not r.exists(CLAIM_PREFIX + rid)
    assert rid not in client.watcher._callbacks
    # and a good request after it is answered, while the refused one never got a result
    good = client.submit("mlp", np.ones((2, 16), np.float32))
    assert good.result(timeout=60)["output"].shape == (2, 4)
    assert not r.exists(f"celery-task-meta-{rid}")
    assert client.app.AsyncResult(rid).state == "PENDING"
    # every other way in refuses it the same: map, and the asyncio client
    with pytest.raises(InvalidRequest, match=r"shape \[1, 3\] does not match \[n, 16\]$"):
        list(client.map("mlp", [WRONG["input"]], timeout_s=60))

    async def asubmit() -> None:
        await aio.submit(client.sender, "mlp", WRONG, {"request_id": rid + "-aio"})

    with pytest.raises(InvalidRequest) as caught:
        asyncio.run(asubmit())
    assert str(caught.value) == words(rid + "-aio")
    assert r.llen("infer.mlp") == queued and not r.exists(CLAIM_PREFIX + rid + "-aio")
    r.close()


def test_a_celery_producer_sending_the_same_request_gets_the_workers_failure_in_the_same_words(
        client) -> None:
    # Given the same request, sent by Celery itself (no client check)
    rid = f"misfit-celery-{uuid.uuid4().hex[:8]}"
    kwargs = {"model": "mlp", "inputs": input_payloads(WRONG, False), "parameters": {}}
    result = client.app.send_task(TASK_NAME, task_id=rid, queue="infer.mlp", kwargs=kwargs)
    # Then it fails on the worker, stored as a FAILURE with the words the client says
    with pytest.raises(InvalidRequest) as caught:
        result.get(timeout=60)
    assert str(caught.value) == words(rid)
    assert result.state == "FAILURE"

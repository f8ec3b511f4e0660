"""An unknown request ID is said at once; a request merely queued (any producer, behind any
backlog) never is: ``Client.result`` and the look behind it (client/request_lookup.py), against a
real Redis and no worker."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from asyncinfer.celery_app import create_app
from asyncinfer.client import Client
from asyncinfer.client.request_lookup import Limits, look_up
from asyncinfer.config.settings import Settings
from asyncinfer.constants import CPU_QUEUE, POSTPROCESS_TASK, PREPROCESS_TASK, TASK_NAME
from asyncinfer.errors import RequestRevoked, RequestTimeout, RequestUnknown
from asyncinfer.wire.keys import CLAIM_PREFIX, UNACKED_KEY
from asyncinfer.wire.messages import task_message

pytestmark = pytest.mark.timeout(120)

BACKLOG = 10_000


@pytest.fixture()
def app(redis_db) -> Iterator[Any]:
    """asyncinfer's Celery app on the test's database (its result backend, its chains)."""
    celery = create_app(Settings(broker_url=redis_db.url))
    yield celery
    celery.close()


@pytest.fixture()
def plain(redis_db) -> Iterator[Celery]:
    """A stock Celery producer: its send_task writes no trace (asyncinfer's app claims the ID)."""
    celery = Celery("plain", broker=redis_db.url)
    yield celery
    celery.close()


@pytest.fixture()
def db_client(redis_db) -> Iterator[Client]:
    """A client of the test's database, which no worker serves."""
    with Client(broker_url=redis_db.url) as c:
        yield c


def push_backlog(r, queue: str, count: int = BACKLOG) -> None:
    """``count`` requests on ``queue``, as Celery's send_task writes them (no trace)."""
    pipe = r.pipeline(transaction=False)
    for i in range(count):
        pipe.lpush(queue, task_message(TASK_NAME, f"backlog-{i}", {"model": "m", "inputs": []},
                                       queue))
    pipe.execute()


def test_an_unknown_id_is_said_at_once(db_client, redis_db) -> None:
    # Given a broker with requests of others queued, and an ID nothing exists for
    push_backlog(redis_db.client, "infer.other", 50)
    began = time.monotonic()
    # When its result is waited for, up to a minute
    with pytest.raises(RequestUnknown) as err:
        db_client.result("no-such-request", timeout_s=60)
    # Then it is said well before the minute, naming the request; still a RequestTimeout
    assert time.monotonic() - began < 10
    assert str(err.value).startswith(
        "request no-such-request: no request with this ID is known: nothing exists for it in "
        "Redis (no result, trace, claim, queue entry, unacked entry, lease or stream")
    assert isinstance(err.value, RequestTimeout) and isinstance(err.value, TimeoutError)
    assert "no-such-request" not in db_client.watcher._callbacks


@pytest.mark.parametrize("where", ["newest", "oldest"])
def test_a_request_behind_a_deep_backlog_is_never_unknown(db_client, plain, redis_db,
                                                          where) -> None:
    # Given a request sent with Celery's send_task (no trace, no claim), no worker running, and
    # 10,000 requests queued before it (newest: it waits behind them) or after it (oldest: past
    # what one look reads)
    queue, request_id = "infer.backlog", f"sent-{uuid.uuid4().hex}"
    if where == "oldest":
        plain.send_task(TASK_NAME, kwargs={"model": "backlog", "inputs": []}, queue=queue,
                      task_id=request_id)
    push_backlog(redis_db.client, queue)
    if where == "newest":
        plain.send_task(TASK_NAME, kwargs={"model": "backlog", "inputs": []}, queue=queue,
                      task_id=request_id)
    assert not redis_db.client.exists(CLAIM_PREFIX + request_id)
    # When its result is waited for
    with pytest.raises(RequestTimeout) as err:
        db_client.result(request_id, timeout_s=2)
    # Then the wait times out with the words it always had: it is queued, not unknown
    assert not isinstance(err.value, RequestUnknown)
    ahead = BACKLOG if where == "newest" else 0
    assert str(err.value) == (f"request {request_id}: no result within 2 s; it is queued on "
                              f"{queue} ({ahead} requests ahead of it)")


def test_an_id_revoked_before_it_was_sent_is_revoked_not_unknown(client) -> None:
    # Given an ID revoked before anything was sent with it (Celery's workers store REVOKED)
    request_id = f"revoked-first-{uuid.uuid4().hex}"
    client.app.control.revoke(request_id)
    # Then waiting for it says it was revoked: the worker stored that within the second look
    with pytest.raises(RequestRevoked):
        client.result(request_id, timeout_s=30)


def test_a_look_finds_each_place_a_request_can_be(app, redis_db) -> None:
    backend, r = app.backend, redis_db.client

    def look(request_id: str) -> Any:
        return look_up(request_id, backend.client, backend, r)

    assert look("nothing-1").unknown
    # its trace (an asyncinfer client's push), its stored state, its stream
    r.set(CLAIM_PREFIX + "traced-1", "infer.m")
    assert look("traced-1").found == "its trace (claim)"
    backend.store_result("running-1", {"pid": 1, "hostname": "cpu@box"}, "STARTED")
    assert look("running-1").found == "its stored result or stream"
    r.xadd("asyncinfer:stream:streaming-1", {"part": "0"})
    assert look("streaming-1").found == "its stored result or stream"
    # a worker's unacknowledged entry
    taken = task_message(TASK_NAME, "taken-1", {"model": "m"}, "infer.m")
    r.hset(UNACKED_KEY, "tag-7", json.dumps([json.loads(taken), "", "infer.m"]))
    assert look("taken-1").found == "kombu's unacknowledged entry tag-7"
    # a staged chain: its last task's ID is only in the body of the first message
    chain = (app.signature(PREPROCESS_TASK, kwargs={"model": "m"}, queue=CPU_QUEUE)
             | app.signature(POSTPROCESS_TASK, queue=CPU_QUEUE, task_id="staged-1"))
    chain.apply_async()
    assert r.llen(CPU_QUEUE) == 1 and b"staged-1" not in r.lindex(CPU_QUEUE, 0)
    assert look("staged-1").found == f"an entry of the list {CPU_QUEUE}"
    # an ID JSON escapes
    odd = 'quote"and\\slash'
    r.lpush("infer.m", task_message(TASK_NAME, odd, {"model": "m"}, "infer.m"))
    assert look(odd).found == "an entry of the list infer.m"
    assert look("nothing-2").unknown


def test_a_look_past_its_limits_tells_nothing(redis_db, app) -> None:
    backend, r = app.backend, redis_db.client
    r.lpush("infer.m", task_message(TASK_NAME, "oldest-1", {"model": "m"}, "infer.m"))
    push_backlog(r, "infer.m", 30)
    # Given a look that reads at most 20 entries: the oldest of 31 is past it
    small = Limits(max_entries=20, chunk=8)
    found = look_up("oldest-1", backend.client, backend, r, small)
    assert not found.unknown and not found.whole
    assert not look_up("nothing", backend.client, backend, r, small).unknown
    # and the newest is within it
    assert look_up("backlog-29", backend.client, backend, r, small).found
    # A compressed body cannot be searched: the look tells nothing either
    r.delete("infer.m")
    message = json.loads(task_message(TASK_NAME, "other", {"model": "m"}, "infer.m"))
    message["headers"]["compression"] = "application/x-gzip"
    r.lpush("infer.m", json.dumps(message))
    assert not look_up("nothing", backend.client, backend, r).unknown
    # A look with room reads every list whole
    r.delete("infer.m")
    push_backlog(r, "infer.m", 30)
    assert look_up("nothing", backend.client, backend, r).unknown

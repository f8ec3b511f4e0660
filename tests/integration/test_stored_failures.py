"""Failures stored by someone else (another producer, a tool writing the result backend itself)
whose ``exc_type`` is not an exception type: every way of reading a result settles with an
asyncinfer error naming the request and what was stored, against a real Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.errors import AsyncInferError
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(120)

#: Stored failures no exception can be rebuilt from: (its ``result``, what the error says of it).
NOT_EXCEPTIONS = [
    ({"exc_type": "dict", "exc_message": ["a", "b"], "exc_module": "builtins"},
     "an error of unknown type 'builtins.dict': ['a', 'b']"),
    ({"exc_type": "system", "exc_message": "echo hi", "exc_module": "os"},
     "an error of unknown type 'os.system': 'echo hi'"),
    ({"exc_type": "getLogger", "exc_message": [], "exc_module": "logging"},
     "an error of unknown type 'logging.getLogger': []"),
    ({"exc_message": ["no type"], "exc_module": "builtins"},
     "an error of unknown type (none stored): {'exc_message': ['no type'], 'exc_module': 'builtins'}"),
    ("just text", "an error of unknown type (none stored): 'just text'"),
]


def store_failure(r, request_id: str, result: object) -> None:
    """Store ``result`` as request ``request_id``'s FAILURE and announce it, as a tool writing
    Celery's result backend by hand would (no Celery involved)."""
    payload = json.dumps({"status": "FAILURE", "result": result, "traceback": None,
                          "children": [], "date_done": "2026-12-01T00:00:00+00:00",
                          "task_id": request_id})
    key = f"celery-task-meta-{request_id}"
    r.set(key, payload)
    r.publish(key, payload)


@pytest.mark.parametrize(("stored", "said"), NOT_EXCEPTIONS,
                         ids=["builtins.dict", "os.system", "logging.getLogger", "no-type", "text"])
def test_a_future_settles_when_the_stored_failure_is_no_exception_type(
        redis_db, stored, said) -> None:
    with Client(broker_url=redis_db.url) as client:
        # Given a future waiting on a request, and a second one the watcher also serves
        first, second = f"odd-{uuid.uuid4().hex}", f"fine-{uuid.uuid4().hex}"
        future, other = client.future(first), client.future(second)
        # When someone stores a failure for it whose type is no exception type
        store_failure(redis_db.client, first, stored)
        # Then the future settles with an asyncinfer error naming the request and what was stored
        with pytest.raises(AsyncInferError) as caught:
            future.result(timeout=10)
        assert str(caught.value) == f"request {first} failed with {said}"
        # And the watcher goes on serving other futures
        client.app.backend.store_result(second, {"ok": 1}, "SUCCESS")
        assert other.result(timeout=10) == {"ok": 1}


def test_an_odd_failure_stored_before_the_lookup_is_said_too(redis_db) -> None:
    request_id = f"odd-{uuid.uuid4().hex}"
    store_failure(redis_db.client, request_id, NOT_EXCEPTIONS[0][0])
    with Client(broker_url=redis_db.url) as client:
        # client.result reads it by ID, as AsyncResult would
        with pytest.raises(AsyncInferError, match=rf"^request {request_id} failed with an error of "
                                                  r"unknown type 'builtins.dict': \['a', 'b'\]$"):
            client.result(request_id, timeout_s=10)

        async def awaited() -> None:
            await asyncio.wrap_future(client.future(request_id))

        with pytest.raises(AsyncInferError, match=rf"^request {request_id} failed with an error"):
            asyncio.run(awaited())


def test_a_submitted_request_answered_with_an_odd_failure_ends(redis_db) -> None:
    # Given requests no worker serves (this database has none), one answered by hand with an odd
    # failure, the others with a plain success
    with Client(broker_url=redis_db.url) as client:
        futures = [client.submit("identity", np.array([[i]], np.float32)).sent(timeout_s=10)
                   for i in range(3)]
        store_failure(redis_db.client, futures[1].id, NOT_EXCEPTIONS[0][0])
        for f in (futures[0], futures[2]):
            client.app.backend.store_result(f.id, {"ok": f.id}, "SUCCESS")
        # Then map-like reading gets each in turn: the odd one raises, the others answer
        assert futures[0].result(timeout=10) == {"ok": futures[0].id}
        with pytest.raises(AsyncInferError, match=f"request {futures[1].id} failed with an error "
                                                  f"of unknown type 'builtins.dict'"):
            futures[1].result(timeout=10)
        assert futures[2].result(timeout=10) == {"ok": futures[2].id}


def test_a_stored_exit_is_not_raised_to_the_caller(redis_db) -> None:
    # A failure naming SystemExit (or StopIteration, which an asyncio future refuses) would end
    # the caller's program, or leave its awaiting coroutine hanging
    with Client(broker_url=redis_db.url) as client:
        for kind in ("SystemExit", "StopIteration"):
            request_id = f"{kind}-{uuid.uuid4().hex}"
            future = client.future(request_id)
            store_failure(redis_db.client, request_id,
                          {"exc_type": kind, "exc_message": ["bye"], "exc_module": "builtins"})
            with pytest.raises(AsyncInferError, match=rf"^request {request_id} failed with an "
                                                      rf"error of type 'builtins.{kind}', which is "
                                                      r"not raised to a caller: \['bye'\]$"):
                future.result(timeout=10)


def test_a_stored_result_that_cannot_be_read_ends_its_future(redis_db) -> None:
    with Client(broker_url=redis_db.url) as client:
        # Given a result key that holds no result (a tool's garbled write)
        request_id, other = f"garbled-{uuid.uuid4().hex}", f"fine-{uuid.uuid4().hex}"
        redis_db.client.set(f"celery-task-meta-{request_id}", b"\x80 not json")
        # When it is looked up: its future ends saying so, and the watcher serves the next
        future, fine = client.future(request_id), client.future(other)
        with pytest.raises(AsyncInferError, match=rf"^request {request_id}: its stored result "
                                                  r"cannot be read \("):
            future.result(timeout=10)
        client.app.backend.store_result(other, {"ok": 1}, "SUCCESS")
        assert fine.result(timeout=10) == {"ok": 1}


def test_reading_the_stream_of_a_request_with_an_odd_failure_raises_it(redis_db) -> None:
    request_id = f"odd-{uuid.uuid4().hex}"
    store_failure(redis_db.client, request_id, NOT_EXCEPTIONS[1][0])
    with Client(broker_url=redis_db.url) as client:
        with pytest.raises(AsyncInferError, match=rf"^request {request_id} failed with an error of "
                                                  r"unknown type 'os.system'"):
            list(client.read_stream(request_id, timeout_s=10))


def test_asyncinfer_result_says_an_odd_failure_on_one_line(redis_db) -> None:
    request_id = f"odd-{uuid.uuid4().hex}"
    store_failure(redis_db.client, request_id, NOT_EXCEPTIONS[0][0])
    out = subprocess.run([sys.executable, "-m", "asyncinfer", "result", request_id, "--timeout-s",
                          "10"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=worker_env(redis_db.url))
    assert out.returncode == 1
    assert [line for line in out.stderr.splitlines() if line.strip()] == [
        f"asyncinfer result: AsyncInferError: request {request_id} failed with an error of "
        f"unknown type 'builtins.dict': ['a', 'b']"]

"""Hostile envelopes interleaved with valid requests, all taken by a worker in one go.

Every valid request is answered at once (not after the visibility timeout), each bad message that
names a request ID gets a FAILURE naming it, nothing bad stays in kombu's unacknowledged
bookkeeping, the worker's memory stays bounded and it goes on serving. The same matrix runs
against the session worker (the fast consumer) and a worker on Celery's stock consumer
(``ASYNCINFER_CONSUMER=celery``, the project's kombu Redis transport).
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.constants import TASK_NAME, queue_for
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.messages import task_message
from tests.support.databases import RedisDatabases
from tests.support.processes import SESSION_MAX_PAYLOAD_BYTES, WorkerProcess, start_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

QUEUE = queue_for("identity")
DEEP = 100_000


def _valid(rid: str) -> str:
    kwargs = {"model": "identity", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                               "data": [float(len(rid)), 2.0]}], "parameters": {}}
    # written as the standard library writes it (as a Python producer would): the edits below
    # find their places by its spacing
    return json.dumps(json.loads(task_message(TASK_NAME, rid, kwargs, QUEUE)))


def _replaced(text: Any, old: Any, new: Any) -> Any:
    """``text`` with its first ``old`` replaced (which must be there: an edit that finds nothing
    would send a valid request)."""
    assert old in text
    return text.replace(old, new, 1)


def _edited(edit: Callable[[dict], None]) -> Callable[[str], str]:
    def build(rid: str) -> str:
        envelope = json.loads(_valid(rid))
        edit(envelope)
        return json.dumps(envelope)
    return build


def _set(path: str, value: object) -> Callable[[dict], None]:
    def edit(envelope: dict) -> None:
        *parents, last = path.split(".")
        node = envelope
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _deep_headers(rid: str) -> str:
    return _replaced(_valid(rid), '"headers": {', '"headers": {"deep": ' + "[" * DEEP + "]" * DEEP + ", ")


def _body(raw: bytes) -> Callable[[dict], None]:
    return _set("body", base64.b64encode(raw).decode())


def _kwargs_body(kwargs: dict) -> Callable[[dict], None]:
    return _body(json.dumps([[], kwargs, {}]).encode())


#: name → (message given the request ID, a regular expression the FAILURE must match, or None
#: when the message names no findable request ID and can only be dropped and logged).
HOSTILE: dict[str, tuple[Callable[[str], str | bytes], str | None]] = {
    "headers a list": (_edited(_set("headers", ["id", "x"])), r"malformed.*headers must be an object"),
    "headers a string": (_edited(_set("headers", "nope")), r"malformed.*headers must be an object"),
    "properties missing": (_edited(lambda e: e.pop("properties")), r"malformed.*properties"),
    "delivery tag missing": (_edited(lambda e: e["properties"].pop("delivery_tag")),
                             r"malformed.*no delivery tag"),
    "body not base64": (_edited(_set("body", "%%% not base64 %%%")), r"not valid base64"),
    "nested 100k deep in headers": (_deep_headers, r"malformed.*RecursionError"),
    "nested 100k deep in the body": (_edited(_body(b"[" * DEEP + b"]" * DEEP)),
                                     r"not valid application/json \(RecursionError"),
    "huge shape": (_edited(_kwargs_body({"model": "identity", "inputs": [
        {"name": "x", "shape": [10 ** 12, 10 ** 6], "datatype": "FP32", "data": [1.0]}]})),
        r"input 'x'.*(shape|elements)"),
    "negative shape": (_edited(_kwargs_body({"model": "identity", "inputs": [
        {"name": "x", "shape": [-3, 2], "datatype": "FP32", "data": [1.0]}]})), r"input 'x'"),
    "50 MB body": (_edited(_set("body", "A" * (50 * 1024 * 1024))), r"over the limit"),
    "invalid UTF-8": (lambda rid: _replaced(_valid(rid).encode(), b'"lang": "py"', b'"lang": "p\xff"'),
                      r"malformed.*(UnicodeDecodeError|utf-8)"),
    "retries a string": (_edited(_set("headers.retries", "many")), r"header 'retries'"),
    "timelimit junk": (_edited(_set("headers.timelimit", {"hard": 1})), r"header 'timelimit'"),
    "task a number": (_edited(_set("headers.task", 7)), r"header 'task' must be a string"),
    "celery.accumulate": (_edited(_set("headers.task", "celery.accumulate")),
                          r"task 'celery.accumulate' is refused: only asyncinfer.infer is served "
                          r"on queue infer.identity"),
    "celery.backend_cleanup": (_edited(_set("headers.task", "celery.backend_cleanup")),
                               r"task 'celery.backend_cleanup' is refused: only asyncinfer.infer is served"),
    "asyncinfer.preprocess": (_edited(_set("headers.task", "asyncinfer.preprocess")),
                              r"task 'asyncinfer.preprocess' is refused: only asyncinfer.infer is served"),
    "body a number": (_edited(_kwargs_body(5)), r"\[args, kwargs, embed\]"),  # type: ignore[arg-type]
    "not JSON at all": (lambda rid: "{garbage " + "x" * 100, None),
    "a JSON array": (lambda rid: "[1, 2, 3]", None),
    "empty": (lambda rid: "", None),
}


@dataclass(frozen=True)
class Served:
    """A worker on one consumer and the broker URL it serves."""

    consumer: str
    url: str
    worker: WorkerProcess


@pytest.fixture(scope="module", params=["fast", "celery"])
def served(request: pytest.FixtureRequest, redis_url: str, redis_databases: RedisDatabases,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The session worker (fast consumer), or a worker of its own on Celery's stock consumer."""
    if request.param == "fast":
        yield Served("fast", redis_url, request.getfixturevalue("worker"))
        return
    with redis_databases.take("hostile-celery") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp("hostile") / "worker.log",
                            "--device", "cpu", "--models", "identity", "--concurrency", "8",
                            "--hostname", "hostile-celery@%h", ASYNCINFER_CONSUMER="celery",
                            ASYNCINFER_MAX_PAYLOAD_BYTES=str(SESSION_MAX_PAYLOAD_BYTES))
        try:
            assert "fast consumer on" not in proc.log()
            yield Served("celery", db.url, proc)
        finally:
            proc.stop()


@pytest.fixture()
def served_client(served: Served) -> Iterator[Client]:
    c = Client(broker_url=served.url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture()
def served_worker(served: Served) -> WorkerProcess:
    return served.worker


@pytest.fixture()
def served_redis(served: Served) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(served.url)
    try:
        yield r
    finally:
        r.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_hostile_envelopes_fail_alone_and_valid_ones_are_answered_at_once(
        served_client, served_worker, served_redis) -> None:
    client, worker, redis_client = served_client, served_worker, served_redis
    # Given the worker is serving
    assert client.infer("identity", {"x": np.ones((1, 2), np.float32)}, timeout_s=30)
    rss_before = _rss_kib(worker.pid)
    # When every hostile message goes on the queue between two valid requests, in one push,
    # so that they are taken together
    bad_ids = {name: f"bad-{i}-{uuid.uuid4().hex[:6]}" for i, name in enumerate(HOSTILE)}
    good_ids = [f"good-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(HOSTILE) + 1)]
    goods = {rid: client.future(rid) for rid in good_ids}
    bads = {name: client.future(bad_ids[name]) for name, (_, rule) in HOSTILE.items() if rule}
    pipe = redis_client.pipeline()
    pipe.lpush(QUEUE, _valid(good_ids[0]))
    for (name, (build, _)), good in zip(HOSTILE.items(), good_ids[1:], strict=True):
        pipe.lpush(QUEUE, build(bad_ids[name]))
        pipe.lpush(QUEUE, _valid(good))
    pipe.execute()

    # Then every valid request is answered, right away (the visibility timeout is an hour)
    for rid, future in goods.items():
        response = future.result(timeout=60)
        assert response.id == rid and response["x"].tolist() == [[float(len(rid)), 2.0]]
    # And each bad one that names its ID fails, saying which request and which rule
    for name, future in bads.items():
        err = future.exception(timeout=30)
        assert isinstance(err, InvalidRequest), (name, err)
        message = str(err)
        assert message.startswith(f"request {bad_ids[name]}: "), (name, message)
        assert re.search(HOSTILE[name][1], message), (name, message)
    # And nothing bad is left on the queue or in kombu's bookkeeping (its restore sweep loads
    # every entry there), and the worker's memory stayed bounded
    wait_for(lambda: redis_client.hlen("unacked") == 0, 30, "every message acknowledged")
    assert redis_client.llen(QUEUE) == 0
    growth_mib = (_rss_kib(worker.pid) - rss_before) / 1024
    print(f"hostile envelopes: worker RSS grew by {growth_mib:.0f} MiB")
    assert growth_mib < 400, f"worker RSS grew by {growth_mib:.0f} MiB"
    # And the worker goes on serving
    assert worker.process.poll() is None
    out = client.infer("identity", {"x": np.full((1, 2), 7.0, np.float32)}, timeout_s=30)
    assert out["x"].tolist() == [[7.0, 7.0]]


def test_a_request_id_cannot_forge_a_log_line(served_client, served_worker, served_redis) -> None:
    client, worker, redis_client = served_client, served_worker, served_redis
    # Given a message whose request ID carries a line break and a fake log line
    rid = f"evil-{uuid.uuid4().hex[:6]}\n[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged"
    future = client.future(rid)
    redis_client.lpush(QUEUE, _valid(rid))
    # Then it fails for its ID, and the worker's log has no line that starts with the forgery
    err = future.exception(timeout=30)
    assert isinstance(err, InvalidRequest) and "printable characters" in str(err)
    def logged() -> str | None:
        text = worker.log()
        return text if "forged" in text else None

    log = wait_for(logged, 10, "the log line")
    assert not [line for line in log.splitlines() if line.startswith("[2026-01-01")]
    assert "\\n[2026-01-01" in log

"""The store script (broker/store.py) announces a batch's results once per reply channel, stores a
quiet entry (a STARTED state) without announcing it, and acknowledges any number of messages with
one command per key (fakeredis: Redis' Lua in-process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from asyncinfer.broker.store import QUIET, StoreScript
from asyncinfer.wire.keys import (
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)
from asyncinfer.wire.reply import GROUPED, announced_payloads

A, B = "asyncinfer:reply:a", "asyncinfer:reply:b"


def meta(request_id: str, status: str = "SUCCESS") -> str:
    return json.dumps({"status": status, "result": [request_id], "task_id": request_id})


@pytest.fixture()
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    client.close()


def heard(pubsub: Any) -> list[tuple[str, bytes]]:
    out = []
    while (message := pubsub.get_message(timeout=0.1)) is not None:
        if message["type"] == "message":
            out.append((message["channel"].decode(), message["data"]))
    return out


def test_a_batch_is_announced_once_per_reply_channel(r: fakeredis.FakeRedis) -> None:
    pubsub = r.pubsub()
    pubsub.subscribe(A, B, "celery-task-meta-a1", "celery-task-meta-s1")
    while pubsub.get_message(timeout=0.1) is not None:
        pass  # the confirmations
    # Given a batch: three results for client A (one with a ':' and a non-ASCII character in its
    # text), one for B, one naming no channel, and a quiet STARTED state naming A
    entries = [("celery-task-meta-a1", meta("a1"), A, "", ""),
               ("celery-task-meta-b1", meta("b1"), B, "", ""),
               ("celery-task-meta-a2", meta("a:2 wörld"), A, "", ""),
               ("celery-task-meta-n1", meta("n1"), "", "", ""),
               ("celery-task-meta-s1", meta("s1", "STARTED"), A, "", QUIET),
               ("celery-task-meta-a3", meta("a3"), A, "", "")]
    assert StoreScript(r, 60).call(entries) == ([], [])
    messages = heard(pubsub)
    # Then A heard one message carrying its three results in order, B one plain payload, the
    # result's own channel its payload, and the STARTED state was stored and announced nowhere
    on_a = [data for channel, data in messages if channel == A]
    assert len(on_a) == 1 and on_a[0].startswith(GROUPED)
    assert announced_payloads(on_a[0]) == [meta("a1").encode(), meta("a:2 wörld").encode(),
                                           meta("a3").encode()]
    assert [data for channel, data in messages if channel == B] == [meta("b1").encode()]
    assert [data for channel, data in messages if channel == "celery-task-meta-a1"] == [
        meta("a1").encode()]
    assert [channel for channel, _ in messages if channel == "celery-task-meta-s1"] == []
    assert json.loads(r.get("celery-task-meta-s1"))["status"] == "STARTED"
    for request_id in ("a1", "b1", "a:2 wörld", "n1", "a3"):
        key = f"celery-task-meta-{request_id}" if ":" not in request_id else "celery-task-meta-a2"
        assert json.loads(r.get(key))["task_id"] == request_id


def test_a_grouped_message_cut_short_yields_what_came_before_the_fault() -> None:
    whole = GROUPED + b"3:abc2:de"
    assert announced_payloads(whole) == [b"abc", b"de"]
    assert announced_payloads(whole[:-1]) == [b"abc"]  # the second payload cut short
    assert announced_payloads(GROUPED + b"x:abc") == []  # no length
    assert announced_payloads(b'{"status": "SUCCESS"}') == [b'{"status": "SUCCESS"}']


def test_any_number_of_acknowledgements_are_one_command_per_key(r: fakeredis.FakeRedis) -> None:
    tags = [f"t{i}" for i in range(2500)]  # more than one call's worth (1,000 per call)
    for key in (UNACKED_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY):
        r.hset(key, mapping={tag: "x" for tag in tags + ["other"]})
    for key in (UNACKED_INDEX_KEY, LEASES_KEY):
        r.zadd(key, {tag: 1.0 for tag in tags + ["other"]})
    assert StoreScript(r, 60).call([("", "", "", tag, "") for tag in tags]) == ([], [])
    for key in (UNACKED_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY):
        assert r.hkeys(key) == [b"other"], key
    for key in (UNACKED_INDEX_KEY, LEASES_KEY):
        assert r.zrange(key, 0, -1) == [b"other"], key

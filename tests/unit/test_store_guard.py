"""The store script's guard (broker/store.py): a sequence request's result never replaces a
final state already stored for its request — the FAILURE (SequenceStateLost) another worker's
sweep wrote while this worker was frozen past its lease — and a plain request's result is stored
as ever (fakeredis: Redis' Lua in-process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from asyncinfer.broker.store import GUARDED, StoreScript
from asyncinfer.constants import is_sequence_list, queue_for, sequence_list
from asyncinfer.wire.keys import UNACKED_KEY

KEY = "celery-task-meta-r1"


def meta(status: str) -> str:
    return json.dumps({"status": status, "result": None, "task_id": "r1"})


def status(r: fakeredis.FakeRedis) -> str:
    stored: Any = r.get(KEY)
    return str(json.loads(stored)["status"])


@pytest.fixture()
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    client.close()


@pytest.mark.parametrize("final", ["FAILURE", "SUCCESS", "REVOKED"])
def test_a_guarded_result_never_replaces_a_final_state(r: fakeredis.FakeRedis, final: str) -> None:
    r.set(KEY, meta(final))
    r.hset(UNACKED_KEY, "t1", "message")
    pubsub = r.pubsub()
    pubsub.subscribe(KEY)
    pubsub.get_message(timeout=1)
    errors, left = StoreScript(r, 60).call([(KEY, meta("SUCCESS"), "", "t1", GUARDED)])
    assert (errors, left) == ([], [KEY])
    assert status(r) == final  # what its caller was told stands
    assert pubsub.get_message(timeout=0.1) is None  # and no second answer is announced
    assert not r.hexists(UNACKED_KEY, "t1")  # the message is acknowledged all the same


@pytest.mark.parametrize("before", [None, "STARTED", "RETRY", "not json"])
def test_a_guarded_result_is_stored_over_no_final_state(r: fakeredis.FakeRedis,
                                                        before: str | None) -> None:
    if before is not None:
        r.set(KEY, meta(before) if before != "not json" else before)
    assert StoreScript(r, 60).call([(KEY, meta("SUCCESS"), "", "", GUARDED)]) == ([], [])
    assert status(r) == "SUCCESS"


def test_a_plain_result_is_stored_over_a_final_state_as_ever(r: fakeredis.FakeRedis) -> None:
    r.set(KEY, meta("FAILURE"))
    assert StoreScript(r, 60)([(KEY, meta("SUCCESS"), "", "", "")]) == []
    assert status(r) == "SUCCESS"


def test_a_sequence_request_is_known_by_the_list_it_was_taken_from() -> None:
    queue = queue_for("accumulator")
    assert is_sequence_list(sequence_list(queue, "seq-a@host host 4242 99"))
    assert not is_sequence_list(queue)

"""The reply channel, in process: the header's rule, the envelope that carries it, and the result
writer publishing a final state there (and nothing else) in the transaction that stores it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from celery import states

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import ModelError
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.keys import REPLY_CHANNEL_PREFIX
from asyncinfer.wire.messages import task_message
from asyncinfer.wire.reply import REPLY_TO, announced_payloads, reply_channel_of, reply_rule_broken
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.result_writer import ResultWriter
from asyncinfer.worker.requests.taken import TakenMessage

CHANNEL = REPLY_CHANNEL_PREFIX + "c0ffee"


@pytest.mark.parametrize("value, rule", [
    (7, "must be a string, not int"),
    (["asyncinfer:reply:x"], "must be a string, not list"),
    ("celery-task-meta-someone-else", "must name a channel 'asyncinfer:reply:<name>'"),
    ("asyncinfer:reply:", "must name a channel"),
    ("asyncinfer:reply:two words", "without whitespace"),
    ("asyncinfer:reply:" + "x" * 200, "at most 200 printable characters"),
    ("asyncinfer:reply:\x00", "printable"),
])
def test_a_reply_channel_outside_the_rule_is_refused_naming_the_header(value: Any, rule: str) -> None:
    # Given a message whose reply header breaks the rule
    raw = json.loads(task_message(TASK_NAME, "r-1", {"model": "m", "inputs": []}, "infer.m"))
    raw["headers"][REPLY_TO] = value
    delivery = TakenMessage(raw=json.dumps(raw).encode(), queue="infer.m", received_at=0.0)
    # When the worker parses it, then it is refused with the header's name and the rule
    with pytest.raises(ValueError) as err:
        parse_envelope(delivery)
    assert REPLY_TO in str(err.value) and rule in str(err.value)
    assert reply_channel_of(raw["headers"]) is None


def test_the_envelope_carries_a_valid_reply_channel_and_nothing_when_none_is_given() -> None:
    with_reply = json.loads(task_message(TASK_NAME, "r-2", {}, "infer.m", reply_to=CHANNEL))
    without = json.loads(task_message(TASK_NAME, "r-3", {}, "infer.m"))
    assert with_reply["headers"][REPLY_TO] == CHANNEL
    assert REPLY_TO not in without["headers"]
    assert reply_rule_broken(CHANNEL) is None and reply_rule_broken(None) is None
    assert reply_channel_of(with_reply["headers"]) == CHANNEL
    assert reply_channel_of(without["headers"]) is None


@pytest.fixture()
def writer() -> Iterator[tuple[ResultWriter, fakeredis.FakeRedis, threading.Event]]:
    broker = fakeredis.FakeRedis()
    done = threading.Event()
    w = ResultWriter(create_app(Settings(broker_url="redis://127.0.0.1:1/0")), broker,
                     lambda batch: done.set())
    try:
        yield w, broker, done
    finally:
        w.close()
        broker.flushall()


def _delivery(request_id: str, reply_to: str | None) -> TakenMessage:
    d = TakenMessage(raw=task_message(TASK_NAME, request_id, {"model": "m", "inputs": []}, "infer.m",
                                  reply_to=reply_to).encode(), queue="infer.m", received_at=0.0)
    parse_envelope(d)
    return d


def _messages(pubsub: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    while (message := pubsub.get_message(timeout=0.2)) is not None:
        if message["type"] == "message":  # a batch's results on one channel come grouped
            out += [(message["channel"].decode(), json.loads(payload))
                    for payload in announced_payloads(message["data"])]
    return out


def test_the_writer_announces_final_states_on_the_reply_channel_exactly_as_stored(writer: Any) -> None:
    w, broker, done = writer
    pubsub = broker.pubsub()
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=1)  # the subscription's confirmation
    # Given four outcomes: a success and a failure naming the reply channel, a retry naming it,
    # and a success naming none
    outcomes = [Outcome(_delivery("ok", CHANNEL), states.SUCCESS, {"id": "ok", "outputs": []}),
                Outcome(_delivery("bad", CHANNEL), states.FAILURE, ModelError("request bad: boom")),
                Outcome(_delivery("again", CHANNEL), states.RETRY, ModelError("transient"),
                        retry='{"retry": 1}'),
                Outcome(_delivery("plain", None), states.SUCCESS, {"id": "plain", "outputs": []})]
    for outcome in outcomes:
        w.put(outcome)
    # When they are written
    assert done.wait(10)
    while sum(1 for k in broker.scan_iter("celery-task-meta-*")) < 4:
        done.clear()
        assert done.wait(10)
    # Then the reply channel heard the two final states, each the stored payload, and nothing else
    heard = _messages(pubsub)
    assert [(channel, meta["task_id"], meta["status"]) for channel, meta in heard] == [
        (CHANNEL, "ok", states.SUCCESS), (CHANNEL, "bad", states.FAILURE)]
    for _, meta in heard:
        assert json.loads(broker.get(f"celery-task-meta-{meta['task_id']}")) == meta

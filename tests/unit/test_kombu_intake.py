"""The kombu transport of the pipeline, without a broker: a kombu message written as the envelope
the Redis lists hold (so every rule reads it as on the fast consumer), its acknowledgement after
the write (a retry published first; one that cannot be published left unacknowledged), and the
prefetch window widened while one waits for its eta."""

from __future__ import annotations

import base64
import json
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import ModelError
from asyncinfer.wire.envelope import decode_body, parse_envelope
from asyncinfer.wire.messages import envelope_text, retry_message
from asyncinfer.worker.consumers.kombu_intake import KombuIntake
from asyncinfer.worker.output.kombu_acks import acknowledge
from asyncinfer.worker.output.outcomes import Outcomes
from asyncinfer.worker.requests.holdings import Holdings
from asyncinfer.worker.requests.taken import TakenMessage

pytestmark = pytest.mark.timeout(30)

BODY = b'[[], {"model": "m", "inputs": []}, {"callbacks": null, "errbacks": null}]'


class _Message:
    """What kombu hands Celery's consumer: an amqp message (int delivery tag, bytes body)."""

    def __init__(self, request_id: str, *, redelivered: bool = False, tag: Any = 7) -> None:
        self.body = BODY
        self.content_type, self.content_encoding = "application/json", "utf-8"
        self.headers = {"task": TASK_NAME, "id": request_id, "retries": 0, "eta": None}
        self.properties = {"correlation_id": request_id, "reply_to": "", "priority": 0,
                           "delivery_tag": tag}
        self.delivery_info = {"exchange": "infer.m", "routing_key": "infer.m",
                              "redelivered": redelivered}
        self.acknowledged = False
        self.acks = 0

    def ack(self) -> None:
        self.acks += 1
        self.acknowledged = True


def _taken(message: _Message) -> TakenMessage:
    d = TakenMessage(raw=envelope_text(message).encode(), queue="infer.m", message=message)
    parse_envelope(d)
    return d


def test_a_kombu_message_reads_as_the_redis_lists_envelope() -> None:
    d = _taken(_Message("req-1", redelivered=True))
    assert d.request_id == "req-1" and d.tag  # a delivery tag of its own (amqp's is a number)
    assert d.headers["task"] == TASK_NAME and d.headers["redelivered"] is True
    args, kwargs, embed = decode_body(d, 10_000)
    assert (args, kwargs["model"], embed["callbacks"]) == ([], "m", None)
    info = d.envelope["properties"]["delivery_info"]
    assert info == {"exchange": "infer.m", "routing_key": "infer.m"}
    # over the payload limit, as on the fast consumer
    with pytest.raises(Exception, match="req-1"):
        decode_body(d, 10)
    # kombu's Redis transport's string tag is kept; a first delivery is not marked redelivered
    kept = _taken(_Message("req-2", tag="abc-tag"))
    assert kept.tag == "abc-tag" and "redelivered" not in kept.headers


class _Producer:
    def __init__(self, fail_for: str = "") -> None:
        self.fail_for, self.published = fail_for, []

    def publish(self, body: bytes, **options: Any) -> None:
        if options["headers"]["id"] == self.fail_for:
            raise ConnectionError("the broker went away")
        self.published.append((body, options))


def _app(producer: _Producer) -> Any:
    """An app whose producer is ``producer`` (no broker)."""

    @contextmanager
    def producer_or_acquire() -> Any:
        yield producer

    return SimpleNamespace(producer_or_acquire=producer_or_acquire)


def test_a_written_batch_is_acknowledged_its_retries_published_first() -> None:
    producer = _Producer()
    done, again = _taken(_Message("done")), _taken(_Message("again"))
    retry = retry_message(again, 1.5)
    acknowledge(_app(producer), [(done, None), (again, retry)])
    assert done.message.acks == 1 and again.message.acks == 1
    [(body, options)] = producer.published
    assert body == BODY  # the same body, as Task.retry sends it
    assert options["headers"]["retries"] == 1 and options["headers"]["eta"]
    assert options["routing_key"] == "infer.m" and options["exchange"] == "infer.m"
    assert options["content_type"] == "application/json"


def test_a_retry_that_cannot_be_published_leaves_its_message_unacknowledged() -> None:
    producer = _Producer(fail_for="lost")
    lost, other = _taken(_Message("lost")), _taken(_Message("other"))
    acknowledge(_app(producer), [(lost, retry_message(lost, 1.0)), (other, None)])
    assert lost.message.acks == 0  # the broker gives it back: at least once
    assert other.message.acks == 1
    # one already acknowledged is not acknowledged again
    acknowledge(_app(producer), [(other, None)])
    assert other.message.acks == 1


def test_what_waits_for_its_eta_widens_the_prefetch_window_while_it_waits() -> None:
    told: list[int] = []
    holdings = Holdings(8, on_scheduled=told.append)
    a, b = _taken(_Message("a")), _taken(_Message("b"))
    holdings.add(a, b)
    holdings.schedule(a)
    holdings.schedule(b)
    holdings.schedule(b)  # already waiting: nothing more
    holdings.resume(a)
    holdings.release([a, b])  # b released while it waits
    assert told == [1, 1, -1, -1]
    # the Redis lists' messages are none of kombu's window, nor its leases' business
    lists = TakenMessage(raw=b"{}", queue="infer.m", tag="t-1", request_id="c")
    holdings.add(lists)
    holdings.schedule(lists)
    assert told == [1, 1, -1, -1] and holdings.tags() == ["t-1"]
    holdings.add(a)
    assert holdings.tags() == ["t-1"]  # a kombu message is leased by no script
    assert holdings.in_flight == 1 and json.loads(a.raw)["body"] == base64.b64encode(BODY).decode()



def test_what_is_still_held_at_a_stop_goes_back_and_is_settled_as_nothing_here() -> None:
    # Given an intake holding a request its device never ran, whose drain at a stop runs out
    written, failed = [], []
    intake = KombuIntake.__new__(KombuIntake)
    intake._stopping = threading.Event()
    intake.holdings = Holdings(8)
    # the drain runs out (nothing finishes), the writer closed: nothing is written from now on
    intake._drain = lambda grace_s: intake.holdings.drain(grace_s)
    held = _taken(_Message("held"))
    intake.holdings.add(held)
    intake.stop(grace_s=0.0)
    # Then it is no longer held, nor acknowledged: RabbitMQ gives it back when the connection
    # closes
    assert intake.holdings.held() == [] and intake.in_flight == 0 and held.message.acks == 0
    # And when the runtime's shutdown then fails it ("worker shut down before model ... ran
    # it"), nothing answers, logs or counts it as a FAILURE here: it runs elsewhere
    settlement = SimpleNamespace(failed=lambda *a, **k: failed.append(a), hostname="w")
    outcomes = Outcomes(SimpleNamespace(put=written.append), settlement, intake.holdings,
                        lambda *a: None)
    future: Future[Any] = Future()
    future.set_exception(ModelError("request held: worker shut down before model 'm' ran it"))
    outcomes.settle(held, SimpleNamespace(id="held"), future, None)
    assert written == [] and failed == []

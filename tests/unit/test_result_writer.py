"""The result writer on fakeredis (with its Lua): each batch's results and acknowledgements in one
script call (a transaction with it when the batch pushes retries), retried whole when Redis
refuses it, the retry budget asked once per batch, one unencodable
result failing alone."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis
from celery import states

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import ModelError
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.keys import UNACKED_INDEX_KEY, UNACKED_KEY
from asyncinfer.wire.messages import retry_message, task_message
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.result_writer import ResultWriter
from asyncinfer.worker.requests.taken import TakenMessage

URL = "redis://127.0.0.1:1/0"  # never connected to: the writer is given fakeredis


class _Refusing(fakeredis.FakeRedis):
    """fakeredis whose next ``refusals`` writes (transactions or store scripts) Redis refuses
    (out of memory)."""

    refusals = 0
    #: A write of more commands than this (four per request in a store script) is refused as
    #: Redis does when its queued commands or arguments take it over maxmemory (0: no limit).
    max_commands = 0

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        if self.refusals > 0:
            type(self).refusals -= 1
            # as Redis 6 reports a script's refused write
            raise redis.ResponseError("Error running script (call to f_0): @user_script:9: "
                                      "@user_script: 9: -OOM command not allowed when used memory "
                                      "> 'maxmemory'.")
        requests = (len(keys_and_args) - numkeys - 1) // 4
        if self.max_commands and requests * 4 > self.max_commands:
            raise redis.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        return super().evalsha(sha, numkeys, *keys_and_args)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        if transaction and self.max_commands:
            execute, limit = pipe.execute, self.max_commands

            def execute_if_it_fits(*args: Any, **kwargs: Any) -> Any:
                if len(pipe.command_stack) > limit:
                    pipe.reset()
                    raise redis.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
                return execute(*args, **kwargs)

            pipe.execute = execute_if_it_fits  # type: ignore[method-assign]
        if transaction:
            execute_now = pipe.execute

            def refuse_or_execute(*args: Any, **kwargs: Any) -> Any:
                if type(self).refusals > 0:
                    type(self).refusals -= 1
                    pipe.reset()
                    raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")
                return execute_now(*args, **kwargs)

            pipe.execute = refuse_or_execute  # type: ignore[method-assign]
        return pipe


@pytest.fixture()
def broker() -> Iterator[_Refusing]:
    _Refusing.refusals = 0
    _Refusing.max_commands = 0
    r = _Refusing()
    yield r
    r.flushall()


@pytest.fixture()
def writer(broker: _Refusing) -> Iterator[tuple[ResultWriter, list[list[Outcome]]]]:
    app = create_app(Settings(broker_url=URL))
    written: list[list[Outcome]] = []
    cond = threading.Condition()

    def on_written(batch: list[Outcome]) -> None:
        with cond:
            written.append(list(batch))
            cond.notify_all()

    w = ResultWriter(app, broker, on_written)
    w.written = (written, cond)  # type: ignore[attr-defined]
    try:
        yield w, written
    finally:
        w.close()


def _taken(broker: redis.Redis, request_id: str) -> TakenMessage:
    """A message as the take script leaves it: recorded as unacknowledged."""
    d = TakenMessage(raw=task_message(TASK_NAME, request_id, {"model": "m", "inputs": []},
                                  "infer.m").encode(), queue="infer.m", received_at=0.0, key="infer.m")
    parse_envelope(d)
    broker.hset(UNACKED_KEY, d.tag, d.unacked_entry)
    broker.zadd(UNACKED_INDEX_KEY, {d.tag: 1.0})
    return d


def _meta(broker: redis.Redis, request_id: str) -> dict[str, Any]:
    return json.loads(broker.get(f"celery-task-meta-{request_id}") or "{}")


def _write(w: ResultWriter, outcomes: list[Outcome]) -> None:
    """Hand ``outcomes`` to the writer; return once all of them are written."""
    written, cond = w.written  # type: ignore[attr-defined]
    with cond:
        target = sum(len(b) for b in written) + len(outcomes)
    for outcome in outcomes:
        w.put(outcome)
    with cond:
        assert cond.wait_for(lambda: sum(len(b) for b in written) >= target, 10), "written"


def test_results_and_acknowledgements_are_written_together(writer: Any, broker: _Refusing) -> None:
    w, written = writer
    ok, bad = _taken(broker, "ok"), _taken(broker, "bad")
    _write(w, [Outcome(ok, states.SUCCESS, {"id": "ok", "outputs": []}),
               Outcome(bad, states.FAILURE, ModelError("request bad: boom"))])
    assert sorted(o.delivery.request_id for batch in written for o in batch) == ["bad", "ok"]
    assert _meta(broker, "ok")["status"] == states.SUCCESS
    assert _meta(broker, "ok")["result"] == {"id": "ok", "outputs": []}
    failed = _meta(broker, "bad")
    assert failed["status"] == states.FAILURE
    assert failed["result"]["exc_type"] == "ModelError"
    assert failed["result"]["exc_message"] == ["request bad: boom"]
    assert broker.hlen(UNACKED_KEY) == 0 and broker.zcard(UNACKED_INDEX_KEY) == 0
    assert 0 < broker.ttl("celery-task-meta-ok") <= Settings().result_expires_s


def test_a_retry_goes_back_on_its_list_and_is_acknowledged(writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    d = _taken(broker, "again")
    _write(w, [Outcome(d, states.RETRY, ModelError("transient"), retry='{"retry": 1}')])
    assert broker.lrange("infer.m", 0, -1) == [b'{"retry": 1}']
    assert broker.hlen(UNACKED_KEY) == 0
    assert _meta(broker, "again")["status"] == states.RETRY


def test_a_retry_refused_for_memory_is_pushed_once_when_tried_again(
        writer: Any, broker: _Refusing) -> None:
    # Given a batch with a retry (a transaction: MULTI, LPUSH, the store script, EXEC) that Redis
    # refuses once
    w, _ = writer
    d, ok = _taken(broker, "again"), _taken(broker, "fine")
    _Refusing.refusals = 1
    _write(w, [Outcome(d, states.RETRY, ModelError("transient"), retry='{"retry": 1}'),
               Outcome(ok, states.SUCCESS, {"id": "fine"})])
    # Then the retry message is on its list once, and both are stored and acknowledged
    assert broker.lrange("infer.m", 0, -1) == [b'{"retry": 1}']
    assert _meta(broker, "fine")["status"] == states.SUCCESS
    assert broker.hlen(UNACKED_KEY) == 0 and broker.zcard(UNACKED_INDEX_KEY) == 0


def test_a_refused_transaction_is_tried_again_whole_and_the_budget_asked_once(
        writer: Any, broker: _Refusing) -> None:
    w, written = writer
    asked: list[int] = []
    w.before_write = lambda batch: asked.append(len(batch))
    d = _taken(broker, "patient")
    _Refusing.refusals = 2
    _write(w, [Outcome(d, states.SUCCESS, {"id": "patient"})])
    assert asked == [1]  # not once per try
    assert _meta(broker, "patient")["status"] == states.SUCCESS
    assert broker.hlen(UNACKED_KEY) == 0 and _Refusing.refusals == 0
    assert [[o.delivery.request_id for o in batch] for batch in written] == [["patient"]]


def test_a_batch_too_large_for_redis_memory_is_stored_in_parts(writer: Any, broker: _Refusing) -> None:
    # Given a Redis that refuses any transaction of more than two requests (4 commands each):
    # queued commands count towards maxmemory, so a large batch can be refused where parts fit
    w, written = writer
    asked: list[int] = []
    all_queued = threading.Event()

    def before_write(batch: list[Outcome]) -> None:
        all_queued.wait(10)  # the first batch waits until every outcome is queued
        asked.append(len(batch))

    w.before_write = before_write
    _Refusing.max_commands = 8
    deliveries = [_taken(broker, f"part-{i}") for i in range(8)]
    # When eight results are written, seven of them as one batch
    for d in deliveries:
        w.put(Outcome(d, states.SUCCESS, {"id": d.request_id}))
    all_queued.set()
    done, cond = w.written  # type: ignore[attr-defined]
    with cond:
        assert cond.wait_for(lambda: sum(len(b) for b in done) == 8, 10), "written"
    # Then every one is stored and acknowledged, the budget asked once per batch, each batch
    # reported once, whole
    assert all(_meta(broker, d.request_id)["result"] == {"id": d.request_id} for d in deliveries)
    assert broker.hlen(UNACKED_KEY) == 0 and broker.zcard(UNACKED_INDEX_KEY) == 0
    assert asked == [len(b) for b in written] and max(asked) >= 7, asked


def test_an_unencodable_result_fails_alone(writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    good, odd = _taken(broker, "good"), _taken(broker, "odd")
    _write(w, [Outcome(good, states.SUCCESS, {"id": "good"}),
               Outcome(odd, states.SUCCESS, {"id": "odd", "value": object()})])
    assert _meta(broker, "good")["status"] == states.SUCCESS
    failed = _meta(broker, "odd")
    assert failed["status"] == states.FAILURE
    assert failed["result"]["exc_message"][0].startswith("request odd: its result could not be stored")
    assert broker.hlen(UNACKED_KEY) == 0


def test_acknowledge_only_stores_nothing(writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    d = _taken(broker, "seen")
    broker.set("celery-task-meta-seen", json.dumps({"status": "SUCCESS", "result": 1}))
    _write(w, [Outcome(d, states.SUCCESS, None, store=False)])
    assert _meta(broker, "seen") == {"status": "SUCCESS", "result": 1}
    assert broker.hlen(UNACKED_KEY) == 0


def test_an_odd_unacked_key_is_reported_and_every_result_still_stored(
        writer: Any, broker: _Refusing, caplog: pytest.LogCaptureFixture) -> None:
    # Given kombu's unacked hash replaced by a value of another type (as EXEC reports one failed
    # command and runs the others, the store script reports it and does the rest)
    w, _ = writer
    one, two = _taken(broker, "one"), _taken(broker, "two")
    broker.delete(UNACKED_KEY)
    broker.set(UNACKED_KEY, "not a hash")
    _write(w, [Outcome(one, states.SUCCESS, {"id": "one"}), Outcome(two, states.SUCCESS, {"id": "two"})])
    assert _meta(broker, "one")["result"] == {"id": "one"}
    assert _meta(broker, "two")["result"] == {"id": "two"}
    assert broker.zcard(UNACKED_INDEX_KEY) == 0
    refused = [r.getMessage() for r in caplog.records if "refused by Redis" in r.getMessage()]
    # the batch's acknowledgements are one command per key: one refusal for the odd key
    assert len(refused) == 1 and "WRONGTYPE" in refused[0], refused


def test_started_states_are_one_script_call_and_survive_a_flushed_script_cache(
        writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    ids = ["s-1", 's"2\\']  # a quote and a backslash: the ID is JSON-escaped in the template
    deliveries = [_taken(broker, i) for i in ids]
    broker.script_flush()
    pipe = broker.pipeline(transaction=False)
    w.started(pipe, deliveries, "cpu@host")
    replies = pipe.execute(raise_on_error=False)
    assert isinstance(replies[0], redis.exceptions.NoScriptError)  # the caller loads it then
    w.store.load(broker)
    pipe = broker.pipeline(transaction=False)
    w.started(pipe, deliveries, "cpu@host")
    assert pipe.execute() == [[[], []]]  # no errors, no result left out
    for request_id in ids:
        meta = _meta(broker, request_id)
        assert meta["status"] == states.STARTED and meta["task_id"] == request_id
        assert meta["result"] == {"pid": os.getpid(), "hostname": "cpu@host"}
        assert meta["date_done"] is None
        assert 0 < broker.ttl(f"celery-task-meta-{request_id}") <= Settings().result_expires_s
    assert broker.hlen(UNACKED_KEY) == 2  # STARTED acknowledges nothing


def test_outcomes_gathered_by_a_thread_are_one_write_handed_over_as_it_leaves(
        writer: Any, broker: _Refusing) -> None:
    w, written = writer
    done, cond = w.written
    taken = [_taken(broker, f"g{i}") for i in range(40)]
    # Given a thread gathering a batch's outcomes (and a nested gathering inside it)
    with w.gathering():
        for d in taken[:20]:
            w.put(Outcome(d, states.SUCCESS, {"id": d.request_id, "outputs": []}))
        with w.gathering():
            for d in taken[20:]:
                w.put(Outcome(d, states.SUCCESS, {"id": d.request_id, "outputs": []}))
        # When the writer has had time to write anything put so far, Then nothing went out yet
        with cond:
            assert not cond.wait_for(lambda: written, 0.3), "written while still gathering"
        assert broker.hlen(UNACKED_KEY) == 40
    # And when the gathering ends, all 40 go out in one write, stored and acknowledged
    with cond:
        assert cond.wait_for(lambda: written, 10), "written"
    assert [len(b) for b in written] == [40]
    assert all(_meta(broker, d.request_id)["status"] == states.SUCCESS for d in taken)
    assert broker.hlen(UNACKED_KEY) == 0
    # and after it, a put goes out by itself again
    _write(w, [Outcome(_taken(broker, "alone"), states.SUCCESS, {"id": "alone", "outputs": []})])
    assert [len(b) for b in written] == [40, 1]


def test_outcomes_gathered_are_handed_over_even_when_the_gathering_raises(
        writer: Any, broker: _Refusing) -> None:
    w, written = writer
    d = _taken(broker, "raised")
    with pytest.raises(RuntimeError, match="a callback broke"):
        with w.gathering():
            w.put(Outcome(d, states.SUCCESS, {"id": "raised", "outputs": []}))
            raise RuntimeError("a callback broke")
    done, cond = w.written
    with cond:
        assert cond.wait_for(lambda: written, 10), "written"
    assert _meta(broker, "raised")["status"] == states.SUCCESS


def test_kombus_messages_are_stored_then_acknowledged_through_kombu(
        writer: Any, broker: _Refusing) -> None:
    # Given three messages Celery's consumer received (kombu's, acknowledged through it) and one
    # of the Redis lists
    w, _ = writer
    acked_with: list[bool] = []

    class _Message:
        acknowledged = False

        def __init__(self, request_id: str) -> None:
            self.request_id = request_id

        def ack(self) -> None:  # the result is stored before the acknowledgement
            acked_with.append(bool(_meta(broker, self.request_id)) or self.request_id == "k-dup")
            self.acknowledged = True

    def kombu(request_id: str) -> TakenMessage:
        d = _taken(broker, request_id)
        d.message = _Message(request_id)
        return d

    ok, failed, dup, lists = kombu("k-ok"), kombu("k-bad"), kombu("k-dup"), _taken(broker, "l-ok")
    # When their outcomes are written in one batch
    _write(w, [Outcome(ok, states.SUCCESS, {"id": "k-ok", "outputs": []}),
               Outcome(failed, states.FAILURE, ModelError("request k-bad: boom")),
               Outcome(dup, states.SUCCESS, None, store=False),
               Outcome(lists, states.SUCCESS, {"id": "l-ok", "outputs": []})])
    # Then each result is stored, each of kombu's acknowledged through kombu after its result
    assert acked_with == [True, True, True]
    assert all(d.message.acknowledged for d in (ok, failed, dup))
    assert _meta(broker, "k-ok")["status"] == states.SUCCESS
    assert _meta(broker, "k-bad")["status"] == states.FAILURE and _meta(broker, "k-dup") == {}
    # and only the lists' message left the lists' bookkeeping (kombu keeps its own)
    left = {json.loads(v)[0]["headers"]["id"] for v in broker.hvals(UNACKED_KEY)}
    assert left == {"k-ok", "k-bad", "k-dup"}


def test_a_retry_of_kombus_is_left_to_kombu_to_publish(writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    d = _taken(broker, "k-again")
    d.message = type("M", (), {"acknowledged": True})()  # acknowledged: nothing more to do
    published: list[Any] = []
    w.app = type("A", (), {"producer_or_acquire": lambda self: _Producing(published)})()
    _write(w, [Outcome(d, states.RETRY, ModelError("transient"), retry=retry_message(d, 0.5))])
    assert broker.llen("infer.m") == 0  # not pushed on the lists
    assert [options["headers"]["retries"] for _, options in published] == [1]
    assert _meta(broker, "k-again")["status"] == states.RETRY


class _Producing:
    def __init__(self, published: list[Any]) -> None:
        self.published = published

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def publish(self, body: bytes, **options: Any) -> None:
        self.published.append((body, options))


class _RecordingProducer:
    """A kombu producer that records what it would publish."""

    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []

    def publish(self, body: bytes, **options: Any) -> None:
        self.published.append({"body": body, **options})


@pytest.mark.parametrize("content_type", ["application/x-python-serialize", None, "text/plain"])
def test_an_envelope_of_any_other_content_type_is_never_published(content_type: str | None) -> None:
    from asyncinfer.worker.output.kombu_acks import publish_envelope

    envelope = json.loads(task_message(TASK_NAME, "req-9", {"model": "m", "inputs": []}, "infer.m"))
    producer = _RecordingProducer()
    publish_envelope(producer, envelope, "infer.m")  # json: published as it is
    assert producer.published[0]["content_type"] == "application/json"
    envelope["content-type"] = content_type
    with pytest.raises(ValueError, match=r"request req-9: content type .* is never sent"):
        publish_envelope(producer, envelope, "infer.m")
    assert len(producer.published) == 1

"""The pipeline alone (worker/pipeline.py): what it does with what a take hands it, against a fake
transport (a recording writer, a scripted results store) and a fake runtime (futures it keeps)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import states

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.engine.timer import TimeLimits
from asyncinfer.errors import InvalidRequest, WorkerLost
from asyncinfer.policy.deaths import WorkerDeaths
from asyncinfer.policy.policy import Policy
from asyncinfer.policy.retries import RetryPolicy
from asyncinfer.wire.messages import task_message
from asyncinfer.wire.result_json import encode_meta
from asyncinfer.worker.events import TaskEvents
from asyncinfer.worker.lifecycle import Settlement, answered_before
from asyncinfer.worker.metrics import WorkerMetrics
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.outcomes import Outcomes
from asyncinfer.worker.pipeline import Pipeline
from asyncinfer.worker.requests.holdings import SCHEDULED, Holdings
from asyncinfer.worker.requests.taken import TakenMessage

pytestmark = pytest.mark.timeout(30)

QUEUE = "infer.m"
APP = create_app(Settings(broker_url="redis://127.0.0.1:1/0"))


class Results:
    """The results' Redis, as the pipeline reads it: stored metas by key."""

    def __init__(self, stored: dict[str, Any] | None = None) -> None:
        self.stored = stored or {}

    def mget(self, keys: list[str]) -> list[Any]:
        return [self.stored.get(k) for k in keys]


class Writer:
    """The transport's writing side: records outcomes and STARTED states."""

    def __init__(self, results: Results) -> None:
        self.results = results
        self.outcomes: list[Outcome] = []
        self.started: list[str] = []
        self.before_write: Any = None
        self.on_written: Any = None

    def put(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        yield

    def store_started(self, deliveries: list[Any], hostname: str) -> None:
        self.started += [d.request_id for d in deliveries]

    def answered_before(self, backend: Any, deliveries: list[Any]) -> dict[str, str]:
        return answered_before(backend, [d.request_id for d in deliveries], self.results)

    def state_of(self, request_id: str) -> tuple[str, Any]:
        [found] = [(o.state, o.result) for o in self.outcomes if o.delivery.request_id == request_id]
        return found


class Timer:
    def __init__(self) -> None:
        self.later: list[float] = []

    def call_later(self, delay_s: float, fn: Any) -> None:
        self.later.append(delay_s)


class Runtime:
    """Keeps what is submitted, with its future; runs nothing."""

    def __init__(self) -> None:
        self.submitted: dict[str, dict[str, Any]] = {}
        self.on_device: set[str] = set()
        self.timer = Timer()
        self.metrics = WorkerMetrics()

    def runners(self) -> list[Any]:
        return []

    def withdraw(self, request_ids: set[str]) -> set[str]:
        """Those submitted and not yet on the device (all of them, here), withdrawn."""
        gone = {i for i in request_ids if i in self.submitted and i not in self.on_device}
        for i in gone:
            del self.submitted[i]
        return gone

    def submit(self, request_id: str, kwargs: Any, **options: Any) -> tuple[Any, Future[Any]]:
        if kwargs.get("model") != "m":
            raise InvalidRequest(f"request {request_id}: model {kwargs.get('model')!r} is unknown")
        self.submitted[request_id] = options
        return request_id, Future()


def _message(request_id: str, task: str = TASK_NAME, *, model: str = "m",
             **headers: Any) -> bytes:
    envelope = json.loads(task_message(task, request_id, {"model": model, "inputs": []}, QUEUE))
    envelope["headers"].update(headers)
    return json.dumps(envelope).encode()


def _pipeline(stored: dict[str, Any] | None = None, max_worker_deaths: int = 2
              ) -> tuple[Pipeline, Writer, Runtime, Holdings]:
    policy = Policy(retry=RetryPolicy(max_retries=0), time_limits=TimeLimits(), max_in_flight=64,
                    deaths=WorkerDeaths(max_worker_deaths))
    writer, runtime, holdings = Writer(Results(stored)), Runtime(), Holdings(64)
    settlement = Settlement("w@h", "cpu", policy)
    outcomes = Outcomes(writer, settlement, holdings, response=lambda *a: {})  # type: ignore[arg-type]
    pipeline = Pipeline(APP, runtime, policy, hostname="w@h", holdings=holdings,  # type: ignore[arg-type]
                        outcomes=outcomes, writer=writer,  # type: ignore[arg-type]
                        events=TaskEvents(APP, "w@h", enabled=False),
                        stopping=lambda: False)
    return pipeline, writer, runtime, holdings


def _take(*messages: tuple[bytes, int]) -> list[tuple[str, Any, bool, bool, int]]:
    """What the take script hands over: (list, message, recorded, started, deaths)."""
    return [(QUEUE, raw, not raw.startswith(b"{not"), False, deaths) for raw, deaths in messages]


def test_good_requests_go_to_the_device_and_a_malformed_one_fails_alone() -> None:
    pipeline, writer, runtime, holdings = _pipeline()
    pipeline.took(_take((_message("a"), 0), (b'{not json "id": "b"', 0), (_message("c"), 0)))
    assert sorted(runtime.submitted) == ["a", "c"]
    assert writer.started == ["a", "c"]  # STARTED before they run (the take stored none)
    [malformed] = writer.outcomes
    assert malformed.state == states.FAILURE and not malformed.delivery.tag
    assert holdings.in_flight == 3  # held until written
    counts, _ = runtime.metrics.stats.take()  # each message's time in Redis, from its sent_at
    assert counts["m"]["redis_wait_count"] == 2 and counts["m"]["redis_wait_ns"] >= 0


def test_each_rule_answers_its_requests_and_the_rest_go_on() -> None:
    later = (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat()
    pipeline, writer, runtime, holdings = _pipeline()
    pipeline.took(_take((_message("ok"), 0), (_message("later", eta=later), 0),
                        (_message("other", task="celery.map"), 0),
                        (_message("unknown", model="nope"), 0),
                        (_message("killer", redelivered=True), 2),
                        (_message("survivor", redelivered=True), 1)))
    assert sorted(runtime.submitted) == ["ok", "survivor"]
    assert runtime.submitted["survivor"]["alone"] is True  # a death seen: a batch of its own
    assert runtime.submitted["ok"]["alone"] is False
    assert runtime.timer.later and 29 < runtime.timer.later[0] <= 30.5
    assert [h.state for h in holdings.held() if h.delivery.request_id == "later"] == [SCHEDULED]
    state, error = writer.state_of("other")
    assert state == states.FAILURE and "only asyncinfer.infer is served" in str(error)
    state, error = writer.state_of("unknown")
    assert state == states.FAILURE and "model 'nope' is unknown" in str(error)
    state, error = writer.state_of("killer")
    assert state == states.FAILURE and isinstance(error, WorkerLost) and "died 2 times" in str(error)


def test_a_redelivered_request_already_answered_is_acknowledged_not_run() -> None:
    meta = encode_meta(APP.backend, {"status": states.SUCCESS, "result": {}, "task_id": "done"})
    pipeline, writer, runtime, _ = _pipeline({APP.backend.get_key_for_task("done"): meta})
    pipeline.took(_take((_message("done", redelivered=True), 0),
                        (_message("again", redelivered=True), 0)))
    assert list(runtime.submitted) == ["again"]
    [ack] = writer.outcomes
    assert ack.delivery.request_id == "done" and ack.store is False and ack.state == states.SUCCESS


def test_what_went_to_another_worker_is_given_up_unless_it_is_on_the_device() -> None:
    later = (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat()
    pipeline, writer, runtime, holdings = _pipeline()
    pipeline.took(_take((_message("waiting"), 0), (_message("running"), 0),
                        (_message("retrying", eta=later), 0), (_message("kept"), 0)))
    runtime.on_device.add("running")
    tags = {h.delivery.request_id: h.delivery.tag for h in holdings.held()}
    # When the leases of all but "kept" are found with another worker
    given_up = pipeline.forget([tags["waiting"], tags["running"], tags["retrying"]])
    # Then what had not started is given up, unanswered; what is on the device runs on
    assert given_up == 2
    assert sorted(h.delivery.request_id for h in holdings.held()) == ["kept", "running"]
    assert sorted(runtime.submitted) == ["kept", "running"]
    assert writer.outcomes == []  # nothing written or acknowledged for them here
    assert pipeline.forget([tags["waiting"]]) == 0  # once


def test_a_message_kombu_delivered_that_names_no_request_is_still_acknowledged() -> None:
    # Given a message Celery's consumer received whose text is no envelope and names no request
    # (it cannot be answered, but kombu holds it unacknowledged)
    pipeline, writer, runtime, holdings = _pipeline()
    kombu_message = object()
    pipeline.received([TakenMessage(raw=b"message of infer.m: ValueError: no body", queue=QUEUE,
                                    message=kombu_message)])
    # Then it is acknowledged (through kombu, by the writer) with nothing stored, not left held by
    # kombu for ever
    [ack] = writer.outcomes
    assert ack.delivery.message is kombu_message and ack.store is False
    assert runtime.submitted == {}

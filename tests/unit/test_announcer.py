"""A worker's start and stop around the model catalogue, in process: the first announcement is
made before anything is taken (retried until Redis takes it), a running announcer is never
restarted (that would withdraw the entry), the fast consumer starts only once Celery says the
worker is ready, and a stop withdraws before the consumer gives its requests back."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
import redis
from celery import signals

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.config.settings import Settings
from asyncinfer.worker import announcer
from asyncinfer.worker.step import FastConsumerStep
from asyncinfer.worker.worker import Worker, attach

MODELS = [{"name": "identity", "versions": ["1"]}]


class Refusing(Catalogue):
    """A catalogue whose Redis refuses the first ``refusals`` announcements."""

    def __init__(self, client: Any, refusals: int) -> None:
        super().__init__(client, ttl_s=15)
        self.refusals = refusals
        self.tries = 0

    def announce(self, *args: Any, **kwargs: Any) -> None:
        self.tries += 1
        if self.tries <= self.refusals:
            raise redis.ResponseError("MISCONF Errors writing to the AOF file")
        super().announce(*args, **kwargs)


@pytest.fixture()
def r() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis()
    yield client
    client.close()


def test_the_first_announcement_is_made_before_start_returns_even_if_redis_refuses_at_first(
        r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(announcer.Announcer, "first_retry_s", (0.001, 0.002))
    catalogue = Refusing(r, refusals=3)
    one = announcer.Announcer(catalogue, "w@host", lambda: MODELS, device="cpu").start()
    try:
        # Then start() returned only once Redis took it: the model is live on that worker
        assert catalogue.tries == 4
        assert [h.worker for h in Catalogue(r).read()["identity"].hosts] == ["w@host"]
    finally:
        one.stop()
    assert Catalogue(r).read()["identity"].hosts == ()  # withdrawn, still known


def _worker(announcing: Any = None, name: str = "w@host") -> Worker:
    """A device worker (no Celery worker, no device) whose announcer is ``announcing``."""
    worker = Worker(SimpleNamespace(), Settings.from_env(), name)  # type: ignore[arg-type]
    worker.announcer = announcing
    return worker


def test_a_running_announcer_is_kept_not_restarted() -> None:
    withdrawn: list[str] = []
    running = SimpleNamespace(stop=lambda: withdrawn.append("withdrawn"))
    worker = _worker(running)
    again = worker.announce()
    assert again is running and withdrawn == []  # no gap in which the model looks unserved
    worker.withdraw()
    assert withdrawn == ["withdrawn"] and worker.announcer is None


class Consumer:
    """What Celery sends ``worker_ready`` from: a consumer, its worker as ``controller``."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller


def _step(order: list[str]) -> FastConsumerStep:
    step = FastConsumerStep.__new__(FastConsumerStep)  # without a Celery worker to take queues from
    step.queues, step.consumer, step._worker = ["infer.identity"], None, None
    step._start_consumer = lambda worker: order.append(f"consumer started for {worker.name}")  # type: ignore[method-assign]
    step._check_reachable = lambda worker: None  # type: ignore[method-assign]
    return step


def test_the_fast_consumer_starts_only_once_its_worker_is_ready() -> None:
    order: list[str] = []
    step = _step(order)
    worker = SimpleNamespace(name="w", app=SimpleNamespace())
    other = SimpleNamespace(name="other", app=SimpleNamespace())
    step.start(worker)
    try:
        assert order == []  # the blueprint started it: nothing is taken yet
        signals.worker_ready.send(sender=Consumer(other))
        assert order == []  # another worker of this process became ready
        signals.worker_ready.send(sender=Consumer(worker))
        assert order == ["consumer started for w"]
        signals.worker_ready.send(sender=Consumer(worker))
        assert order == ["consumer started for w"]  # once
    finally:
        step.stop(worker)


def test_a_stop_withdraws_the_models_before_the_consumer_gives_requests_back() -> None:
    order: list[str] = []
    app = SimpleNamespace()
    attach(app, _worker(SimpleNamespace(stop=lambda: order.append("withdraw"))))  # type: ignore[arg-type]
    step = _step(order)
    step.consumer = SimpleNamespace(stop=lambda: order.append("give back"))
    step.stop(SimpleNamespace(name="w", app=app))
    assert order == ["withdraw", "give back"]


def test_a_clean_stop_withdraws_when_it_begins() -> None:
    # worker_shutting_down: sent by Celery's signal handler before the blueprint stops anything
    from asyncinfer.worker.bootstrap import withdraw_when_stopping

    order: list[str] = []
    worker = _worker(SimpleNamespace(stop=lambda: order.append("withdraw")))
    receiver = withdraw_when_stopping(worker)
    try:
        signals.worker_shutting_down.send(sender="other@host", sig="TERM", how="Warm", exitcode=0)
        assert order == []  # another worker of this process stops
        signals.worker_shutting_down.send(sender="w@host", sig="TERM", how="Warm", exitcode=0)
        assert order == ["withdraw"]
    finally:
        signals.worker_shutting_down.disconnect(receiver)

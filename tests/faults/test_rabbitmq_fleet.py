"""Faults of a fleet on RabbitMQ, at the shipped defaults: a busy worker killed with SIGKILL, a
worker stopped with SIGTERM while it holds requests, a request retried.

On RabbitMQ a device worker's infer.* messages go from Celery's consumer to the pipeline (the kombu
intake, asyncinfer/worker/consumers/kombu_intake.py): each is acknowledged through kombu once its
result is stored; what a worker holds when it stops or dies is given back by RabbitMQ when the
connection closes (marked redelivered), and a redelivered request whose result is already stored
is acknowledged without running again.

Runs against the RabbitMQ at 127.0.0.1:5672 when one listens there, and skips otherwise. The models
are named after the run, so their queues are the run's own; they are deleted at the end. Results,
and the models' records of what ran, go to a Redis database of the test's own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.errors import TransientModelError
from tests.support.amqp import (
    AMQP_HOST,
    AMQP_PORT,
    AMQP_URL,
    model_of_run,
    node_lock,
    rabbitmq_listens,
)
from tests.support.databases import RedisDatabase, gated_broker, gated_executions
from tests.support.paced import index_input, kill_during_paced_stream, started_by
from tests.support.processes import launch_worker, start_worker
from tests.support.waiting import wait_for

RUN = uuid.uuid4().hex[:8]
GATED, FLAKY = "tests.support.models:Gated", "tests.support.models:Flaky"


@pytest.fixture(autouse=True)
def _rabbitmq() -> Iterator[None]:
    """Skip without a RabbitMQ; share the node's lock (no alarm of another test meets this)."""
    if not rabbitmq_listens():
        pytest.skip(f"no RabbitMQ listening on {AMQP_HOST}:{AMQP_PORT}")
    with node_lock(shared=True):
        yield


@pytest.fixture()
def model(request: pytest.FixtureRequest) -> Iterator[str]:
    """A model name of this test and run (its queue is deleted at the end)."""
    with model_of_run(request.param, RUN) as name:
        yield name


def _on_rabbitmq(results: str, model: str, factory: str, **env: str) -> dict[str, str]:
    """A worker's environment: RabbitMQ the broker, ``results`` the result backend, ``model``
    made by ``factory``; nothing else but ``env`` set (the shipped defaults)."""
    return {"ASYNCINFER_BROKER_URL": AMQP_URL, "ASYNCINFER_RESULT_BACKEND": results,
            "ASYNCINFER_MODEL_FACTORIES": f"{model}={factory}", **env}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["gated"], indirect=True)
def test_kill_9_of_a_busy_worker_loses_none(redis_db: RedisDatabase, model: str, tmp_path) -> None:
    # Given two workers on one model queue sharing a paced stream (40 requests a second)
    prefix, r, env = gated_broker(redis_db.url, f"rabbit-kill-{RUN}")
    env.pop("ASYNCINFER_VISIBILITY_TIMEOUT_S")  # Redis' setting; RabbitMQ's defaults here
    env["ASYNCINFER_MODEL_FACTORIES"] = f"{model}={GATED}"
    try:
        # When one of them is killed with SIGKILL every 4 s while it holds requests (a batch
        # blocked on its device, more waiting behind it) and replaced
        counts = kill_during_paced_stream(redis_db.url, r, prefix, env, tmp_path, rate_per_s=40,
                                          duration_s=10, kill_every_s=4, model=model,
                                          broker_url=AMQP_URL, hold_s=0.5)
        print("RabbitMQ, kill -9 of a busy worker:", counts)
        # Then every request sent is answered with its own value
        assert counts["kills"] >= 2 and counts["sent"] == 400
        assert counts["lost"] == 0 and counts["answered"] == 400, counts
        # And what a victim held went back to RabbitMQ and was answered by another worker
        assert counts["held"] >= counts["kills"], counts
        # And only what a victim held when it was killed may have run twice (at least once)
        assert counts["twice_unheld"] == 0, counts
    finally:
        r.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["gated"], indirect=True)
def test_sigterm_of_a_worker_holding_requests_answers_each_once(redis_db: RedisDatabase,
                                                                model: str, tmp_path) -> None:
    # Given two workers on one model queue, the "gated" model recording what each runs apart,
    # and the first one's gate closed: its first batch blocks on its device
    url, r = redis_db.url, redis_db.client
    stopped, other = f"term-a-{RUN}", f"term-b-{RUN}"
    r.set(f"{stopped}:gate", "closed")
    env = _on_rabbitmq(url, model, GATED, GATED_REDIS_URL=url)
    first = launch_worker(url, tmp_path / "a.log", "--device", "cpu", "--models", model,
                          "--hostname", f"{stopped}@%h", GATED_PREFIX=stopped, **env)
    second = launch_worker(url, tmp_path / "b.log", "--device", "cpu", "--models", model,
                           "--hostname", f"{other}@%h", GATED_PREFIX=other, **env)
    client = Client(broker_url=AMQP_URL, result_backend=url)
    futures: list = []
    try:
        first.wait_ready()
        second.wait_ready()
        futures += [client.submit(model, index_input(i)) for i in range(20)]

        def held_by_first() -> list[str]:
            waiting = [f.id for f in futures if not f.done()]
            held = [i for i, who in started_by(r, waiting).items() if who.startswith(stopped)]
            return held if waiting and len(held) == len(waiting) else []

        # the second answers its share; what is left, the first holds (STARTED by it)
        held = wait_for(held_by_first, 30, "the first worker holding what is not answered",
                        poll_s=0.05)
        assert r.exists(f"{stopped}:blocked")

        # When requests keep coming (20 a second) and the first is stopped with SIGTERM, its
        # gate opening a second later
        submitted_at: dict[str, float] = {}

        def stream() -> None:
            for i in range(20, 80):
                futures.append(client.submit(model, index_input(i)))
                submitted_at[futures[-1].id] = time.monotonic()
                time.sleep(0.05)

        sender = threading.Thread(target=stream)
        sender.start()
        time.sleep(0.5)
        os.kill(first.pid, signal.SIGTERM)
        term_at = time.monotonic()
        time.sleep(1.0)
        r.delete(f"{stopped}:gate")
        first.process.wait(timeout=60)
        exited_at = time.monotonic()
        sender.join()
        last_sent = time.monotonic()

        # Then every request is answered with its own value, and ran exactly once
        answers = [f.result(timeout=60) for f in futures]
        to_last_answer_s = time.monotonic() - last_sent
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(80)]
        ran = gated_executions(r, stopped)
        for i, n in gated_executions(r, other).items():
            ran[i] = ran.get(i, 0) + n
        by_first = {a.id for a in answers if str(a.parameters["worker"]).startswith(stopped)}
        while_stopping = {i for i, t in submitted_at.items() if term_at < t < exited_at}
        counts = {"sent": len(futures), "answered": len(answers), "lost": 80 - len(answers),
                  "ran_twice": sum(1 for n in ran.values() if n > 1), "held_at_sigterm": len(held),
                  "finished_by_stopped": len(by_first), "answered_by_other": 80 - len(by_first),
                  "sent_while_stopping": len(while_stopping),
                  "of_them_by_stopped": len(while_stopping & by_first),
                  "stop_s": round(exited_at - term_at, 2),
                  "to_last_answer_s": round(to_last_answer_s, 2)}
        print("RabbitMQ, SIGTERM of a worker holding requests:", counts)
        assert ran == {i: 1 for i in range(80)}, counts
        # (what the first held when stopped, it finished before its connection closed, or gave
        # back to be answered by the second)
        assert held and all(f.done() for f in futures if f.id in held)
        # And the stopped worker left cleanly: status 0, every acknowledgement went through
        log = first.log()
        assert first.process.returncode == 0, log[-3000:]
        assert "could not acknowledge" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        r.delete(f"{stopped}:gate")
        client.close()
        first.stop()
        second.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["flaky"], indirect=True)
def test_a_retried_request_succeeds_after_its_retries(redis_db: RedisDatabase, model: str,
                                                     tmp_path) -> None:
    # Given a worker of the "flaky" model (each request fails the number of times it says)
    url, r = redis_db.url, redis_db.client
    prefix = f"rabbit-flaky-{RUN}"
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", model,
                          "--hostname", f"{prefix}@%h",
                          **_on_rabbitmq(url, model, FLAKY, FLAKY_REDIS_URL=url, FLAKY_PREFIX=prefix))
    client = Client(broker_url=AMQP_URL, result_backend=url)
    try:
        # When one request fails twice, and another more often than the retries allow (3)
        twice = client.submit(model, np.array([[1.0, 2.0]], np.float64))
        always = client.submit(model, np.array([[2.0, 10.0]], np.float64))
        # Then the first succeeds on its third run, its retries published through kombu
        assert twice.result(timeout=60)["output"].tolist() == [[1.0, 2.0]]
        assert r.llen(f"{prefix}:runs:1") == 3
        # And the second fails as a transient failure after 1 + 3 runs
        with pytest.raises(TransientModelError, match=rf"request {always.id}: model '{model}'"):
            always.result(timeout=60)
        assert r.llen(f"{prefix}:runs:2") == 4
        log = worker.log()
        assert "could not be published" not in log and "could not acknowledge" not in log, log
    finally:
        client.close()
        worker.stop()

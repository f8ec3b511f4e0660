"""A streaming request whose worker is killed mid-stream, through the gateway: the caller is told
(gRPC: a response with ``error_message``, not final; SSE: an ``event: interrupted``), and the
parts go on from the next one when the worker, started again on the same host, takes the request
back — each part once, in order. A database of its own: only these workers host echo-stream; the
worker and the gateway are started side by side once, and shared by the module's tests."""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from tests.support.databases import RedisDatabases
from tests.support.processes import (
    GatewayProcess,
    WorkerProcess,
    launch_gateway,
    launch_worker,
    ready_together,
    stop_together,
)

pytestmark = pytest.mark.timeout(180)

WORDS = [f"w{i}" for i in range(10)]
#: Parts in all: enough to outlast the kill (10 ms a step), few enough to end soon after.
PARTS = 600
#: Parts read before the kill.
BEFORE_KILL = 5


class Fleet:
    """A gateway and one echo-stream worker (killed and started again by each test) on a
    database of their own, shared by the module's tests: each test leaves the worker it started
    again serving, for the next."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        self.url, self.tmp_path, self.starts = url, tmp_path, 0
        self.worker = self.launch_worker()
        self.gateway: GatewayProcess = launch_gateway(url, tmp_path / "gateway.log")
        ready_together([self.worker, self.gateway])  # started side by side; on failure stopped
        self.results = Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": url}))

    def launch_worker(self) -> WorkerProcess:
        self.starts += 1
        return launch_worker(self.url, self.tmp_path / f"worker-{self.starts}.log", "--device",
                             "cpu", "--models", "echo-stream", "--hostname", "interrupted@%h")

    def kill_and_restart_worker(self) -> None:
        """SIGKILL the worker (by its PID), then start it again on the same host: it takes its
        predecessor's requests back at once."""
        self.worker.process.send_signal(signal.SIGKILL)
        self.worker.process.wait()
        self.worker.stop()  # closes its log
        self.worker = self.launch_worker().wait_ready()

    def restore(self) -> None:
        """A serving worker again, if a test left its worker dead (it failed between the kill
        and the start)."""
        if self.worker.process.poll() is not None:
            self.worker.stop()
            self.worker = self.launch_worker().wait_ready()

    def close(self) -> None:
        self.results.close()
        stop_together([self.gateway, self.worker])


@pytest.fixture(scope="module")
def shared_fleet(redis_databases: RedisDatabases,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with redis_databases.take(__name__) as db:
        f = Fleet(db.url, tmp_path_factory.mktemp("stream-interrupted"))
        try:
            yield f
        finally:
            f.close()


@pytest.fixture()
def fleet(shared_fleet: Fleet) -> Fleet:
    shared_fleet.restore()
    return shared_fleet


def _expected(count: int) -> list[str]:
    return [WORDS[i % len(WORDS)] for i in range(count)]


def test_grpc_caller_is_told_and_the_parts_go_on_each_once(fleet: Fleet) -> None:
    request_id = f"gi-{uuid.uuid4().hex}"
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(fleet.gateway.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([" ".join(WORDS).encode()], dtype=np.object_))
        count = grpcclient.InferInput("max_tokens", [1], "INT32")
        count.set_data_from_numpy(np.array([PARTS], np.int32))
        client.async_stream_infer("echo-stream", [text, count], request_id=request_id,
                                  enable_empty_final_response=True,
                                  parameters={"idempotency_key": request_id})
        words, errors, finals = [], [], []
        while len(words) < BEFORE_KILL:
            result, error = responses.get(timeout=60)
            assert error is None, error
            words.append(result.as_numpy("text_output").reshape(-1)[0].decode())
        fleet.kill_and_restart_worker()
        while not finals:
            result, error = responses.get(timeout=90)
            if error is not None:
                errors.append(str(error.message()))
                continue
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals.append(response)
            else:
                words.append(result.as_numpy("text_output").reshape(-1)[0].decode())
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"request {request_id}: interrupted after part ")
    assert "stopped mid-stream" in errors[0] and "resumes with the next part" in errors[0]
    assert words == _expected(PARTS)  # each part once, in order, across both runs
    assert finals[0].id == request_id
    assert fleet.results.app.AsyncResult(request_id).state == "SUCCESS"


def test_sse_caller_gets_an_interrupted_event_and_the_parts_go_on(fleet: Fleet) -> None:
    request_id = f"si-{uuid.uuid4().hex}"
    enough = threading.Event()
    killed = threading.Event()

    async def read() -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        kind, data = "message", ""
        body = {"id": request_id, "idempotency_key": request_id, "text_input": " ".join(WORDS),
                "max_tokens": PARTS}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as session:
            url = f"http://{fleet.gateway.http_url}/v2/models/echo-stream/generate_stream"
            async with session.post(url, json=body) as response:
                assert response.status == 200
                async for raw in response.content:
                    line = raw.decode().rstrip("\r\n")
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif not line and data:
                        events.append((kind, json.loads(data)))
                        kind, data = "message", ""
                        if len(events) == BEFORE_KILL:
                            enough.set()
                            # hold the reading until the worker is gone (off the loop)
                            await asyncio.get_running_loop().run_in_executor(None, killed.wait, 120)
        return events

    found: list[Any] = []
    reader = threading.Thread(target=lambda: found.append(asyncio.run(read())), daemon=True)
    reader.start()
    try:
        assert enough.wait(60)
        fleet.kill_and_restart_worker()
    finally:
        killed.set()
    reader.join(150)
    assert found, "the SSE reader did not finish"
    events = found[0]
    interrupted = [data for kind, data in events if kind == "interrupted"]
    assert len(interrupted) == 1
    assert interrupted[0]["id"] == request_id
    assert interrupted[0]["interrupted"].startswith(f"request {request_id}: interrupted after part ")
    parts = [data for kind, data in events if kind == "message"]
    assert not any("error" in p for p in parts)
    assert [p["text_output"] for p in parts] == _expected(PARTS)
    assert fleet.results.app.AsyncResult(request_id).state == "SUCCESS"

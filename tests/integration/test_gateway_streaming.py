"""Streaming through the gateway: a real gateway process in front of a real worker hosting
``echo-stream`` (one word of ``text_input`` per part, ``max_tokens`` words in all) and ``square``
(Triton's ``square_int32``: ``IN`` responses, none at all for 0), driven by
tritonclient.grpc's streaming client (ModelStreamInfer) and by an aiohttp reader of
``generate_stream``'s server-sent events; the requests' stored states read from Redis."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from asyncinfer.client import Client
from asyncinfer.wire.stream import FINAL, decode_entry, stream_key
from tests.support.processes import (
    ROOT,
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    start_gateway,
    start_worker,
)
from tests.support.stream_models import SQUARE_FACTORY
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

#: A model whose input declares Triton's ``format`` (NCHW).
CHANNEL_MEANS_FACTORY = "channel-means=tests.support.models:ChannelMeans"

#: The words ``text_input`` holds; part ``i`` (0-based) is ``WORDS[i % 10]``.
WORDS = [f"w{i}" for i in range(10)]
#: Parts enough for a stream that outlives anything the test does meanwhile (never let run out).
ENDLESS = 100_000


@pytest.fixture(scope="module")
def stream_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[WorkerProcess]:
    """A worker hosting echo-stream and square (decoupled), identity and channel-means (not;
    channel-means declares its input's format)."""
    proc = start_worker(redis_url, tmp_path_factory.mktemp("stream-worker") / "worker.log",
                        "--device", "cpu", "--models", "echo-stream,identity,square,channel-means",
                        "--concurrency", "8", "--hostname", "stream-cpu@%h",
                        ASYNCINFER_MODEL_FACTORIES=f"{TEST_FACTORIES},{SQUARE_FACTORY},"
                                                   f"{CHANNEL_MEANS_FACTORY}")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(redis_url: str, stream_worker: WorkerProcess,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = start_gateway(redis_url, tmp_path_factory.mktemp("stream-gateway") / "gateway.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def results(redis_url: str) -> Iterator[Client]:
    """A client to read the requests' stored states and streams."""
    c = Client(broker_url=redis_url)
    try:
        yield c
    finally:
        c.close()


class Stream:
    """A tritonclient.grpc stream whose responses are queued as they arrive; ``first_states``
    holds each request's stored state when its first part arrived."""

    def __init__(self, gateway: GatewayProcess, results: Client) -> None:
        self.client = grpcclient.InferenceServerClient(gateway.grpc_url)
        self.results = results
        self.responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.first_states: dict[str, str] = {}
        self.client.start_stream(callback=self._arrived)

    def _arrived(self, result: Any, error: Any) -> None:
        if result is not None:
            request_id = result.get_response().id
            if request_id not in self.first_states:
                self.first_states[request_id] = self.results.app.AsyncResult(request_id).state
        self.responses.put((result, error))

    def send(self, request_id: str, text: str, max_tokens: int | None = None,
             model: str = "echo-stream") -> None:
        x = grpcclient.InferInput("text_input", [1], "BYTES")
        x.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs = [x]
        if max_tokens is not None:
            n = grpcclient.InferInput("max_tokens", [1], "INT32")
            n.set_data_from_numpy(np.array([max_tokens], np.int32))
            inputs.append(n)
        # the id is a label: the idempotency key makes it the request ID too (to look it up)
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       enable_empty_final_response=True,
                                       parameters={"idempotency_key": request_id})

    def take(self) -> tuple[str, str, bool, list[str] | None]:
        """The next response: (id, error or '', final flag, words or None)."""
        result, error = self.responses.get(timeout=60)
        if error is not None:
            return "", str(error.message()), False, None
        response = result.get_response()
        words = result.as_numpy("text_output")
        return (response.id, "", response.parameters["triton_final_response"].bool_param,
                None if words is None else [w.decode() for w in words.reshape(-1)])

    def until_final(self, request_ids: set[str]) -> list[tuple[str, str, bool, list[str] | None]]:
        """Every response until each of ``request_ids`` has had its final one."""
        got, open_ids = [], set(request_ids)
        while open_ids:
            one = self.take()
            got.append(one)
            if one[2]:
                open_ids.discard(one[0])
        return got

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture()
def grpc_stream(gateway: GatewayProcess, results: Client) -> Iterator[Stream]:
    s = Stream(gateway, results)
    try:
        yield s
    finally:
        s.close(cancel=True)


def _expected(count: int) -> list[str]:
    return [WORDS[i % len(WORDS)] for i in range(count)]


def _final_entry(results: Client, request_id: str) -> Any:
    """The ``final`` entry of ``request_id``'s stream, or None while it has none."""
    entries = results.app.backend.client.xrevrange(stream_key(request_id), count=1)
    if not entries:
        return None
    entry = decode_entry(*entries[0])
    return entry if entry.kind == FINAL else None


def _settled(results: Client, request_id: str) -> str:
    return wait_for(lambda: (s := results.app.AsyncResult(request_id).state)
                    in ("SUCCESS", "FAILURE", "REVOKED") and s, 60, f"request {request_id} settled")


# -- gRPC ModelStreamInfer -----------------------------------------------------------------------

def test_grpc_parts_arrive_as_made_in_order_each_once_then_the_final_flag(grpc_stream, results) -> None:
    request_id = f"gs-order-{uuid.uuid4().hex}"
    # 400 parts: the first reaches the caller while the worker is still making the others
    grpc_stream.send(request_id, " ".join(WORDS), max_tokens=400)
    got = grpc_stream.until_final({request_id})
    assert grpc_stream.first_states[request_id] not in ("SUCCESS", "FAILURE", "REVOKED")
    assert [g[1] for g in got] == [""] * 401
    assert all(g[0] == request_id for g in got)
    assert [g[3][0] for g in got[:-1]] == _expected(400)  # in order, each once
    assert [g[2] for g in got] == [False] * 400 + [True]  # only the empty last one is final
    assert got[-1][3] is None
    # the request's one answer: the parts joined
    assert _settled(results, request_id) == "SUCCESS"
    answer = results.result(request_id, timeout_s=30)
    joined = answer.as_numpy("text_output").reshape(-1)[0]
    assert (joined.decode() if isinstance(joined, bytes) else joined) == " ".join(_expected(400))


def test_grpc_two_requests_on_one_stream_each_get_their_own_parts(grpc_stream) -> None:
    a, b = f"gs-a-{uuid.uuid4().hex}", f"gs-b-{uuid.uuid4().hex}"
    grpc_stream.send(a, "a0 a1 a2 a3 a4", max_tokens=30)
    grpc_stream.send(b, "b0 b1 b2", max_tokens=20)
    got = grpc_stream.until_final({a, b})
    assert {g[0] for g in got} == {a, b} and all(g[1] == "" for g in got)
    for request_id, words, count in ((a, "a0 a1 a2 a3 a4", 30), (b, "b0 b1 b2", 20)):
        mine = [g for g in got if g[0] == request_id]
        expected = [words.split()[i % len(words.split())] for i in range(count)]
        assert [g[3][0] for g in mine[:-1]] == expected
        assert [g[2] for g in mine] == [False] * count + [True]


def test_grpc_a_model_that_does_not_stream_answers_once_flagged_final(grpc_stream) -> None:
    request_id = f"gs-identity-{uuid.uuid4().hex}"
    x = grpcclient.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.array([[1.5, 2.0, 3.0]], np.float32))
    grpc_stream.client.async_stream_infer("identity", [x], request_id=request_id,
                                          enable_empty_final_response=True)
    result, error = grpc_stream.responses.get(timeout=60)
    assert error is None
    response = result.get_response()
    assert response.id == request_id and response.parameters["triton_final_response"].bool_param
    np.testing.assert_array_equal(result.as_numpy("x"), [[1.5, 2.0, 3.0]])
    grpc_stream.client.stop_stream()  # waits for the call's end: nothing more came
    assert grpc_stream.responses.empty()


def test_grpc_an_error_names_the_request_and_the_stream_goes_on(grpc_stream) -> None:
    bad, good = f"gs-bad-{uuid.uuid4().hex}", f"gs-good-{uuid.uuid4().hex}"
    n = grpcclient.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([3], np.int32))
    grpc_stream.client.async_stream_infer("echo-stream", [n], request_id=bad)
    _, error, _, _ = grpc_stream.take()
    assert f"request {bad}" in error and "needs input 'text_input'" in error
    grpc_stream.send(good, "still here", max_tokens=2)
    got = grpc_stream.until_final({good})
    assert [g[3] for g in got] == [["still"], ["here"], None]


def test_grpc_cancelling_the_stream_revokes_its_running_request(grpc_stream, results) -> None:
    request_id = f"gs-cancel-{uuid.uuid4().hex}"
    grpc_stream.send(request_id, " ".join(WORDS), max_tokens=ENDLESS)
    first = [grpc_stream.take() for _ in range(3)]
    assert [g[3][0] for g in first] == _expected(3)
    grpc_stream.close(cancel=True)
    assert _settled(results, request_id) == "REVOKED"
    final = wait_for(lambda: _final_entry(results, request_id), 30, "the stream's final entry")
    assert final.status == "REVOKED" and 3 <= int(final.fields["parts"]) < ENDLESS


# -- a decoupled request that ends with no response (Triton's empty final response) -------------

def _square_in(n: int) -> grpcclient.InferInput:
    x = grpcclient.InferInput("IN", [1], "INT32")
    x.set_data_from_numpy(np.array([n], np.int32))
    return x


def _all_responses(stream: Stream) -> list[tuple[str, str, bool, list[int] | None]]:
    """Every response of ``stream`` once its call has ended: (id, error or '', final flag, OUT
    or None)."""
    stream.client.stop_stream()  # closes the sending side and waits for the call's end
    got = []
    while not stream.responses.empty():
        result, error = stream.responses.get_nowait()
        if error is not None:
            got.append(("", str(error.message()), False, None))
            continue
        response = result.get_response()
        out = result.as_numpy("OUT")
        got.append((response.id, "", response.parameters["triton_final_response"].bool_param,
                    None if out is None else out.tolist()))
    return got


def test_grpc_a_request_with_zero_responses_gets_only_the_empty_final_response(
        grpc_stream, results) -> None:
    # Given a stream with a request that yields no response (IN = 0) and one that yields two,
    # both asking for the empty final response
    none, two = f"gs-zero-{uuid.uuid4().hex}", f"gs-two-{uuid.uuid4().hex}"
    grpc_stream.client.async_stream_infer("square", [_square_in(0)], request_id=none,
                                          enable_empty_final_response=True,
                                          parameters={"idempotency_key": none})
    grpc_stream.client.async_stream_infer("square", [_square_in(2)], request_id=two,
                                          enable_empty_final_response=True)
    got = _all_responses(grpc_stream)
    # Then the first gets exactly the empty final response, no error; the other its two parts
    assert [g for g in got if g[0] == none] == [(none, "", True, None)]
    assert [g for g in got if g[0] != none] == [(two, "", False, [2]), (two, "", False, [2]),
                                                (two, "", True, None)]
    # and the request succeeded, with an answer of no outputs
    assert _settled(results, none) == "SUCCESS"
    answer = results.result(none, timeout_s=30)
    assert answer.outputs == {} and answer.raw["outputs"] == []


def test_grpc_a_request_with_zero_responses_gets_nothing_without_the_empty_final(
        grpc_stream, results) -> None:
    none, one = f"gs-zero-{uuid.uuid4().hex}", f"gs-one-{uuid.uuid4().hex}"
    grpc_stream.client.async_stream_infer("square", [_square_in(0)], request_id=none,
                                          parameters={"idempotency_key": none})
    grpc_stream.client.async_stream_infer("square", [_square_in(1)], request_id=one)
    got = _all_responses(grpc_stream)
    # as Triton: no response at all (no error either), and no final flag for the other
    assert got == [(one, "", False, [1])]
    assert _settled(results, none) == "SUCCESS"


def test_the_one_answer_of_a_request_with_zero_responses_has_no_outputs(gateway) -> None:
    # gRPC ModelInfer
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        result = client.infer("square", [_square_in(0)], request_id="u-zero")
    finally:
        client.close()
    response = result.get_response()
    assert (response.id, response.model_name, list(response.outputs)) == ("u-zero", "square", [])
    assert result.as_numpy("OUT") is None
    # HTTP infer
    status, _, answer = _post(gateway, "/v2/models/square/infer", {"id": "h-zero", "inputs": [
        {"name": "IN", "shape": [1], "datatype": "INT32", "data": [0]}]})
    assert status == 200, answer
    assert (answer["id"], answer["model_name"], answer["outputs"]) == ("h-zero", "square", [])
    # generate (the answer without outputs) and generate_stream (no event)
    status, _, answer = _post(gateway, "/v2/models/square/generate", {"id": "g-zero", "IN": 0})
    assert status == 200 and answer["id"] == "g-zero" and "OUT" not in answer
    status, kind, events = _post(gateway, "/v2/models/square/generate_stream", {"IN": 0})
    assert (status, kind, events) == (200, "text/event-stream", [])


# -- HTTP generate, generate_stream ---------------------------------------------------------------

async def _events(response: aiohttp.ClientResponse, count: int | None = None
                  ) -> list[tuple[str, dict[str, Any]]]:
    """Server-sent events as (event type, data): ``count`` of them, or all until the end."""
    events: list[tuple[str, dict[str, Any]]] = []
    kind, data = "message", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data:
            events.append((kind, json.loads(data)))
            kind, data = "message", ""
            if count is not None and len(events) == count:
                break
    return events


def _post(gateway: GatewayProcess, path: str, body: dict[str, Any], count: int | None = None
          ) -> tuple[int, str, Any]:
    async def go() -> tuple[int, str, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{gateway.http_url}{path}", json=body) as response:
                if response.content_type == "text/event-stream":
                    return response.status, response.content_type, await _events(response, count)
                return response.status, response.content_type, await response.json()

    return asyncio.run(go())


def test_generate_stream_sends_each_part_as_an_event_in_order(gateway, results) -> None:
    request_id = f"sse-order-{uuid.uuid4().hex}"
    status, kind, events = _post(gateway, "/v2/models/echo-stream/generate_stream",
                                 {"id": request_id, "idempotency_key": request_id,
                                  "text_input": " ".join(WORDS),
                                  "max_tokens": 40})
    assert (status, kind) == (200, "text/event-stream")
    assert [e[0] for e in events] == ["message"] * 40
    assert [e[1] for e in events] == [
        {"id": request_id, "model_name": "echo-stream", "model_version": "1", "text_output": w}
        for w in _expected(40)]
    assert _settled(results, request_id) == "SUCCESS"


def test_generate_stream_refusals_before_any_part_are_json_errors(gateway) -> None:
    status, kind, answer = _post(gateway, "/v2/models/echo-stream/generate_stream",
                                 {"id": "sse-bad", "text_input": "x", "max_tokens": "many"})
    assert (status, kind) == (400, "application/json")
    assert answer["error"].startswith("request sse-bad: input 'max_tokens'")
    status, _, answer = _post(gateway, "/v2/models/nosuchmodel/generate_stream", {"text_input": "x"})
    assert status == 404
    assert answer["error"].startswith("Request for unknown model: 'nosuchmodel' is not found")


def test_generate_stream_a_client_that_hangs_up_has_its_request_revoked(gateway, results) -> None:
    request_id = f"sse-hangup-{uuid.uuid4().hex}"
    status, _, events = _post(gateway, "/v2/models/echo-stream/generate_stream",
                              {"id": request_id, "idempotency_key": request_id,
                               "text_input": " ".join(WORDS),
                               "max_tokens": ENDLESS}, count=3)
    # leaving the session closed the connection after three events
    assert status == 200 and [e[1]["text_output"] for e in events] == _expected(3)
    assert _settled(results, request_id) == "REVOKED"
    final = wait_for(lambda: _final_entry(results, request_id), 30, "the stream's final entry")
    assert final.status == "REVOKED" and int(final.fields["parts"]) < ENDLESS


def test_generate_returns_the_joined_answer(gateway) -> None:
    request_id = f"gen-{uuid.uuid4().hex}"
    status, kind, answer = _post(gateway, "/v2/models/echo-stream/generate",
                                 {"id": request_id, "text_input": "one two three",
                                  "parameters": {"max_tokens": 5}})
    assert (status, kind) == (200, "application/json")
    assert answer["id"] == request_id
    assert (answer["model_name"], answer["model_version"]) == ("echo-stream", "1")
    assert answer["text_output"] == "one two three one two"
    assert answer["worker"].startswith("stream-cpu@")


def test_model_config_says_which_models_are_decoupled(gateway) -> None:
    status, _, config = _post_get(gateway, "/v2/models/echo-stream/config")
    assert status == 200 and config["model_transaction_policy"] == {"decoupled": True}
    status, _, config = _post_get(gateway, "/v2/models/identity/config")
    assert status == 200 and config["model_transaction_policy"] == {"decoupled": False}
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        assert client.get_model_config("echo-stream").config.model_transaction_policy.decoupled
        assert not client.get_model_config("identity").config.model_transaction_policy.decoupled
    finally:
        client.close()


def test_model_config_gives_each_inputs_format_as_triton_does(gateway) -> None:
    from tritonclient.grpc import model_config_pb2

    # HTTP: Triton's JSON config names every input's format, FORMAT_NONE when it has none
    status, _, config = _post_get(gateway, "/v2/models/channel-means/config")
    assert status == 200
    assert config["input"] == [{"name": "pixels", "data_type": "TYPE_FP32", "dims": [3, 2, 2],
                                "format": "FORMAT_NCHW"}]
    assert config["output"] == []  # it declares none (an output has no format in Triton)
    status, _, config = _post_get(gateway, "/v2/models/square/config")
    assert config["input"] == [{"name": "IN", "data_type": "TYPE_INT32", "dims": [], "format":
                                "FORMAT_NONE"}]
    # the v2 metadata has no such key
    status, _, meta = _post_get(gateway, "/v2/models/channel-means")
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 2, 2]}]
    # gRPC: Triton's ModelInput.format (field 3), read with Triton's own model_config.proto
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        (pixels,) = client.get_model_config("channel-means").config.input
        assert (pixels.name, list(pixels.dims), pixels.format) == (
            "pixels", [3, 2, 2], model_config_pb2.ModelInput.FORMAT_NCHW)
        (count,) = client.get_model_config("square").config.input
        assert count.format == model_config_pb2.ModelInput.FORMAT_NONE
        # and the model serves as declared
        x = grpcclient.InferInput("pixels", [1, 3, 2, 2], "FP32")
        x.set_data_from_numpy(np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2))
        means = client.infer("channel-means", [x]).as_numpy("means")
    finally:
        client.close()
    np.testing.assert_array_equal(means, [[1.5, 5.5, 9.5]])


def _post_get(gateway: GatewayProcess, path: str) -> tuple[int, str, Any]:
    async def go() -> tuple[int, str, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{gateway.http_url}{path}") as response:
                return response.status, response.content_type, await response.json()

    return asyncio.run(go())


# -- docs/streaming.md's curl example --------------------------------------------------------------

def _page_curl() -> tuple[list[str], list[dict[str, Any]]]:
    """docs/streaming.md's streaming curl command (as argv) and the events its comment shows."""
    text = (ROOT / "docs" / "streaming.md").read_text()
    block = re.search(r"<!-- stream-curl[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert block, "docs/streaming.md has no marked streaming curl example"
    lines = block.group(1).splitlines()
    argv = shlex.split(lines[0])
    shown = [json.loads(line[len("# data: "):]) for line in lines[1:] if line.startswith("# data: ")]
    return argv, shown


def test_the_streaming_page_curl_example_streams_as_shown(gateway) -> None:
    argv, shown = _page_curl()
    assert argv[:2] == ["curl", "-N"] and argv[3] == "-d"
    url = argv[2].replace("localhost:8000", gateway.http_url)
    # a fresh ID: the page's, sent again to this session's Redis, would be the same request
    body = json.loads(argv[4])
    request_id = f"{body['id']}-{uuid.uuid4().hex}"
    shown = [{**event, "id": request_id} for event in shown]
    body["id"] = request_id
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-sN", url, "-d", json.dumps(body)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        events = [json.loads(line[6:]) for line in out.stdout.splitlines()
                  if line.startswith("data: ")]
    else:  # the same request as curl sends it (-d: a form content type, which is ignored)
        path = url.split(gateway.http_url, 1)[1]
        status, kind, pairs = _post(gateway, path, body)
        assert (status, kind) == (200, "text/event-stream")
        events = [data for _, data in pairs]
    words = body["text_input"].split()
    assert [e["text_output"] for e in events] == words
    assert events[:len(shown)] == shown  # the page shows the first events as they are

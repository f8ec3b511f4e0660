"""gRPC ModelStreamInfer (gateway/grpc_stream.py, gateway/streaming.py) against Triton's own
streaming client (tritonclient.grpc ``start_stream``), with a fake service and a fake reader of
each request's stream behind it: the plumbing alone (what reaches the caller, in what order, with
which flags; what is revoked). The real fleet: tests/integration/test_gateway_streaming.py.

Model ``steps`` is decoupled: each word of ``text_input`` is one part; the word ``!interrupt``
reports an interruption instead, ``!fail`` ends the request with a model error, ``!wait``
waits until cancelled, ``!after:<word>`` until another request's part ``<word>`` was made.
Model ``echo`` does not stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.client.responses import StreamPart
from asyncinfer.client.stream_progress import Interruption
from asyncinfer.errors import ModelError, QueueFull
from asyncinfer.gateway import streaming
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.grpc_api import start_grpc
from asyncinfer.gateway.service import Service
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.gateway.tensors import InferCall, InferResult, OutputTensor, list_from_raw

pytestmark = pytest.mark.timeout(20)

OUTPUTS = [{"name": "text_output", "datatype": "BYTES", "shape": [-1, 1]}]
INPUTS = [{"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]}]


@dataclass
class FakeReader:
    """``Client.aread_stream`` of the fake: the parts of each request sent to ``steps``."""

    words: dict[str, list[str]] = field(default_factory=dict)
    #: A word → set once a part with it was yielded (``!after:<word>`` waits for it).
    yielded: dict[str, asyncio.Event] = field(default_factory=dict)

    def aread_stream(self, request_id: str, *, model: str | None = None,
                     on_interrupted: Callable[[Interruption], Any] | None = None
                     ) -> AsyncIterator[StreamPart]:
        return self._parts(request_id, on_interrupted)

    async def _parts(self, request_id: str, on_interrupted: Any) -> AsyncIterator[StreamPart]:
        index = 0
        for word in self.words[request_id]:
            await asyncio.sleep(0.01)
            if word == "!interrupt":
                on_interrupted(Interruption(request_id, "w1", "7", 1, index, "lease run out"))
            elif word == "!fail":
                raise ModelError(f"request {request_id}: the model failed at step {index + 1}")
            elif word == "!wait":
                await asyncio.sleep(60)
            elif word.startswith("!after:"):
                await self.yielded.setdefault(word[7:], asyncio.Event()).wait()
            else:
                index += 1
                self.yielded.setdefault(word, asyncio.Event()).set()
                yield StreamPart(request_id, index, [{"name": "text_output", "datatype": "BYTES",
                                                      "shape": [1, 1], "data": [word]}])


class FakeService:
    """What streaming.stream and the gRPC front use of :class:`Service`."""

    CATALOGUE = {"steps": {"versions": ["1"], "decoupled": True, "inputs": INPUTS,
                           "outputs": OUTPUTS},
                 "echo": {"versions": ["1"], "inputs": INPUTS, "outputs": OUTPUTS}}

    def __init__(self) -> None:
        self.client = FakeReader()
        self.stopping = False
        self.shared_memory = SharedMemory(allowed=False)
        self.in_flight = 0
        self.revoked: queue.Queue[str] = queue.Queue()
        self.ended: list[tuple[str, int]] = []
        self._numbered = 0

    def on_infer(self, call: InferCall, status: int, seconds: float) -> None:
        self.ended.append((call.id, status))

    accounted = Service.accounted  # the service's own accounting, over this fake's on_infer

    async def entry(self, model: str, version: str = "") -> CatalogueEntry:
        if model not in self.CATALOGUE:
            raise GatewayError(404, f"Request for unknown model: '{model}' is not found: no worker "
                                    f"announced it")
        return CatalogueEntry(model, self.CATALOGUE[model])

    async def infer(self, call: InferCall) -> InferResult:
        outputs = [OutputTensor("text_output", t.datatype, t.shape, t.raw) for t in call.inputs]
        return InferResult(call.model, "1", call.id, outputs, {"worker": "w1"})

    async def submit(self, call: InferCall, entry: CatalogueEntry) -> Any:
        if call.id == "full":
            raise GatewayError(429, "request full: the queue of model 'steps' is full")
        self._numbered += 1
        sent: Any = concurrent.futures.Future()
        sent.id = call.id or f"generated-{self._numbered}"
        text = list_from_raw("x", "BYTES", call.inputs[0].shape, call.inputs[0].raw)[0]
        self.client.words[sent.id] = text.split()
        return sent

    def wait(self, sent: Any) -> asyncio.Future[Any]:
        answer = asyncio.get_running_loop().create_future()  # answered by the stream's end only
        if sent.id.startswith("refused"):  # refused once handed over: no stream ever comes
            answer.set_exception(QueueFull(f"request {sent.id}: the queue of model 'steps' is full"))
        return answer

    def revoke(self, sent: Any) -> None:
        self.revoked.put(sent.id)


@dataclass
class Served:
    fake: FakeService
    client: grpcclient.InferenceServerClient
    responses: queue.Queue[tuple[Any, Any]]

    def send(self, request_id: str, text: str, model: str = "steps", **options: Any) -> None:
        x = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        x.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        self.client.async_stream_infer(model, [x], request_id=request_id, **options)

    def take(self, count: int) -> list[tuple[str, str, Any]]:
        """The next ``count`` responses as (id, error or '', (final flag, words))."""
        got = []
        for _ in range(count):
            result, error = self.responses.get(timeout=10)
            if error is not None:
                got.append(("", str(error.message()), None))
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            words = result.as_numpy("text_output")
            got.append((response.id, "", (final, None if words is None else
                                          [w.decode() for w in words.reshape(-1)])))
        return got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-stream-test-loop", daemon=True)
    thread.start()
    fake = FakeService()
    port = _free_port()
    server = asyncio.run_coroutine_threadsafe(
        start_grpc(cast(Service, fake), "127.0.0.1", port), loop).result(5)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        yield Served(fake, client, responses)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_parts_in_order_then_the_empty_final_response_when_asked(served: Served) -> None:
    served.send("r1", "one two three", enable_empty_final_response=True)
    assert served.take(4) == [("r1", "", (False, ["one"])), ("r1", "", (False, ["two"])),
                              ("r1", "", (False, ["three"])), ("r1", "", (True, None))]
    served.client.stop_stream()  # waits for the call to end
    assert served.fake.ended == [("r1", 200)] and served.fake.revoked.empty()


def test_no_empty_final_response_unless_asked_as_triton(served: Served) -> None:
    served.send("r1", "one two")
    served.send("r2", "x", enable_empty_final_response=True)
    got = served.take(4)
    assert [g for g in got if g[0] == "r1"] == [("r1", "", (False, ["one"])),
                                                ("r1", "", (False, ["two"]))]
    assert [g for g in got if g[0] == "r2"] == [("r2", "", (False, ["x"])), ("r2", "", (True, None))]


def test_requests_interleave_each_with_its_own_parts(served: Served) -> None:
    served.send("a", "a1 !after:b1 a2 a3", enable_empty_final_response=True)
    served.send("b", "b1 !after:a3 b2 b3", enable_empty_final_response=True)
    got = served.take(8)
    for rid in "ab":
        assert [g[2] for g in got if g[0] == rid] == [
            *[(False, [f"{rid}{i}"]) for i in range(1, 4)], (True, None)]
    words = [g[2][1][0] for g in got if g[2][1]]
    assert words.index("b1") < words.index("a2") and words.index("a3") < words.index("b2")


def test_a_model_that_does_not_stream_answers_once_flagged_final(served: Served) -> None:
    served.send("e1", "whole answer", model="echo", enable_empty_final_response=True)
    assert served.take(1) == [("e1", "", (True, ["whole answer"]))]
    served.client.stop_stream()
    assert served.responses.empty()


def test_errors_name_the_request_and_the_stream_goes_on(served: Served) -> None:
    served.send("bad", "one !fail two")
    first = served.take(2)
    assert first[0] == ("bad", "", (False, ["one"]))
    assert first[1][1] == "ModelError: request bad: the model failed at step 2"
    served.send("nobody", "x", model="nosuchmodel")
    # Triton's words stay first (its clients match on them), the request is named after them
    assert served.take(1)[0][1] == ("Request for unknown model: 'nosuchmodel' is not found: no "
                                    "worker announced it (request nobody)")
    served.send("full", "x")
    assert "request full: the queue of model 'steps' is full" in served.take(1)[0][1]
    served.send("ok", "fine", enable_empty_final_response=True)
    assert served.take(2) == [("ok", "", (False, ["fine"])), ("ok", "", (True, None))]


def test_an_interruption_is_told_and_the_parts_go_on(served: Served) -> None:
    served.send("r", "one !interrupt two", enable_empty_final_response=True)
    got = served.take(4)
    assert got[0] == ("r", "", (False, ["one"]))
    assert got[1][1].startswith("request r: interrupted after part 1: its worker w1 stopped "
                                "mid-stream (lease run out)")
    assert got[2:] == [("r", "", (False, ["two"])), ("r", "", (True, None))]


def test_cancelling_the_stream_revokes_every_request_still_running(served: Served) -> None:
    served.send("done", "only", enable_empty_final_response=True)
    assert served.take(2)[1] == ("done", "", (True, None))
    served.send("w1", "one !wait")
    served.send("w2", "two !wait")
    assert sorted(g[2][1][0] for g in served.take(2)) == ["one", "two"]
    served.client.stop_stream(cancel_requests=True)
    revoked = {served.fake.revoked.get(timeout=10), served.fake.revoked.get(timeout=10)}
    assert revoked == {"w1", "w2"}
    assert served.fake.revoked.empty()  # not the request that had ended


def test_a_request_refused_after_it_was_handed_over_is_told(served: Served,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a request whose send fails once handed to the publisher: its stream never comes
    monkeypatch.setattr(streaming, "READER_GRACE_S", 0.05)
    served.send("refused-1", "!wait")
    # Then its answer's error is the response, once the reader had its chance
    assert served.take(1)[0][1] == "request refused-1: the queue of model 'steps' is full"
    served.client.stop_stream()
    assert served.fake.ended == [("refused-1", 429)] and served.fake.revoked.empty()

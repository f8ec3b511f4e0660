"""The gRPC front against Triton's own client (tritonclient.grpc), with a fake service behind it.

The server runs on an asyncio loop in a background thread (tritonclient.grpc is synchronous);
each test gets a fresh server on a free loopback port and stops it at the end.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from asyncinfer.broker.fleet_stats import triton_stats
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.grpc_api import start_grpc
from asyncinfer.gateway.service import Service
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.gateway.tensors import InferCall, InferResult, OutputTensor

pytestmark = pytest.mark.timeout(10)

METADATA = {"name": "echo", "versions": ["1"], "platform": "pytorch",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}
CONFIG = {"name": "echo", "platform": "pytorch", "backend": "asyncinfer", "max_batch_size": 8,
          "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4], "format": "FORMAT_NCHW"}],
          "output": [{"name": "y", "data_type": "TYPE_STRING", "dims": [4]}]}
#: Two workers' counts of ``echo`` as fleet_stats.FleetStats.read gives them.
STATS_WORKERS = [
    {"worker": "w1", "device": "cpu", "execution_count": 2, "inference_count": 5,
     "success_count": 3, "success_ns": 9000, "fail_count": 1, "fail_ns": 0, "queue_count": 3,
     "queue_ns": 600, "compute_infer_count": 3, "compute_infer_ns": 7000, "last_inference": 1700,
     "batch:1:compute_infer_count": 1, "batch:1:compute_infer_ns": 1000,
     "batch:4:compute_infer_count": 1, "batch:4:compute_infer_ns": 2000},
    {"worker": "w2", "device": "cuda:0", "execution_count": 1, "inference_count": 4,
     "success_count": 1, "success_ns": 3000, "queue_count": 1, "queue_ns": 100,
     "compute_input_count": 1, "compute_input_ns": 50, "last_inference": 1900,
     "batch:4:compute_infer_count": 1, "batch:4:compute_infer_ns": 2500},
]
WORKER_PARAMETERS = {"worker": "w1", "device": "cpu", "batch_size": 4, "queue_ms": 1.5,
                     "compute_ms": 2.25}


class FakeService:
    """The calls of :class:`Service`, with canned answers: model ``echo`` returns its inputs as
    outputs; ``missing``, ``bad``, ``full`` and ``boom`` fail; ``slow`` waits to be cancelled."""

    def __init__(self) -> None:
        self.calls: list[InferCall] = []
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.shared_memory = SharedMemory(allowed=False)

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return False

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "asyncinfer", "version": "9.9", "extensions": ["binary_tensor_data"]}

    def _check(self, model: str) -> None:
        if model == "boom":
            raise RuntimeError("a bug")
        if model != "echo" and model != "slow":
            raise GatewayError(404, f"model '{model}' is unknown")

    async def model_metadata(self, model: str, version: str = "") -> dict[str, Any]:
        self._check(model)
        return METADATA

    async def model_ready(self, model: str, version: str = "") -> bool:
        return model == "echo"

    async def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        self._check(model)
        return CONFIG

    async def model_statistics(self, model: str = "", version: str = "") -> dict[str, Any]:
        if model:
            self._check(model)
        return {"model_stats": [triton_stats("echo", STATS_WORKERS, version or "1")]}

    async def infer(self, call: InferCall) -> InferResult:
        self.calls.append(call)
        if call.model == "bad":
            raise GatewayError(400, "request r: input 'x' is bad")
        if call.model == "full":
            raise GatewayError(429, "queue of model 'full' is full", retry_after_s=1.0)
        if call.model == "slow":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        self._check(call.model)
        outputs = [OutputTensor(t.name, t.datatype, t.shape, t.raw) for t in call.inputs]
        return InferResult(call.model, call.version or "1", call.id, outputs, dict(WORKER_PARAMETERS))


@dataclass
class Served:
    fake: FakeService
    client: grpcclient.InferenceServerClient
    url: str
    loop: asyncio.AbstractEventLoop

    def stub(self) -> tuple[grpc.Channel, service_pb2_grpc.GRPCInferenceServiceStub]:
        channel = grpc.insecure_channel(self.url)
        return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()
    fake = FakeService()
    url = f"127.0.0.1:{_free_port()}"
    host, port = url.split(":")
    server = asyncio.run_coroutine_threadsafe(
        start_grpc(cast(Service, fake), host, int(port)), loop).result(5)
    client = grpcclient.InferenceServerClient(url)
    try:
        yield Served(fake, client, url, loop)
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _status(exc: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(exc.value.status())


# -- health, metadata, config --------------------------------------------------------------------

def test_health(served: Served) -> None:
    assert served.client.is_server_live() is True
    assert served.client.is_server_ready() is False
    assert served.client.is_model_ready("echo") is True
    assert served.client.is_model_ready("nobody", "3") is False


def test_server_and_model_metadata(served: Served) -> None:
    server = served.client.get_server_metadata()
    assert (server.name, server.version, list(server.extensions)) == (
        "asyncinfer", "9.9", ["binary_tensor_data"])
    meta = served.client.get_model_metadata("echo")
    assert (meta.name, list(meta.versions), meta.platform) == ("echo", ["1"], "pytorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("y", "FP32", [-1, 4])]
    as_json = served.client.get_model_metadata("echo", as_json=True)
    assert as_json["inputs"][0]["shape"] == ["-1", "4"]  # MessageToJson writes int64 as text


def test_model_config(served: Served) -> None:
    config = served.client.get_model_config("echo").config
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        "echo", "pytorch", "asyncinfer", 8)
    # read with Triton's own model_config.proto: its ModelInput.format is field 3, as ours
    assert [(t.name, t.data_type, list(t.dims), t.format) for t in config.input] == [
        ("x", model_config_pb2.TYPE_FP32, [4], model_config_pb2.ModelInput.FORMAT_NCHW)]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("y", model_config_pb2.TYPE_STRING, [4])]
    as_json = served.client.get_model_config("echo", as_json=True)["config"]["input"][0]
    assert (as_json["data_type"], as_json["format"]) == ("TYPE_FP32", "FORMAT_NCHW")


def test_unknown_model_is_not_found(served: Served) -> None:
    with pytest.raises(InferenceServerException) as exc:
        served.client.get_model_metadata("nobody")
    assert _status(exc) == "StatusCode.NOT_FOUND"
    assert "model 'nobody' is unknown" in str(exc.value.message())
    with pytest.raises(InferenceServerException) as exc:
        served.client.get_model_config("nobody")
    assert _status(exc) == "StatusCode.NOT_FOUND"


def test_a_bug_answers_internal(served: Served) -> None:
    with pytest.raises(InferenceServerException) as exc:
        served.client.get_model_metadata("boom")
    assert _status(exc) == "StatusCode.INTERNAL"
    assert "RuntimeError: a bug" in str(exc.value.message())


def test_statistics_reach_tritonclient_as_the_json_form_says(served: Served) -> None:
    expected = triton_stats("echo", STATS_WORKERS)
    del expected["asyncinfer"], expected["memory_usage"]  # not on Triton's wire
    for name in ("echo", ""):
        got = served.client.get_inference_statistics(name, as_json=True)
        (stats,) = got["model_stats"]
        # protobuf's JSON writes uint64 as text and leaves zeros out
        assert _without_zeros(_ints(stats)) == _without_zeros(expected)
    stats = served.client.get_inference_statistics("echo").model_stats[0]
    assert (stats.inference_count, stats.execution_count, stats.last_inference) == (9, 3, 1900)
    assert (stats.inference_stats.success.count, stats.inference_stats.success.ns) == (4, 12000)
    assert [(b.batch_size, b.compute_infer.count, b.compute_infer.ns)
            for b in stats.batch_stats] == [(1, 1, 1000), (4, 2, 4500)]
    with pytest.raises(InferenceServerException) as exc:
        served.client.get_inference_statistics("missing")
    assert _status(exc) == "StatusCode.NOT_FOUND"


_UINT64 = {"count", "ns", "batch_size", "last_inference", "inference_count", "execution_count"}


def _ints(value: Any) -> Any:
    """protobuf's JSON form with its uint64 text as integers again."""
    if isinstance(value, dict):
        return {k: int(v) if k in _UINT64 else _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def _without_zeros(value: Any) -> Any:
    if isinstance(value, dict):
        kept = {k: _without_zeros(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (0, {}, [])}
    if isinstance(value, list):
        return [_without_zeros(v) for v in value]
    return value


def test_methods_not_served_are_unimplemented(served: Served) -> None:
    for call in (lambda: served.client.get_trace_settings(),
                 lambda: served.client.get_log_settings()):
        with pytest.raises(InferenceServerException) as exc:
            call()
        assert _status(exc) == "StatusCode.UNIMPLEMENTED"


def test_shared_memory_status_answers_and_registering_is_off_by_default(served: Served) -> None:
    assert list(served.client.get_system_shared_memory_status().regions) == []
    assert list(served.client.get_cuda_shared_memory_status().regions) == []
    served.client.unregister_cuda_shared_memory()  # nothing registered: nothing to do
    with pytest.raises(InferenceServerException) as exc:
        served.client.register_system_shared_memory("r", "/nothing", 16)
    assert _status(exc) == "StatusCode.UNIMPLEMENTED"
    assert exc.value.message().startswith("Client shared memory is disabled. Start the server "
                                          "with '--allow-client-shm=true' to enable.")


# -- infer ---------------------------------------------------------------------------------------

def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "BOOL": np.array([[True, False, True], [False, False, True]]),
        "FP16": rng.standard_normal((2, 3)).astype(np.float16),
        # tritonclient (r26.06 on) takes and returns BF16 as ml_dtypes.bfloat16, not float32.
        "BF16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "FP32": rng.standard_normal((2, 3)).astype(np.float32),
        "FP64": rng.standard_normal((2, 3)),
        "BYTES": np.array([[b"a", b"", "h\u00e9".encode()], [b"\x00\xff", b"xyz", b"q"]],
                          dtype=np.object_),
    }
    for kind in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(kind)
        arrays[kind.upper()] = np.array([[info.min, info.max, 0], [1, 2, 3]], dtype=kind)
    return arrays


def test_infer_round_trip_of_every_datatype(served: Served) -> None:
    arrays = _arrays()
    inputs = []
    for datatype, array in arrays.items():
        tensor = grpcclient.InferInput(f"in_{datatype}", list(array.shape), datatype)
        inputs.append(tensor.set_data_from_numpy(array))
    result = served.client.infer("echo", inputs, request_id="r1")
    for datatype, array in arrays.items():
        got = result.as_numpy(f"in_{datatype}")
        assert got.dtype == array.dtype, datatype
        assert got.shape == array.shape, datatype
        np.testing.assert_array_equal(got, array, err_msg=datatype)
        assert result.get_output(f"in_{datatype}").datatype == datatype
    call = served.fake.calls[0]
    assert (call.model, call.version, call.id, call.protocol) == ("echo", "", "r1", "grpc")
    assert call.outputs is None and call.timeout_s is None
    assert call.inputs[0].raw == arrays["BOOL"].tobytes()
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("echo", "1", "r1")


def test_infer_parameters_outputs_and_deadline(served: Served) -> None:
    array = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = grpcclient.InferInput("x", [1, 4], "FP32").set_data_from_numpy(array)
    result = served.client.infer(
        "echo", [tensor], model_version="1", outputs=[grpcclient.InferRequestedOutput("x")],
        priority=2, timeout=5_000_000, client_timeout=3.0,
        parameters={"note": "hi", "n": -3, "scale": 0.5, "flag": True})
    call = served.fake.calls[0]
    assert call.version == "1"
    assert call.parameters == {"note": "hi", "n": -3, "scale": 0.5, "flag": True, "priority": 2,
                               "timeout": 5_000_000}
    assert [o.name for o in call.outputs or []] == ["x"]
    # gRPC rounds the grpc-timeout header up (to a few ms): the server may see a bit more than 3 s.
    assert call.timeout_s is not None and 2.0 < call.timeout_s <= 3.1
    parameters = result.get_response().parameters
    assert parameters["worker"].string_param == "w1"
    assert parameters["device"].string_param == "cpu"
    assert parameters["batch_size"].int64_param == 4
    assert parameters["queue_ms"].double_param == 1.5
    assert parameters["compute_ms"].double_param == 2.25


def _contents_request(*tensors: tuple[str, str, list[int], dict[str, list[Any]]],
                      raw: list[bytes] | None = None) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest in Triton's own messages, data in typed ``contents``."""
    request = service_pb2.ModelInferRequest(model_name="echo", id="c1")
    for name, datatype, shape, contents in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape,
                           contents=service_pb2.InferTensorContents(**contents))
    request.raw_input_contents.extend(raw or [])
    return request


def test_typed_contents_become_raw_data(served: Served) -> None:
    request = _contents_request(
        ("b", "BOOL", [3], {"bool_contents": [True, False, True]}),
        ("i8", "INT8", [2], {"int_contents": [-128, 127]}),
        ("u16", "UINT16", [2], {"uint_contents": [0, 65535]}),
        ("i64", "INT64", [1], {"int64_contents": [-(2**40)]}),
        ("u64", "UINT64", [1], {"uint64_contents": [2**64 - 1]}),
        ("f", "FP32", [2, 1], {"fp32_contents": [1.5, -2.0]}),
        ("d", "FP64", [1], {"fp64_contents": [0.1]}),
        ("s", "BYTES", [2], {"bytes_contents": [b"ab", b""]}),
        ("empty", "INT32", [0], {}))
    channel, stub = served.stub()
    with channel:
        response = stub.ModelInfer(request, timeout=5)
    raws = {t.name: t.raw for t in served.fake.calls[0].inputs}
    assert raws == {
        "b": b"\x01\x00\x01", "i8": np.array([-128, 127], "<i1").tobytes(),
        "u16": np.array([0, 65535], "<u2").tobytes(), "i64": np.array([-(2**40)], "<i8").tobytes(),
        "u64": np.array([2**64 - 1], "<u8").tobytes(), "f": np.array([1.5, -2.0], "<f4").tobytes(),
        "d": np.array([0.1], "<f8").tobytes(),
        "s": struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0), "empty": b""}
    assert list(response.raw_output_contents) == list(raws.values())
    assert [o.name for o in response.outputs] == list(raws)


@pytest.mark.parametrize(("request_", "says"), [
    (_contents_request(("x", "INT8", [1], {"int_contents": [300]})), "input 'x'"),
    (_contents_request(("x", "FP32", [3], {"fp32_contents": [1.0]})), "input 'x'"),
    (_contents_request(("x", "FP16", [1], {"fp32_contents": [1.0]})),
     "FP16 data travels in raw_input_contents only"),
    (_contents_request(("x", "INT32", [1], {"int64_contents": [1]})),
     "INT32 data belongs in int_contents"),
    (_contents_request(("x", "INT32", [1], {"int_contents": [1]}), ("y", "INT32", [1], {}),
                       raw=[b"\x00" * 4, b"\x00" * 4]),
     # Triton's words first (grpc_explicit_int_content_client.py looks for them)
     "contents field must not be specified when using raw_input_contents for 'x' for model "
     "'echo' (request c1: give an input's data in one or the other)"),
    # as grpc_explicit_int_content_client.py sends it: typed contents on the first input, raw
    # contents for one input only; Triton's first rule broken is the first input's
    (_contents_request(("x", "INT32", [1], {"int_contents": [1]}), ("y", "INT32", [1], {}),
                       raw=[b"\x00" * 4]),
     "contents field must not be specified when using raw_input_contents for 'x' for model 'echo'"),
    (_contents_request(("x", "INT32", [1], {}), ("y", "INT32", [1], {}), raw=[b"\x00" * 4]),
     "unable to find data for input tensor 'y' for model 'echo' in request (request c1: 1 "
     "raw_input_contents for 2 inputs; give one per input, or none)"),
    (_contents_request(("x", "INT32", [1], {}), raw=[b"\x00" * 4, b"\x00" * 4]),
     "request c1: 2 raw_input_contents for 1 inputs (give one per input, or none)"),
    (_contents_request(("x", "NOPE", [1], {})), "input 'x'"),
], ids=["out-of-range", "count", "fp16-typed", "wrong-field", "mixed", "mixed-short", "raw-count",
        "raw-extra", "datatype"])
def test_malformed_contents_are_invalid_argument(served: Served, request_: Any, says: str) -> None:
    channel, stub = served.stub()
    with channel, pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request_, timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in exc.value.details()
    assert "request c1" in exc.value.details()
    assert served.fake.calls == []


def test_an_input_in_shared_memory_reaches_the_service_as_its_region(served: Served) -> None:
    # the other input's raw contents are the only ones sent (Triton's rule): they stay its own
    in_region = grpcclient.InferInput("x", [1, 4], "FP32").set_shared_memory("region", 16, 32)
    sent = grpcclient.InferInput("y", [1], "INT32").set_data_from_numpy(np.array([7], np.int32))
    output = grpcclient.InferRequestedOutput("x")
    output.set_shared_memory("out", 16)
    served.client.infer("echo", [in_region, sent], outputs=[output])
    call = served.fake.calls[-1]
    assert [(t.name, t.shm, t.raw) for t in call.inputs] == [
        ("x", ("region", 32, 16), b""), ("y", None, np.array([7], np.int32).tobytes())]
    assert [(o.name, o.shm) for o in call.outputs or []] == [("x", ("out", 0, 16))]


@pytest.mark.parametrize(("model", "code"), [("missing", "NOT_FOUND"), ("bad", "INVALID_ARGUMENT"),
                                             ("full", "RESOURCE_EXHAUSTED")])
def test_infer_errors_are_mapped(served: Served, model: str, code: str) -> None:
    tensor = grpcclient.InferInput("x", [1], "INT32").set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException) as exc:
        served.client.infer(model, [tensor])
    assert _status(exc) == f"StatusCode.{code}"


def test_queue_full_sends_retry_after(served: Served) -> None:
    request = _contents_request(("x", "INT32", [1], {"int_contents": [1]}))
    request.model_name = "full"
    channel, stub = served.stub()
    with channel, pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request, timeout=5)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.details() == "queue of model 'full' is full"
    assert ("retry-after", "1") in tuple(exc.value.trailing_metadata())


def test_client_cancel_reaches_the_service(served: Served) -> None:
    tensor = grpcclient.InferInput("x", [1], "INT32").set_data_from_numpy(np.array([1], np.int32))
    answers: list[Any] = []
    context = served.client.async_infer("slow", [tensor], lambda result, error: answers.append(error))
    assert served.fake.started.wait(3)
    context.cancel()
    assert served.fake.cancelled.wait(3), "the handler was not cancelled"
    deadline = time.monotonic() + 3
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers and "CANCELLED" in str(answers[0].status())


def test_deadline_cancels_the_handler(served: Served) -> None:
    tensor = grpcclient.InferInput("x", [1], "INT32").set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException) as exc:
        served.client.infer("slow", [tensor], client_timeout=0.3)
    assert "DEADLINE_EXCEEDED" in _status(exc)
    assert served.fake.cancelled.wait(3), "the handler was not cancelled"


def test_a_taken_port_raises_oserror(served: Served) -> None:
    host, port = served.url.split(":")
    with pytest.raises(OSError, match="cannot bind gRPC"):
        asyncio.run_coroutine_threadsafe(
            start_grpc(cast(Service, served.fake), host, int(port)), served.loop).result(5)

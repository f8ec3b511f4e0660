"""Triton's system shared-memory extension through a real gateway and worker, with tritonclient's
own shared-memory helpers (HTTP and gRPC): inputs read from a region, outputs written to one,
byte-exact; a 64 MB input; the calls' refusals in Triton's words."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.support.databases import RedisDatabases
from tests.support.processes import GatewayProcess, start_gateway, start_worker

pytestmark = pytest.mark.timeout(180)


#: A message of a 64 MB input (msgpack, then base64 in kombu's envelope) is about 85 MB.
LIMIT = str(128 * 1024 * 1024)


@pytest.fixture(scope="module")
def fleet_url(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[str]:
    """A database of its own, served by a worker that takes messages of up to 128 MiB."""
    with redis_databases.take("shared memory") as db:
        worker = start_worker(db.url, tmp_path_factory.mktemp("worker") / "worker.log",
                              "--device", "cpu", "--models", "identity",
                              ASYNCINFER_MAX_PAYLOAD_BYTES=LIMIT)
        try:
            yield db.url
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def gateway(fleet_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = start_gateway(fleet_url, tmp_path_factory.mktemp("gateway") / "gateway.log",
                         ASYNCINFER_ALLOW_CLIENT_SHM="1", ASYNCINFER_MAX_PAYLOAD_BYTES=LIMIT)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, gateway: GatewayProcess) -> Iterator[Any]:
    if request.param == "http":
        c: Any = httpclient.InferenceServerClient(gateway.http_url)
    else:
        c = grpcclient.InferenceServerClient(gateway.grpc_url)
    c.protocol = request.param
    try:
        yield c
    finally:
        c.unregister_system_shared_memory()
        c.close()


class Regions:
    """POSIX shared-memory objects a test made (tritonclient's helpers), destroyed at its end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, byte_size: int) -> tuple[str, Any]:
        key = f"/ai-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, byte_size)
        self.handles.append(handle)
        return key, handle

    def close(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture()
def regions() -> Iterator[Regions]:
    made = Regions()
    try:
        yield made
    finally:
        made.close()


def _lib(client: Any) -> Any:
    return httpclient if client.protocol == "http" else grpcclient


def test_inputs_and_outputs_through_shared_memory_are_byte_exact(client: Any,
                                                                 regions: Regions) -> None:
    # Given an input region holding two tensors and an output region, registered
    lib = _lib(client)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.linspace(-1, 1, 8, dtype=np.float64).reshape(1, 8)
    in_key, in_handle = regions.make(a.nbytes + b.nbytes)
    out_key, out_handle = regions.make(a.nbytes + b.nbytes)
    shm.set_shared_memory_region(in_handle, [a])
    shm.set_shared_memory_region(in_handle, [b], offset=a.nbytes)
    client.register_system_shared_memory("in", in_key, a.nbytes + b.nbytes)
    client.register_system_shared_memory("out", out_key, a.nbytes + b.nbytes)
    # When identity is asked to read both from the region and write both to the other
    inputs = [lib.InferInput("a", [1, 16], "INT32"), lib.InferInput("b", [1, 8], "FP64")]
    inputs[0].set_shared_memory("in", a.nbytes)
    inputs[1].set_shared_memory("in", b.nbytes, offset=a.nbytes)
    outputs = [lib.InferRequestedOutput("a"), lib.InferRequestedOutput("b")]
    outputs[0].set_shared_memory("out", a.nbytes)
    outputs[1].set_shared_memory("out", b.nbytes, offset=a.nbytes)
    result = client.infer("identity", inputs, outputs=outputs, request_id="shm-1")
    # Then the outputs are in the region, exactly, and not in the response
    got_a = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    got_b = shm.get_contents_as_numpy(out_handle, np.float64, [1, 8], offset=a.nbytes)
    assert got_a.tobytes() == a.tobytes() and got_b.tobytes() == b.tobytes()
    output = result.get_output("b")
    if client.protocol == "http":
        assert output == {"name": "b", "datatype": "FP64", "shape": [1, 8]}  # no data
    else:
        assert list(output.shape) == [1, 8] and output.datatype == "FP64"
        assert list(result.get_response().raw_output_contents) == [b"", b""]
    # and the status lists both regions as registered
    status = client.get_system_shared_memory_status()
    names = ([r["name"] for r in status] if client.protocol == "http"
             else sorted(status.regions))
    assert sorted(names) == ["in", "out"]


def test_a_64_mb_input_travels_through_a_region_byte_exact(client: Any, regions: Regions) -> None:
    lib = _lib(client)
    data = np.random.default_rng(3).integers(0, 255, size=(1, 64_000_000), dtype=np.uint8)
    in_key, in_handle = regions.make(data.nbytes)
    out_key, out_handle = regions.make(data.nbytes)
    shm.set_shared_memory_region(in_handle, [data])
    client.register_system_shared_memory("big-in", in_key, data.nbytes)
    client.register_system_shared_memory("big-out", out_key, data.nbytes)
    x = lib.InferInput("x", [1, data.size], "UINT8")
    x.set_shared_memory("big-in", data.nbytes)
    out = lib.InferRequestedOutput("x")
    out.set_shared_memory("big-out", data.nbytes)
    client.infer("identity", [x], outputs=[out], client_timeout=120) if (
        client.protocol == "grpc") else client.infer("identity", [x], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.uint8, [1, data.size])
    assert got.tobytes() == data.tobytes()


def test_the_calls_refuse_in_tritons_words(client: Any, regions: Regions) -> None:
    lib = _lib(client)
    key, handle = regions.make(64)
    client.register_system_shared_memory("r", key, 64)
    cases = [
        (lambda: client.register_system_shared_memory("r", key, 64),
         "shared memory region 'r' already in manager"),
        (lambda: client.register_system_shared_memory("s", "/ai-no-such-" + uuid.uuid4().hex, 64),
         "Unable to open shared memory region: '/ai-no-such-"),
        (lambda: client.register_system_shared_memory("s", key, 65),
         "failed to register shared memory region 's': invalid args"),
        (lambda: client.get_system_shared_memory_status("nope"),
         "Unable to find system shared memory region: 'nope'"),
    ]
    x = lib.InferInput("x", [1, 32], "FP32")
    x.set_shared_memory("r", 128)  # more than the region holds
    cases.append((lambda: client.infer("identity", [x]),
                  "input 'x': Invalid offset + byte size for shared memory region: 'r'"))
    y = lib.InferInput("x", [1, 3], "FP32")
    y.set_shared_memory("r", 8)  # 8 bytes for 3 FP32 elements
    cases.append((lambda: client.infer("identity", [y]), "input 'x'"))
    for call, message in cases:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert message in caught.value.message(), caught.value.message()
    # and unregistering frees the name
    client.unregister_system_shared_memory("r")
    client.register_system_shared_memory("r", key, 32)


def test_registering_is_refused_unless_the_operator_allows_it(fleet_url: str, tmp_path: Any,
                                                              regions: Regions) -> None:
    proc = start_gateway(fleet_url, tmp_path / "gateway.log")
    try:
        key, _ = regions.make(16)
        http = httpclient.InferenceServerClient(proc.http_url)
        with pytest.raises(InferenceServerException) as caught:
            http.register_system_shared_memory("r", key, 16)
        assert caught.value.message().startswith(
            "Client shared memory is disabled. Start the server with '--allow-client-shm=true' "
            "to enable. (asyncinfer: start the gateway with --allow-client-shm")
        assert http.get_system_shared_memory_status() == []
        http.close()
    finally:
        proc.stop()

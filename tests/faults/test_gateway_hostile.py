"""The v2 gateway against hostile input and an unlucky environment, as a real process.

Every malformed or hostile request gets a 4xx (gRPC INVALID_ARGUMENT, NOT_FOUND, ...) whose
message names the request and the rule it breaks, nothing of it is enqueued, and the gateway
keeps serving good requests; and the faults around it (a client that hangs up mid-body, idle
connections, a frozen or killed worker, Redis gone) end with every request answered, once.

The module's gateway runs on a database of its own, with a body limit of 1 MiB (cheap to go
over). There the model "parked" is announced but nothing consumes its queue: whatever the gateway
enqueued for it would stay on ``infer.parked``, so each hostile case checks that queue is still
empty. Good requests go to "identity", served by the module's two workers, which also host
"gated" (it echoes its input and counts each execution in Redis: how the fault runs see which
requests ran, and how often).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import signal
import socket
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.gateway.proto import inference_pb2 as pb
from asyncinfer.ops.redis_server import RedisServer, free_port
from asyncinfer.wire.keys import CLAIM_PREFIX
from tests.support.databases import RedisDatabase, RedisDatabases, gated_broker, gated_executions
from tests.support.processes import GatewayProcess, WorkerProcess, start_gateway, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(30)

#: The gateway's body (and gRPC message) limit in this module.
LIMIT = 1 << 20
PARKED = "/v2/models/parked/infer"
IDENTITY = "/v2/models/identity/infer"
#: Seconds a request taken by a worker that died waits before another worker gets it.
VISIBILITY_S = 5


# -- the module's fleet ----------------------------------------------------------------------------

@dataclass
class Fleet:
    db: RedisDatabase
    prefix: str
    env: dict[str, str]
    log_dir: Path
    workers: list[WorkerProcess]
    gateway: GatewayProcess

    @property
    def http(self) -> str:
        return self.gateway.http_url

    def spawn(self, n: int) -> WorkerProcess:
        """A worker of identity and gated on the fleet's database (not yet waited for)."""
        argv = [sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu", "--models",
                "identity,gated", "--hostname", f"hostile{n}@%h", "--concurrency", "32"]
        return WorkerProcess(argv, worker_env(self.db.url, **self.env), self.log_dir / f"w{n}.log")

    def queued(self) -> dict[str, int]:
        """Length of every ``infer.*`` queue of the fleet's database."""
        r = self.db.client
        return {k.decode(): int(r.llen(k)) for k in r.scan_iter(match="infer.*") if r.type(k) == b"list"}


@pytest.fixture(scope="module")
def fleet(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("hostile")
    with redis_databases.take("test_gateway_hostile") as db:
        prefix, r, env = gated_broker(db.url, "hostile", visibility_timeout_s=str(VISIBILITY_S))
        r.close()
        Catalogue(db.client).announce("nobody@nowhere", [{"name": "parked"}])
        fleet = Fleet(db, prefix, env, log_dir, [], None)  # type: ignore[arg-type]
        try:
            fleet.workers = [fleet.spawn(0), fleet.spawn(1)]
            for w in fleet.workers:
                w.wait_ready()
            fleet.gateway = start_gateway(db.url, log_dir / "gateway.log",
                                          ASYNCINFER_MAX_PAYLOAD_BYTES=str(LIMIT))
            yield fleet
        finally:
            if fleet.gateway is not None:
                fleet.gateway.stop()
            for w in fleet.workers:
                if w.process.poll() is None:
                    os.kill(w.pid, signal.SIGCONT)
                w.stop()


def _http(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
          timeout_s: float = 20) -> tuple[int, dict[str, str], bytes]:
    host, port = url.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def _doc(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def _input(**kw: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0], **kw}


def _binary(datatype: str, shape: list[Any], raw: bytes, size: Any = None,
            **header: Any) -> tuple[bytes, dict[str, str]]:
    """A binary body: one input whose ``binary_data_size`` is ``size`` (default len(raw))."""
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape,
                       "parameters": {"binary_data_size": len(raw) if size is None else size}}],
           **header}
    text = json.dumps(doc).encode()
    return text + raw, {"Inference-Header-Content-Length": str(len(text))}


def _good(value: float = 1.0) -> bytes:
    return _doc(inputs=[_input(data=[value, value + 1])])


def _bomb(blocks: int) -> bytes:
    """A gzip body of ``blocks`` MiB of zeros in about 1 KiB each (one compressed block, repeated;
    the trailer's checksum is wrong, which nothing that stops at the limit ever reads)."""
    co = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * (1 << 20)
    head = co.compress(zeros) + co.flush(zlib.Z_FULL_FLUSH)
    block = co.compress(zeros) + co.flush(zlib.Z_FULL_FLUSH)
    return head + block * (blocks - 1) + co.flush()


F32 = struct.pack("<2f", 1.0, 2.0)
GZ = {"Content-Encoding": "gzip"}

# -- REST: each case a 4xx naming the rule, nothing enqueued ---------------------------------------

REST_CASES = [
    # the binary part
    ("truncated binary part", *_binary("FP32", [1, 2], F32[:5], size=8), 400,
     "input 'x': binary_data_size 8 runs past the end of the binary part (5 bytes left)"),
    ("binary part longer than the sizes", _binary("FP32", [1, 2], F32)[0] + b"junk",
     _binary("FP32", [1, 2], F32)[1], 400,
     "the binary part holds 12 bytes but the inputs' binary_data_size add up to 8"),
    ("binary_data_size negative", *_binary("FP32", [1, 2], F32, size=-1), 400,
     "binary_data_size must be a non-negative integer, got -1"),
    ("binary_data_size huge", *_binary("FP32", [1, 2], F32, size=2**70), 400,
     f"binary_data_size {2**70} runs past the end of the binary part"),
    ("binary_data_size a string", *_binary("FP32", [1, 2], F32, size="8"), 400,
     "binary_data_size must be a non-negative integer, got '8'"),
    ("binary_data_size a float", *_binary("FP32", [1, 2], F32, size=8.0), 400,
     "binary_data_size must be a non-negative integer, got 8.0"),
    ("binary_data_size a list", *_binary("FP32", [1, 2], F32, size=[8] * 1000), 400,
     "binary_data_size must be a non-negative integer, got [8, 8, 8, 8, ...]"),
    ("binary_data_size on a JSON input",
     _doc(inputs=[_input(parameters={"binary_data_size": 8})]), {}, 400,
     "input 'x': has both 'data' and binary_data_size; send one"),
    ("binary bytes short of the shape", *_binary("FP32", [1, 3], F32), 400,
     "input 'x': raw data has 8 bytes but 3 FP32 elements need 12 (4 bytes each)"),
    ("binary of an unknown datatype", *_binary("FOO", [1, 2], F32), 400,
     "input 'x': unknown datatype 'FOO'"),
    ("binary BOOL byte 2", *_binary("BOOL", [2], b"\x01\x02"), 400,
     "raw byte 1 is 2; BOOL raw bytes must be 0 or 1"),
    ("binary BYTES length past the end", *_binary("BYTES", [1], b"\xff\xff\xff\x7fabcd"), 400,
     "malformed BYTES binary data: element 0 declares 2147483647 bytes but only 4 remain"),
    ("binary shape 2**40, 8 bytes", *_binary("FP32", [2**40], F32), 400,
     "raw data has 8 bytes but 1099511627776 FP32 elements need 4398046511104"),
    ("binary BYTES shape 2**40, 8 bytes", *_binary("BYTES", [2**40], F32), 400,
     "BYTES binary data has 8 bytes, too few for the 1099511627776 elements"),
    # Inference-Header-Content-Length
    ("header length negative", _good(), {"Inference-Header-Content-Length": "-1"}, 400,
     "Inference-Header-Content-Length must be a non-negative integer, got '-1'"),
    ("header length not a number", _good(), {"Inference-Header-Content-Length": "abc"}, 400,
     "Inference-Header-Content-Length must be a non-negative integer, got 'abc'"),
    ("header length with a sign", _good(), {"Inference-Header-Content-Length": "+5"}, 400,
     "Inference-Header-Content-Length must be a non-negative integer, got '+5'"),
    ("header length past the body", _good(), {"Inference-Header-Content-Length": "99999"}, 400,
     "Inference-Header-Content-Length is 99999 but the body has 84 bytes"),
    ("header length of 60 digits", _good(), {"Inference-Header-Content-Length": "9" * 60}, 400,
     "Inference-Header-Content-Length is 99999999999999999999... (60 digits) but the body has 84"),
    # shapes
    *[(f"shape {shape!r}", _doc(inputs=[_input(shape=shape)]), {}, 400,
       f"input 'x': shape must be a non-empty list of non-negative integers, got {shape!r}")
      for shape in ([-1, 2], [1.0, 2], ["1", 2], [True, 2], [], None, "12", {"a": 1})],
    ("shape [0] with data", _doc(inputs=[_input(shape=[0])]), {}, 400,
     "data has 2 elements but shape [0] needs 0"),
    ("shape [2**40] with 2 elements", _doc(inputs=[_input(shape=[2**40])]), {}, 400,
     "data has 2 elements but shape [1099511627776] needs 1099511627776"),
    ("shape [2**40, 2**40] with 2 elements", _doc(inputs=[_input(shape=[2**40, 2**40])]), {}, 400,
     "needs 1208925819614629174706176"),
    ("shape [2**64] BYTES", _doc(inputs=[_input(shape=[2**64], datatype="BYTES", data=["a"])]), {},
     400, "data has 1 elements but shape [18446744073709551616] needs"),
    # datatypes
    ("datatype unknown", _doc(inputs=[_input(datatype="FP31")]), {}, 400,
     "input 'x': unknown datatype 'FP31'; accepted datatypes: BOOL, UINT8"),
    ("datatype lowercase", _doc(inputs=[_input(datatype="fp32")]), {}, 400,
     "input 'x': unknown datatype 'fp32'"),
    ("datatype a number", _doc(inputs=[_input(datatype=32)]), {}, 400,
     "input 'x': needs a 'datatype' string"),
    ("datatype null", _doc(inputs=[_input(datatype=None)]), {}, 400,
     "input 'x': needs a 'datatype' string"),
    # data
    ("data nested wrongly", _doc(inputs=[_input(data=[[1.0], 2.0])]), {}, 400,
     "data mixes nested lists with scalar elements"),
    ("data ragged", _doc(inputs=[_input(data=[[1.0], [2.0, 3.0]])]), {}, 400,
     "data has 3 elements but shape [1, 2] needs 2"),
    ("strings in FP32", _doc(inputs=[_input(data=["1", "2"])]), {}, 400,
     "data element 0 is a str ('1'); FP32 elements must be numbers"),
    ("bools in INT8", _doc(inputs=[_input(datatype="INT8", data=[True, False])]), {}, 400,
     "data element 0 is a bool (True); INT8 elements must be integers"),
    ("INT8 out of range", _doc(inputs=[_input(datatype="INT8", data=[1, 128])]), {}, 400,
     "data element 1 = 128 is out of range for INT8 [-128, 127]"),
    ("UINT64 negative", _doc(inputs=[_input(datatype="UINT64", data=[-1, 0])]), {}, 400,
     "data element 0 = -1 is out of range for UINT64"),
    ("FP32 beyond float64", _doc(inputs=[_input(data=[10**400, 1])]), {}, 400,
     "data element 0 is out of range for FP32"),
    ("floats in INT32", _doc(inputs=[_input(datatype="INT32", data=[1.5, 2.0])]), {}, 400,
     "data element 0 is a float (1.5); INT32 elements must be integers"),
    ("BYTES element a number", _doc(inputs=[_input(datatype="BYTES", data=[1, "a"])]), {}, 400,
     "data element 0 is a int (1); BYTES elements must be str or bytes"),
    ("BYTES element an object", _doc(inputs=[_input(datatype="BYTES", data=["a", {}])]), {}, 400,
     "data element 1 is a dict ({}); BYTES elements must be str or bytes"),
    ("data missing", _doc(inputs=[{"name": "x", "datatype": "FP32", "shape": [1]}]), {}, 400,
     "input 'x': needs 'data' (or binary_data_size"),
    # inputs
    ("duplicate input names", _doc(inputs=[_input(), _input()]), {}, 400,
     "input 'x': duplicate input name (input #0 has it too)"),
    ("input not an object", _doc(inputs=[[1, 2]]), {}, 400, "input #0 must be an object, got list"),
    ("input without a name", _doc(inputs=[_input(name="")]), {}, 400, "input #0 needs a 'name' string"),
    ("no inputs", _doc(inputs=[]), {}, 400, "'inputs' must be a non-empty list"),
    ("10,000 inputs, the last one bad", _doc(inputs=[_input(name=f"x{i}") for i in range(9999)]
                                         + [_input(name="last", shape=[1, 3])]), {}, 400,
     "input 'last': data has 2 elements but shape [1, 3] needs 3"),
    # the JSON itself
    ("100k nested arrays", b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400,
     "request body is not valid JSON: it nests arrays or objects too deeply"),
    ("100k nested objects", b'{"parameters":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001, {},
     400, "nests arrays or objects too deeply"),
    ("not UTF-8", b'{"id": "\xff\xfe", "inputs": []}', {}, 400, "request body is not valid JSON"),
    ("not JSON", b"{inputs: 1}", {}, 400, "request body is not valid JSON"),
    ("not an object", b"[1, 2]", {}, 400, "request body must be a JSON object, got list"),
    ("an integer of 5000 digits", b'{"inputs": [' + b"1" * 5000 + b"]}", {}, 400,
     "request body is not valid JSON"),
    # the request id (a label: any string) and the idempotency key (the request ID)
    ("id a number", _doc(id=5, inputs=[_input()]), {}, 400, "'id' must be a string, got 5"),
    ("idempotency key with a space", _doc(id="a\nb", parameters={"idempotency_key": "a b"},
                                          inputs=[_input()]), {}, 400,
     "request a\\nb: the idempotency key 'a b' must be 1 to 200 printable characters without "
     "whitespace (it is the request ID)"),
    ("idempotency key of 600 characters", _doc(inputs=[_input()]),
     {"Idempotency-Key": "x" * 600}, 400,
     "request (no id): the idempotency key 'xxx"),
    ("idempotency key a number", _doc(id="7", parameters={"idempotency_key": 5},
                                      inputs=[_input()]), {}, 400,
     "request 7: parameter 'idempotency_key' must be a string, got int"),
    ("two idempotency keys that differ", _doc(parameters={"idempotency_key": "k1"},
                                              inputs=[_input()]), {"Idempotency-Key": "k2"}, 400,
     "the idempotency key is given twice and the two differ"),
    ("id a long list", _doc(id=list(range(10_000)), inputs=[_input()]), {}, 400,
     "'id' must be a string, got [0, 1, 2, 3, ...]"),
    # parameters
    ("parameters a list", _doc(parameters=[1], inputs=[_input()]), {}, 400,
     "request 'parameters' must be an object, got list"),
    ("parameters a string", _doc(parameters="x", inputs=[_input()]), {}, 400,
     "request 'parameters' must be an object, got str"),
    ("input parameters a list", _doc(inputs=[_input(parameters=[1])]), {}, 400,
     "input 'x': input 'parameters' must be an object, got list"),
    *[(f"priority {v!r}", _doc(parameters={"priority": v}, inputs=[_input()]), {}, 400,
       f"parameter 'priority' must be a non-negative integer, got {v!r}")
      for v in (-1, "3", 3.0, True)],
    *[(f"timeout {v!r:.20}", _doc(parameters={"timeout": v}, inputs=[_input()]), {}, 400,
       f"parameter 'timeout' must be a number of microseconds above 0 and at most "
       f"2592000000000 (30 days), got {v!r:.40}")
      for v in (0, -5, "10", True, float("inf"), 1e308, 10**400, 2**64 - 1)],
    # outputs
    ("outputs not a list", _doc(inputs=[_input()], outputs={"name": "x"}), {}, 400,
     "'outputs' must be a list"),
    ("output without a name", _doc(inputs=[_input()], outputs=[{}]), {}, 400,
     "each of 'outputs' must be an object with a 'name', got {}"),
    ("output parameters a list", _doc(inputs=[_input()], outputs=[{"name": "x", "parameters": [1]}]),
     {}, 400, "output 'x': output 'parameters' must be an object, got list"),
    *[(f"output classification {v!r}", _doc(inputs=[_input()], outputs=[
        {"name": "x", "parameters": {"classification": v}}]), {}, 400,
       f"output 'x': parameter 'classification' must be a non-negative integer (how many classes "
       f"to return), got {v!r}") for v in (-1, "2", 2.0, True, None)],
    # a sequence's parameters on a stateless model, and malformed ones: refused by name
    *[(f"{name} {value!r}", _doc(parameters={name: value}, inputs=[_input()]), {}, 400, says)
      for name, value, says in [
          ("sequence_id", 42, "model 'parked' is not stateful (it declares no sequence "
                              "batching): parameter 'sequence_id' is not served for it"),
          ("sequence_id", "s1", "parameter 'sequence_id' is not served for it"),
          ("sequence_id", -1, "parameter 'sequence_id' must be an unsigned 64-bit integer or a "
                              "string, got -1"),
          ("sequence_id", 0.0, "parameter 'sequence_id' must be an unsigned 64-bit integer or a "
                               "string, got 0.0"),
          ("sequence_start", True, "parameter 'sequence_start' needs a non-zero 'sequence_id'"),
          ("sequence_end", True, "parameter 'sequence_end' needs a non-zero 'sequence_id'"),
          ("sequence_start", 0, "parameter 'sequence_start' must be a boolean, got 0"),
          ("sequence_end", "false", "parameter 'sequence_end' must be a boolean, got 'false'")]],
    ("a sequence's three parameters", _doc(id="7", parameters={
        "sequence_id": 5, "sequence_start": True, "sequence_end": False}, inputs=[_input()]), {},
     400, "request 7: model 'parked' is not stateful"),
    ("a triton_ parameter", _doc(parameters={"triton_anything": 1}, inputs=[_input()]), {}, 400,
     "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
     "specified: parameter 'triton_anything' is not served over HTTP (served: none)"),
    ("the empty final response over HTTP", _doc(parameters={
        "triton_enable_empty_final_response": True}, inputs=[_input()]), {}, 400,
     "parameter 'triton_enable_empty_final_response' is not served over HTTP"),
    *[(f"input {', '.join(given)}", _doc(inputs=[_input(parameters={
        k: "r" if k == "shared_memory_region" else 8 for k in given})]), {}, 400, f"input 'x': {says}")
      for given, says in [
          (("shared_memory_region",), "'shared_memory_region' needs 'shared_memory_byte_size'"),
          (("shared_memory_byte_size",), "'shared_memory_byte_size' or 'shared_memory_offset' "
                                         "without 'shared_memory_region'"),
          (("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"),
           "only one of 'data', 'binary_data_size' in 'parameters', 'shared_memory_region' in "
           "'parameters' may be set")]],
    ("input in a region never registered", _doc(inputs=[{
        "name": "x", "datatype": "FP32", "shape": [1, 2],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]), {}, 400,
     "input 'x': Unable to find system shared memory region: 'r'"),
    ("output in a region never registered", _doc(inputs=[_input()], outputs=[{
        "name": "x", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]),
     {}, 400, "output 'x': Unable to find system shared memory region: 'r'"),
    ("output in a region and binary", _doc(inputs=[_input()], outputs=[{
        "name": "x", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8,
                                    "binary_data": True}}]),
     {}, 400, "output 'x': Output can't set both 'shared_memory_region' and 'binary_data'"),
    # Content-Encoding and size
    ("gzip bomb (100 MiB of zeros in 100 KiB)", _bomb(100), GZ, 413,
     f"request body inflates to more than the gateway's limit of {LIMIT} bytes"),
    ("says gzip, is not", _good(), GZ, 400, "request body is not valid gzip data"),
    ("says deflate, is not", b"\x78\x9c" + _good(), {"Content-Encoding": "deflate"}, 400,
     "request body is not valid deflate data"),
    ("gzip cut short", zlib.compress(_good() * 100, wbits=31)[:40], GZ, 400,
     "request body is cut short"),
    ("gzip then garbage", zlib.compress(_good(), wbits=31) + b"garbage!", GZ, 400,
     "request body is not valid gzip data"),
    ("an encoding the gateway does not know", _good(), {"Content-Encoding": "zstd-nope"}, 415,
     "request body has Content-Encoding 'zstd-nope'; accepted: gzip, deflate, identity"),
    ("brotli", _good(), {"Content-Encoding": "br"}, 415, "accepted: gzip, deflate, identity"),
    ("two encodings", _good(), {"Content-Encoding": "gzip, gzip"}, 415, "accepted: gzip"),
    ("a body over the limit", b" " * (LIMIT + 1), {}, 413,
     f"request body is larger than the gateway's limit of {LIMIT} bytes"),
]


@pytest.mark.parametrize(("body", "headers", "status", "message"),
                         [pytest.param(*case[1:], id=case[0]) for case in REST_CASES])
def test_a_bad_rest_request_gets_a_4xx_naming_the_rule_and_nothing_is_enqueued(
        fleet: Fleet, body: bytes, headers: dict[str, str], status: int, message: str) -> None:
    queued = fleet.queued().get("infer.parked", 0)
    got, response_headers, answer = _http(fleet.http, "POST", PARKED, body, headers, timeout_s=10)
    assert got == status, answer[:300]
    assert response_headers["Content-Type"].startswith("application/json")
    error = json.loads(answer)["error"]
    assert message in error, error
    assert len(error) < 600, error  # a hostile value is quoted short, never echoed whole
    assert fleet.queued().get("infer.parked", 0) == queued


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/v2/models/../infer", 404, "Request for unknown model: '..' is not found: no worker"),
    ("/v2/models/%2e%2e/infer", 404, "Request for unknown model: '..' is not found"),
    # control characters shown escaped
    ("/v2/models/%00/infer", 404, "Request for unknown model: '\\x00' is not found"),
    ("/v2/models/infer.parked/infer", 404, "Request for unknown model: 'infer.parked' is not found"),
    ("/v2/models/park%20ed/infer", 404, "Request for unknown model: 'park ed' is not found"),
    ("/v2/models/parked%2Finfer/infer", 404, "Request for unknown model: 'parked/infer' is not found"),
    ("/v2/models/" + "m" * 3000 + "/infer", 404, "Request for unknown model: 'mmmmmmmm"),
    ("/v2/models/parked/versions/2/infer", 404,
     "Request for unknown model: 'parked' version 2 is not found: the fleet has versions 1 of it"),
    # a version string that can name no version: Triton's 400 (INVALID_ARG) and words
    ("/v2/models/parked/versions/../infer", 400,
     "failed to get model version from specified version string '..': a version is letters and "
     "digits (model 'parked')"),
    ("/v2/models/parked/versions/%00/infer", 400,
     "failed to get model version from specified version string '\\x00'"),
    ("/v2/models/parked/versions/-1/infer", 400, "invalid model version specified '-1'"),
    ("/v2/models/parked/infer/more", 404, "no such route: POST /v2/models/parked/infer/more"),
    ("/v2/nothing", 404, "no such route: POST /v2/nothing"),
], ids=lambda v: v[:40] if isinstance(v, str) and v.startswith("/") else "")
def test_odd_model_names_and_versions_are_refused_and_nothing_is_enqueued(
        fleet: Fleet, path: str, status: int, message: str) -> None:
    queued = fleet.queued().get("infer.parked", 0)
    got, _, answer = _http(fleet.http, "POST", path, _good(), timeout_s=10)
    assert got == status, answer[:300]
    error = json.loads(answer)["error"]
    assert error.startswith(message), error  # Triton's words first, where Triton has them
    assert set(fleet.queued()) <= {"infer.parked", "infer.identity", "infer.gated"}
    assert fleet.queued().get("infer.parked", 0) == queued


#: How a bad ``timeout`` parameter is refused (then the value given).
TIMEOUT_RULE = ("parameter 'timeout' must be a number of microseconds above 0 and at most "
                "2592000000000 (30 days), got ")

ROUTES = {"/v2/health/live": "GET, HEAD", "/v2/health/ready": "GET, HEAD", "/v2": "GET, HEAD",
          "/v2/models/identity": "GET, HEAD", "/v2/models/identity/ready": "GET, HEAD",
          "/v2/models/identity/config": "GET, HEAD", "/v2/models/identity/versions/1": "GET, HEAD",
          "/v2/models/identity/infer": "POST", "/v2/models/identity/versions/1/infer": "POST"}


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "GET", "POST"])
def test_other_methods_get_405_naming_the_allowed_ones(fleet: Fleet, method: str) -> None:
    for path, allowed in ROUTES.items():
        if method in allowed:
            continue
        status, headers, answer = _http(fleet.http, method, path, b"{}")
        assert status == 405, (path, answer)
        assert json.loads(answer)["error"] == (f"method {method} is not allowed on {path} "
                                               f"(allowed: {allowed})")
        assert headers["Allow"]
    assert fleet.queued().get("infer.identity", 0) == 0


def test_a_method_http_does_not_know_gets_400(fleet: Fleet) -> None:
    host, port = fleet.http.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"FOO /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).split(b" ")[1] == b"400"


@pytest.mark.parametrize(("body", "headers", "check"), [
    pytest.param(_doc(inputs=[_input(shape=[0], data=[])]), {},
                 lambda doc: doc["outputs"][0]["shape"] == [0] and doc["outputs"][0]["data"] == [],
                 id="shape [0]"),
    pytest.param(_doc(inputs=[_input(shape=[0, 2], data=[])]), {},
                 lambda doc: doc["outputs"][0]["shape"] == [0, 2], id="shape [0, 2]"),
    pytest.param(_doc(inputs=[_input(name=f"x{i}", data=[i, 0]) for i in range(10_000)]), {},
                 lambda doc: len(doc["outputs"]) == 10_000 and doc["outputs"][9999]["data"] == [9999, 0],
                 id="10,000 inputs"),
    pytest.param(_doc(id="", inputs=[_input()]), {}, lambda doc: "id" not in doc, id="empty id"),
    *[pytest.param(_doc(id=label, inputs=[_input()]), {}, lambda doc, label=label: doc["id"] == label,
                   id=f"id {name} (a label, echoed)")
      for name, label in [("with spaces", "my request id"), ("with a line break", "a\nb"),
                          ("of 600 characters", "y" * 600), ("with a NUL", "\x00"),
                          ("of one space", " ")]],
    pytest.param(_doc(parameters={"priority": 2**70}, inputs=[_input()]), {},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="priority 2**70 (served as 9)"),
    pytest.param(_doc(parameters={"timeout": 30_000_000, "custom": {"nested": [1, [2]]}},
                      inputs=[_input()]), {},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="timeout and own parameters"),
    *[pytest.param(_doc(parameters=parameters, inputs=[_input()]), {},
                   lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id=f"sequence defaults {i}")
      for i, parameters in enumerate([
          {"sequence_id": 0, "sequence_start": False, "sequence_end": False},
          {"sequence_id": ""}, {"sequence_start": False}, {"headers": {"x": "y"}}])],
    pytest.param(_doc(inputs=[_input(parameters={"content_type": "np"})],
                      outputs=[{"name": "x", "parameters": {"content_type": "np",
                                                            "classification": 0}}]), {},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0],
                 id="tensor parameters Triton ignores, classification 0"),
    pytest.param(zlib.compress(_good(), wbits=31) + zlib.compress(b" ", wbits=31), GZ,
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="gzip of two members"),
    pytest.param(zlib.compress(_good(), wbits=-15), {"Content-Encoding": "deflate"},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="raw deflate"),
    pytest.param(zlib.compress(_good()), {"Content-Encoding": "DEFLATE"},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="deflate in capitals"),
    pytest.param(_good(), {"Content-Encoding": "identity"},
                 lambda doc: doc["outputs"][0]["data"] == [1.0, 2.0], id="identity encoding"),
])
def test_odd_but_valid_requests_are_answered(fleet: Fleet, body: bytes, headers: dict[str, str],
                                             check: Any) -> None:
    status, _, answer = _http(fleet.http, "POST", IDENTITY, body, headers)
    assert status == 200, answer[:300]
    assert check(json.loads(answer))


# -- gRPC: the same rules, INVALID_ARGUMENT and friends --------------------------------------------

def _tensor(name: str = "x", datatype: str = "FP32", shape: tuple[int, ...] = (1, 2),
            **kw: Any) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(shape), **kw)


def _request(model: str = "parked", inputs: Any = None, raw: Any = None, **kw: Any) -> pb.ModelInferRequest:
    inputs = [_tensor()] if inputs is None else inputs
    raw = [F32] * len(inputs) if raw is None else raw
    return pb.ModelInferRequest(model_name=model, inputs=inputs, raw_input_contents=raw, **kw)


def _p(**kw: Any) -> pb.InferParameter:
    return pb.InferParameter(**kw)


def _output(name: str = "x", **kw: Any) -> pb.ModelInferRequest.InferRequestedOutputTensor:
    return pb.ModelInferRequest.InferRequestedOutputTensor(name=name, **kw)


C = pb.InferTensorContents
INVALID = "INVALID_ARGUMENT"
GRPC_CASES = [
    ("raw contents for some inputs only", _request(inputs=[_tensor(), _tensor("y")], raw=[F32]),
     INVALID, "1 raw_input_contents for 2 inputs"),
    ("raw bytes of the wrong length", _request(raw=[F32[:5]]), INVALID,
     "input 'x': raw data has 5 bytes but 2 FP32 elements need 8"),
    ("raw of an unknown datatype", _request(inputs=[_tensor(datatype="FOO")]), INVALID,
     "input 'x': unknown datatype 'FOO'"),
    ("raw, negative shape", _request(inputs=[_tensor(shape=(-1, 2))]), INVALID,
     "input 'x': shape must be a non-empty list of non-negative integers, got [-1, 2]"),
    ("raw, no shape", _request(inputs=[_tensor(shape=())]), INVALID,
     "shape must be a non-empty list of non-negative integers, got []"),
    ("raw, shape 2**40", _request(inputs=[_tensor(shape=(2**40,))]), INVALID,
     "raw data has 8 bytes but 1099511627776 FP32 elements need"),
    ("raw, shape 2**62 x 4", _request(inputs=[_tensor(shape=(2**62, 4))]), INVALID,
     "raw data has 8 bytes but 18446744073709551616 FP32 elements need"),
    ("raw BOOL byte 2", _request(inputs=[_tensor(datatype="BOOL", shape=(2,))], raw=[b"\x00\x02"]),
     INVALID, "raw byte 1 is 2; BOOL raw bytes must be 0 or 1"),
    ("raw BYTES length past the end", _request(inputs=[_tensor(datatype="BYTES", shape=(1,))],
                                               raw=[b"\xff\xff\xff\x7fab"]),
     INVALID, "malformed BYTES binary data"),
    ("contents in the wrong field", _request(inputs=[_tensor(contents=C(int_contents=[1, 2]))], raw=[]),
     INVALID, "input 'x': has int_contents (FP32 data belongs in fp32_contents)"),
    ("contents for FP16", _request(inputs=[_tensor(datatype="FP16", contents=C(fp32_contents=[1, 2]))],
                                   raw=[]),
     INVALID, "FP16 data travels in raw_input_contents only"),
    ("contents of an unknown datatype", _request(inputs=[_tensor(datatype="fp32",
                                                                 contents=C(fp32_contents=[1, 2]))],
                                                 raw=[]),
     INVALID, "input 'x': unknown datatype 'fp32'"),
    ("contents, negative shape", _request(inputs=[_tensor(shape=(-2,), contents=C(fp32_contents=[1, 2]))],
                                          raw=[]),
     INVALID, "shape must be a non-empty list of non-negative integers, got [-2]"),
    ("contents, shape 2**40", _request(inputs=[_tensor(shape=(2**40,), contents=C(fp32_contents=[1, 2]))],
                                       raw=[]),
     INVALID, "data has 2 elements but shape [1099511627776] needs"),
    ("contents INT8 out of range", _request(inputs=[_tensor(datatype="INT8",
                                                            contents=C(int_contents=[1, 300]))], raw=[]),
     INVALID, "data element 1 = 300 is out of range for INT8"),
    ("contents and raw", _request(inputs=[_tensor(contents=C(fp32_contents=[1, 2]))]), INVALID,
     "contents field must not be specified when using raw_input_contents for 'x' for model "
     "'parked' (request (no id): give an input's data in one or the other)"),
    ("no data at all", _request(inputs=[_tensor()], raw=[]), INVALID,
     "data has 0 elements but shape [1, 2] needs 2"),
    ("no inputs", _request(inputs=[]), INVALID, "a v2 request needs at least one input"),
    ("duplicate input names", _request(inputs=[_tensor(), _tensor()]), INVALID,
     "input 'x': duplicate input name (input #0 has it too)"),
    ("input without a name", _request(inputs=[_tensor(name="")]), INVALID, "input #0 needs a name"),
    ("shared memory without its size", _request(inputs=[_tensor(parameters={
        "shared_memory_region": _p(string_param="r")})]),
     INVALID, "input 'x': 'shared_memory_region' needs 'shared_memory_byte_size'"),
    ("shared memory offset and size", _request(inputs=[_tensor(parameters={
        "shared_memory_offset": _p(int64_param=0), "shared_memory_byte_size": _p(int64_param=8)})]),
     INVALID, "input 'x': 'shared_memory_byte_size' or 'shared_memory_offset' without "
              "'shared_memory_region'"),
    ("input in a region never registered", _request(inputs=[_tensor(parameters={
        "shared_memory_region": _p(string_param="r"), "shared_memory_byte_size": _p(int64_param=8)})],
        raw=[]), INVALID, "input 'x': Unable to find system shared memory region: 'r'"),
    ("output in a region never registered", _request(outputs=[_output(parameters={
        "shared_memory_region": _p(string_param="r"), "shared_memory_byte_size": _p(int64_param=8)})]),
     INVALID, "output 'x': Unable to find system shared memory region: 'r'"),
    *[(f"output classification {name}", _request(outputs=[_output(parameters={"classification": p})]),
       INVALID, f"output 'x': invalid value for 'classification' parameter, expected a positive "
                f"int64_param (how many classes to return), got {shown}")
      for name, p, shown in [("0", _p(int64_param=0), "0"), ("-2", _p(int64_param=-2), "-2"),
                             ("a string", _p(string_param="2"), "'2'"),
                             ("a double", _p(double_param=2.0), "2.0"),
                             ("a bool", _p(bool_param=True), "True"), ("unset", _p(), "None")]],
    *[(f"{name} {shown}", _request(id="q", parameters={name: p}), INVALID, f"request q: {says}")
      for name, p, shown, says in [
          ("sequence_id", _p(int64_param=7), "7", "model 'parked' is not stateful"),
          ("sequence_id", _p(uint64_param=2**64 - 1), str(2**64 - 1),
           "model 'parked' is not stateful"),
          ("sequence_id", _p(string_param="s1"), "'s1'", "model 'parked' is not stateful"),
          ("sequence_start", _p(bool_param=True), "True",
           "parameter 'sequence_start' needs a non-zero 'sequence_id'"),
          ("sequence_end", _p(int64_param=0), "0",
           "parameter 'sequence_end' must be a boolean, got 0")]],
    ("a triton_ parameter", _request(parameters={"triton_anything": _p(bool_param=True)}), INVALID,
     "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
     "specified: parameter 'triton_anything' is not served over GRPC (served: "
     "triton_enable_empty_final_response)"),
    ("the empty final response a string", _request(parameters={
        "triton_enable_empty_final_response": _p(string_param="true")}), INVALID,
     "invalid value type for 'triton_enable_empty_final_response' parameter, expected a boolean, "
     "got 'true'"),
    ("idempotency key with a space", _request(id="a b", parameters={
        "idempotency_key": _p(string_param="a b")}), INVALID,
     "request a b: the idempotency key 'a b' must be 1 to 200 printable characters"),
    ("idempotency key a number", _request(id="\x00", parameters={
        "idempotency_key": _p(int64_param=5)}), INVALID,
     "request \\x00: parameter 'idempotency_key' must be a string, got int"),
    ("priority negative", _request(parameters={"priority": _p(int64_param=-1)}), INVALID,
     "parameter 'priority' must be a non-negative integer, got -1"),
    ("priority a string", _request(parameters={"priority": _p(string_param="3")}), INVALID,
     "parameter 'priority' must be a non-negative integer, got '3'"),
    ("priority a bool", _request(parameters={"priority": _p(bool_param=True)}), INVALID,
     "parameter 'priority' must be a non-negative integer, got True"),
    ("timeout zero", _request(parameters={"timeout": _p(int64_param=0)}), INVALID,
     TIMEOUT_RULE + "0"),
    ("timeout negative", _request(parameters={"timeout": _p(double_param=-1.5)}), INVALID,
     TIMEOUT_RULE + "-1.5"),
    *[(f"timeout {v!r}", _request(parameters={"timeout": p}), INVALID,
       f"parameter 'timeout' must be a number of microseconds above 0 and at most 2592000000000 "
       f"(30 days), got {v!r}")
      for v, p in ((float("inf"), _p(double_param=float("inf"))),
                   (float("nan"), _p(double_param=float("nan"))),
                   (2**64 - 1, _p(uint64_param=2**64 - 1)))],
    ("timeout a string", _request(parameters={"timeout": _p(string_param="10")}), INVALID,
     TIMEOUT_RULE + "'10'"),
    ("empty model name", _request(model=""), "NOT_FOUND", "Request for unknown model: '' is not found"),
    ("model infer.parked", _request(model="infer.parked"), "NOT_FOUND",
     "Request for unknown model: 'infer.parked' is not found"),
    ("model ..", _request(model=".."), "NOT_FOUND", "Request for unknown model: '..' is not found"),
    ("version 2", _request(model_version="2"), "NOT_FOUND",
     "Request for unknown model: 'parked' version 2 is not found"),
    ("version wrong_specification", _request(model_version="wrong_specification"), INVALID,
     "failed to get model version from specified version string 'wrong_specification'"),
    ("a message over the limit", _request(inputs=[_tensor(datatype="UINT8", shape=(LIMIT + 1,))],
                                          raw=[b"\0" * (LIMIT + 1)]),
     "RESOURCE_EXHAUSTED", "Received message larger than max"),
]


@pytest.fixture(scope="module")
def infer_rpc(fleet: Fleet) -> Iterator[Any]:
    channel = grpc.insecure_channel(fleet.gateway.grpc_url,
                                    options=[("grpc.max_send_message_length", 4 * LIMIT)])
    try:
        yield channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelInferResponse.FromString)
    finally:
        channel.close()


@pytest.mark.parametrize(("request_", "code", "message"),
                         [pytest.param(*case[1:], id=case[0]) for case in GRPC_CASES])
def test_a_bad_grpc_request_gets_its_code_naming_the_rule_and_nothing_is_enqueued(
        fleet: Fleet, infer_rpc: Any, request_: pb.ModelInferRequest, code: str, message: str) -> None:
    queued = fleet.queued().get("infer.parked", 0)
    with pytest.raises(grpc.RpcError) as caught:
        infer_rpc(request_, timeout=10)
    assert caught.value.code().name == code, caught.value.details()
    assert message in caught.value.details(), caught.value.details()
    assert len(caught.value.details()) < 600
    assert fleet.queued().get("infer.parked", 0) == queued


@pytest.mark.parametrize("parameter", [
    _p(bool_param=True), _p(int64_param=-(2**63)), _p(string_param="ünï\x00"), _p(double_param=-0.5),
    _p(uint64_param=2**64 - 1), _p()], ids=["bool", "int64", "string", "double", "uint64", "unset"])
def test_grpc_parameters_of_every_type_travel_and_the_call_is_answered(infer_rpc: Any,
                                                                       parameter: pb.InferParameter) -> None:
    response = infer_rpc(_request("identity", parameters={"own": parameter,
                                                          "priority": _p(uint64_param=2**64 - 1)}),
                         timeout=20)
    assert [o.name for o in response.outputs] == ["x"]
    assert response.raw_output_contents[0] == F32
    assert response.parameters["worker"].string_param.startswith("hostile")


@pytest.mark.parametrize("parameters", [
    {"sequence_id": _p(int64_param=0), "sequence_start": _p(bool_param=False),
     "sequence_end": _p(bool_param=False)},
    {"sequence_id": _p(string_param="")},
    {"triton_enable_empty_final_response": _p(bool_param=True)},
], ids=["sequence defaults", "empty sequence id", "empty final response"])
def test_grpc_default_sequence_parameters_and_the_served_triton_one_pass(
        infer_rpc: Any, parameters: dict[str, pb.InferParameter]) -> None:
    response = infer_rpc(_request("identity", parameters=parameters), timeout=20)
    assert response.raw_output_contents[0] == F32


def test_grpc_10000_inputs_are_answered(infer_rpc: Any) -> None:
    inputs = [_tensor(f"x{i}", "INT32", (1,)) for i in range(10_000)]
    response = infer_rpc(_request("identity", inputs, [struct.pack("<i", i) for i in range(10_000)]),
                         timeout=25)
    assert len(response.outputs) == 10_000
    assert response.raw_output_contents[9999] == struct.pack("<i", 9999)


# -- the environment: clients, workers and Redis misbehave ------------------------------------------

def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) / 1024


def test_a_gzip_bomb_is_refused_after_the_limit_not_inflated_to_its_end(fleet: Fleet) -> None:
    # Given a body of 0.9 MiB (under the 1 MiB limit) that inflates to 900 MiB
    bomb = _bomb(900)
    assert len(bomb) < LIMIT
    pid = fleet.gateway.pid
    cpu, rss = _cpu_s(pid), _rss_mib(pid)
    # When it is sent, Then it is refused with 413 at once
    started = time.monotonic()
    status, _, answer = _http(fleet.http, "POST", PARKED, bomb, GZ)
    assert status == 413 and "inflates to more than" in json.loads(answer)["error"]
    assert time.monotonic() - started < 2
    # And the gateway did about a limit's worth of work for it, not 900 MiB of inflating
    assert _http(fleet.http, "GET", "/v2/health/live", timeout_s=2)[0] == 200
    time.sleep(0.5)
    assert _cpu_s(pid) - cpu < 0.3, "the gateway kept inflating the bomb"
    assert _rss_mib(pid) - rss < 32


def test_a_client_that_hangs_up_mid_body_leaves_nothing_behind(fleet: Fleet) -> None:
    host, port = fleet.http.rsplit(":", 1)
    logged = len(fleet.gateway.log())
    queued = fleet.queued().get("infer.parked", 0)
    request_id = f"hangup-{os.urandom(4).hex()}"
    body = _doc(id=request_id, inputs=[_input()])
    for sent in (0, 10, len(body) - 1):
        with socket.create_connection((host, int(port))) as s:  # a slow upload, then gone
            s.sendall(f"POST {PARKED} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:sent])
            time.sleep(0.2)
    # a chunked upload cut off in the middle of a chunk
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {PARKED} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  f"{len(body):x}\r\n".encode() + body[:20])
        time.sleep(0.2)
    status, _, answer = _http(fleet.http, "POST", IDENTITY, _good(7.0))
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [7.0, 8.0]
    assert fleet.queued().get("infer.parked", 0) == queued
    assert not fleet.db.client.exists(f"{CLAIM_PREFIX}{request_id}")
    assert "Traceback" not in fleet.gateway.log()[logged:]


def test_50_idle_connections_do_not_keep_a_good_request_out(fleet: Fleet) -> None:
    host, port = fleet.http.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(50)]
    half = [socket.create_connection((host, int(port))) for _ in range(10)]
    try:
        for s in half:  # and some that stop in the middle of their headers
            s.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Le")
        started = time.monotonic()
        status, _, answer = _http(fleet.http, "POST", IDENTITY, _good(3.0), timeout_s=5)
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [3.0, 4.0]
        assert time.monotonic() - started < 2
        assert _http(fleet.http, "GET", "/v2/health/ready", timeout_s=5)[0] == 200
    finally:
        for s in idle + half:
            s.close()


def _gated_call(fleet: Fleet, run: str, i: int) -> tuple[int, Any]:
    """Infer row ``i`` of "gated" through the gateway as request ``<prefix>-<run>-<i>``;
    (status, the answer's data or error)."""
    request_id = f"{fleet.prefix}-{run}-{i}"
    body = _doc(id=request_id, inputs=[
        {"name": "index", "datatype": "FP64", "shape": [1, 1], "data": [float(i)]}])
    try:
        status, _, answer = _http(fleet.http, "POST", "/v2/models/gated/infer", body, timeout_s=25)
    except OSError as exc:
        return -1, repr(exc)
    doc = json.loads(answer)
    if status != 200:
        return status, doc.get("error")
    assert doc["id"] == request_id
    return status, doc["outputs"][0]["data"]


def _counts(fleet: Fleet, results: dict[int, tuple[int, Any]], n: int = 40) -> dict[str, int]:
    """Sent / answered (with its own input) / lost / ran twice / never ran, of requests 0 … n-1;
    the gated model's executions are reset for the next run."""
    executions = gated_executions(fleet.db.client, fleet.prefix)
    fleet.db.client.delete(f"{fleet.prefix}:executions")
    answered = sum(1 for i in range(n) if results.get(i) == (200, [float(i)]))
    return {"sent": n, "answered": answered, "lost": n - answered,
            "ran_twice": sum(1 for i in range(n) if executions.get(i, 0) > 1),
            "never_ran": sum(1 for i in range(n) if executions.get(i, 0) == 0)}


def _record(results: dict[int, tuple[int, Any]], i: int, fleet: Fleet, run: str) -> None:
    results[i] = _gated_call(fleet, run, i)


def _all_taken(fleet: Fleet, n: int) -> bool:
    """Whether the workers hold ``n`` requests unacknowledged and none waits on the queue."""
    return int(fleet.db.client.hlen("unacked")) == n and not fleet.queued().get("infer.gated")


def _hold(fleet: Fleet, pool: ThreadPoolExecutor, run: str, results: dict[int, tuple[int, Any]]) -> None:
    """With the gate closed, send requests 0-19 while only the first worker takes (the second
    frozen), then 20-39 while only the second does: each worker holds 20, stuck in forward."""
    r = fleet.db.client
    r.set(f"{fleet.prefix}:gate", "closed")
    try:
        for taker, other, first in ((fleet.workers[0], fleet.workers[1], 0),
                                    (fleet.workers[1], fleet.workers[0], 20)):
            os.kill(other.pid, signal.SIGSTOP)
            try:
                for i in range(first, first + 20):
                    pool.submit(_record, results, i, fleet, run)
                wait_for(functools.partial(_all_taken, fleet, first + 20), 10,
                         f"worker {taker.pid} to take 20 requests", poll_s=0.02)
            finally:
                os.kill(other.pid, signal.SIGCONT)
    except BaseException:
        r.delete(f"{fleet.prefix}:gate")  # the calls sent end, whatever failed
        raise


def test_a_frozen_worker_answers_every_request_once_when_it_thaws(fleet: Fleet) -> None:
    r = fleet.db.client
    results: dict[int, tuple[int, Any]] = {}
    frozen = fleet.workers[0]
    with ThreadPoolExecutor(40) as pool:
        # Given 40 requests in flight through the gateway, 20 held by each worker
        _hold(fleet, pool, "freeze", results)
        # When one worker is frozen (SIGSTOP) and the gate opens
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            r.delete(f"{fleet.prefix}:gate")
            wait_for(lambda: sum(1 for v in results.values() if v[0] == 200) >= 20, 5,
                     "the other worker's 20 answers")
            time.sleep(0.5)
            during = sorted(i for i, v in results.items() if v[0] == 200)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)  # thawed well within the visibility timeout
    counts = _counts(fleet, results)
    print(f"frozen worker: {counts}, answered while it was frozen: {len(during)}")
    # Then only the other worker's requests were answered while it was frozen
    assert during == list(range(20, 40))
    # And after it thaws every request is answered with its own input, each ran exactly once
    assert counts == {"sent": 40, "answered": 40, "lost": 0, "ran_twice": 0, "never_ran": 0}, results


def test_kill_9_of_a_worker_mid_stream_every_request_is_answered_once(fleet: Fleet) -> None:
    r = fleet.db.client
    results: dict[int, tuple[int, Any]] = {}
    victim = fleet.workers[0]
    try:
        with ThreadPoolExecutor(40) as pool:
            # Given 40 requests in flight through the gateway, 20 held by each worker
            _hold(fleet, pool, "kill", results)
            # When one is killed with SIGKILL (no acks, nothing given back) and the gate opens
            victim.process.kill()
            victim.process.wait()
            killed_at = time.monotonic()
            r.delete(f"{fleet.prefix}:gate")
            wait_for(lambda: sum(1 for v in results.values() if v[0] == 200) >= 20, 5,
                     "the survivor's 20 answers")
            by_survivor = sorted(i for i, v in results.items() if v[0] == 200)
        # (the pool's end waits for every call: the victim's come back after the visibility
        # timeout, taken again by the survivor)
        waited_s = time.monotonic() - killed_at
    finally:
        fleet.workers.remove(victim)
        victim.stop()
        fleet.workers.append(fleet.spawn(2).wait_ready())
    counts = _counts(fleet, results)
    print(f"kill -9 mid-stream: {counts}, answered at once by the survivor: {len(by_survivor)}, "
          f"the victim's after {waited_s:.1f} s")
    # Then the survivor answers its own at once, and the victim's once they are redelivered
    assert by_survivor == list(range(20, 40))
    assert counts == {"sent": 40, "answered": 40, "lost": 0, "ran_twice": 0, "never_ran": 0}, results


def test_redis_gone_means_not_ready_and_fast_503s_until_it_is_back(tmp_path: Path) -> None:
    port = free_port()
    server = RedisServer(tmp_path / "redis", port, appendonly=True).start()
    worker = gateway = None
    try:
        argv = [sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu", "--models",
                "identity", "--hostname", "redisgone@%h"]
        worker = WorkerProcess(argv, worker_env(server.url), tmp_path / "worker.log").wait_ready()
        gateway = start_gateway(server.url, tmp_path / "gateway.log", ASYNCINFER_CONNECT_TIMEOUT_S="0.5")
        assert _http(gateway.http_url, "POST", IDENTITY, _good())[0] == 200
        # When Redis stops
        server.stop()
        stopped = time.monotonic()
        # Then the gateway is not ready within a few seconds, and calls fail fast with 503
        wait_for(lambda: _http(gateway.http_url, "GET", "/v2/health/ready")[0] == 503, 10,
                 "ready to go 503")
        not_ready_s = time.monotonic() - stopped
        assert _http(gateway.http_url, "GET", "/v2/health/live")[0] == 200
        took = []
        for _ in range(3):
            started = time.monotonic()
            status, _, answer = _http(gateway.http_url, "POST", IDENTITY, _good())
            took.append(time.monotonic() - started)
            assert status == 503, answer
            assert "broker" in json.loads(answer)["error"].lower()
        assert max(took) < 5, took
        # When Redis is back on its port, Then the gateway is ready and serves again
        server = RedisServer(tmp_path / "redis", port, appendonly=True).start()
        back = time.monotonic()
        wait_for(lambda: _http(gateway.http_url, "GET", "/v2/health/ready")[0] == 200, 10,
                 "ready to come back")
        ready_s = time.monotonic() - back
        wait_for(lambda: _http(gateway.http_url, "POST", IDENTITY, _good(5.0), timeout_s=5)[0] == 200,
                 15, "an infer call to succeed again")
        serving_s = time.monotonic() - back
        status, _, answer = _http(gateway.http_url, "POST", IDENTITY, _good(5.0))
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [5.0, 6.0]
        print(f"Redis gone: not ready after {not_ready_s:.1f} s, infer 503 in "
              f"{', '.join(f'{t:.2f}' for t in took)} s; back: ready after {ready_s:.1f} s, "
              f"serving after {serving_s:.1f} s")
    finally:
        for proc in (gateway, worker):
            if proc is not None:
                proc.stop()
        server.stop()

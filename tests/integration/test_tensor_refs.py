"""Tensors by reference (wire/tensor_refs.py, asyncinfer/store): 200 MB in and 200 MB out through a
shared folder and through S3 (moto's server: an emulator of the S3 protocol, the one installable
here), byte for byte, with Redis' memory before, during and after, and the objects gone after their
expiry; a store that cannot be reached refuses the request, naming it, with nothing sent and
nothing half-written; references a worker must not follow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.errors import InvalidRequest, StoreUnavailable
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.local_fleet import MemoryPeak
from tests.support.processes import ROOT, WorkerProcess, start_gateway, start_worker, worker_env
from tests.support.s3_server import s3_server
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

#: Results and the store's objects live this long here (the sweep runs every 1.5 s then): long
#: enough for 200 MB to go through S3's emulator and back (~8 s alone; past 15 s once in a loaded
#: full-suite run, when the sweep took the input's folder before the output was listed), short
#: for the expiry's wait.
EXPIRES_S = "30"
ROWS = 50_000_000  # float32: 200 MB


@pytest.fixture(scope="module")
def store_db(redis_databases: RedisDatabases) -> Iterator[RedisDatabase]:
    with redis_databases.take("tensor refs") as db:
        yield db


@pytest.fixture(scope="module", params=["folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          store_db: RedisDatabase) -> Iterator[dict[str, Any]]:
    """A store, and a worker of ``identity`` on a database of its own that uses it."""
    if request.param == "folder":
        folder = tmp_path_factory.mktemp("tensors")
        with _store_worker(store_db, tmp_path_factory, str(folder), "") as worker:
            yield {"url": str(folder), "options": "", "worker": worker, "folder": folder}
    else:
        with s3_server("tensors") as options, \
                _store_worker(store_db, tmp_path_factory, "s3://tensors/fleet",
                              json.dumps(options)) as worker:
            yield {"url": "s3://tensors/fleet", "options": json.dumps(options), "worker": worker,
                   "s3": options}


class _store_worker:  # noqa: N801 - a context manager
    def __init__(self, db: RedisDatabase, tmp: pytest.TempPathFactory, url: str, options: str) -> None:
        self.args = (db.url, tmp.mktemp("worker") / "worker.log", "--device", "cpu", "--models",
                     "identity", "--hostname", "tensor-refs@%h")
        self.env = {"ASYNCINFER_TENSOR_STORE_URL": url, "ASYNCINFER_TENSOR_STORE_OPTIONS": options,
                    "ASYNCINFER_RESULT_EXPIRES_S": EXPIRES_S,
                    "ASYNCINFER_MAX_PAYLOAD_BYTES": str(4 * 2**20),
                    "ASYNCINFER_TENSOR_REF_BYTES": str(2**20)}

    def __enter__(self) -> WorkerProcess:
        self.worker = start_worker(*self.args, **self.env)
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()


def _client(db: RedisDatabase, store: dict[str, Any], **more: str) -> Client:
    os.environ.update(ASYNCINFER_TENSOR_STORE_URL=store["url"],
                      ASYNCINFER_TENSOR_STORE_OPTIONS=store["options"],
                      ASYNCINFER_RESULT_EXPIRES_S=EXPIRES_S, **more)
    try:
        return Client(broker_url=db.url)
    finally:
        for name in ("ASYNCINFER_TENSOR_STORE_URL", "ASYNCINFER_TENSOR_STORE_OPTIONS",
                     "ASYNCINFER_RESULT_EXPIRES_S", *more):
            os.environ.pop(name, None)


def _objects(store: dict[str, Any]) -> list[str]:
    if "folder" in store:
        return sorted(str(p.relative_to(store["folder"])) for p in store["folder"].rglob("*.bin"))
    import s3fs

    fs = s3fs.S3FileSystem(**store["s3"])
    fs.invalidate_cache()
    return sorted(fs.find("tensors/fleet"))


def test_200_mb_in_and_out_by_reference_byte_for_byte_with_redis_memory_flat(
        store: dict[str, Any], store_db: RedisDatabase) -> None:
    x = np.random.default_rng(7).standard_normal((1, ROWS)).astype(np.float32)
    with _client(store_db, store) as client:
        with MemoryPeak(store_db.client) as memory:
            response = client.infer("identity", {"input": x}, timeout_s=180)
        before, after = memory.before, memory.after
        output = response.outputs["input"]
        assert "data" not in output and output["parameters"]["data_ref"].endswith("/out-input.bin")
        y = response.as_numpy("input")
        assert y.dtype == np.float32 and y.shape == (1, ROWS) and y.tobytes() == x.tobytes()
        stored = _objects(store)
        request = response.id
        assert [s.rsplit("/", 2)[-2:] for s in stored] == [[request, "in-input.bin"],
                                                           [request, "out-input.bin"]], stored
        print(f"{store['url']}: Redis used_memory before {before:,}, peak during {memory.peak:,}, "
              f"after {after:,} bytes")
        assert memory.peak - before < 8 * 2**20 and after - before < 8 * 2**20  # not 400 MB
        # the objects expire with the result: a worker's sweep removes them
        wait_for(lambda: not _objects(store), int(EXPIRES_S) + 25, "the store's objects to expire")


def test_outputs_by_reference_when_asked_and_a_small_input_inline(
        store: dict[str, Any], store_db: RedisDatabase) -> None:
    with _client(store_db, store) as client:
        response = client.infer("identity", {"input": np.arange(6, dtype=np.int64).reshape(2, 3)},
                                parameters={"data_ref_outputs": True}, timeout_s=60)
        assert response.outputs["input"]["parameters"]["data_ref"].startswith(
            "file://" if "folder" in store else "s3://tensors/fleet/")
        assert response["input"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_caller_that_reads_no_store_gets_a_large_output_in_its_result(
        store: dict[str, Any], store_db: RedisDatabase) -> None:
    x = np.arange(600_000, dtype=np.float32).reshape(1, -1)  # 2.4 MB: over the worker's 1 MiB
    with Client(broker_url=store_db.url) as plain:  # no store: it could not read a reference
        answer = plain.infer("identity", {"input": x}, serializer="msgpack", timeout_s=60)
    assert "data" in answer.outputs["input"] and np.array_equal(answer["input"], x)
    with _client(store_db, store) as reading:  # a store: data_ref_accepted, so by reference
        answer = reading.infer("identity", {"input": x}, serializer="msgpack", timeout_s=60)
    assert "data_ref" in answer.outputs["input"]["parameters"] and np.array_equal(answer["input"], x)


def test_a_store_that_cannot_be_written_refuses_the_request_naming_it_with_nothing_sent(
        store: dict[str, Any], store_db: RedisDatabase, tmp_path: Path) -> None:
    if "folder" in store:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        broken = {**store, "url": str(blocker / "tensors")}  # under a file: cannot be made
    else:
        broken = {**store, "options": json.dumps({**store["s3"], "endpoint_url": "http://127.0.0.1:9"})}
    queued = store_db.client.llen("infer.identity")
    with _client(store_db, broken) as client:
        with pytest.raises(StoreUnavailable) as refused:
            client.submit("identity", {"input": np.ones((1, 3_000_000), np.float32)},
                          request_id="refs-unreachable")
        said = str(refused.value)
        assert said.startswith("request refs-unreachable: the tensor store ") and "'in-input'" in said
        assert broken["url"] in said
    assert store_db.client.llen("infer.identity") == queued
    assert not store_db.client.exists("asyncinfer:request:refs-unreachable")
    if "folder" in store:
        assert not (blocker / "tensors").exists()


def test_references_a_worker_must_not_follow_are_refused_naming_the_rule(
        store: dict[str, Any], store_db: RedisDatabase, worker: WorkerProcess, redis_url: str) -> None:
    def ref(url: str, shape: list[int] | None = None) -> list[dict[str, Any]]:
        return [{"name": "input", "datatype": "UINT8", "shape": shape or [1, 4],
                 "parameters": {"data_ref": url}}]

    with Client(broker_url=store_db.url) as client:
        scheme = "file://" if "folder" in store else ""
        for url, words in (("file:///etc/passwd", "is not in this fleet's tensor store"),
                           (f"{store['url']}/../outside.bin", "is not in this fleet's tensor store"),
                           (f"{scheme}{store['url']}/expires-1/x/in-input.bin", "no such object")):
            with pytest.raises(InvalidRequest, match=words):
                client.infer("identity", ref(url), timeout_s=60)
        assert client.infer("identity", {"input": np.ones((1, 2), np.float32)}, timeout_s=60)
    with Client(broker_url=redis_url) as plain:  # the session worker: no store
        with pytest.raises(InvalidRequest, match="passed by reference .*this worker has no tensor "
                                                 "store \\(ASYNCINFER_TENSOR_STORE_URL\\)"):
            plain.infer("identity", ref("file:///tmp/x.bin"), timeout_s=60)


def test_a_v2_caller_passes_a_reference_and_asks_for_outputs_by_reference_through_the_gateway(
        store: dict[str, Any], store_db: RedisDatabase, tmp_path: Path) -> None:
    import urllib.request

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from asyncinfer.store.tensor_store import TensorStore

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    fleet = TensorStore(store["url"], ttl_s=60, options=json.loads(store["options"] or "{}"))
    url = fleet.write("gateway-call", "in-input", x.tobytes())
    # the gateway needs no store: references pass through it (the workers' store is the fleet's)
    gateway = start_gateway(store_db.url, tmp_path / "gateway.log")
    try:
        body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 4],
                                       "parameters": {"data_ref": url}}],
                           "parameters": {"data_ref_outputs": True}}).encode()
        call = urllib.request.Request(f"http://{gateway.http_url}/v2/models/identity/infer",
                                      data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=60) as answer:
            (output,) = json.loads(answer.read())["outputs"]
        assert "data" not in output and output["shape"] == [3, 4]
        assert fleet.read(output["parameters"]["data_ref"], "test", 48) == x.tobytes()
        # gRPC: the input's parameter data_ref, no contents; the output's the same, no data
        request = service_pb2.ModelInferRequest(model_name="identity")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[3, 4])
        tensor.parameters["data_ref"].string_param = url
        request.parameters["data_ref_outputs"].bool_param = True
        with grpc.insecure_channel(gateway.grpc_url) as channel:
            reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        (grpc_output,) = reply.outputs
        ref = grpc_output.parameters["data_ref"].string_param
        assert ref and list(grpc_output.shape) == [3, 4] and reply.raw_output_contents[0] == b""
        assert fleet.read(ref, "test", 48) == x.tobytes()
        # a reference out of the store: refused at the worker, naming the rule, as a 400
        bad = body.replace(url.encode(), b"file:///etc/passwd")
        call = urllib.request.Request(f"http://{gateway.http_url}/v2/models/identity/infer",
                                      data=bad, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(call, timeout=60)
        assert refused.value.code == 400
        assert "is not in this fleet's tensor store" in json.loads(refused.value.read())["error"]
    finally:
        gateway.stop()


def test_a_job_reads_its_input_from_the_store_and_writes_its_output_straight_there(
        store: dict[str, Any], store_db: RedisDatabase) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncinfer.store.places import place_of

    options = json.loads(store["options"] or "{}")
    base = store["url"].rsplit("/", 1)[0] if "s3" in store else str(store["folder"].parent)
    source, output = place_of(f"{base}/jobs/rows.parquet", options), \
        place_of(f"{base}/jobs/answers.parquet", options)
    values = np.arange(3000 * 4, dtype=np.float32).reshape(3000, 4)
    source.fs.makedirs(source.path.rsplit("/", 1)[0], exist_ok=True)
    with source.open("wb") as stream:
        pq.write_table(pa.table({"n": np.arange(3000), "input": list(values)}), stream)
    with _client(store_db, store) as client:
        done = client.run_job("identity", source.url, output.url, job_id=f"to-store-{id(store)}",
                              part_rows=500, progress=False)
    assert (done.rows, done.failed, done.output) == (3000, 0, output.url)
    with output.open("rb") as stream:
        table = pq.read_table(stream)
    assert table.column("n").to_pylist() == list(range(3000))
    assert np.array_equal(np.asarray(table.column("input_output").to_pylist(), np.float32), values)
    assert not place_of(f"{base}/jobs/answers.parquet.parts", options).exists()
    # the command, its options given as a flag (no tensor store set for it)
    command = subprocess.run(
        [sys.executable, "-m", "asyncinfer", "job", "run", "identity", "--input", source.url,
         "--output", f"{base}/jobs/again.jsonl", "--storage-options", store["options"] or "{}"],
        capture_output=True, text=True, cwd=ROOT, env=worker_env(store_db.url), timeout=120)
    assert command.returncode == 0, command.stderr
    assert f"completed, 3,000 rows (0 failed) -> {base}/jobs/again.jsonl" in command.stdout
    with place_of(f"{base}/jobs/again.jsonl", options).open("rb") as stream:
        assert [json.loads(line)["n"] for line in stream] == list(range(3000))


def test_a_worker_whose_store_is_down_retries_then_fails_the_request_naming_it_and_serves_on(
        redis_databases: RedisDatabases, tmp_path: Path) -> None:
    down = json.dumps({"endpoint_url": "http://127.0.0.1:9", "key": "testing", "secret": "testing",
                       "config_kwargs": {"retries": {"max_attempts": 1}}})
    with redis_databases.take("tensor store down") as db:
        worker = start_worker(db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity", "--hostname", "store-down@%h",
                              ASYNCINFER_TENSOR_STORE_URL="s3://tensors/fleet",
                              ASYNCINFER_TENSOR_STORE_OPTIONS=down)
        try:
            with Client(broker_url=db.url) as client:
                url = "s3://tensors/fleet/expires-9999999999/r/in-input.bin"
                with pytest.raises(StoreUnavailable) as failed:
                    client.infer("identity", [{"name": "input", "datatype": "UINT8", "shape": [1, 4],
                                               "parameters": {"data_ref": url}}], timeout_s=60)
                said = str(failed.value)
                assert "the tensor store s3://tensors/fleet could not be read at " + url in said
                # transient: retried (Celery's retry options, 3 at the defaults) before it failed
                assert worker.log().count("after StoreUnavailable") == 3, worker.log()[-3000:]
                answer = client.infer("identity", {"input": np.ones((1, 2), np.float32)},
                                      timeout_s=60)
                assert answer["input"].tolist() == [[1.0, 1.0]]  # the worker serves on
        finally:
            worker.stop()


def test_a_bytes_tensor_by_reference_and_the_same_request_sent_again_under_its_id(
        store: dict[str, Any], store_db: RedisDatabase) -> None:
    texts = np.array([[b"\x00\xff" * 2_500_000, "ünïcode ".encode() * 400_000]], dtype=object)
    with _client(store_db, store) as client:
        first = client.infer("identity", {"input": texts}, request_id=f"bytes-{id(store)}",
                             timeout_s=120)
        assert "data_ref" in first.outputs["input"]["parameters"]  # 8.2 MB: over the threshold
        assert first["input"].tolist() == texts.tolist()
        # sent again under its ID (a job's row after a restart): a new copy of its input, the
        # same content: the same request, answered with its answer, not refused, not run again
        again = client.infer("identity", {"input": texts}, request_id=f"bytes-{id(store)}",
                             timeout_s=120)
        assert again.outputs["input"]["parameters"]["data_ref"] == \
            first.outputs["input"]["parameters"]["data_ref"]
        assert again["input"].tolist() == texts.tolist()

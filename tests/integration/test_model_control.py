"""Model control across the fleet (Triton's model repository extension), end to end: real Redis,
real worker processes, a real gateway process, Triton's own client.

After an unload, a model that another worker still hosts is served there; one that nobody hosts
any more stays known (the catalogue's retention) and its requests wait in its queue, as for a
fleet scaled to zero, until a worker loads it again (docs/operations.md).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.model_control import BIG_BYTES, rss_bytes
from tests.support.processes import (
    ROOT,
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    launch_gateway,
    launch_worker,
    ready_together,
    start_gateway,
    stop_together,
    worker_env,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

FACTORIES = TEST_FACTORIES + (",big=tests.support.model_control:Big,"
                              "affine@2=tests.support.model_control:make_affine_v2,"
                              "gated@2=tests.support.model_control:make_gated_v2")
HOST = socket.gethostname()


def _launch(url: str, tmp_path: Path, name: str, models: str, **env: str) -> WorkerProcess:
    """A worker named ``name`` hosting ``models``, not waited for (:func:`ready_together`)."""
    return launch_worker(url, tmp_path / f"{name}.log", "--device", "cpu", "--models", models,
                         "--hostname", f"{name}@%h", ASYNCINFER_MODEL_FACTORIES=FACTORIES,
                         **{FORWARD_MARKS_ENV: url}, **env)


def _worker(url: str, tmp_path: Path, name: str, models: str, **env: str) -> WorkerProcess:
    return _launch(url, tmp_path, name, models, **env).wait_ready()


def _client(url: str) -> Client:
    return Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": url,
                                                     "ASYNCINFER_MODEL_FACTORIES": FACTORIES}))


@pytest.fixture()
def fleet(redis_db, tmp_path) -> Iterator[tuple[WorkerProcess, GatewayProcess, Client]]:
    """One worker hosting identity (its model folder holds a file that is no model), a gateway."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "bad.pt").write_bytes(b"this is not a TorchScript archive")
    worker = _launch(redis_db.url, tmp_path, "a", "identity", ASYNCINFER_MODEL_DIR=str(models))
    gateway = launch_gateway(redis_db.url, tmp_path / "gateway.log",
                             "--model-control-mode", "explicit")
    ready_together([worker, gateway])  # started side by side; on a failure both stopped
    client = _client(redis_db.url)
    try:
        yield worker, gateway, client
    finally:
        client.close()
        stop_together([gateway, worker])


def _index(rows: list[dict[str, str]]) -> dict[str, tuple[str, str]]:
    """Each model's (state, reason): READY when one of its versions is (a loadable version of
    it, affine@2's row ``affine`` version 2, is listed beside)."""
    index: dict[str, tuple[str, str]] = {}
    for r in rows:
        if r["name"] not in index or r["state"] == "READY":
            index[r["name"]] = (r["state"], r.get("reason", ""))
    return index


def test_load_infer_unload_and_failed_loads_through_tritonclient(fleet) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    worker, gateway, client = fleet
    http = httpclient.InferenceServerClient(gateway.http_url, network_timeout=120.0)
    grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        # Given a worker hosting identity only: the index says what it could load
        index = _index(http.get_model_repository_index())
        assert index["identity"] == ("READY", "")
        assert index["affine"][0] == "UNAVAILABLE" and f"a@{HOST}" in index["affine"][1]
        assert not http.is_model_ready("affine")

        # When affine is loaded through Triton's client, Then it is ready and serves
        http.load_model("affine")
        assert http.is_model_ready("affine")
        assert _index(http.get_model_repository_index())["affine"] == ("READY", "")
        x = np.array([[1.0, 2.0, 3.0]], np.float64)
        inp = httpclient.InferInput("x", [1, 3], "FP64")
        inp.set_data_from_numpy(x)
        out = http.infer("affine", [inp]).as_numpy("y")
        assert out.tolist() == (x * 3 + 1).tolist()
        assert [h.worker for h in client.models()["affine"].hosts] == [f"a@{HOST}"]

        # A failed load answers with the reason and the worker serves on
        with pytest.raises(InferenceServerException, match="'nosuch' is not registered"):
            http.load_model("nosuch")
        with pytest.raises(InferenceServerException, match="'bad' failed to load on cpu"):
            http.load_model("bad")
        with pytest.raises(InferenceServerException, match="parameter 'config' is not supported"):
            http.load_model("affine", config='{"max_batch_size": 8}')
        assert http.infer("affine", [inp]).as_numpy("y").tolist() == (x * 3 + 1).tolist()
        assert client.infer("identity", np.ones((2, 2), np.float32), timeout_s=60)[
            "input"].tolist() == [[1, 1], [1, 1]]
        assert "bad" not in client.models()

        # Over gRPC: the index, an unload, a load again
        rows = {(m.name, m.version): m for m in grpc.get_model_repository_index().models}
        assert rows[("affine", "1")].state == "READY" and rows[("identity", "1")].state == "READY"
        assert rows[("affine", "2")].state == "UNAVAILABLE"  # affine@2: affine's version 2
        grpc.unload_model("affine")
        assert not grpc.is_model_ready("affine")
        rows = {(m.name, m.version): m for m in grpc.get_model_repository_index().models}
        assert rows[("affine", "1")].state == "UNAVAILABLE"
        assert "no live worker" in rows[("affine", "1")].reason
        ready = urllib.request.urlopen(urllib.request.Request(  # tritonclient sends no 'ready'
            f"http://{gateway.http_url}/v2/repository/index", data=b'{"ready": true}',
            method="POST"), timeout=30)
        assert [r["name"] for r in json.load(ready)] == ["identity"]
        with pytest.raises(InferenceServerException, match="no live worker hosts it"):
            grpc.unload_model("affine")
        grpc.load_model("affine")
        assert grpc.is_model_ready("affine")
        assert http.infer("affine", [inp]).as_numpy("y").tolist() == (x * 3 + 1).tolist()

        # and the command line: an unload, a load that fails with its reason
        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "asyncinfer", "models", *args], cwd=ROOT,
                                  env=worker_env(client.settings.resolved_broker_url()),
                                  capture_output=True, text=True, timeout=120)

        done = cli("unload", "affine", "--workers", f"a@{HOST}", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["workers"][0]["given_back"] == 0
        assert "affine" not in client.models() or not client.models()["affine"].ready
        failed = cli("load", "nosuch")
        assert failed.returncode == 1
        assert f"load failed for model 'nosuch': a@{HOST}: model 'nosuch' is not registered" in \
            failed.stderr
    finally:
        http.close()
        grpc.close()


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_an_unload_under_a_stream_of_requests_loses_none_and_runs_none_twice(
        redis_db, tmp_path) -> None:
    import tritonclient.http as httpclient

    # Given worker b hosting sleep, and worker a hosting identity only
    b = _launch(redis_db.url, tmp_path, "b", "sleep")
    a = _launch(redis_db.url, tmp_path, "a", "identity")
    gateway = launch_gateway(redis_db.url, tmp_path / "gateway.log", "--model-control-mode",
                             "explicit")
    ready_together([b, a, gateway])
    client = _client(redis_db.url)
    http = httpclient.InferenceServerClient(gateway.http_url, network_timeout=120.0)
    try:
        # When sleep is loaded through Triton's client (every live worker: a loads it, b has it)
        http.load_model("sleep")
        hosts = [h.worker for h in client.models()["sleep"].hosts]
        assert hosts == [f"a@{HOST}", f"b@{HOST}"]
        marks = ForwardMarks(redis_db.client, "sleep")
        # and 200 requests stream in (each a value of its own, ~100 ms of device per batch: some
        # wait in the batchers) while a unloads it
        values = [float(np.float32(0.1 + i / 2**16)) for i in range(200)]
        futures: list = []
        half = threading.Event()

        def stream() -> None:
            for i, v in enumerate(values):
                futures.append(client.submit("sleep", np.array([[v]], np.float32)))
                if i == 60:
                    half.set()
                threading.Event().wait(0.005)

        sender = threading.Thread(target=stream)
        sender.start()
        assert half.wait(60)
        answer = _post(gateway.http_url, "/v2/repository/models/sleep/unload",
                       {"parameters": {"workers": f"a@{HOST}"}})
        sender.join(60)
        assert answer["ok"] is True and [w["worker"] for w in answer["workers"]] == [f"a@{HOST}"]

        # Then every request is answered, with its own value, once
        results = [f.result(timeout=120) for f in futures]
        assert [r["output"].item() for r in results] == pytest.approx(values)
        ran = Counter(v for batch in marks.batches() for v in batch)
        assert sorted(ran) == sorted(values) and set(ran.values()) == {1}
        by_worker = Counter(r.raw["parameters"]["worker"] for r in results)
        assert by_worker[f"b@{HOST}"] > 0 and sum(by_worker.values()) == 200
        # and a hosts it no more: the catalogue and the index say so, b serves it
        assert [h.worker for h in client.models()["sleep"].hosts] == [f"b@{HOST}"]
        assert _index(http.get_model_repository_index())["sleep"] == ("READY", "")
        late = client.infer("sleep", np.array([[0.0]], np.float32), timeout_s=60)
        assert late.raw["parameters"]["worker"] == f"b@{HOST}"
        print(f"answered by {dict(by_worker)}; a gave back {answer['workers'][0]['given_back']}")
    finally:
        http.close()
        client.close()
        stop_together([gateway, a, b])


def test_an_unloaded_models_memory_is_given_back(redis_db, tmp_path) -> None:
    # Given a worker hosting identity, at its resident size
    worker = _worker(redis_db.url, tmp_path, "m", "identity")
    client = _client(redis_db.url)
    try:
        pid = client.models()["identity"].hosts[0].pid
        client.infer("identity", np.ones((1, 1), np.float32), timeout_s=60)
        baseline = rss_bytes(pid)
        # When a model holding 200 MB is loaded, it is resident and serves
        loaded = client.load_model("big", devices=["cpu"])
        assert loaded.ok, loaded.message()
        loaded_rss = rss_bytes(pid)
        assert loaded_rss - baseline > BIG_BYTES * 0.8
        assert client.infer("big", np.array([[1.0]], np.float32), timeout_s=60)[
            "output"].tolist() == [[2.0]]
        # Then once it is unloaded, the worker's resident size is back near where it was
        unloaded = client.unload_model("big")
        assert unloaded.ok, unloaded.message()
        after = rss_bytes(pid)
        print(f"RSS MiB: baseline {baseline / 2**20:.0f}, loaded {loaded_rss / 2**20:.0f}, "
              f"unloaded {after / 2**20:.0f}")
        assert after - baseline < BIG_BYTES * 0.25
        assert "big" not in [r["name"] for r in client.repository_index() if r["state"] == "READY"]
        # and it serves what it served
        assert client.infer("identity", np.ones((1, 1), np.float32), timeout_s=60)[
            "input"].tolist() == [[1.0]]
        # A worker that unloads its last model hosts nothing, and loads again on demand
        assert client.unload_model("identity").ok
        assert not client.models()["identity"].ready
        waiting = client.submit("identity", np.full((1, 1), 7.0, np.float32))
        again = client.load_model("identity", workers=[f"m@{HOST}"])
        assert again.ok, again.message()
        assert waiting.result(timeout=60)["input"].tolist() == [[7.0]]
    finally:
        client.close()
        worker.stop()


def test_an_unload_gives_back_what_waits_and_finishes_what_runs(redis_db, tmp_path) -> None:
    r = redis_db.client
    r.set("ga:gate", "closed")
    # Given worker a hosting gated, its device held by request 0 (gate closed), requests waiting
    # in its batcher; worker b hosting identity
    a = _launch(redis_db.url, tmp_path, "a", "gated", GATED_REDIS_URL=redis_db.url,
                GATED_PREFIX="ga")
    b = _launch(redis_db.url, tmp_path, "b", "identity", GATED_REDIS_URL=redis_db.url,
                GATED_PREFIX="gb")
    ready_together([a, b])
    client = _client(redis_db.url)
    try:
        futures = [client.submit("gated", {"index": np.array([[0.0]])})]
        wait_for(lambda: r.get("ga:blocked"), 60, "request 0 on a's device")
        futures += [client.submit("gated", {"index": np.array([[float(i)]])}) for i in range(1, 21)]
        # and a retry waiting for its eta (index 21)
        later = str(uuid.uuid4())
        client.app.send_task(TASK_NAME, queue="infer.gated", task_id=later, countdown=8, kwargs={
            "model": "gated", "inputs": [{"name": "index", "shape": [1, 1], "datatype": "FP64",
                                          "data": [21]}]})
        inspect = client.app.control.inspect(destination=[f"a@{HOST}"], timeout=2.0)
        wait_for(lambda: ((inspect.reserved() or {}).get(f"a@{HOST}") or []), 60,
                 "requests waiting in a's batcher")
        wait_for(lambda: ((inspect.scheduled() or {}).get(f"a@{HOST}") or []), 60,
                 "the retry held by a until its eta")

        # When a unloads it (waiting for request 0) and b loads it
        unloaded: list = []
        unloading = threading.Thread(target=lambda: unloaded.append(client.unload_model(
            "gated", workers=[f"a@{HOST}"], grace_s=120, timeout_s=180)))
        unloading.start()
        wait_for(lambda: [h.worker for h in client.models()["gated"].hosts] == [], 60,
                 "a left the catalogue")
        loaded = client.load_model("gated", workers=[f"b@{HOST}"])
        assert loaded.ok, loaded.message()

        # Then what waited on a is served by b, while request 0 still holds a's device
        given_back = wait_for(lambda: {int(k) for k in r.hgetall("gb:executions")}, 60,
                              "b runs what a gave back")
        assert 0 not in given_back and not r.hgetall("ga:executions")
        # and once a's device is free, request 0 (and what was prepared with it) ends there
        r.set("ga:gate", "open")
        unloading.join(180)
        outcome = unloaded[0]
        assert outcome.ok, outcome.message()
        assert outcome.answers[0].reply["given_back"] >= 1
        answers = [int(f.result(timeout=120)["output"].item()) for f in futures]
        assert answers == list(range(21))
        assert client.result(later, timeout_s=120)["output"].item() == 21
        ran = Counter({int(k): int(v) for k, v in r.hgetall("ga:executions").items()})
        ran.update({int(k): int(v) for k, v in r.hgetall("gb:executions").items()})
        assert sorted(ran) == list(range(22)) and set(ran.values()) == {1}
        assert 21 in {int(k) for k in r.hgetall("gb:executions")}
        assert 0 in {int(k) for k in r.hgetall("ga:executions")}
    finally:
        r.set("ga:gate", "open")
        client.close()
        stop_together([a, b])


def test_two_versions_side_by_side_routed_by_version(fleet) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    worker, gateway, client = fleet
    http = httpclient.InferenceServerClient(gateway.http_url, network_timeout=120.0)
    grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
    x = np.array([[1.0, 2.0, 3.0]], np.float64)

    def y(version: str = "", over_grpc: bool = False) -> list:
        lib = grpcclient if over_grpc else httpclient
        inp = lib.InferInput("x", [1, 3], "FP64")
        inp.set_data_from_numpy(x)
        result = (grpc if over_grpc else http).infer("affine", [inp], model_version=version)
        return result.as_numpy("y").tolist()

    try:
        # Given affine (version 1) and its version 2 loaded beside it
        assert client.load_model("affine").ok
        loaded = _post(gateway.http_url, "/v2/repository/models/affine/load",
                       {"parameters": {"version": "2"}})
        assert loaded["ok"] and loaded["workers"][0]["version"] == "2"
        rows = [(r["name"], r["version"], r["state"]) for r in http.get_model_repository_index()]
        assert ("affine", "1", "READY") in rows and ("affine", "2", "READY") in rows
        assert http.get_model_metadata("affine")["versions"] == ["1", "2"]
        # And `asyncinfer status` shows the one queue both versions take, infer.affine
        from asyncinfer.ops.status import cluster_status

        status = cluster_status(client.app, 5.0)
        assert any("affine@2" in w.models for w in status.workers)
        assert "affine" in status.queue_depths
        assert not [q for q in status.queue_depths if "@" in q], status.queue_depths
        # Then each version answers its own calls, and a call naming none gets the latest
        v1, v2 = (x * 3 + 1).tolist(), (x * 3 + 2).tolist()
        assert y("1") == v1 and y("2") == v2 and y() == v2
        assert y("1", over_grpc=True) == v1 and y("2", over_grpc=True) == v2
        assert client.infer("affine", {"x": x}, timeout_s=60, version=1)["y"].tolist() == v1
        with pytest.raises(InferenceServerException,
                           match="Request for unknown model: 'affine' version 3 is not found"):
            y("3")
        # When version 1 is unloaded, version 2 serves on, and version 1 is unavailable
        unloaded = client.unload_model("affine", version="1")
        assert unloaded.ok, unloaded.message()
        assert y() == v2 and y("2") == v2
        rows = {r["version"]: r["state"] for r in http.get_model_repository_index()
                if r["name"] == "affine"}
        assert rows == {"2": "READY"}
        with pytest.raises(InferenceServerException,
                           # the gateway's words, or the worker's (its catalogue entry may lag)
                           match="Request for unknown model: 'affine' version 1 is not found"):
            y("1")
        failed = client.load_model("affine", version="9")
        assert not failed.ok and "no version '9' registered" in failed.message()
        assert failed.message().startswith("load failed for model 'affine' (version '9'): ")
    finally:
        http.close()
        grpc.close()


def test_a_version_unloads_without_losing_a_request(redis_db, tmp_path) -> None:
    r = redis_db.client
    r.set("gv:gate", "closed")
    # Given a worker hosting gated (version 1, its gate closed) and gated version 2 (open)
    worker = _worker(redis_db.url, tmp_path, "a", "gated,gated@2", GATED_REDIS_URL=redis_db.url,
                     GATED_PREFIX="gv")
    client = _client(redis_db.url)
    try:
        assert client.models()["gated"].versions == ["1", "2"]
        # version 1 holds the device with request 0; requests 1-5 for version 1 wait for it
        pinned = [client.submit("gated", {"index": np.array([[0.0]])}, version=1)]
        wait_for(lambda: r.get("gv:blocked"), 60, "request 0 on the device")
        pinned += [client.submit("gated", {"index": np.array([[float(i)]])}, version=1)
                   for i in range(1, 6)]
        inspect = client.app.control.inspect(destination=[f"a@{HOST}"], timeout=2.0)
        wait_for(lambda: len((inspect.reserved() or {}).get(f"a@{HOST}") or []) >= 4, 60,
                 "version 1's requests waiting")
        # When version 1 is unloaded (it waits for its requests)
        unloaded: list = []
        unloading = threading.Thread(target=lambda: unloaded.append(client.unload_model(
            "gated", version="1", grace_s=120, timeout_s=180)))
        unloading.start()
        wait_for(lambda: client.models()["gated"].versions == ["2"], 60,
                 "version 1 left the catalogue")
        # Then requests naming no version run on version 2 meanwhile, and version 1 is refused
        latest = [client.submit("gated", {"index": np.array([[float(i)]])}) for i in range(6, 11)]
        assert [int(f.result(timeout=60)["output"].item()) for f in latest] == list(range(6, 11))
        assert {f.result(timeout=60).raw["parameters"]["model_version"] for f in latest} == {"2"}
        late = client.submit("gated", {"index": np.array([[11.0]])}, version=1)
        with pytest.raises(Exception, match="Request for unknown model: 'gated' version 1 is not found"):
            late.result(timeout=60)
        # and once its device is free, what version 1 had taken ends there, each request once
        r.set("gv:gate", "open")
        unloading.join(180)
        assert unloaded[0].ok, unloaded[0].message()
        answers = [f.result(timeout=60) for f in pinned]
        assert [int(a["output"].item()) for a in answers] == list(range(6))
        assert {a.raw["parameters"]["model_version"] for a in answers} == {"1"}
        assert {int(k): int(v) for k, v in r.hgetall("gv:executions").items()} == {
            i: 1 for i in range(6)}
        assert {int(k): int(v) for k, v in r.hgetall("gv-v2:executions").items()} == {
            i: 1 for i in range(6, 11)}
    finally:
        r.set("gv:gate", "open")
        client.close()
        worker.stop()


# -- the first control call, and model control only when allowed --------------------------------

def _status(url: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}{path}", data=body,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"body": raw.decode(errors="replace")}


def _starting_worker(url: str, tmp_path: Path) -> WorkerProcess:
    """``asyncinfer worker --models identity,mlp`` with its default hostname, not waited for: it
    is in the catalogue, its models ready, a few seconds before it listens to control."""
    return launch_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                         "identity,mlp", ASYNCINFER_MODEL_FACTORIES=FACTORIES)


def test_a_fresh_gateway_unloads_at_once_from_a_worker_it_just_saw(redis_db, tmp_path) -> None:
    # Given a fresh gateway that allows model control, and a worker starting behind it
    gateway = start_gateway(redis_db.url, tmp_path / "gateway.log",
                            "--model-control-mode", "explicit")
    worker = _starting_worker(redis_db.url, tmp_path)
    try:
        # When the gateway says mlp is ready (a client's cue), and it is unloaded at once: the
        # gateway's first control call
        wait_for(lambda: _status(gateway.http_url, "/v2/models/mlp/ready")[0] == 200, 90,
                 "mlp ready on the gateway", poll_s=0.02)
        listening = " ready." in worker.log()
        began = time.monotonic()
        status, answer = _status(gateway.http_url, "/v2/repository/models/mlp/unload", b"{}")
        took_s = time.monotonic() - began
        # Then it reaches the worker and is answered (not a 504 after the whole timeout)
        assert status == 200, answer
        assert answer["ok"] is True and [w["worker"] for w in answer["workers"]] == [f"cpu@{HOST}"]
        assert answer["workers"][0]["models"] == ["identity"]
        assert "model mlp unloaded (model control)" in worker.log()
        assert _status(gateway.http_url, "/v2/models/mlp/ready")[0] == 503
        # and the next call is answered too
        status, answer = _status(gateway.http_url, "/v2/repository/models/identity/unload",
                                 b"{}")
        assert status == 200 and answer["workers"][0]["models"] == []
        print(f"first unload answered in {took_s:.2f} s; the worker listened already: {listening}")
    finally:
        stop_together([gateway, worker])


def test_a_clients_first_call_unloads_from_a_worker_it_just_saw(redis_db, tmp_path) -> None:
    # Given a fresh client and a worker starting
    client = _client(redis_db.url)
    worker = _starting_worker(redis_db.url, tmp_path)
    try:
        # When the catalogue lists the worker hosting mlp, and the client's first control call
        # unloads it at once
        def hosted() -> list[str]:
            entry = client.models().get("mlp")
            return [h.worker for h in entry.hosts] if entry is not None else []

        assert wait_for(hosted, 90, "mlp in the catalogue", poll_s=0.02) == [f"cpu@{HOST}"]
        listening = " ready." in worker.log()
        outcome = client.unload_model("mlp", timeout_s=60)
        # Then the worker gets it and answers
        assert outcome.ok, outcome.message()
        assert [a.worker for a in outcome.answers] == [f"cpu@{HOST}"] and not outcome.missing
        assert outcome.answers[0].reply["models"] == ["identity"]
        assert hosted() == []
        assert client.load_model("mlp", workers=[f"cpu@{HOST}"]).ok
        print(f"the worker listened already: {listening}")
    finally:
        client.close()
        worker.stop()


def test_load_and_unload_are_refused_unless_the_gateway_allows_them(redis_db, tmp_path) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    triton = "explicit model load / unload is not allowed if polling is enabled: "
    how = "--model-control-mode explicit (or ASYNCINFER_MODEL_CONTROL_MODE=explicit"
    worker = _launch(redis_db.url, tmp_path, "a", "identity,mlp")
    # Given a gateway started without --model-control-mode (Triton's default, none), and another
    # whose operator allows model control through the setting (started beside it, used below)
    closed = launch_gateway(redis_db.url, tmp_path / "closed.log")
    opened = launch_gateway(redis_db.url, tmp_path / "opened.log",
                            ASYNCINFER_MODEL_CONTROL_MODE="explicit")
    ready_together([worker, closed, opened])
    http = httpclient.InferenceServerClient(closed.http_url, network_timeout=120.0)
    grpc = grpcclient.InferenceServerClient(closed.grpc_url)
    client = _client(redis_db.url)
    try:
        # When a load or an unload is asked over HTTP, Then 400 in Triton's words, saying how
        for action in ("load", "unload"):
            status, body = _status(closed.http_url, f"/v2/repository/models/mlp/{action}",
                                   b'{"parameters": {"workers": "nobody"}}')
            assert status == 400
            assert body["error"].startswith(triton) and how in body["error"]
            assert f"refuses a repository {action}" in body["error"]
        with pytest.raises(InferenceServerException) as refused:
            http.unload_model("mlp")
        assert refused.value.status() == "400" and refused.value.message().startswith(triton)
        # and over gRPC: UNAVAILABLE, Triton's code, with the same words
        for call in (grpc.load_model, grpc.unload_model):
            with pytest.raises(InferenceServerException) as refused:
                call("mlp")
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            assert refused.value.message().startswith(triton) and how in refused.value.message()
        # Then nothing was unloaded, and the index is still served, on both fronts
        assert [h.worker for h in client.models()["mlp"].hosts] == [f"a@{HOST}"]
        assert _index(http.get_model_repository_index())["mlp"] == ("READY", "")
        assert {m.name: m.state for m in grpc.get_model_repository_index().models}["mlp"] == \
            "READY"
        # When the other gateway is asked, whose operator allows it through the setting, Then it
        # serves them
        status, body = _status(opened.http_url, "/v2/repository/models/mlp/unload", b"{}")
        assert status == 200 and body["ok"] is True, body
        assert [h.worker for h in client.models()["mlp"].hosts] == []
    finally:
        http.close()
        grpc.close()
        client.close()
        stop_together([closed, opened, worker])

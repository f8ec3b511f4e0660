"""A fleet sharded by model over two real Redis servers with one routing table
(ASYNCINFER_BROKER_ROUTES): one worker per Redis, each picking its broker from the table; one
Client, one gateway and the CLI serving both. Parsing and validation: tests/unit/test_routes.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.supervision.supervisor import CANNOT_START
from asyncinfer.wire.keys import CATALOGUE_KNOWN_KEY, RESULT_KEY_PREFIX
from tests.support.processes import (
    ROOT,
    GatewayProcess,
    WorkerProcess,
    launch_worker,
    start_gateway,
    worker_env,
)

pytestmark = pytest.mark.timeout(180)

X = np.arange(16, dtype=np.float32).reshape(1, 16) / 16


class Fleet:
    """Two Redis servers: ``a`` the default broker (identity), ``b`` routed (mlp, by a glob)."""

    def __init__(self, a: RedisServer, b: RedisServer) -> None:
        self.a, self.b = a, b
        self.routes = f"ml*={b.url}"
        self.env = {"ASYNCINFER_BROKER_ROUTES": self.routes}

    def settings(self) -> Settings:
        return Settings.from_env({"ASYNCINFER_BROKER_URL": self.a.url, **self.env})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    a = RedisServer(tmp_path_factory.mktemp("redis-a"), appendonly=False).start()
    try:
        b = RedisServer(tmp_path_factory.mktemp("redis-b"), appendonly=False).start()
    except BaseException:
        a.stop()
        raise
    try:
        yield Fleet(a, b)
    finally:
        b.stop()
        a.stop()


@pytest.fixture(scope="module")
def workers(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """One worker per Redis, both given the default URL (a) and the table: mlp's takes b."""
    logs = tmp_path_factory.mktemp("route-workers")
    started = []
    try:
        for model in ("identity", "mlp"):
            started.append(launch_worker(fleet.a.url, logs / f"{model}.log", "--device", "cpu",
                                         "--models", model, "--concurrency", "4",
                                         "--hostname", f"route-{model}@%h", **fleet.env))
        for proc in started:
            proc.wait_ready()
        yield started
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="module")
def client(fleet: Fleet, workers: list[WorkerProcess]) -> Iterator[Client]:
    c = Client(settings=fleet.settings())
    try:
        yield c
    finally:
        c.close()


def _known(url: str) -> set[str]:
    r = redis.Redis.from_url(url)
    try:
        return {m.decode() for m in r.zrange(CATALOGUE_KNOWN_KEY, 0, -1)}
    finally:
        r.close()


def _results_on(url: str, *request_ids: str) -> list[bool]:
    r = redis.Redis.from_url(url)
    try:
        return [bool(r.exists(RESULT_KEY_PREFIX + i)) for i in request_ids]
    finally:
        r.close()


def test_each_worker_announces_its_models_on_its_own_redis(fleet: Fleet, workers: object) -> None:
    assert _known(fleet.a.url) == {"identity"}
    assert _known(fleet.b.url) == {"mlp"}


def test_one_client_sends_each_model_to_its_own_redis(fleet: Fleet, client: Client) -> None:
    on_a, on_b = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    same = client.infer("identity", {"x": X}, request_id=on_a, timeout_s=60)
    mlp = client.infer("mlp", X, request_id=on_b, timeout_s=60)
    assert same["x"].tobytes() == X.tobytes()
    assert mlp["output"].shape == (1, 4) and np.isfinite(mlp["output"]).all()
    # each request's result (the worker's write) is on its own Redis, and only there
    assert _results_on(fleet.a.url, on_a, on_b) == [True, False]
    assert _results_on(fleet.b.url, on_a, on_b) == [False, True]
    # by ID, on the model's broker
    assert client.result(on_b, timeout_s=10, model="mlp")["output"].tobytes() == \
        mlp["output"].tobytes()
    assert set(client.models()) == {"identity", "mlp"}
    assert client.models()["mlp"].ready and client.models()["identity"].ready
    assert set(client.apps()) == {fleet.a.url, fleet.b.url}


def test_asyncio_and_map_route_too(fleet: Fleet, client: Client) -> None:
    async def main() -> tuple[object, object]:
        return (await client.ainfer("mlp", X, timeout_s=60),
                await client.ainfer("identity", {"x": X}, timeout_s=60))

    mlp, same = asyncio.run(main())
    assert mlp["output"].shape == (1, 4)  # type: ignore[index]
    assert same["x"].tobytes() == X.tobytes()  # type: ignore[index]
    outputs = list(client.map("mlp", [X, X * 2], timeout_s=60))
    assert [o["output"].shape for o in outputs] == [(1, 4), (1, 4)]


def test_a_model_routed_to_a_redis_whose_fleet_never_announced_it_is_unknown(
        fleet: Fleet, client: Client) -> None:
    from asyncinfer.errors import UnknownModel

    with pytest.raises(UnknownModel) as caught:
        client.submit("mlx", X)  # routed to b (ml*), where only mlp is known
    assert "mlp" in str(caught.value)


def test_a_worker_with_models_on_two_redis_does_not_start(fleet: Fleet, tmp_path: Path) -> None:
    proc = launch_worker(fleet.a.url, tmp_path / "both.log", "--device", "cpu", "--models",
                         "identity,mlp", **fleet.env)
    try:
        assert proc.process.wait(timeout=90) == CANNOT_START
    finally:
        proc.stop()
    log = proc.log()
    assert "cannot start" in log
    assert f"identity on {fleet.a.url}" in log
    assert f"mlp on {fleet.b.url}" in log


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, workers: object, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    proc = start_gateway(fleet.a.url, tmp_path_factory.mktemp("route-gateway") / "gateway.log",
                         **fleet.env)
    try:
        yield proc
    finally:
        proc.stop()


def test_one_gateway_answers_models_on_two_redis(fleet: Fleet, gateway: GatewayProcess) -> None:
    http = httpclient.InferenceServerClient(gateway.http_url)
    try:
        assert http.is_server_ready()
        assert http.is_model_ready("identity") and http.is_model_ready("mlp")
        assert http.get_model_metadata("mlp")["outputs"][0]["name"] == "output"
        assert http.get_model_metadata("identity")["name"] == "identity"
        answers = {}
        for model, name in (("identity", "x"), ("mlp", "input")):
            tensor = httpclient.InferInput(name, [1, 16], "FP32")
            tensor.set_data_from_numpy(X)
            answers[model] = http.infer(model, [tensor], request_id=f"gw-{model}-{uuid.uuid4()}")
        assert answers["identity"].as_numpy("x").tobytes() == X.tobytes()
        assert answers["mlp"].as_numpy("output").shape == (1, 4)
        # the answers name their request IDs (the v2 id is a label)
        on_a = answers["identity"].get_response()["parameters"]["request_id"]
        on_b = answers["mlp"].get_response()["parameters"]["request_id"]
        assert _results_on(fleet.a.url, on_a, on_b) == [True, False]
        assert _results_on(fleet.b.url, on_a, on_b) == [False, True]
    finally:
        http.close()


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], capture_output=True,
                          text=True, timeout=90, cwd=ROOT, env=worker_env(fleet.a.url, **fleet.env))


def test_cli_status_and_models_cover_both_redis(fleet: Fleet, workers: object) -> None:
    out = _cli(fleet, "status", "--json", "--timeout-s", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert set(status) == {fleet.a.url, fleet.b.url}
    assert [w["models"] for w in status[fleet.a.url]["workers"]] == [["identity"]]
    assert [w["models"] for w in status[fleet.b.url]["workers"]] == [["mlp"]]
    assert "mlp" in status[fleet.b.url]["queue_depths"]
    assert "mlp" not in status[fleet.a.url]["queue_depths"]
    table = _cli(fleet, "status", "--timeout-s", "2")
    assert table.returncode == 0, table.stderr[-2000:]
    assert f"BROKER {fleet.a.url}" in table.stdout and f"BROKER {fleet.b.url}" in table.stdout
    models = _cli(fleet, "models", "--json")
    assert models.returncode == 0, models.stderr[-2000:]
    assert set(json.loads(models.stdout)) == {"identity", "mlp"}


def test_cli_config_shows_the_table_with_passwords_masked(fleet: Fleet) -> None:
    env = worker_env(fleet.a.url, ASYNCINFER_BROKER_ROUTES="bert-*=redis://:s3cret@c:6379/0")
    out = subprocess.run([sys.executable, "-m", "asyncinfer", "config"], capture_output=True,
                         text=True, timeout=90, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    [line] = [line for line in out.stdout.splitlines() if line.startswith("broker_routes")]
    assert "bert-*=redis://:**@c:6379/0" in line
    assert "s3cret" not in out.stdout


def test_cli_refuses_a_malformed_table_naming_the_entry(fleet: Fleet) -> None:
    env = worker_env(fleet.a.url, ASYNCINFER_BROKER_ROUTES=f"mlp={fleet.b.url};bert")
    out = subprocess.run([sys.executable, "-m", "asyncinfer", "models"], capture_output=True,
                         text=True, timeout=90, cwd=ROOT, env=env)
    assert out.returncode == 1
    assert "ASYNCINFER_BROKER_ROUTES entry 2 ('bert') has no '='" in out.stderr


def test_a_gateway_with_one_redis_down_serves_the_others_and_is_not_ready(
        fleet: Fleet, workers: object, tmp_path: Path) -> None:
    from asyncinfer.ops.redis_server import free_port

    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = start_gateway(fleet.a.url, tmp_path / "gateway.log",
                         ASYNCINFER_BROKER_ROUTES=f"{fleet.routes};nn-*={down}",
                         ASYNCINFER_CONNECT_TIMEOUT_S="1")
    http = httpclient.InferenceServerClient(proc.http_url)
    try:
        tensor = httpclient.InferInput("input", [1, 16], "FP32")
        tensor.set_data_from_numpy(X)
        assert http.infer("mlp", [tensor]).as_numpy("output").shape == (1, 4)
        assert http.is_model_ready("identity")
        assert not http.is_server_ready()  # every broker of the table must answer
    finally:
        http.close()
        proc.stop()

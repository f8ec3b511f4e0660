"""Fleet statistics through a real gateway: two real CPU workers of one model serve a known load,
and tritonclient's ``get_inference_statistics`` (HTTP and gRPC) and ``asyncinfer stats`` show the
counts summed over both, exactly, per batch size and per worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support.processes import ROOT, GatewayProcess, start_gateway, start_worker, worker_env

pytestmark = pytest.mark.timeout(180)

#: The load: requests of 1 row and of 3 rows.
ONE_ROW, THREE_ROWS = 24, 8
REQUESTS = ONE_ROW + THREE_ROWS
ROWS = ONE_ROW + 3 * THREE_ROWS


@dataclass
class Fleet:
    url: str
    gateway: GatewayProcess
    #: The worker each request's response named.
    served_by: list[str]


def _inputs(rows: int) -> list[httpclient.InferInput]:
    x = httpclient.InferInput("input", [rows, 16], "FP32")
    x.set_data_from_numpy(np.ones((rows, 16), np.float32))
    return [x]


@pytest.fixture(scope="module")
def fleet(redis_databases: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two workers of ``mlp`` (batches of up to 8, formed over 20 ms) behind a gateway, after the
    load: every request sent at once, so both workers take some and batches of several form."""
    logs = tmp_path_factory.mktemp("fleet-stats")
    with redis_databases.take("fleet statistics") as db:
        workers = [start_worker(db.url, logs / f"{name}.log", "--device", "cpu", "--models", "mlp",
                                "--hostname", f"{name}@%h", ASYNCINFER_MAX_BATCH_SIZE="8",
                                ASYNCINFER_MAX_DELAY_MS="20")
                   for name in ("stats-a", "stats-b")]
        gateway = start_gateway(db.url, logs / "gateway.log")
        try:
            http = httpclient.InferenceServerClient(gateway.http_url, concurrency=REQUESTS)
            try:
                pending = [http.async_infer("mlp", _inputs(1)) for _ in range(ONE_ROW)]
                pending += [http.async_infer("mlp", _inputs(3)) for _ in range(THREE_ROWS)]
                results = [p.get_result(timeout=60) for p in pending]
            finally:
                http.close()
            served_by = [r.get_response()["parameters"]["worker"] for r in results]
            yield Fleet(db.url, gateway, served_by)
        finally:
            gateway.stop()
            for w in workers:
                w.stop()


def _flushed(read: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """The model's statistics once every request's success is in (the workers flush every
    second), read with ``read()``."""
    deadline = time.monotonic() + timeout_s
    while True:
        (stats,) = read()["model_stats"]
        if int(stats["inference_stats"]["success"].get("count", 0)) >= REQUESTS:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"statistics never counted {REQUESTS} successes: {stats}")
        time.sleep(0.1)


def _check_counts(stats: dict[str, Any]) -> None:
    infer = stats["inference_stats"]
    assert stats["name"] == "mlp" and stats["version"] == "1"
    assert int(stats["inference_count"]) == ROWS
    assert int(infer["success"]["count"]) == REQUESTS
    assert int(infer.get("fail", {}).get("count", 0)) == 0
    assert int(infer["queue"]["count"]) == REQUESTS
    assert int(infer["compute_infer"]["count"]) == REQUESTS
    assert int(infer["success"]["ns"]) > 0 and int(infer["compute_infer"]["ns"]) > 0
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert sum(size * n for size, n in batches.items()) == ROWS
    assert sum(batches.values()) == int(stats["execution_count"])
    assert int(stats["last_inference"]) > 1_600_000_000_000


def test_http_statistics_sum_both_workers_exactly(fleet: Fleet) -> None:
    http = httpclient.InferenceServerClient(fleet.gateway.http_url)
    try:
        stats = _flushed(lambda: http.get_inference_statistics("mlp"))
        everyone = http.get_inference_statistics()
        one_version = http.get_inference_statistics("mlp", model_version="1")
    finally:
        http.close()
    _check_counts(stats)
    assert [s["name"] for s in everyone["model_stats"]] == ["mlp"]
    assert one_version["model_stats"][0]["inference_count"] == ROWS
    # What Triton cannot show: per worker (both served; their counts add up) and per device.
    workers = stats["asyncinfer"]["workers"]
    assert {w["worker"] for w in workers} == set(fleet.served_by)
    assert len(set(fleet.served_by)) == 2, f"one worker took everything: {fleet.served_by}"
    for w in workers:
        assert w["inference_stats"]["success"]["count"] == fleet.served_by.count(w["worker"])
    assert sum(w["inference_count"] for w in workers) == ROWS
    assert sum(w["execution_count"] for w in workers) == stats["execution_count"]
    (cpu,) = stats["asyncinfer"]["devices"]
    assert (cpu["device"], cpu["inference_count"]) == ("cpu", ROWS)
    # The wait in Redis: one per request, from its sent time to its take.
    assert stats["asyncinfer"]["redis_wait"]["count"] == REQUESTS


def test_grpc_statistics_are_the_same_counts(fleet: Fleet) -> None:
    grpc = grpcclient.InferenceServerClient(fleet.gateway.grpc_url)
    try:
        stats = _flushed(lambda: grpc.get_inference_statistics("mlp", as_json=True))
        message = grpc.get_inference_statistics("mlp").model_stats[0]
    finally:
        grpc.close()
    _check_counts(stats)
    assert (message.inference_count, message.inference_stats.success.count) == (ROWS, REQUESTS)
    assert sum(b.batch_size * b.compute_infer.count for b in message.batch_stats) == ROWS


def test_unknown_model_statistics_are_an_error(fleet: Fleet) -> None:
    http = httpclient.InferenceServerClient(fleet.gateway.http_url)
    try:
        with pytest.raises(Exception, match="nosuchmodel"):
            http.get_inference_statistics("nosuchmodel")
    finally:
        http.close()


def test_the_stats_command_names_the_model_and_its_counts(fleet: Fleet) -> None:
    env = worker_env(fleet.url)
    http = httpclient.InferenceServerClient(fleet.gateway.http_url)
    try:
        _flushed(lambda: http.get_inference_statistics("mlp"))
    finally:
        http.close()
    out = subprocess.run([sys.executable, "-m", "asyncinfer", "stats", "mlp", "--workers"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    model_line = next(line for line in lines if line.startswith("mlp "))
    assert model_line.split()[1:5] == [str(ROWS), model_line.split()[2], str(REQUESTS), "0"]
    for worker in set(fleet.served_by):
        line = next(line for line in lines if line.strip().startswith(worker))
        assert line.split()[4] == str(fleet.served_by.count(worker))  # after "worker (cpu)"
    as_json = subprocess.run([sys.executable, "-m", "asyncinfer", "stats", "--json"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    (stats,) = json.loads(as_json.stdout)["model_stats"]
    assert (stats["name"], stats["inference_count"]) == ("mlp", ROWS)
    missing = subprocess.run([sys.executable, "-m", "asyncinfer", "stats", "nosuchmodel"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "nosuchmodel" in missing.stderr

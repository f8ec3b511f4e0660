"""Sequence batching across a fleet, through tritonclient (HTTP and gRPC) and the ``Client``: two
real workers hosting the stateful ``accumulator`` (tests/support/sequence_models.py: a running sum
per sequence, its state the runner's; sequences idle 2 s are released), a gateway, a Redis
database of their own. A sequence's requests accumulate on one worker while another interleaves;
a request without START, or after the sequence's state was released, is refused with Triton's
words; a sequence whose worker is killed fails its next request with the state-lost error, and a
new sequence works on the survivor."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from asyncinfer.errors import SequenceNotStarted
from tests.support.databases import RedisDatabases
from tests.support.processes import (
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    launch_worker,
    start_gateway,
)
from tests.support.sequence_models import ACCUMULATOR_FACTORY, RELEASED_LOG_ENV
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

MODEL = "accumulator"
NOT_STARTED = "must specify the START flag on the first request of the sequence"


@dataclass
class Fleet:
    url: str
    workers: dict[str, WorkerProcess]  # by the name a response's ``worker`` parameter gives
    released: dict[str, Path]  # each worker's log of released sequences
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def fleet(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Fleet]:
    """Two workers hosting the accumulator (and identity), leases of 2 s, and a gateway."""
    folder = tmp_path_factory.mktemp("sequences")
    with redis_databases.take("sequence batching") as db:
        started: dict[str, WorkerProcess] = {}
        released: dict[str, Path] = {}
        gateway = None
        try:
            for name in ("seq-a", "seq-b"):  # started together, waited for together
                released[name] = folder / f"{name}.released"
                started[name] = launch_worker(
                    db.url, folder / f"{name}.log", "--device", "cpu", "--models",
                    f"{MODEL},identity", "--hostname", f"{name}@%h",
                    ASYNCINFER_MODEL_FACTORIES=f"{TEST_FACTORIES},{ACCUMULATOR_FACTORY}",
                    ASYNCINFER_LEASE_S="2", **{RELEASED_LOG_ENV: str(released[name])})
            for proc in started.values():
                proc.wait_ready()
            gateway = start_gateway(db.url, folder / "gateway.log")
            host = os.uname().nodename
            yield Fleet(db.url, {f"{n}@{host}": p for n, p in started.items()},
                        {f"{n}@{host}": path for n, path in released.items()}, gateway)
        finally:
            if gateway is not None:
                gateway.stop()
            for proc in started.values():
                proc.stop()


def _released(fleet: Fleet, worker: str) -> list[str]:
    path = fleet.released[worker]
    return path.read_text().split() if path.exists() else []


def http_step(client: httpclient.InferenceServerClient, sequence: int | str, value: int, *,
              start: bool = False, end: bool = False) -> tuple[int, str, list[int]]:
    """One request of ``sequence`` over HTTP: (the running sum, the worker, START/END/READY/CORRID
    as the model got them)."""
    x = httpclient.InferInput("INPUT", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[value]], np.int64))
    r = client.infer(MODEL, [x], sequence_id=sequence, sequence_start=start, sequence_end=end)
    return (int(r.as_numpy("SUM")[0, 0]), r.get_response()["parameters"]["worker"],
            r.as_numpy("FLAGS")[0].tolist())


def grpc_step(client: grpcclient.InferenceServerClient, sequence: int | str, value: int, *,
              start: bool = False, end: bool = False) -> tuple[int, str]:
    """One request of ``sequence`` over gRPC: (the running sum, the worker)."""
    x = grpcclient.InferInput("INPUT", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[value]], np.int64))
    r = client.infer(MODEL, [x], sequence_id=sequence, sequence_start=start, sequence_end=end)
    return int(r.as_numpy("SUM")[0, 0]), r.get_response().parameters["worker"].string_param


@pytest.fixture()
def http(fleet: Fleet) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(fleet.gateway.http_url, network_timeout=30)
    yield client
    client.close()


@pytest.fixture()
def grpc(fleet: Fleet) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(fleet.gateway.grpc_url)
    yield client
    client.close()


def test_ten_requests_accumulate_on_one_worker_while_another_sequence_interleaves(
        fleet: Fleet, http: httpclient.InferenceServerClient,
        grpc: grpcclient.InferenceServerClient) -> None:
    # Given an HTTP sequence (an integer ID) and a gRPC one (a string ID), sent at the same time
    http_id, grpc_id = 501, f"g-{uuid.uuid4().hex[:8]}"
    out: dict[str, list[Any]] = {"http": [], "grpc": []}
    failures: list[BaseException] = []

    def run_grpc() -> None:
        try:
            for i in range(1, 11):
                out["grpc"].append(grpc_step(grpc, grpc_id, 100 * i, start=i == 1, end=i == 10))
        except BaseException as exc:  # noqa: BLE001 - told below
            failures.append(exc)

    other = threading.Thread(target=run_grpc)
    other.start()
    # When each sends 10 requests, START on the first and END on the last
    for i in range(1, 11):
        out["http"].append(http_step(http, http_id, i, start=i == 1, end=i == 10))
    other.join(30)
    assert not failures, failures
    # Then each answer is its sequence's running sum, all of a sequence from one worker
    assert [s for s, _, _ in out["http"]] == [i * (i + 1) // 2 for i in range(1, 11)]
    assert [s for s, _ in out["grpc"]] == [100 * i * (i + 1) // 2 for i in range(1, 11)]
    http_workers = {w for _, w, _ in out["http"]}
    assert len(http_workers) == 1 and len({w for _, w in out["grpc"]}) == 1
    # and the model got the controls: START on the first, END and the CORRID on the last
    assert out["http"][0][2] == [1, 0, 1, http_id]
    assert out["http"][-1][2] == [0, 1, 1, http_id]
    # and an ended sequence's state is released on its worker
    worker = http_workers.pop()
    wait_for(lambda: str(http_id) in _released(fleet, worker), 10, "the END released the state")


def test_a_request_without_start_first_is_refused_with_tritons_words(
        fleet: Fleet, http: httpclient.InferenceServerClient,
        grpc: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match=NOT_STARTED) as e:
        http_step(http, 701, 1)
    assert "inference request for sequence 701 to model 'accumulator'" in str(e.value)
    with pytest.raises(InferenceServerException, match=NOT_STARTED):
        grpc_step(grpc, "never-started", 1)
    # after its END, a sequence's next request without START is refused too
    assert http_step(http, 702, 4, start=True, end=True)[0] == 4
    with pytest.raises(InferenceServerException, match=NOT_STARTED):
        http_step(http, 702, 1)


def test_a_stateless_model_refuses_a_sequence_by_name(
        fleet: Fleet, http: httpclient.InferenceServerClient) -> None:
    x = httpclient.InferInput("x", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[1]], np.int64))
    with pytest.raises(InferenceServerException, match="'identity' is not stateful"):
        http.infer("identity", [x], sequence_id=5, sequence_start=True)


def test_the_client_sends_sequences_too(fleet: Fleet) -> None:
    from asyncinfer.client import Client

    with Client(broker_url=fleet.url) as client:
        def step(value: int, **flags: Any) -> int:
            r = client.infer(MODEL, {"INPUT": np.array([[value]], np.int64)},
                             parameters={"sequence_id": "client-seq", **flags}, timeout_s=30)
            return int(r["SUM"][0, 0])

        assert [step(3, sequence_start=True), step(4), step(5, sequence_end=True)] == [3, 7, 12]
        with pytest.raises(SequenceNotStarted, match=NOT_STARTED):
            step(1)


def test_a_sequence_idle_past_its_timeout_has_its_state_released(
        fleet: Fleet, http: httpclient.InferenceServerClient) -> None:
    # Given a started sequence
    total, worker, _ = http_step(http, 601, 5, start=True)
    assert total == 5
    # When it is idle past the model's sequence timeout (2 s)
    time.sleep(2.5)
    # Then its worker released its state, and its next request is refused as not started
    wait_for(lambda: "601" in _released(fleet, worker), 10, "the idle sequence released")
    with pytest.raises(InferenceServerException, match=NOT_STARTED):
        http_step(http, 601, 1)
    # and a new START begins from zero
    assert http_step(http, 601, 7, start=True, end=True)[0] == 7


def test_a_sequence_whose_worker_is_killed_fails_saying_its_state_was_lost(
        fleet: Fleet, http: httpclient.InferenceServerClient,
        grpc: grpcclient.InferenceServerClient) -> None:
    # Given an HTTP sequence and a gRPC one pinned to the same worker
    first, victim_name, _ = http_step(http, 801, 1, start=True)
    assert first == 1
    grpc_id = ""
    for i in range(6):  # a START goes to the live worker holding the fewest, in turns
        candidate = f"k-{i}-{uuid.uuid4().hex[:6]}"
        if grpc_step(grpc, candidate, 10, start=True)[1] == victim_name:
            grpc_id = candidate
            break
    assert grpc_id, "no gRPC sequence landed on the worker to kill"
    victim = fleet.workers[victim_name]
    survivor = next(n for n in fleet.workers if n != victim_name)
    # When that worker is killed
    os.kill(victim.pid, signal.SIGKILL)
    victim.process.wait(10)
    # Then each sequence's next request (sent at once: the model's idle timeout is 2 s) fails,
    # saying its state was lost and where
    started = time.monotonic()
    errors: dict[str, str] = {}

    def next_grpc() -> None:
        try:
            grpc_step(grpc, grpc_id, 20)
        except InferenceServerException as exc:
            errors["grpc"] = str(exc)

    other = threading.Thread(target=next_grpc)
    other.start()
    with pytest.raises(InferenceServerException, match="state of sequence 801 of model "
                                                       "'accumulator' is lost") as e:
        http_step(http, 801, 2)
    other.join(30)
    assert f"its worker {victim_name.split('@')[0]}" in str(e.value)
    assert f"pid {victim.pid}" in str(e.value)
    assert f"state of sequence {grpc_id} of model 'accumulator' is lost" in errors.get("grpc", "")
    assert "FAILED_PRECONDITION" in errors["grpc"]
    assert time.monotonic() - started < 15  # the lease (2 s) and a sweep
    # and a new sequence works, on the survivor
    sums = [http_step(http, 802, v, start=v == 1, end=v == 3) for v in (1, 2, 3)]
    assert [s for s, _, _ in sums] == [1, 3, 6] and {w for _, w, _ in sums} == {survivor}

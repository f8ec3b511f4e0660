"""The worker's NPU path on a simulated ``npu`` device (tests/support/npu_sim): PyTorch's
PrivateUse1 backend renamed ``npu``, as torch_npu registers itself, with two devices, tensors whose
ops run on CPU, and events that complete only after a delay.

One ``asyncinfer worker --device npu:1`` (two instances per model) serves the module; the
simulation's log says what the device saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from asyncinfer.client import Client
from asyncinfer.models.builtin import MLP
from tests.support.databases import RedisDatabases
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.npu_sim.hook import read_log, sim_env, sim_worker
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(120)

OPTIONS = json.dumps({"*": {"instances": 2, "max_batch_size": 8, "max_delay_ms": 5}})
DEVICE_THREADS = {f"device-{m}-{i}" for m in ("identity", "mlp") for i in (0, 1)}


@pytest.fixture(scope="module")
def npu_worker(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Client, str, Path]]:
    folder = tmp_path_factory.mktemp("npu_sim")
    with redis_databases.take("test_npu_sim worker") as db, sim_worker(
            db.url, folder, "npu:1", "identity,mlp,poison", "npu-sim@%h", OPTIONS,
            **{FORWARD_MARKS_ENV: db.url}) as (client, _):
        yield client, db.url, folder


@pytest.fixture(scope="module")
def served(npu_worker: tuple[Client, str, Path]) -> dict[str, Any]:
    """Many requests at once for both models (so both instances of each get batches), their
    answers, and the simulation's log of serving them."""
    client, _, folder = npu_worker
    rng = np.random.default_rng(7)
    mlp_inputs = [rng.standard_normal((1 + i % 3, MLP.in_features)).astype(np.float32)
                  for i in range(48)]
    ident_inputs = [np.arange(4 * i, 4 * i + 4 * (1 + i % 2), dtype=np.float32).reshape(-1, 4)
                    for i in range(32)]
    mlp_futures: list[Future[Any]] = [client.submit("mlp", x) for x in mlp_inputs]
    ident_futures: list[Future[Any]] = [client.submit("identity", x) for x in ident_inputs]
    return {"mlp": (mlp_inputs, [f.result(timeout=60) for f in mlp_futures]),
            "identity": (ident_inputs, [f.result(timeout=60) for f in ident_futures]),
            "log": read_log(folder)}


def _of(log: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    return [e for e in log if e["what"] == what]


def test_mlp_on_the_npu_matches_cpu(served: dict[str, Any]) -> None:
    # Given: the same fixed-seed MLP on CPU
    net = MLP().net
    inputs, responses = served["mlp"]
    for x, response in zip(inputs, responses, strict=True):
        with torch.no_grad():
            expected = net(torch.from_numpy(x)).numpy()
        # Then: each request got its own rows, computed on the device, none mixed
        np.testing.assert_allclose(response.as_numpy(), expected, rtol=1e-5, atol=1e-6)
        assert response.parameters["device"] == "npu:1"
    assert max(r.parameters["batch_size"] for r in responses) > 1  # rows did share batches


def test_identity_on_the_npu_returns_each_request_its_rows(served: dict[str, Any]) -> None:
    inputs, responses = served["identity"]
    for x, response in zip(inputs, responses, strict=True):
        np.testing.assert_array_equal(response.as_numpy(), x)
        assert response.parameters["device"] == "npu:1"


def test_visible_device_is_set_before_the_first_device_call(served: dict[str, Any]) -> None:
    log = served["log"]
    # The first thing the device saw was its initialisation, with only device 1 visible
    assert log[0]["what"] == "init"
    assert log[0]["visible_var"] == "1" and log[0]["physical"] == [1]
    assert len(_of(log, "init")) == 1
    # Every copy ran on physical device 1, seen by the process as its npu:0
    copies = _of(log, "h2d") + _of(log, "d2h")
    assert copies and {e["physical"] for e in copies} == {1}
    assert {e["index"] for e in _of(log, "set_device")} == {0}


def test_every_thread_that_launches_work_set_its_device(served: dict[str, Any]) -> None:
    log = served["log"]
    assert _of(log, "unbound_launch") == []
    launching = {e["thread"] for e in log
                 if e["what"] in ("h2d", "d2h", "stream_new", "event_record", "event_sync")}
    bound = {e["thread"] for e in _of(log, "set_device")}
    assert DEVICE_THREADS <= launching <= bound
    # set_device came before the thread's first launch
    for thread in launching:
        first = next(i for i, e in enumerate(log) if e["thread"] == thread and e["what"] != "init")
        assert log[first]["what"] == "set_device", (thread, log[first])


def test_one_stream_per_instance(served: dict[str, Any]) -> None:
    log = served["log"]
    streams = {e["thread"]: e["stream"] for e in _of(log, "stream_new")
               if e["thread"] in DEVICE_THREADS}
    assert set(streams) == DEVICE_THREADS
    assert len(set(streams.values())) == len(DEVICE_THREADS)
    assert Counter(e["thread"] for e in _of(log, "stream_new")
                   if e["thread"] in DEVICE_THREADS) == Counter(DEVICE_THREADS)
    # Each instance copied on its own stream only, and both instances of each model worked
    for e in _of(log, "h2d") + _of(log, "d2h"):
        if e["thread"] in DEVICE_THREADS:
            assert e["stream"] == streams[e["thread"]]
    worked = {e["thread"] for e in _of(log, "d2h")}
    assert DEVICE_THREADS <= worked


def test_copies_are_pinned_non_blocking_and_completion_waits_on_the_event(
        served: dict[str, Any]) -> None:
    log = served["log"]
    batch_h2d = [e for e in _of(log, "h2d") if e["thread"] in DEVICE_THREADS]
    assert batch_h2d and all(e["pinned"] and e["non_blocking"] for e in batch_h2d)
    batch_d2h = [e for e in _of(log, "d2h") if e["thread"] in DEVICE_THREADS]
    assert batch_d2h and all(e["non_blocking"] and e["stream"] is not None for e in batch_d2h)
    # One event per batch, each waited on by blocking (never polled), in a bound thread (the
    # warm-up at load records and waits on its own, in the loading thread)
    records = _of(log, "event_record")
    waits = _of(log, "event_sync")
    assert len(records) == len(waits) > 0
    assert sum(e["writes"] for e in records if e["thread"] in DEVICE_THREADS) == len(batch_d2h)
    assert _of(log, "event_query") == [] and _of(log, "stream_sync") == []
    assert all(e["bound"] == 0 for e in waits)
    assert _of(log, "device_error") == []


def test_a_poisoned_request_fails_alone_on_the_npu(
        npu_worker: tuple[Client, str, Path]) -> None:
    client, url, folder = npu_worker
    # Given: both instances busy (a row >= 100 keeps the model on the device value - 100 s) ...
    marks = ForwardMarks(redis.Redis.from_url(url), "poison")
    blockers = []
    for v in (100.75, 100.5):  # one after the other: the second goes to the other instance
        blockers.append(client.submit("poison", np.array([[v]], np.float32)))
        marks.wait_on_device(v)
    # ... requests queue up and run as one batch, one of them poisoned (negative rows raise)
    values = [1.0, 2.0, -1.0, 3.0, 4.0, 5.0]
    futures = [client.submit("poison", np.array([[v]], np.float32)) for v in values]
    assert [b.result(timeout=60).as_numpy()[0, 0] for b in blockers] == [201.5, 201.0]
    # Then: the poisoned one fails with the model's error, the others get their own rows back
    for v, future in zip(values, futures, strict=True):
        if v < 0:
            with pytest.raises(Exception, match="negative input poisons this model"):
                future.result(timeout=60)
        else:
            np.testing.assert_array_equal(future.result(timeout=60).as_numpy(), [[2 * v]])
    # and the failed batch's requests, run one by one on a stream of their own, ran bound
    log = read_log(folder)
    assert _of(log, "unbound_launch") == [] and _of(log, "device_error") == []
    poison_streams = [e for e in _of(log, "stream_new") if e["thread"].startswith("device-poison-")]
    assert len(poison_streams) > 2  # the two instances' own, and one to run a failed batch alone
    poison_h2d = [e for e in _of(log, "h2d") if e["thread"].startswith("device-poison-")]
    assert all(e["bound"] == 0 and e["pinned"] and e["non_blocking"] for e in poison_h2d)
    assert sum(e["shape"][0] for e in poison_h2d) > len(values)  # some rows went twice


def test_the_simulation_has_two_devices_and_completes_late(tmp_path: Path) -> None:
    """Without a visible-device variable both simulated devices are there; per thread a current
    device; a non-blocking copy to the host lands only when its event completes."""
    env = worker_env("", **sim_env(tmp_path, ROOT, delay_ms=50))
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-m", "tests.support.npu_sim.selfcheck"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["accelerator"] == "npu" and seen["device_count"] == 2
    assert seen["thread_devices"] == {"main": 1, "other": 0}
    assert seen["before_wait"] == {"query": False, "all_nan": True}
    assert seen["after_wait"] == {"query": True, "correct": True}
    assert seen["physical"] == [0, 1]


def test_before_serving_mlp_was_warmed_up_on_the_device_at_each_batch_size(
        served: dict[str, Any]) -> None:
    # The loading thread copied mlp's weights, then one batch of each size up to max_batch_size
    # 8 of its declared input shape, before any device thread launched anything
    log = served["log"]
    loading = [e for e in _of(log, "h2d") if e["thread"] not in DEVICE_THREADS]
    warm = loading[-4:]
    assert [e["shape"] for e in warm] == [[n, MLP.in_features] for n in (1, 2, 4, 8)]
    assert len(loading) > 4  # the weights came first
    first_batch = next(i for i, e in enumerate(log) if e["thread"] in DEVICE_THREADS
                       and e["what"] == "h2d")
    assert all(log.index(e) < first_batch for e in warm)


def test_without_graph_batch_sizes_no_graph_is_captured_or_replayed(served: dict[str, Any]) -> None:
    # The option is off for every model of this worker: every batch ran the eager forward
    log = served["log"]
    assert _of(log, "graph_capture") == [] and _of(log, "graph_replay") == []
    assert len(_of(log, "d2h")) > 0

"""``graph_batch_sizes`` on the simulated ``npu`` (tests/support/npu_sim): one real worker process
captures its graphs at load and replays them, padded, for the batches it serves; the simulation's
log says what was captured, which graph each batch replayed and into what it was copied.

The simulated graph is a real one in what matters here: a replay runs the captured ops again on
the captured tensors, so a batch not copied into the graph's inputs, or outputs not cut to the
batch's rows, would show in the answers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.client import Client
from asyncinfer.models.builtin import MLP
from asyncinfer.supervision.supervisor import CANNOT_START
from tests.integration.test_failures_cli import asyncinfer, error_lines
from tests.support.databases import RedisDatabases
from tests.support.npu_sim.hook import read_log, sim_worker
from tests.support.processes import worker_env

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 4]
INSTANCES = 2
OPTIONS = json.dumps({"*": {"max_batch_size": 8, "max_delay_ms": 5},
                      "mlp": {"graph_batch_sizes": [4, 2, 1], "instances": INSTANCES},
                      "affine3": {"graph_batch_sizes": [4]}})
MLP_THREADS = {f"device-mlp-{i}" for i in range(INSTANCES)}
Log = list[dict[str, Any]]


@pytest.fixture(scope="module")
def graph_worker(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Client, Path, Any]]:
    folder = tmp_path_factory.mktemp("npu_graphs")
    with redis_databases.take("test_npu_graphs worker") as db, sim_worker(
            db.url, folder, "npu:0", "mlp,identity,affine3", "npu-graphs@%h", OPTIONS) as (client, proc):
        yield client, folder, proc


def _eager(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return MLP().net(torch.from_numpy(x)).numpy()


def _of(log: Log, what: str) -> Log:
    return [e for e in log if e["what"] == what]


def _captures(log: Log) -> dict[int, dict[str, Any]]:
    """Each graph → its capture, with ``size`` and ``input`` (storage) of its [size, 16] input."""
    graphs = {}
    for e in _of(log, "graph_capture"):
        inputs = [r for r in e["reads"] if r["shape"][1:] == [MLP.in_features]
                  and r["shape"][0] != MLP.hidden]  # the first layer's weight is [64, 16]
        if len(inputs) == 1:
            graphs[e["graph"]] = {**e, "size": inputs[0]["shape"][0],
                                  "input": inputs[0]["storage"]}
    return graphs


def _batches(log: Log, threads: set[str]) -> list[dict[str, Any]]:
    """Each batch the ``threads`` launched, in order: its rows copied in (h2d), into what, and
    the graph it replayed (None: eager)."""
    batches: list[dict[str, Any]] = []
    last: dict[str, dict[str, Any]] = {}
    for e in log:
        if e["thread"] not in threads:
            continue
        if e["what"] == "h2d":
            last[e["thread"]] = batch = {**e, "graph": None}
            batches.append(batch)
        elif e["what"] == "graph_replay":
            last[e["thread"]]["graph"] = e["graph"]
    return batches


def test_one_graph_per_size_per_instance_is_captured_at_load(graph_worker) -> None:
    _, folder, _ = graph_worker
    log = read_log(folder)
    graphs = _captures(log)
    # Then: mlp's graphs, one per size for each instance, were captured by the loading thread
    assert sorted(g["size"] for g in graphs.values()) == sorted(SIZES * INSTANCES)
    assert all(g["thread"] not in MLP_THREADS and g["bound"] == 0 for g in graphs.values())
    # largest first, each instance's graphs sharing one memory pool
    assert [g["size"] for g in graphs.values()] == sorted(SIZES, reverse=True) * INSTANCES
    pools = defaultdict(list)
    for g in graphs.values():
        pools[tuple(g["pool"])].append(g["size"])
    assert sorted(pools.values()) == [sorted(SIZES, reverse=True)] * INSTANCES
    # and no other model had a graph captured: identity has no option, affine3's capture failed
    assert len(_of(log, "graph_capture")) == len(graphs)
    failed = _of(log, "graph_capture_failed")
    assert len(failed) == 1 and "reading a device value on the host" in failed[0]["error"]
    first_batch = next(i for i, e in enumerate(log) if e["thread"] in MLP_THREADS)
    assert all(log.index(e) < first_batch for e in _of(log, "graph_capture"))


def test_each_batch_replays_the_smallest_graph_that_holds_it_and_gets_its_own_rows(
        graph_worker) -> None:
    client, folder, _ = graph_worker
    rng = np.random.default_rng(3)
    already = len(_batches(read_log(folder), MLP_THREADS))
    # Given: requests sent one at a time, so each is a batch of its own rows
    rows = [3, 1, 4, 2, 5, 8]
    for n in rows:
        x = rng.standard_normal((n, MLP.in_features)).astype(np.float32)
        response = client.infer("mlp", x, timeout_s=60)
        # Then: exactly its rows came back, as the eager model computes them
        assert response.as_numpy().shape == (n, MLP.out_features)
        np.testing.assert_allclose(response.as_numpy(), _eager(x), rtol=1e-5, atol=1e-6)
        assert response.parameters["batch_size"] == n
    log = read_log(folder)
    graphs = _captures(log)
    batches = _batches(log, MLP_THREADS)[already:]
    assert [b["shape"][0] for b in batches] == rows
    # each batch of at most 4 rows replayed the smallest graph that holds it, its rows copied into
    # that graph's input, the rest of it padding; 5 and 8 rows ran eager, into a tensor of their own
    replayed = [graphs[b["graph"]]["size"] if b["graph"] else None for b in batches]
    assert replayed == [4, 1, 4, 2, None, None]
    for b in batches:
        if b["graph"] is not None:
            assert b["dst_storage"] == graphs[b["graph"]]["input"]
            assert b["dst_rows"] == graphs[b["graph"]]["size"]  # 4 - 3 = 1 padding row for 3
        else:
            assert b["dst_storage"] not in {g["input"] for g in graphs.values()}
            assert b["dst_rows"] == b["shape"][0]
        assert b["pinned"] and b["non_blocking"] and b["bound"] == 0


def test_requests_at_once_are_answered_as_eager_for_every_row(graph_worker) -> None:
    client, folder, _ = graph_worker
    rng = np.random.default_rng(11)
    already = len(_batches(read_log(folder), MLP_THREADS))
    # Given: pairs of one-row requests (each pair fits a graph, whichever instance takes it),
    # then 48 requests of 1-3 rows at once (batches of every size up to 8)
    pairs = [[rng.standard_normal((1, MLP.in_features)).astype(np.float32) for _ in range(2)]
             for _ in range(8)]
    burst = [rng.standard_normal((1 + i % 3, MLP.in_features)).astype(np.float32)
             for i in range(48)]
    inputs: list[np.ndarray] = []
    for group in [*pairs, burst]:
        futures: list[Future[Any]] = [client.submit("mlp", x) for x in group]
        for x, future in zip(group, futures, strict=True):
            response = future.result(timeout=60)
            np.testing.assert_allclose(response.as_numpy(), _eager(x), rtol=1e-5, atol=1e-6)
        inputs += group
    log = read_log(folder)
    graphs = _captures(log)
    batches = _batches(log, MLP_THREADS)[already:]
    assert sum(b["shape"][0] for b in batches) == sum(len(x) for x in inputs)
    for b in batches:  # the smallest size that holds the batch, or eager above the largest
        n = b["shape"][0]
        want = min((s for s in SIZES if s >= n), default=None)
        assert (graphs[b["graph"]]["size"] if b["graph"] else None) == want, b
    assert any(b["graph"] for b in batches) and max(b["shape"][0] for b in batches) > 1
    # each graph replayed by one device thread only (its buffers are that instance's), never
    # two at once, always with the thread's device set
    threads = defaultdict(set)
    for e in _of(log, "graph_replay"):
        threads[e["graph"]].add(e["thread"])
    assert threads and all(len(t) == 1 and t <= MLP_THREADS for t in threads.values())
    assert _of(log, "graph_replay_overlap") == [] and _of(log, "unbound_launch") == []
    assert _of(log, "device_error") == []


def test_models_without_graphs_run_eager(graph_worker) -> None:
    client, folder, proc = graph_worker
    x = np.arange(6, dtype=np.float32).reshape(-1, 1)
    np.testing.assert_array_equal(client.infer("identity", x, timeout_s=60).as_numpy(), x)
    # affine3's forward reads a device value on the host (a check of its input), which no graph
    # can hold: its capture failed, the worker said so in one line, and it serves eager
    np.testing.assert_allclose(client.infer("affine3", x, timeout_s=60).as_numpy(),
                               (x + 1) * 10 - 1)
    warned = [line for line in proc.log().splitlines() if "model affine3: graph capture" in line]
    assert len(warned) == 1 and warned[0].endswith("; running eager")
    assert "reading a device value on the host is not allowed while a graph is captured" in warned[0]
    log = read_log(folder)
    eager = ("device-identity-", "device-affine3-")
    others = {e["thread"] for e in log if str(e["thread"]).startswith(eager)}
    assert others  # they ran on the device...
    assert not [e for e in _of(log, "graph_replay") if e["thread"] in others]  # ...eager


def test_a_model_whose_inputs_vary_in_shape_is_refused_at_load(redis_db) -> None:
    # identity takes any input, so no graph can hold it: the worker does not start, and says why
    env = worker_env(redis_db.url, ASYNCINFER_MODEL_OPTIONS=json.dumps(
        {"identity": {"graph_batch_sizes": [2]}}))
    out = asyncinfer(env, "worker", "--device", "cpu", "--models", "identity")
    assert out.returncode == CANNOT_START
    assert error_lines(out)[-1] == (
        "asyncinfer worker: cannot start: loading identity failed: NotGraphable: model "
        "'identity': graph_batch_sizes needs a forward whose inputs are declared with a fixed "
        "row shape and a numeric datatype (one graph per batch size holds fixed shapes); it "
        "declares no inputs")

"""Celery's remote inspection sees a fast-consumer worker's queues, concurrency and totals."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from tests.support.processes import WORKER_MODELS

pytestmark = pytest.mark.timeout(60)


def test_inspect_shows_the_fast_consumers_queues_concurrency_and_totals(client, worker) -> None:
    node = f"test-cpu@{socket.gethostname()}"
    inspect = client.app.control.inspect(destination=[node], timeout=5)
    before = (inspect.stats() or {})[node]["total"].get("asyncinfer.infer", 0)
    # Given 12 requests the worker has answered
    futures = [client.submit("identity", {"x": np.full((1, 1), float(i), np.float32)}) for i in range(12)]
    assert [f.result(timeout=30)["x"].item() for f in futures] == [float(i) for i in range(12)]
    # Then active_queues lists every infer.* queue it serves, beside Celery's control queue
    queues = {q["name"] for q in inspect.active_queues()[node]}
    assert queues >= {f"infer.{m}" for m in WORKER_MODELS.split(",")} | {"asyncinfer.control"}
    # And stats counts the requests it ran and reports its in-flight bound as its concurrency
    stats = inspect.stats()[node]
    assert stats["total"]["asyncinfer.infer"] - before >= 12
    assert stats["pool"]["max-concurrency"] == 16 * 2  # --concurrency 16 × prefetch multiplier 2

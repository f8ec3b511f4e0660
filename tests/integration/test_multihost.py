"""Several workers on different hosts share one queue: each takes work, every response is right.

Two worker processes with their own node names (``a@hostA``, ``b@hostB``) stand in for two hosts;
they use a Redis database of their own, so the session worker does not take their requests.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.support.databases import RedisDatabase
from tests.support.processes import start_worker

pytestmark = pytest.mark.timeout(240)

REQUESTS = 200


def test_two_hosts_share_one_queue(redis_db: RedisDatabase, tmp_path) -> None:
    from asyncinfer.client import Client

    # Given two workers on "different hosts" consuming the same infer.sleep queue
    url = redis_db.url
    workers = []
    try:
        for node in ("a@hostA", "b@hostB"):
            workers.append(start_worker(url, tmp_path / f"{node}.log", "--device", "cpu",
                                        "--models", "sleep", "--concurrency", "8",
                                        "--hostname", node,
                                        ASYNCINFER_MODEL_OPTIONS='{"sleep": {"max_batch_size": 4}}'))
        # When 200 requests that each take a little device time are sent at once
        with Client(broker_url=url) as client:
            values = [0.001 * (i % 10) + 0.005 for i in range(REQUESTS)]
            futures = [client.submit("sleep", np.array([[v]], np.float32)) for v in values]
            responses = [f.result(timeout=120) for f in futures]
        # Then every response carries its own value, and both hosts served some of them
        assert [r["output"].tolist() for r in responses] == \
            [[[np.float32(v).item()]] for v in values]
        served = Counter(r.parameters["worker"] for r in responses)
        assert set(served) == {"a@hostA", "b@hostB"}
        assert all(n > 0 for n in served.values()) and sum(served.values()) == REQUESTS
    finally:
        for proc in workers:
            proc.stop()

"""A request that kills its worker, on Celery's stock consumer (``ASYNCINFER_CONSUMER=celery``)
at the shipped defaults: the project's kombu channel leases what it takes and reads each
redelivered request's deaths (broker/atomic_take.py), and the pipeline marks each batch on the
device in those leases (worker/consumers/kombu_intake.py), so the killer is isolated and fails
with ``WorkerLost`` as on the fast consumer, and every good request is answered."""

from __future__ import annotations

import json
import time

import pytest

from asyncinfer.errors import WorkerLost
from asyncinfer.wire.keys import DEATHS_PREFIX
from tests.support.crashy import (
    burst_with_killer,
    crashy_batches,
    crashy_env,
    crashy_starts,
    crashy_under_up,
    report_counts,
)


@pytest.mark.timeout(240)
def test_a_killer_on_the_stock_consumer_is_isolated_and_fails_with_worker_lost(
        redis_db, tmp_path) -> None:
    # Given `asyncinfer up` with one worker on Celery's consumer, batches of 8
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "stock-killer", 0.1)
    env["ASYNCINFER_CONSUMER"] = "celery"
    env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"max_batch_size": 8}})
    with crashy_under_up(url, env, tmp_path) as (client, _):
        # When 16 good requests and one that kills its worker (-1) are sent in one burst
        good, killer = burst_with_killer(client, 8, 8)
        sent_at = time.monotonic()
        # Then every good one is answered with its own value
        answers = [f.result(timeout=180) for f in good]
        last_s = time.monotonic() - sent_at
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(16)]
        # And the killer fails for good after three deaths (its batch, the batch's rerun as
        # suspects, then alone), each counted on Redis
        with pytest.raises(WorkerLost, match="died 3 times"):
            killer.result(timeout=180)
        assert r.get(DEATHS_PREFIX + killer.id) == b"3"
        starts = crashy_starts(r, prefix)
        killer_batches = [sorted(b) for b in crashy_batches(r, prefix) if -1 in b]
        assert len(killer_batches) == 3 and killer_batches[2] == [-1], killer_batches
        assert killer_batches[1] == killer_batches[0]
        assert starts[-1] == 3 and all(starts[i] <= 3 for i in range(16)), starts
        report_counts("a request that kills its worker, among 16 (stock consumer, up)", 17,
                      len(answers) + 1, starts, last_s)

"""A host lost under a full device batch, and a killer among a full batch, at the shipped
defaults (lease 10 s, ``ASYNCINFER_MAX_WORKER_DEATHS`` 3).

Most deaths are the host's, not a request's: the requests that were on a lost worker's device
come back as suspects (one death each) and run again together, in a batch of suspects only, so
the survivor pays about one batch time for the loss, not one per row (policy/deaths.py). A real
killer among them kills the rerun too; after that second death each runs alone, and the killer
fails with ``WorkerLost`` at its third while every good request is answered.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from asyncinfer.config.settings import Settings
from asyncinfer.errors import WorkerLost
from asyncinfer.ops.status import cluster_status
from tests.support.crashy import (
    crashy_batches,
    crashy_env,
    crashy_index,
    crashy_starts,
    crashy_under_up,
    report_counts,
    two_crashy_workers,
)
from tests.support.processes import stop_together
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(("rows", "kernel_s"), [(8, 4.0), (32, 1.0)],
                         ids=["8-rows-on-a-4s-kernel", "32-rows-on-a-1s-kernel"])
def test_a_host_lost_under_a_full_batch_costs_the_survivor_one_batch_time(
        redis_db, tmp_path, rows: int, kernel_s: float) -> None:
    from asyncinfer.client import Client

    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "host-lost", kernel_s)
    env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"max_batch_size": rows}})
    first, second = two_crashy_workers(url, url, tmp_path, env, env)
    client = Client(broker_url=url)
    try:
        # Given a full batch of `rows` on the first worker's device and a second worker idle
        # (both frozen while the requests are sent, so that the first takes them in one batch)
        for worker in (first, second):
            os.kill(worker.pid, signal.SIGSTOP)
        futures = [client.submit("crashy", crashy_index(i)) for i in range(rows)]
        for f in futures:
            f.sent()
        os.kill(first.pid, signal.SIGCONT)
        wait_for(lambda: crashy_batches(r, prefix), 30, "a batch on the first worker's device")
        os.kill(second.pid, signal.SIGCONT)
        assert sorted(crashy_batches(r, prefix)[0]) == list(range(rows))
        # When its host is lost (kill -9) while the batch runs
        struck = time.monotonic()
        first.process.kill()
        first.process.wait()
        # Then the survivor answers every one, each with its own value
        answers = [f.result(timeout=90) for f in futures]
        last_s = time.monotonic() - struck
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(rows)]
        assert {a.parameters["worker"].split("@")[0] for a in answers} == {"second"}
        # And it ran the lost batch again once, whole (one batch of the suspects), not row by row
        assert [sorted(b) for b in crashy_batches(r, prefix)[1:]] == [list(range(rows))]
        assert crashy_starts(r, prefix) == {i: 2 for i in range(rows)}
        lease_s = Settings().lease_s
        report_counts(f"host lost under a batch of {rows} on a {kernel_s:g} s kernel", rows,
                      len(answers), crashy_starts(r, prefix), last_s)
        print(f"(goal: the lease {lease_s:g} s + 2 batch times = {lease_s + 2 * kernel_s:g} s; "
              f"row by row it was {lease_s + rows * kernel_s:g} s)")
        assert last_s < lease_s + 2 * kernel_s + 10  # far below row by row for either
    finally:
        client.close()
        stop_together([first, second])


def test_a_killer_among_a_full_batch_of_32_is_isolated_and_every_good_one_answered(
        redis_db, tmp_path) -> None:
    # Given `asyncinfer up` with one worker (restarted when it dies), batches of 32, and a batch
    # of 31 good requests and one that kills its worker (-1), taken in one batch
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "killer-32", 0.05)
    env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"max_batch_size": 32}})
    with crashy_under_up(url, env, tmp_path) as (client, seen):
        worker = seen[0]  # the one worker up has seen; a second ping may miss its reply under load
        os.kill(worker, signal.SIGSTOP)
        try:
            good = [client.submit("crashy", crashy_index(i)) for i in range(16)]
            killer = client.submit("crashy", crashy_index(-1))
            good += [client.submit("crashy", crashy_index(i)) for i in range(16, 31)]
            for f in [*good, killer]:
                f.sent()
        finally:
            os.kill(worker, signal.SIGCONT)
        sent_at = time.monotonic()
        # Then every good one is answered with its own value
        answers = [f.result(timeout=180) for f in good]
        last_s = time.monotonic() - sent_at
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(31)]
        # And the killer fails for good after three deaths: its batch, the batch's rerun (the
        # suspects together), then alone
        with pytest.raises(WorkerLost, match="died 3 times"):
            killer.result(timeout=120)
        batches = crashy_batches(r, prefix)
        killer_batches = [sorted(b) for b in batches if -1 in b]
        assert killer_batches == [sorted([-1, *range(31)])] * 2 + [[-1]], batches
        # And each good one ran three times at most: twice with the killer, then once alone
        starts = crashy_starts(r, prefix)
        assert starts[-1] == 3 and all(starts[i] == 3 for i in range(31)), starts
        assert sum(1 for b in batches if len(b) == 1 and b != [-1]) == 31
        seen += [w.pid for w in cluster_status(client.app, 0.5).workers]
        report_counts("a killer among a batch of 32 (asyncinfer up)", 32, len(answers) + 1, starts,
                      last_s)
